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

Split graph (`SplitNeighborSampler`): the adjacency's rows are split over every device of a
mesh (device d owns rows [d R, (d+1) R)). Per hop, inside one shard_map:
  all_gather   the frontier (each device held k / D batches)      k * n_l int32
  local        each device draws the offsets of EVERY frontier row from the shared key and
               reads the neighbours of the rows it owns (others write 0)
  psum_scatter the candidates, scattered over batches             k * n_l * f_l int32
  local        each device deduplicates its own k / D batches
Every row has exactly one owner, so the sum is the neighbour (stored +1 so that 0 means
"none"). Because the draws are the 1-device sampler's draws, the split sample equals the
1-device sample exactly (tested), and the bytes per hop are read from the compiled HLO.
The reduce-scatter carries every row's slots from every device (zeros where a device does
not own the row), so its bytes do not fall with D. `exchange="all_to_all"` instead sends
each device's own rows to their owners and the neighbours back (two all_to_alls with a
fixed room per device pair): exact with room for all rows, about capacity / D of the
reduce-scatter's bytes with `exchange_capacity` (rows beyond it are dropped and counted).

LADIES on a split graph (`SplitLadiesSampler`): the same row split of Ahat; per layer an
all_gather of the frontier and a psum_scatter of P = Q @ Ahat's entries, each read by the
owner of its row, then the 1-device layer on each device's own batches (see the class).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import scipy.sparse as sp

from recgnn import sharding
from recgnn.graphs import sampling

P = sharding.P
WHERE = ("host", "device")
EXCHANGES = ("reduce_scatter", "all_to_all")


def key_from(rng_or_key) -> jax.Array:
  """A jax key from a numpy Generator (the host samplers' argument) or a key itself, so a
  caller seeding per (epoch, group) with numpy gets a deterministic device sample too."""
  if isinstance(rng_or_key, np.random.Generator):
    return jax.random.key(int(rng_or_key.integers(0, 2**31 - 1)))
  return rng_or_key


def _pad_k(k: int, multiple: int = 1) -> int:
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
# cache make the scatter / gather several times slower (N = 1M, k = 16: one batch at a time
# 0.19 s, all 16 at once 0.70 s); an accelerator wants many batches in flight.
TABLE_ENTRIES = {"cpu": 1 << 21}
TABLE_ENTRIES_DEFAULT = 1 << 26


def _table_chunk(k: int, num_nodes: int) -> int:
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
  XLA:CPU sorts (key, payload) pairs 6x slower than single arrays (measured 2.3 s for
  1.76M pairs), so a sort-based dedup was 10x slower than numpy's; the table costs O(N)
  memset per batch plus O(n + M) random accesses.
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
  time (`_table_chunk`), so the dedup tables' memory does not grow with k."""
  chunk = _table_chunk(frontier.shape[0], num_nodes)
  return jax.lax.map(
    lambda x: extend(*x, n_next, num_nodes), (frontier, cand, cand_valid), batch_size=chunk
  )


def _batch_uniforms(key: jax.Array, layer: int, k: int, shape) -> jax.Array:
  """float32[k, *shape]: batch b's uniforms of `layer`, independent of k and padding."""
  keys = jax.vmap(lambda b: jax.random.fold_in(jax.random.fold_in(key, b), layer))(
    jnp.arange(k, dtype=jnp.int32)
  )
  return jax.vmap(lambda kb: jax.random.uniform(kb, shape))(keys)


def _gather_rows(indptr, indices, rows, fanout, u, owned=None, row_offset=0):
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


def _node_layer(indptr, indices, frontier, fanout, n_next, num_nodes, u):
  """One node-wise layer for k batches: frontier int32[k, n], u float32[k, n, f] ->
  (next int32[k, n_next], nbr int32[k, n, f], mask bool[k, n, f], edges int32[k], dropped)."""
  k, n = frontier.shape
  cand, mask = _gather_rows(indptr, indices, frontier.reshape(-1), fanout, u.reshape(k * n, fanout))
  cand, mask = cand.reshape(k, n * fanout), mask.reshape(k, n * fanout)
  nxt, pos, dropped = extend_batches(frontier, cand, mask, n_next, num_nodes)
  return _node_outputs(nxt, pos, dropped, k, n, fanout)


