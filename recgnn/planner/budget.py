"""The memory budget: device budgets in bytes or relative to the plan, and the check that
refuses, before allocating, a plan that does not fit."""

from __future__ import annotations

import dataclasses
import re

from recgnn import sharding
from recgnn.planner.plan import Plan, mib


class PlanDoesNotFit(ValueError):
  """The plan needs more device (or host) memory than the budget allows."""


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
  of ids shaped `ids_shapes` (`Backend.batch_memory`: e.g. the host tiers' rings of recent
  write-backs)."""
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
      f"Embedding plan needs {mib(total)} per device on mesh {sharding.describe(plan.mesh)}"
      + (f" ({mib(buffers)} of it buffers sized by the batch)" if buffers else "")
      + f", budget is {mib(device_budget_bytes)} per device. Largest tables: "
      + ", ".join(f"{n} {mib(m.device_bytes)} ({g.describe(n)})" for n, (g, m) in worst)
      + ". Split large tables over the devices ('dense(shard=rows)' with --config.mesh.model=N)"
      " or move them to host memory or a compressed backend in config.embeddings.plan, e.g. "
      "('C(3|4|10)', 'offload(cache_rows=100_000)') or 'tt(rank=32)'."
    )
  return total


def check_host_memory(plan: Plan, host_budget_bytes: int | None) -> int:
  """Refuse, before allocating, a plan whose host bytes (every table's `memory().host_bytes`:
  offload's host tables or host cache, hot_cold's cold rows, ...) exceed the host budget, naming
  the largest and the way down: offload's SSD level keeps only a host cache of a table's rows
  in RAM. Returns the plan's host bytes."""
  per_table = {n: (g, g.memory()[n]) for n in plan.table_group for g in [plan.backend_of(n)]}
  total = sum(m.host_bytes for _, m in per_table.values())
  if host_budget_bytes is not None and total > host_budget_bytes:
    worst = sorted(per_table.items(), key=lambda kv: -kv[1][1].host_bytes)[:5]
    raise PlanDoesNotFit(
      f"Embedding plan needs {mib(total)} of host memory, host budget is "
      f"{mib(host_budget_bytes)}. Largest: "
      + ", ".join(f"{n} {mib(m.host_bytes)} ({g.describe(n)})" for n, (g, m) in worst)
      + ". Keep the rows of the largest on a local SSD with a host cache of a share of them, "
      "e.g. ('C(3|4|10)', \"offload(cache_fraction=0.01, host_cache=0.05, "
      "storage='ssd:/mnt/nvme/rows')\"), or raise --host_memory_budget."
    )
  return total
