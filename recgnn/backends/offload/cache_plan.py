"""Offload's cache planner in numpy: which row sits in which device-cache slot, the victims
of each admission under the eviction policy (lru, lfu, lookahead), and the `Exchange` a step
applies. The compiled kernels of `planner.py` take the same decisions on the steady state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from recgnn.embeddings import access_counts as profile
from recgnn.embeddings import host_cache

POLICIES = ("lru", "lfu", "lookahead")
_PROTECTED = np.iinfo(np.int64).max
_NEEDED = np.int64(1) << 62  # look-ahead keys: rows needed within the window sort after others
_FAR = np.int64(1) << 40
# Rows of a prepared exchange array int32[4, L] ("now") / int32[5, L] ("next").
EVICT_SLOTS, EVICT_ROWS, LOAD_ROWS, LOAD_SLOTS = range(4)
# "next" only: each load's position among the same step's "now" EVICT_ROWS (a row the "now"
# exchange evicts and the next batch needs back: its host copy is stale until that write-back,
# so its value comes from the evicted cache row), or the "now" list's length when absent.
NEXT_FROM_NOW = 4
# exchange=bucket: steps between the lists' shrink decisions (`host_cache.ListSizer`).
PATIENCE = 16


def pow2_bucket(n: int) -> int:
  """Padded length of an exchange list under `exchange=pow2`: 0, or a power of two >= 16."""
  return 0 if n == 0 else max(16, 1 << (n - 1).bit_length())


# exchange=bucket's list sizing: the shared host-link list sizer (recgnn.embeddings.host_cache).
Sizer = host_cache.ListSizer
octave_bucket = host_cache.octave_bucket


def _pad(a: np.ndarray, size: int, fill: int) -> np.ndarray:
  out = np.full(size, fill, np.int32)
  out[: a.shape[0]] = a
  return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class Exchange:
  """One cache exchange, host-planned: write back dirty victims, then load missing rows.

  Attributes:
    evict_slots: int32[E], cache slots whose (dirty) rows go back to the host.
    evict_rows: int32[E], the rows they hold.
    load_rows: int32[M], rows to copy host -> cache.
    load_slots: int32[M], their slots.
    hits: distinct rows of the admitted batch already resident.
  """

  evict_slots: np.ndarray
  evict_rows: np.ndarray
  load_rows: np.ndarray
  load_slots: np.ndarray
  hits: int = 0

  @staticmethod
  def empty() -> Exchange:
    z = np.zeros(0, np.int32)
    return Exchange(evict_slots=z, evict_rows=z, load_rows=z, load_slots=z)


def smallest(keys: np.ndarray, k: int) -> np.ndarray:
  """Indices of the k smallest keys, ties to the smaller index (a total order: the numpy and
  the compiled planner pick the same victims). O(len(keys))."""
  v = np.partition(keys, k - 1)[k - 1]
  below = np.flatnonzero(keys < v)
  return np.concatenate([below, np.flatnonzero(keys == v)[: k - below.shape[0]]])


class Planner:
  """Host-side cache bookkeeping of one table: which row sits in which slot, and victims.

  Time is counted in train batches (`version`). Costs O(C) numpy work per admission (victim
  selection by `smallest` over the slots' keys), never O(N).
  """

  def __init__(self, num_rows: int, cache_rows: int, policy: str):
    self.num_rows, self.cache_rows, self.policy = num_rows, cache_rows, policy
    self.row_slot = np.full(num_rows, -1, np.int32)
    self.slot_row = np.full(cache_rows, -1, np.int64)
    self.last_used = np.zeros(cache_rows, np.int64)
    # A row is dirty once a train batch touched it since it was loaded; only dirty victims
    # are written back. `sync` does not clean rows: batches prepared ahead of it still hold
    # plans that touch them.
    self.dirty = np.zeros(cache_rows, bool)
    # LFU: each batch counts each of its distinct rows once (the shared profiler); `freq` is
    # its count array.
    self.lfu = profile.AccessProfile(num_rows) if policy == "lfu" else None
    self.freq = self.lfu.counts if self.lfu is not None else None
    self.version = 0
    self.admitted: np.ndarray | None = None  # ids of the batch admitted ahead

  @classmethod
  def from_slots(cls, slot_rows: np.ndarray, num_rows: int, policy: str, version: int):
    """Rebuild bookkeeping from a state's slot map (after a restore). History is lost:
    LRU/LFU start fresh, which changes hit rates, never values."""
    p = cls(num_rows, slot_rows.shape[0], policy)
    resident = slot_rows < num_rows
    p.slot_row[resident] = slot_rows[resident]
    p.row_slot[slot_rows[resident]] = np.flatnonzero(resident)
    p.version = version
    return p

  def check_fits(self, n: int, table: str) -> None:
    if n > self.cache_rows:
      raise ValueError(
        f"offload: a batch touches {n} distinct rows of table {table!r} but its device cache "
        f"holds {self.cache_rows}. Use offload(cache_rows>={n}, ...) (or a smaller batch)."
      )

  def eviction_keys(self, window: Sequence[np.ndarray]) -> np.ndarray:
    """Eviction order of every slot: smaller keys go first."""
    rows = self.slot_row
    if self.policy == "lru":
      return self.last_used.copy()
    if self.policy == "lfu":
      f = self.freq[np.maximum(rows, 0)]
      return (f << 32) | self.last_used
    # lookahead: rows not needed within the window go first (least recently used first);
    # only if the window does not fit, needed rows go, farthest next use first (Belady).
    keys = self.last_used.copy()
    if window:
      w = np.concatenate(window)
      t = np.concatenate([np.full(u.shape[0], j, np.int64) for j, u in enumerate(window)])
      uniq, first = np.unique(w, return_index=True)  # first occurrence = nearest batch
      pos = np.minimum(np.searchsorted(uniq, rows), uniq.shape[0] - 1)
      needed = (uniq[pos] == rows) & (rows >= 0)
      keys[needed] = _NEEDED + (_FAR - t[first[pos[needed]]])
    return keys

  def admit(self, rows: np.ndarray, t: int, window: Sequence[np.ndarray]) -> Exchange:
    """Make the distinct rows `rows` (sorted) resident for the batch at time t.

    window: distinct rows of the batches after it (look-ahead policy only).
    """
    slots = self.row_slot[rows]
    hit = slots >= 0
    self.last_used[slots[hit]] = t
    miss = rows[~hit]
    m = miss.shape[0]
    if m == 0:
      return dataclasses.replace(Exchange.empty(), hits=int(hit.sum()))
    # Free slots first, taken directly (argpartition over many equal keys is slow); then the
    # policy's order over the occupied ones.
    free = np.flatnonzero(self.slot_row < 0)
    if free.shape[0] >= m:
      victims = free[:m]
    else:
      keys = self.eviction_keys(window)
      keys[free] = _PROTECTED  # already taken
      keys[slots[hit]] = _PROTECTED
      victims = np.sort(np.concatenate([free, smallest(keys, m - free.shape[0])]))
    old = self.slot_row[victims]
    valid = old >= 0
    back = valid & self.dirty[victims]
    self.row_slot[old[valid]] = -1
    self.slot_row[victims] = miss
    self.row_slot[miss] = victims
    self.last_used[victims] = t
    self.dirty[victims] = False
    return Exchange(
      evict_slots=victims[back].astype(np.int32),
      evict_rows=old[back].astype(np.int32),
      load_rows=miss.astype(np.int32),
      load_slots=victims.astype(np.int32),
      hits=int(hit.sum()),
    )
