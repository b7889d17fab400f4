"""Tables in (pinned) host memory, read and written inside the jitted step.

Shared by the backends that keep rows on the host (`offload`: the whole table behind a device
cache; `hot_cold`: the cold rows): one copy of the placement, the Orbax workaround and the
host gather / scatter.

Placement: on one device the host arrays are whole, in that device's `pinned_host` memory; on
a mesh they are split by rows over EVERY device of the mesh (P(BATCH)): one host copy of the
table in all, S / n rows per device, instead of a replica per device.

Reads and writes happen inside jit as host computations (`compute_on`, compute type
"device_host", outputs in host memory) with the indices moved to host memory first
(docs/architecture.md: a gather on a host array works only that way). On a split
table each device reads / writes the rows it owns:
  gather   each device gathers its owned rows (zeros elsewhere) and a psum over the mesh
           gives every device all of them (exact: one non-zero term per row)
  scatter  each device writes the rows it owns (the others are dropped)
Both are bare XLA gathers / scatters: jnp's index normalisation would add device-memory
constants, which compute_on("device_host") rejects.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax import lax
from jax.experimental import compute_on as _compute_on

from recgnn import sharding
from recgnn.embeddings import base, row_sharded

HOST_MEMORIES = ("pinned_host", "device")

# The function form of compute_on (compute_type=, out_memory_spaces=): jax 0.10 names it
# `compute_on2` (its `compute_on` is a context manager); from jax 0.11 on it is `compute_on`
# and the context manager is gone. Both lower to the same host-compute call.
_HOST_COMPUTE = getattr(_compute_on, "compute_on2", None) or _compute_on.compute_on


def host_compute(fn, *args):
  """fn(*args) as a host computation (XLA compute type "device_host"), its outputs in host
  memory. The args must already be in host memory (`HostTable.to_host`)."""
  return _HOST_COMPUTE(fn, compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)(
    *args
  )


def host_spec(x: jax.Array) -> jax.sharding.PartitionSpec:
  """A split host array's spec: rows over every device of the mesh."""
  return sharding.P(sharding.BATCH, *([None] * (x.ndim - 1)))


def gather_rows(x: jax.Array, idx: jax.Array) -> jax.Array:
  """x[idx] for in-range idx, as a bare XLA gather (jnp's index normalisation would add
  device-memory constants, which `compute_on("device_host")` rejects)."""
  dn = lax.GatherDimensionNumbers(
    offset_dims=tuple(range(1, x.ndim)), collapsed_slice_dims=(0,), start_index_map=(0,)
  )
  return lax.gather(x, idx[:, None], dn, (1,) + x.shape[1:], mode=lax.GatherScatterMode.CLIP)


def scatter_rows(x: jax.Array, idx: jax.Array, rows: jax.Array) -> jax.Array:
  """x.at[idx].set(rows); out-of-range idx (padding) are dropped natively by XLA."""
  dn = lax.ScatterDimensionNumbers(
    update_window_dims=tuple(range(1, x.ndim)),
    inserted_window_dims=(0,),
    scatter_dims_to_operand_dims=(0,),
  )
  return lax.scatter(
    x, idx[:, None], rows, dn, mode=lax.GatherScatterMode.FILL_OR_DROP, unique_indices=True
  )


