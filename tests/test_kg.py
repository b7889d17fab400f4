"""Knowledge-graph link prediction: reader, decoders, filtered ranks, partitions."""

from __future__ import annotations

import gzip
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import kge_fb15k237, rgcn_fb15k237_partitioned
from recgnn.data import kg as kg_lib
from recgnn.models import kge, rgcn
from recgnn.tasks import link_prediction as lp
from tests import contract_lib as contract
from tests.trainer_lib import make_task


def ranks_from_scores(scores: np.ndarray, target: np.ndarray, filt: list[np.ndarray]):
  """The reference of the task's jitted filtered ranks (numpy): scores f32[B, N], target
  int[B], filt[i] the true answers of query i (the target among them or not).
  Rank = 1 + #higher + #tied / 2."""
  out = np.zeros(len(target), np.float64)
  for i, (s, y) in enumerate(zip(scores, target)):
    s = s.astype(np.float64).copy()
    other = np.setdiff1d(filt[i], [y])
    s[other] = -np.inf
    out[i] = 1 + np.sum(s > s[y]) + (np.sum(s == s[y]) - 1) / 2
  return out


# ----------------------------------------------------------------------------- data


def _write(path, text, gz=False):
  data = text.encode()
  if gz:
    data = gzip.compress(data)
  with open(path, "wb") as f:
    f.write(data)


def test_reader_gzip_crlf_and_bad_lines(tmp_path):
  _write(tmp_path / "train.txt.gz", "a\tr1\tb\r\nb\tr2\tc\r\n\r\nbroken line\nc\tr1\ta\n", gz=True)
  _write(tmp_path / "valid.txt", "a\tr2\tc\nx\tr9\ta\n")  # r9 unseen in train: dropped
  _write(tmp_path / "test.txt", "c\tr2\tb\na\tr1\t\n")  # empty tail: malformed
  g = kg_lib.load(str(tmp_path))
  assert g.entities == ["a", "b", "c", "x"]
  assert g.relations == ["r1", "r2"]
  np.testing.assert_array_equal(g.splits["train"], [[0, 0, 1], [1, 1, 2], [2, 0, 0]])
  np.testing.assert_array_equal(g.splits["valid"], [[0, 1, 2]])
  assert g.unseen == {"train": 0, "valid": 1, "test": 0}
  bad = {os.path.basename(b.path): b for b in g.bad_lines}
  assert bad["train.txt.gz"].count == 1 and bad["train.txt.gz"].examples[0][0] == 4
  assert bad["test.txt"].examples == [(2, "a\tr1\t")]
  assert "line 4" in g.describe()
  # reciprocal triples
  np.testing.assert_array_equal(g.training_triples()[3:], [[1, 2, 0], [2, 3, 1], [0, 2, 2]])
  with pytest.raises(kg_lib.MalformedDataError, match=r"train.txt.gz.*line 4.*max_bad_lines"):
    kg_lib.load(str(tmp_path), max_bad_lines=0)


def test_bundled_fb15k237_sizes():
  g = kg_lib.load()
  # The ConvE release of FB15k-237 (Toutanova & Chen 2015): published sizes.
  assert (g.num_entities, g.num_base_relations) == (14541, 237)
  assert {s: len(v) for s, v in g.splits.items()} == {
    "train": 272115,
    "valid": 17535,
    "test": 20466,
  }
  assert os.path.isfile(os.path.join(kg_lib.BUNDLED, "ConvE_LICENSE.txt"))


def test_filter_index_against_sets():
  rng = np.random.default_rng(0)
  trip = {
    s: np.stack([rng.integers(0, 30, n), rng.integers(0, 4, n), rng.integers(0, 30, n)], 1)
    for s, n in (("train", 300), ("valid", 40), ("test", 40))
  }
  g = kg_lib.from_triples(trip, 30, 4)
  f = kg_lib.FilterIndex(g)
  allt = {tuple(x) for s in trip for x in trip[s]}
  a, r = rng.integers(0, 30, 50), rng.integers(0, 8, 50)
  for ai, ri, got in zip(a, r, f.lookup(a, r)):
    if ri < 4:
      want = sorted({t for (h, rr, t) in allt if h == ai and rr == ri})
    else:
      want = sorted({h for (h, rr, t) in allt if t == ai and rr == ri - 4})
    assert list(got) == want


# ----------------------------------------------------------------------------- decoders


