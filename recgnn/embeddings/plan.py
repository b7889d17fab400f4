"""The per-table plan, the backend registry, and the memory budget.

A plan is a list of (regex over table names, backend string) rules, first match wins:
  [("C(3|4|10)", "tt(rank=32)"), (".*", "dense")]
The backend string's name is a registry key. Backends register themselves with
`@register_backend("name")` (the built-in ones in `recgnn.backends`, a researcher's in their
own file, imported before the plan is resolved) or, from an installed package, through the
`recgnn.backends` entry-point group (`[project.entry-points."recgnn.backends"]
toy = "mypkg.toy:Toy"`). `capabilities_of(text)` answers from a plan string without
constructing anything.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.metadata
import re
from collections.abc import Sequence
from typing import Any

import jax
from absl import logging

from recgnn import sharding
from recgnn.embeddings.contract import (
  Backend,
  Capabilities,
  Layout,
  TableBackend,
  valid_options,
)
from recgnn.embeddings.group import TableGroup
from recgnn.embeddings.specs import TableSpec

# ----------------------------------------------------------------------------- registry

ENTRY_POINT_GROUP = "recgnn.backends"
_REGISTRY: dict[str, type] = {}
_loaded = False


def register_backend(name: str):
  """Class decorator: register a `Backend` (a group of tables) or a `TableBackend` (one
  table; grouped by `TableGroup`) under `name`, the word a plan string starts with.

    @register_backend("toy")
    class Toy(TableBackend): ...
  """
  if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
    raise ValueError(f"Backend name {name!r} is not an identifier")

  def register(cls):
    if not (isinstance(cls, type) and issubclass(cls, (Backend, TableBackend))):
      raise TypeError(f"@register_backend({name!r}): {cls!r} is not a Backend or TableBackend")
    old = _REGISTRY.get(name)
    if old is not None and old.__qualname__ != cls.__qualname__:
      raise ValueError(f"Backend {name!r} is already registered ({old.__module__}.{old.__name__})")
    cls.name = name
    _REGISTRY[name] = cls
    return cls

  return register


def _load_registry() -> None:
  """Import the built-in backends and the installed packages' entry points (once)."""
  global _loaded
  if _loaded:
    return
  _loaded = True
  importlib.import_module("recgnn.backends")
  for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
    obj = ep.load()  # a module that registers on import, or the class itself
    if isinstance(obj, type) and ep.name not in _REGISTRY:
      register_backend(ep.name)(obj)


def available_backends() -> list[str]:
  """The registered backend names."""
  _load_registry()
  return sorted(_REGISTRY)


def backend_class(name: str) -> type:
  """The class registered under `name`; an unknown name lists the valid ones."""
  _load_registry()
  if name not in _REGISTRY:
    raise ValueError(
      f"Unknown backend {name!r}; available: {', '.join(sorted(_REGISTRY))}. A backend of your "
      "own registers with @recgnn.embeddings.register_backend(NAME) in a module imported "
      f"before the plan is resolved, or through the {ENTRY_POINT_GROUP!r} entry-point group."
    )
  return _REGISTRY[name]


def capabilities_of(text: str) -> Capabilities:
  """The declared capabilities of a plan string's backend, without constructing anything
  (tasks and the trainer ask before the plan exists)."""
  name, options = parse_backend(text)
  return backend_class(name).capabilities_for(options)


# ----------------------------------------------------------------------------- plan


_BACKEND_RE = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(?:\((.*)\))?\s*$", re.S)


def parse_backend(text: str) -> tuple[str, dict[str, Any]]:
  """'tt(rank=32, kernel=prefix)' -> ('tt', {'rank': 32, 'kernel': 'prefix'}).

  Option values are Python literals; bare words are strings. `_` separators allowed in ints.
  """
  m = _BACKEND_RE.match(text)
  if not m:
    raise ValueError(f"Cannot parse backend {text!r}; expected NAME or NAME(key=value, ...)")
  name, args = m.group(1), (m.group(2) or "").strip()
  options: dict[str, Any] = {}
  if args:
    try:
      call = ast.parse(f"f({args})", mode="eval").body
    except SyntaxError as e:
      raise ValueError(f"Cannot parse options of backend {text!r}: {e.msg}") from None
    if call.args:
      raise ValueError(f"Backend {text!r}: options must be key=value")
    for kw in call.keywords:
      v = kw.value
      options[kw.arg] = v.id if isinstance(v, ast.Name) else ast.literal_eval(v)
  return name, options


def default_mesh() -> jax.sharding.Mesh:
  """The 1 x 1 mesh on the first device (tests, benchmarks and tools without a config)."""
  return sharding.make_mesh(1, 1)


def check_layout(text: str, caps: Capabilities, layout: Layout) -> None:
  """Refuse a layout a backend's declared capabilities cannot serve (before constructing)."""
  if caps.needs_split_ids and not layout.split_batch:
    raise ValueError(
      f"backend {text!r} needs the ids split over the devices, but this task's batches are "
      "replicated over them (Layout(split_batch=False)). Use dense or offload here."
    )
  if caps.plans_globally and layout.process_local:
    raise ValueError(
      f"backend {text!r} cannot read process-local batches: its prepare plans over the whole "
      "batch (cache / prefix plans). Use train.process_input=global."
    )


