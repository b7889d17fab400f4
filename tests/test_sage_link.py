"""GraphSAGE link prediction on homogeneous graphs (recgnn/tasks/sage_link): the random link
split as PyG's RandomLinkSplit, OGB linkproppred's .npz layout, the negatives, the metrics
against plain references, no held-out or batch edge in a training step's message passing,
resume; the trainer runs (training, resume, 8 devices vs 1) under -m long."""

from __future__ import annotations

import shutil

import ml_collections
import numpy as np
import pytest

from experiments import linkpred_planted
from recgnn import metrics as metrics_lib
from recgnn.data import graph_loading, link_split, ogbl
from recgnn.graphs import store
from recgnn.tasks import sage_link
from recgnn.tasks.sage_link import batches as B
from recgnn.tasks.sage_link import scores
from recgnn.train import loop
from tests.trainer_lib import make_task, state_leaves


def small_config(inputs: str = "features", steps: int = 10) -> ml_collections.ConfigDict:
  c = linkpred_planted.get_config()
  c.data.synthetic = linkpred_planted.synthetic(600, 4000, 8 if inputs != "embeddings" else 0)
  c.data.synthetic.num_classes = 10
  c.model.inputs = inputs
  c.model.hidden = c.model.out = 16
  c.embeddings.dim = 8
  c.sampler.fanouts = c.sampler.eval_fanouts = (5, 3)
  c.sampler.batch_size = 64
  c.sampler.eval_batch_size = 256
  c.sampler.bulk = 2
  c.sampler.capacities = "worst"
  c.mesh = ml_collections.ConfigDict({"data": 1, "model": 1})
  c.train.steps = steps
  c.train.log_every = steps
  c.train.eval_every = 0
  c.train.final_eval_splits = ("test",)
  return c


@pytest.fixture(scope="module")
def task():
  return make_task(sage_link.TASK, small_config())


def _keys(e, n):
  return set(link_split.edge_keys(e, n).tolist())


def test_random_link_split_is_pygs_defaults_and_seeded(task):
  """5 % / 10 % of the undirected edges (int(fraction E), as PyG), disjoint, together the
  graph; one fixed negative per held-out edge, none an edge, no repeats; the same split from
  the same seed, another from another."""
  s = task.split
  n = s.num_nodes
  every = link_split.undirected_edges(graph_loading.load_raw_graph(task.config.data).adj)
  e = len(s.train) + len(s.valid) + len(s.test)
  assert (len(s.valid), len(s.test)) == (int(0.05 * e), int(0.1 * e))
  tr, va, te = _keys(s.train, n), _keys(s.valid, n), _keys(s.test, n)
  assert not (tr & va or tr & te or va & te) and len(tr | va | te) == e == len(every)
  neg = link_split.edge_keys(np.concatenate([s.valid_neg, s.test_neg]), n)
  assert neg.size == len(s.valid) + len(s.test) == np.unique(neg).size
  assert not set(neg.tolist()) & (tr | va | te)
  assert (s.valid_neg[:, 0] != s.valid_neg[:, 1]).all()
  adj = store.csr_from_edges(every[:, 0], every[:, 1], n)
  again = link_split.random_link_split("g", adj, None, seed=0)
  other = link_split.random_link_split("g", adj, None, seed=1)
  np.testing.assert_array_equal(again.test, link_split.random_link_split("g", adj, None).test)
  assert not np.array_equal(again.test, other.test)


def _training_edges(batch, n):
  """(keys of the edges the batch's message passing uses, keys of its positive pairs)."""
  frontier = batch["frontier"]
  keys = ("nbr", "mask") if "nbr0" in batch else ("src", "dst", "weight")
  layers = [{k: batch[f"{k}{d}"] for k in keys} for d in range(2)]
  used = B.message_keys(frontier, layers, n)
  pos = (batch["label"] > 0) & (batch["weight"] > 0)
  pairs = np.stack([frontier[batch["pair_src"][pos]], frontier[batch["pair_dst"][pos]]], 1)
  return set(used.tolist()), _keys(pairs, n)


