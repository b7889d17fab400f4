"""The backend contract: every backend against the dense reference.

A new backend adds its plan strings to EXACT (bit-identical to dense) or to its own test
with a tolerance (compression) or its own reference (tt).
"""

import numpy as np
import pytest

from recgnn.embeddings import base, testing

# Plan strings that must reproduce `dense` bit for bit.
EXACT = [
  "dense",
  "dense(shard=rows)",
  # Tables of 1000 rows, batches touching ~100 distinct rows: a 10% cache evicts every step.
  "offload(cache_rows=100, policy=lru, lookahead=2)",
  "offload(cache_rows=100, policy=lfu, lookahead=1)",
  "offload(cache_rows=100, policy=lookahead, lookahead=4)",
  "offload(cache_rows=100, policy=lru, lookahead=0)",
]

OPTIMIZERS = [
  base.OptimizerSpec(name="sgd", learning_rate=0.1),
  base.OptimizerSpec(name="rowwise_adagrad", learning_rate=0.1, initial_accumulator=0.1),
]


def _spec(opt, num_rows=1000, dim=8, pooling="sum"):
  return base.TableSpec(name="t", num_rows=num_rows, dim=dim, optimizer=opt, pooling=pooling)


@pytest.mark.parametrize("backend", EXACT)
@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: o.name)
def test_matches_dense(backend, opt):
  batches = testing.zipf_ids(seed=1, num_batches=6, batch=64, bag=3, num_rows=1000)
  mesh = None
  if "shard" in backend:
    from recgnn import sharding

    mesh = sharding.make_mesh(data=1, table=8)
  trace = testing.assert_matches_dense(backend, _spec(opt), batches, mesh=mesh)
  testing.assert_lookups_equal_table(
    trace.lookups[0], testing.run("dense", _spec(opt), []).table, batches[0]
  )


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: o.name)
def test_dense_update_is_sparse(opt):
  spec = _spec(opt, num_rows=200_000, dim=16)
  batch = testing.zipf_ids(seed=0, num_batches=1, batch=256, bag=2, num_rows=spec.num_rows)[0]
  testing.assert_update_is_sparse("dense", spec, batch)


def test_dense_matches_numpy_reference():
  """Row-wise Adagrad and SGD against a loop-per-row numpy implementation."""
  for opt in OPTIMIZERS:
    spec = _spec(opt, num_rows=50, dim=4)
    batches = testing.zipf_ids(seed=3, num_batches=4, batch=16, bag=3, num_rows=50)
    trace = testing.run("dense", spec, batches)
    import jax

    table = base.init_table(jax.random.key(0), spec).astype(np.float64)
    accum = np.full(50, opt.initial_accumulator)
    for step, ids in enumerate(batches):
      rows = np.where((ids >= 0)[..., None], table[np.maximum(ids, 0)], 0.0)
      np.testing.assert_allclose(trace.lookups[step], rows, rtol=1e-5, atol=1e-6)
      g = np.asarray(testing.grads_for(step, jax.numpy.asarray(rows, np.float32)), np.float64)
      g_row = np.zeros_like(table)
      for (b, slot), i in np.ndenumerate(ids):
        if i >= 0:
          g_row[i] += g[b, slot]
      touched = np.unique(ids[ids >= 0])
      if opt.name == "sgd":
        table[touched] -= opt.learning_rate * g_row[touched]
      else:
        accum[touched] += np.mean(g_row[touched] ** 2, axis=1)
        table[touched] -= (
          opt.learning_rate * g_row[touched] / (np.sqrt(accum[touched])[:, None] + opt.eps)
        )
    np.testing.assert_allclose(trace.table, table, rtol=1e-4, atol=1e-5)
