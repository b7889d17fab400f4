"""Matrix-based bulk samplers: validity, shapes, the product formulation, distributions.

Tests parametrized over `where` run the same checks on the host samplers (numpy / scipy)
and on the device samplers (jitted JAX, recgnn/graphs/device_sampling.py): the device
samplers must pass the host samplers' distribution tests and sample only neighbours.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.sparse as sp
from scipy import stats

from recgnn import sharding
from recgnn.graphs import (
  device_ladies,
  device_sampling,
  ladies,
  samplers,
  sampling,
  split_sampling,
  store,
  synthetic,
)
from tests.trainer_lib import make_task

WHERE = ("host", "device")


def node_sampler(where, adj, **kw):
  cls = sampling.NeighborSampler if where == "host" else device_sampling.DeviceNeighborSampler
  return cls(adj, **kw)


def ladies_sampler(where, adj, **kw):
  cls = ladies.LadiesSampler if where == "host" else device_ladies.DeviceLadiesSampler
  return cls(adj, **kw)


def draw_offsets(where, deg, fanout, rng):
  """(offsets int[R, fanout], mask) from the host or the device kernel."""
  if where == "host":
    return sampling.draw_offsets(deg, fanout, rng)
  u = jax.random.uniform(device_sampling.key_from(rng), (deg.size, fanout))
  off, mask = device_sampling.draw_offsets(jnp.asarray(deg, jnp.int32), fanout, u)
  return np.asarray(off), np.asarray(mask)


def weighted_draw(where, prob, s, rng):
  """(rows, cols) of s weighted draws per row of the CSR `prob`, host or device."""
  if where == "host":
    return ladies.weighted_draw(prob, s, rng)
  dense = jnp.asarray(prob.toarray(), jnp.float32)
  cols, valid = device_ladies.weighted_draw(dense, s, device_sampling.key_from(rng))
  cols, valid = np.asarray(cols), np.asarray(valid)
  rows = np.broadcast_to(np.arange(cols.shape[0])[:, None], cols.shape)
  return rows[valid], cols[valid]


@pytest.fixture(scope="module")
def graph():
  return synthetic.generate(
    synthetic.SyntheticSpec(num_nodes=3000, num_edges=30_000, num_classes=4, seed=5)
  )


def star(degree: int) -> sp.csr_matrix:
  """Node 0 linked to nodes 1..degree."""
  leaves = np.arange(1, degree + 1)
  return store.csr_from_edges(np.zeros(degree, np.int64), leaves, degree + 1)


def check_node_blocks(adj, sampler, blocks, seeds):
  """Every sampled edge is an edge of adj; fanouts, padding and frontier layout hold."""
  adj = sp.csr_matrix(adj)
  deg = np.diff(adj.indptr)
  assert blocks.nodes.shape == (seeds.shape[0], sampler.sizes[-1])
  for b in range(blocks.k):
    nodes = blocks.nodes[b]
    np.testing.assert_array_equal(nodes[: seeds.shape[1]], seeds[b])
    for d, layer in enumerate(blocks.layers):
      n_dst, f = sampler.sizes[d], sampler.fanouts[d]
      nbr, mask = layer["nbr"][b], layer["mask"][b]
      assert nbr.shape == (n_dst, f) and mask.shape == (n_dst, f) and nbr.dtype == np.int32
      dst = nodes[:n_dst]
      frontier = nodes[: sampler.sizes[d + 1]]
      valid_nodes = frontier[frontier >= 0]
      assert np.unique(valid_nodes).size == valid_nodes.size  # deduplicated
      # Padding rows sample nothing; padded slots point at 0.
      assert not mask[dst < 0].any() and (nbr[~mask] == 0).all()
      if blocks.dropped == 0:
        expect = np.where(dst >= 0, np.minimum(deg[np.maximum(dst, 0)], f), 0)
        np.testing.assert_array_equal(mask.sum(1), expect)
      r, c = np.nonzero(mask)
      u, v = dst[r], frontier[nbr[r, c]]
      assert (u >= 0).all() and (v >= 0).all()
      assert np.all(np.asarray(adj[u, v]).ravel() > 0), "sampled a non-neighbour"
      # Without replacement: no neighbour twice in a row.
      pairs = u.astype(np.int64) * adj.shape[0] + v
      assert np.unique(pairs).size == pairs.size
    assert blocks.num_edges[b].tolist() == [lay["mask"][b].sum() for lay in blocks.layers]


@pytest.mark.parametrize("where", WHERE)
def test_node_sampler_blocks_are_valid(graph, where):
  rng = np.random.default_rng(0)
  s = node_sampler(where, graph.adj, fanouts=[6, 3, 2], batch_size=50)
  seeds = rng.permutation(graph.num_nodes)[:150].reshape(3, 50)
  seeds[2, 40:] = -1  # a last, partial batch
  blocks = s.sample(seeds, rng)
  assert blocks.k == 3 and blocks.dropped == 0
  assert s.sizes == (50, 350, 350 + 350 * 3, 350 + 350 * 3 + (350 + 1050) * 2)
  check_node_blocks(graph.adj, s, blocks, seeds)


@pytest.mark.parametrize("where", WHERE)
def test_capacities_drop_and_count(graph, where):
  rng = np.random.default_rng(1)
  seeds = rng.permutation(graph.num_nodes)[:128].reshape(2, 64)
  full = node_sampler(where, graph.adj, fanouts=[8, 4], batch_size=64)
  caps = sampling.estimate_capacities(full, seeds, np.random.default_rng(2), margin=1.2)
  assert caps[0] < full.sizes[1] and caps[1] < full.sizes[2]
  roomy = node_sampler(where, graph.adj, fanouts=[8, 4], batch_size=64, capacities=caps)
  check_node_blocks(graph.adj, roomy, roomy.sample(seeds, rng), seeds)
  tight = node_sampler(where, graph.adj, fanouts=[8, 4], batch_size=64, capacities=[100, 150])
  blocks = tight.sample(seeds, rng)
  assert tight.sizes == (64, 100, 150) and blocks.dropped > 0
  check_node_blocks(graph.adj, tight, blocks, seeds)


def test_materialized_product_gives_the_same_sample(graph):
  """Reading P = Q @ A's rows from A's CSR is the product: same draws, same sample."""
  seeds = np.random.default_rng(3).permutation(graph.num_nodes)[:160].reshape(4, 40)
  kw = dict(fanouts=[5, 4], batch_size=40)
  fast = sampling.NeighborSampler(graph.adj, **kw).sample(seeds, np.random.default_rng(9))
  prod = sampling.NeighborSampler(graph.adj, materialize=True, **kw)
  ref = prod.sample(seeds, np.random.default_rng(9))
  np.testing.assert_array_equal(fast.nodes, ref.nodes)
  for a, b in zip(fast.layers, ref.layers):
    np.testing.assert_array_equal(a["nbr"], b["nbr"])
    np.testing.assert_array_equal(a["mask"], b["mask"])
  rows = seeds[0]
  p = sampling.selection_matrix(rows, graph.num_nodes) @ graph.adj
  assert (p != graph.adj[rows]).nnz == 0


@pytest.mark.parametrize("where", WHERE)
def test_fanout_all_takes_every_neighbour(graph, where):
  s = node_sampler(where, graph.adj, fanouts=[-1], batch_size=10)
  seeds = np.arange(10)[None]
  blocks = s.sample(seeds, np.random.default_rng(0))
  got = blocks.nodes[0][blocks.layers[0]["nbr"][0]]
  for i in range(10):
    row = np.sort(got[i][blocks.layers[0]["mask"][0][i]])
    np.testing.assert_array_equal(
      row, graph.adj.indices[graph.adj.indptr[i] : graph.adj.indptr[i + 1]]
    )
  hub = star(5000)
  with pytest.raises(ValueError, match="finite fanout"):
    node_sampler(where, hub, fanouts=[-1], batch_size=1)


def uniform_subsets_pvalue(draw_subsets, degree: int, fanout: int) -> float:
  """Chi-square p-value of subset counts against 'every fanout-subset equally likely'."""
  subsets = draw_subsets()
  index = {c: i for i, c in enumerate(itertools.combinations(range(degree), fanout))}
  counts = np.bincount([index[tuple(sorted(r))] for r in subsets.tolist()], minlength=len(index))
  return stats.chisquare(counts).pvalue


@pytest.mark.parametrize("where", WHERE)
def test_draw_offsets_is_uniform_over_subsets(where):
  deg, f, n = 6, 3, 20_000  # 20 subsets, 1000 expected each
  rng = np.random.default_rng(11)
  draws = lambda: draw_offsets(where, np.full(n, deg), f, rng)[0]
  assert uniform_subsets_pvalue(draws, deg, f) > 1e-3
  # A high degree: each offset is included with probability f / deg.
  big, f2 = 1000, 7
  picks = draw_offsets(where, np.full(n, big), f2, rng)[0]
  assert all(np.unique(r).size == f2 for r in picks[:200])
  assert stats.chisquare(np.bincount(picks.ravel(), minlength=big)).pvalue > 1e-3
  # The same test has power: distinct subsets from weighted keys (neighbours 0 and 1 a
  # little likelier) are rejected.
  weights = np.array([1.3, 1.3, 1, 1, 1, 1])
  biased_distinct = lambda: np.argsort(rng.random((n, deg)) / weights, 1)[:, :f]
  assert uniform_subsets_pvalue(biased_distinct, deg, f) < 1e-6


@pytest.mark.parametrize("where", WHERE)
def test_node_sampler_is_uniform_over_neighbours(where):
  """Through the whole sampler: a degree-40 node, fanout 5, many rows in one bulk product."""
  deg, f = 40, 5
  adj = star(deg)
  s = node_sampler(where, adj, fanouts=[f], batch_size=500)
  blocks = s.sample(np.zeros((8, 500), np.int64), np.random.default_rng(4))
  counts = np.zeros(deg + 1)
  for b in range(blocks.k):
    picked = blocks.nodes[b][blocks.layers[0]["nbr"][b]]
    assert blocks.layers[0]["mask"][b].all()
    np.add.at(counts, picked.ravel(), 1)
  assert counts[0] == 0 and counts.sum() == 8 * 500 * f
  # Each of the 4000 rows includes each neighbour with probability f / deg.
  assert stats.chisquare(counts[1:]).pvalue > 1e-3


@pytest.mark.parametrize("where", WHERE)
def test_ladies_probabilities_are_column_norms(graph, where):
  s = ladies_sampler(where, graph.adj, layer_sizes=[64], batch_size=20)
  frontier = np.random.default_rng(6).permutation(graph.num_nodes)[:60].reshape(3, 20)
  frontier[1, 15:] = -1
  prob = s.probabilities(frontier)
  prob = prob.toarray() if sp.issparse(prob) else prob
  lap = ladies.ladies_matrix(graph.adj).toarray()
  tol = dict(rtol=1e-10, atol=1e-15) if where == "host" else dict(rtol=1e-5, atol=1e-9)
  for b in range(3):
    rows = frontier[b][frontier[b] >= 0]
    ref = (lap[rows] ** 2).sum(0)
    np.testing.assert_allclose(prob[b], ref / ref.sum(), **tol)
  np.testing.assert_allclose(lap.sum(1), 1.0)  # row-normalised A + I
  assert np.all(np.diag(lap) > 0)


@pytest.mark.parametrize("where", WHERE)
def test_weighted_draw_follows_probabilities(where):
  rng = np.random.default_rng(7)
  p = np.array([0.05, 0.1, 0.15, 0.3, 0.4])
  k = 20_000
  prob = sp.csr_matrix(np.tile(p, (k, 1)))
  rows, cols = weighted_draw(where, prob, 1, rng)
  np.testing.assert_array_equal(rows, np.arange(k))
  assert stats.chisquare(np.bincount(cols, minlength=5), p * k).pvalue > 1e-3
  assert stats.chisquare(np.bincount(cols, minlength=5), np.full(5, k / 5)).pvalue < 1e-6
  rows, cols = weighted_draw(where, prob[:50], 3, rng)
  assert np.all(np.bincount(rows) == 3)
  assert all(np.unique(cols[rows == r]).size == 3 for r in range(50))


@pytest.mark.parametrize("where", WHERE)
def test_ladies_blocks(graph, where):
  rng = np.random.default_rng(8)
  s = ladies_sampler(where, graph.adj, layer_sizes=[100, 200], batch_size=32)
  seeds = rng.permutation(graph.num_nodes)[:96].reshape(3, 32)
  blocks = s.sample(seeds, rng)
  assert s.sizes == (32, 132, 332) and blocks.dropped == 0
  lap = ladies.ladies_matrix(graph.adj)
  for b in range(3):
    nodes = blocks.nodes[b]
    np.testing.assert_array_equal(nodes[:32], seeds[b])
    for d, layer in enumerate(blocks.layers):
      src, dst, w = layer["src"][b], layer["dst"][b], layer["weight"][b]
      live = w > 0
      assert live.sum() == blocks.num_edges[b, d] > 0
      u, v = nodes[dst[live]], nodes[src[live]]
      assert (u >= 0).all() and (v >= 0).all()
      assert np.all(np.asarray(lap[u, v]).ravel() > 0), "edge not in A + I"
      assert (src[live] < s.sizes[d + 1]).all() and (dst[live] < s.sizes[d]).all()
      # Row-normalised: every destination with an edge sums to 1.
      sums = np.bincount(dst[live], weights=w[live], minlength=s.sizes[d])
      np.testing.assert_allclose(sums[np.unique(dst[live])], 1.0, rtol=1e-5)
      # New nodes per layer are at most layer_sizes[d].
      new = nodes[s.sizes[d] : s.sizes[d + 1]]
      assert (new >= 0).sum() <= s.layer_sizes[d]


def test_chunked_dedup_gives_the_same_sample(graph, monkeypatch):
  seeds = np.random.default_rng(12).permutation(graph.num_nodes)[:320].reshape(8, 40)
  s = sampling.NeighborSampler(graph.adj, fanouts=[5, 3], batch_size=40)
  whole = s.sample(seeds, np.random.default_rng(1))
  monkeypatch.setattr(sampling, "DEDUP_CHUNK", 500)  # 8 batches -> several groups
  parts = s.sample(seeds, np.random.default_rng(1))
  np.testing.assert_array_equal(whole.nodes, parts.nodes)
  for a, b in zip(whole.layers, parts.layers):
    np.testing.assert_array_equal(a["nbr"], b["nbr"])
    np.testing.assert_array_equal(a["mask"], b["mask"])


@pytest.mark.parametrize("where", WHERE)
def test_all_padding_batches(graph, where):
  s = node_sampler(where, graph.adj, fanouts=[3, 2], batch_size=4)
  blocks = s.sample(np.full((2, 4), -1), np.random.default_rng(0))
  assert (blocks.nodes == -1).all() and blocks.num_edges.sum() == 0
  assert not any(layer["mask"].any() for layer in blocks.layers)


def test_seeds_shape_error(graph):
  s = sampling.NeighborSampler(graph.adj, fanouts=[2], batch_size=8)
  with pytest.raises(ValueError, match="seeds must be"):
    s.sample(np.zeros((2, 7), np.int64), np.random.default_rng(0))
  with pytest.raises(ValueError, match="fanouts"):
    sampling.NeighborSampler(graph.adj, fanouts=[0], batch_size=8)


def _split_layers_vs_one_device(one, split, seeds, key):
  """Both samplers' sample_device on the seeds padded to the 8 devices (5 batches -> 8), same
  key: the same nodes, edge counts and dropped count. Returns the (1-device, split) layer
  pairs for the sampler's own per-layer checks."""
  padded = split.pad_seeds(seeds)
  assert padded.shape == (8, seeds.shape[1])
  ref = jax.device_get(one.sample_device(padded, key))
  got = jax.device_get(split.sample_device(padded, key))
  np.testing.assert_array_equal(ref[0], got[0])
  np.testing.assert_array_equal(ref[2], got[2])
  assert int(ref[3]) == int(got[3])
  assert len(ref[1]) == len(got[1]) == len(split.sizes) - 1
  return list(zip(ref[1], got[1]))


