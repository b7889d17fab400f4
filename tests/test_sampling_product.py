"""The device node-wise sampler's sparse-product path (P = Q @ A formed first,
`device_sampling.product_rows`) gives the direct CSR reads' sample exactly."""

import jax
import numpy as np
import pytest

from recgnn.graphs import device_sampling, synthetic


@pytest.fixture(scope="module")
def graph():
  spec = synthetic.SyntheticSpec(num_nodes=3000, num_edges=30_000, num_classes=4, seed=5)
  return synthetic.generate(spec)


@pytest.mark.parametrize("fanouts", [(5, 3), (-1, 2)])
def test_product_path_gives_the_direct_sample(graph, fanouts):
  kw = dict(fanouts=fanouts, batch_size=24)
  direct = device_sampling.DeviceNeighborSampler(graph.adj, **kw)
  product = device_sampling.DeviceNeighborSampler(graph.adj, materialize=True, **kw)
  rng = np.random.default_rng(0)
  seeds = rng.permutation(3000)[:120].reshape(5, 24)  # k = 5: padded to 8 batches
  seeds[4, 20:] = -1
  key = jax.random.key(0)
  a = jax.device_get(direct.sample_device(seeds, key))
  b = jax.device_get(product.sample_device(seeds, key))
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(x, y)
  assert int(a[2].sum()) > 0


def test_product_rows_are_the_selected_rows(graph):
  """P = Q @ A row by row: row r of P is A's row rows[r], padding rows empty."""
  adj = graph.adj
  rows = np.array([7, -1, 0, 2999, 7], np.int32)
  cap = int(np.sort(np.diff(adj.indptr))[::-1][:5].sum())
  indptr, indices = device_sampling.product_rows(
    adj.indptr.astype(np.int32), adj.indices.astype(np.int32), rows, cap
  )
  indptr, indices = np.asarray(indptr), np.asarray(indices)
  for r, v in enumerate(rows):
    got = indices[indptr[r] : indptr[r + 1]]
    want = adj.indices[adj.indptr[v] : adj.indptr[v + 1]] if v >= 0 else []
    np.testing.assert_array_equal(got, want)
