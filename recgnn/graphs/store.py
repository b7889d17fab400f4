"""The graph store: a CSR adjacency on the host, node features, labels and splits.

Convention: row i of `adj` lists the nodes whose messages node i aggregates (its in-neighbours
for message passing). Loaders of undirected graphs store both directions, so `adj` is
symmetric; samplers never assume it.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import scipy.sparse as sp

SPLITS = ("train", "valid", "test")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Graph:
  """A node-classification graph, host resident.

  Attributes:
    name: for logs.
    adj: scipy CSR [N, N], sorted indices, no duplicates, float32 data (1.0 unless weighted).
    labels: int32[N], -1 where unknown.
    num_classes: number of label classes.
    splits: {"train" | "valid" | "test": int64[n_split]} node ids.
    features: float32[N, F] or None (graphs trained with learnable node embeddings only).
    original_ids: int64[N], the id node i had when the graph was loaded (after `relabel`),
      or None (never relabelled: ids are the original ones). Predictions, embeddings and
      exported tables map back to the dataset's ids through it.
  """

  name: str
  adj: sp.csr_matrix
  labels: np.ndarray
  num_classes: int
  splits: dict[str, np.ndarray]
  features: np.ndarray | None = None
  original_ids: np.ndarray | None = None

  def __post_init__(self):
    n = self.adj.shape[0]
    if self.adj.shape != (n, n) or self.adj.format != "csr":
      raise ValueError(f"Graph {self.name!r}: adj must be square CSR, got {self.adj!r}")
    if self.labels.shape != (n,):
      raise ValueError(f"Graph {self.name!r}: labels must be [{n}], got {self.labels.shape}")
    if self.features is not None and self.features.shape[0] != n:
      raise ValueError(
        f"Graph {self.name!r}: features have {self.features.shape[0]} rows for {n} nodes"
      )
    if self.original_ids is not None and self.original_ids.shape != (n,):
      raise ValueError(f"Graph {self.name!r}: original_ids must be [{n}]")
    for split, ids in self.splits.items():
      if split not in SPLITS:
        raise ValueError(f"Graph {self.name!r}: unknown split {split!r}; use one of {SPLITS}")
      if ids.size and (ids.min() < 0 or ids.max() >= n):
        raise ValueError(f"Graph {self.name!r}: split {split!r} has node ids outside [0, {n})")

  @property
  def num_nodes(self) -> int:
    return self.adj.shape[0]

  @property
  def num_edges(self) -> int:
    """Stored (directed) adjacency entries; an undirected edge counts twice."""
    return self.adj.nnz

  @property
  def num_features(self) -> int:
    return 0 if self.features is None else self.features.shape[1]

  def degrees(self) -> np.ndarray:
    """int64[N]: entries per adjacency row."""
    return np.diff(self.adj.indptr)

  def relabel(self, perm: np.ndarray) -> Graph:
    """The same graph with node `perm[j]` renamed `j` (perm: int[N], a permutation).

    Adjacency rows and columns, labels, features and split ids all move with their node, so a
    model trained on the relabelled graph sees the same graph; `original_ids` keeps the ids
    of the loaded graph (composed over repeated relabels).
    """
    n = self.num_nodes
    perm = np.asarray(perm, np.int64)
    if perm.shape != (n,) or not np.array_equal(np.sort(perm), np.arange(n)):
      raise ValueError(f"Graph {self.name!r}: relabel needs a permutation of range({n})")
    inverse = np.empty(n, np.int64)
    inverse[perm] = np.arange(n)
    # P A P^T by index arithmetic (a CSR row gather then a column rename): O(nnz), no sparse
    # matmul, and the rows stay sorted after one per-row sort.
    adj = self.adj[perm]
    adj = sp.csr_matrix(
      (adj.data, inverse[adj.indices].astype(adj.indices.dtype), adj.indptr), shape=adj.shape
    )
    adj.sort_indices()
    original = np.arange(n) if self.original_ids is None else self.original_ids
    return dataclasses.replace(
      self,
      adj=adj,
      labels=self.labels[perm],
      features=None if self.features is None else self.features[perm],
      splits={k: np.sort(inverse[v]) for k, v in self.splits.items()},
      original_ids=original[perm],
    )

  def describe(self) -> str:
    deg = self.degrees()
    sizes = ", ".join(f"{k} {v.size:,}" for k, v in self.splits.items())
    return (
      f"graph {self.name}: {self.num_nodes:,} nodes, {self.num_edges:,} adjacency entries "
      f"(mean degree {deg.mean():.1f}, max {deg.max():,}), {self.num_features} features, "
      f"{self.num_classes} classes; splits: {sizes}"
    )


def csr_from_edges(
  src: np.ndarray, dst: np.ndarray, num_nodes: int, *, undirected: bool = True
) -> sp.csr_matrix:
  """Adjacency from an edge list: row dst aggregates from src (and the reverse if undirected).

  Self-loops are dropped (SAGE adds the root term itself), duplicates merged, indices sorted.
  Args:
    src, dst: int[E] endpoints in [0, num_nodes).
  Returns:
    float32 CSR [num_nodes, num_nodes] with unit entries.
  """
  src = np.asarray(src, np.int64)
  dst = np.asarray(dst, np.int64)
  if src.shape != dst.shape:
    raise ValueError(f"src and dst differ in shape: {src.shape} vs {dst.shape}")
  if src.size and (min(src.min(), dst.min()) < 0 or max(src.max(), dst.max()) >= num_nodes):
    raise ValueError(f"edge endpoints outside [0, {num_nodes})")
  keep = src != dst
  src, dst = src[keep], dst[keep]
  if undirected:
    src, dst = np.concatenate([src, dst]), np.concatenate([dst, src])
  # Dedup through one sort of a packed key: faster than scipy's sum_duplicates at 10M edges
  # and leaves rows with sorted column indices.
  key = sorted_unique(dst * num_nodes + src)
  rows, cols = np.divmod(key, num_nodes)
  indptr = np.zeros(num_nodes + 1, np.int64)
  np.cumsum(np.bincount(rows, minlength=num_nodes), out=indptr[1:])
  index_dtype = np.int32 if max(num_nodes, key.size) < 2**31 else np.int64
  adj = sp.csr_matrix(
    (np.ones(key.size, np.float32), cols.astype(index_dtype), indptr.astype(index_dtype)),
    shape=(num_nodes, num_nodes),
  )
  adj.has_sorted_indices = True
  return adj


def sorted_unique(values: np.ndarray) -> np.ndarray:
  """np.unique for integers by sort + neighbour compare.

  numpy 2.4's np.unique hashes integer arrays, far slower than a sort for large arrays.
  """
  values = np.sort(values)
  if values.size == 0:
    return values
  keep = np.empty(values.size, bool)
  keep[0] = True
  np.not_equal(values[1:], values[:-1], out=keep[1:])
  return values[keep]


def random_split(
  num_nodes: int, fractions: tuple[float, float, float], seed: int
) -> dict[str, np.ndarray]:
  """A random train/valid/test split of all nodes by fractions (each sorted)."""
  if sum(fractions) > 1.0 + 1e-9 or min(fractions) < 0:
    raise ValueError(f"split fractions must be >= 0 and sum to <= 1, got {fractions}")
  perm = np.random.default_rng(seed).permutation(num_nodes)
  out, start = {}, 0
  for name, frac in zip(SPLITS, fractions):
    stop = start + int(round(frac * num_nodes))
    out[name] = np.sort(perm[start:stop])
    start = stop
  return out