def test_split_graph_sample_equals_one_device(graph):
  """Rows split over 8 devices, per-hop shard_map with all_gather / psum_scatter: the same
  draws as the 1-device sampler, hence the same sample; and the collectives are in the HLO."""
  mesh = sharding.make_mesh(8, 1)
  kw = dict(fanouts=[5, 3], batch_size=30)
  one = device_sampling.DeviceNeighborSampler(graph.adj, **kw)
  split = split_sampling.SplitNeighborSampler(graph.adj, mesh=mesh, **kw)
  seeds = np.random.default_rng(13).permutation(graph.num_nodes)[:150].reshape(5, 30)
  seeds[4, 20:] = -1
  key = jax.random.key(21)
  for a, b in _split_layers_vs_one_device(one, split, seeds, key):
    np.testing.assert_array_equal(a["nbr"], b["nbr"])
    np.testing.assert_array_equal(a["mask"], b["mask"])
  check_node_blocks(graph.adj, split, split.sample(seeds, key), seeds)
  # Each device holds about 1/8 of the edges.
  assert split.adjacency_bytes_per_device < graph.adj.nnz * 4 / 4
  # Per hop: an all-gather of the frontier and a reduce-scatter of the candidates
  # (k * n_l * f_l int32 operands); the replicated graph moves nothing.
  hops = split.hop_bytes(8)
  for layer, h in enumerate(hops):
    n, f = split.sizes[layer], split.fanouts[layer]
    assert h["by_op"]["reduce-scatter"]["operand_bytes"] == 8 * n * f * 4
    assert h["by_op"]["all-gather"]["operand_bytes"] == n * 4  # one local batch
  assert all(
    h["total_operand_bytes"] == 0 for h in split_sampling.replicated_hop_bytes(one, mesh, 8)
  )