def test_no_held_out_or_batch_edge_in_any_training_step(task):
  """Over two epochs of train batches, no edge a step's message passing uses is a valid or
  test edge or one of the step's own positives (either direction); every train edge is some
  step's positive. With sampler.exclude=false (the exclusion removed) the same check finds
  the batch's positives in its message passing: the check can fail."""
  n, s = task.num_nodes, task.split
  held = _keys(s.valid, n) | _keys(s.test, n)
  spe = task.steps_per_epoch()
  it = task.train_batches(0)
  seen = set()
  for _ in range(2 * spe):
    used, pos = _training_edges(next(it), n)
    assert used and not used & held and not used & pos
    seen |= pos
  assert seen == _keys(s.train, n)
  # Data-parallel on 8 devices: no part's message passing holds any of the step's positives.
  c = small_config()
  c.mesh.data, c.sampler.data_parallel = 8, True
  it = make_task(sage_link.TASK, c).train_batches(0)
  for _ in range(spe):
    b = next(it)
    parts = [{k: v[j] for k, v in b.items() if k not in ("ids", "part")} for j in range(8)]
    found = [_training_edges(p, n) for p in parts]
    positives = set().union(*(pos for _, pos in found))
    # (A part of an epoch's last, padded step may hold no pairs, so no edges.)
    assert any(used for used, _ in found)
    assert not any(used & (held | positives) for used, _ in found)
  c = small_config()
  c.sampler.exclude = False
  leaky = make_task(sage_link.TASK, c)
  it = leaky.train_batches(0)
  leaks = [len(u & p) for u, p in (_training_edges(next(it), n) for _ in range(spe))]
  assert sum(leaks) > 0


@pytest.mark.parametrize("kind, where", [("node", "device"), ("ladies", "host")])
def test_other_samplers_exclude_the_batch_edges(kind, where):
  """The device node-wise sampler and LADIES (its weights zeroed on excluded edges): no
  step's message passing holds one of its positives or a held-out edge; with the exclusion
  off both do (the check can fail)."""
  seen = {}
  for exclude in (True, False):
    c = small_config()
    c.sampler.kind, c.sampler.where, c.sampler.exclude = kind, where, exclude
    c.sampler.layer_sizes = (128, 128)
    t = make_task(sage_link.TASK, c)
    held = _keys(t.split.valid, t.num_nodes) | _keys(t.split.test, t.num_nodes)
    it = t.train_batches(0)
    found = [_training_edges(next(it), t.num_nodes) for _ in range(3)]
    assert all(used and not used & held for used, _ in found)
    seen[exclude] = sum(len(used & pos) for used, pos in found)
  assert seen[True] == 0 and seen[False] > 0


def test_train_batches_resume_exactly(task):
  """A batch is a function of the seed and the step: train_batches(start) gives the batch
  the stream gave at `start`, across a bulk group's middle and an epoch's end."""
  spe = task.steps_per_epoch()
  it = task.train_batches(0)
  stream = [next(it) for _ in range(spe + 2)]
  for start in (1, spe - 1, spe + 1):
    resumed = next(task.train_batches(start))
    for key in ("x", "frontier", "mask0", "mask1", "pair_src", "pair_dst", "label", "weight"):
      np.testing.assert_array_equal(resumed[key], stream[start][key])


