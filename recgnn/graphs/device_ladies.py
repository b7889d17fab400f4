"""LADIES on the accelerator (`DeviceLadiesSampler`): `ladies.LadiesSampler` as jitted JAX,
same arguments, same Blocks, same law (see device_sampling's docstring for what differs from
the host code: P = Q @ Ahat's entries enumerated per batch into the exact worst-case
capacity, column norms in a dense node table per batch, the draw a top_k over it). The
node-wise device sampler and the shared device helpers are device_sampling's.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import scipy.sparse as sp

from recgnn.graphs import ladies, sampling
from recgnn.graphs.device_sampling import (
  _device_csr,
  _row_entries,
  batch_keys,
  extend,
  key_from,
  pad_k,
  table_chunk,
  to_blocks,
)


def weighted_draw(p: jax.Array, s: int, key: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Per row of p (float[k, m], >= 0), s distinct columns without replacement, probability
  proportional to p (Efraimidis-Spirakis: the s smallest -log(u) / p win; `lax.top_k`).
  Returns (cols int32[k, s], valid bool[k, s]), each row in draw order; invalid when the
  row has fewer than s positive entries."""
  if s > p.shape[1]:  # top_k needs s columns; zero columns never win
    p = jnp.pad(p, ((0, 0), (0, s - p.shape[1])))
  u = jax.random.uniform(key, p.shape)
  race = jnp.where(p > 0, -jnp.log1p(-u) / jnp.where(p > 0, p, 1.0), jnp.inf)
  neg, cols = jax.lax.top_k(-race, s)
  return cols.astype(jnp.int32), jnp.isfinite(neg)


def _ladies_batch(
  indptr, indices, data, frontier, s, n_next, cap_entries, cap_edges, num_nodes, key
):
  """One batch, one LADIES layer (the device twin of LadiesSampler.sample's loop body)."""
  row, entry, valid = _row_entries(indptr, frontier, cap_entries)
  col = jnp.where(valid, jnp.take(indices, entry, mode="clip"), num_nodes)
  val = jnp.where(valid, jnp.take(data, entry, mode="clip"), 0.0)
  return ladies_from_entries(row, col, val, valid, frontier, s, n_next, cap_edges, num_nodes, key)


def ladies_from_entries(row, col, val, valid, frontier, s, n_next, cap_edges, num_nodes, key):
  """One batch's LADIES layer from P = Q @ Ahat's entries (row position, column, value;
  invalid: column num_nodes, value 0), however they were read (one device or the split
  graph's exchange)."""
  n = frontier.shape[0]
  # Column norms p_b(v) = sum_r P[r, v]^2 into a dense node table (row N: the sink of
  # padding entries), as `extend` does: no pair sort (slow on XLA:CPU), O(N) per batch.
  norm = jnp.zeros(num_nodes + 1, jnp.float32).at[col].add(val * val).at[num_nodes].set(0.0)
  prob = norm / jnp.maximum(norm.sum(), 1e-30)
  picks, ok = weighted_draw(prob[None], s, key)
  nxt, _, dropped = extend(frontier, picks[0], ok[0], n_next, num_nodes)

  # Edges: P's entries whose column is in the next frontier (a node -> slot table).
  slot_of = jnp.full(num_nodes + 1, -1, jnp.int32)
  slot_of = slot_of.at[jnp.where(nxt >= 0, nxt, num_nodes)].set(jnp.arange(n_next, dtype=jnp.int32))
  src = slot_of.at[num_nodes].set(-1)[col]
  keep = valid & (src >= 0)
  w = jnp.where(keep, val / jnp.where(keep, prob[col], 1.0), 0.0)
  rowsum = jax.ops.segment_sum(w, row, num_segments=n)
  w = jnp.where(keep, w / jnp.where(keep, rowsum[row], 1.0), 0.0)
  slot = jnp.cumsum(keep.astype(jnp.int32)) - 1
  fits = keep & (slot < cap_edges)
  at_slot = jnp.where(fits, slot, cap_edges)
  out_src = jnp.zeros(cap_edges, jnp.int32).at[at_slot].set(src, mode="drop")
  out_dst = jnp.zeros(cap_edges, jnp.int32).at[at_slot].set(row, mode="drop")
  out_w = jnp.zeros(cap_edges, jnp.float32).at[at_slot].set(w, mode="drop")
  edges = jnp.sum(fits, dtype=jnp.int32)
  return (
    nxt,
    {"src": out_src, "dst": out_dst, "weight": out_w},
    edges,
    dropped + jnp.sum(keep & ~fits, dtype=jnp.int32),
    prob[:num_nodes],
  )