def _node_outputs(nxt, pos, dropped, k, n, fanout):
  pos = pos.reshape(k, n, fanout)
  mask = pos >= 0
  return nxt, jnp.maximum(pos, 0), mask, mask.sum((1, 2), dtype=jnp.int32), dropped.sum()


class DeviceNeighborSampler:
  """`sampling.NeighborSampler` on the device: same arguments, same Blocks, same law.

  Args: as `sampling.NeighborSampler` (adj, fanouts, batch_size, capacities).
    device: where the CSR lives (None: the default device).
  """

  def __init__(
    self,
    adj: sp.spmatrix,
    *,
    fanouts: Sequence[int],
    batch_size: int,
    capacities: Sequence[int] | None = None,
    device=None,
  ):
    # The host sampler validates and sizes; its arrays are only read here.
    host = sampling.NeighborSampler(
      adj, fanouts=fanouts, batch_size=batch_size, capacities=capacities
    )
    self.fanouts, self.sizes, self.batch_size = host.fanouts, host.sizes, batch_size
    self.num_nodes = host.num_nodes
    self.max_degree = int(host.deg.max(initial=0))
    indptr, indices = _device_csr(host.adj)
    self.indptr = jax.device_put(indptr, device)
    self.indices = jax.device_put(indices, device)
    self._sample = jax.jit(self._sample_fn)

  def _sample_fn(self, indptr, indices, seeds, key):
    k = seeds.shape[0]
    frontier, layers, edges, dropped = seeds, [], [], jnp.int32(0)
    for layer, f in enumerate(self.fanouts):
      u = _batch_uniforms(key, layer, k, (frontier.shape[1], f))
      frontier, nbr, mask, e, d = _node_layer(
        indptr, indices, frontier, f, self.sizes[layer + 1], self.num_nodes, u
      )
      layers.append({"nbr": nbr, "mask": mask})
      edges.append(e)
      dropped = dropped + d
    return frontier, tuple(layers), jnp.stack(edges, 1), dropped

  def sample_device(self, seeds, key: jax.Array):
    """seeds int32[k, batch_size] (-1 = padding) -> (nodes int32[k, n_L], layers,
    num_edges int32[k, L], dropped int32[]) as device arrays (see sampling.Blocks)."""
    return self._sample(self.indptr, self.indices, jnp.asarray(seeds, jnp.int32), key)

  def sample(self, seeds: np.ndarray, rng) -> sampling.Blocks:
    """Host-compatible: seeds int[k, batch_size], a numpy Generator (or a jax key) ->
    sampling.Blocks of numpy arrays, as `NeighborSampler.sample`."""
    seeds = sampling._check_seeds(seeds, self.batch_size, self.num_nodes)
    k = seeds.shape[0]
    padded = np.full((_pad_k(k), seeds.shape[1]), -1, np.int32)
    padded[:k] = seeds
    out = jax.device_get(self.sample_device(padded, key_from(rng)))
    return _blocks(out, k, self.sizes)


def _blocks(out, k, sizes) -> sampling.Blocks:
  nodes, layers, edges, dropped = out
  return sampling.Blocks(
    nodes=np.asarray(nodes[:k]),
    sizes=tuple(sizes),
    layers=tuple({key: np.asarray(v[:k]) for key, v in layer.items()} for layer in layers),
    num_edges=np.asarray(edges[:k], np.int64),
    dropped=int(dropped),
  )


# ----------------------------------------------------------------------------- LADIES


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


def _row_entries(indptr, rows, capacity):
  """The entries of the rows `rows` (int32[n], -1 = padding) of a CSR, in row order, padded
  to `capacity`: (row position int32[C], CSR entry int32[C], valid bool[C])."""
  valid = rows >= 0
  r = jnp.where(valid, rows, 0)
  row, offset, ok = _row_layout(jnp.where(valid, indptr[r + 1] - indptr[r], 0), capacity)
  return row, indptr[r[row]] + offset, ok