def _np_score(name, h, r, t, gamma, p):
  """Independent numpy formulas (complex arithmetic) for one triple."""
  k = h.shape[-1] // 2
  if name == "distmult":
    return float(np.sum(h * r * t))
  if name == "complex":
    hc, rc, tc = h[:k] + 1j * h[k:], r[:k] + 1j * r[k:], t[:k] + 1j * t[k:]
    return float(np.real(np.sum(hc * rc * np.conj(tc))))
  if name == "rotate":
    hc, tc = h[:k] + 1j * h[k:], t[:k] + 1j * t[k:]
    return float(gamma - np.sum(np.abs(hc * np.exp(1j * r) - tc)))
  d = h + r - t
  return float(gamma - (np.sum(np.abs(d)) if p == 1 else np.sqrt(np.sum(d * d))))


@pytest.mark.parametrize("name", kge.DECODERS)
def test_score_all_matches_numpy(name):
  rng = np.random.default_rng(1)
  D, B, N = 8, 3, 11
  q = rng.normal(size=(B, D)).astype(np.float32)
  r = rng.normal(size=(B, kge.relation_dim(name, D))).astype(np.float32)
  c = rng.normal(size=(N, D)).astype(np.float32)
  tail = np.asarray(kge.score_all(name, q, r, c, "tail", gamma=2.0, p=1, chunk=4))
  head = np.asarray(kge.score_all(name, q, r, c, "head", gamma=2.0, p=1, chunk=4))
  for i in range(B):
    for j in range(N):
      np.testing.assert_allclose(
        tail[i, j], _np_score(name, q[i], r[i], c[j], 2.0, 1), rtol=2e-4, atol=2e-4
      )
      np.testing.assert_allclose(
        head[i, j], _np_score(name, c[j], r[i], q[i], 2.0, 1), rtol=2e-4, atol=2e-4
      )


# ----------------------------------------------------------------------------- filtered ranks


def _small_kg(tmp_path, n_ent=40, n_rel=5, seed=0):
  rng = np.random.default_rng(seed)
  lines = {}
  for s, n in (("train", 400), ("valid", 30), ("test", 60)):
    h, r, t = rng.integers(0, n_ent, n), rng.integers(0, n_rel, n), rng.integers(0, n_ent, n)
    lines[s] = "".join(f"e{a}\tr{b}\te{c}\n" for a, b, c in zip(h, r, t))
  # Every entity and relation in train, so that ids and files agree.
  lines["train"] += "".join(f"e{i}\tr{i % n_rel}\te{(i + 1) % n_ent}\n" for i in range(n_ent))
  for s, text in lines.items():
    _write(tmp_path / f"{s}.txt", text)
  return str(tmp_path)


def _config(path, decoder="complex", **over):
  c = kge_fb15k237.get_config(decoder)
  c.data.path = path
  c.embeddings.dim = 8
  c.batch_size = 16
  c.eval.batch_size = 7  # several batches per side, a padded last one
  for k, v in over.items():
    node = c
    *head, last = k.split(".")
    for h in head:
      node = node[h]
    node[last] = v
  return c


@pytest.mark.parametrize(
  "decoder,reciprocal",
  [("complex", True), ("distmult", False), ("rotate", True), ("transe", False)],
)
def test_filtered_ranks_equal_numpy_bruteforce(tmp_path, decoder, reciprocal):
  task = make_task(
    lp.LinkPrediction, _config(_small_kg(tmp_path), decoder, **{"data.reciprocal": reciprocal})
  )
  g = task.kg
  N = g.num_entities
  rng = np.random.default_rng(3)
  E = rng.normal(size=(N, 8)).astype(np.float32)
  if decoder == "distmult":
    E = np.round(E)  # integer scores: exercises the tie rule
  batch0 = task.example_batch()
  params = task.init_params(jax.random.key(0), batch0, {"entity": jnp.zeros((N, 8))})
  ranks, sides = [], []
  for b in task.eval_batches("test"):
    out = task.predict(params, b, {"entity": jnp.asarray(E)})
    keep = b["weight"] > 0
    ranks.append(np.asarray(out["rank"])[keep])
    sides.append(np.asarray(out["side"])[keep])
  ranks, sides = np.concatenate(ranks), np.concatenate(sides)
  # Brute force: every candidate scored by the numpy formulas, filter from python sets.
  rel_table = np.asarray(params["relations"][next(iter(params["relations"]))])
  if decoder in kge.BILINEAR:  # Relations adds the identity offset
    ones = np.ones(8, np.float32)
    if decoder == "complex":
      ones[4:] = 0
    rel_table = rel_table + ones
  elif decoder == "rotate":
    rel_table = rel_table - np.pi
  true = {tuple(x) for s in kg_lib.SPLITS for x in g.splits[s]}
  R = g.num_base_relations
  gamma, p = task.options.gamma, task.options.p
  want = []
  for side in (0, 1):
    for h, r, t in g.splits["test"]:
      if side == 0:
        anchor, target = h, t
        rv = rel_table[r]
        s = np.array([_np_score(decoder, E[h], rv, E[c], gamma, p) for c in range(N)])
        filt = np.array([c for c in range(N) if (h, r, c) in true])
      else:
        anchor, target = t, h
        rv = rel_table[r + R] if reciprocal else rel_table[r]
        if reciprocal:
          s = np.array([_np_score(decoder, E[t], rv, E[c], gamma, p) for c in range(N)])
        else:
          s = np.array([_np_score(decoder, E[c], rv, E[t], gamma, p) for c in range(N)])
        filt = np.array([c for c in range(N) if (c, r, t) in true])
      del anchor
      want.append(ranks_from_scores(s[None], np.array([target]), [filt])[0])
  np.testing.assert_allclose(ranks, np.array(want), rtol=0, atol=1e-3)
  assert (sides[: len(g.splits["test"])] == 0).all()
  m = task.metrics([{"rank": ranks, "side": sides, "weight": np.ones_like(ranks)}])
  np.testing.assert_allclose(m["mrr"], np.mean(1 / np.array(want)), rtol=1e-6)


