"""The per-table plan and the backend registry's lookup.

A plan is a list of (regex over table names, backend string) rules, first match wins:
  [("C(3|4|10)", "tt(rank=32)"), (".*", "dense")]
The backend string's name is a registry key. Backends register themselves with
`@register_backend("name")` (`recgnn.embeddings.registry`: the built-in ones in
`recgnn.backends`, a researcher's in their own file, imported before the plan is resolved:
`load_modules`, what `embeddings.modules=PATH,...` does in the trainer) or,
from an installed package, through the `recgnn.backends` entry-point group
(`[project.entry-points."recgnn.backends"] toy = "mypkg.toy:Toy"`). The first look-up loads
the built-in backends (the planner sits above them: docs/architecture.md, "Layers") and the
entry points. `capabilities_of(text)` answers from a plan string without constructing
anything.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import importlib.util
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

import jax
from absl import logging

from recgnn import sharding
from recgnn.embeddings import protocols
from recgnn.embeddings.contract import (
  Backend,
  Capabilities,
  Layout,
)
from recgnn.embeddings.registry import (  # noqa: F401 (parse_backend: the planner's name too)
  REGISTRY,
  construct,
  parse_backend,
  register_backend,
)
from recgnn.embeddings.specs import TableSpec

# ----------------------------------------------------------------------------- registry

ENTRY_POINT_GROUP = "recgnn.backends"
_loaded = False


def _load_registry() -> None:
  """Import the built-in backends and the installed packages' entry points (once)."""
  global _loaded
  if _loaded:
    return
  _loaded = True
  importlib.import_module("recgnn.backends")  # registers the built-in backends
  for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
    obj = ep.load()  # a module that registers on import, or the class itself
    if isinstance(obj, type) and ep.name not in REGISTRY:
      register_backend(ep.name)(obj)


def load_modules(modules: str | Sequence[str]) -> list[str]:
  """Import the modules a config names (`embeddings.modules`: comma-separated file paths or
  module names) before the plan is resolved, so a backend in its own file registers itself
  (`@register_backend`) and the plan can name it. A path (ending in .py or holding a `/`) is
  imported under its file's stem, once: a module of that name already imported from the
  same file is kept, one from another file refused. -> the module names, in order."""
  items = modules.split(",") if isinstance(modules, str) else list(modules)
  return [_load_module(x.strip()) for x in items if x.strip()]


def _load_module(item: str) -> str:
  """Import one `load_modules` item (a path or a module name) -> its module name."""
  if not (item.endswith(".py") or os.sep in item or "/" in item):
    importlib.import_module(item)
    return item
  path = os.path.realpath(item)
  if not os.path.isfile(path):
    raise ValueError(f"embeddings.modules: no file {item!r} (from {os.getcwd()})")
  name = os.path.splitext(os.path.basename(path))[0]
  old = sys.modules.get(name)
  if old is not None:
    if os.path.realpath(getattr(old, "__file__", "") or "") != path:
      raise ValueError(
        f"embeddings.modules: {item!r} would be module {name!r}, already imported from "
        f"{getattr(old, '__file__', None)!r}: rename the file"
      )
    return name
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module
  try:
    spec.loader.exec_module(module)
  except BaseException:
    del sys.modules[name]
    raise
  return name


def available_backends() -> list[str]:
  """The registered backend names."""
  _load_registry()
  return sorted(REGISTRY)


def backend_class(name: str) -> type:
  """The class registered under `name`; an unknown name lists the valid ones."""
  _load_registry()
  if name not in REGISTRY:
    raise ValueError(
      f"Unknown backend {name!r}; available: {', '.join(sorted(REGISTRY))}. A backend of your "
      "own registers with @recgnn.embeddings.register_backend(NAME) in a module imported "
      f"before the plan is resolved, or through the {ENTRY_POINT_GROUP!r} entry-point group."
    )
  return REGISTRY[name]


def capabilities_of(text: str) -> Capabilities:
  """The declared capabilities of a plan string's backend, without constructing anything
  (tasks and the trainer ask before the plan exists)."""
  name, options = parse_backend(text)
  return backend_class(name).capabilities_for(options)


# ----------------------------------------------------------------------------- plan


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


