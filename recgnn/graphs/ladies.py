"""LADIES layer-wise sampling (Zou et al., NeurIPS'19) as bulk sparse products on the host:
each batch b draws `layer_size` columns with probability proportional to the column norms of
its rows of P = Q @ Ahat, p_b = (B @ (P * P))[b] / sum (B[b, r] = 1 when row r is in batch
b), Ahat LADIES' row-normalised A + I. The shared outputs and helpers (Blocks, the frontier
extension, the seed checks) are sampling's; the device version is device_sampling's
DeviceLadiesSampler.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import scipy.sparse as sp

from recgnn.graphs.sampling import Blocks, _check_adj, _extend, check_seeds, selection_matrix


def weighted_draw(
  prob: sp.csr_matrix, s: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
  """Per row b of prob (CSR [k, N], non-negative), s distinct columns drawn without
  replacement with probability proportional to the entries (all of them when fewer).

  Efraimidis-Spirakis: give each entry the key -log(u) / p (an exponential race); the s
  smallest keys per row win. One lexsort for all rows, no loop. The first winner of a row
  is column v with probability exactly p_v / sum(p).
  Returns:
    (row int64[M], column int64[M]) of the winners, rows ascending, each row's in draw order.
  """
  counts = np.diff(prob.indptr)
  batch_of = np.repeat(np.arange(prob.shape[0]), counts)
  keys = -np.log1p(-rng.random(prob.nnz)) / prob.data
  order = np.lexsort((keys, batch_of))
  rank = np.arange(prob.nnz) - prob.indptr[batch_of[order]]
  chosen = order[rank < s]
  return batch_of[chosen].astype(np.int64), prob.indices[chosen].astype(np.int64)


def ladies_matrix(adj: sp.spmatrix) -> sp.csr_matrix:
  """LADIES' propagation matrix: row-normalised A + I (float64 CSR)."""
  n = adj.shape[0]
  a = (sp.csr_matrix(adj, dtype=np.float64) + sp.identity(n, np.float64, format="csr")).tocsr()
  rowsum = np.asarray(a.sum(axis=1)).ravel()
  return sp.csr_matrix(sp.diags(1.0 / rowsum) @ a)