def test_rank_tie_rule():
  s = np.array([[1.0, 3.0, 3.0, 3.0, 0.0]])
  # target 1 ties with 2 and 3; entity 3 is another true answer (filtered): rank 1 + 0 + 1/2
  assert ranks_from_scores(s, np.array([1]), [np.array([1, 3])])[0] == 1.5


# ----------------------------------------------------------------------------- partitions


def _rgcn_config(path, parts, layers=2, **over):
  c = rgcn_fb15k237_partitioned.get_config()
  c.data.path = path
  c.embeddings.dim = 8
  c.model.rgcn.num_layers = layers
  c.model.rgcn.num_bases = 2
  c.model.rgcn.edge_dropout = 0.0
  c.model.rgcn.dropout = 0.0
  c.partition.num_parts = parts
  c.batch_size = 16
  for k, v in over.items():
    node = c
    *head, last = k.split(".")
    for h in head:
      node = node[h]
    node[last] = v
  if c.train.scoring == "sampled" and not c.negatives.num:
    c.negatives.num = 5  # (1vsall draws no negatives and refuses the option)
  return c


@pytest.mark.parametrize(
  "method,layers,scoring",
  [("metis", 1, "sampled"), ("metis", 2, "1vsall"), ("random", 2, "sampled")],
)
def test_partitions_are_self_sufficient(tmp_path, method, layers, scoring):
  if method == "metis":
    pytest.importorskip("pymetis")
  over = {"partition.method": method, "train.scoring": scoring}
  over["negatives.shared"] = scoring == "sampled"
  cfg = _rgcn_config(_small_kg(tmp_path, n_ent=60), 3, layers, **over)
  task = make_task(lp.LinkPrediction, cfg)
  g = task.kg
  N = g.num_entities
  parts = task.partitions
  # Every training triple is trained by exactly one partition.
  got = sorted(
    tuple(p.nodes[x] if i != 1 else x for i, x in enumerate(t)) for p in parts for t in p.triples
  )
  assert got == sorted(map(tuple, g.training_triples()))
  rng = np.random.default_rng(0)
  x = rng.normal(size=(N, 8)).astype(np.float32)
  edges = task.graph["edges"]
  full_graph = {
    "src": edges[:, 0],
    "dst": edges[:, 2],
    "rel": edges[:, 1],
    "norm": task.graph["norm"],
  }
  # (jitted whole: op by op, the encoder compiled a program per op and partition shape)
  encode = jax.jit(task.encoder.apply, static_argnums=3)
  params = jax.jit(task.encoder.init, static_argnums=3)(jax.random.key(0), x, full_graph, False)
  whole = np.asarray(encode(params, x, full_graph, False))
  for i, p in enumerate(parts):
    # (1) The encoder over the partition alone gives its core rows their whole-graph values.
    sub = {
      "src": p.edges[:, 0],
      "dst": p.edges[:, 2],
      "rel": p.edges[:, 1],
      "norm": task.graph["norm"][p.edge_index],
    }
    local = np.asarray(encode(params, x[p.nodes], sub, False))
    np.testing.assert_allclose(
      local[: p.num_core], whole[p.nodes[: p.num_core]], rtol=1e-5, atol=1e-5
    )
    # (2) A partition's batches read only its core + halo; triples and negatives in the core.
    b = task.partition_batch(i, p.triples[:16], rng)
    ids = b["ids"]["entity"][:, 0]
    assert set(ids[ids >= 0]) == set(p.nodes)
    n = int(b["weight"].sum())
    for key in ("h", "t"):
      assert (b[key][:n] < p.num_core).all()
    if scoring == "sampled":
      assert (b["neg"] < p.num_core).all()
    else:  # 1-vs-all over the partition: the candidates are exactly its rows
      np.testing.assert_array_equal(np.flatnonzero(b["cand_mask"]), np.arange(len(p.nodes)))
    assert (b["src"] < len(p.nodes)).all() and (b["dst"] < len(p.nodes)).all()
    # (3) Its gradient: the loss on these rows touches no padded / outside row.
    rows = jnp.asarray(np.where(ids[:, None] >= 0, x[np.maximum(ids, 0)], 0.0))
    pp = jax.jit(task.init_params)(jax.random.key(1), b, {"entity": rows})
    grad = jax.jit(
      jax.grad(lambda r, pp=pp, b=b: task.loss(pp, b, {"entity": r}, jax.random.key(2))[0])
    )(rows)
    assert not np.asarray(grad)[len(p.nodes) :].any()