def check_raw_ids(text: str, caps: Capabilities, specs: Sequence[TableSpec]) -> None:
  """Refuse tables of raw ids (`TableSpec.raw_ids`) under a backend that reads ids as rows."""
  raw = [s.name for s in specs if s.raw_ids]
  if raw and not caps.maps_ids:
    raise ValueError(
      f"table{'s' * (len(raw) > 1)} {', '.join(raw)} hold{'s' * (len(raw) == 1)} raw ids (the "
      f"schema's vocab='raw'), which backend {text!r} would read as rows: give "
      f"{'them' if len(raw) > 1 else 'it'} a dynamic table, e.g. "
      f'("{"|".join(raw)}", "dynamic(capacity=1_000_000)")'
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
  check_raw_ids(text, cls.capabilities_for(options), specs)
  group = construct(cls, text, specs, mesh, layout, options)
  protocols.check(group, text)  # (a declared optional protocol is implemented)
  return group


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


PLAN_FORM = (
  'a list of (regex over table names, backend string) pairs, e.g. ((".*", "dense"),) or '
  '(("C(3|4)", "tt(rank=32)"), (".*", "auto(budget=0.25)")), or one backend string for every '
  "table (plan=auto, plan=dense, plan='tt(rank=8)')"
)


def rules_of(plan: Any) -> list[tuple[str, str]]:
  """A config's `embeddings.plan` as rules [(regex, backend string)]: the one place a plan is
  read (the trainer, a task's input layout, a resume's config comparison). One backend string
  (`--config.embeddings.plan=auto` arrives as ("auto",), a config may hold "auto") is that
  backend for every table: [(".*", text)]. Anything else but a sequence of (str, str) pairs is
  refused naming the expected form."""
  if isinstance(plan, str):
    plan = (plan,)
  if isinstance(plan, Sequence) and len(plan) == 1 and isinstance(plan[0], str):
    text = plan[0]
    if not text.strip():
      raise ValueError(f"embeddings.plan is an empty backend string; expected {PLAN_FORM}")
    return [(".*", text)]
  if not isinstance(plan, Sequence) or not plan:
    raise ValueError(f"embeddings.plan is {plan!r}; expected {PLAN_FORM}")
  out = []
  for rule in plan:
    if (
      isinstance(rule, str)
      or not isinstance(rule, Sequence)
      or len(rule) != 2
      or not all(isinstance(x, str) for x in rule)
    ):
      raise ValueError(f"embeddings.plan has rule {rule!r} in {plan!r}; expected {PLAN_FORM}")
    out.append((rule[0], rule[1]))
  return out


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
      "candidates on the run's batches (recgnn.planner.auto.plan_rules); "
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
  # (a disk column only where a table has bytes on disk: offload's SSD level)
  disk_any = any(m.disk_bytes for g in plan.groups.values() for m in g.memory().values())
  lines = [
    f"mesh {sharding.describe(plan.mesh)}",
    f"{'table':<12} {'rows':>12} {'dim':>4} {'backend':<40} {'per device':>10} {'host':>10}"
    + (f" {'disk':>10}" if disk_any else ""),
  ]
  dev = host = disk = params = dense = total = 0
  for name in plan.table_group:
    g = plan.backend_of(name)
    spec, mem = g.specs[name], g.memory()[name]
    dev, host, disk = dev + mem.device_bytes, host + mem.host_bytes, disk + mem.disk_bytes
    total += g.num_params()[name]
    # (a table of raw ids has no all-dense form: its rows are the 2^64 id space)
    params += 0 if spec.raw_ids else g.num_params()[name]
    dense += 0 if spec.raw_ids else spec.num_rows * spec.dim
    rows = "raw ids" if spec.raw_ids else f"{spec.num_rows:,}"
    lines.append(
      f"{name:<12} {rows:>12} {spec.dim:>4} {g.describe(name):<40} "
      f"{mib(mem.device_bytes):>10} {mib(mem.host_bytes):>10}"
      + (f" {mib(mem.disk_bytes):>10}" if disk_any else "")
    )
  dev = sum(g.device_bytes() for g in plan.groups.values())
  lines.append(
    f"{'total':<12} {'':>12} {'':>4} {'':<40} {mib(dev):>10} {mib(host):>10}"
    + (f" {mib(disk):>10}" if disk_any else "")
  )
  out = []
  if params:
    out.append(f"{params:,} ({dense / params:,.1f}x fewer than all-dense {dense:,})")
  if total > params:
    out.append(f"{total - params:,} in tables of raw ids (their dynamic capacities)")
  if out:
    lines.append("embedding parameters: " + "; ".join(out))
  return "\n".join(lines)


def mib(n: int) -> str:
  """Bytes as MiB for the plan's tables and messages ('12.5M')."""
  return f"{n / 2**20:,.1f}M"
