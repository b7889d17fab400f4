"""Bounded Zipf ids, as the synthetic Criteo generator draws them (numpy's Zipf is unbounded).

zipf_cdf(rows, exponent)          the CDF of P(rank r) ~ r^-exponent
zipf_ranks(rng, cdf, shape)       ranks drawn from it (0: the most frequent)
zipf_ids(rng, rows, shape, e)     ids: ranks scattered over the table by a permutation
"""

from __future__ import annotations

import numpy as np


def zipf_cdf(num_rows: int, exponent: float) -> np.ndarray:
  """float64[num_rows]: the CDF of P(rank r) ~ r^-exponent, r = 1..num_rows."""
  cdf = np.cumsum(np.arange(1, num_rows + 1, dtype=np.float64) ** -exponent)
  return cdf / cdf[-1]


def zipf_ranks(rng: np.random.Generator, cdf: np.ndarray, shape) -> np.ndarray:
  """int64 ranks of `shape` drawn from `cdf` (zipf_cdf): 0 is the most frequent."""
  return np.minimum(np.searchsorted(cdf, rng.random(shape)), len(cdf) - 1)


def zipf_ids(
  rng: np.random.Generator, num_rows: int, shape, exponent: float, perm: np.ndarray | None = None
) -> np.ndarray:
  """Ids with P(rank r) ~ r^-exponent over [0, num_rows), ranks scattered by a permutation.

  Hot rows land anywhere in the table, as with hashed categorical features. `perm`: the rank
  -> id permutation (pass one to keep the same hot rows over a stream of batches); by default
  a fresh one drawn after the ranks (int64 ids).
  """
  ranks = zipf_ranks(rng, zipf_cdf(num_rows, exponent), shape)
  if perm is None:
    return rng.permutation(num_rows)[ranks].astype(np.int64)
  return perm[ranks]
