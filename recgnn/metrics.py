"""Evaluation metrics, computed on the host from numpy arrays (off the step's path)."""

from __future__ import annotations

import numpy as np


def auc(labels: np.ndarray, scores: np.ndarray, weights: np.ndarray | None = None) -> float:
  """Exact ROC AUC (ties count 1/2), the Mann-Whitney U statistic; O(n log n).

  Examples with weight 0 (padding) are ignored; other weights must be 1.
  """
  labels, scores = np.asarray(labels).reshape(-1), np.asarray(scores).reshape(-1)
  if weights is not None:
    keep = np.asarray(weights).reshape(-1) > 0
    labels, scores = labels[keep], scores[keep]
  pos = labels > 0.5
  n_pos, n_neg = int(pos.sum()), int((~pos).sum())
  if n_pos == 0 or n_neg == 0:
    return float("nan")
  ranks = average_ranks(scores.astype(np.float64))
  return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def average_ranks(x: np.ndarray) -> np.ndarray:
  """1-based ranks of float64[n] `x`, ties given their average rank (scipy.stats.rankdata's
  "average"), in numpy: importing scipy.stats would slow every trainer process's start."""
  if np.isnan(x).any():  # as scipy's default (nan_policy="propagate"): no ranks
    return np.full(len(x), np.nan)
  order = np.argsort(x, kind="stable")
  xs = x[order]
  first = np.empty(len(x), bool)
  first[:1] = True
  np.not_equal(xs[1:], xs[:-1], out=first[1:])
  starts = np.flatnonzero(first)  # each tie group's first position in sorted order
  counts = np.diff(np.append(starts, len(x)))
  ranks = np.empty(len(x), np.float64)
  ranks[order] = np.repeat(starts + (counts + 1) / 2, counts)
  return ranks


def logloss(labels, probs, weights=None, eps: float = 1e-7) -> float:
  """Mean binary cross-entropy of probabilities (clipped to [eps, 1 - eps])."""
  labels, probs = (
    np.asarray(labels, np.float64),
    np.clip(np.asarray(probs, np.float64), eps, 1 - eps),
  )
  w = np.ones_like(labels) if weights is None else np.asarray(weights, np.float64)
  ll = -(labels * np.log(probs) + (1 - labels) * np.log(1 - probs))
  return float((ll * w).sum() / w.sum())


def accuracy(labels, probs, weights=None, threshold: float = 0.5) -> float:
  """Fraction of examples whose thresholded probability equals the label."""
  labels, probs = np.asarray(labels), np.asarray(probs)
  w = np.ones(labels.shape) if weights is None else np.asarray(weights, np.float64)
  return float((((probs > threshold) == (labels > 0.5)) * w).sum() / w.sum())