class HostTable:
  """Placement and in-step access of host-resident row arrays ({"table": f32[S, D], slot:
  f32[S]} with S = base.aligned_rows(N)) on a mesh.

  host_memory: `pinned_host` (falls back to `device`, with a warning, where the platform has
  no host memory space) or `device` (no offload: debugging, benchmarks).
  """

  def __init__(self, host_memory: str, owner: str, mesh: jax.sharding.Mesh):
    """Refuse (before allocating) a memory kind or a mesh the host arrays cannot live on."""
    if host_memory not in HOST_MEMORIES:
      raise ValueError(
        f"{owner}: unknown host_memory {host_memory!r}; available: {', '.join(HOST_MEMORIES)}"
      )
    kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
    if host_memory != "device" and host_memory not in kinds:
      logging.warning(
        "%s: %s memory unavailable on %s (has %s); keeping it in device memory",
        owner,
        host_memory,
        jax.devices()[0].platform,
        sorted(kinds),
      )
      host_memory = "device"
    self.host_memory = host_memory
    self.owner = owner
    self.mesh = mesh
    self._check_mesh(mesh)

  @property
  def offloaded(self) -> bool:
    return self.host_memory != "device"

  @property
  def split(self) -> bool:
    """Whether the host arrays are split by rows over the devices of the mesh."""
    return self.offloaded and self.mesh.size > 1

  @property
  def list_spec(self):
    """The input placement (`Backend.prepared_spec`) of an index list only this table's host
    computations read: in host memory (sharding.HOST_SPEC) for one host table (unsplit, in
    host memory), so it never crosses the host link; on the devices otherwise (a split table's
    devices read their own rows of the replicated list inside a shard_map)."""
    return sharding.HOST_SPEC if self.offloaded and not self.split else sharding.REPLICATED

  def _check_mesh(self, mesh: jax.sharding.Mesh) -> None:
    if self.offloaded and not all(
      d.process_index == jax.process_index() for d in mesh.devices.flat
    ):
      raise ValueError(
        f"{self.owner} runs within one process: its host table and planner live in this "
        "process's memory; a mesh over several processes needs a table split per process "
        "(not built yet). Use dense / dense(shard=rows) for this table, or run one process."
      )
    if self.split and base.ROW_ALIGN % mesh.size:
      raise ValueError(
        f"{self.owner}: the host table is split by rows over the {mesh.size} devices of the "
        f"mesh, which needs a device count dividing {base.ROW_ALIGN} (1, 2, 4, 8, ...)"
      )

  def row_sharding(self) -> tuple[jax.sharding.Sharding, jax.sharding.Sharding]:
    """(rows f32[S, D], slots f32[S]) shardings of the host arrays."""
    kind = self.host_memory if self.offloaded else "device"
    if self.split:
      return (
        sharding.named(self.mesh, sharding.P(sharding.BATCH, None), kind),
        sharding.named(self.mesh, sharding.P(sharding.BATCH), kind),
      )
    repl = sharding.named(self.mesh, sharding.REPLICATED, kind)
    return repl, repl

  def sharding(self, slot_names) -> dict:
    rows, vec = self.row_sharding()
    return {"table": rows, **{s: vec for s in slot_names}}

  def place(self, host: dict, shardings: dict) -> dict:
    """Host arrays (numpy or placed) in host memory. Orbax (0.11, jax 0.10) restores arrays
    whose sharding says pinned_host but whose type is in device memory, which compute_on
    rejects: those are re-placed (once, O(N))."""
    out = {}
    for k, v in host.items():
      if isinstance(v, jax.Array) and (
        not self.offloaded or jax.typeof(v).memory_space == jax.memory.Space.Host
      ):
        out[k] = v if v.sharding == shardings[k] else jax.device_put(v, shardings[k])
      else:
        out[k] = jax.device_put(np.asarray(v), shardings[k])
    return out

  # ------------------------------------------------------------------------- in the step

  def to_host(self, x):
    return jax.device_put(x, jax.memory.Space.Host) if self.offloaded else x

  def to_device(self, x):
    return jax.device_put(x, jax.memory.Space.Device) if self.offloaded else x

  def on_host(self, fn, *args):
    """fn(*args) on the host when the arrays are offloaded, else a plain device computation."""
    return host_compute(fn, *args) if self.offloaded else fn(*args)

  def scatter(self, h: jax.Array, rows: jax.Array, values: jax.Array) -> jax.Array:
    """h[rows] = values on the host array h (rows past h's end are dropped; rows unique).
    values: device, replicated. On a split host table each device writes the rows it owns."""
    if not self.split:
      rows, values = self.to_host(rows), self.to_host(values)
      return self.on_host(scatter_rows, h, rows, values)

    def local_scatter(block, loc, values):  # loc = R where not owned: dropped (stays unique)
      loc, values = self.to_host(loc), self.to_host(values)
      return self.on_host(scatter_rows, block, loc, values)

    return row_sharded.scatter_everywhere(self.mesh, sharding.BATCH, h, rows, values, local_scatter)

  def gather(self, h: jax.Array, rows: jax.Array) -> jax.Array:
    """h[rows] (rows in range) from the host array h, as a replicated device array. On a
    split host table each device gathers the rows it owns and an all-reduce of the [M, ...]
    block (zeros elsewhere, so the sum is exact) gives every device all of them."""
    if not self.split:
      rows = self.to_host(rows)
      return self.to_device(self.on_host(gather_rows, h, rows))

    def local_gather(block, loc):
      owned = loc < block.shape[0]
      # The host gather is a bare XLA gather (`gather_rows`): in-range indices only.
      got = self.to_device(self.on_host(gather_rows, block, self.to_host(jnp.where(owned, loc, 0))))
      return jnp.where(owned.reshape(owned.shape + (1,) * (got.ndim - 1)), got, 0)

    return row_sharded.gather_everywhere(self.mesh, sharding.BATCH, h, rows, local_gather)

  # ----------------------------------------------- several arrays, one index transfer

  def gather_many(self, hs: dict, rows: jax.Array) -> dict:
    """{k: hs[k][rows]} (rows in range) from host arrays with the same rows (a table and
    its optimizer slots), as replicated device arrays: ONE host computation, so the indices
    cross the host link once, not once per array. Split tables as `gather`."""

    def read(arrays, idx):
      return {k: gather_rows(a, idx) for k, a in arrays.items()}

    if not self.split:
      return {k: self.to_device(v) for k, v in self.on_host(read, hs, self.to_host(rows)).items()}

    def local(blocks, rows):
      r = next(iter(blocks.values())).shape[0]
      loc = row_sharded.local_index(rows, r, sharding.BATCH)
      owned = loc < r
      got = self.on_host(read, blocks, self.to_host(jnp.where(owned, loc, 0)))
      got = {
        k: jnp.where(owned.reshape(owned.shape + (1,) * (v.ndim - 1)), self.to_device(v), 0)
        for k, v in got.items()
      }  # fmt: skip
      return row_sharded.psum_rows(got, sharding.BATCH)

    specs = {k: host_spec(h) for k, h in hs.items()}
    return jax.shard_map(
      local, mesh=self.mesh, in_specs=(specs, sharding.REPLICATED),
      out_specs=sharding.REPLICATED, check_vma=False,
    )(hs, rows)  # fmt: skip

  def scatter_many(self, hs: dict, rows: jax.Array, values: dict) -> dict:
    """{k: hs[k].at[rows].set(values[k])} on host arrays with the same rows (rows past the
    end dropped; unique): ONE host computation, the indices cross the host link once.
    values: device, replicated. Split tables as `scatter`."""
    write = _scatter_all
    if not self.split:
      return self.on_host(write, hs, self.to_host(rows), self.to_host(values))

    def local(blocks, rows, values):
      r = next(iter(blocks.values())).shape[0]
      loc = row_sharded.local_index(rows, r, sharding.BATCH)
      return self.on_host(write, blocks, self.to_host(loc), self.to_host(values))

    specs = {k: host_spec(h) for k, h in hs.items()}
    return jax.shard_map(
      local, mesh=self.mesh, in_specs=(specs, sharding.REPLICATED, sharding.REPLICATED),
      out_specs=specs, check_vma=False,
    )(hs, rows, values)  # fmt: skip

  # ------------------------------------- one list for several tables (see `_gather_segments`)

  def gather_segments(self, tables: list[dict], rows: jax.Array, off: jax.Array, caps):
    """Rows of several tables' host arrays (same keys and row layout) listed in ONE list:
    rows int32[W] (replicated; table i's own row indices at [off[i], off[i + 1])), off
    int32[T + 1], caps: each table's most entries (static). -> ({k: f32[W, ...]} replicated
    on the device, entries past the last segment unspecified; `moved`: the list and offsets
    left in host memory for `scatter_segments`, or None). One host computation per device:
    the list crosses the host link once, W rows come back. On a split host table each
    device reads the rows it owns (zeros elsewhere) and a psum gives every device all."""
    _check_segments(tables)
    caps = tuple(int(c) for c in caps)
    if not self.offloaded:
      return _gather_segments(tables, rows, off, caps, lambda x: x), None
    if not self.split:
      rows, off = self.to_host(rows), self.to_host(off)
      got, rows, off = host_compute(
        lambda t, r, o: (_gather_segments(t, r, o, caps, _host_const), r, o), tables, rows, off
      )
      return {k: self.to_device(v) for k, v in got.items()}, {"rows": rows, "off": off}
    block_rows = [next(iter(t.values())).shape[0] // self.mesh.size for t in tables]

    def local(blocks, rows, off):
      base = jnp.stack([lax.axis_index(sharding.BATCH) * r for r in block_rows]).astype(jnp.int32)
      read = lambda b, r, o, s: _gather_segments(b, r, o, caps, _host_const, s, block_rows)  # noqa: E731
      got = host_compute(read, blocks, self.to_host(rows), self.to_host(off), self.to_host(base))
      return row_sharded.psum_rows({k: self.to_device(v) for k, v in got.items()}, sharding.BATCH)

    specs = [{k: host_spec(h) for k, h in t.items()} for t in tables]
    got = jax.shard_map(
      local, mesh=self.mesh, in_specs=(specs, sharding.REPLICATED, sharding.REPLICATED),
      out_specs=sharding.REPLICATED, check_vma=False,
    )(tables, rows, off)  # fmt: skip
    return got, None

  def scatter_segments(self, tables, rows, off, caps, values: dict, moved=None) -> list[dict]:
    """`gather_segments`' write: tables[i][k][rows[j]] = values[k][j] for table i's
    segment (rows past a table's end dropped; unique per table); values {k: [W, ...]} on
    the device, replicated. moved: `gather_segments`' list in host memory (not sent again).
    -> the new host arrays, per table. On a split table each device writes its own rows."""
    return self.scatter_lists(tables, [(rows, off, values, caps)], moved)

  def scatter_lists(self, tables, lists, moved=None) -> list[dict]:
    """`scatter_segments` of several lists [(rows int32[W], off int32[T + 1], values {k:
    [W, ...]}, caps)] (each as `gather_segments` lays them out, W and each table's window
    `caps` per list), written in order in ONE host computation (one write-back per step)."""
    _check_segments(tables)
    caps = [tuple(int(c) for c in x[3]) for x in lists]
    lists = [tuple(x[:3]) for x in lists]
    if not self.offloaded:
      for (rows, off, values), c in zip(lists, caps):
        tables = _scatter_segments(tables, rows, off, c, values, lambda x: x)
      return tables

    def write(t, lists, base=None, block_rows=None):
      for (r, o, v), c in zip(lists, caps):
        t = _scatter_segments(t, r, o, c, v, _host_const, base, block_rows)
      return t

    def to_host(lists, moved):
      out = []
      for i, (r, o, v) in enumerate(lists):
        if i == 0 and moved is not None:
          r, o = moved["rows"], moved["off"]
        else:
          r, o = self.to_host(r), self.to_host(o)
        out.append((r, o, {k: self.to_host(x) for k, x in v.items()}))
      return out

    if not self.split:
      return host_compute(write, tables, to_host(lists, moved))
    block_rows = [next(iter(t.values())).shape[0] // self.mesh.size for t in tables]

    def local(blocks, lists):
      base = jnp.stack([lax.axis_index(sharding.BATCH) * r for r in block_rows]).astype(jnp.int32)
      fn = lambda b, ls, s: write(b, ls, s, block_rows)  # noqa: E731
      return host_compute(fn, blocks, to_host(lists, None), self.to_host(base))

    specs = [{k: host_spec(h) for k, h in t.items()} for t in tables]
    lists = [tuple(x) for x in lists]
    return jax.shard_map(
      local, mesh=self.mesh, in_specs=(specs, sharding.REPLICATED),
      out_specs=specs, check_vma=False,
    )(tables, lists)  # fmt: skip


def _scatter_all(arrays: dict, idx: jax.Array, values: dict) -> dict:
  return {k: scatter_rows(a, idx, values[k]) for k, a in arrays.items()}


# ------------------------------------------------- one list for a group's tables (segments)
#
# A step that moves rows of several tables over the host link moves them as ONE list per
# group: table i's rows (its own row indices) at [off[i], off[i + 1]) of rows int32[W], the
# list's length W one shape for the group (`host_cache.ListSizer` over the group's total
# need). Sizing each table's list apart made the step's signature every table's width, and
# with 26 tables one of them changes every few steps (33-106 compiles in 200 steps,
# measured); the group's total moves ~sqrt(26) less, relative to its size.
#
# Inside the one host computation each table reads a static window of its own cap_i entries
# at the dynamic offset off[i] (its count off[i + 1] - off[i] <= cap_i): O(sum cap_i) host
# work, O(W) rows over the link. The backends pass cap_i = min(the table's most entries, the
# list's longest segment, bucketed): windows of each table's ids per batch made the host
# touch tables x ids rows whatever the list's length (offload, 26 x 2048 ids at a 5% cache:
# 33 MB a step for a 0.9 MB list; 11 MB with these windows). Windows overlap the next
# tables' segments: gathers read those entries clipped and the next table's write
# overwrites them (tables in order), scatters mask them. Constants are built in host
# memory (`_host_const`): a device-memory constant inside a host computation is refused.


def _host_const(x) -> jax.Array:
  return jax.device_put(x, jax.memory.Space.Host)


def _padded(x: jax.Array, pad: int) -> jax.Array:
  """x [W, ...] then `pad` copies of x[0] (inside a host computation: no constant)."""
  if pad == 0:
    return x
  tail = lax.broadcast_in_dim(x[0], (pad,) + x.shape[1:], tuple(range(1, x.ndim)))
  return lax.concatenate([x, tail], 0)


def _windows(rows, off, caps, const, base=None, block_rows=None):
  """Each table's window of the list: [(idx int32[cap_i], ok bool[cap_i])], ok where the
  entry is the table's own (and, with base / block_rows: owned by this device, idx local)."""
  out = []
  single = len(caps) == 1  # one table: its segment starts the list, the window is the list
  padded = rows if single else _padded(rows, max(caps))
  for i, cap in enumerate(caps):
    cap = rows.shape[0] if single else cap
    idx = rows if single else lax.dynamic_slice(padded, (off[i],), (cap,))
    ok = const(lax.iota(jnp.int32, cap)) < off[i + 1] - off[i]
    if base is not None:
      idx = idx - base[i]
      ok = ok & (idx >= 0) & (idx < block_rows[i])
    out.append((idx, ok))
  return out


def assemble(parts, off, width: int, const=lambda x: x):
  """{k: [W, ...]} from each table's window of values parts[i] {k: [cap_i, ...]} written at
  off[i], in table order: table i + 1's write covers what table i's window holds past its
  segment. Entries past the last segment are unspecified. (Host or device; const: how a
  constant is built there.) Scatters dropping what falls past W, in place in one [W, ...]
  buffer: a buffer padded by a window (dynamic_update_slice clamps its start) and its copy
  back to W rows touched ~2 W rows more on the host, per list."""
  out = {}
  for k in parts[0]:
    first = parts[0][k]
    dims = tuple(range(1, first.ndim))
    buf = lax.broadcast_in_dim(first[0], (width,) + first.shape[1:], dims)
    for i, p in enumerate(parts):
      pos = off[i] + const(lax.iota(jnp.int32, p[k].shape[0]))
      buf = scatter_rows(buf, pos, p[k])
    out[k] = buf
  return out


def _gather_segments(tables, rows, off, caps, const, base=None, block_rows=None):
  """(host) {k: [W, ...]}: entry j of table i's segment = tables[i][k][rows[j]]; with base /
  block_rows (split tables): this device's rows, zeros for the others."""
  parts = []
  for (idx, ok), arrays in zip(_windows(rows, off, caps, const, base, block_rows), tables):
    got = {}
    for k, a in arrays.items():
      g = gather_rows(a, jnp.where(ok, idx, const(jnp.zeros((), jnp.int32))))
      if base is not None:
        mask = ok.reshape(ok.shape + (1,) * (g.ndim - 1))
        g = jnp.where(mask, g, const(jnp.zeros((), g.dtype)))
      got[k] = g
    parts.append(got)
  return parts[0] if len(parts) == 1 else assemble(parts, off, rows.shape[0], const)


def _scatter_segments(tables, rows, off, caps, values, const, base=None, block_rows=None):
  """(host) tables[i][k][rows[j]] = values[k][j] for the entries j of table i's segment
  (and, split, owned here); entries past a table's end are dropped (padding)."""
  single = len(caps) == 1
  out = []
  windows = _windows(rows, off, caps, const, base, block_rows)
  for i, ((idx, ok), arrays) in enumerate(zip(windows, tables)):
    drop = const(jnp.full((), jnp.iinfo(jnp.int32).max, jnp.int32))
    idx = jnp.where(ok, idx, drop)
    new = {}
    for k, a in arrays.items():
      v = values[k]
      if single:
        win = v
      else:  # (a clipped gather, not a slice of values padded by a window: no copy of them)
        win = gather_rows(v, off[i] + const(lax.iota(jnp.int32, caps[i])))
      new[k] = scatter_rows(a, idx, win)
    out.append(new)
  return out


def layouts(specs, by_optimizer: bool = False) -> tuple[tuple[str, ...], ...]:
  """Table names (specs: {name: TableSpec}) grouped by row layout (dim, optimizer slots),
  in order: the tables one host list can carry (`HostTable.gather_segments`). by_optimizer:
  by the whole optimizer too (its learning rate, ...): tables one sparse update can take
  (offload's stacked caches)."""
  out: dict[tuple, list[str]] = {}
  for name, spec in specs.items():
    opt = spec.optimizer if by_optimizer else spec.optimizer.slot_names()
    out.setdefault((spec.dim, opt), []).append(name)
  return tuple(tuple(v) for v in out.values())


def _check_segments(tables) -> None:
  keys = [tuple(sorted(t)) for t in tables]
  tails = [tuple((k, t[k].shape[1:], t[k].dtype) for k in sorted(t)) for t in tables]
  if len(set(keys)) > 1 or len(set(tails)) > 1:
    raise ValueError(
      f"one host list for tables of different layouts ({tails}): group the tables by row "
      "width and optimizer (one list per layout)"
    )
