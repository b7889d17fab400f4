"""sharded's placement planner: which MODEL shard holds which table (table-wise), or that a
table is split by rows or columns over every shard. Nothing allocated; see the package
docstring for the rule."""

from __future__ import annotations

import dataclasses

from recgnn.embeddings import base

KINDS = ("auto", "table", "row", "column")


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where one table lives. kind: table | row | column; shard: the owner (table-wise);
  slot: its position among the owner's tables; offset: its first row in the owner's array."""

  kind: str
  shard: int = 0
  slot: int = 0
  offset: int = 0


def plan_placements(
  specs: dict[str, base.TableSpec],
  k: int,
  kind: str = "auto",
  lookups: dict[str, float] | None = None,
) -> dict[str, Placement]:
  """Assign every table a placement over k MODEL shards (see the module docstring)."""
  if kind not in KINDS:
    raise ValueError(f"sharded: unknown kind {kind!r}; available: {', '.join(KINDS)}")
  lookups = lookups or {}
  total_bytes = sum(s.table_bytes for s in specs.values()) or 1
  total_lookups = sum(lookups.get(n, 1.0) for n in specs) or 1.0
  out: dict[str, Placement] = {}
  table_wise = []
  for n, s in specs.items():
    if kind == "column":
      if s.dim % k:
        raise ValueError(
          f"sharded(kind=column): table {n!r} has dim {s.dim}, which does not split over the "
          f"{k} devices of the model axis; use a dim divisible by {k}, or kind=row / table."
        )
      out[n] = Placement("column")
    elif kind == "row" or (kind == "auto" and k > 1 and s.table_bytes * k > total_bytes):
      out[n] = Placement("row")
    else:
      table_wise.append(n)
  cost = [0.0] * k
  rows = [0] * k
  slots = [0] * k
  order = sorted(
    table_wise,
    key=lambda n: -(specs[n].table_bytes / total_bytes + lookups.get(n, 1.0) / total_lookups),
  )
  for n in order:
    m = min(range(k), key=lambda i: (cost[i], i))
    out[n] = Placement("table", m, slots[m], rows[m])
    cost[m] += specs[n].table_bytes / total_bytes + lookups.get(n, 1.0) / total_lookups
    rows[m] += specs[n].num_rows
    slots[m] += 1
  return {n: out[n] for n in specs}