def make_group(
  text: str,
  specs: Sequence[TableSpec],
  mesh: jax.sharding.Mesh | None = None,
  layout: Layout | None = None,
) -> Backend:
  """Instantiate the backend named by a plan string for a group of tables on `mesh`, fed as
  `layout` says (default: `Layout()`, the batch split over the devices)."""
  name, options = parse_backend(text)
  cls = backend_class(name)
  mesh = default_mesh() if mesh is None else mesh
  layout = Layout() if layout is None else layout
  check_layout(text, cls.capabilities_for(options), layout)
  try:
    if issubclass(cls, TableBackend):
      return TableGroup(cls, specs, mesh, layout, text, **options)
    return cls(specs, mesh, layout, text=text, **options)
  except TypeError as e:
    raise ValueError(
      f"Bad options for backend {text!r}: {e}; valid options: "
      f"{', '.join(valid_options(cls)) or 'none'}"
    ) from None


def make_backend(
  text: str,
  spec: TableSpec,
  mesh: jax.sharding.Mesh | None = None,
  layout: Layout | None = None,
) -> Backend:
  """The backend of one table (a group of one)."""
  return make_group(text, [spec], mesh, layout)


@dataclasses.dataclass
class Plan:
  """Every table's backend: groups keyed by a state key, and each table's group."""

  groups: dict[str, Backend]
  table_group: dict[str, str]
  mesh: jax.sharding.Mesh
  layout: Layout = Layout()

  def backend_of(self, table: str) -> Backend:
    return self.groups[self.table_group[table]]

  @property
  def specs(self) -> dict[str, TableSpec]:
    return {n: g.specs[n] for n, g in ((t, self.backend_of(t)) for t in self.table_group)}

  @property
  def lookahead(self) -> int:
    return max([g.lookahead for g in self.groups.values()] + [0])


def assign_rules(
  rules: Sequence[tuple[str, str]], specs: Sequence[TableSpec]
) -> dict[str, list[TableSpec]]:
  """Each table's backend string (the first rule whose regex fully matches its name):
  {normalised backend string: its tables}, nothing constructed."""
  compiled = []
  for pattern, text in rules:
    try:
      compiled.append((re.compile(pattern), text))
    except re.error as e:
      raise ValueError(f"Bad plan regex {pattern!r}: {e}") from None
  by_text: dict[str, list[TableSpec]] = {}
  for spec in specs:
    for rx, text in compiled:
      if rx.fullmatch(spec.name):
        by_text.setdefault(" ".join(text.split()), []).append(spec)
        break
    else:
      raise ValueError(
        f"No plan rule matches table {spec.name!r}; rules: {[p for p, _ in rules]}. "
        "End the plan with ('.*', 'dense') to give every table a default."
      )
  return by_text


def resolve_plan(
  rules: Sequence[tuple[str, str]],
  specs: Sequence[TableSpec],
  mesh: jax.sharding.Mesh | None = None,
  layout: Layout | None = None,
  log: bool = True,
) -> Plan:
  """Pick each table's backend (`assign_rules`) and build one backend instance per distinct
  backend string, on `mesh`, fed as `layout` says (decided before: the trainer's
  `recgnn.train.inputs.choose_layout`)."""
  if any(parse_backend(" ".join(t.split()))[0] == "auto" for _, t in rules):
    raise ValueError(
      "An auto(...) plan rule is resolved by recgnn.train.setup.build, which times the "
      "candidates on the run's batches (recgnn.embeddings.auto_plan.plan_rules); "
      "resolve_plan takes the rules it returns"
    )
  by_text = assign_rules(rules, specs)
  mesh = default_mesh() if mesh is None else mesh
  layout = Layout() if layout is None else layout
  groups: dict[str, Backend] = {}
  table_group: dict[str, str] = {}
  for text, members in by_text.items():
    group = make_group(text, members, mesh, layout)
    key = group.name or parse_backend(text)[0]
    i = 1
    while key in groups:
      key, i = f"{group.name}_{i}", i + 1
    groups[key] = group
    table_group.update({s.name: key for s in members})
  # Tables in the task's order (the state and the printed plan follow it).
  table_group = {s.name: table_group[s.name] for s in specs}
  plan = Plan(groups, table_group, mesh, layout)
  if log:
    logging.info("Embedding plan:\n%s", format_plan(plan))
  return plan


