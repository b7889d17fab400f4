"""The host id map of a dynamic table: raw 64-bit ids -> rows of a fixed-capacity table, with
admission and eviction decided in stream order (recgnn/backends/dynamic/__init__.py says why
on the host, docs/dynamic_tables.md what was measured).

One `IdMap` per table. Its whole state is a dict of numpy arrays (`arrays()`), so a
checkpoint saves it and `IdMap.from_arrays` resumes it exactly:

  hash_keys int64[H], hash_slots int32[H]   open addressing (linear probing, backward-shift
                                            deletion), H = the power of two >= 2 x capacity
  keys int64[C]                             the raw id held by each row (-1: free)
  count int64[C], last int64[C]             accesses since admission; last train step seen
  used uint8[C]                             the row ever held an id (its reuse resets it)
  heap int32[C], heap_pos int32[C]          the rows in eviction order (an indexed min-heap
                                            over (primary, secondary, row), see `EVICTIONS`)
  free int32[C]                             free rows, a stack (row 0 first)
  pending_keys int64[P], pending_count int32[P]   admit=count(k): occurrences of ids not yet
                                            admitted (cleared whole when half full)
  bloom uint8[M]                            admit=bloom(k): counting Bloom filter (count-min,
                                            conservative update, saturating at 255)
  scalars int64[8]                          see `SCALARS`

An id of -1 is padding (the batch's PAD) and maps to PAD; every other int64 is a key (a 64-bit
key with its top bit set reads negative: hashed strings, half the time). An id that is not
admitted maps to PAD too, so it reads a zero row (sum pooling; mean pooling leaves it out) and
is not trained.
"""

from __future__ import annotations

import dataclasses

import numba
import numpy as np

from recgnn.embeddings.backend_options import BackendOptions

#: Eviction policies: `lru` evicts the row seen longest ago; `lfu` the row with the fewest
#: accesses since its admission (ties: seen longest ago); `ttl` expires rows unseen for more
#: than `ttl` train steps at the start of each train batch and, when full, evicts as `lru`;
#: `none` never evicts (a full table rejects new ids).
EVICTIONS = ("lru", "lfu", "ttl", "none")
#: Admission policies: `always` (the first occurrence), `count` (the k-th occurrence, counted
#: exactly in a window), `bloom` (the k-th occurrence as a counting Bloom filter estimates it:
#: fixed memory, may admit early on a collision, never late).
ADMISSIONS = ("always", "count", "bloom")
#: Indices into `scalars`: the train steps mapped, free rows, heap size, pending entries, and
#: the running totals (admissions, evictions incl. expiries, rejected lookups, resets).
SCALARS = ("step", "nfree", "heap_size", "pending", "admitted", "evicted", "rejected", "resets")
_STEP, _NFREE, _HEAP, _PEND, _ADM, _EVI, _REJ, _RES = range(8)
_BLOOM_HASHES = 4
_EMPTY = -1


@dataclasses.dataclass(frozen=True)
class Policy(BackendOptions):
  """A dynamic table's admission and eviction: the `dynamic(...)` options that shape its map
  (`DynamicOptions` adds the others).

  Attributes:
    capacity: rows of the table (C).
    admit: one of ADMISSIONS; k: the occurrences `count` / `bloom` admit at (>= 1).
    evict: one of EVICTIONS; ttl: `ttl`'s steps.
    pending: `count`'s window: distinct waiting ids kept (cleared when half full; 0: 4 x C).
    bloom: `bloom`'s counters, one byte each (0: 4 x C).
  """

  capacity: int = 0
  admit: str = "always"
  k: int = 1
  evict: str = "lru"
  ttl: int = 0
  pending: int = 0
  bloom: int = 0

  def __post_init__(self):
    if self.capacity < 1:
      raise ValueError(
        f"dynamic: give capacity=ROWS (the rows of each table, >= 1), e.g. capacity=100_000; "
        f"got {self.capacity}"
      )
    if self.admit not in ADMISSIONS:
      raise ValueError(f"dynamic: admit must be one of {', '.join(ADMISSIONS)}; got {self.admit!r}")
    if self.evict not in EVICTIONS:
      raise ValueError(f"dynamic: evict must be one of {', '.join(EVICTIONS)}; got {self.evict!r}")
    if self.k < 1:
      raise ValueError(f"dynamic: k must be >= 1, got {self.k}")
    if self.admit == "always" and self.k != 1:
      raise ValueError(f"dynamic: k={self.k} needs admit=count or admit=bloom")
    if (self.evict == "ttl") != (self.ttl > 0):
      raise ValueError(f"dynamic: ttl={self.ttl} goes with evict=ttl (and only with it)")

  @property
  def pending_ids(self) -> int:
    return self.pending or 4 * self.capacity

  @property
  def bloom_bytes(self) -> int:
    return self.bloom or 4 * self.capacity


