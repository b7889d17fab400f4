"""The backend contract: every backend, on meshes 1x1, 8x1 and 2x4 (data x model), against
single-device `dense`, under the trainer's run-ahead of `prepare`.

A new backend adds its plan strings to EXACT (bit-identical to dense) or to its own test
with a tolerance (compression) or its own reference (tt).

On one accelerator (tools/gpu_check.sh): meshes needing more devices than there are
are skipped, naming the count (`contract.mesh_or_skip`); EXACT is bit-identical on CPU and,
on a GPU, bit-identical until the first update and then within the summation-order bound of
`contract.updated_tolerance()` (XLA:GPU sums duplicate ids in another order per buffer).
"""

import functools

import contract_lib as contract
import jax
import numpy as np
import pytest

from recgnn import planner, sharding
from recgnn.embeddings import base

# Plan strings that must reproduce `dense` bit for bit.
EXACT = [
  "dense",
  # Tables of 1000 rows, batches touching ~100 distinct rows: a 10% cache evicts every step.
  "offload(cache_rows=100, policy=lru, lookahead=2)",
  "offload(cache_rows=100, policy=lfu, lookahead=1)",
  "offload(cache_rows=100, policy=lookahead, lookahead=4)",
  "offload(cache_rows=100, policy=lru, lookahead=0)",
  # The SSD level (issue 44): row files in the test's temporary directory ({tmp}), a host
  # cache of 15% of the rows (fewer than a batch's distinct rows: reads and write-backs go
  # through the file every step).
  "offload(cache_rows=100, policy=lru, lookahead=2, host_cache=0.15, storage='ssd:{tmp}')",
  "sharded(kind=table)",
  # 10% of the rows hot after profiling 2 batches, re-profiled (rows migrated) every 2.
  "hot_cold(budget=0.1, profile_batches=2, reprofile=2)",
]
# Plan strings equal to `dense` up to float summation order: a row-sharded table pools each
# bag's rows per owner and adds the partial sums across MODEL (psum_scatter of [B, D], not
# [B, L, D]: L times fewer bytes), so a bag whose ids live on different shards is summed in
# another order.
ROUNDING = {
  "dense(shard=rows)": dict(rtol=1e-5, atol=1e-7),
  "sharded(kind=row)": dict(rtol=1e-5, atol=1e-7),
  # Column blocks: row-wise Adagrad's mean over a row's dims is a sum across MODEL.
  "sharded(kind=column)": dict(rtol=1e-5, atol=1e-7),
}
MESHES = [(1, 1), (8, 1), (2, 4)]

OPTIMIZERS = [
  base.OptimizerSpec(name="sgd", learning_rate=0.1),
  base.OptimizerSpec(name="rowwise_adagrad", learning_rate=0.1, initial_accumulator=0.1),
]


def _spec(opt, num_rows=1000, dim=8, pooling="sum"):
  return base.TableSpec(name="t", num_rows=num_rows, dim=dim, optimizer=opt, pooling=pooling)


@functools.cache
def _dense_reference(opt_name: str) -> tuple[contract.Trace, np.ndarray]:
  """Single-device dense on test_matches_dense's batches, and its initial table: the same
  for every backend and mesh of an optimizer, so run once per process (it is not the code
  under test: a backend's own run is, in each test)."""
  (opt,) = (o for o in OPTIMIZERS if o.name == opt_name)
  ref = contract.run("dense", _spec(opt), _batches())
  return ref, contract.run("dense", _spec(opt), []).table


def _batches() -> list[np.ndarray]:
  return contract.zipf_ids(seed=1, num_batches=6, batch=64, bag=3, num_rows=1000)


@pytest.mark.parametrize("mesh_shape", MESHES, ids=lambda m: f"{m[0]}x{m[1]}")
@pytest.mark.parametrize("backend", EXACT + list(ROUNDING))
@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: o.name)
def test_matches_dense(backend, opt, mesh_shape, tmp_path):
  backend = backend.replace("{tmp}", str(tmp_path))
  batches = _batches()
  mesh = contract.mesh_or_skip(*mesh_shape)
  tol = ROUNDING.get(backend, {})
  ref, initial = _dense_reference(opt.name)
  trace = contract.assert_matches_dense(backend, _spec(opt), batches, mesh=mesh, ref=ref, **tol)
  contract.assert_lookups_equal_table(trace.lookups[0], initial, batches[0], atol=1e-7)


