"""`Planned`: one planned batch of an offload group, every table's arrays as segments of flat
int32 buffers, which the group lays out per stack (`OffloadGroup._lists`, `stacked_batch.stack`).

Two makers: `of_tables`, from the members' numpy planners (`Offload.prepare`'s dicts: one copy
of each array), and the compiled planner (`fast_plan.SteadyPlanner.plan`: segments of the
kernel's output buffer, no copy, no per-table dict). Why: on the steady path per-table dicts
would be built by one loop and taken apart by two more, Python holding the GIL on the
planning thread (docs/backends/offload.md).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from recgnn.backends.offload.table import PLANNED


@dataclasses.dataclass(frozen=True)
class Flat:
  """Per-table segments of one flat int32 buffer: table i's entry j of row r is
  data[at[i] + r * stride[i] + j], j < n[i] (a batch's [B, L] array is one row of B * L)."""

  data: np.ndarray  # int32[*]
  at: np.ndarray  # int64[T]
  n: np.ndarray  # int64[T]
  stride: np.ndarray  # int64[T]

  @classmethod
  def of(cls, arrays: list, rows: int = 1) -> Flat:
    """Tables' arrays, each int[rows, n_i] (or any shape of rows * n_i entries), copied
    into one buffer, table after table."""
    arrays = [np.asarray(a, np.int32).reshape(rows, -1) for a in arrays]
    n = np.array([a.shape[1] for a in arrays], np.int64)
    at = np.concatenate([[0], np.cumsum(rows * n)[:-1]]).astype(np.int64)
    data = np.concatenate([a.reshape(-1) for a in arrays]) if arrays else np.zeros(0, np.int32)
    return cls(data, at, n, n)

  def part(self, idx) -> tuple:
    """(data, at, n, stride) of the tables idx (their order)."""
    return self.data, self.at[idx], self.n[idx], self.stride[idx]


@dataclasses.dataclass(frozen=True)
class Planned:
  """A group's planned batch, tables in the group's member order (`names`):
  shapes   each table's ids [B, L]
  ids      its slots int32[B * L] (C, its cache rows: padding)
  now_pos  positions in its "now" exchange (its length: not loaded now), [B * L]
  unique / inverse   row-wise optimizers (`Offload._prepared`): [B * L] each (n 0: none)
  lists    {"now": 4 rows, "next": 5 rows}: its exchanges at their exact lengths, as
           `Offload.prepare` packs them (its own slots and rows)
  exchange_planned  bool[T, 2]: whether its (now, next) exchange was planned (`_width`)
  version  int32[T]: its plan's version (-1: read-only)
  count    {table index: int32[B]}: ids per example, tables pooled by mean."""

  names: tuple
  shapes: tuple
  ids: Flat
  now_pos: Flat
  unique: Flat
  inverse: Flat
  lists: dict
  exchange_planned: np.ndarray
  version: np.ndarray
  count: dict

  @classmethod
  def of_tables(cls, per: dict, names) -> Planned:
    """From each table's planned batch ({name: {"rows": `Offload.prepare`'s dict, "count"?}})."""
    names = tuple(names)
    rows = [per[n]["rows"] for n in names]
    none = np.zeros(0, np.int32)
    return cls(
      names=names,
      shapes=tuple(np.shape(r["ids"]) for r in rows),
      ids=Flat.of([r["ids"] for r in rows]),
      now_pos=Flat.of([r["now_pos"] for r in rows]),
      unique=Flat.of([r.get("unique", none) for r in rows]),
      inverse=Flat.of([r.get("inverse", none) for r in rows]),
      lists={
        "now": Flat.of([r["now"] for r in rows], 4),
        "next": Flat.of([r["next"] for r in rows], 5),
      },
      exchange_planned=np.array([r[PLANNED] for r in rows], bool).reshape(len(rows), 2),
      version=np.array([r["version"] for r in rows], np.int32),
      count={i: per[n]["count"] for i, n in enumerate(names) if "count" in per[n]},
    )
