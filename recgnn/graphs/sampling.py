"""Matrix-based bulk sampling of GNN mini-batches (Tripathy et al., MLSys'24).

Sampling one layer for k mini-batches at once is one sparse product: stack the frontier
nodes of all k batches as the rows of a selection matrix Q (Q[r, v] = 1 when row r is node v),
and P = Q @ A holds, row by row, each frontier node's candidate neighbours with their weights.
Then:

  node-wise (GraphSAGE)  each row of P draws `fanout` of its non-zeros uniformly without
                         replacement (all of them when it has fewer);
  layer-wise (LADIES)    each batch b draws `layer_size` columns with probability
                         proportional to the column norms of its rows of P:
                         p_b = (B @ (P * P))[b] / sum, B[b, r] = 1 when row r is in batch b,
                         a second sparse product; A is LADIES' row-normalised A + I.

For node-wise sampling P's row r is exactly A's row Q[r], so the product's structure is
A's CSR read at Q's columns: the default path reads row extents from `A.indptr` instead of
materialising P (whose size is the sum of the frontier's degrees, which on a power-law graph
is dominated by hubs of which only `fanout` entries are kept). `materialize=True` forms P
with scipy; both paths draw the same offsets from the same random numbers, so they return the
same sample (tested), which is the check that the shortcut is the product.

Every draw is vectorized over all rows of all k batches; the only Python loop is over the k
batches when frontiers are deduplicated (and over the fanout in Floyd's algorithm).

Output: `Blocks`, k mini-batches padded to static shapes so a jitted step compiles once.
Frontier 0 is the seeds; layer l maps frontier l+1 (sources) to frontier l (destinations),
and frontier l is the prefix of frontier l+1, so all frontiers live in one node array:

  nodes             int32[k, n_L]     global ids of the deepest frontier; -1 = padding;
                                      frontier l = nodes[:, :sizes[l]]
  node-wise layer l nbr  int32[k, n_l, f_l]   neighbour positions in frontier l+1 (0 at padding)
                    mask bool[k, n_l, f_l]
  LADIES layer l    src int32[k, E_l], dst int32[k, E_l]  positions in frontiers l+1 and l
                    weight float32[k, E_l]   LADIES' debiased, row-normalised weights (0 = pad)

The node-wise host sampler and what the samplers share (Blocks, seeds, the frontier
extension, the capacity estimate); LADIES on the host: ladies.py. Their device versions:
device_sampling.py and split_sampling.py; the factory that picks one for a config: samplers.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import scipy.sparse as sp

ALL = -1  # fanout meaning "every neighbour" (padded to the graph's largest degree)
MAX_ALL_DEGREE = 4096  # beyond this, fanout=-1 pads every row to a huge width: refuse
DEDUP_CHUNK = 4_000_000  # elements per frontier dedup sort (see `_extend`)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Blocks:
  """k sampled mini-batches with static shapes (see the module docstring).

  Attributes:
    nodes: int32[k, n_L], frontier l is nodes[:, :sizes[l]], -1 = padding.
    sizes: (n_0 = batch_size, n_1, ..., n_L), the padded frontier sizes.
    layers: per layer l, {"nbr", "mask"} (node-wise) or {"src", "dst", "weight"} (LADIES).
    num_edges: int64[k, L], sampled (valid) edges per batch and layer.
    dropped: neighbours or edges dropped because a capacity was too small (0 unless
      capacities were set below the worst case).
  """

  nodes: np.ndarray
  sizes: tuple[int, ...]
  layers: tuple[dict[str, np.ndarray], ...]
  num_edges: np.ndarray
  dropped: int = 0

  @property
  def k(self) -> int:
    return self.nodes.shape[0]

  def batch(self, i: int) -> tuple[np.ndarray, tuple[dict[str, np.ndarray], ...]]:
    """Mini-batch i: (nodes int32[n_L], layers with the leading k dimension removed)."""
    return self.nodes[i], tuple({key: v[i] for key, v in layer.items()} for layer in self.layers)


# ----------------------------------------------------------------------------- helpers


def selection_matrix(rows: np.ndarray, num_nodes: int) -> sp.csr_matrix:
  """Q: CSR [R, N] with Q[r, rows[r]] = 1, so (Q @ A)[r] = A[rows[r]]."""
  r = rows.size
  return sp.csr_matrix(
    (np.ones(r, np.float32), rows.astype(np.int64), np.arange(r + 1, dtype=np.int64)),
    shape=(r, num_nodes),
  )


def draw_offsets(
  deg: np.ndarray, fanout: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
  """Per row, `fanout` distinct offsets in [0, deg) uniformly at random (all when deg <= fanout).

  Rows with deg > fanout use Floyd's algorithm, vectorized across rows: step s draws t in
  [0, deg - fanout + s] and takes t unless already taken, else deg - fanout + s. Every
  fanout-subset is equally likely, and a row costs O(fanout^2) whatever its degree.
  Args:
    deg: int[R] row lengths.
  Returns:
    offsets int64[R, fanout] (0 where masked), mask bool[R, fanout].
  """
  r = deg.shape[0]
  offsets = np.broadcast_to(np.arange(fanout, dtype=np.int64), (r, fanout))
  mask = offsets < deg[:, None]
  offsets = np.where(mask, offsets, 0)
  big = np.flatnonzero(deg > fanout)
  if big.size:
    d = deg[big].astype(np.int64)
    u = rng.random((fanout, big.size))
    picks = np.empty((fanout, big.size), np.int64)
    for s in range(fanout):
      j = d - fanout + s
      t = (u[s] * (j + 1)).astype(np.int64)
      if s:
        dup = picks[0] == t
        for q in range(1, s):
          dup |= picks[q] == t
        t = np.where(dup, j, t)
      picks[s] = t
    offsets[big] = picks.T
  return offsets, mask


def _extend(
  frontier: np.ndarray,
  cand_batch: np.ndarray,
  cand_node: np.ndarray,
  n_next: int,
  num_nodes: int,
) -> tuple[np.ndarray, np.ndarray, int]:
  """`_extend_group` over groups of batches of about DEDUP_CHUNK elements each.

  The dedup's gathers and scatters are random accesses over its arrays; past a few million
  elements those leave the cache and cost several times more per element. cand_batch must be
  ascending (candidates grouped by batch), as both samplers produce them.
  """
  k = frontier.shape[0]
  total = int(np.count_nonzero(frontier >= 0)) + cand_node.size
  groups = max(1, min(k, -(-total // DEDUP_CHUNK)))
  if groups == 1:
    return _extend_group(frontier, cand_batch, cand_node, n_next, num_nodes)
  bounds = np.linspace(0, k, groups + 1).astype(np.int64)
  cut = np.searchsorted(cand_batch, bounds)
  nxt, pos, dropped = [], [], 0
  for g in range(groups):
    lo, hi = bounds[g], bounds[g + 1]
    part = slice(cut[g], cut[g + 1])
    x, p, d = _extend_group(
      frontier[lo:hi], cand_batch[part] - lo, cand_node[part], n_next, num_nodes
    )
    nxt.append(x)
    pos.append(p)
    dropped += d
  return np.concatenate(nxt), np.concatenate(pos), dropped


def _extend_group(
  frontier: np.ndarray,
  cand_batch: np.ndarray,
  cand_node: np.ndarray,
  n_next: int,
  num_nodes: int,
) -> tuple[np.ndarray, np.ndarray, int]:
  """The next frontier of each batch: its current frontier, then its new candidates.

  Deduplicates all k batches together with one sort of packed integers
  ((batch * N + node) << 1 | is_candidate) << b | element, b = bits of the element count:
  numpy's integer sort is SIMD-vectorized, several times faster
  than an argsort or a node -> position map walked batch by batch.
  Args:
    frontier: int32[k, n] global ids, -1 padding (anywhere: earlier layers' padding stays).
    cand_batch, cand_node: int[M] the batch and global id of each candidate.
    n_next: padded size of the next frontier (>= n).
  Returns:
    next int32[k, n_next] (new nodes after position n, in id order), pos int32[M] (each
    candidate's position in its batch's next frontier; -1 if dropped for lack of room),
    number of distinct new nodes dropped.
  """
  k, n = frontier.shape
  fb, fp = np.nonzero(frontier >= 0)
  fv = frontier[fb, fp]
  nf, m = fv.size, cand_node.size
  total = nf + m
  ebits = max(int(total).bit_length(), 1)
  if (k * num_nodes).bit_length() + 1 + ebits > 63:
    raise ValueError(
      f"{k} batches of a {num_nodes:,}-node graph overflow the 63-bit sort key; sample fewer "
      "mini-batches per call (k)."
    )
  keys = np.concatenate([fb.astype(np.int64) * num_nodes + fv, cand_batch * num_nodes + cand_node])
  packed = (keys << 1 | (np.arange(total) >= nf)) << ebits | np.arange(total)
  packed.sort()
  elem = packed & ((1 << ebits) - 1)
  key = packed >> (ebits + 1)
  is_cand = (packed >> ebits) & 1
  first = np.empty(total, bool)
  first[:1] = True
  np.not_equal(key[1:], key[:-1], out=first[1:])
  # A frontier node is unique in its batch and sorts before its candidate copies, so a group
  # led by a candidate is a new node.
  new = first & (is_cand == 1)
  batch = key // num_nodes
  new_per_batch = np.bincount(batch[new], minlength=k)
  rank = np.cumsum(new) - 1 - np.concatenate([[0], np.cumsum(new_per_batch)[:-1]])[batch]
  room = n_next - n
  fits = rank < room
  fpos = fp if nf else np.zeros(1, fp.dtype)  # every batch empty: no frontier to look up
  lead_pos = np.where(is_cand == 1, np.where(fits, n + rank, -1), fpos[np.minimum(elem, nf - 1)])
  group = np.cumsum(first) - 1
  pos_sorted = lead_pos[first][group]
  pos = np.empty(m, np.int32)
  cand_rows = is_cand == 1
  pos[elem[cand_rows] - nf] = pos_sorted[cand_rows]
  nxt = np.full((k, n_next), -1, np.int32)
  nxt[:, :n] = frontier
  placed = new & fits
  nxt[batch[placed], n + rank[placed]] = key[placed] % num_nodes
  return nxt, pos, int(np.count_nonzero(new & ~fits))


def check_seeds(seeds: np.ndarray, batch_size: int, num_nodes: int) -> np.ndarray:
  seeds = np.asarray(seeds)
  if seeds.ndim == 1:
    seeds = seeds[None]
  if seeds.ndim != 2 or seeds.shape[1] != batch_size:
    raise ValueError(f"seeds must be int[k, {batch_size}] (-1 = padding), got {seeds.shape}")
  if seeds.max(initial=-1) >= num_nodes:
    raise ValueError(f"seed ids must be < {num_nodes} nodes")
  return seeds.astype(np.int32)


def _check_adj(adj: sp.spmatrix) -> sp.csr_matrix:
  adj = sp.csr_matrix(adj)
  if adj.shape[0] != adj.shape[1]:
    raise ValueError(f"adjacency must be square, got {adj.shape}")
  return adj


# ----------------------------------------------------------------------------- node-wise


class NeighborSampler:
  """GraphSAGE node-wise sampling: `fanouts[l]` uniform neighbours per node at layer l.

  Args:
    adj: CSR [N, N]; row v lists the nodes v aggregates from.
    fanouts: per layer, seeds outward; ALL (-1) takes every neighbour.
    batch_size: seeds per mini-batch (n_0).
    capacities: padded sizes (n_1, ..., n_L) of the frontiers beyond the seeds; None: the
      worst case n_{l+1} = n_l + min(n_l * f_l, N), which never drops anything. Smaller
      capacities save padding; what does not fit is dropped and counted in Blocks.dropped.
    materialize: form P = Q @ A with scipy instead of reading its rows from A (same sample;
      slower: the reference the fast path is tested against).
  """

  def __init__(
    self,
    adj: sp.spmatrix,
    *,
    fanouts: Sequence[int],
    batch_size: int,
    capacities: Sequence[int] | None = None,
    materialize: bool = False,
  ):
    self.adj = _check_adj(adj)
    n = self.adj.shape[0]
    self.deg = np.diff(self.adj.indptr)
    max_deg = int(self.deg.max(initial=0))
    self.fanouts = []
    for f in fanouts:
      if f == ALL:
        if max_deg > MAX_ALL_DEGREE:
          raise ValueError(
            f"fanout -1 (all neighbours) pads every node to the largest degree, {max_deg:,}; "
            f"use a finite fanout on graphs with degrees above {MAX_ALL_DEGREE}."
          )
        f = max(max_deg, 1)
      elif f <= 0:
        raise ValueError(f"fanouts must be > 0 or -1 (all), got {list(fanouts)}")
      self.fanouts.append(int(f))
    self.batch_size = batch_size
    if capacities is not None and len(capacities) != len(self.fanouts):
      raise ValueError(f"capacities needs {len(self.fanouts)} sizes, got {list(capacities)}")
    sizes = [batch_size]
    for i, f in enumerate(self.fanouts):
      worst = sizes[-1] + min(sizes[-1] * f, n)
      cap = worst if capacities is None else int(capacities[i])
      sizes.append(max(min(cap, worst), sizes[-1]))
    self.sizes = tuple(sizes)
    self.materialize = materialize

  @property
  def num_nodes(self) -> int:
    return self.adj.shape[0]

  def _rows(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Structure of P = Q @ A: (column index array, row starts int64[R], row lengths int64[R])."""
    if self.materialize:
      p = selection_matrix(rows, self.num_nodes) @ self.adj
      p.sort_indices()  # scipy's product leaves row entries unordered; A's are sorted
      return p.indices, p.indptr[:-1].astype(np.int64), np.diff(p.indptr)
    start = self.adj.indptr[rows].astype(np.int64)
    return self.adj.indices, start, self.deg[rows].astype(np.int64)

  def sample(self, seeds: np.ndarray, rng: np.random.Generator) -> Blocks:
    """Sample k mini-batches at once: seeds int[k, batch_size] (-1 = padding) -> Blocks."""
    frontier = check_seeds(seeds, self.batch_size, self.num_nodes)
    k = frontier.shape[0]
    layers, edges, dropped = [], [], 0
    for layer, f in enumerate(self.fanouts):
      n = frontier.shape[1]
      # Work on the valid rows only; padding is scattered in at the end.
      rb, rp = np.nonzero(frontier >= 0)
      indices, start, deg = self._rows(frontier[rb, rp])
      off, mask = draw_offsets(deg, f, rng)
      cand_node = indices[(start[:, None] + off)[mask]].astype(np.int64)
      cand_batch = np.broadcast_to(rb[:, None], mask.shape)[mask].astype(np.int64)
      frontier, pos, drop = _extend(
        frontier, cand_batch, cand_node, self.sizes[layer + 1], self.num_nodes
      )
      rowpos = np.full(mask.shape, -1, np.int32)
      rowpos[mask] = pos
      nbr = np.zeros((k, n, f), np.int32)
      nbr[rb, rp] = np.maximum(rowpos, 0)
      m = np.zeros((k, n, f), bool)
      m[rb, rp] = rowpos >= 0
      layers.append({"nbr": nbr, "mask": m})
      edges.append(np.bincount(cand_batch[pos >= 0], minlength=k))
      dropped += drop
    return Blocks(
      nodes=frontier,
      sizes=self.sizes,
      layers=tuple(layers),
      num_edges=np.stack(edges, axis=1),
      dropped=dropped,
    )


# ----------------------------------------------------------------------------- sizing


def estimate_capacities(
  sampler: NeighborSampler,
  seeds: np.ndarray,
  rng: np.random.Generator,
  *,
  margin: float = 1.25,
  round_to: int = 64,
) -> tuple[int, ...]:
  """Frontier capacities (n_1, ..., n_L) from a trial sample, for `NeighborSampler(capacities=)`.

  The worst-case sizes assume no two sampled neighbours coincide; on real graphs frontiers
  are several times smaller, and every padded slot costs sampling, a feature / embedding
  lookup and model compute. Takes the largest frontier seen over `seeds` (int[k, B]) times
  `margin`, rounded up, never above the worst case. Overflow later is dropped and counted.
  """
  blocks = sampler.sample(seeds, rng)
  caps, prev = [], sampler.sizes[0]
  for layer in range(1, len(sampler.sizes)):
    # New nodes of frontier `layer` sit after the previous frontier's slots.
    lo, hi = sampler.sizes[layer - 1], sampler.sizes[layer]
    new = int((blocks.nodes[:, lo:hi] >= 0).sum(axis=1).max())
    need = prev + int(np.ceil(new * margin / round_to) * round_to)
    prev = min(need, prev + (hi - lo))
    caps.append(prev)
  return tuple(caps)
