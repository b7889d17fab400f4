"""`dynamic(...)`'s options (see recgnn/backends/dynamic/__init__.py)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from recgnn.backends.dynamic import id_map
from recgnn.embeddings import base

#: What a reused row starts from (`DynamicOptions.reset`).
RESETS = ("rows", "none")


@dataclasses.dataclass(frozen=True)
class DynamicOptions(base.BackendOptions):
  """`dynamic(...)`'s options.

  Attributes:
    capacity: rows of each table (the inner backend's tables get this many rows).
    inner: the backend string the rows live in (`dense`, `offload(cache_fraction=0.5)`,
      `hot_cold(budget=0.1)`, `sharded(kind=row)`, `tt(rank=8)`).
    admit: `always`, `count` (the k-th occurrence) or `bloom` (a counting Bloom filter's).
    k: the occurrences `count` / `bloom` admit at.
    evict: `lru`, `lfu`, `ttl` (rows unseen for `ttl` train steps, then as lru) or `none` (a
      full table rejects new ids). Every policy but `none` reuses rows.
    reset: what a reused row starts from: `rows` (fresh initial values and optimizer state,
      set by the inner backend in the step: `Capabilities.resets_rows`) or `none` (the row as
      the evicted id left it, any inner backend: the only choice for one whose rows are not
      independent parameters, tt).
    ttl: steps a row may go unseen under evict=ttl.
    pending: admit=count's window of waiting ids (default 4 x capacity).
    bloom: admit=bloom's counters, one byte each (default 4 x capacity).
    seed: the reused rows' initial values are drawn from (seed, table, reset number).
  """

  backend: ClassVar[str] = "dynamic"
  capacity: int = 0
  inner: str = "dense"
  admit: str = "always"
  k: int = 1
  evict: str = "lru"
  reset: str = "rows"
  ttl: int = 0
  pending: int = 0
  bloom: int = 0
  seed: int = 0

  def __post_init__(self):
    if self.capacity < 1:
      raise ValueError(
        "dynamic: give capacity=ROWS (the rows of each table), e.g. capacity=100_000"
      )
    if self.admit == "always" and self.k != 1:
      raise ValueError(f"dynamic: k={self.k} needs admit=count or admit=bloom")
    if self.reset not in RESETS:
      raise ValueError(f"dynamic: reset must be one of {', '.join(RESETS)}; got {self.reset!r}")
    if self.inner.split("(")[0].strip() == "dynamic":
      raise ValueError("dynamic: inner cannot be dynamic")
    self.policy()  # (its own checks: admit, evict, ttl)

  def policy(self) -> id_map.Policy:
    """The id map's policy (every table of the group gets its own map with it)."""
    return id_map.Policy(
      capacity=self.capacity,
      admit=self.admit,
      k=self.k,
      evict=self.evict,
      ttl=self.ttl,
      pending=self.pending or 4 * self.capacity,
      bloom_counters=self.bloom or 4 * self.capacity,
    )

  def format(self) -> str:
    """The checkpoint format's words for what makes a saved map and table mean something:
    capacity, policy and reset (a resume with others is refused naming both)."""
    p = self.policy()
    admit = self.admit if self.admit == "always" else f"{self.admit}({self.k})"
    evict = f"ttl({self.ttl})" if self.evict == "ttl" else self.evict
    # reset=rows, the default, unwritten (the format checkpoints had before the option), and
    # no reset under evict=none (no row is reused, so it changes nothing).
    reset = ", reset=none" if self.reset == "none" and self.evict != "none" else ""
    return f"dynamic(capacity={p.capacity}, admit={admit}, evict={evict}{reset})"
