"""Adjacency eigenvectors: Nimble's "eigen" initialization of node embeddings.

`eigen_embedding(adj, dim)` is float32[N, dim]: the eigenvectors of the `dim` largest
eigenvalues of the symmetrically normalised adjacency S = D^-1/2 A D^-1/2 (the smooth
directions of the graph: community indicators on a graph with planted communities), found by
randomized subspace iteration (Halko, Martinsson, Tropp 2011) on (I + S) / 2, whose spectrum
is S's shifted into [0, 1] so that the largest |eigenvalue| is the largest eigenvalue. Cost:
`iters` sparse products with an [N, dim + oversample] block, then a Rayleigh-Ritz step;
`scipy.sparse.linalg.eigsh` would be exact and several times slower on a large graph. An init
needs the leading subspace, not 6 digits.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp


def normalized_adjacency(adj: sp.csr_matrix) -> sp.csr_matrix:
  """S = D^-1/2 (A + A^T)/2 D^-1/2, float64 (isolated nodes: a zero row)."""
  a = adj.tocsr().astype(np.float64)
  a = ((a + a.T) * 0.5).tocsr()
  deg = np.asarray(a.sum(axis=1)).ravel()
  inv = np.where(deg > 0, 1.0 / np.sqrt(np.maximum(deg, 1e-300)), 0.0)
  d = sp.diags(inv)
  return (d @ a @ d).tocsr()


def eigen_embedding(
  adj: sp.csr_matrix,
  dim: int,
  *,
  iters: int = 30,
  oversample: int = 16,
  seed: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
  """(float32[N, dim] eigenvectors, float64[dim] eigenvalues of S, descending).

  Columns are unit-norm and orthogonal; each column's sign is fixed so its largest-magnitude
  entry is positive (deterministic output).
  """
  s = normalized_adjacency(adj)
  n = s.shape[0]
  k = min(n, dim + oversample)
  rng = np.random.default_rng([seed, 0xE16])
  q, _ = np.linalg.qr(rng.standard_normal((n, k)))
  for _ in range(iters):
    q, _ = np.linalg.qr(0.5 * (q + s @ q))
  # Rayleigh-Ritz in the subspace.
  h = q.T @ (s @ q)
  vals, vecs = np.linalg.eigh(0.5 * (h + h.T))
  top = np.argsort(vals)[::-1][:dim]
  vecs = q @ vecs[:, top]
  signs = np.sign(vecs[np.abs(vecs).argmax(axis=0), np.arange(vecs.shape[1])])
  vecs *= np.where(signs == 0, 1.0, signs)
  if vecs.shape[1] < dim:  # fewer nodes than dim
    vecs = np.pad(vecs, ((0, 0), (0, dim - vecs.shape[1])))
  return vecs.astype(np.float32), vals[top]