def _community_kg(tmp_path, communities=3, size=30, seed=0):
  """Dense communities, a few edges across: partitions with real halos."""
  rng = np.random.default_rng(seed)
  lines = {}
  for s, n in (("train", 600), ("valid", 30), ("test", 30)):
    c = rng.integers(0, communities, n)
    h = c * size + rng.integers(0, size, n)
    across = rng.random(n) < 0.003
    t = np.where(
      across, rng.integers(0, communities * size, n), c * size + rng.integers(0, size, n)
    )
    r = rng.integers(0, 4, n)
    lines[s] = "".join(f"e{a}\tr{b}\te{d}\n" for a, b, d in zip(h, r, t))
  os.makedirs(tmp_path, exist_ok=True)
  for s, text in lines.items():
    _write(os.path.join(tmp_path, f"{s}.txt"), text)
  return str(tmp_path)


def test_training_a_partition_changes_only_its_rows(tmp_path):
  """Through the trainer: entity rows outside partition 1's core + halo are bit-identical
  to their initial values after training partition 1 alone; rows inside changed."""
  pytest.importorskip("pymetis")
  from recgnn.train import loop, setup

  cfg = _rgcn_config(_community_kg(tmp_path / "kg"), 3, 1, **{"partition.only": 1})
  cfg.train.steps = 4
  cfg.train.eval_every = 0
  cfg.train.final_eval_splits = ()
  cfg.train.log_every = 4
  task = make_task(lp.LinkPrediction, cfg)
  nodes = task.partitions[1].nodes
  assert len(nodes) < 0.75 * task.kg.num_entities  # a real partition, not the whole graph
  result = loop.train(cfg, str(tmp_path / "w"))
  after = _tables(result, result.state)
  before = _tables(result, setup.build(cfg, task=task).state)
  outside = np.setdiff1d(np.arange(task.kg.num_entities), nodes)
  np.testing.assert_array_equal(after[outside], before[outside])
  assert not np.array_equal(after[nodes], before[nodes])


def _parallel_config(path, parts=4, data=4, **over):
  over = {"partition.parallel": -1, "mesh": {"data": data, "model": 1}, **over}
  cfg = _rgcn_config(path, parts, 1, **over)
  cfg.model.rgcn.edge_dropout = 0.5  # per-partition dropout keys are part of the contract
  return cfg