def _row_layout(length, capacity):
  """Rows of `length` (int32[n]) laid end to end in `capacity` slots: (row position
  int32[C], offset within the row int32[C], valid bool[C])."""
  rows = length.shape[0]
  ends = jnp.cumsum(length)
  starts = ends - length
  e = jnp.arange(capacity, dtype=jnp.int32)
  # Entry e belongs to the last row starting at or before e: mark each row's start, then a
  # running max (a searchsorted per entry costs ~1 us each on XLA:CPU). An empty row shares
  # its start with the next non-empty one, which is larger and wins the max.
  marks = (
    jnp.zeros(capacity, jnp.int32).at[starts].max(jnp.arange(rows, dtype=jnp.int32), mode="drop")
  )
  row = jax.lax.cummax(marks)
  return row, e - starts[row], e < ends[-1]


def _ladies_batch(
  indptr, indices, data, frontier, s, n_next, cap_entries, cap_edges, num_nodes, key
):
  """One batch, one LADIES layer (the device twin of LadiesSampler.sample's loop body)."""
  row, entry, valid = _row_entries(indptr, frontier, cap_entries)
  col = jnp.where(valid, jnp.take(indices, entry, mode="clip"), num_nodes)
  val = jnp.where(valid, jnp.take(data, entry, mode="clip"), 0.0)
  return _ladies_from_entries(row, col, val, valid, frontier, s, n_next, cap_edges, num_nodes, key)


