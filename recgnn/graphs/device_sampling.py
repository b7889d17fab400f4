"""Bulk sampling on the accelerator: the node-wise and LADIES samplers as jitted JAX.

The same samplers as `recgnn.graphs.sampling` (same Blocks, same padded shapes, same
distributions; tests/test_sampling.py runs the host samplers' distribution tests on both),
but over a CSR graph held in device memory, so that a GPU is not starved by host sampling.
One call samples k mini-batches; every shape is static (frontier capacities, edge
capacities, padded k), so each (k, sampler) compiles once.

What differs from the host code, and why:
  - Random numbers come from `jax.random`; batch b of a call draws from fold_in(key, b) and
    layer l from fold_in(., l), so a batch's sample does not depend on how many batches share
    the call or on how they are padded (the split-graph sampler below relies on it).
  - Deduplication of a frontier is a node -> slot table per batch (scatter-min, gather),
    not the host's sort: XLA:CPU's multi-operand sort is slow and the host's packed keys need
    int64. New nodes follow the frontier in order of first appearance, not in id order.
  - LADIES enumerates P = Q @ Ahat's entries per batch into a fixed capacity: the sum of the
    n largest rows of Ahat, the exact worst case, so no entry is ever dropped (dropping would
    bias the column norms); the column norms go into a dense node table per batch and the
    draw is a top_k over it (O(N) per batch and layer: fine up to millions of nodes).

LADIES' device sampler is in `recgnn.graphs.device_ladies`. The same samplers with the
graph's rows split over the devices of a mesh are in
`recgnn.graphs.split_sampling`; `recgnn.graphs.samplers.make` picks one of the host, device or
split samplers for a config.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import scipy.sparse as sp

from recgnn import sharding
from recgnn.graphs import sampling

P = sharding.P


def key_from(rng_or_key) -> jax.Array:
  """A jax key from a numpy Generator (the host samplers' argument) or a key itself, so a
  caller seeding per (epoch, group) with numpy gets a deterministic device sample too."""
  if isinstance(rng_or_key, np.random.Generator):
    return jax.random.key(int(rng_or_key.integers(0, 2**31 - 1)))
  return rng_or_key


def pad_k(k: int, multiple: int = 1) -> int:
  """Calls are padded to a power of two batches (a multiple of `multiple`): a handful of
  compiled sizes instead of one per trailing partial group."""
  p = 1 << max(k - 1, 0).bit_length()
  return -(-p // multiple) * multiple


# ----------------------------------------------------------------------------- kernels


def draw_offsets(deg: jax.Array, fanout: int, u: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Per row, `fanout` distinct offsets in [0, deg) uniformly (all when deg <= fanout).

  Floyd's algorithm as in `sampling.draw_offsets`, one loop step per pick over all rows.
  Args:
    deg: int32[R] row lengths.
    u: float32[R, fanout] uniforms in [0, 1).
  Returns:
    offsets int32[R, fanout] (0 where masked), mask bool[R, fanout].
  """
  r = deg.shape[0]
  base = jnp.broadcast_to(jnp.arange(fanout, dtype=jnp.int32), (r, fanout))
  mask = base < deg[:, None]

  def pick(s, picks):
    j = deg - fanout + s
    # min(.., j): float rounding of u * (j + 1) must not reach j + 1.
    t = jnp.minimum((u[:, s] * (j + 1).astype(jnp.float32)).astype(jnp.int32), j)
    t = jnp.where(jnp.any(picks == t[:, None], axis=1), j, t)
    return picks.at[:, s].set(t)

  picks = jax.lax.fori_loop(0, fanout, pick, jnp.full((r, fanout), -1, jnp.int32))
  offsets = jnp.where((deg > fanout)[:, None], picks, jnp.where(mask, base, 0))
  return offsets, mask


# Dedup table entries (batches x (N + 1) int32) held at once. On CPU, tables that leave the
# cache make the scatter / gather several times slower; an accelerator wants many batches in
# flight.
TABLE_ENTRIES = {"cpu": 1 << 21}
TABLE_ENTRIES_DEFAULT = 1 << 26


def table_chunk(k: int, num_nodes: int) -> int:
  """Batches deduplicated at once (see TABLE_ENTRIES)."""
  budget = TABLE_ENTRIES.get(jax.default_backend(), TABLE_ENTRIES_DEFAULT)
  return max(1, min(k, budget // (num_nodes + 1)))


def extend(
  frontier: jax.Array, cand: jax.Array, cand_valid: jax.Array, n_next: int, num_nodes: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """One batch's next frontier: its frontier, then its new candidates in order of first
  appearance (the host puts them in id order; positions are all the model reads).

  The device twin of `sampling._extend_group` for one batch (see `extend_batches`). No
  sort: a node -> smallest claiming index table of N + 1 entries, built by one scatter-min
  (frontier slot i claims with i, candidate j with n + j) and read back by one gather.
  XLA:CPU sorts (key, payload) pairs several times slower than single arrays, so a sort-based
  dedup is far slower than numpy's; the table costs O(N) memset per batch plus O(n + M)
  random accesses.
  Args:
    frontier: int32[n] global ids, -1 = padding (anywhere), unique among the valid ones.
    cand: int32[M] candidate ids; cand_valid: bool[M].
  Returns:
    next int32[n_next], pos int32[M] (each candidate's position in next; -1 if invalid or
    dropped for lack of room), dropped int32[] (distinct new nodes without room).
  """
  n, m = frontier.shape[0], cand.shape[0]
  fid = jnp.where(frontier >= 0, frontier, num_nodes)
  cid = jnp.where(cand_valid, cand, num_nodes)  # row num_nodes: a sink for padding
  j = jnp.arange(m, dtype=jnp.int32)
  table = jnp.full(num_nodes + 1, n + m, jnp.int32)
  table = table.at[fid].min(jnp.arange(n, dtype=jnp.int32)).at[cid].min(n + j)
  lead = table[cid]
  leader = cand_valid & (lead == n + j)  # the first candidate of a node not in the frontier
  rank = jnp.cumsum(leader.astype(jnp.int32)) - 1
  fits = rank < n_next - n
  slot = jnp.where(fits, n + rank, -1)
  pos = jnp.where(lead < n, lead, jnp.take(slot, lead - n, mode="clip"))
  pos = jnp.where(cand_valid, pos, -1)
  nxt = jnp.full(n_next, -1, jnp.int32).at[:n].set(frontier)
  nxt = nxt.at[jnp.where(leader & fits, n + rank, n_next)].set(cand, mode="drop")
  return nxt, pos, jnp.sum(leader & ~fits, dtype=jnp.int32)


def extend_batches(frontier, cand, cand_valid, n_next: int, num_nodes: int):
  """`extend` over k batches: frontier int32[k, n], cand int32[k, M], cand_valid bool[k, M]
  -> (next int32[k, n_next], pos int32[k, M], dropped int32[k]). Batches run a few at a
  time (`table_chunk`), so the dedup tables' memory does not grow with k."""
  chunk = table_chunk(frontier.shape[0], num_nodes)
  return jax.lax.map(
    lambda x: extend(*x, n_next, num_nodes), (frontier, cand, cand_valid), batch_size=chunk
  )


def batch_keys(key: jax.Array, k: int, first=0) -> jax.Array:
  """key[k]: the keys of batches first .. first + k - 1 of a call. `key` is the call's key
  (a scalar key: batch b's is fold_in(key, b)) or every batch's own key (key[K], K >= first
  + k: e.g. the data-parallel trainer's, where batch (step s, device d) has fold_in(the key
  of step s, d), so that a call sampling k steps draws what k calls of one step draw).
  `first` (may be traced): where a device's k batches sit in a call that several devices
  share (device d's are d k ..), so its draws are the ones a single call over every
  device's batches makes."""
  if key.ndim:
    return jax.lax.dynamic_slice_in_dim(key, first, k)
  return jax.vmap(lambda b: jax.random.fold_in(key, b))(first + jnp.arange(k, dtype=jnp.int32))


def batch_uniforms(key: jax.Array, layer: int, k: int, shape, first=0) -> jax.Array:
  """float32[k, *shape]: the uniforms of `layer` of batches first .. first + k - 1
  (`batch_keys`: key a call's key or every batch's), independent of k and padding."""
  keys = jax.vmap(lambda kb: jax.random.fold_in(kb, layer))(batch_keys(key, k, first))
  return jax.vmap(lambda kb: jax.random.uniform(kb, shape))(keys)


def gather_rows(indptr, indices, rows, fanout, u, owned=None, row_offset=0):
  """Offsets drawn for every row; neighbours read where `owned`. rows: int32[R] (-1 pad)
  -> (cand int32[R, f], mask bool[R, f]), cand = id or -1 where masked / not owned."""
  valid = rows >= 0 if owned is None else owned
  local = jnp.where(valid, rows - row_offset, 0)
  start = indptr[local]
  deg = jnp.where(valid, indptr[local + 1] - start, 0)
  off, mask = draw_offsets(deg, fanout, u)
  cand = jnp.take(indices, start[:, None] + off, mode="clip")
  return jnp.where(mask, cand, -1), mask


# ----------------------------------------------------------------------------- node-wise


def _device_csr(adj: sp.csr_matrix) -> tuple[np.ndarray, np.ndarray]:
  """int32 indptr [N+1] and indices [max(nnz, 1)] (one pad entry: a gather from an empty
  array is undefined)."""
  if adj.nnz >= 2**31 or adj.shape[0] >= 2**30:
    raise ValueError(
      f"graph of {adj.shape[0]:,} nodes / {adj.nnz:,} entries exceeds int32 device indices; "
      "split it over devices (SplitNeighborSampler) or sample on the host."
    )
  indices = adj.indices.astype(np.int32)
  if indices.size == 0:
    indices = np.zeros(1, np.int32)
  return adj.indptr.astype(np.int32), indices


def product_rows(indptr, indices, rows, capacity: int):
  """P = Q @ A for the rows `rows` (int32[R], -1 = padding; Q[r, rows[r]] = 1) as a CSR:
  (indptr int32[R + 1], indices int32[capacity]) with row r = A's row rows[r] (empty at
  padding). Segment ops, not `jax.experimental.sparse`: a BCOO sparse x sparse product
  sizes its output for lhs.nse x rhs.nse entries (R x nnz), where P holds at most
  `capacity` = the sum of the R largest degrees (the exact worst case: nothing dropped)."""
  valid = rows >= 0
  r = jnp.where(valid, rows, 0)
  length = jnp.where(valid, indptr[r + 1] - indptr[r], 0)
  _, entry, ok = _row_entries(indptr, rows, capacity)
  cols = jnp.where(ok, jnp.take(indices, entry, mode="clip"), 0)
  return jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(length, dtype=jnp.int32)]), cols


def node_layer(indptr, indices, frontier, fanout, n_next, num_nodes, u, capacity=None):
  """One node-wise layer for k batches: frontier int32[k, n], u float32[k, n, f] ->
  (next int32[k, n_next], nbr int32[k, n, f], mask bool[k, n, f], edges int32[k], dropped).
  capacity: None reads the frontier's rows of A directly; else P = Q @ A is formed first
  (`product_rows`, that many entries) and its rows are read: the same offsets from the same
  uniforms, so the same sample."""
  k, n = frontier.shape
  rows = frontier.reshape(-1)
  if capacity is not None:
    indptr, indices = product_rows(indptr, indices, rows, capacity)
    rows = jnp.where(rows >= 0, jnp.arange(k * n, dtype=jnp.int32), -1)
  cand, mask = gather_rows(indptr, indices, rows, fanout, u.reshape(k * n, fanout))
  cand, mask = cand.reshape(k, n * fanout), mask.reshape(k, n * fanout)
  nxt, pos, dropped = extend_batches(frontier, cand, mask, n_next, num_nodes)
  return node_outputs(nxt, pos, dropped, k, n, fanout)


def node_outputs(nxt, pos, dropped, k, n, fanout):
  pos = pos.reshape(k, n, fanout)
  mask = pos >= 0
  return nxt, jnp.maximum(pos, 0), mask, mask.sum((1, 2), dtype=jnp.int32), dropped.sum()


class DeviceNeighborSampler:
  """`sampling.NeighborSampler` on the device: same arguments, same Blocks, same law.

  Args: as `sampling.NeighborSampler` (adj, fanouts, batch_size, capacities, materialize).
    device: where the CSR lives (None: the default device).

  `materialize=False` (the default) reads each frontier row's `fanout` drawn entries straight
  from A's CSR; `materialize=True` forms the sparse product P = Q @ A for all k batches of a
  layer first (`product_rows`, as the paper's formulation) and draws from P: the same sample
  (tested). The direct reads are the default because they are faster wherever a frontier's
  degrees exceed its fanouts: the product writes every entry of every frontier row (the sum
  of their degrees, dominated by hubs on a power-law graph) to keep `fanout` of each, and
  sizes its buffer for the worst case (the comparison: docs/graphs.md).
  """

  def __init__(
    self,
    adj: sp.spmatrix,
    *,
    fanouts: Sequence[int],
    batch_size: int,
    capacities: Sequence[int] | None = None,
    materialize: bool = False,
    device=None,
  ):
    # The host sampler validates and sizes; its arrays are only read here.
    host = sampling.NeighborSampler(
      adj, fanouts=fanouts, batch_size=batch_size, capacities=capacities
    )
    self.fanouts, self.sizes, self.batch_size = host.fanouts, host.sizes, batch_size
    self.num_nodes = host.num_nodes
    self.max_degree = int(host.deg.max(initial=0))
    self.materialize = materialize
    # Sums of the largest degrees: P's worst-case entries (materialize).
    self._top_degrees = np.concatenate([[0], np.cumsum(np.sort(host.deg)[::-1])])
    indptr, indices = _device_csr(host.adj)
    self.indptr = jax.device_put(indptr, device)
    self.indices = jax.device_put(indices, device)
    self._sample = jax.jit(self.sample_arrays)

  @property
  def arrays(self) -> tuple[jax.Array, ...]:
    """The graph arrays `sample_arrays` reads: (indptr int32[N + 1], indices int32[nnz])."""
    return self.indptr, self.indices

  def sample_arrays(self, indptr, indices, seeds, key, first=0):
    """The pure sampling function (jit-able, shard_map-able: the data-parallel step runs it
    on every device over its replica of `arrays`): -> as `sample_device`. key: the call's
    key, or every batch's own (key[k]: `batch_keys`); first: the index of seeds' first
    batch in a call shared by several devices (`batch_keys`)."""
    k = seeds.shape[0]
    frontier, layers, edges, dropped = seeds, [], [], jnp.int32(0)
    for layer, f in enumerate(self.fanouts):
      u = batch_uniforms(key, layer, k, (frontier.shape[1], f), first)
      # A batch's frontier nodes are distinct: P's k batches hold at most k x the sum of
      # the n largest degrees.
      n = min(frontier.shape[1], self.num_nodes)
      cap = max(k * int(self._top_degrees[n]), 1) if self.materialize else None
      frontier, nbr, mask, e, d = node_layer(
        indptr, indices, frontier, f, self.sizes[layer + 1], self.num_nodes, u, cap
      )
      layers.append({"nbr": nbr, "mask": mask})
      edges.append(e)
      dropped = dropped + d
    return frontier, tuple(layers), jnp.stack(edges, 1), dropped

  def sample_device(self, seeds, key: jax.Array):
    """seeds int32[k, batch_size] (-1 = padding) -> (nodes int32[k, n_L], layers,
    num_edges int32[k, L], dropped int32[]) as device arrays (see sampling.Blocks)."""
    return self._sample(*self.arrays, jnp.asarray(seeds, jnp.int32), key)

  def sample(self, seeds: np.ndarray, rng) -> sampling.Blocks:
    """Host-compatible: seeds int[k, batch_size], a numpy Generator (or a jax key) ->
    sampling.Blocks of numpy arrays, as `NeighborSampler.sample`."""
    seeds = sampling.check_seeds(seeds, self.batch_size, self.num_nodes)
    k = seeds.shape[0]
    padded = np.full((pad_k(k), seeds.shape[1]), -1, np.int32)
    padded[:k] = seeds
    out = jax.device_get(self.sample_device(padded, key_from(rng)))
    return to_blocks(out, k, self.sizes)


def to_blocks(out, k, sizes) -> sampling.Blocks:
  nodes, layers, edges, dropped = out
  return sampling.Blocks(
    nodes=np.asarray(nodes[:k]),
    sizes=tuple(sizes),
    layers=tuple({key: np.asarray(v[:k]) for key, v in layer.items()} for layer in layers),
    num_edges=np.asarray(edges[:k], np.int64),
    dropped=int(dropped),
  )


# ----------------------------------------------------------------------------- CSR rows


def _row_entries(indptr, rows, capacity):
  """The entries of the rows `rows` (int32[n], -1 = padding) of a CSR, in row order, padded
  to `capacity`: (row position int32[C], CSR entry int32[C], valid bool[C])."""
  valid = rows >= 0
  r = jnp.where(valid, rows, 0)
  row, offset, ok = row_layout(jnp.where(valid, indptr[r + 1] - indptr[r], 0), capacity)
  return row, indptr[r[row]] + offset, ok


def row_layout(length, capacity):
  """Rows of `length` (int32[n]) laid end to end in `capacity` slots: (row position
  int32[C], offset within the row int32[C], valid bool[C])."""
  rows = length.shape[0]
  ends = jnp.cumsum(length)
  starts = ends - length
  e = jnp.arange(capacity, dtype=jnp.int32)
  # Entry e belongs to the last row starting at or before e: mark each row's start, then a
  # running max (a searchsorted per entry is slow on XLA:CPU). An empty row shares
  # its start with the next non-empty one, which is larger and wins the max.
  marks = (
    jnp.zeros(capacity, jnp.int32).at[starts].max(jnp.arange(rows, dtype=jnp.int32), mode="drop")
  )
  row = jax.lax.cummax(marks)
  return row, e - starts[row], e < ends[-1]