class DeviceLadiesSampler:
  """`ladies.LadiesSampler` on the device: same arguments, same Blocks, same law.

  Args: as `ladies.LadiesSampler` (adj, layer_sizes, batch_size, edge_capacities).
    device: where Ahat (row-normalised A + I, float32 CSR) lives.
  """

  def __init__(
    self,
    adj: sp.spmatrix,
    *,
    layer_sizes: Sequence[int],
    batch_size: int,
    edge_capacities: Sequence[int] | None = None,
    device=None,
  ):
    host, self.entry_capacities = self.plan(adj, layer_sizes, batch_size, edge_capacities)
    self.layer_sizes, self.sizes = host.layer_sizes, host.sizes
    self.edge_capacities, self.batch_size = host.edge_capacities, batch_size
    self.num_nodes = host.num_nodes
    lap = host.lap
    indptr, indices = _device_csr(lap)
    self.indptr = jax.device_put(indptr, device)
    self.indices = jax.device_put(indices, device)
    self.data = jax.device_put(lap.data.astype(np.float32), device)
    self._sample = jax.jit(self.sample_arrays)

  @property
  def arrays(self) -> tuple[jax.Array, ...]:
    """(indptr int32[N + 1], indices int32[nnz], data float32[nnz]) of Ahat."""
    return self.indptr, self.indices, self.data

  @staticmethod
  def plan(adj, layer_sizes, batch_size, edge_capacities):
    """(the host sampler: validation, sizes, Ahat; the entry capacity of each layer: the
    exact worst case of P's entries per batch, whose n_l rows are the n_l longest of Ahat)."""
    host = ladies.LadiesSampler(
      adj, layer_sizes=layer_sizes, batch_size=batch_size, edge_capacities=edge_capacities
    )
    row_len = np.sort(np.diff(host.lap.indptr))[::-1]
    caps = tuple(max(int(row_len[: host.sizes[i]].sum()), 1) for i in range(len(host.layer_sizes)))
    return host, caps

  def _layer(self, layer, indptr, indices, data, frontier, key, first=0):
    k = frontier.shape[0]
    keys = jax.vmap(lambda kb: jax.random.fold_in(kb, layer))(batch_keys(key, k, first))
    fn = functools.partial(
      _ladies_batch,
      indptr,
      indices,
      data,
      s=self.layer_sizes[layer],
      n_next=self.sizes[layer + 1],
      cap_entries=self.entry_capacities[layer],
      cap_edges=self.edge_capacities[layer],
      num_nodes=self.num_nodes,
    )
    # In chunks: each batch's dedup holds a node table of N + 1 entries (see `extend`).
    chunk = table_chunk(k, self.num_nodes)
    return jax.lax.map(lambda x: fn(x[0], key=x[1]), (frontier, keys), batch_size=chunk)

  def sample_arrays(self, indptr, indices, data, seeds, key, first=0):
    """The pure sampling function over `arrays` -> as `sample_device` (first: as
    `DeviceNeighborSampler.sample_arrays`)."""
    frontier, layers, edges, dropped = seeds, [], [], jnp.int32(0)
    for layer in range(len(self.layer_sizes)):
      frontier, lay, e, d, _ = self._layer(layer, indptr, indices, data, frontier, key, first)
      layers.append(lay)
      edges.append(e)
      dropped = dropped + d.sum()
    return frontier, tuple(layers), jnp.stack(edges, 1), dropped

  def sample_device(self, seeds, key: jax.Array):
    """seeds int32[k, batch_size] -> (nodes, layers, num_edges, dropped) device arrays."""
    return self._sample(*self.arrays, jnp.asarray(seeds, jnp.int32), key)

  def sample(self, seeds: np.ndarray, rng) -> sampling.Blocks:
    """As `LadiesSampler.sample`: numpy seeds and Generator (or a jax key) -> Blocks."""
    seeds = sampling.check_seeds(seeds, self.batch_size, self.num_nodes)
    k = seeds.shape[0]
    padded = np.full((pad_k(k), seeds.shape[1]), -1, np.int32)
    padded[:k] = seeds
    return to_blocks(jax.device_get(self.sample_device(padded, key_from(rng))), k, self.sizes)

  def probabilities(self, frontier: np.ndarray) -> np.ndarray:
    """LADIES' column-norm probabilities as the device computes them: frontier int[k, n]
    (n = batch_size) -> float32[k, N] dense (for tests; the sampler never densifies)."""
    frontier = jnp.asarray(frontier, jnp.int32)
    *_, prob = self._layer(0, self.indptr, self.indices, self.data, frontier, jax.random.key(0))
    return np.asarray(prob, np.float64)