@pytest.mark.parametrize("inference", ["sampled", "full"])
def test_eval_scores_are_the_full_graph_models(inference):
  """With eval_fanouts -1 (sampled: each batch's endpoints' whole neighbourhoods) or
  eval.inference=full (layer by layer over every node, in chunks of 100 edges), the eval
  scores are the full-graph model's (numpy: two SAGE-mean layers over every node of the test
  split's message graph, train + valid edges, then the dot product), pair for pair in the
  split's order. The metrics (with 3 seeded MRR negatives per positive) are the
  references' on those scores."""
  import jax

  c = small_config()
  c.sampler.eval_fanouts = (-1, -1)
  c.eval.mrr_negatives = 3
  c.eval.inference = inference
  c.eval.chunk = 100
  t = make_task(sage_link.TASK, c)
  batches = list(t.eval_batches("test"))
  params = jax.jit(t.init_params)(jax.random.key(0), t.example_batch(), {})
  predict = jax.jit(t.predict)
  out = [jax.device_get(predict(params, b, {})) for b in batches]
  got = np.concatenate([o["score"][o["weight"] > 0] for o in out])
  adj = t.split.message_adj("test")
  mean = adj.multiply(1.0 / np.maximum(adj.sum(axis=1), 1)).tocsr()
  h = t.split.features.astype(np.float64)
  p = jax.tree.map(np.asarray, params["encoder"])
  for i in range(2):
    h = mean @ h @ p[f"lin_l{i}"]["kernel"] + h @ p[f"lin_r{i}"]["kernel"] + p[f"lin_r{i}"]["bias"]
    h = np.maximum(h, 0) if i == 0 else h
  pairs, kind, query = t.eval_sets["test"]
  assert np.count_nonzero(kind == B.QUERY_NEGATIVE) == 3 * len(t.split.test)
  want = np.sum(h[pairs[:, 0]] * h[pairs[:, 1]], axis=1)
  np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)
  metrics = t.metrics(out)
  pos, neg, own = (want[kind == k] for k in (B.POSITIVE, B.FIXED_NEGATIVE, B.QUERY_NEGATIVE))
  assert metrics["hits@20"] == pytest.approx(scores.hits_at(pos, neg, 20), abs=2 / pos.size)
  ranks = 1 + np.sum(own.reshape(-1, 3) > pos[:, None], axis=1)
  assert metrics["mrr"] == pytest.approx(np.mean(1 / ranks), abs=0.02)


def test_negative_kinds():
  """uniform: any pairs; degree: the positive's source, targets favouring high degree;
  shared: num targets for the whole batch, paired with every source; padding stays -1."""
  rng = np.random.default_rng(0)
  pos = np.array([[1, 2], [3, 4], [-1, -1]])
  cdf = np.cumsum([0.0] * 9 + [1.0])  # all mass on node 9
  deg = B.draw_negatives("degree", pos, 2, cdf, rng)
  np.testing.assert_array_equal(deg, [[1, 9], [1, 9], [3, 9], [3, 9], [-1, -1], [-1, -1]])
  sh = B.draw_negatives("shared", pos, 3, cdf, rng)
  assert (sh[:3, 1] == sh[3:6, 1]).all() and (sh[:6, 0] == [1, 1, 1, 3, 3, 3]).all()
  assert (sh[6:] == -1).all() and B.draw_negatives("uniform", pos, 4, cdf, rng).shape == (12, 2)
  with pytest.raises(ValueError, match="available: uniform, shared, degree"):
    B.negatives_per_batch("hard", 8, 1)


def test_metrics_match_plain_references():
  """Hits@K as OGB's evaluator (positives above the K-th best negative), ROC-AUC as the
  Mann-Whitney statistic, MRR with ties counted half, on random scores with ties."""
  rng = np.random.default_rng(1)
  pos, neg = rng.integers(0, 50, 300).astype(float), rng.integers(0, 50, 500).astype(float)
  for k in (1, 20, 100):
    kth = np.sort(neg)[::-1][k - 1]
    assert scores.hits_at(pos, neg, k) == np.mean([p > kth for p in pos])
  q = np.repeat(np.arange(300), 7)
  qneg = rng.integers(0, 50, q.size).astype(float)
  score = np.concatenate([pos, neg, qneg])
  kind = np.repeat([0, 1, 2], [300, 500, q.size]).astype(np.int32)
  query = np.concatenate([np.arange(300), -np.ones(500, int), q]).astype(np.int32)
  out = scores.metrics([{"score": score, "kind": kind, "query": query,
                         "weight": np.ones_like(score)}], (20,))  # fmt: skip
  ranks = [1 + sum(qneg[q == i] > pos[i]) + sum(qneg[q == i] == pos[i]) / 2 for i in range(300)]
  assert out["mrr"] == pytest.approx(np.mean(1 / np.array(ranks)))
  labels = np.r_[np.ones(300), np.zeros(500)]
  assert out["roc_auc"] == pytest.approx(metrics_lib.auc(labels, np.r_[pos, neg]))
  assert out["hits@20"] == scores.hits_at(pos, neg, 20)


