"""The contract's core and optional protocols (recgnn/embeddings/protocols.py): every built-in
backend implements the protocols it declares, one that declares a protocol without its
methods is refused naming them, and docs/architecture.md's table states them as the code
does (the methods of each protocol, and who implements it)."""

from __future__ import annotations

import os
import re

import pytest

from recgnn import planner, sharding
from recgnn.backends import dense
from recgnn.embeddings import base, protocols, registry
from recgnn.embeddings.group import TableGroup

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPEC = base.TableSpec(
  name="t", num_rows=1000, dim=8, optimizer=base.OptimizerSpec(name="rowwise_adagrad")
)


def _docs_table() -> dict[str, tuple[tuple[str, ...], list[str]]]:
  """{protocol: (methods, backend strings of its "who implements")} of the docs' table."""
  with open(os.path.join(ROOT, "docs", "architecture.md")) as f:
    text = f.read()
  out = {}
  for line in text.splitlines():
    m = re.fullmatch(r"\| `(\w+)` \| ([\w, ]+) \| (.*) \|", line)
    if m:
      who = re.findall(r"`([^`]+)`", m.group(3).split(": declared")[0])
      out[m.group(1)] = (tuple(x.strip() for x in m.group(2).split(",")), who)
  return out


def test_docs_table_states_each_protocols_methods():
  table = _docs_table()
  assert list(table) == [name for name, _ in protocols.table()]
  for name, methods in protocols.table():
    assert table[name][0] == methods, name


def test_who_implements_declares_and_implements_it(tmp_path):
  """Each built-in backend string the docs' table names for a protocol declares it (its
  group, built on a 2x4 mesh) and leaves none of its methods to the default."""
  mesh = sharding.make_mesh(2, 4)
  by_name = {p.__name__: p for p in protocols.OPTIONAL}
  checked = 0
  for name, (_, who) in _docs_table().items():
    for text in who:
      if planner.parse_backend(text)[0] not in planner.available_backends():
        continue  # (a backend of the tests' own files: tests/test_int8_backend.py)
      text = text.replace("DIR", str(tmp_path))
      if name == "AutoCandidates":  # (declared on the class: the planner asks the class)
        cls = planner.backend_class(planner.parse_backend(text)[0])
        assert cls.auto_candidates(SPEC, base.AutoContext(mesh=mesh)), text
        continue
      group = planner.make_group(text, [SPEC], mesh)
      assert by_name[name] in protocols.declared(group), (name, text)
      assert protocols.missing(group) == {}, text
      checked += 1
  assert checked >= 5


@pytest.mark.parametrize(
  "text, want",
  [
    ("tt(rank=4)", []),
    ("dense", ["DevicePrepare", "RowReset"]),
    ("sharded(kind=table)", ["DevicePrepare", "RowReset"]),
  ],
)
def test_what_a_backend_declares_is_all_it_opts_into(text, want):
  group = planner.make_group(text, [SPEC], sharding.make_mesh(2, 4))
  assert [p.__name__ for p in protocols.declared(group)] == want
  assert protocols.missing(group) == {}


def test_a_declared_protocol_without_its_methods_is_refused(monkeypatch):
  """A per-table backend whose group declares micro-batches (splits_batch) and a host
  writer, with none of their methods: refused when its group is built, naming them."""

  class Half(TableGroup):
    pass

  class Declares(dense.Dense):
    capabilities = base.Capabilities(splits_batch=True, writes_host=True)

    @classmethod
    def group_class(cls, specs, options):
      return Half

    @classmethod
    def capabilities_for(cls, options):
      return cls.capabilities

  monkeypatch.setitem(registry.REGISTRY, "declares", Declares)
  monkeypatch.setattr(Declares, "name", "declares")
  with pytest.raises(TypeError) as e:
    planner.make_backend("declares", SPEC)
  msg = str(e.value)
  assert "HostTier: after_update" in msg and "MicroBatching: micro_batches, lookup_micro" in msg