def test_where_is_checked(graph):
  with pytest.raises(ValueError, match="available: host, device"):
    samplers.make(graph.adj, "node", "gpu", batch_size=4, fanouts=[2])


def small_task_config(where: str, split_devices: int = 0):
  from experiments import sage_synthetic

  c = sage_synthetic.get_config()
  c.data.synthetic.num_nodes = 2000
  c.data.synthetic.num_edges = 16_000
  c.data.synthetic.num_classes = 4
  c.data.synthetic.num_features = 8
  c.data.synthetic.split = (0.3, 0.1, 0.3)
  c.model.inputs = "features"
  c.sampler.where = where
  c.sampler.split_devices = split_devices
  c.sampler.fanouts = (4, 3)
  c.sampler.eval_fanouts = (4, 3)
  c.sampler.batch_size = 64
  c.sampler.eval_batch_size = 256
  c.sampler.bulk = 4
  return c


def test_task_sampler_where_selects_the_sampler_and_resumes_exactly():
  """sampler.where=device: the task's batches come from the device sampler, are valid
  blocks, and a resumed stream repeats the same neighbours (keys derive from the seed)."""
  from recgnn.tasks import node_classification as nc

  task = make_task(nc.TASK, small_task_config("device"))
  assert isinstance(task.sampler, device_sampling.DeviceNeighborSampler)
  assert isinstance(task.eval_sampler, device_sampling.DeviceNeighborSampler)
  it = task.train_batches(0)
  stream = [next(it) for _ in range(6)]
  resumed = next(task.train_batches(5))
  for key in ("x", "labels", "nbr0", "mask0", "nbr1", "mask1"):
    np.testing.assert_array_equal(resumed[key], stream[5][key])
  split = make_task(nc.TASK, small_task_config("device", split_devices=8))
  assert isinstance(split.sampler, split_sampling.SplitNeighborSampler)
  # The same seed, the same (epoch, group) keys: the split graph gives the same batches.
  for a, b in zip(stream, split.train_batches(0)):
    for key in ("x", "nbr0", "mask0", "nbr1", "mask1"):
      np.testing.assert_array_equal(a[key], b[key])
  with pytest.raises(ValueError, match="sampler.where=device"):
    make_task(nc.TASK, small_task_config("host", split_devices=8))


