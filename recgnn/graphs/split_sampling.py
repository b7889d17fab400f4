"""Sampling on a graph whose rows are split over the devices of a mesh: the node-wise and
LADIES samplers of `recgnn.graphs.device_sampling` with the adjacency's rows split, giving
the same sample as one device (tested).

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
from recgnn.graphs import device_ladies, sampling
from recgnn.graphs import device_sampling as device

P = sharding.P
EXCHANGES = ("reduce_scatter", "all_to_all")


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
    seeds = sampling.check_seeds(seeds, self.batch_size, self.num_nodes)
    padded = np.full((device.pad_k(seeds.shape[0], self.devices), seeds.shape[1]), -1, np.int32)
    padded[: seeds.shape[0]] = seeds
    return padded

  def sample_device(self, seeds, key: jax.Array):
    """seeds int32[k, batch_size] (k a multiple of the devices) -> (nodes, layers,
    num_edges int32[k, L], dropped int32[]), batch-split over the mesh."""
    frontier = jax.device_put(
      jnp.asarray(seeds, jnp.int32), sharding.named(self.mesh, P(sharding.BATCH))
    )
    return self.sample_arrays(*self._args(), frontier, key)

  @property
  def arrays(self) -> tuple[jax.Array, ...]:
    """The split graph arrays `sample_arrays` reads (batch-split over the mesh)."""
    return self._args()

  def sample_arrays(self, *args):
    """The pure sampling function (jit-able: the data-parallel step runs it inside its own
    jit): (*arrays, seeds int32[k, batch_size] batch-split, key) -> as `sample_device`. key:
    the call's key, or every batch's own (key[k], replicated: `device.batch_keys`)."""
    *graph, frontier, key = args
    layers, edges, dropped = [], [], 0
    for hop in self._hops:
      frontier, lay, e, d = hop(*graph, frontier, key)
      layers.append(lay)
      edges.append(e)
      dropped = dropped + d.sum()
    return frontier, tuple(layers), jnp.stack(edges, 1), dropped

  def sample(self, seeds: np.ndarray, rng) -> sampling.Blocks:
    """As the host sampler's `sample`: numpy seeds and Generator (or a jax key) -> Blocks."""
    k = np.asarray(seeds).reshape(-1, self.batch_size).shape[0]
    out = jax.device_get(self.sample_device(self.pad_seeds(seeds), device.key_from(rng)))
    return device.to_blocks(out, k, self.sizes)

  def hop_bytes(self, k: int) -> list[dict]:
    """Per hop, the collectives of the compiled hop for k batches (recgnn.comms.summary):
    bytes each device sends, read from the HLO without running it."""
    from recgnn import comms

    k = device.pad_k(k, self.devices)
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
  `device.DeviceNeighborSampler` plus the mesh; `sample_device(seeds, key)` returns the same
  sample as `device.DeviceNeighborSampler.sample_device(seeds, key)` (tested), batch-sharded.
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
    overflows often at small s, and rows beyond it lose their neighbours (accuracy drops)."""
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
      u = device.batch_uniforms(key, layer, lb * d, (n, f)).reshape(-1, f)
      cand, _ = device.gather_rows(
        indptr[0], indices[0], want, f, u[pos], owned=want >= 0, row_offset=me * r
      )
      resp = jnp.where((want >= 0)[:, None], cand + 1, 0)
      back = jax.lax.all_to_all(resp, axis, 0, 0, tiled=True)
      got = jnp.where(fits[:, None], back[jnp.minimum(dest, d * cap - 1)], 0).reshape(lb, n * f)
      nxt, pos, dropped = device.extend_batches(local_frontier, got - 1, got > 0, n_next, num_nodes)
      nxt, nbr, mask, edges, dropped = device.node_outputs(nxt, pos, dropped, lb, n, f)
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
      u = device.batch_uniforms(key, layer, k, (n, f))
      rows = frontier.reshape(-1)
      owned = (rows >= 0) & (rows // r == me)
      cand, _ = device.gather_rows(
        indptr[0], indices[0], rows, f, u.reshape(k * n, f), owned, me * r
      )
      # The owner writes id + 1 (0 = masked); non-owners write 0: the sum is the sample.
      mine = jnp.where(owned[:, None], cand + 1, 0).reshape(k, n * f)
      total = jax.lax.psum_scatter(mine, axis, scatter_dimension=0, tiled=True)
      local = local_frontier
      nxt, pos, dropped = device.extend_batches(local, total - 1, total > 0, n_next, num_nodes)
      nxt, nbr, mask, edges, dropped = device.node_outputs(nxt, pos, dropped, local.shape[0], n, f)
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
  sample equals `device_ladies.DeviceLadiesSampler`'s for the same key, bit for bit
  (tested). C_l is the 1-device worst case of P's entries (the n_l longest rows of Ahat),
  so the reduce-scatter is as large as the 1-device entry buffer; the column norms, O(N)
  per batch, never cross.
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
    host, self.entry_capacities = device_ladies.DeviceLadiesSampler.plan(
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
        return device.row_layout(jnp.where(ok, lengths[jnp.where(ok, fr, 0)], 0), cap)

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
      keys = jax.vmap(lambda kb: jax.random.fold_in(kb, layer))(device.batch_keys(key, lb, me * lb))
      fn = functools.partial(
        device_ladies.ladies_from_entries,
        s=self.layer_sizes[layer],
        n_next=self.sizes[layer + 1],
        cap_edges=self.edge_capacities[layer],
        num_nodes=num_nodes,
      )
      chunk = device.table_chunk(lb, num_nodes)
      nxt, lay, edges, dropped, _ = jax.lax.map(
        lambda x: fn(*x[:5], key=x[5]),
        (row, col, val, valid, local_frontier, keys),
        batch_size=chunk,
      )
      return nxt, lay, edges, dropped.sum()[None]

    return hop

  def _args(self):
    return self.indptr, self.indices, self.data, self.lengths


def replicated_hop_bytes(sampler: device.DeviceNeighborSampler, mesh, k: int) -> list[dict]:
  """The 1-device sampler replicated on every device of `mesh`, each sampling its k / D
  batches (the whole graph on every device): the collectives of its compiled hops (none)."""
  from recgnn import comms

  axis = sharding.BATCH
  k = device.pad_k(k, mesh.size)
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
      u = device.batch_uniforms(key, layer, frontier.shape[0], (frontier.shape[1], f))
      return device.node_layer(indptr, indices, frontier, f, n_next, sampler.num_nodes, u)[0]

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
