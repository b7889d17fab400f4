"""The link-prediction task's model side (jitted): the encoder and relation params, the three
training losses (per-edge 1vsall or sampled negatives, grouped 1vsall queries, partition-
parallel: G partitions in shard_map) with their regularizers, and the filtered ranks of eval."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from recgnn import sharding
from recgnn.data import kg as kg_lib
from recgnn.models import kge, rgcn
from recgnn.tasks.link_prediction.options import TABLE, LinkPredictionOptions


def rank_metrics(ranks: np.ndarray, side: np.ndarray | None = None) -> dict[str, float]:
  """Host side: MRR, Hits@1/3/10 of filtered ranks f64[Q] (and MRR per side: 0 tail, 1 head)."""
  ranks = np.asarray(ranks, np.float64)
  res = {"mrr": float(np.mean(1 / ranks))}
  for k in (1, 3, 10):
    res[f"hits@{k}"] = float(np.mean(ranks <= k))
  if side is not None:
    for s, name in ((0, "tail"), (1, "head")):
      sel = side == s
      if sel.any():
        res[f"mrr_{name}"] = float(np.mean(1 / ranks[sel]))
  return res


class Losses:
  """The model side of the task: the relation embeddings and the optional R-GCN encoder
  (Flax modules built here from the options), the training losses and eval's filtered ranks;
  pure and jit-able, reading the options, the KG's sizes and the mesh it is handed."""

  def __init__(self, options: LinkPredictionOptions, kg: kg_lib.KG, mesh: jax.sharding.Mesh):
    o = options
    self.options = options
    self.mesh = mesh
    self.num_entities = kg.num_entities
    self.reciprocal = kg.reciprocal
    self.num_base_relations = kg.num_base_relations
    self.relations = kge.Relations(
      kg.num_relations, kge.relation_dim(o.decoder, o.dim), o.decoder, o.relation_init
    )
    self.encoder = None
    if o.encoder == "rgcn":
      self.encoder = rgcn.RGCN(
        num_relations=kg.num_relations if kg.reciprocal else 2 * kg.num_relations,
        dim=o.dim,
        num_bases=o.rgcn_bases,
        num_layers=o.rgcn_layers,
        dropout=o.rgcn_dropout,
        edge_dropout=o.rgcn_edge_dropout,
      )

  def encode(self, params, batch, rows, train: bool, key=None):
    """rows f32[M, D] -> the encoder's f32[M, D] over the batch's graph (rows as they are
    without an encoder)."""
    if self.encoder is None:
      return rows
    graph = {"src": batch["src"], "dst": batch["dst"], "rel": batch["erel"], "norm": batch["enorm"]}
    rngs = {"dropout": key} if train else {}
    return self.encoder.apply({"params": params["encoder"]}, rows, graph, train, rngs=rngs)

  def _rel(self, params, rel):
    return self.relations.apply({"params": params["relations"]}, rel)

  @staticmethod
  def _stacked(batch) -> bool:
    """A partition-parallel train batch: every leaf has a leading axis of partitions."""
    return "h" in batch and np.ndim(batch["h"]) == 2

  def init_params(self, key, batch, embeddings):
    if self._stacked(batch):  # the params do not depend on the graph: init on slot 0
      rows = embeddings[TABLE][: embeddings[TABLE].shape[0] // batch["h"].shape[0]]
      return self.init_params(key, jax.tree.map(lambda x: x[0], batch), {TABLE: rows})
    k1, k2 = jax.random.split(key)
    rel = jnp.asarray(batch["rel"])
    params = {"relations": self.relations.init(k1, rel)["params"]}
    if self.encoder is not None:
      graph = {
        "src": batch["src"],
        "dst": batch["dst"],
        "rel": batch["erel"],
        "norm": batch["enorm"],
      }
      params["encoder"] = self.encoder.init(k2, embeddings[TABLE], graph, False)["params"]
    return params

  def loss(self, params, batch, embeddings, key):
    if self._stacked(batch):
      return self._parallel_loss(params, batch, embeddings[TABLE], key)
    k_enc, k_drop = jax.random.split(key)
    rows = self.encode(params, batch, embeddings[TABLE], True, k_enc)
    if "cnt" in batch:
      return self._grouped_loss(params, batch, rows, k_drop)
    h = jnp.take(rows, batch["h"], axis=0)
    t = jnp.take(rows, batch["t"], axis=0)
    r = self._rel(params, batch["rel"])
    rate = self.options.dropout
    hd = h
    if rate > 0:
      keep = jax.random.bernoulli(k_drop, 1 - rate, h.shape)
      hd = jnp.where(keep, h / (1 - rate), 0.0)
    gamma, p = self.options.gamma, self.options.p
    if self.options.scoring == "1vsall":
      scores = kge.score_all(self.options.decoder, hd, r, rows, "tail", gamma, p)  # [B, M]
      if "cand_mask" in batch:
        scores = jnp.where(batch["cand_mask"][None] > 0, scores, -1e30)
      ce = optax.softmax_cross_entropy_with_integer_labels(scores, batch["t"])
    else:
      neg = jnp.take(rows, batch["neg"], axis=0)  # [B, K, D], or [K, D] shared
      pos = kge.score(self.options.decoder, hd, r, t, gamma, p)
      if batch["neg"].ndim == 1:
        negs = kge.score_all(self.options.decoder, hd, r, neg, "tail", gamma, p)
      else:
        negs = kge.score(self.options.decoder, hd[:, None], r[:, None], neg, gamma, p)
      logits = jnp.concatenate([pos[:, None], negs], 1)
      ce = -jax.nn.log_softmax(logits, axis=-1)[:, 0]
    w = batch["weight"]
    denom = jnp.maximum(w.sum(), 1.0)
    loss = jnp.sum(ce * w) / denom
    aux = {"ce": loss}
    lam = self.options.reg_weight
    if self.options.regularizer != "none" and lam > 0:
      wv = w[:, None]
      if self.options.regularizer == "n3":
        pairs = self.options.decoder in ("complex", "rotate")
        reg = kge.n3(h * wv, r * wv, t * wv, complex_pairs=pairs) / denom
      else:
        reg = (jnp.sum((h * wv) ** 2) + jnp.sum((r * wv) ** 2) + jnp.sum((t * wv) ** 2)) / denom
      loss = loss + lam * reg
      aux["reg"] = reg
    return loss, aux

  def _parallel_loss(self, params, batch, rows, key):
    """G partition batches at once, combined as the edge-weighted mean over all G batches:
    sum_g (W_g / W) loss_g with W_g its edges (a task loss divides by max(W_g, 1), undone
    here), which is the loss of the G batches' edges taken together. In shard_map over the
    mesh: each device runs the ordinary one-partition loss on its G / devices partitions
    (a vmap over the partition axis instead is slower: XLA's batched gathers and scatters),
    and the sums meet outside (the gradient of the replicated params is then
    summed over the devices by shard_map's transpose). Partition g's dropout key:
    fold_in(key, g)."""
    G = batch["h"].shape[0]
    rows = rows.reshape(G, rows.shape[0] // G, rows.shape[1])
    keys = jax.vmap(lambda g: jax.random.fold_in(key, g))(jnp.arange(G))
    split = sharding.P(sharding.BATCH)

    @functools.partial(
      jax.shard_map,
      mesh=self.mesh,
      in_specs=(sharding.REPLICATED, split, split, split),
      out_specs=split,
      check_vma=False,  # no collective inside; replicated params' cotangents psummed
    )
    def local(params, batch, rows, keys):
      out = []
      for j in range(rows.shape[0]):
        b = jax.tree.map(lambda x, j=j: x[j], batch)
        loss, aux = self.loss(params, b, {TABLE: rows[j]}, keys[j])
        w = jnp.sum(b["weight"])
        c = jnp.maximum(w, 1.0)
        out.append((loss * c, jax.tree.map(lambda a, c=c: a * c, aux), w))
      return jax.tree.map(lambda *x: jnp.stack(x), *out)

    loss, aux, w = local(params, batch, rows, keys)
    total = jnp.maximum(jnp.sum(w), 1.0)
    return jnp.sum(loss) / total, jax.tree.map(lambda a: jnp.sum(a) / total, aux)

  def _dropout(self, x, key):
    rate = self.options.dropout
    if rate <= 0:
      return x
    keep = jax.random.bernoulli(key, 1 - rate, x.shape)
    return jnp.where(keep, x / (1 - rate), 0.0)

  def _grouped_loss(self, params, batch, rows, key):
    """Sum over the batch's triples of CE_t = logsumexp(scores) - score_t, / #triples."""
    h = jnp.take(rows, batch["h"], axis=0)
    r = self._rel(params, batch["rel"])
    gamma, p = self.options.gamma, self.options.p
    scores = kge.score_all(self.options.decoder, self._dropout(h, key), r, rows, "tail", gamma, p)
    cnt = batch["cnt"]
    lse = jax.nn.logsumexp(scores, axis=1)
    valid = batch["lab_q"] < scores.shape[0]
    pos = scores.at[batch["lab_q"], batch["lab_e"]].get(mode="fill", fill_value=0.0)
    total = jnp.maximum(cnt.sum(), 1.0)
    loss = (jnp.sum(cnt * lse) - jnp.sum(jnp.where(valid, pos, 0.0))) / total
    aux = {"ce": loss}
    lam = self.options.reg_weight
    if self.options.regularizer != "none" and lam > 0:
      # Each triple's h, r and t count once: h and r weighted by the answers per query, every
      # entity row by how often it is an answer in the batch (t_cnt). Gathering the label_cap
      # answer rows instead cost 2/3 of the step (its gradient a [label_cap, D] scatter-add).
      c = cnt[:, None]
      tc = batch["t_cnt"][:, None]
      if self.options.regularizer == "n3":
        pairs = self.options.decoder in ("complex", "rotate")
        third = 1 / 3  # |c^(1/3) x|^3 = c |x|^3, complex moduli too
        reg = kge.n3(h * c**third, r * c**third, rows * tc**third, complex_pairs=pairs) / total
      else:
        reg = (jnp.sum(c * h**2) + jnp.sum(c * r**2) + jnp.sum(tc * rows**2)) / total
      loss = loss + lam * reg
      aux["reg"] = reg
    return loss, aux

  def predict(self, params, batch, embeddings):
    rows = embeddings[TABLE]
    if self.options.parallel:
      # Rows come split over the devices (ids are batch-major in these runs): gather them
      # once (N x D floats) so that the whole-graph encoder runs on replicated rows rather
      # than XLA partitioning its gathers. The padding rows are no candidates.
      rows = sharding.replicate(rows, self.mesh)
    rows = self.encode(params, batch, rows, False)[: self.num_entities]
    q = jnp.take(rows, batch["anchor"], axis=0)
    gamma, p = self.options.gamma, self.options.p
    if self.reciprocal:
      scores = kge.score_all(
        self.options.decoder, q, self._rel(params, batch["rel"]), rows, "tail", gamma, p
      )
    else:
      R = self.num_base_relations
      base_rel = jnp.where(batch["side"] == 1, batch["rel"] - R, batch["rel"])
      r = self._rel(params, base_rel)
      tail = kge.score_all(self.options.decoder, q, r, rows, "tail", gamma, p)
      head = kge.score_all(self.options.decoder, q, r, rows, "head", gamma, p)
      scores = jnp.where(batch["side"][:, None] == 1, head, tail)
    B = scores.shape[0]
    target = jnp.take_along_axis(scores, batch["target"][:, None], axis=1)
    scores = scores.at[batch["filt_q"], batch["filt_e"]].set(-jnp.inf, mode="drop")
    higher = jnp.sum(scores > target, axis=1).astype(jnp.float32)
    tied = jnp.sum(scores == target, axis=1).astype(jnp.float32) - 1.0
    del B
    return {"rank": 1.0 + higher + tied / 2, "side": batch["side"], "weight": batch["weight"]}

  def metrics(self, outputs):
    rank = np.concatenate([np.asarray(o["rank"]) for o in outputs])
    side = np.concatenate([np.asarray(o["side"]) for o in outputs])
    w = np.concatenate([np.asarray(o["weight"]) for o in outputs])
    keep = w > 0
    return rank_metrics(rank[keep], side[keep])