def format_plan(plan: Plan) -> str:
  """A table of each table's backend, bytes per device and on the host."""
  d, m = sharding.mesh_shape(plan.mesh)
  lines = [
    f"mesh {sharding.describe(plan.mesh)}",
    f"{'table':<12} {'rows':>12} {'dim':>4} {'backend':<40} {'per device':>10} {'host':>10}",
  ]
  dev = host = params = dense = 0
  for name in plan.table_group:
    g = plan.backend_of(name)
    spec, mem = g.specs[name], g.memory()[name]
    dev, host = dev + mem.device_bytes, host + mem.host_bytes
    params += g.num_params()[name]
    dense += spec.num_rows * spec.dim
    lines.append(
      f"{name:<12} {spec.num_rows:>12,} {spec.dim:>4} {g.describe(name):<40} "
      f"{_mib(mem.device_bytes):>10} {_mib(mem.host_bytes):>10}"
    )
  dev = sum(g.device_bytes() for g in plan.groups.values())
  lines.append(f"{'total':<12} {'':>12} {'':>4} {'':<40} {_mib(dev):>10} {_mib(host):>10}")
  if params:
    lines.append(
      f"embedding parameters: {params:,} ({dense / params:,.1f}x fewer than all-dense {dense:,})"
    )
  return "\n".join(lines)


def _mib(n: int) -> str:
  return f"{n / 2**20:,.1f}M"


class PlanDoesNotFit(ValueError):
  """The plan needs more device memory than the budget allows."""


_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_bytes(text: str | int | None) -> int | None:
  """'512M', '2G', '1.5GiB', '1000000' -> bytes; '' / None -> None."""
  if text in (None, ""):
    return None
  t = str(text).strip().upper().removesuffix("IB").removesuffix("B")
  try:
    if t and t[-1] in _UNITS:
      return int(float(t[:-1]) * _UNITS[t[-1]])
    return int(float(t))
  except ValueError:
    raise ValueError(
      f"Cannot read {text!r} as bytes; expected a number with an optional unit (512M, 2G, "
      "1.5GiB, 1000000)"
    ) from None


@dataclasses.dataclass(frozen=True)
class RelativeBudget:
  """A device budget relative to the plan: 'plan+10%' is the plan's own bytes per device
  (every group's `memory()` plus the buffers sized by a train batch, `batch_bytes`) on the
  run's mesh, plus 10%. For an experiment whose point is a budget its own plan fits and a
  larger plan does not (hotline_kaggle): the bytes come from the backends' own reports and
  follow the mesh, the data and the batch size of the run, overrides included, where a
  number written in the experiment file would be a second formula that drifts from them."""

  margin: float  # 0.1 for 'plan+10%'

  def bytes_for(self, plan_bytes: int) -> int:
    return int(plan_bytes * (1 + self.margin))

  def __str__(self) -> str:
    return f"plan+{self.margin * 100:g}%" if self.margin else "plan"


_RELATIVE_RE = re.compile(r"\s*plan\s*(?:\+\s*(\d+(?:\.\d*)?|\.\d+)\s*%)?\s*", re.I)


def parse_budget(text: str | int | None) -> int | RelativeBudget | None:
  """A device memory budget: bytes ('2G', `parse_bytes`), or relative to the plan ('plan',
  'plan+10%': `RelativeBudget`); '' / None: no budget."""
  if isinstance(text, str) and text.strip().lower().startswith("plan"):
    m = _RELATIVE_RE.fullmatch(text)
    if not m:
      raise ValueError(
        f"Cannot read budget {text!r}; expected bytes (512M, 2G) or the plan's own bytes "
        "plus a margin ('plan+10%')"
      )
    return RelativeBudget(float(m.group(1) or 0) / 100)
  return parse_bytes(text)


def batch_bytes(plan: Plan, ids_shapes: dict[str, tuple[int, ...]] | None) -> int:
  """Bytes per device the plan's state comes to hold beyond its `memory()` for train batches
  of ids shaped `ids_shapes` (`Backend.batch_memory`: e.g. hot_cold's prefetch buffer)."""
  if not ids_shapes:
    return 0
  return sum(sum(g.batch_memory(ids_shapes).values()) for g in plan.groups.values())


def check_memory(
  plan: Plan, device_budget_bytes: int | None, ids_shapes: dict[str, tuple] | None = None
) -> int:
  """Refuse, before allocating, a plan whose bytes on one device exceed the budget (per
  device), with ids_shapes (a train batch's ids, {table: shape}) the buffers the state comes
  to hold for such batches included (`batch_bytes`). Returns the plan's bytes per device."""
  per_table = {n: (g, g.memory()[n]) for n in plan.table_group for g in [plan.backend_of(n)]}
  buffers = batch_bytes(plan, ids_shapes)
  total = sum(g.device_bytes() for g in plan.groups.values()) + buffers
  if device_budget_bytes is not None and total > device_budget_bytes:
    worst = sorted(per_table.items(), key=lambda kv: -kv[1][1].device_bytes)[:5]
    raise PlanDoesNotFit(
      f"Embedding plan needs {_mib(total)} per device on mesh {sharding.describe(plan.mesh)}"
      + (f" ({_mib(buffers)} of it buffers sized by the batch)" if buffers else "")
      + f", budget is {_mib(device_budget_bytes)} per device. Largest tables: "
      + ", ".join(f"{n} {_mib(m.device_bytes)} ({g.describe(n)})" for n, (g, m) in worst)
      + ". Split large tables over the devices ('dense(shard=rows)' with --config.mesh.model=N)"
      " or move them to host memory or a compressed backend in config.embeddings.plan, e.g. "
      "('C(3|4|10)', 'offload(cache_rows=100_000)') or 'tt(rank=32)'."
    )
  return total
