"""Raw keys -> ids for the CTR cache: each column's id slots (`offsets`), hash columns by
their size, frequency columns through a vocabulary built from every key's count (`Counter`,
`lookup`), all int32 (`column_ids`: sparse.npy, MISSING_ID for an empty field); raw columns
their keys' 64 bits as int64 (`raw_column_ids`: raw_ids.npy, RAW_MISSING for an empty field).
A bag's unused slots are PAD in both."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from recgnn.data.ctr_schema import (
  FIRST_ID,
  MISSING_ID,
  PAD,
  RAW_MISSING,
  RAW_RESERVED,
  UNKNOWN_ID,
  Categorical,
)

SORTED_LOOKUP = 512  # vocabularies larger than this are searched with sorted queries

# Parsed.state values of an id slot.
VALUE, EMPTY, PADDED = 0, 1, 2


def offsets(columns: Sequence[Categorical]) -> np.ndarray:
  """int64[T + 1]: table t's slots are [o[t], o[t + 1])."""
  return np.concatenate([[0], np.cumsum([c.bag for c in columns])]).astype(np.int64)


def lookup(col: np.ndarray, vals: np.ndarray, ids: np.ndarray, sorted_threshold: int) -> np.ndarray:
  """Keys -> ids through a vocabulary (vals sorted ascending); UNKNOWN_ID if absent."""
  if vals.size == 0:
    return np.full(col.shape, UNKNOWN_ID, np.int32)
  if vals.size > sorted_threshold:
    # numpy's binary search starts from the previous key's bounds: sorted queries walk a
    # big vocabulary in order instead of missing the cache at every level (several x faster).
    order = np.argsort(col)
    pos = np.empty(col.size, np.int64)
    pos[order] = np.searchsorted(vals, col[order])
  else:
    pos = np.searchsorted(vals, col)
  pos = np.minimum(pos, vals.size - 1)
  return np.where(vals[pos] == col, ids[pos], UNKNOWN_ID).astype(np.int32)


def slots(columns: Sequence[Categorical], raw: bool) -> np.ndarray:
  """int64[S']: the id slots (of `offsets`) of the raw columns (raw=True) or of the others,
  in column order: the columns of raw_ids.npy or of sparse.npy."""
  o = offsets(columns)
  parts = [np.arange(o[t], o[t + 1]) for t, c in enumerate(columns) if c.raw == raw]
  return np.concatenate([np.zeros(0, np.int64), *parts]).astype(np.int64)


def column_ids(raw, state, columns: Sequence[Categorical], vocab=None) -> np.ndarray:
  """raw keys [n, S], state uint8[n, S] -> int32[n, S_d] ids of the columns that are not
  vocab="raw" (their slots, in order; every slot when none is): hash columns folded into
  their id space, frequency columns through `vocab` ({column index: (vals, ids)})."""
  out = np.empty(raw.shape, np.int32)
  o = offsets(columns)
  for t, c in enumerate(columns):
    sl = slice(o[t], o[t + 1])
    r = raw[:, sl]
    if c.vocab == "hash":
      m = np.asarray(c.hash_size - FIRST_ID, r.dtype)
      out[:, sl] = FIRST_ID + (r % m).astype(np.int64)
    elif c.vocab == "frequency":
      vals, ids = vocab[t]
      out[:, sl] = lookup(r.ravel(), vals, ids, SORTED_LOOKUP).reshape(r.shape)
  out[state == EMPTY] = MISSING_ID
  out[state == PADDED] = PAD
  if any(c.raw for c in columns):
    return np.ascontiguousarray(out[:, slots(columns, raw=False)])
  return out


def raw_column_ids(raw, state, columns: Sequence[Categorical]) -> np.ndarray:
  """raw keys [n, S] (uint32 or uint64), state uint8[n, S] -> int64[n, S_r]: the vocab="raw"
  columns' slots, each key's bits as the id (no fold: a uint32 key keeps its value), an
  empty field RAW_MISSING, a bag's unused slot PAD; a key whose bits are one of those two
  RAW_RESERVED."""
  cols = slots(columns, raw=True)
  keys = np.ascontiguousarray(raw[:, cols]).astype(np.uint64).view(np.int64)
  st = state[:, cols]
  out = np.where((keys == PAD) | (keys == RAW_MISSING), RAW_RESERVED, keys)
  out[st == EMPTY] = RAW_MISSING
  out[st == PADDED] = PAD
  return out


class Counter:
  """Per-column key counts, merged lazily so the cost stays O(keys log keys)."""

  def __init__(self, num_columns: int, dtype):
    self.values = [np.zeros(0, dtype) for _ in range(num_columns)]
    self.counts = [np.zeros(0, np.int64) for _ in range(num_columns)]
    self.pending: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(num_columns)]
    self.pending_size = [0] * num_columns

  def add(self, counts: dict[int, tuple[np.ndarray, np.ndarray]]):
    for t, (u, c) in counts.items():
      self.pending[t].append((u, c))
      self.pending_size[t] += u.size
      if self.pending_size[t] > max(self.values[t].size, 1 << 20):
        self._merge(t)

  def _merge(self, t: int):
    vals = np.concatenate([self.values[t]] + [u for u, _ in self.pending[t]])
    cnts = np.concatenate([self.counts[t]] + [c for _, c in self.pending[t]])
    u, inv = np.unique(vals, return_inverse=True)
    self.values[t] = u
    self.counts[t] = np.bincount(inv, weights=cnts, minlength=u.size).astype(np.int64)
    self.pending[t], self.pending_size[t] = [], 0

  def vocabulary(self, t: int, min_count: int) -> tuple[np.ndarray, np.ndarray]:
    """Column t's (kept keys sorted ascending, their ids by decreasing count, ties by key)."""
    self._merge(t)
    keep = self.counts[t] >= min_count
    vals, cnts = self.values[t][keep], self.counts[t][keep]
    order = np.lexsort((vals, -cnts))
    ids = np.empty(vals.size, np.int32)
    ids[order] = FIRST_ID + np.arange(vals.size, dtype=np.int32)
    return vals, ids
