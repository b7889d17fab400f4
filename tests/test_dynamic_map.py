"""The dynamic table's host id map (recgnn/backends/dynamic/id_map.py) against the plain-Python
reference (tests/dynamic_reference.py): every batch's rows, resets and counters, and the
rows' ids, on drifting streams for each admission and eviction policy."""

from __future__ import annotations

import numpy as np
import pytest
from dynamic_reference import ReferenceMap

from recgnn.backends.dynamic import id_map


def drifting(seed, batches=40, batch=24, alive=30, born=4):
  """Batches of raw ids: a window of `alive` ids that slides by `born` per batch (ids are
  born and die), Zipf-like popularity inside it, padding, and full 64-bit values (every
  other id with its top bit set: a negative int64, a key like any other)."""
  rng = np.random.default_rng(seed)
  base = np.int64(1) << 40
  out = []
  for b in range(batches):
    lo = b * born
    rank = np.minimum(rng.zipf(1.3, size=batch) - 1, alive - 1)
    ids = base + (lo + rank) * 7919
    ids = np.where(rank % 2 == 1, ids ^ np.int64(-(2**63)), ids)
    ids[rng.random(batch) < 0.1] = -1
    out.append(ids.reshape(-1, 2))
  return out


CASES = [
  ("always", 1, "lru", 0),
  ("always", 1, "lfu", 0),
  ("always", 1, "ttl", 3),
  ("always", 1, "none", 0),
  ("count", 2, "lru", 0),
  ("count", 3, "lfu", 0),
]


@pytest.mark.parametrize("admit,k,evict,ttl", CASES)
def test_map_matches_reference(admit, k, evict, ttl):
  capacity = 16
  policy = id_map.Policy(capacity=capacity, admit=admit, k=k, evict=evict, ttl=ttl, pending=6)
  fast = id_map.IdMap(policy)
  ref = ReferenceMap(
    capacity, admit, k, evict, ttl, pending_cells=fast.arrays()["pending_keys"].size
  )
  for step, ids in enumerate(drifting(hash((admit, evict)) % 1000)):
    train = step % 7 != 6  # every 7th batch an eval batch: reads only
    rows, resets = fast.map(ids, train=train)
    want, want_resets = ref.map(ids, train=train)
    np.testing.assert_array_equal(rows.reshape(-1), want, err_msg=f"rows at batch {step}")
    np.testing.assert_array_equal(resets, want_resets, err_msg=f"resets at batch {step}")
    np.testing.assert_array_equal(fast.key_of(np.arange(capacity)), ref.key)
  got = fast.counters()
  assert (got["admitted"], got["evicted"], got["rejected"]) == (
    ref.admitted,
    ref.evicted,
    ref.rejected,
  )
  assert got["occupied"] == len(ref.rows)
  if evict != "none":
    assert got["evicted"] > 0  # (the stream drifts past the capacity: evictions happened)


def test_bloom_admits_no_later_than_exact_count():
  """A counting Bloom filter's estimate is at least the true count: each id is admitted at its
  k-th occurrence or (after a collision) earlier, never later; with enough counters, exactly."""
  k = 3
  ids = np.random.default_rng(0).integers(0, 400, size=3000)
  for counters, exact in ((1 << 16, True), (64, False)):
    m = id_map.IdMap(id_map.Policy(capacity=512, admit="bloom", k=k, bloom=counters))
    seen: dict[int, int] = {}
    early = 0
    for x in ids.tolist():
      seen[x] = seen.get(x, 0) + 1
      row, _ = m.map(np.asarray([x]))
      if seen[x] >= k:
        assert row[0] >= 0, f"id {x} not admitted at occurrence {seen[x]}"
      elif row[0] >= 0:
        early += 1
    assert (early == 0) == exact, (counters, early)


def test_bijection_with_room():
  """Capacity >= distinct ids, immediate admission: row = the id's first-occurrence index (a
  dictionary built in stream order), no resets, nothing evicted."""
  rng = np.random.default_rng(1)
  ids = rng.integers(0, 1 << 62, size=50)[rng.integers(0, 50, 400)]
  m = id_map.IdMap(id_map.Policy(capacity=64))
  order = {x: i for i, x in enumerate(dict.fromkeys(ids.tolist()))}
  rows, resets = m.map(ids.reshape(20, 20))
  np.testing.assert_array_equal(rows.reshape(-1), [order[x] for x in ids.tolist()])
  assert resets.size == 0 and m.counters()["evicted"] == 0


def test_resume_from_arrays_is_exact():
  policy = id_map.Policy(capacity=16, admit="count", k=2, evict="lfu", pending=6)
  a, stream = id_map.IdMap(policy), drifting(5)
  for ids in stream[:20]:
    a.map(ids)
  b = id_map.IdMap(policy, a.arrays())
  for ids in stream[20:]:
    for x, y in zip(a.map(ids), b.map(ids), strict=True):
      np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("evict", ["lru", "none"])
def test_eval_and_look_ahead_maps_change_nothing(evict):
  """map(train=False) (eval batches, a backend's look-ahead) reads the map and leaves every
  array, counters included, as it was: a look-ahead of k batches must not count their new ids
  as rejected k times."""
  m = id_map.IdMap(id_map.Policy(capacity=8, evict=evict))
  for ids in drifting(2, batches=6):
    m.map(ids)
  before = {k: v.copy() for k, v in m.arrays().items()}
  for ids in drifting(5, batches=3):
    rows, resets = m.map(ids, train=False)
    assert resets.size == 0 and np.all(rows[~np.isin(ids, m.key_of(np.arange(8)))] == -1)
  for k, v in m.arrays().items():
    np.testing.assert_array_equal(v, before[k], err_msg=k)


def test_bad_policy_names_the_choices():
  with pytest.raises(ValueError, match="always, count, bloom"):
    id_map.Policy(capacity=4, admit="sometimes")
  with pytest.raises(ValueError, match="lru, lfu, ttl, none"):
    id_map.Policy(capacity=4, evict="fifo")
  with pytest.raises(ValueError, match="ttl"):
    id_map.Policy(capacity=4, evict="ttl")
