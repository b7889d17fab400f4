"""`hot_cold(...)`'s plan-string options: one frozen dataclass, parsed by
`base.BackendOptions.parse` (an option it cannot honour is refused with the reason)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from recgnn.embeddings import base

COLD_LISTS = ("fixed", "bucket")


@dataclasses.dataclass(frozen=True)
class HotColdOptions(base.BackendOptions):
  """`hot_cold(...)`'s options: `budget` or `hot_rows` (not both; budget=0.05 when neither).

  Attributes:
    budget: share of each table's bytes (rows + optimizer state) kept on the devices, in all
      (each of n devices holds 1 / n of it), in (0, 1].
    hot_rows: the hot rows per table (>= 1), instead of `budget`.
    profile_batches: train batches profiled before the first hot set is picked (>= 1).
    reprofile: re-pick the hot set every this many train batches from the accesses counted
      since the last pick, migrating rows (0 = never). Refused with budget=1: every row is
      hot, so no pick can differ. The device ring of recent write-backs then also holds the
      hot slots a re-pick may empty (`host_side.HostTier._ring_rows`).
    split: run the batch as popular + non-popular micro-batches (the step's micro-batch
      feature). False: one lookup of the whole batch (same values).
    cold_list: the length of the group's cold lists, a shape of the step. The cold rows of
      every table with the same row layout (dim, optimizer) travel in ONE list, table after
      table (read by prepare, `host_side.HostTier.stage`), so the step's shape is one length per
      layout, not one per table. `bucket` (default): the batch's distinct cold rows over the
      group's tables, rounded up to an eighth-octave length with hysteresis
      (`host_cache.ListSizer`): host-link bytes within ~1.1x of what the cold ids need and
      falling as the budget grows (tests/test_hot_cold_tiers.py), a few lengths per run (26
      tables, 200 Zipf steps: <= 6 step shapes; before the first hot set, when every id is
      cold, the batch's ids: one length for the profile). `fixed`: the batch's id count per
      table (at most its rows), summed: one shape for the run, but the host link carries
      that many rows whatever the hot set covers.
  """

  backend: ClassVar[str] = "hot_cold"

  budget: float | None = None
  hot_rows: int | None = None
  profile_batches: int = 20
  reprofile: int = 0
  split: bool = True
  cold_list: str = "bucket"

  def __post_init__(self):
    if self.cold_list not in COLD_LISTS:
      raise ValueError(
        f"hot_cold: cold_list must be one of {', '.join(COLD_LISTS)}, got {self.cold_list!r}"
      )
    if self.budget is not None and self.hot_rows is not None:
      raise ValueError("hot_cold: give budget=FRACTION or hot_rows=ROWS, not both")
    if self.budget is not None and not 0 < self.budget <= 1:
      raise ValueError(f"hot_cold: budget must be in (0, 1], got {self.budget}")
    if self.hot_rows is not None and self.hot_rows < 1:
      raise ValueError(f"hot_cold: hot_rows must be >= 1, got {self.hot_rows}")
    if self.profile_batches < 1 or self.reprofile < 0:
      raise ValueError(
        f"hot_cold: need profile_batches >= 1 and reprofile >= 0, got {self.profile_batches}, "
        f"{self.reprofile}"
      )
    if self.reprofile and self.budget == 1:
      raise ValueError(
        f"hot_cold: reprofile={self.reprofile} re-picks the hot set, but budget=1 keeps every "
        "row hot, so a new pick never differs: drop reprofile= or give a budget under 1"
      )

  def describe(self) -> str:
    """The plan string of what these options do (defaults left out)."""
    size = f"hot_rows={self.hot_rows}" if self.fraction is None else f"budget={self.fraction}"
    extra = f", reprofile={self.reprofile}" if self.reprofile else ""
    extra += "" if self.split else ", split=False"
    extra += "" if self.cold_list == "bucket" else f", cold_list={self.cold_list}"
    return f"hot_cold({size}, profile_batches={self.profile_batches}{extra})"

  @property
  def fraction(self) -> float | None:
    """The budget in effect: `budget`, its default 0.05, or None with `hot_rows`."""
    return None if self.hot_rows is not None else (0.05 if self.budget is None else self.budget)
