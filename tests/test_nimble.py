"""Nimble (TT node embeddings, KDD'22): node reordering, TT-SVD / eigen inits, and relabelled
graphs giving the same predictions per original node id."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.csgraph as csgraph
import scipy.sparse.linalg as spla

from experiments import sage_cora, sage_tt_synthetic
from recgnn import planner
from recgnn.backends import tt
from recgnn.embeddings import base
from recgnn.graphs import reorder, spectral, store, synthetic
from recgnn.tasks import node_classification as nc
from recgnn.train import loop
from tests import trainer_lib
from tests.trainer_lib import make_task


def prefix_sharing(adj: sp.csr_matrix, block: int) -> float:
  """Share of adjacency entries whose endpoints fall in the same id block of `block` ids
  (i // block == j // block): for block = n_2 * n_3, neighbours sharing a TT first digit."""
  rows = np.repeat(np.arange(adj.shape[0]), np.diff(adj.indptr))
  return float(np.mean(rows // block == adj.indices // block)) if adj.nnz else 0.0


@pytest.fixture(scope="module")
def graph():
  return synthetic.generate(
    synthetic.SyntheticSpec(
      num_nodes=3000, num_edges=30_000, num_classes=6, num_features=8, seed=4,
      split=(0.3, 0.1, 0.3),
    )
  )  # fmt: skip


# ----------------------------------------------------------------------------- relabel


def test_relabel_moves_every_attribute_with_its_node(graph):
  perm = np.random.default_rng(0).permutation(graph.num_nodes)
  g = graph.relabel(perm)
  p = sp.csr_matrix((np.ones(perm.size), (np.arange(perm.size), perm)), shape=graph.adj.shape)
  np.testing.assert_array_equal((p @ graph.adj @ p.T).toarray(), g.adj.toarray())  # P A P^T
  assert g.adj.has_sorted_indices and g.adj.nnz == graph.adj.nnz
  np.testing.assert_array_equal(g.labels, graph.labels[perm])
  np.testing.assert_array_equal(g.features, graph.features[perm])
  np.testing.assert_array_equal(g.original_ids, perm)
  for k, ids in graph.splits.items():
    np.testing.assert_array_equal(np.sort(perm[g.splits[k]]), ids)
  # Twice: original_ids compose; relabelling back by the inverse restores the graph.
  perm2 = np.random.default_rng(1).permutation(graph.num_nodes)
  gg = g.relabel(perm2)
  np.testing.assert_array_equal(gg.original_ids, perm[perm2])
  back = gg.relabel(np.argsort(gg.original_ids))
  np.testing.assert_array_equal(back.original_ids, np.arange(graph.num_nodes))
  assert (back.adj != graph.adj).nnz == 0
  with pytest.raises(ValueError, match="permutation"):
    graph.relabel(np.zeros(graph.num_nodes, np.int64))


# ----------------------------------------------------------------------------- orders


def test_orders_are_permutations_and_partition_keeps_communities_together(graph):
  n = graph.num_nodes
  block = -(-n // reorder.default_levels(n)[0])  # ids sharing the first TT digit
  share, span = {}, {}
  for order in ("none", "random", "rcm", "partition"):
    perm = reorder.node_order(graph, order, seed=0)
    g = graph if perm is None else graph.relabel(perm)
    if perm is not None:
      np.testing.assert_array_equal(np.sort(perm), np.arange(n))
    share[order] = prefix_sharing(g.adj, block)
    span[order] = reorder.mean_edge_span(g.adj)
  # RCM is scipy's; random is seeded.
  sym = reorder._symmetric_no_loops(graph.adj)
  np.testing.assert_array_equal(
    reorder.rcm_order(graph.adj), csgraph.reverse_cuthill_mckee(sym, symmetric_mode=True)
  )
  np.testing.assert_array_equal(reorder.random_order(n, 3), reorder.random_order(n, 3))
  # Neighbours share a first digit ~1/k of the time at random; partitioning (min edge cut,
  # balanced parts) makes that several times likelier, and beats RCM's unbalanced bands.
  assert share["random"] < 2.0 / reorder.default_levels(n)[0]
  assert share["partition"] > 5 * share["random"], share
  assert share["partition"] > share["rcm"], share
  assert span["partition"] < 0.5 * span["random"] and span["rcm"] < span["random"], span


def test_partition_blocks_are_metis_parts(graph):
  """Level one of the order is METIS k-way: the ids of block j are exactly part j."""
  k = 7
  perm = reorder.partition_order(graph.adj, levels=(k,), seed=0)
  parts = reorder.metis_parts(reorder._symmetric_no_loops(graph.adj), k, seed=0)
  sizes = np.bincount(parts, minlength=k)
  bounds = np.concatenate([[0], np.cumsum(sizes)])
  for j in range(k):
    np.testing.assert_array_equal(perm[bounds[j] : bounds[j + 1]], np.flatnonzero(parts == j))
  assert sizes.max() <= 1.1 * graph.num_nodes / k  # balanced


# ----------------------------------------------------------------------------- TT-SVD


def _random_tt(shape, seed=0):
  rng = np.random.default_rng(seed)
  return [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shape.core_shapes()]


def test_tt_svd_is_exact_at_full_rank_and_recovers_a_low_rank_tt():
  rng = np.random.default_rng(0)
  full = tt.tt_shape(500, 16, rank=10**6)
  table = rng.standard_normal((500, 16))
  cores = tt.tt_svd(table, full)
  np.testing.assert_allclose(tt.reconstruct(cores, 500), table, atol=1e-4)
  # A table that IS a rank-3 TT comes back exactly at rank 3 (TT-SVD is exact when the
  # unfoldings have rank <= r), in cores of the same shapes.
  low = tt.tt_shape(1000, 8, rank=3)
  table = np.asarray(tt.reconstruct(_random_tt(low), 1000))
  cores = tt.tt_svd(table, low)
  assert [c.shape for c in cores] == low.core_shapes()
  np.testing.assert_allclose(tt.reconstruct(cores, 1000), table, rtol=1e-3, atol=1e-4)
  norms = [np.linalg.norm(c) for c in cores]
  np.testing.assert_allclose(norms, norms[0], rtol=1e-5)  # balanced


def test_tt_svd_truncation_error_is_bounded_by_the_unfoldings_tails():
  """Oseledets' bound: ||A - TT-SVD_r(A)||^2 <= sum_k (tail of unfolding k beyond r)^2."""
  rng = np.random.default_rng(1)
  shape = tt.tt_shape(512, 8, rank=4, row_factors=(8, 8, 8), dim_factors=(2, 2, 2))
  table = rng.standard_normal((512, 8)) + np.asarray(tt.reconstruct(_random_tt(shape, 2), 512))
  err = np.linalg.norm(np.asarray(tt.reconstruct(tt.tt_svd(table, shape), 512)) - table) ** 2
  t = table.reshape(8, 8, 8, 2, 2, 2).transpose(0, 3, 1, 4, 2, 5)
  bound = 0.0
  for k in (1, 2):
    sv = np.linalg.svd(t.reshape(16**k, -1), compute_uv=False)
    bound += np.sum(sv[4:] ** 2)
  assert err <= bound * (1 + 1e-6)
  assert err < np.linalg.norm(table) ** 2  # and it does capture something


def test_tt_svd_init_from_a_file_through_the_plan(tmp_path):
  """tt(init=tt_svd, init_path=F): the table starts as the TT-SVD of F, at the table's
  initializer variance, whatever F's scale."""
  spec = base.TableSpec(name="node", num_rows=1000, dim=8, initializer="normal")
  low = tt.tt_shape(1000, 8, rank=4)
  target = 37.0 * np.asarray(tt.reconstruct(_random_tt(low, 5), 1000))  # a rank-4 TT
  path = tmp_path / "init.npy"
  np.save(path, target.astype(np.float32))
  b = planner.make_backend(f"tt(rank=4, init=tt_svd, init_path='{path}')", spec)
  state = b.init(jax.random.key(0))
  table = b.tables(state)["node"]
  assert abs(table.var() - 1 / 8) < 0.01 / 8  # normal initializer: Var 1/dim
  corr = np.corrcoef(table.ravel(), target.ravel())[0, 1]
  assert corr > 0.9999
  assert "init=tt_svd" in b.describe("node")
  with pytest.raises(ValueError, match="go together"):
    planner.make_backend("tt(rank=4, init=tt_svd)", spec)
  np.save(tmp_path / "bad.npy", target[:10].astype(np.float32))
  bad = planner.make_backend(f"tt(rank=4, init=tt_svd, init_path='{tmp_path / 'bad.npy'}')", spec)
  with pytest.raises(ValueError, match="need"):
    bad.init(jax.random.key(0))
  # A truncated file (a copy cut short): refused naming it, never compressed.
  cut = tmp_path / "cut.npy"
  cut.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
  cut_b = planner.make_backend(f"tt(rank=4, init=tt_svd, init_path='{cut}')", spec)
  with pytest.raises(ValueError, match=f"{cut}.*not a whole .npy array"):
    cut_b.init(jax.random.key(0))


def test_eigen_embedding_spans_the_leading_eigenvectors():
  g = synthetic.generate(
    synthetic.SyntheticSpec(num_nodes=1500, num_edges=30_000, num_classes=4, homophily=0.9)
  )
  dim = 4
  vecs, vals = spectral.eigen_embedding(g.adj, dim)
  s = spectral.normalized_adjacency(g.adj)
  ref_vals, ref_vecs = spla.eigsh(s, k=dim, which="LA")
  np.testing.assert_allclose(np.sort(vals), np.sort(ref_vals), atol=1e-3)
  np.testing.assert_allclose(vecs.T @ vecs, np.eye(dim), atol=1e-4)
  # Same subspace: the projection of each reference eigenvector onto ours has norm ~1.
  proj = np.linalg.norm(vecs.T.astype(np.float64) @ ref_vecs, axis=0)
  np.testing.assert_allclose(proj, 1.0, atol=1e-3)


# ----------------------------------------------------------------------------- the task


def _cora(order: str, cache_dir: str, inputs: str = "features"):
  c = sage_cora.get_config()
  c.data.node_order = order
  c.data.cache_dir = cache_dir
  c.data.partition_levels = None
  c.model.inputs = inputs
  c.embeddings.dim = 8
  return make_task(nc.TASK, c)


def _predict_all(task, params, table=None):
  predict = jax.jit(task.predict)
  outs = []
  for b in task.eval_batches("test"):
    emb = {}
    if table is not None:
      ids = b["ids"]["node"][:, 0]
      emb = {"node": jnp.asarray(np.where(ids[:, None] >= 0, table[np.maximum(ids, 0)], 0.0))}
    outs.append(jax.device_get(predict(params, b, emb)))
  return task.predictions(outs)


@pytest.mark.parametrize("order", ["random", "partition"])
@pytest.mark.parametrize("inputs", ["features", "embeddings"])
def test_relabelled_graph_gives_the_same_predictions_per_original_id(tmp_path, order, inputs):
  """The same params (and node table, its rows moved with their nodes) on Cora and on Cora
  relabelled: identical logits for every test node, matched through original ids."""
  a = _cora("none", str(tmp_path), inputs)
  b = _cora(order, str(tmp_path), inputs)
  perm = b.graph.original_ids
  assert not np.array_equal(perm, np.arange(perm.size))
  table_a = table_b = None
  if inputs == "embeddings":
    table_a = np.random.default_rng(0).standard_normal((a.graph.num_nodes, 8)).astype(np.float32)
    table_b = table_a[perm]  # row j of the relabelled table is node perm[j]'s
  example = next(iter(a.eval_batches("valid")))
  emb = {"node": jnp.zeros((example["ids"]["node"].shape[0], 8))} if table_a is not None else {}
  params = a.init_params(jax.random.key(0), example, emb)
  pa, pb = _predict_all(a, params, table_a), _predict_all(b, params, table_b)
  np.testing.assert_array_equal(pa["node"], pb["node"])
  np.testing.assert_array_equal(pa["node"], np.sort(a.graph.splits["test"]))
  np.testing.assert_allclose(pa["logits"], pb["logits"], rtol=1e-4, atol=1e-5)
  np.testing.assert_array_equal(pa["pred"], pb["pred"])
  # The order is cached: a second task loads the same permutation, from the file it names.
  c = _cora(order, str(tmp_path), inputs)
  np.testing.assert_array_equal(c.graph.original_ids, perm)
  np.testing.assert_array_equal(np.load(c.load_info["node_order_file"]), perm)
  assert c.load_info["node_order_file"] in c.describe()


def test_sage_tt_synthetic_config_and_compression():
  c = sage_tt_synthetic.get_config()
  rep = sage_tt_synthetic.compression(
    c.data.synthetic.num_nodes, c.embeddings.dim, c.embeddings.plan
  )
  assert c.data.synthetic.num_nodes == 1_000_000 and rep["ratio"] >= 1000
  assert c.data.node_order == "partition"
  e = sage_tt_synthetic.get_config("init=eigen,order=random")
  assert "init=tt_svd" in e.embeddings.plan[0][1] and e.embeddings.node_init == "eigen"
  assert e.embeddings.node_init_path in e.embeddings.plan[0][1]
  with pytest.raises(ValueError, match="available"):
    sage_tt_synthetic.get_config("init=eigne")


@pytest.mark.slow
def test_eigen_init_reaches_the_tt_cores_through_the_trainer(tmp_path):
  """embeddings.node_init=eigen: the task writes the eigenvectors of the (partition-ordered)
  graph; the tt backend starts from their TT-SVD; TT node embeddings train well above chance."""
  c = sage_tt_synthetic.get_config("init=eigen,rank=4")
  s = c.data.synthetic
  s.num_nodes, s.num_edges, s.num_classes, s.split = 3000, 30_000, 4, (0.3, 0.1, 0.3)
  c.data.cache_dir = str(tmp_path / "cache")
  path = str(tmp_path / "eigen.npy")
  c.embeddings.node_init_path = path
  c.embeddings.plan = [(".*", f"tt(rank=4, init=tt_svd, init_path='{path}')")]
  c.embeddings.dim = 16
  c.model.hidden = 32
  c.sampler.batch_size, c.sampler.eval_batch_size, c.sampler.bulk = 128, 512, 4
  c.sampler.fanouts = c.sampler.eval_fanouts = (5, 5)
  c.train.steps, c.train.log_every = 100, 100
  res = loop.train(c, str(tmp_path / "wd"))
  vecs = np.load(path)
  assert vecs.shape == (3000, 16)
  task = make_task(nc.TASK, c)  # the same relabelled graph: its eigenvectors are the file's
  ref, _ = spectral.eigen_embedding(task.graph.adj, 16)
  np.testing.assert_allclose(vecs, ref, atol=1e-5)
  m = res.metrics
  assert m["test/accuracy"] > m["chance_accuracy"] + 0.3, m


def test_store_rejects_bad_original_ids(graph):
  import dataclasses

  with pytest.raises(ValueError, match="original_ids"):
    dataclasses.replace(graph, original_ids=np.arange(3))
  assert isinstance(graph, store.Graph)


def test_sage_tt_ogb_on_the_raw_ogb_layout(tmp_path):
  """The OGB-layout variant, feature-less, partition order and eigen init, end to end."""
  from test_graphs import _ogb_fixture

  from experiments import sage_tt_ogb

  root = str(tmp_path / "ogbn_tiny")
  _, _, labels, parts = _ogb_fixture(root)
  c = sage_tt_ogb.get_config("init=eigen,rank=2")
  c.data.path = root
  c.data.cache_dir = str(tmp_path / "cache")
  path = str(tmp_path / "eigen.npy")
  c.embeddings.node_init_path = path
  c.embeddings.plan = [(".*", f"tt(rank=2, init=tt_svd, init_path='{path}')")]
  c.embeddings.dim = 8
  c.model.hidden = 8
  c.sampler.fanouts = c.sampler.eval_fanouts = (3, 3)
  c.sampler.batch_size, c.sampler.eval_batch_size = 8, 16
  c.train.steps, c.train.log_every, c.train.eval_every, c.train.checkpoint_every = 6, 3, 0, 0
  with trainer_lib.eval_predictions() as seen:
    res = loop.train(c, str(tmp_path / "wd"))
  assert res.metrics["step"] == 6  # (the graph relabelled: predictions by the dataset's ids)
  trainer_lib.assert_accuracy_from_raw_labels(res.metrics, seen, labels, parts["test"])
  task = make_task(nc.TASK, c)
  assert not np.array_equal(task.graph.original_ids, np.arange(task.graph.num_nodes))
  assert np.load(path).shape == (task.graph.num_nodes, 8)