class LadiesSampler:
  """LADIES layer-wise sampling (Zou et al., NeurIPS'19) as bulk sparse products.

  Layer l of batch b draws `layer_sizes[l]` nodes without replacement, with probability
  proportional to p_b(v) = sum over b's frontier rows r of P[r, v]^2, P = Q @ Ahat
  (Efraimidis-Spirakis keys -log(u) / p, the smallest win, vectorized over all batches).
  The next frontier is the current one plus the drawn nodes (as LADIES' reference code
  does, so every node keeps its self-loop); edges are P's entries between them, weighted
  P[r, v] / p_b(v) and row-normalised.

  Args:
    adj: CSR [N, N].
    layer_sizes: nodes drawn per layer, seeds outward.
    batch_size: seeds per mini-batch.
    edge_capacities: padded edges per layer; None: the worst case n_l * n_{l+1} capped by
      the rows' degrees. Edges beyond a capacity are dropped and counted.
  """

  def __init__(
    self,
    adj: sp.spmatrix,
    *,
    layer_sizes: Sequence[int],
    batch_size: int,
    edge_capacities: Sequence[int] | None = None,
  ):
    self.adj = _check_adj(adj)
    self.lap = ladies_matrix(self.adj)
    n = self.adj.shape[0]
    if any(s <= 0 for s in layer_sizes):
      raise ValueError(f"layer_sizes must be > 0, got {list(layer_sizes)}")
    self.layer_sizes = [int(s) for s in layer_sizes]
    self.batch_size = batch_size
    self.sizes = sizes = self.frontier_sizes(batch_size, self.layer_sizes, n)
    max_row = int(np.diff(self.lap.indptr).max(initial=1))
    caps = [sizes[i] * min(max_row, sizes[i + 1]) for i in range(len(self.layer_sizes))]
    if edge_capacities is not None:
      if len(edge_capacities) != len(caps):
        raise ValueError(f"edge_capacities needs {len(caps)} sizes, got {list(edge_capacities)}")
      caps = [min(int(c), w) for c, w in zip(edge_capacities, caps)]
    self.edge_capacities = tuple(caps)

  @property
  def num_nodes(self) -> int:
    return self.adj.shape[0]

  @staticmethod
  def frontier_sizes(batch_size: int, layer_sizes: Sequence[int], num_nodes: int) -> tuple:
    """Padded frontier sizes: each layer adds at most its drawn nodes."""
    sizes = [int(batch_size)]
    for s in layer_sizes:
      sizes.append(sizes[-1] + min(int(s), num_nodes))
    return tuple(sizes)

  def probabilities(self, frontier: np.ndarray, p: sp.csr_matrix | None = None) -> sp.csr_matrix:
    """LADIES' column-norm probabilities of k batches: frontier int[k, n] -> CSR [k, N].

    Row b holds p_b over the columns its rows of P = Q @ Ahat touch, summing to 1.
    p: that product, when the caller has it (rows = the valid frontier entries, row-major).
    """
    k = frontier.shape[0]
    valid = frontier >= 0
    rows = frontier[valid]
    batch_of_row = np.nonzero(valid)[0]
    if p is None:
      p = selection_matrix(rows, self.num_nodes) @ self.lap
    bmat = sp.csr_matrix(
      (np.ones(rows.size), (batch_of_row, np.arange(rows.size))), shape=(k, rows.size)
    )
    norms = (bmat @ p.multiply(p)).tocsr()
    norms.sort_indices()
    total = np.asarray(norms.sum(axis=1)).ravel()
    # Scale in place: a product with a diagonal matrix would reorder the entries again.
    norms.data /= np.repeat(np.where(total > 0, total, 1.0), np.diff(norms.indptr))
    return norms

  def sample(self, seeds: np.ndarray, rng: np.random.Generator) -> Blocks:
    """Sample k mini-batches at once: seeds int[k, batch_size] (-1 = padding) -> Blocks."""
    frontier = check_seeds(seeds, self.batch_size, self.num_nodes)
    k = frontier.shape[0]
    layers, edges, dropped = [], [], 0
    for layer, s in enumerate(self.layer_sizes):
      n = frontier.shape[1]
      valid = frontier >= 0
      rows = frontier[valid]
      row_batch, row_pos = np.nonzero(valid)
      p = selection_matrix(rows, self.num_nodes) @ self.lap  # one product per layer
      prob = self.probabilities(frontier, p)
      counts = np.diff(prob.indptr)
      chosen_batch, chosen_node = weighted_draw(prob, s, rng)
      frontier_next, _, drop = _extend(
        frontier, chosen_batch, chosen_node, self.sizes[layer + 1], self.num_nodes
      )
      dropped += drop

      # Edges: P's entries from the frontier rows to the next frontier's columns.
      e_row = np.repeat(np.arange(rows.size), np.diff(p.indptr))
      e_batch = row_batch[e_row]
      # Membership of (batch, column) in the next frontier by a sorted key lookup.
      nv = frontier_next >= 0
      fkeys = np.nonzero(nv)[0].astype(np.int64) * self.num_nodes + frontier_next[nv]
      fpos = np.nonzero(nv)[1]
      korder = np.argsort(fkeys)
      fkeys, fpos = fkeys[korder], fpos[korder]
      ekeys = e_batch.astype(np.int64) * self.num_nodes + p.indices
      at = np.minimum(np.searchsorted(fkeys, ekeys), fkeys.size - 1)
      keep = fkeys[at] == ekeys
      e_src = fpos[at[keep]]
      e_dst = row_pos[e_row[keep]]
      e_b = e_batch[keep]
      # Debias by the column's probability, then normalise each destination row.
      pkeys = np.repeat(np.arange(k, dtype=np.int64), counts) * self.num_nodes + prob.indices
      pcol = prob.data[np.searchsorted(pkeys, ekeys[keep])]
      w = p.data[keep] / pcol
      rowsum = np.zeros((k, n))
      np.add.at(rowsum, (e_b, e_dst), w)
      w = w / rowsum[e_b, e_dst]

      cap = self.edge_capacities[layer]
      per_batch = np.bincount(e_b, minlength=k)
      slot = np.arange(e_b.size) - np.concatenate([[0], np.cumsum(per_batch)[:-1]])[e_b]
      fits = slot < cap
      dropped += int(np.count_nonzero(~fits))
      src = np.zeros((k, cap), np.int32)
      dst = np.zeros((k, cap), np.int32)
      weight = np.zeros((k, cap), np.float32)
      src[e_b[fits], slot[fits]] = e_src[fits]
      dst[e_b[fits], slot[fits]] = e_dst[fits]
      weight[e_b[fits], slot[fits]] = w[fits]
      layers.append({"src": src, "dst": dst, "weight": weight})
      edges.append(np.minimum(per_batch, cap))
      frontier = frontier_next
    return Blocks(
      nodes=frontier,
      sizes=self.sizes,
      layers=tuple(layers),
      num_edges=np.stack(edges, axis=1),
      dropped=dropped,
    )
