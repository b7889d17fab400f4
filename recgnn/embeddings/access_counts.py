"""Row-access profiles: count how often each row of a table is looked up, pick the hot set.

One profiler for every backend that ranks rows by popularity (instead of one copy each):
  hot_cold   FAE / Hotline: profile a sample of the training input (FAE: 5 %), keep the most
             accessed rows that fit a device byte budget on the accelerators
  tt         TT-Rec's cache of hot uncompressed rows: the C most accessed rows of a warm-up
  offload    the LFU policy's per-row counts (each batch counts a row once)

Two ways to count, both exact integer counts:
  AccessProfile.add(ids)        every non-padding occurrence counts (FAE, TT-Rec)
  AccessProfile.add_rows(rows)  each of a batch's distinct rows counts once (an LFU cache's
                                notion of use: a batch that looks a row up 50 times needs it once)

Ranking: more accesses first, ties to the smaller row id (deterministic, so two runs over the
same input pick the same rows). O(ids log ids) work per batch, never O(N) per batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import numpy as np


class AccessProfile:
  """Access counts of the rows of one table.

  dense (default): `counts` int64[num_rows] on the host, O(N) once; for backends that keep
    O(N) host bookkeeping anyway (offload's planner, hot_cold's row map).
  sparse: only the rows seen, as sorted (rows, counts) arrays merged lazily (amortised
    O(ids log ids) per batch); for a short warm-up over a huge table (tt's hot-row cache).
  """

  def __init__(self, num_rows: int, sparse: bool = False):
    if num_rows <= 0:
      raise ValueError(f"AccessProfile: num_rows must be > 0, got {num_rows}")
    self.num_rows, self.sparse = num_rows, sparse
    self._dense = None if sparse else np.zeros(num_rows, np.int64)
    self._rows = np.zeros(0, np.int64)
    self._counts = np.zeros(0, np.int64)
    self._pending: list[tuple[np.ndarray, np.ndarray]] = []
    self._pending_size = 0
    self.accesses = 0  # ids counted (add_rows: rows counted)
    self.batches = 0

  def add(self, ids: np.ndarray) -> None:
    """Count every non-padding occurrence (ids < 0 are padding) of one batch, any shape."""
    ids = np.asarray(ids).reshape(-1)
    ids = ids[ids >= 0].astype(np.int64)
    self._check(ids)
    if ids.size:
      # np.unique + counts: O(ids log ids), never O(N); np.add.at is several times slower.
      rows, c = np.unique(ids, return_counts=True)
      self._bump(rows, c)
    self.accesses += ids.size
    self.batches += 1

  def add_rows(self, rows: np.ndarray) -> None:
    """Count each of `rows` (distinct row ids, e.g. a batch's distinct rows) once: an LFU
    cache's notion of use."""
    rows = np.asarray(rows, np.int64).reshape(-1)
    self._check(rows)
    self._bump(rows, None)
    self.accesses += rows.size
    self.batches += 1

  def _check(self, ids):
    if ids.size and ids.max() >= self.num_rows:
      raise ValueError(
        f"AccessProfile: id {int(ids.max())} out of range for a table of {self.num_rows} rows"
      )

  def _bump(self, rows, c):
    if not self.sparse:
      self._dense[rows] += 1 if c is None else c
      return
    c = np.ones(rows.size, np.int64) if c is None else c.astype(np.int64)
    self._pending.append((rows, c))
    self._pending_size += rows.size
    if self._pending_size > max(self._rows.size, 1 << 16):
      self._merge()

  def _merge(self):
    if not self._pending:
      return
    rows = np.concatenate([self._rows] + [r for r, _ in self._pending])
    c = np.concatenate([self._counts] + [x for _, x in self._pending])
    self._rows, inv = np.unique(rows, return_inverse=True)
    self._counts = np.bincount(inv, weights=c, minlength=self._rows.size).astype(np.int64)
    self._pending, self._pending_size = [], 0

  @property
  def counts(self) -> np.ndarray:
    """Dense mode: the count of every row, int64[num_rows] (the profile's own array)."""
    if self.sparse:
      raise ValueError("AccessProfile(sparse=True) has no dense counts; use seen() / count_of()")
    return self._dense

  def use_counts(self, counts: np.ndarray) -> None:
    """Dense mode: keep the counts in `counts` (int64[num_rows], e.g. a slice of an array
    shared by several tables); its values become the counts."""
    if self.sparse or counts.shape != self._dense.shape or counts.dtype != np.int64:
      raise ValueError(f"use_counts: int64[{self._dense.shape[0]}] for a dense profile")
    self._dense = counts

  def seen(self) -> tuple[np.ndarray, np.ndarray]:
    """(rows accessed at least once int64[S] ascending, their counts int64[S])."""
    if not self.sparse:
      rows = np.flatnonzero(self._dense)
      return rows, self._dense[rows]
    self._merge()
    return self._rows, self._counts

  def count_of(self, rows: np.ndarray) -> np.ndarray:
    """Access counts of `rows` (any int array): int64, same shape."""
    rows = np.asarray(rows, np.int64)
    if not self.sparse:
      return self._dense[rows]
    seen, c = self.seen()
    if seen.size == 0:
      return np.zeros(rows.shape, np.int64)
    pos = np.minimum(np.searchsorted(seen, rows), seen.size - 1)
    return np.where(seen[pos] == rows, c[pos], 0)

  def top(self, k: int) -> np.ndarray:
    """The k most accessed rows (ties: smaller id first), sorted by id: int64[<= k]. Rows
    never accessed are not returned."""
    rows, c = self.seen()
    return rows[top_rows(c, k)]

  def coverage(self, rows: np.ndarray) -> float:
    """Share of the counted accesses that fall on `rows` (distinct row ids)."""
    return float(self.count_of(rows).sum() / max(self.accesses, 1))

  def reset(self) -> None:
    if self._dense is not None:
      self._dense[:] = 0
    self._rows = self._counts = np.zeros(0, np.int64)
    self._pending, self._pending_size = [], 0
    self.accesses = self.batches = 0


def top_rows(counts: np.ndarray, k: int) -> np.ndarray:
  """Indices of the k largest counts > 0 (ties: smaller index), sorted ascending."""
  counts = np.asarray(counts)
  k = int(min(k, counts.shape[0]))
  seen = np.flatnonzero(counts > 0)
  if k <= 0 or seen.size == 0:
    return np.zeros(0, np.int64)
  if seen.size <= k:
    return seen.astype(np.int64)
  c = counts[seen]
  # Keep every row whose count beats the k-th largest, then the smallest ids among the ties.
  kth = np.partition(c, c.size - k)[c.size - k]
  above = seen[c > kth]
  ties = seen[c == kth][: k - above.size]  # seen is ascending: smaller ids first
  return np.sort(np.concatenate([above, ties])).astype(np.int64)


@dataclasses.dataclass(frozen=True, kw_only=True)
class HotSet:
  """The hot rows of each table chosen for a byte budget.

  Attributes:
    rows: {table: int64[H_t] sorted hot row ids}.
    bytes: bytes the hot rows (values + optimizer state) take.
    coverage: {table: share of the profiled accesses that hit a hot row}.
  """

  rows: dict[str, np.ndarray]
  bytes: int
  coverage: dict[str, float]


def hot_set_for_budget(
  profiles: dict[str, AccessProfile],
  row_bytes: dict[str, int],
  budget_bytes: int,
  capacity: dict[str, int] | None = None,
) -> HotSet:
  """FAE's choice: the globally most accessed rows of all tables whose bytes fit the budget.

  Rows are taken in order of accesses per byte (a row of a narrow table costs less), ties by
  table order then row id; `capacity` optionally caps the rows of each table (a backend whose
  hot arrays have a fixed size). O(rows accessed log rows accessed).
  """
  names = list(profiles)
  cand_t, cand_r, cand_c = [], [], []
  for i, n in enumerate(names):
    seen, counts = profiles[n].seen()
    cand_t.append(np.full(seen.size, i, np.int64))
    cand_r.append(seen)
    cand_c.append(counts / row_bytes[n])
  t, r, c = (np.concatenate(x) if x else np.zeros(0) for x in (cand_t, cand_r, cand_c))
  order = np.lexsort((r, t, -c))
  t, r = t[order].astype(np.int64), r[order].astype(np.int64)
  cost = np.asarray([row_bytes[n] for n in names], np.int64)[t]
  if capacity is not None:
    # Rank of each candidate within its table; beyond the table's capacity it is skipped.
    rank = np.zeros(t.size, np.int64)
    for i in range(len(names)):
      m = t == i
      rank[m] = np.arange(m.sum())
    cap = np.asarray([capacity.get(n, profiles[n].num_rows) for n in names], np.int64)[t]
    keep = rank < cap
    t, r, cost = t[keep], r[keep], cost[keep]
  take = np.cumsum(cost) <= budget_bytes
  t, r = t[take], r[take]
  rows = {n: np.sort(r[t == i]) for i, n in enumerate(names)}
  used = int(sum(rows[n].size * row_bytes[n] for n in names))
  return HotSet(rows=rows, bytes=used, coverage={n: profiles[n].coverage(rows[n]) for n in names})


def profile_sample(
  batches: Iterable[dict[str, np.ndarray]],
  num_rows: dict[str, int],
  fraction: float = 0.05,
  total: int | None = None,
  seed: int = 0,
) -> dict[str, AccessProfile]:
  """Profile a `fraction` of the batches of a stream (FAE samples 5 % of the training input):
  every batch with probability `fraction` (or, with `total` known, exactly
  round(fraction * total) batches spread over the stream). batches: {table: int[B, L]}."""
  if not 0 < fraction <= 1:
    raise ValueError(f"profile_sample: fraction must be in (0, 1], got {fraction}")
  profiles = {n: AccessProfile(r) for n, r in num_rows.items()}
  rng = np.random.default_rng(seed)
  chosen = None
  if total is not None:
    k = max(1, round(fraction * total))
    chosen = set(np.sort(rng.choice(total, size=min(k, total), replace=False)).tolist())
  for i, batch in enumerate(batches):
    if (i in chosen) if chosen is not None else rng.random() < fraction:
      for n, p in profiles.items():
        p.add(batch[n])
  return profiles


def coverage_of(ids: Sequence[np.ndarray], hot: np.ndarray) -> float:
  """Share of the non-padding ids of `ids` that are in `hot` (sorted distinct rows)."""
  hit = total = 0
  for x in ids:
    x = np.asarray(x).reshape(-1)
    x = x[x >= 0]
    total += x.size
    if hot.size:
      pos = np.minimum(np.searchsorted(hot, x), hot.size - 1)
      hit += int((hot[pos] == x).sum())
  return hit / max(total, 1)