@pytest.mark.parametrize("capacity", [None, 1.5])
def test_split_graph_all_to_all_exchange(graph, capacity):
  """Requests to the rows' owners and answers back by all_to_all (on a 2 x 4 mesh): the
  1-device sample (exact capacity, or a fitted one that did not overflow), fewer bytes."""
  mesh = sharding.make_mesh(2, 4)
  kw = dict(fanouts=[5, 3], batch_size=30)
  one = device_sampling.DeviceNeighborSampler(graph.adj, **kw)
  split = split_sampling.SplitNeighborSampler(
    graph.adj, mesh=mesh, exchange="all_to_all", exchange_capacity=capacity, **kw
  )
  seeds = np.random.default_rng(13).permutation(graph.num_nodes)[:150].reshape(5, 30)
  seeds[4, 20:] = -1
  padded = split.pad_seeds(seeds)
  key = jax.random.key(21)
  ref = jax.device_get(one.sample_device(padded, key))
  got = jax.device_get(split.sample_device(padded, key))
  assert int(got[3]) == 0
  np.testing.assert_array_equal(ref[0], got[0])
  for a, b in zip(ref[1], got[1]):
    np.testing.assert_array_equal(a["nbr"], b["nbr"])
    np.testing.assert_array_equal(a["mask"], b["mask"])
  for layer, h in enumerate(split.hop_bytes(8)):
    assert set(h["by_op"]) == {"all-to-all"}
    cap = split.pair_capacity(split.sizes[layer])  # one local batch of n_l rows
    assert h["by_op"]["all-to-all"]["operand_bytes"] == 8 * cap * (2 + split.fanouts[layer]) * 4
  # A capacity too small drops rows, counted; what is kept is still valid.
  tight = split_sampling.SplitNeighborSampler(
    graph.adj, mesh=mesh, exchange="all_to_all", exchange_capacity=0.3, exchange_margin=0, **kw
  )
  blocks = tight.sample(seeds, key)
  assert blocks.dropped > 0
  mask = blocks.layers[0]["mask"]
  nodes = blocks.nodes
  r, c = np.nonzero(mask[0])
  u, v = nodes[0][r], nodes[0][blocks.layers[0]["nbr"][0][r, c]]
  assert np.all(np.asarray(graph.adj[u, v]).ravel() > 0)


