"""Node orders: permutations of a graph's node ids, applied with `Graph.relabel`.

Why order matters: a TT node table (`tt` backend) reads row i through the mixed-radix digits
(i_1, ..., i_K) of i, and rows sharing a prefix share core slices. When the nodes of one
community get consecutive ids, they share prefixes and so parameters: Nimble (Yin et al.,
KDD'22) reorders by hierarchical graph partitioning before compressing node embeddings.

Orders (`data.node_order`):
  none       the dataset's ids.
  partition  hierarchical METIS (pymetis): the graph is split into `levels[0]` balanced parts
             minimising the edge cut, each part's subgraph into `levels[1]` parts, and so on;
             nodes are then numbered part by part (lexicographic in the part path, ties by
             original id). With `levels` = (n_1, ..., n_{K-1}), the TT row factors, a level-k
             part is about one block of ids sharing the first k digits. Default levels:
             K - 1 = 2 levels of ceil(N^(1/3)) (the balanced 3-core factors).
  rcm        reverse Cuthill-McKee (scipy): a bandwidth-reducing BFS order; neighbours get
             nearby ids, without balanced blocks.
  random     a uniformly random permutation (seeded): the control for "order does nothing".

Every function returns `perm` with `perm[new_id] = old_id`, the argument of `Graph.relabel`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import numpy as np
import scipy.sparse as sp
import scipy.sparse.csgraph as csgraph

from recgnn.graphs import store

ORDERS = ("none", "partition", "rcm", "random")


def _symmetric_no_loops(adj: sp.csr_matrix) -> sp.csr_matrix:
  """A + A^T without the diagonal, unit weights: what METIS and RCM need."""
  a = adj.tocsr().astype(np.float32)
  a = ((a + a.T) > 0).astype(np.int8).tocsr()
  a.setdiag(0)
  a.eliminate_zeros()
  a.sort_indices()
  return a


def default_levels(num_nodes: int, cores: int = 3) -> tuple[int, ...]:
  """K - 1 partition fan-outs of ceil(N^(1/K)): the balanced TT row factors but the last."""
  k = max(1, math.ceil(num_nodes ** (1.0 / cores) - 1e-9))
  return (k,) * (cores - 1)


def metis_parts(adj: sp.csr_matrix, nparts: int, seed: int = 0) -> np.ndarray:
  """int64[N] part of each node: METIS k-way on the symmetric graph (pymetis)."""
  n = adj.shape[0]
  if nparts <= 1 or n <= nparts:
    return np.zeros(n, np.int64) if nparts <= 1 else np.arange(n, dtype=np.int64) % nparts
  try:
    import pymetis
  except ImportError as e:  # pragma: no cover - pymetis is a dependency
    raise ImportError(
      "node_order=partition needs pymetis (pip install pymetis); or use node_order=rcm"
    ) from e
  opts = pymetis.Options(seed=seed)
  csr = pymetis.CSRAdjacency(adj.indptr.astype(np.int32), adj.indices.astype(np.int32))
  _, membership = pymetis.part_graph(nparts, csr, options=opts)
  return np.asarray(membership, np.int64)


def partition_order(
  adj: sp.csr_matrix, levels: Sequence[int] | None = None, seed: int = 0
) -> np.ndarray:
  """Hierarchical METIS order (see the module docstring). perm[new] = old."""
  a = _symmetric_no_loops(adj)
  n = a.shape[0]
  levels = tuple(levels) if levels else default_levels(n)
  # key[:, l] is a node's part at level l (within its level-(l-1) part).
  key = np.zeros((n, len(levels)), np.int64)
  groups = [np.arange(n)]
  for lvl, k in enumerate(levels):
    nxt = []
    for nodes in groups:
      sub = a[nodes][:, nodes] if nodes.size < n else a
      part = metis_parts(sub.tocsr(), k, seed)
      key[nodes, lvl] = part
      order = np.argsort(part, kind="stable")
      bounds = np.searchsorted(part[order], np.arange(k + 1))
      nxt.extend(nodes[order[bounds[j] : bounds[j + 1]]] for j in range(k))
    groups = [g for g in nxt if g.size]
  # Lexicographic in (level 0 part, level 1 part, ..., original id).
  return np.lexsort([np.arange(n)] + [key[:, j] for j in reversed(range(len(levels)))])


def rcm_order(adj: sp.csr_matrix) -> np.ndarray:
  """Reverse Cuthill-McKee (scipy). perm[new] = old."""
  return np.asarray(
    csgraph.reverse_cuthill_mckee(_symmetric_no_loops(adj), symmetric_mode=True), np.int64
  )


def random_order(num_nodes: int, seed: int = 0) -> np.ndarray:
  return np.random.default_rng([seed, 0x0D]).permutation(num_nodes)


def node_order(
  graph: store.Graph, order: str, *, seed: int = 0, levels: Sequence[int] | None = None
) -> np.ndarray | None:
  """The permutation of `order` for `graph` (None for `none`). perm[new] = old."""
  if order == "none":
    return None
  if order == "partition":
    return partition_order(graph.adj, levels, seed)
  if order == "rcm":
    return rcm_order(graph.adj)
  if order == "random":
    return random_order(graph.num_nodes, seed)
  raise ValueError(f"Unknown node order {order!r}; available: {', '.join(ORDERS)}")


def reorder(
  graph: store.Graph,
  order: str,
  *,
  seed: int = 0,
  levels: Sequence[int] | None = None,
  log=None,
) -> store.Graph:
  """`graph` relabelled by `order` (the graph itself for `none`)."""
  t0 = time.perf_counter()
  perm = node_order(graph, order, seed=seed, levels=levels)
  if perm is None:
    return graph
  out = graph.relabel(perm)
  if log is not None:
    log(
      f"node order {order}: {time.perf_counter() - t0:.1f} s; mean |i - j| over edges "
      f"{mean_edge_span(graph.adj):,.0f} -> {mean_edge_span(out.adj):,.0f}"
    )
  return out


def mean_edge_span(adj: sp.csr_matrix) -> float:
  """Mean |i - j| over adjacency entries: how local the ids of neighbours are."""
  rows = np.repeat(np.arange(adj.shape[0]), np.diff(adj.indptr))
  return float(np.abs(rows - adj.indices).mean()) if adj.nnz else 0.0