def _pow2(n: int) -> int:
  return 1 << max(3, (int(n) - 1).bit_length())


def new_arrays(p: Policy) -> dict[str, np.ndarray]:
  """The empty map's arrays (`IdMap`'s docstring): every row free, row 0 taken first."""
  c = p.capacity
  h = _pow2(2 * c)
  pend = _pow2(2 * p.pending_ids) if p.admit == "count" else 8
  bloom = max(p.bloom_bytes, 8) if p.admit == "bloom" else 8
  scalars = np.zeros(len(SCALARS), np.int64)
  scalars[_NFREE] = c
  return {
    "hash_keys": np.full(h, _EMPTY, np.int64),
    "hash_slots": np.full(h, _EMPTY, np.int32),
    "keys": np.full(c, _EMPTY, np.int64),
    "count": np.zeros(c, np.int64),
    "last": np.zeros(c, np.int64),
    "used": np.zeros(c, np.uint8),
    "heap": np.zeros(c, np.int32),
    "heap_pos": np.full(c, _EMPTY, np.int32),
    "free": np.arange(c - 1, -1, -1, dtype=np.int32),
    "pending_keys": np.full(pend, _EMPTY, np.int64),
    "pending_count": np.zeros(pend, np.int32),
    "bloom": np.zeros(bloom, np.uint8),
    "scalars": scalars,
  }


# ------------------------------------------------------------------ compiled kernels (numba)


@numba.njit(cache=True, inline="always")
def _mix(x):
  """splitmix64's finalizer: a well-spread 64-bit hash of an id (as uint64)."""
  z = np.uint64(x) + np.uint64(0x9E3779B97F4A7C15)
  z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
  z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
  return z ^ (z >> np.uint64(31))


@numba.njit(cache=True)
def _find(hkeys, key):
  """Index of `key` in the open-addressing table, or of the empty cell where it would go."""
  mask = np.uint64(hkeys.shape[0] - 1)
  i = _mix(key) & mask
  while hkeys[i] != _EMPTY and hkeys[i] != key:
    i = (i + np.uint64(1)) & mask
  return np.int64(i)


@numba.njit(cache=True)
def _delete(hkeys, hvals, i):
  """Remove cell i (backward-shift deletion: no tombstones, probes stay short)."""
  mask = hkeys.shape[0] - 1
  j = i
  while True:
    j = (j + 1) & mask
    if hkeys[j] == _EMPTY:
      break
    home = np.int64(_mix(hkeys[j]) & np.uint64(mask))
    # Move j back to i unless its home lies cyclically in (i, j].
    if (j > i and (home <= i or home > j)) or (j < i and (home <= i and home > j)):
      hkeys[i] = hkeys[j]
      hvals[i] = hvals[j]
      i = j
  hkeys[i] = _EMPTY
  hvals[i] = _EMPTY


@numba.njit(cache=True, inline="always")
def _less(a, b, prim, sec):
  if prim[a] != prim[b]:
    return prim[a] < prim[b]
  if sec[a] != sec[b]:
    return sec[a] < sec[b]
  return a < b


@numba.njit(cache=True)
def _sift_up(heap, pos, i, prim, sec):
  while i > 0:
    parent = (i - 1) // 2
    if not _less(heap[i], heap[parent], prim, sec):
      break
    heap[i], heap[parent] = heap[parent], heap[i]
    pos[heap[i]] = i
    pos[heap[parent]] = parent
    i = parent


@numba.njit(cache=True)
def _sift_down(heap, pos, i, n, prim, sec):
  while True:
    lo, left, right = i, 2 * i + 1, 2 * i + 2
    if left < n and _less(heap[left], heap[lo], prim, sec):
      lo = left
    if right < n and _less(heap[right], heap[lo], prim, sec):
      lo = right
    if lo == i:
      break
    heap[i], heap[lo] = heap[lo], heap[i]
    pos[heap[i]] = i
    pos[heap[lo]] = lo
    i = lo