@pytest.mark.slow
def test_split_graph_ladies_equals_one_device(graph):
  """LADIES with Ahat's rows split over 8 devices (all-gather of the frontier, reduce-scatter
  of P's entries, each read by its owner): the 1-device sample bit for bit (nodes, edges;
  weights to an ulp), and those collectives in the HLO, sized k x C_l per layer. Slow: the
  two LADIES programs take ~10-20 s to compile on this CPU."""
  mesh = sharding.make_mesh(2, 4)  # the rows split over both axes: every device
  kw = dict(layer_sizes=[60, 80], batch_size=24)
  one = device_ladies.DeviceLadiesSampler(graph.adj, **kw)
  split = split_sampling.SplitLadiesSampler(graph.adj, mesh=mesh, **kw)
  seeds = np.random.default_rng(4).permutation(graph.num_nodes)[:120].reshape(5, 24)
  seeds[4, 10:] = -1
  for a, b in _split_layers_vs_one_device(one, split, seeds, jax.random.key(3)):
    np.testing.assert_array_equal(a["src"], b["src"])
    np.testing.assert_array_equal(a["dst"], b["dst"])
    # The weights' arithmetic is the same, but XLA fuses it differently in the two programs
    # (1 batch per device vs 8 at once): within an ulp or two.
    np.testing.assert_allclose(a["weight"], b["weight"], rtol=5e-7, atol=0)
  assert split.adjacency_bytes_per_device < (graph.adj.nnz + graph.num_nodes) * 8 / 4
  for layer, h in enumerate(split.hop_bytes(8)):
    assert h["by_op"]["all-gather"]["operand_bytes"] == split.sizes[layer] * 4  # 1 batch
    # (column + 1, value) of k x C_l entries, int32 + float32.
    assert h["by_op"]["reduce-scatter"]["operand_bytes"] == 8 * split.entry_capacities[layer] * 8
  # Through the task: sampler.kind=ladies, where=device, split over 8 devices.
  from recgnn.tasks import node_classification as nc

  c = small_task_config("device", split_devices=8)
  c.sampler.kind = "ladies"
  c.sampler.layer_sizes = (64, 64)
  task = make_task(nc.TASK, c)
  assert isinstance(task.sampler, split_sampling.SplitLadiesSampler)
  assert isinstance(task.eval_sampler, split_sampling.SplitLadiesSampler)