def test_ogbl_npz_layout(tmp_path):
  """OGB linkproppred's split arrays as .npz: ddi's edge / edge_neg and citation2's
  source_node / target_node / target_node_neg (its per-positive negatives kept for MRR); a
  .pt without its .npz is refused naming the conversion."""
  ddi = tmp_path / "ogbl_ddi" / "split" / "target"
  ddi.mkdir(parents=True)
  np.savez(ddi / "train.npz", edge=np.array([[0, 1], [1, 2], [2, 1], [3, 4]]))
  for s in ("valid", "test"):
    np.savez(ddi / f"{s}.npz", edge=np.array([[0, 4]]), edge_neg=np.array([[0, 3], [1, 4]]))
  got = ogbl.load(str(tmp_path / "ogbl_ddi"))
  np.testing.assert_array_equal(got.train, [[0, 1], [1, 2], [3, 4]])
  assert got.num_nodes == 5 and got.features is None and got.test_messages == "train"
  np.testing.assert_array_equal(got.message_edges("test"), got.train)
  cit = tmp_path / "cit" / "split" / "time"
  cit.mkdir(parents=True)
  np.savez(cit / "train.npz", source_node=np.array([0, 1]), target_node=np.array([1, 2]))
  for s in ("valid", "test"):
    np.savez(cit / f"{s}.npz", source_node=np.array([2]), target_node=np.array([0]),
             target_node_neg=np.array([[1, 3, 4]]))  # fmt: skip
  got = ogbl.load(str(tmp_path / "cit"))
  np.testing.assert_array_equal(got.test_target_neg, [[1, 3, 4]])
  np.testing.assert_array_equal(got.test_neg, [[2, 1]])
  (cit / "test.npz").rename(cit / "test.pt")
  with pytest.raises(FileNotFoundError, match=r"test.pt is there: convert it"):
    ogbl.load(str(tmp_path / "cit"))


def test_config_errors_name_the_fix():
  for key, value, words in (
    ("negatives.kind", "hard", "available: uniform, shared, degree"),
    ("data.source", "ogbn", "available: ogbl, planetoid, synthetic, ogb, tfds"),
    ("model.inputs", "both", "no node features; set --config.model.inputs=embeddings"),
  ):
    c = small_config("embeddings" if key == "model.inputs" else "features")
    section, name = key.split(".")
    c[section][name] = value
    with pytest.raises(ValueError, match=words):
      make_task(sage_link.TASK, c)
  c = small_config()
  c.mesh.data, c.sampler.data_parallel, c.sampler.batch_size = 8, True, 100
  with pytest.raises(ValueError, match="use a multiple of 8"):
    make_task(sage_link.TASK, c)


# ------------------------------------------------------------------ trainer runs (-m long)


@pytest.mark.long
def test_trains_and_resumes_bit_identically(tmp_path):
  """The trainer on the planted graph: test ROC-AUC well above chance; a run stopped after
  10 steps and resumed from its checkpoint ends bit-identical to the uninterrupted one."""
  c = small_config("both", 20)
  full = loop.train(c, str(tmp_path / "full"))
  assert full.metrics["test/roc_auc"] > 0.8, full.metrics
  assert loop.train(c, str(tmp_path / "part"), stop_after=10).metrics["step"] == 10
  shutil.copytree(tmp_path / "part", tmp_path / "resumed")
  resumed = loop.train(c, str(tmp_path / "resumed"), resume=True)
  for x, y in zip(state_leaves(full.state), state_leaves(resumed.state)):
    np.testing.assert_array_equal(x, y)
  assert resumed.metrics["test/roc_auc"] == full.metrics["test/roc_auc"]


