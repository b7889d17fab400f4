"""The link task's scoring: the pairs each evaluation scores (fixed, saved with the run), the
training loss over a batch's pairs, and the eval metrics (ROC-AUC, Hits@K against the fixed
negatives as OGB's evaluator, MRR of each positive among its own negatives)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from recgnn import metrics as metrics_lib
from recgnn.data.link_split import LinkSplit
from recgnn.tasks.link_prediction import rank_metrics
from recgnn.tasks.node_batch import TABLE
from recgnn.tasks.sage_link.batches import FIXED_NEGATIVE, POSITIVE, QUERY_NEGATIVE


def eval_sets(split: LinkSplit, config, seed: int) -> dict[str, tuple]:
  """{valid | test: (pairs int64[P, 2], kind int32[P], query int32[P])}: the split's positives
  (kind 0, query = their index), its fixed negatives (kind 1, query -1), and with
  eval.mrr_negatives = K > 0 (or a split that brings its own, OGB citation2's) K negative
  targets per positive, paired with its source (kind 2, query = the positive's index), drawn
  uniformly with a seed of their own (the same for every run of this seed)."""
  k = int(config.eval.get("mrr_negatives", 0))
  out = {}
  for name in ("valid", "test"):
    pos, neg = split.positives(name), split.negatives(name)
    targets = split.target_negatives(name)
    if targets is None and k > 0:
      rng = np.random.default_rng([seed, 62, 1 if name == "valid" else 2])
      targets = rng.integers(0, split.num_nodes, (len(pos), k))
    parts = [
      (pos, np.full(len(pos), POSITIVE), np.arange(len(pos))),
      (neg, np.full(len(neg), FIXED_NEGATIVE), np.full(len(neg), -1)),
    ]
    if targets is not None:
      q = np.repeat(np.arange(len(pos)), targets.shape[1])
      pairs = np.stack([pos[q, 0], targets.reshape(-1)], axis=1)
      parts.append((pairs, np.full(len(q), QUERY_NEGATIVE), q))
    out[name] = tuple(
      np.concatenate([p[i] for p in parts]).astype(dt)
      for i, dt in enumerate((np.int64, np.int32, np.int32))
    )
  return out


def artifacts(sets: dict[str, tuple]) -> dict[str, np.ndarray]:
  """The scored pairs of every eval split, for the run's artifacts.npz."""
  return {f"{name}_pairs": pairs for name, (pairs, _, _) in sets.items()}


def full_graph_batch(split: LinkSplit, name: str, pairs_set, inputs: str, chunk_edges: int,
                     id_multiple: int) -> dict:  # fmt: skip
  """The one eval batch of eval.inference=full for split `name`: every node's inputs ("x"
  float32[N, F] and / or "ids" {node: int32[N', 1]}, "frontier" = arange(N)), the message
  graph ("msg_src" / "msg_dst" int32[E'], E' rounded up to a multiple of chunk_edges, padding
  dst = N; "inv_deg" float32[N]) and every scored pair by node id (pair_src / pair_dst,
  label, weight, kind, query)."""
  n = split.num_nodes
  adj = split.message_adj(name).tocoo()
  e = adj.nnz
  pad = -(-max(e, 1) // chunk_edges) * chunk_edges - e
  batch: dict = {"ids": {}}
  if inputs != "embeddings":
    batch["x"] = split.features
  if inputs != "features":
    ids = np.arange(-(-n // id_multiple) * id_multiple, dtype=np.int32)
    batch["ids"] = {TABLE: np.where(ids < n, ids, -1)[:, None]}
  batch["frontier"] = np.arange(n, dtype=np.int32)
  # Row v of the adjacency aggregates from column u (recgnn.graphs.store).
  batch["msg_src"] = np.pad(adj.col.astype(np.int32), (0, pad))
  batch["msg_dst"] = np.pad(adj.row.astype(np.int32), (0, pad), constant_values=n)
  batch["inv_deg"] = (1.0 / np.maximum(np.bincount(adj.row, minlength=n), 1)).astype(np.float32)
  pairs, kind, query = pairs_set
  batch["pair_src"], batch["pair_dst"] = pairs[:, 0].astype(np.int32), pairs[:, 1].astype(np.int32)
  batch["label"] = (kind == POSITIVE).astype(np.float32)
  batch["weight"] = np.ones(len(pairs), np.float32)
  batch["kind"], batch["query"] = kind, query
  return batch


def chunk(pairs, kind, query, start: int, size: int):
  """Pairs [start, start + size) of an eval set, padded to `size` (pairs -1, kind and query
  -1)."""
  sl = slice(start, start + size)
  pad = size - len(pairs[sl])
  return (
    np.pad(pairs[sl], ((0, pad), (0, 0)), constant_values=-1),
    np.pad(kind[sl], (0, pad), constant_values=-1),
    np.pad(query[sl], (0, pad), constant_values=-1),
  )


def pair_loss(s: jax.Array, label: jax.Array, weight: jax.Array):
  """Binary cross-entropy of logits float32[P]: the positives' mean plus the negatives' mean
  (OGB's link examples; each mean over the pairs of non-zero weight)."""
  wp, wn = weight * label, weight * (1.0 - label)
  lp = jnp.sum(jax.nn.softplus(-s) * wp) / jnp.maximum(wp.sum(), 1.0)
  ln = jnp.sum(jax.nn.softplus(s) * wn) / jnp.maximum(wn.sum(), 1.0)
  return lp + ln, {"pos_loss": lp, "neg_loss": ln}


def hits_at(pos: np.ndarray, neg: np.ndarray, k: int) -> float:
  """OGB's Hits@K: the fraction of positive scores above the K-th highest negative score
  (1.0 when there are fewer than K negatives)."""
  if neg.size < k:
    return 1.0
  kth = np.partition(neg, neg.size - k)[neg.size - k]
  return float(np.mean(pos > kth))


def query_ranks(score, kind, query) -> np.ndarray:
  """float64[Q]: each positive's rank among its own negatives (kind 2), 1 + #higher +
  #tied / 2, for the positives that have any."""
  pos = kind == POSITIVE
  by_query = np.full(int(query.max(initial=-1)) + 1, np.nan)
  by_query[query[pos]] = score[pos]
  neg = kind == QUERY_NEGATIVE
  q, s = query[neg], score[neg]
  n = by_query.size
  higher = np.bincount(q, weights=s > by_query[q], minlength=n)
  tied = np.bincount(q, weights=s == by_query[q], minlength=n)
  has = np.bincount(q, minlength=n) > 0
  return (1.0 + higher + tied / 2)[has]


def metrics(outputs, hits: tuple[int, ...]) -> dict[str, float]:
  """Host side: roc_auc (positives vs fixed negatives), hits@K for each K, and with
  per-positive negatives mrr (and its mrr_hits@1/3/10)."""
  cat = {k: np.concatenate([np.asarray(o[k]) for o in outputs]) for k in outputs[0]}
  keep = cat["weight"] > 0
  score, kind, query = cat["score"][keep], cat["kind"][keep], cat["query"][keep]
  fixed = kind != QUERY_NEGATIVE
  res = {"roc_auc": metrics_lib.auc((kind[fixed] == POSITIVE), score[fixed])}
  pos, neg = score[kind == POSITIVE], score[kind == FIXED_NEGATIVE]
  for k in hits:
    res[f"hits@{k}"] = hits_at(pos, neg, k)
  if np.any(kind == QUERY_NEGATIVE):
    ranked = rank_metrics(query_ranks(score, kind, query))
    res["mrr"] = ranked.pop("mrr")
    res.update({f"mrr_{k}": v for k, v in ranked.items()})
  return res