@numba.njit(cache=True)
def _push(heap, pos, scalars, slot, prim, sec):
  n = scalars[_HEAP]
  heap[n] = slot
  pos[slot] = n
  scalars[_HEAP] = n + 1
  _sift_up(heap, pos, n, prim, sec)


@numba.njit(cache=True)
def _pop(heap, pos, scalars, prim, sec):
  n = scalars[_HEAP] - 1
  top = heap[0]
  heap[0] = heap[n]
  pos[heap[0]] = 0
  pos[top] = _EMPTY
  scalars[_HEAP] = n
  if n > 0:
    _sift_down(heap, pos, 0, n, prim, sec)
  return top


@numba.njit(cache=True)
def _release(a, slot):
  """Row `slot` no longer holds its id: out of the hash table (the caller took it off the
  heap)."""
  hk, hv = a[0], a[1]
  _delete(hk, hv, _find(hk, a[2][slot]))
  a[2][slot] = _EMPTY


@numba.njit(cache=True)
def _admitted(key, mode, k, pkeys, pcount, bloom, scalars):
  """Count one occurrence of a key not in the map; whether it is admitted now."""
  if mode == 0:
    return True
  if mode == 1:
    if 2 * (scalars[_PEND] + 1) > pkeys.shape[0]:  # the window is full: start a new one
      pkeys[:] = _EMPTY
      pcount[:] = 0
      scalars[_PEND] = 0
    i = _find(pkeys, key)
    if pkeys[i] == _EMPTY:
      pkeys[i] = key
      pcount[i] = 0
      scalars[_PEND] += 1
    pcount[i] += 1
    if pcount[i] >= k:
      _delete(pkeys, pcount, i)
      scalars[_PEND] -= 1
      return True
    return False
  m = np.uint64(bloom.shape[0])
  h = _mix(key)
  h1, h2 = h & np.uint64(0xFFFFFFFF), (h >> np.uint64(32)) | np.uint64(1)
  low = 255
  for j in range(_BLOOM_HASHES):
    c = bloom[(h1 + np.uint64(j) * h2) % m]
    low = min(low, np.int64(c))
  new = min(low + 1, 255)
  for j in range(_BLOOM_HASHES):
    i = (h1 + np.uint64(j) * h2) % m
    if bloom[i] < new:  # conservative update: only the counters at the minimum rise
      bloom[i] = new
  return new >= k


@numba.njit(cache=True)
def _victim(a, step, prim, sec):
  """Take the first row in eviction order not seen in this batch off the heap (-1: none);
  rows seen in this batch (last == step) are set aside and put back."""
  heap, pos, scalars = a[6], a[7], a[12]
  held = np.empty(scalars[_HEAP], np.int32)
  nheld, out = 0, -1
  while scalars[_HEAP] > 0:
    top = _pop(heap, pos, scalars, prim, sec)
    if a[4][top] < step:
      out = top
      break
    held[nheld] = top
    nheld += 1
  for j in range(nheld):
    _push(heap, pos, scalars, held[j], prim, sec)
  return out


@numba.njit(cache=True)
def _expire(a, step, ttl, prim, sec):
  """evict=ttl: free every row unseen for more than `ttl` train steps (in eviction order)."""
  heap, pos, scalars, free = a[6], a[7], a[12], a[8]
  while scalars[_HEAP] > 0 and a[4][heap[0]] < step - ttl:
    slot = _pop(heap, pos, scalars, prim, sec)
    _release(a, slot)
    free[scalars[_NFREE]] = slot
    scalars[_NFREE] += 1
    scalars[_EVI] += 1