@pytest.mark.long
@pytest.mark.parametrize("split_ids", ["false", "true"])
def test_eight_devices_train_to_the_same_hits_as_one(tmp_path, split_ids):
  """8 x 1 against 1 x 1, learned node embeddings and features, the same seed: Hits@20 and
  ROC-AUC within seed noise (split ids: each device fetches its share of the node rows)."""
  res = {}
  for devices in (1, 8):
    c = small_config("both", 40)
    c.mesh.data = devices
    c.embeddings.split_ids = split_ids
    res[devices] = loop.train(c, str(tmp_path / str(devices))).metrics
  assert abs(res[1]["test/roc_auc"] - res[8]["test/roc_auc"]) < 0.02, res
  assert abs(res[1]["test/hits@20"] - res[8]["test/hits@20"]) < 0.1, res


@pytest.mark.long
def test_node_table_backends_serve_it_as_dense(tmp_path):
  """Learned node embeddings through offload (a device cache of half the rows) and hot_cold
  (half the rows hot): the same test metrics as dense after 6 steps (both are exact); tt
  (its own reconstruction) trains to finite metrics."""
  res = {}
  for plan in ("dense", "offload(cache_fraction=0.5, min_cache_rows=600)",
               "hot_cold(budget=0.5)", "tt(rank=4)"):  # fmt: skip
    c = small_config("embeddings", 6)
    c.embeddings.plan = ((".*", plan),)
    res[plan.split("(")[0]] = loop.train(c, str(tmp_path / plan.split("(")[0])).metrics
  for name in ("offload", "hot_cold"):
    for key in ("test/roc_auc", "test/hits@20"):
      assert res[name][key] == res["dense"][key], (name, res)
  assert 0.0 <= res["tt"]["test/roc_auc"] <= 1.0


@pytest.mark.long
def test_data_parallel_on_eight_devices_trains_as_one(tmp_path):
  """sampler.data_parallel on 8 devices: each step's 128 positives in 8 parts of 16, each
  part's subgraph sampled on its own and trained on its device (its leaves split over the
  mesh), the loss over all parts: test ROC-AUC and Hits@20 within seed noise of one device
  training the whole batch as one subgraph; its batches are split, not replicated."""
  res = {}
  for devices in (1, 8):
    c = small_config("both", 40)
    c.sampler.batch_size = 128
    c.mesh.data = devices
    c.sampler.data_parallel = devices > 1
    if devices > 1:
      t = make_task(sage_link.TASK, c)
      b = next(t.train_batches(0))
      assert b["part"].shape == (8,) and b["label"].shape[0] == 8 and t.shard_batch
      assert b["ids"]["node"].shape[0] == 8 * b["frontier"].shape[1]
    res[devices] = loop.train(c, str(tmp_path / str(devices))).metrics
  print({d: (r["test/roc_auc"], r["test/hits@20"]) for d, r in res.items()})
  assert abs(res[1]["test/roc_auc"] - res[8]["test/roc_auc"]) < 0.03, res
  assert abs(res[1]["test/hits@20"] - res[8]["test/hits@20"]) < 0.1, res


@pytest.mark.long
def test_k_steps_per_call_train_as_one(tmp_path):
  """sampler.steps_per_call = 2: two host-sampled batches per call of the trainer's step,
  one transfer, a scan over their two optimizer steps: the same final state and metrics as
  one step per call."""
  res = {}
  for k in (1, 2):
    c = small_config("both", 8)
    c.sampler.steps_per_call = k
    c.train.log_every = 4
    res[k] = loop.train(c, str(tmp_path / str(k)))
  for x, y in zip(state_leaves(res[1].state), state_leaves(res[2].state)):
    np.testing.assert_array_equal(x, y)
  assert res[2].metrics["test/roc_auc"] == res[1].metrics["test/roc_auc"]
