"""tt's host-side preparer (the input thread): a batch's ids -> its prepared pytree.

One concern: the per-batch host work. The cache's plan (the warm-up's access counts, the hot
set fixed after it, each id's cache slot), the batch's distinct rows and their prefix tree
(level by level: distinct prefixes, the core slices they use, each one's parent), padded to
grow-only capacities (the module docstring's "Shapes are static per bucket"). `Preparer` is an
object the `TT` front holds (recgnn/backends/tt/backend.py).
"""

from __future__ import annotations

import math

import numpy as np

from recgnn.backends.tt.kernels import _round_up
from recgnn.backends.tt.options import TTOptions
from recgnn.backends.tt.shape import TTShape
from recgnn.embeddings import access_counts as profile
from recgnn.embeddings import base


class Preparer:
  """ids int[B, L] -> {"ids", "inverse", per level "slices{k}" / "slice_of{k}" /
  "parent{k}", with the cache "cache_ids" / "cache_slot" (/ "cache_unique" /
  "cache_inverse")}. Holds the capacities grown so far and the cache's hot set.

  cache_rows: the cache's rows (0: none); warmup: the batches counted before the hot set is
  fixed; lookahead: upcoming batches that presize the capacities (pad=grow)."""

  def __init__(
    self,
    spec: base.TableSpec,
    shape: TTShape,
    o: TTOptions,
    cache_rows: int,
    warmup: int,
    lookahead: int,
  ):
    self._spec, self._shape, self._o = spec, shape, o
    self._cache_rows, self._warmup, self._lookahead = cache_rows, warmup, lookahead
    self.batch_size = 0  # the last prepared batch's ids (capacities are keyed by it)
    self.restart(None)

  def restart(self, hot: np.ndarray | None) -> None:
    """A state built or restored with this hot set (sorted rows; None: the warm-up runs)."""
    self.caps: dict[str, int] = {}
    # Access counts of the warm-up (the shared profiler; sparse: only the rows seen).
    self.warm = profile.AccessProfile(self._spec.num_rows, sparse=True)
    self.hot = hot  # sorted hot row ids, fixed after the warm-up

  def stats(self):
    return {f"cap_{k}": float(v) for k, v in self.caps.items()}

  def cap(self, name: str, n: int, limit: int) -> int:
    """Static size of a padded array holding n entries (grow-only; see module docstring)."""
    if self._o.pad == "full":
      return limit
    # Keyed by the batch shape too: eval batches (often larger) must not pad train batches.
    key = f"{name}@{self.batch_size}"
    cap = self.caps.get(key, 0)
    if n > cap or cap == 0:
      # Grow only when the count does not fit: growing whenever HEADROOM * n passed the
      # capacity would recompile the step for batches that fit.
      cap = max(cap, min(_round_up(n), limit))
      self.caps[key] = cap
    return cap

  def _cache_plan(self, ids: np.ndarray, count: bool) -> tuple[dict, np.ndarray]:
    """Cache slots of this batch and the ids left for the cores (hits -> PAD).

    count: whether the batch counts toward the warm-up (train batches; eval batches only
    read the table, so they neither decide the hot set nor end the warm-up).
    """
    n, c = self._spec.num_rows, self._cache_rows
    out = {}
    if self.hot is None and count:
      self.warm.add(ids)
      if self.warm.batches >= self._warmup:
        # LFU over the warm-up; ties go to the smaller id.
        self.hot = self.warm.top(c)
        self.warm = profile.AccessProfile(n, sparse=True)
        # The cores now see fewer distinct rows: let the capacities shrink (one recompile).
        self.caps = {}
    hot_ids = np.full(c, n, np.int32)
    slot = np.full(ids.shape, c, np.int32)
    if self.hot is not None and self.hot.size:
      hot_ids[: self.hot.size] = self.hot
      pos = np.searchsorted(self.hot, ids)
      pos = np.minimum(pos, self.hot.size - 1)
      hit = (ids >= 0) & (self.hot[pos] == ids)
      slot = np.where(hit, pos, c).astype(np.int32)
      ids = np.where(hit, base.PAD, ids)
    out["cache_ids"] = hot_ids
    out["cache_slot"] = slot
    if self._spec.optimizer.needs_unique:
      out["cache_unique"], out["cache_inverse"] = base.dedup(np.where(slot < c, slot, -1), c)
    return out, ids

  def _presize(self, upcoming, total: int) -> None:
    """pad=grow: the first batch of a shape (and the first after the hot set is fixed) sizes
    the capacities from the largest counts of the next `lookahead` batches too, so they
    rarely grow later: each growth recompiles the trainer's whole step."""
    if self._o.pad != "grow" or self._o.kernel == "naive" or f"rows@{total}" in self.caps:
      return
    if self._cache_rows and self.hot is None:
      return  # warm-up: the capacities are reset when the hot set is fixed
    for u in list(upcoming)[: self._lookahead]:
      u = np.asarray(u).astype(np.int64)
      if u.size != total:
        continue
      if self.hot is not None and self.hot.size:
        pos = np.minimum(np.searchsorted(self.hot, u), self.hot.size - 1)
        u = np.where((u >= 0) & (self.hot[pos] == u), base.PAD, u)
      self.tree(np.unique(u[u >= 0]), total)

  def tree(self, rows: np.ndarray, total: int) -> tuple[int, list]:
    """The prefix tree of the sorted distinct rows: (rows' capacity, per level k: distinct
    prefixes (i_1..i_k) as keys, the slices they use, each key's slice, p_cap, s_cap);
    capacities grown to fit."""
    shape, kernel = self._shape, self._o.kernel
    u_cap = self.cap("rows", rows.size, total)
    levels = []
    for k in range(shape.num_cores):
      keys = rows // shape.strides[k]  # sorted, as rows are: no np.unique (a sort) needed
      last = k == shape.num_cores - 1
      if kernel == "prefix" and not last and keys.size:
        keys = keys[np.concatenate([[True], keys[1:] != keys[:-1]])]
      n_k = shape.row_factors[k]
      digit = keys % n_k
      used = np.zeros(n_k, bool)  # the slices used, in order, and each key's rank among them
      used[digit] = True
      slices = np.flatnonzero(used)
      slice_idx = (np.cumsum(used) - 1)[digit]
      limit = min(total, math.prod(shape.row_factors[: k + 1]))
      p_cap = u_cap if (last or kernel == "unique") else self.cap(f"p{k}", keys.size, limit)
      s_cap = self.cap(f"s{k}", slices.size, min(total, n_k))
      levels.append((keys, slices, slice_idx, p_cap, s_cap))
    return u_cap, levels

  def prepare(self, ids, upcoming, train: bool):
    ids = np.asarray(ids).astype(np.int64)
    n_rows = self._spec.num_rows
    out = {}
    if self._cache_rows:
      cache, ids = self._cache_plan(ids, count=train)
      out.update(cache)
    out["ids"] = np.where(ids < 0, n_rows, ids).astype(np.int32)
    if self._o.kernel == "naive":
      return out
    shape, total = self._shape, ids.size
    self.batch_size = total
    if train:
      self._presize(upcoming, total)
    valid = ids.reshape(-1) >= 0
    rows, inverse = np.unique(ids.reshape(-1)[valid], return_inverse=True)
    u_cap, levels = self.tree(rows, total)
    inv = np.full(total, u_cap, np.int32)
    inv[valid] = inverse
    out["inverse"] = inv.reshape(ids.shape)
    # The prefix tree: level k holds the distinct prefixes (i_1..i_k) of the batch's rows
    # ('unique': every row its own chain), each with its parent at level k-1 and its slice.
    prev_keys = None
    for k, (keys, slices, slice_idx, p_cap, s_cap) in enumerate(levels):
      n_k = shape.row_factors[k]
      sl = np.full(s_cap, n_k, np.int32)  # n_k: gathers fill 0, scatters drop
      sl[: slices.size] = slices
      si = np.full(p_cap, s_cap, np.int32)  # s_cap: a zero slice, so padded prefixes are 0
      si[: keys.size] = slice_idx
      out[f"slices{k}"], out[f"slice_of{k}"] = sl, si
      if k > 0:
        parent = np.zeros(p_cap, np.int32)
        if self._o.kernel == "prefix":
          parent[: keys.size] = np.searchsorted(prev_keys, keys // n_k)
        else:
          parent[: keys.size] = np.arange(keys.size)
        out[f"parent{k}"] = parent
      prev_keys = keys
    return out
