"""A researcher's path: a backend in its own file outside the package (tests/toy_backend.py)
registers itself, is named in a plan string, and passes the contract test on 1x1, 8x1 and
2x4 without any change to recgnn."""

import importlib.metadata

import contract_lib as contract
import jax
import numpy as np
import pytest
import toy_backend  # noqa: F401  (registers "toy")

from recgnn import planner
from recgnn.embeddings import base, registry
from recgnn.planner import plan as plan_lib

MESHES = [(1, 1), (8, 1), (2, 4)]
OPTIMIZERS = [
  base.OptimizerSpec(name="sgd", learning_rate=0.1),
  base.OptimizerSpec(name="rowwise_adagrad", learning_rate=0.1, initial_accumulator=0.1),
]


def _spec(opt, pooling="sum"):
  return base.TableSpec(name="t", num_rows=1000, dim=8, optimizer=opt, pooling=pooling)


@pytest.mark.parametrize("mesh_shape", MESHES, ids=lambda m: f"{m[0]}x{m[1]}")
@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: o.name)
def test_toy_matches_dense(opt, mesh_shape):
  """The same checks as tests/test_contract.py's EXACT backends: bit-identical lookups and
  tables against single-device dense, under the trainer's run-ahead of prepare."""
  batches = contract.zipf_ids(seed=1, num_batches=6, batch=64, bag=3, num_rows=1000)
  mesh = contract.mesh_or_skip(*mesh_shape)
  contract.assert_matches_dense("toy", _spec(opt), batches, mesh=mesh)


def test_toy_mean_pooling_on_mesh():
  spec = _spec(OPTIMIZERS[1], pooling="mean")
  batches = contract.zipf_ids(seed=2, num_batches=4, batch=32, bag=4, num_rows=1000)
  contract.assert_matches_dense("toy", spec, batches, mesh=contract.mesh_or_skip(2, 4))


def test_toy_checkpoints_through_the_default_rows_form():
  """`toy` implements only `table` (its slots under their names): the default export gives
  dense's logical form bit for bit, which restores into toy on another mesh and into dense
  with the same table and slots."""
  spec = _spec(OPTIMIZERS[1])
  batches = contract.zipf_ids(seed=3, num_batches=3, batch=32, bag=3, num_rows=1000)
  got = contract.run("toy", spec, batches, mesh=contract.mesh_or_skip(2, 4))
  logical = jax.device_get(got.backend.export(got.state))
  ref = contract.run("dense", spec, batches)
  want = jax.device_get(ref.backend.export(ref.state))
  for k in ("rows", "accum"):
    assert (
      logical["t"][k].shape
      == want["t"][k].shape
      == (base.aligned_rows(1000),) + ((8,) if k == "rows" else ())
    )
    np.testing.assert_array_equal(logical["t"][k], want["t"][k], err_msg=k)
  for text, shape in (("toy", (8, 1)), ("dense", (1, 1))):
    b = planner.make_backend(text, spec, contract.mesh_or_skip(*shape))
    placed = jax.tree.map(lambda x, t: jax.device_put(x, t.sharding), logical, b.logical_target())
    state = b.import_(placed)
    np.testing.assert_array_equal(b.tables(state)["t"], got.table, err_msg=text)
    again = jax.device_get(b.export(state))
    np.testing.assert_array_equal(again["t"]["accum"], logical["t"]["accum"], err_msg=text)


def test_toy_is_registered_and_named_in_a_plan():
  assert "toy" in planner.available_backends()
  assert planner.capabilities_of("toy") == base.Capabilities()
  specs = [_spec(OPTIMIZERS[0]), base.TableSpec(name="u", num_rows=10, dim=8)]
  plan = planner.resolve_plan([("t", "toy"), (".*", "dense")], specs, log=False)
  assert plan.backend_of("t").name == "toy" and plan.backend_of("u").name == "dense"
  assert planner.check_memory(plan, None) > 0
  with pytest.raises(ValueError, match="takes no options"):
    planner.make_backend("toy(rank=3)", specs[0])


def test_unknown_backend_lists_the_registered_ones():
  with pytest.raises(ValueError, match=r"Unknown backend 'toy2'; available: .*dense.*toy"):
    planner.make_backend("toy2", _spec(OPTIMIZERS[0]))


def test_a_name_cannot_be_taken_twice():
  class Other(base.TableBackend):
    pass

  with pytest.raises(ValueError, match="already registered"):
    base.register_backend("dense")(Other)


def test_entry_point_registers_an_installed_backend(monkeypatch):
  """An installed package names its backend class in the `recgnn.backends` entry-point group
  (pyproject: [project.entry-points."recgnn.backends"] toy_ep = "pkg.mod:Class")."""

  class Installed(toy_backend.Toy):
    pass

  ep = importlib.metadata.EntryPoint("toy_ep", "toy_backend:Toy", planner.ENTRY_POINT_GROUP)
  monkeypatch.setattr(ep.__class__, "load", lambda self: Installed)
  monkeypatch.setattr(
    plan_lib.importlib.metadata,
    "entry_points",
    lambda group: [ep] if group == planner.ENTRY_POINT_GROUP else [],
  )
  monkeypatch.setattr(plan_lib, "_loaded", False)
  monkeypatch.delitem(registry.REGISTRY, "toy_ep", raising=False)
  try:
    assert "toy_ep" in planner.available_backends()
    assert planner.backend_class("toy_ep") is Installed
  finally:
    registry.REGISTRY.pop("toy_ep", None)
