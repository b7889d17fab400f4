"""`dynamic(...)` (recgnn/backends/dynamic/) in front of the other backends.

The must-show: with capacity >= the distinct ids and immediate admission the layer is a
bijection, so training on raw 64-bit ids is bit-identical to the same backend on
dictionary-mapped ids (first occurrence in stream order), through the trainer's prepare
driver and run-ahead (contract_lib.run). And the reuse of evicted rows: a reused row reads
fresh initial values."""

from __future__ import annotations

import contract_lib
import numpy as np
import pytest

from recgnn import planner
from recgnn.embeddings import base

OPT = base.OptimizerSpec(name="rowwise_adagrad", learning_rate=0.1, initial_accumulator=0.1)
CAPACITY = 1024


def _raw_stream(num_rows=600, batches=6, batch=16, bag=2):
  """Zipf batches of ids in [0, num_rows) as raw 62-bit ids, and the dictionary's ids of the
  same batches (each raw id's first occurrence in the stream, counted from 0)."""
  ids = contract_lib.zipf_ids(3, batches, batch, bag, num_rows)
  raw_of = np.random.default_rng(4).integers(1 << 40, 1 << 62, size=num_rows)
  raw = [np.where(x >= 0, raw_of[np.maximum(x, 0)], -1).astype(np.int64) for x in ids]
  order: dict[int, int] = {}
  for x in raw:
    for v in x.reshape(-1).tolist():
      if v >= 0 and v not in order:
        order[v] = len(order)
  mapped = [np.vectorize(lambda v: order.get(v, -1), otypes=[np.int32])(x) for x in raw]
  return raw, mapped


INNER = {
  "dense": "lru",
  "offload(cache_rows=100, policy=lru, lookahead=2)": "none",
  "hot_cold(budget=0.1, profile_batches=2)": "none",
  "sharded(kind=row)": "none",
}
CASES = [(inner, (1, 1)) for inner in INNER] + [(inner, (2, 4)) for inner in INNER]
# The default run keeps dense and sharded on both meshes (~4 s warm); offload and hot_cold
# (the priciest to build cold) run under -m long.
LONG = {
  (inner, mesh)
  for inner in INNER
  if inner.startswith(("offload", "hot_cold"))
  for mesh in ((1, 1), (2, 4))
}


@pytest.mark.parametrize(
  "inner,mesh_shape",
  [pytest.param(*c, marks=pytest.mark.long) if c in LONG else c for c in CASES],
)
def test_bijection_is_bit_identical(inner, mesh_shape):
  mesh = contract_lib.mesh_or_skip(*mesh_shape)
  raw, mapped = _raw_stream()
  spec = base.TableSpec(name="t", num_rows=CAPACITY, dim=8, optimizer=OPT)
  text = f"dynamic(capacity={CAPACITY}, inner={inner!r}, evict={INNER[inner]})"
  ref = contract_lib.run(inner, spec, mapped, mesh=mesh)
  got = contract_lib.run(text, spec, raw, mesh=mesh)
  for step, (a, b) in enumerate(zip(got.lookups, ref.lookups, strict=True)):
    np.testing.assert_array_equal(a, b, err_msg=f"{text}: lookup differs at step {step}")
  np.testing.assert_array_equal(got.table, ref.table, err_msg=f"{text}: final table")
  counters = got.backend.maps["t"].counters()
  assert counters["evicted"] == 0 and counters["admitted"] == max(
    max(x.max() for x in mapped) + 1, 0
  )


def test_reused_rows_read_fresh_initial_values():
  """Capacity 8 under a stream of 60 distinct ids: rows are evicted (lru) and reused every
  step; each reused row's lookup is its reset value (one-hot bags: a row's pooled value),
  not what the evicted id had trained it to."""
  rng = np.random.default_rng(0)
  raw = [rng.integers(0, 60, size=(16, 1)).astype(np.int64) + (1 << 50) for _ in range(5)]
  spec = base.TableSpec(name="t", num_rows=8, dim=4, optimizer=OPT)
  seen = []

  def check(step, state):
    del state
    reset = step.prepared["reset"]["t"]
    rows = step.prepared["inner"]["t"]["rows"]["ids"].reshape(-1)
    for slot, want in zip(reset["slots"], reset["rows"], strict=True):
      if slot < 8:
        where = np.flatnonzero(rows == slot)
        np.testing.assert_array_equal(step.pooled[where], np.broadcast_to(want, (where.size, 4)))
        seen.append(slot)

  contract_lib.run(
    "dynamic(capacity=8, evict=lru, inner='dense(fuse=False)')", spec, raw, check=check
  )
  assert len(seen) > 10


def test_inner_that_cannot_reset_is_refused_with_evictions():
  spec = base.TableSpec(name="t", num_rows=8, dim=4, optimizer=OPT)
  with pytest.raises(ValueError, match="cannot reset a row in the step.*evict=none"):
    planner.make_backend("dynamic(capacity=8, inner='tt(rank=2)')", spec)
  with pytest.raises(ValueError, match="unknown inner backend 'nope'; available: dense"):
    planner.make_backend("dynamic(capacity=8, inner=nope)", spec)


def test_memory_counts_the_map():
  spec = base.TableSpec(name="t", num_rows=64, dim=4, optimizer=OPT)
  group = planner.make_backend("dynamic(capacity=64, admit=bloom, k=2, bloom=4096)", spec)
  inner = planner.make_backend("dense", spec).memory()["t"]
  got = group.memory()["t"]
  assert got.device_bytes == inner.device_bytes
  assert got.host_bytes == inner.host_bytes + group.maps["t"].nbytes()
  assert group.maps["t"].nbytes() > 4096  # (the Bloom filter's counters, the hash table)
  assert "id map" in got.placement


def test_fused_dense_resets_the_rows_unfused_dense_does():
  """reset_rows on a fused dense group (two tables in one array) sets the same rows and
  optimizer slots as on one array per table."""
  import jax

  specs = [base.TableSpec(name=n, num_rows=40, dim=4, optimizer=OPT) for n in ("a", "b")]
  rng = np.random.default_rng(0)
  resets = {
    n: {"slots": np.array([3, 39, 0, 2**31 - 1], np.int32), "rows": rng.normal(size=(4, 4))}
    for n in ("a", "b")
  }
  for r in resets.values():
    r["rows"] = r["rows"].astype(np.float32)
  out = []
  for text in ("dense", "dense(fuse=False)"):
    group = planner.make_group(text, specs)
    # (an update first: the optimizer slots move off their initial value)
    prepared = group.prepare({n: np.arange(8).reshape(8, 1) for n in ("a", "b")})
    state = group.init(jax.random.key(0))
    grads = {n: np.ones((8, 4), np.float32) for n in ("a", "b")}
    state = jax.jit(group.update)(state, prepared, {"a": (), "b": ()}, grads)
    state = jax.jit(group.reset_rows)(state, resets)
    out.append((group.tables(state), jax.tree.leaves(group.export(state))))
  (fused, fused_logical), (plain, plain_logical) = out
  for n in ("a", "b"):
    np.testing.assert_array_equal(fused[n], plain[n])
    np.testing.assert_array_equal(fused[n][[3, 39, 0]], resets[n]["rows"][:3])
  for x, y in zip(fused_logical, plain_logical, strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