@numba.njit(cache=True)
def _map_batch(ids, out, resets, at, a, mode, k, evict, ttl, train):
  """Map ids int64[n] in order into out int32[n]; train: admit, evict, count. The rows
  that must be reset before this batch's lookup go to resets[:return value], the position
  in ids that admitted each to at[:return value] (the row's first position in the batch: a
  victim is never a row the batch has read before)."""
  hk, hv, keys, count, last, used = a[0], a[1], a[2], a[3], a[4], a[5]
  heap, pos, free, scalars = a[6], a[7], a[8], a[12]
  lfu = evict == 1
  prim, sec = (count, last) if lfu else (last, count)
  step = scalars[_STEP]
  nres = 0
  if train and evict == 2:
    _expire(a, step, ttl, prim, sec)
  for i in range(ids.shape[0]):
    key = ids[i]
    if key == _EMPTY:  # (PAD; any other value, negative too, is a key)
      out[i] = -1
      continue
    cell = _find(hk, key)
    slot = hv[cell]
    if slot >= 0:
      out[i] = slot
      if train:
        count[slot] += 1
        last[slot] = step
        if evict != 3:
          _sift_down(heap, pos, pos[slot], scalars[_HEAP], prim, sec)
      continue
    if not train:  # (eval, look-ahead: reads only, counts nothing)
      out[i] = -1
      continue
    if not _admitted(key, mode, k, a[9], a[10], a[11], scalars):
      out[i] = -1
      scalars[_REJ] += 1
      continue
    if scalars[_NFREE] > 0:
      scalars[_NFREE] -= 1
      slot = free[scalars[_NFREE]]
    elif evict != 3:
      slot = _victim(a, step, prim, sec)
      if slot >= 0:
        _release(a, slot)
        scalars[_EVI] += 1
    else:
      slot = -1
    if slot < 0:  # full of rows this batch reads (or evict=none): rejected
      out[i] = -1
      scalars[_REJ] += 1
      continue
    cell = _find(hk, key)  # (a deletion may have moved the empty cell)
    hk[cell] = key
    hv[cell] = slot
    keys[slot] = key
    count[slot] = 1
    last[slot] = step
    if used[slot]:
      resets[nres] = slot
      at[nres] = i
      nres += 1
    used[slot] = 1
    if evict != 3:
      _push(heap, pos, scalars, slot, prim, sec)
    scalars[_ADM] += 1
    out[i] = slot
  if train:
    scalars[_STEP] = step + 1
    scalars[_RES] += nres
  return nres


_ORDER = (
  "hash_keys",
  "hash_slots",
  "keys",
  "count",
  "last",
  "used",
  "heap",
  "heap_pos",
  "free",
  "pending_keys",
  "pending_count",
  "bloom",
  "scalars",
)


class IdMap:
  """One table's map (see the module docstring). Not thread-safe: one caller, in stream
  order (the backend's prepare on the input thread)."""

  def __init__(self, policy: Policy, arrays: dict[str, np.ndarray] | None = None):
    self.policy = policy
    self._arrays = new_arrays(policy) if arrays is None else {k: arrays[k] for k in _ORDER}
    self._tuple = tuple(self._arrays[k] for k in _ORDER)
    self._mode = ADMISSIONS.index(policy.admit)
    self._evict = EVICTIONS.index(policy.evict)

  def map(self, ids: np.ndarray, *, train: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """ids int[...] raw (-1: padding) -> (rows int32[...] (-1: padding or not admitted),
    rows to reset int32[R]: rows this batch admits an id into that held another before).
    train=False (eval, look-ahead): reads only, changes nothing."""
    return self.map_at(ids, train=train)[:2]

  def map_at(self, ids: np.ndarray, *, train: bool = True) -> tuple[np.ndarray, ...]:
    """As `map`, and third int32[R]: where in ids (flattened) each reset row is first read,
    the id that was admitted into it (an inner backend finds the row's place in its
    prepared batch there: `Backend.place_resets`)."""
    flat = np.ascontiguousarray(ids, np.int64).reshape(-1)
    out = np.empty(flat.shape[0], np.int32)
    resets = np.empty(flat.shape[0], np.int32)
    at = np.empty(flat.shape[0], np.int32)
    p = self.policy
    args = (self._tuple, self._mode, p.k, self._evict, p.ttl, train)
    n = _map_batch(flat, out, resets, at, *args)
    return out.reshape(np.shape(ids)), resets[:n].copy(), at[:n].copy()

  def arrays(self) -> dict[str, np.ndarray]:
    """The map's whole state (a copy): what a checkpoint saves."""
    return {k: v.copy() for k, v in self._arrays.items()}

  def counters(self) -> dict[str, int]:
    """The running totals and occupancy (`SCALARS`), as ints."""
    s = self._arrays["scalars"]
    out = {name: int(s[i]) for i, name in enumerate(SCALARS)}
    out["occupied"] = self.policy.capacity - out["nfree"]
    return out

  def nbytes(self) -> int:
    """Host bytes of the map."""
    return int(sum(v.nbytes for v in self._arrays.values()))

  def key_of(self, rows: np.ndarray) -> np.ndarray:
    """The raw id each row holds (-1: free)."""
    return self._arrays["keys"][rows]