def _ladies_from_entries(row, col, val, valid, frontier, s, n_next, cap_edges, num_nodes, key):
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
  """`sampling.LadiesSampler` on the device: same arguments, same Blocks, same law.

  Args: as `sampling.LadiesSampler` (adj, layer_sizes, batch_size, edge_capacities).
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
    self._sample = jax.jit(self._sample_fn)

  @staticmethod
  def plan(adj, layer_sizes, batch_size, edge_capacities):
    """(the host sampler: validation, sizes, Ahat; the entry capacity of each layer: the
    exact worst case of P's entries per batch, whose n_l rows are the n_l longest of Ahat)."""
    host = sampling.LadiesSampler(
      adj, layer_sizes=layer_sizes, batch_size=batch_size, edge_capacities=edge_capacities
    )
    row_len = np.sort(np.diff(host.lap.indptr))[::-1]
    caps = tuple(max(int(row_len[: host.sizes[i]].sum()), 1) for i in range(len(host.layer_sizes)))
    return host, caps

  def _layer(self, layer, indptr, indices, data, frontier, key):
    k = frontier.shape[0]
    keys = jax.vmap(lambda b: jax.random.fold_in(jax.random.fold_in(key, b), layer))(
      jnp.arange(k, dtype=jnp.int32)
    )
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
    chunk = _table_chunk(k, self.num_nodes)
    return jax.lax.map(lambda x: fn(x[0], key=x[1]), (frontier, keys), batch_size=chunk)

  def _sample_fn(self, indptr, indices, data, seeds, key):
    frontier, layers, edges, dropped = seeds, [], [], jnp.int32(0)
    for layer in range(len(self.layer_sizes)):
      frontier, lay, e, d, _ = self._layer(layer, indptr, indices, data, frontier, key)
      layers.append(lay)
      edges.append(e)
      dropped = dropped + d.sum()
    return frontier, tuple(layers), jnp.stack(edges, 1), dropped

  def sample_device(self, seeds, key: jax.Array):
    """seeds int32[k, batch_size] -> (nodes, layers, num_edges, dropped) device arrays."""
    return self._sample(self.indptr, self.indices, self.data, jnp.asarray(seeds, jnp.int32), key)

  def sample(self, seeds: np.ndarray, rng) -> sampling.Blocks:
    """As `LadiesSampler.sample`: numpy seeds and Generator (or a jax key) -> Blocks."""
    seeds = sampling._check_seeds(seeds, self.batch_size, self.num_nodes)
    k = seeds.shape[0]
    padded = np.full((_pad_k(k), seeds.shape[1]), -1, np.int32)
    padded[:k] = seeds
    return _blocks(jax.device_get(self.sample_device(padded, key_from(rng))), k, self.sizes)

  def probabilities(self, frontier: np.ndarray) -> np.ndarray:
    """LADIES' column-norm probabilities as the device computes them: frontier int[k, n]
    (n = batch_size) -> float32[k, N] dense (for tests; the sampler never densifies)."""
    frontier = jnp.asarray(frontier, jnp.int32)
    *_, prob = self._layer(0, self.indptr, self.indices, self.data, frontier, jax.random.key(0))
    return np.asarray(prob, np.float64)


# ----------------------------------------------------------------------------- split graph


class _SplitSampler:
  """What the row-split samplers share: a call's k batches padded to a multiple of the
  devices and split over them, one jitted hop per layer (`_hops`, each taking the split
  graph arrays `_args()`, the batch-split frontier and the key, and returning (next
  frontier, the layer's arrays, edges, dropped)), Blocks on the host, and the bytes of
  each hop's collectives read from its compiled HLO."""

  mesh: jax.sharding.Mesh
  devices: int
  batch_size: int
  num_nodes: int
  sizes: tuple[int, ...]
  _hops: list

  def _args(self) -> tuple:
    raise NotImplementedError

  def pad_seeds(self, seeds: np.ndarray) -> np.ndarray:
    seeds = sampling._check_seeds(seeds, self.batch_size, self.num_nodes)
    padded = np.full((_pad_k(seeds.shape[0], self.devices), seeds.shape[1]), -1, np.int32)
    padded[: seeds.shape[0]] = seeds
    return padded

  def sample_device(self, seeds, key: jax.Array):
    """seeds int32[k, batch_size] (k a multiple of the devices) -> (nodes, layers,
    num_edges int32[k, L], dropped int32[]), batch-split over the mesh."""
    frontier = jax.device_put(
      jnp.asarray(seeds, jnp.int32), sharding.named(self.mesh, P(sharding.BATCH))
    )
    layers, edges, dropped = [], [], 0
    for hop in self._hops:
      frontier, lay, e, d = hop(*self._args(), frontier, key)
      layers.append(lay)
      edges.append(e)
      dropped = dropped + d.sum()
    return frontier, tuple(layers), jnp.stack(edges, 1), dropped

  def sample(self, seeds: np.ndarray, rng) -> sampling.Blocks:
    """As the host sampler's `sample`: numpy seeds and Generator (or a jax key) -> Blocks."""
    k = np.asarray(seeds).reshape(-1, self.batch_size).shape[0]
    out = jax.device_get(self.sample_device(self.pad_seeds(seeds), key_from(rng)))
    return _blocks(out, k, self.sizes)

  def hop_bytes(self, k: int) -> list[dict]:
    """Per hop, the collectives of the compiled hop for k batches (recgnn.comms.summary):
    bytes each device sends, read from the HLO without running it."""
    from recgnn import comms

    k = _pad_k(k, self.devices)
    key = jax.random.key(0)
    out = []
    for layer, hop in enumerate(self._hops):
      frontier = jax.ShapeDtypeStruct(
        (k, self.sizes[layer]), jnp.int32, sharding=sharding.named(self.mesh, P(sharding.BATCH))
      )
      out.append(comms.compiled_summary(hop.lower(*self._args(), frontier, key).compile()))
    return out


class SplitNeighborSampler(_SplitSampler):
  """Node-wise sampling with the adjacency's rows split over every device of `mesh`.

  Device d holds rows [d R, (d+1) R) (R = ceil(N / D)) of the CSR, its indices padded to
  the largest shard; a call's k batches are split over the devices (k padded to a multiple
  of D). See the module docstring for the per-hop collectives. Same arguments as
  `DeviceNeighborSampler` plus the mesh; `sample_device(seeds, key)` returns the same
  sample as `DeviceNeighborSampler.sample_device(seeds, key)` (tested), batch-sharded.
  """

  def __init__(
    self,
    adj: sp.spmatrix,
    *,
    fanouts: Sequence[int],
    batch_size: int,
    mesh: jax.sharding.Mesh,
    capacities: Sequence[int] | None = None,
    exchange: str = "reduce_scatter",
    exchange_capacity: float | None = None,
    exchange_margin: float = 4.0,
  ):
    if exchange not in EXCHANGES:
      raise ValueError(f"Unknown exchange {exchange!r}; available: {', '.join(EXCHANGES)}")
    host = sampling.NeighborSampler(
      adj, fanouts=fanouts, batch_size=batch_size, capacities=capacities
    )
    self.fanouts, self.sizes, self.batch_size = host.fanouts, host.sizes, batch_size
    self.num_nodes = host.num_nodes
    self.mesh = mesh
    self.exchange, self.exchange_capacity = exchange, exchange_capacity
    self.exchange_margin = exchange_margin
    self.devices = mesh.size
    # Row-split: each device holds 1 / D of the edges (the point: graphs beyond one device).
    (self.indptr, self.indices), self.rows_per_device, self.adjacency_bytes_per_device = (
      _split_rows(host.adj, mesh)
    )
    make = self._hop if exchange == "reduce_scatter" else self._hop_all_to_all
    self._hops = [jax.jit(make(layer)) for layer in range(len(self.fanouts))]

  def pair_capacity(self, local_rows: int) -> int:
    """Rows one device may ask one owner for per hop (all_to_all exchange): all of its
    rows (exact), or `exchange_capacity` x an even share s plus `exchange_margin` x sqrt(s),
    rounded up to 8. The count per owner is about binomial (std ~ sqrt(s)): a factor alone
    overflows often at small s (measured: 1.25 x 32 rows cost 2-3 points of accuracy)."""
    if self.exchange_capacity is None:
      return local_rows
    share = local_rows / self.devices
    room = share * self.exchange_capacity + self.exchange_margin * np.sqrt(share)
    return max(1, min(local_rows, -(-int(np.ceil(room)) // 8) * 8))

  def _hop_all_to_all(self, layer: int):
    """One hop by requests: each device sends the rows of its own k / D batches to their
    owners (all_to_all, `pair_capacity` rows per pair), owners draw and read the neighbours
    and send them back (all_to_all of [rows, f]). With a fitted capacity a device sends
    about capacity x k n_l f_l / D ints instead of the reduce-scatter's k n_l f_l; rows
    beyond it lose their neighbours and are counted in `dropped`. Same outputs as `_hop`."""
    f, n_next, axis = self.fanouts[layer], self.sizes[layer + 1], sharding.BATCH
    r, num_nodes, d = self.rows_per_device, self.num_nodes, self.devices

    @functools.partial(
      jax.shard_map,
      mesh=self.mesh,
      in_specs=(P(axis), P(axis), P(axis), P()),
      out_specs=(P(axis), P(axis), P(axis), P(axis)),
      check_vma=False,
    )
    def hop(indptr, indices, local_frontier, key):
      lb, n = local_frontier.shape
      me = jax.lax.axis_index(axis)
      rows = local_frontier.reshape(-1)
      cap = self.pair_capacity(lb * n)
      valid = rows >= 0
      owner = jnp.where(valid, rows // r, 0)
      onehot = (owner[:, None] == jnp.arange(d)[None, :]) & valid[:, None]
      slot = jnp.take_along_axis(jnp.cumsum(onehot, 0, dtype=jnp.int32), owner[:, None], 1)[:, 0]
      fits = valid & (slot <= cap)
      dest = jnp.where(fits, owner * cap + slot - 1, d * cap)
      # A request: the row (+1; 0 = empty) and its global position, whose uniforms the
      # owner regenerates: the draws are the 1-device sampler's.
      gpos = me * lb * n + jnp.arange(lb * n, dtype=jnp.int32)
      req = (
        jnp.zeros((d * cap, 2), jnp.int32).at[dest].set(jnp.stack([rows + 1, gpos], 1), mode="drop")
      )
      req = jax.lax.all_to_all(req, axis, 0, 0, tiled=True)
      want, pos = req[:, 0] - 1, req[:, 1]
      u = _batch_uniforms(key, layer, lb * d, (n, f)).reshape(-1, f)
      cand, _ = _gather_rows(
        indptr[0], indices[0], want, f, u[pos], owned=want >= 0, row_offset=me * r
      )
      resp = jnp.where((want >= 0)[:, None], cand + 1, 0)
      back = jax.lax.all_to_all(resp, axis, 0, 0, tiled=True)
      got = jnp.where(fits[:, None], back[jnp.minimum(dest, d * cap - 1)], 0).reshape(lb, n * f)
      nxt, pos, dropped = extend_batches(local_frontier, got - 1, got > 0, n_next, num_nodes)
      nxt, nbr, mask, edges, dropped = _node_outputs(nxt, pos, dropped, lb, n, f)
      # Rows that did not fit the exchange count as dropped (their neighbours are lost).
      dropped = dropped + jnp.sum(valid & ~fits, dtype=jnp.int32)
      return nxt, {"nbr": nbr, "mask": mask}, edges, dropped[None]

    return hop

  def _hop(self, layer: int):
    """One hop: (indptr, indices, frontier [k, n_l] batch-split, key) -> (next
    [k, n_{l+1}], {nbr, mask} [k, n_l, f], edges [k], dropped [D]), batch-split."""
    f, n_next, axis = self.fanouts[layer], self.sizes[layer + 1], sharding.BATCH
    r, num_nodes = self.rows_per_device, self.num_nodes

    @functools.partial(
      jax.shard_map,
      mesh=self.mesh,
      in_specs=(P(axis), P(axis), P(axis), P()),
      out_specs=(P(axis), P(axis), P(axis), P(axis)),
      check_vma=False,  # loop carries start replicated and become device-varying
    )
    def hop(indptr, indices, local_frontier, key):
      frontier = jax.lax.all_gather(local_frontier, axis, tiled=True)  # [k, n] everywhere
      k, n = frontier.shape
      me = jax.lax.axis_index(axis)
      u = _batch_uniforms(key, layer, k, (n, f))
      rows = frontier.reshape(-1)
      owned = (rows >= 0) & (rows // r == me)
      cand, _ = _gather_rows(indptr[0], indices[0], rows, f, u.reshape(k * n, f), owned, me * r)
      # The owner writes id + 1 (0 = masked); non-owners write 0: the sum is the sample.
      mine = jnp.where(owned[:, None], cand + 1, 0).reshape(k, n * f)
      total = jax.lax.psum_scatter(mine, axis, scatter_dimension=0, tiled=True)
      local = local_frontier
      nxt, pos, dropped = extend_batches(local, total - 1, total > 0, n_next, num_nodes)
      nxt, nbr, mask, edges, dropped = _node_outputs(nxt, pos, dropped, local.shape[0], n, f)
      return nxt, {"nbr": nbr, "mask": mask}, edges, dropped[None]

    return hop

  def _args(self):
    return self.indptr, self.indices


def _split_rows(a: sp.csr_matrix, mesh, data: bool = False):
  """A CSR's rows split over every device of `mesh`: device d holds rows [d R, (d+1) R)
  (R = ceil(N / D)) as a local CSR, its entries padded to the largest shard. Returns
  ((indptr int32[D, R+1], indices int32[D, W][, data float32[D, W]]) batch-split device
  arrays, R, bytes per device)."""
  d, n = mesh.size, a.shape[0]
  r = -(-n // d)
  bounds = np.minimum(np.arange(d + 1) * r, n)
  lo, hi = a.indptr[bounds[:-1]], a.indptr[bounds[1:]]
  width = max(int((hi - lo).max()), 1)
  indptr = np.zeros((d, r + 1), np.int32)
  indices = np.zeros((d, width), np.int32)
  values = np.zeros((d, width), np.float32)
  for i in range(d):
    rows = a.indptr[bounds[i] : bounds[i + 1] + 1] - lo[i]
    indptr[i, : rows.size] = rows
    indptr[i, rows.size :] = rows[-1] if rows.size else 0
    indices[i, : hi[i] - lo[i]] = a.indices[lo[i] : hi[i]]
    if data:
      values[i, : hi[i] - lo[i]] = a.data[lo[i] : hi[i]]
  arrays = (indptr, indices, values) if data else (indptr, indices)
  split = sharding.named(mesh, P(sharding.BATCH))
  nbytes = sum(int(x[0].nbytes) for x in arrays)
  return tuple(jax.device_put(x, split) for x in arrays), r, nbytes


class SplitLadiesSampler(_SplitSampler):
  """LADIES with Ahat's rows split over every device of `mesh` (device d holds rows
  [d R, (d+1) R)); a call's k batches are split over the devices (k a multiple of D).

  Per layer, inside one shard_map:
    all_gather    the frontier (each device held k / D batches)          k * n_l int32
    local         every batch's P = Q @ Ahat entries laid out as on one device (the row
                  lengths, N int32, are replicated: O(N) as the dedup tables already are);
                  each device reads the entries of the rows it owns (others write 0)
    psum_scatter  (column + 1, value) of the entries, scattered over batches
                                                               k * C_l * (int32 + float32)
    local         each device runs the 1-device layer on its own batches' entries: column
                  norms, the weighted draw (the same keys), dedup, edges and weights
  Every entry has exactly one owner, so each sum is one value plus zeros (exact): the
  sample equals `DeviceLadiesSampler`'s for the same key, bit for bit (tested). C_l is the
  1-device worst case of P's entries (the n_l longest rows of Ahat), so the reduce-scatter
  is as large as the 1-device entry buffer; the column norms, O(N) per batch, never cross.
  """

  def __init__(
    self,
    adj: sp.spmatrix,
    *,
    layer_sizes: Sequence[int],
    batch_size: int,
    mesh: jax.sharding.Mesh,
    edge_capacities: Sequence[int] | None = None,
  ):
    host, self.entry_capacities = DeviceLadiesSampler.plan(
      adj, layer_sizes, batch_size, edge_capacities
    )
    self.layer_sizes, self.sizes = host.layer_sizes, host.sizes
    self.edge_capacities, self.batch_size = host.edge_capacities, batch_size
    self.num_nodes = host.num_nodes
    self.mesh, self.devices = mesh, mesh.size
    arrays, self.rows_per_device, nbytes = _split_rows(host.lap, mesh, data=True)
    self.indptr, self.indices, self.data = arrays
    # Row lengths, replicated: every device lays out every batch's entries.
    self.lengths = jax.device_put(
      np.diff(host.lap.indptr).astype(np.int32), sharding.named(mesh, P())
    )
    self.adjacency_bytes_per_device = nbytes + int(self.lengths.nbytes)
    self._hops = [jax.jit(self._hop(layer)) for layer in range(len(self.layer_sizes))]

  def _hop(self, layer: int):
    """(indptr, indices, data, lengths, frontier [k, n_l] batch-split, key) -> (next
    [k, n_{l+1}], {src, dst, weight} [k, E_l], edges [k], dropped [D]), batch-split."""
    axis, r, num_nodes = sharding.BATCH, self.rows_per_device, self.num_nodes
    cap = self.entry_capacities[layer]

    @functools.partial(
      jax.shard_map,
      mesh=self.mesh,
      in_specs=(P(axis), P(axis), P(axis), P(), P(axis), P()),
      out_specs=(P(axis), P(axis), P(axis), P(axis)),
      check_vma=False,
    )
    def hop(indptr, indices, data, lengths, local_frontier, key):
      lb = local_frontier.shape[0]
      frontier = jax.lax.all_gather(local_frontier, axis, tiled=True)  # [k, n] everywhere
      me = jax.lax.axis_index(axis)

      def layout(fr):
        ok = fr >= 0
        return _row_layout(jnp.where(ok, lengths[jnp.where(ok, fr, 0)], 0), cap)

      def read(fr):
        row, offset, valid = layout(fr)
        node = fr[row]
        owned = valid & (node // r == me)
        entry = indptr[0][jnp.where(owned, node - me * r, 0)] + offset
        col = jnp.where(owned, jnp.take(indices[0], entry, mode="clip") + 1, 0)
        val = jnp.where(owned, jnp.take(data[0], entry, mode="clip"), 0.0)
        return col, val

      col, val = jax.vmap(read)(frontier)
      col = jax.lax.psum_scatter(col, axis, scatter_dimension=0, tiled=True)
      val = jax.lax.psum_scatter(val, axis, scatter_dimension=0, tiled=True)
      row, _, valid = jax.vmap(layout)(local_frontier)
      col = jnp.where(valid, col - 1, num_nodes)
      keys = jax.vmap(lambda b: jax.random.fold_in(jax.random.fold_in(key, b), layer))(
        me * lb + jnp.arange(lb, dtype=jnp.int32)
      )
      fn = functools.partial(
        _ladies_from_entries,
        s=self.layer_sizes[layer],
        n_next=self.sizes[layer + 1],
        cap_edges=self.edge_capacities[layer],
        num_nodes=num_nodes,
      )
      chunk = _table_chunk(lb, num_nodes)
      nxt, lay, edges, dropped, _ = jax.lax.map(
        lambda x: fn(*x[:5], key=x[5]),
        (row, col, val, valid, local_frontier, keys),
        batch_size=chunk,
      )
      return nxt, lay, edges, dropped.sum()[None]

    return hop

  def _args(self):
    return self.indptr, self.indices, self.data, self.lengths


def replicated_hop_bytes(sampler: DeviceNeighborSampler, mesh, k: int) -> list[dict]:
  """The 1-device sampler replicated on every device of `mesh`, each sampling its k / D
  batches (the whole graph on every device): the collectives of its compiled hops (none)."""
  from recgnn import comms

  axis = sharding.BATCH
  k = _pad_k(k, mesh.size)
  out = []
  for layer, f in enumerate(sampler.fanouts):
    n_next = sampler.sizes[layer + 1]

    @functools.partial(
      jax.shard_map,
      mesh=mesh,
      in_specs=(P(), P(), P(axis), P()),
      out_specs=P(axis),
      check_vma=False,
    )
    def hop(indptr, indices, frontier, key, f=f, n_next=n_next, layer=layer):
      u = _batch_uniforms(key, layer, frontier.shape[0], (frontier.shape[1], f))
      return _node_layer(indptr, indices, frontier, f, n_next, sampler.num_nodes, u)[0]

    repl = sharding.named(mesh, P())
    args = (
      jax.device_put(sampler.indptr, repl),
      jax.device_put(sampler.indices, repl),
      jax.ShapeDtypeStruct(
        (k, sampler.sizes[layer]), jnp.int32, sharding=sharding.named(mesh, P(axis))
      ),
      jax.random.key(0),
    )
    out.append(comms.compiled_summary(jax.jit(hop).lower(*args).compile()))
  return out


def make(
  adj,
  kind: str,
  where: str,
  *,
  batch_size: int,
  fanouts=None,
  layer_sizes=None,
  capacities=None,
  mesh=None,
  exchange: str = "reduce_scatter",
  exchange_capacity: float | None = None,
):
  """The sampler of `kind` (node | ladies) at `where` (host | device); `mesh` with more
  than one device splits the graph's rows over it (`SplitNeighborSampler`, with `exchange`
  and `exchange_capacity`; `SplitLadiesSampler`, reduce_scatter only)."""
  if where not in WHERE:
    raise ValueError(f"Unknown sampler.where {where!r}; available: {', '.join(WHERE)}")
  if kind == "ladies":
    if capacities is not None:  # (node-wise frontier sizes: LADIES' are fixed by layer_sizes)
      raise ValueError("capacities are node-wise sampling's; LADIES' frontiers are exact")
    kw = dict(layer_sizes=list(layer_sizes), batch_size=batch_size)
    if where == "host":
      return sampling.LadiesSampler(adj, **kw)
    if mesh is not None and mesh.size > 1:
      if exchange != "reduce_scatter":
        raise ValueError("sampler.kind=ladies splits the graph with split_exchange=reduce_scatter")
      return SplitLadiesSampler(adj, mesh=mesh, **kw)
    return DeviceLadiesSampler(adj, **kw)
  kw = dict(fanouts=list(fanouts), batch_size=batch_size, capacities=capacities)
  if where == "host":
    return sampling.NeighborSampler(adj, **kw)
  if mesh is not None and mesh.size > 1:
    return SplitNeighborSampler(
      adj, mesh=mesh, exchange=exchange, exchange_capacity=exchange_capacity, **kw
    )
  return DeviceNeighborSampler(adj, **kw)