def test_parallel_partitions_loss_is_the_serial_average(tmp_path):
  """partition.parallel: the loss and gradients of G partition batches stacked in one step
  equal the edge-weighted average of the same G batches' losses / gradients computed one by
  one (the serial-equivalent data-parallel step), rows and dense params alike."""
  pytest.importorskip("pymetis")
  cfg = _parallel_config(_community_kg(tmp_path / "kg", communities=4), 4, 1)
  cfg.partition.parallel = 3  # 4 partitions on 3 slots: slot 0 takes partitions 0 and 3
  task = make_task(lp.LinkPrediction, cfg)
  assert task.parallel == 3 and task.shard_batch
  slots = task.batches.slot_batches()
  assert [sorted({p for p, _ in s}) for s in slots] == [[0, 3], [1], [2]]
  assert task.steps_per_epoch() == max(map(len, slots))
  sched = task.parallel_schedule(0)
  seen = sorted(x for step in sched for x in step if x is not None)
  assert seen == sorted(x for s in slots for x in s)  # every batch of the epoch once
  batch = task.parallel_batch(0, 0)
  G, M = 3, task.max_nodes
  ids = batch["ids"]["entity"][:, 0]
  assert ids.shape == (G * M,)
  for g, (p, _) in enumerate(sched[0]):
    got = ids[g * M : (g + 1) * M]
    assert set(got[got >= 0]) == set(task.partitions[p].nodes)
  rng = np.random.default_rng(0)
  x = rng.normal(size=(task.kg.num_entities, 8)).astype(np.float32)
  rows = jnp.asarray(np.where(ids[:, None] >= 0, x[np.maximum(ids, 0)], 0.0))
  b = jax.tree.map(jnp.asarray, {k: v for k, v in batch.items() if k != "ids"})
  params = task.init_params(jax.random.key(0), b, {"entity": rows})
  key = jax.random.key(3)

  def loss(pp, r, b):
    return task.loss(pp, b, {"entity": r}, key)[0]

  got = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, rows, b)
  w = np.asarray(batch["weight"]).sum(1)
  want_p = jax.tree.map(jnp.zeros_like, params)
  want_r, want_loss = [], 0.0
  # One partition's batch alone (as the serial path trains it), jitted once for all g.
  single = jax.jit(
    jax.value_and_grad(lambda pp, r, bg, k: task.loss(pp, bg, {"entity": r}, k)[0], argnums=(0, 1))
  )
  for g in range(G):
    bg = jax.tree.map(lambda v, g=g: v[g], b)
    lg, (gp, gr) = single(params, rows[g * M : (g + 1) * M], bg, jax.random.fold_in(key, g))
    c = max(w[g], 1) / w.sum()
    want_loss += c * lg
    want_p = jax.tree.map(lambda a, q, c=c: a + c * q, want_p, gp)
    want_r.append(c * gr)
  np.testing.assert_allclose(jax.jit(loss)(params, rows, b), want_loss, rtol=1e-5)
  for a, q in zip(jax.tree.leaves(got[0]), jax.tree.leaves(want_p)):
    np.testing.assert_allclose(a, q, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(got[1], jnp.concatenate(want_r), rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_parallel_partitions_on_devices_train_as_on_one(tmp_path):
  """4 partitions on 4 simulated devices (one each) train the entity table and dense params
  that one device computing the same 4 partition batches per step trains, and reach the
  same filtered test MRR (eval rows split over the devices, padded)."""
  pytest.importorskip("pymetis")
  from recgnn.train import loop

  path = _community_kg(tmp_path / "kg", communities=4)
  out = {}
  for data in (1, 4):
    cfg = _parallel_config(path, 4, data)
    cfg.partition.parallel = 4
    cfg.train.steps = 3
    cfg.train.eval_every = 0
    cfg.train.final_eval_splits = ("test",)
    cfg.train.log_every = 3
    cfg.eval.batch_size = 8
    r = loop.train(cfg, str(tmp_path / f"w{data}"))
    out[data] = (_tables(r, r.state), jax.device_get(r.state.params), r.metrics["test/mrr"])
  np.testing.assert_allclose(out[4][0], out[1][0], rtol=1e-4, atol=1e-6)
  for a, b in zip(jax.tree.leaves(out[4][1]), jax.tree.leaves(out[1][1])):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(out[4][2], out[1][2], rtol=1e-4)


def test_parallel_partitions_read_only_their_rows(tmp_path):
  """Each device of a partition-parallel step reads no entity row outside its partition's
  core + halo: device g's copy of the (replicated) entity table holds NaN in every other
  row, and the step's loss, dense params and the rows of the step's partitions stay finite."""
  pytest.importorskip("pymetis")
  from recgnn.train import setup

  cfg = _parallel_config(_community_kg(tmp_path / "kg", communities=4), 4, 4)
  cfg.embeddings.optimizer.name = "sgd"  # rows change by exactly their gradient
  task = make_task(lp.LinkPrediction, cfg)
  batch = task.parallel_batch(0, 0)
  run = setup.build(cfg, task=task, example=batch, key=jax.random.key(0))
  mesh, state = run.mesh, run.state
  (gkey,) = run.plan.groups
  table = state.emb[gkey]["entity"]["table"]
  clean = np.asarray(table)
  M = task.max_nodes
  ids = batch["ids"]["entity"][:, 0]
  own = []
  copies = []
  for g, d in enumerate(mesh.devices.flat):
    mine = ids[g * M : (g + 1) * M]
    mine = mine[mine >= 0]
    own.append(mine)
    poisoned = np.full_like(clean, np.nan)
    poisoned[mine] = clean[mine]
    copies.append(jax.device_put(poisoned, d))
  state.emb[gkey]["entity"]["table"] = jax.make_array_from_single_device_arrays(
    clean.shape, table.sharding, copies
  )
  new, m = run.train_step(state, *run.packed(run.prepare(batch), batch))
  assert np.isfinite(float(m["loss"]))
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(new.params))
  # Each device's copy: its own rows updated and finite (others were NaN and stay so).
  out = new.emb[gkey]["entity"]["table"]
  for g, shard in enumerate(sorted(out.addressable_shards, key=lambda s: s.device.id)):
    local = np.asarray(shard.data)[own[g]]
    assert np.isfinite(local).all()
  assert not np.array_equal(np.asarray(out.addressable_shards[0].data)[own[0]], clean[own[0]])


def test_planted_kg_hypercube_communities():
  """kg.planted: per relation every entity has exactly one partner (x XOR mask, an
  involution), splits are disjoint; with no cross facts METIS finds the communities
  exactly (halo 0), and a few cross facts give small halos."""
  pytest.importorskip("pymetis")
  from recgnn.graphs import kg_partition

  g = kg_lib.planted(communities=4, bits=6, num_relations=5, cross=0.0, seed=1)
  assert g.num_entities == 256
  facts = np.concatenate([g.splits[s] for s in kg_lib.SPLITS])
  assert len({tuple(f) for f in facts}) == len(facts) == 256 * 5 // 2
  for r in range(5):
    f = facts[facts[:, 1] == r]
    assert sorted(np.concatenate([f[:, 0], f[:, 2]])) == list(range(256))  # a matching
  for cross, most in ((0.0, 0), (0.01, 0.5)):
    g = kg_lib.planted(communities=4, bits=6, num_relations=5, cross=cross, seed=1)
    t = g.training_triples()
    # Message edges = the training triples with their reciprocals, as the task builds them.
    parts = kg_partition.build(256, t, t, kg_partition.assign(256, t, 4, "metis"), 1)
    for p in parts:
      assert p.num_halo <= most * p.num_core
      if cross == 0:
        assert p.num_core == 64


def _tables(result, state) -> np.ndarray:
  """The entity table in `state` (whatever group of the plan holds it)."""
  for key, group in result.plan.groups.items():
    t = group.tables(state.emb[key])
    if "entity" in t:
      return np.asarray(t["entity"])
  raise KeyError("entity")


def test_rgcn_basis_layer_matches_dense_reference():
  """The basis-decomposed layer against W_r = sum_b a_rb V_b applied edge by edge."""
  rng = np.random.default_rng(0)
  n, d, R, E = 7, 4, 3, 20
  x = rng.normal(size=(n, d)).astype(np.float32)
  graph = {
    "src": rng.integers(0, n, E),
    "dst": rng.integers(0, n, E),
    "rel": rng.integers(0, R, E),
    "norm": rng.random(E).astype(np.float32),
  }
  layer = rgcn.RGCNLayer(R, 5, 2)
  params = layer.init(jax.random.key(0), x, graph, graph["norm"])
  out = np.asarray(layer.apply(params, x, graph, graph["norm"]))
  p = jax.tree.map(np.asarray, params["params"])
  W = np.einsum("rb,bio->rio", p["coeff"], p["bases"])
  want = x @ p["self"]["kernel"] + p["self"]["bias"]
  for s, t, r, w in zip(graph["src"], graph["dst"], graph["rel"], graph["norm"]):
    want[t] += w * x[s] @ W[r]
  np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("reg", ["none", "n3", "l2"])
def test_grouped_queries_loss_equals_per_triple_1vsall(tmp_path, reg):
  """Grouping the triples by (anchor, relation) computes exactly the per-triple 1-vs-all loss
  (and regularizer) over the same triples."""
  path = _small_kg(tmp_path)
  over = {"model.regularizer": reg, "model.reg_weight": 0.1, "batch_size": 1024}
  plain = make_task(
    lp.LinkPrediction, _config(path, "complex", **over, **{"train.group_queries": False})
  )
  grouped = make_task(
    lp.LinkPrediction, _config(path, "complex", **over, **{"train.group_queries": True})
  )
  assert grouped.steps_per_epoch() == 1 and plain.steps_per_epoch() == 1
  N = plain.kg.num_entities
  rows = jnp.asarray(np.random.default_rng(0).normal(size=(N, 8)).astype(np.float32))
  b1, b2 = next(plain.train_batches(0)), next(grouped.train_batches(0))
  assert b2["cnt"].sum() == b1["weight"].sum() == len(plain.train_triples)
  params = jax.jit(plain.init_params)(jax.random.key(0), b1, {"entity": rows})
  key = jax.random.key(1)
  l1, a1 = jax.jit(plain.loss)(params, b1, {"entity": rows}, key)  # (jitted: one program each)
  l2, a2 = jax.jit(grouped.loss)(params, b2, {"entity": rows}, key)
  np.testing.assert_allclose(l2, l1, rtol=1e-5)
  np.testing.assert_allclose(a2["ce"], a1["ce"], rtol=1e-5)
  assert grouped.num_examples(b2) == len(plain.train_triples)


def test_type_constrained_negatives(tmp_path):
  over = {"train.scoring": "sampled", "negatives.kind": "type", "negatives.num": 50}
  over["train.group_queries"] = False
  task = make_task(lp.LinkPrediction, _config(_small_kg(tmp_path), "distmult", **over))
  seen = {}
  for _h, r, t in task.train_triples:
    seen.setdefault(r, set()).add(t)
  b = next(task.train_batches(0))
  rows = b["ids"]["entity"][:, 0]
  for i in range(int(b["weight"].sum())):
    r = b["rel"][i]
    negs = rows[b["neg"][i]]
    assert set(negs) <= seen[r]
    assert rows[b["h"][i]] >= 0 and rows[b["t"][i]] in seen[r]


def test_experiments_and_errors():
  for d in kge.DECODERS:
    assert kge_fb15k237.get_config(d).model.decoder == d
  with pytest.raises(ValueError, match="available: distmult, complex, rotate, transe"):
    kge_fb15k237.get_config("conve")
  c = kge_fb15k237.get_config("complex")
  c.train.scoring = "2vsall"
  with pytest.raises(
    ValueError, match="Unknown train.scoring '2vsall'; available: 1vsall, sampled"
  ):
    make_task(lp.LinkPrediction, c)
  with pytest.raises(FileNotFoundError, match="train.txt"):
    kg_lib.load("/nonexistent/kg")
  assert rgcn_fb15k237_partitioned.get_config("2,parallel").partition.parallel == -1
  assert rgcn_fb15k237_partitioned.get_config("2").partition.parallel == 0
  with pytest.raises(ValueError, match="available: P or P,parallel"):
    rgcn_fb15k237_partitioned.get_config("2,paralel")


@pytest.mark.parametrize(
  "option,value", [("kind", "type"), ("num", 64), ("shared", True), ("kind", "partition")]
)
def test_negatives_under_1vsall_are_refused(tmp_path, option, value):
  """1vsall scores every candidate and draws no negatives: a negatives option there would be
  ignored, so it is refused, naming the option and the reason."""
  c = _config(_small_kg(tmp_path), "distmult", **{f"negatives.{option}": value})
  with pytest.raises(ValueError, match=rf"negatives.{option}=.*1vsall .*draws no negatives"):
    make_task(lp.LinkPrediction, c)
  # The same option under sampled scoring is honoured (partition needs partitions).
  if option != "kind" or value != "partition":
    over = {"train.scoring": "sampled", "train.group_queries": False, "model.encoder": "rgcn"}
    task = make_task(
      lp.LinkPrediction,
      _config(
        c.data.path,
        "distmult",
        **over,
        **{f"negatives.{option}": value, "negatives.num": 64 if option != "num" else value},
      ),
    )
    assert (task.neg_kind, task.num_neg, task.shared_neg) == {
      "kind": ("type", 64, False), "num": ("uniform", 64, False),
      "shared": ("uniform", 64, True)}[option]  # fmt: skip


@pytest.mark.parametrize("over", [{"model.encoder": "rgcn"}, {"train.scoring": "sampled"}])
def test_group_queries_is_refused_where_it_cannot_group(tmp_path, over):
  """train.group_queries groups 1vsall queries over the entity table: with an encoder or
  sampled scoring it used to be switched off silently; it is refused, naming the fix."""
  c = _config(_small_kg(tmp_path), "distmult", **over, **{"train.group_queries": True})
  with pytest.raises(ValueError, match="train.group_queries=True .*group_queries=False"):
    make_task(lp.LinkPrediction, c)


def _tables_config(path, plan, **over):
  cfg = _config(path, "complex", **over)
  cfg.embeddings.plan = [(".*", plan)]
  cfg.train.epochs = 0
  cfg.train.steps = 6
  cfg.train.eval_every = 0
  cfg.train.final_eval_splits = ()
  cfg.train.log_every = 6
  return cfg


def _train_tables(path, plan, workdir, check=None, **over):
  """The entity table after 6 steps of `plan`; check(result) first, where given."""
  from recgnn.train import loop

  result = loop.train(_tables_config(path, plan, **over), workdir)
  if check is not None:
    check(result)
  return _tables(result, result.state)


def _init_tables(path, plan, **over):
  """The entity table as the trainer's run of `plan` starts it (its seed, before any step)."""
  from recgnn.train import setup

  run = setup.build(_tables_config(path, plan, **over))
  return _tables(run, run.state)


def test_entity_table_through_offload_and_tt(tmp_path):
  """The entity table goes through the plan like any table: `offload` (a cache smaller than
  the table, rows evicted and written back) trains bit-identically to `dense`; `tt`'s lookups
  are its own reconstruction's rows, which the steps moved from its init."""
  path = _small_kg(tmp_path / "kg", n_ent=300) if os.makedirs(tmp_path / "kg") is None else None
  over = {"train.scoring": "sampled", "train.group_queries": False, "negatives.num": 5}
  dense = _train_tables(path, "dense", str(tmp_path / "d"), **over)
  offload = _train_tables(path, "offload(cache_rows=150)", str(tmp_path / "o"), **over)
  np.testing.assert_array_equal(offload[:300], dense[:300])

  # TT against its own reconstruction: its trained lookups are the reconstructed rows, and
  # those rows moved from its init (the same seed's TT, untrained) where the steps touched.
  def lookups_are_rows(result):
    bags = {t: 1 for g in result.plan.groups.values() for t in g.specs}
    assert contract.lookups_match_own_tables(result, bags, batch=32) == len(bags)

  tt = _train_tables(path, "tt(rank=4)", str(tmp_path / "t"), check=lookups_are_rows, **over)
  assert np.isfinite(tt).all() and tt.shape[1] == 8
  init = _init_tables(path, "tt(rank=4)", **over)
  assert tt.shape == init.shape and not np.allclose(tt, init)


def test_queries_split_over_the_mesh(tmp_path, monkeypatch):
  """Task.batch_spec: a 1-vs-all step's queries are batch-major (split over the devices), its
  label pairs and per-entity answer counts replicated (the entity ids too); 8 devices
  (conftest) train the table that a 1-device mesh trains."""
  from recgnn import sharding
  from recgnn.train import train_state as state_lib

  path = _small_kg(tmp_path / "kg") if os.makedirs(tmp_path / "kg") is None else None
  over = {"batch_size": 16}
  task = make_task(lp.LinkPrediction, _config(path, "complex", **over))
  assert not task.shard_batch
  spec = task.batch_spec(state_lib.device_batch(next(task.train_batches(0))))
  assert {k for k, s in spec.items() if s == sharding.BATCH_SPEC} == {"h", "rel", "cnt", "weight"}
  assert spec["lab_q"] == spec["lab_e"] == spec["t_cnt"] == sharding.REPLICATED
  assert jax.device_count() == 8
  one = _train_tables(path, "dense", str(tmp_path / "one"), mesh={"data": 1, "model": 1}, **over)
  # The trainer packs every batch by the task's specs, asked once per batch signature
  # (feeder.Feeder keeps them per tree structure and leaf shapes).
  seen = []
  spec_fn = lp.LinkPrediction.batch_spec
  monkeypatch.setattr(
    lp.LinkPrediction, "batch_spec", lambda self, b: seen.append(spec_fn(self, b)) or seen[-1]
  )
  eight = _train_tables(path, "dense", str(tmp_path / "eight"), **over)
  assert seen and all(s["h"] == sharding.BATCH_SPEC for s in seen)
  np.testing.assert_allclose(eight, one, rtol=1e-4, atol=1e-5)


def test_tfds_source_gives_the_same_task(tmp_path):
  """data.source=tfds reads the fb15k237 array_record build of the same triples: the same
  entities, relations, splits and filter as the files."""
  (tmp_path / "kg").mkdir()
  path = _small_kg(tmp_path / "kg")
  files = make_task(lp.LinkPrediction, _config(path, "distmult"))
  tfds = make_task(
    lp.LinkPrediction,
    _config(path, "distmult", **{"data.source": "tfds", "data.tfds_dir": str(tmp_path / "t")}),
  )
  assert files.kg.entities == tfds.kg.entities and files.kg.relations == tfds.kg.relations
  for s in files.kg.splits:
    np.testing.assert_array_equal(files.kg.splits[s], tfds.kg.splits[s])
  np.testing.assert_array_equal(files.train_triples, tfds.train_triples)
  with pytest.raises(
    ValueError, match="Unknown data.source 'csv'; available: files, tfds, planted"
  ):
    make_task(lp.LinkPrediction, _config(path, "distmult", **{"data.source": "csv"}))