@pytest.mark.parametrize("mesh_shape", [(8, 1), (2, 4)], ids=lambda m: f"{m[0]}x{m[1]}")
@pytest.mark.parametrize("backend", ["dense", "dense(shard=rows)"])
def test_mean_pooling_on_mesh(backend, mesh_shape):
  """Mean pooling (divide by the bag's non-padded ids) and its gradient, on a mesh."""
  spec = _spec(OPTIMIZERS[1], num_rows=997, pooling="mean")  # rows do not divide over 4
  batches = contract.zipf_ids(seed=2, num_batches=4, batch=32, bag=4, num_rows=997)
  mesh = contract.mesh_or_skip(*mesh_shape)
  contract.assert_matches_dense(backend, spec, batches, mesh=mesh, **ROUNDING.get(backend, {}))


def test_row_sharded_state_is_split():
  """dense(shard=rows) really splits the rows over MODEL: each device holds 1/4 of them
  (of the 1024 aligned rows: base.ROW_ALIGN)."""
  mesh = contract.mesh_or_skip(2, 4)
  group = planner.make_backend("dense(shard=rows)", _spec(OPTIMIZERS[1]), mesh)
  state = group.init(jax.random.key(0))
  table = state["t"]["table"]
  assert table.sharding.spec == sharding.P(sharding.MODEL, None)
  assert {s.data.shape for s in table.addressable_shards} == {(256, 8)}
  assert group.memory()["t"].device_bytes == 256 * (8 * 4 + 4)


def test_batch_that_does_not_divide_is_refused():
  """A batch that does not split evenly over the mesh's devices is refused (on up to 8
  devices; one device divides every batch, so there is nothing to refuse)."""
  n = min(8, jax.device_count())
  if n < 2:
    pytest.skip(f"one {jax.default_backend()} device: every batch divides over it")
  mesh = sharding.make_mesh(n, 1)  # outside pytest.raises: its own errors must not match
  sharding.check_batch(12 * n, mesh)
  with pytest.raises(ValueError, match=f"does not divide over the {n} devices"):
    sharding.check_batch(12 * n + 1, mesh)


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: o.name)
def test_dense_update_is_sparse(opt):
  spec = _spec(opt, num_rows=200_000, dim=16)
  batch = contract.zipf_ids(seed=0, num_batches=1, batch=256, bag=2, num_rows=spec.num_rows)[0]
  contract.assert_update_is_sparse("dense", spec, batch)


def test_dense_matches_numpy_reference():
  """Row-wise Adagrad and SGD against a loop-per-row numpy implementation."""
  for opt in OPTIMIZERS:
    spec = _spec(opt, num_rows=50, dim=4)
    batches = contract.zipf_ids(seed=3, num_batches=4, batch=16, bag=3, num_rows=50)
    trace = contract.run("dense", spec, batches)
    table = base.init_table(base.table_key(jax.random.key(0), "t"), spec).astype(np.float64)
    accum = np.full(50, opt.initial_accumulator)
    for step, ids in enumerate(batches):
      pooled = contract.pooled_reference(table, ids)
      np.testing.assert_allclose(trace.lookups[step], pooled, rtol=1e-5, atol=1e-6)
      g = np.asarray(contract.grads_for(step, jax.numpy.asarray(pooled, np.float32)), np.float64)
      g_row = np.zeros_like(table)
      for (b, _slot), i in np.ndenumerate(ids):
        if i >= 0:
          g_row[i] += g[b]
      touched = np.unique(ids[ids >= 0])
      if opt.name == "sgd":
        table[touched] -= opt.learning_rate * g_row[touched]
      else:
        accum[touched] += np.mean(g_row[touched] ** 2, axis=1)
        table[touched] -= (
          opt.learning_rate * g_row[touched] / (np.sqrt(accum[touched])[:, None] + opt.eps)
        )
    np.testing.assert_allclose(trace.table, table, rtol=1e-4, atol=1e-5)


def test_mesh_needing_more_devices_is_skipped_with_the_count():
  """On a platform with too few devices (one GPU) a mesh test skips, naming the counts."""
  n = jax.device_count()
  with pytest.raises(pytest.skip.Exception, match=f"mesh {n}x2 needs {2 * n} devices; {n} "):
    contract.mesh_or_skip(n, 2)
