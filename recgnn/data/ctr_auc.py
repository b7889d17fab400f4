"""AUCs of the synthetic CTR data: `roc_auc` (ties 1/2, optionally weighted), `expected_auc`
(in expectation over Bernoulli(p) labels: what calibration targets) and the dense-only
baseline (`dense_only_baseline_auc`: what the 13 dense features alone reach)."""

from __future__ import annotations

import numpy as np
import scipy.special

from recgnn import metrics
from recgnn.data import criteo


def expected_auc(p: np.ndarray, presorted: bool = False) -> float:
  """AUC of score p when each label is Bernoulli(p), in expectation over the labels:
  P(score of a random positive > score of a random negative), ties counting 1/2."""
  ps = np.asarray(p, np.float64) if presorted else np.sort(np.asarray(p, np.float64))
  _, first, counts = np.unique(ps, return_index=True, return_counts=True)
  pos, neg = ps, 1.0 - ps
  neg_group = np.add.reduceat(neg, first)
  pos_group = np.add.reduceat(pos, first)
  neg_below = np.cumsum(neg_group) - neg_group
  num = np.sum(pos_group * (neg_below + 0.5 * neg_group)) - 0.5 * np.sum(
    np.add.reduceat(pos * neg, first)
  )  # a row is never paired with itself
  den = pos.sum() * neg.sum() - np.sum(pos * neg)
  return float(num / den) if den > 0 else 1.0  # every p is 0 or 1: a perfect score


def roc_auc(scores: np.ndarray, labels: np.ndarray, weights: np.ndarray | None = None) -> float:
  """Area under the ROC curve (ties count 1/2), optionally weighted (weight 0 = padding)."""
  scores = np.asarray(scores, np.float64).ravel()
  labels = np.asarray(labels).ravel() > 0.5
  w = np.ones_like(scores) if weights is None else np.asarray(weights, np.float64).ravel()
  if weights is None:
    ranks = metrics.average_ranks(scores)  # (scipy.stats.rankdata's, without importing scipy)
    npos = labels.sum()
    nneg = labels.size - npos
    if npos == 0 or nneg == 0:
      raise ValueError("AUC needs both positive and negative labels")
    return float((ranks[labels].sum() - npos * (npos + 1) / 2) / (npos * nneg))
  order = np.argsort(scores, kind="stable")
  s, y, w = scores[order], labels[order], w[order]
  _, first = np.unique(s, return_index=True)
  pos_g = np.add.reduceat(w * y, first)
  neg_g = np.add.reduceat(w * ~y, first)
  neg_below = np.cumsum(neg_g) - neg_g
  den = pos_g.sum() * neg_g.sum()
  if den == 0:
    raise ValueError("AUC needs both positive and negative labels")
  return float(np.sum(pos_g * (neg_below + 0.5 * neg_g)) / den)


def dense_only_baseline_auc(
  dataset: criteo.CriteoDataset,
  *,
  max_train_rows: int = 300_000,
  eval_split: str = "test",
  seed: int = 0,
) -> float:
  """AUC on `eval_split` of a logistic regression on the 13 log dense features only.

  Features: x, x^2 and [x == 0] of each log feature (a flexible per-feature curve), fitted by
  Newton's method on up to `max_train_rows` random train rows. This is the ceiling of what the
  dense features alone say, to report beside the oracle AUC.
  """
  start, stop = dataset.splits["train"]
  rng = np.random.default_rng(seed)
  n = stop - start
  rows = start + np.sort(rng.choice(n, min(n, max_train_rows), replace=False))

  def features(dense):
    x = np.asarray(dense, np.float64)
    return np.concatenate([np.ones((x.shape[0], 1)), x, x * x, x == 0], axis=1)

  x = features(dataset.dense[rows])
  y = np.asarray(dataset.labels[rows], np.float64)
  mean, std = x.mean(0), x.std(0)
  mean[0], std[0] = 0.0, 1.0
  std[std == 0] = 1.0
  x = (x - mean) / std
  w = np.zeros(x.shape[1])
  for _ in range(25):  # Newton / IRLS with a little ridge for constant columns
    # einsum, not BLAS: multi-threaded BLAS crawls on a shared, oversubscribed CPU.
    p = scipy.special.expit(np.einsum("nf,f->n", x, w))
    g = np.einsum("nf,n->f", x, p - y) + 1e-6 * w
    h = np.einsum("nf,ng->fg", x * (p * (1 - p))[:, None], x) + 1e-6 * np.eye(x.shape[1])
    step = np.linalg.solve(h, g)
    w -= step
    if np.abs(step).max() < 1e-7:
      break
  lo, hi = dataset.splits[eval_split]
  xe = (features(dataset.dense[lo:hi]) - mean) / std
  return roc_auc(np.einsum("nf,f->n", xe, w), dataset.labels[lo:hi])
