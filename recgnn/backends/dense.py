"""`dense`: the whole table and its optimizer state on the accelerators (the reference backend).

State: {"table": float32[R, D], "accum": float32[R] (row-wise Adagrad only)}. Lookup is a
gather; the update touches only the batch's rows (scatter-add for SGD, a dedup'd
gather-apply-scatter for row-wise Adagrad, the dedup done on the host in `prepare` or on the
device in the step: `DenseOptions.dedup`).

Placement on a (DATA, MODEL) mesh:
  dense              replicated on every device (R = N). The lookup gathers the local
                     examples' rows; the update all-gathers the batch's (ids, pooled grads)
                     (B x (L + D) values) and every replica applies the same sparse update.
  dense(shard=rows)  rows split over MODEL, replicated over DATA (R = N rounded up to a
                     multiple of the MODEL size; the padding rows are never read). Lookup in
                     shard_map: the MODEL group's ids are all-gathered, each device gathers
                     and pools the rows it owns (zeros elsewhere) and a psum_scatter returns
                     each device its examples' sums: [B / data, D] floats per device, about
                     8x fewer bytes than XLA's own partitioning of the gather (an all-reduce
                     of the whole block; docs/architecture.md). Update: (ids, pooled grads)
                     all-gathered over the mesh; each device updates the rows it owns.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from recgnn import sharding
from recgnn.backends import dense_fused
from recgnn.embeddings import base, row_sharded

P = sharding.P


SHARDS = ("none", "rows")
DEDUPS = ("auto", "host", "device")


@dataclasses.dataclass(frozen=True)
class DenseOptions(base.BackendOptions):
  """`dense(...)`'s options.

  Attributes:
    shard: `none` (replicated on every device) or `rows` (rows split over MODEL; on a mesh
      whose MODEL axis has one device that is one piece per DATA replica, as replicated).
    fuse: replicated tables of one dim and optimizer in one array (`dense_fused`: one gather
      and one row update per step for the group, two state arrays); false: one per table.
    dedup: where row-wise Adagrad's per-batch dedup of the ids runs. `host`: in `prepare`
      (`kernels.StackedDedup`, numba; unique / inverse sent with the ids); `device`: in the
      step (one sort per table, or per fused group), the ids sent as read (padding mapped in
      the step too): the host does nothing per table, and a third of the ids' bytes cross the
      host link. `auto`: host on CPU devices (the host kernel is the faster there), device on
      accelerators and with process-local input (a process's slice is not the batch). The
      same rows and update either way (the tests compare them bit for bit on CPU).
  """

  backend: ClassVar[str] = "dense"

  shard: str = "none"
  fuse: bool = True
  dedup: str = "auto"

  def __post_init__(self):
    if self.shard not in SHARDS:
      raise ValueError(f"dense: shard must be 'none' or 'rows', got {self.shard!r}")
    if self.dedup not in DEDUPS:
      raise ValueError(f"dense: dedup must be one of {', '.join(DEDUPS)}; got {self.dedup!r}")


@base.register_backend("dense")
class Dense(base.TableBackend):
  """Table on the device(s). Options: `DenseOptions`."""

  Options = DenseOptions
  # (its prepare: padding mapped and a dedup, per batch; nothing kept)
  capabilities = base.Capabilities(
    stateless_prepare=True, prepares_on_device=True, resets_rows=True
  )

  @classmethod
  def capabilities_for(cls, options):
    # dedup=host asks for the host's dedup: its ids must reach the host.
    on_device = cls.Options.parse(options).dedup != "host"
    return base.Capabilities(stateless_prepare=True, prepares_on_device=on_device, resets_rows=True)

  def __init__(self, spec: base.TableSpec, mesh, layout: base.Layout | None = None, **options):
    super().__init__(spec, mesh, layout, **options)
    self.capabilities = type(self).capabilities_for(options)
    k = mesh.shape[sharding.MODEL]
    if self.options.shard == "rows" and base.ROW_ALIGN % k:
      raise ValueError(
        f"dense(shard=rows) (table {self.spec.name!r}): the mesh's model axis has {k} devices; "
        f"row-sharded tables need a model size dividing {base.ROW_ALIGN} (1, 2, 4, 8, ...) so "
        "that checkpoints restore on any such mesh. Use --config.mesh.model=8 (or 4, 2)."
      )
    if self.options.dedup == "host" and self.process_local:
      raise ValueError(
        f"dense(dedup=host) (table {self.spec.name!r}): with process-local input each process "
        "prepares only its slice of the batch, so the batch's dedup must run on the devices: "
        "use dedup=device or auto"
      )
    #: "host" or "device" (`DenseOptions.dedup`, auto resolved by the mesh's platform).
    self.dedup = self.options.dedup
    if self.dedup == "auto":
      cpu = mesh.devices.flat[0].platform == "cpu"
      host = cpu and not (self.process_local or self.ids_on_device)
      self.dedup = "host" if host else "device"

  @property
  def dedup_on_host(self) -> bool:
    return self.dedup == "host" and super().dedup_on_host

  def prepares_by_default(self) -> bool:
    return True  # (the default's arrays, or with dedup=device the ids as read)

  def prepare(self, ids, upcoming=(), *, train=True):
    if self.dedup == "host":
      return super().prepare(ids, upcoming, train=train)
    # As read: padding (< 0) is mapped in the step (`device_ids`), the dedup too.
    return {"ids": np.asarray(ids, np.int32)}

  def prepare_on_device(self, ids: jax.Array):
    # As `prepare` with dedup=device: the ids as read (padding and the dedup in the step).
    return {"ids": ids.astype(jnp.int32)}

  def device_ids(self, ids: jax.Array) -> jax.Array:
    """Prepared ids int32[B, L] -> the same with padding (< 0) mapped to `pad_id` (a no-op
    on ids `prepare` mapped on the host): inside the step."""
    return jnp.where(ids < 0, self.pad_id, ids)

  @classmethod
  def group_class(cls, specs, options):
    opts = cls.Options.parse(options)  # (its defaults: one copy, here)
    fuse = opts.fuse and opts.shard == "none" and dense_fused.fusable(specs)
    return dense_fused.FusedDense if fuse else None

  def describe(self) -> str:
    return "dense" if self.options.shard == "none" else f"dense(shard={self.options.shard})"

  @property
  def pad_id(self):
    return self.padded_rows  # past the aligned rows: never a padding row of the table

  @property
  def shards(self) -> int:
    """How many pieces the rows are split into (1: replicated)."""
    return 1 if self.options.shard == "none" else self.mesh.shape[sharding.MODEL]

  @property
  def padded_rows(self) -> int:
    """Rows allocated: N rounded up to base.ROW_ALIGN (the checkpoint's shape, which splits
    evenly over any model size that divides it)."""
    return base.aligned_rows(self.spec.num_rows)

  def init(self, key):
    table = base.init_table(key, self.spec)
    if self.padded_rows > self.spec.num_rows:
      table = np.concatenate(
        [table, np.zeros((self.padded_rows - self.spec.num_rows, self.spec.dim), np.float32)]
      )
    opt = self.spec.optimizer
    state = {"table": table}
    state.update(
      {s: np.full(self.padded_rows, opt.initial_accumulator, np.float32) for s in opt.slot_names()}
    )
    return sharding.put(state, self.state_sharding())

  def row_sharding(self):
    if self.options.shard == "none":
      return self.replicated(), self.replicated()
    return (
      sharding.named(self.mesh, P(sharding.MODEL, None)),
      sharding.named(self.mesh, P(sharding.MODEL)),
    )

  def state_sharding(self):
    rows, vec = self.row_sharding()
    return {"table": rows, **{s: vec for s in self.spec.optimizer.slot_names()}}

  def export(self, state):
    # The state IS the logical form (aligned rows, placed as on this mesh): no copy.
    return {"rows": state["table"], **{k: state[k] for k in self.spec.optimizer.slot_names()}}

  def import_(self, logical):
    state = {"table": logical["rows"], **{k: logical[k] for k in self.spec.optimizer.slot_names()}}
    return sharding.put(state, self.state_sharding())

  def lookup(self, state, prepared):
    # Padding ids map past the rows (by `prepare` or `device_ids`): mode="fill" gives zero rows.
    return state["table"].at[self.device_ids(prepared["ids"])].get(mode="fill", fill_value=0.0)

  def update(self, state, prepared, grads):
    slots = {k: state[k] for k in self.spec.optimizer.slot_names()}
    prepared = {**prepared, "ids": self.device_ids(prepared["ids"])}
    table, slots = base.sparse_sgd_or_adagrad(self.spec, state["table"], slots, prepared, grads)
    return {"table": table, **slots}

  def reset_rows(self, state, resets):
    """resets {"slots": int32[R] (out of range: none), "rows": f32[R, D]}: those rows set,
    their optimizer slots back to the initial value (a dynamic table's reused rows)."""
    at = resets["slots"]
    init = self.spec.optimizer.initial_accumulator
    out = {"table": state["table"].at[at].set(resets["rows"], mode="drop")}
    for k in self.spec.optimizer.slot_names():
      out[k] = state[k].at[at].set(init, mode="drop")
    return out

  # ------------------------------------------------------------------------- row-sharded

  def _local_ids(self, ids: jax.Array) -> jax.Array:
    """Global ids -> this MODEL shard's row index, or R_local (dropped) when not owned."""
    local_rows = self.padded_rows // self.shards
    return row_sharded.local_index(ids, local_rows, sharding.MODEL, self.spec.num_rows)

  def lookup_pooled(self, state, prepared, count):
    if self.options.shard == "none":
      return super().lookup_pooled(state, prepared, count)
    if count is None:
      count = jnp.zeros((prepared["ids"].shape[0],), jnp.int32)  # unused (sum pooling)
      mean = False
    else:
      mean = True

    @functools.partial(
      jax.shard_map,
      mesh=self.mesh,
      in_specs=(P(sharding.MODEL, None), P(sharding.BATCH, None), P(sharding.BATCH)),
      out_specs=P(sharding.BATCH, None),
      check_vma=False,
    )
    def local(table, ids, count):
      # ids of every example of this device's MODEL group: [b * model, L]
      group = row_sharded.every(ids, sharding.MODEL)
      rows = row_sharded.gather(table, self._local_ids(group))
      pooled = row_sharded.reduce_scatter_rows(jnp.sum(rows, axis=1), sharding.MODEL)
      return base.pool_rows(pooled[:, None, :], count) if mean else pooled

    return local(state["table"], prepared["ids"], count), ()

  def update_pooled(self, state, prepared, residuals, g, count):
    if self.options.shard == "none":
      return super().update_pooled(state, prepared, residuals, g, count)
    slot_names = self.spec.optimizer.slot_names()
    bag = prepared["ids"].shape[1]
    batch_keys = {k for k in prepared if k in self.batch_major}
    p_specs = {k: P(sharding.BATCH) if k in batch_keys else P() for k in prepared}
    if count is None:
      count = jnp.zeros((g.shape[0],), jnp.int32)
      mean = False
    else:
      mean = True
    row_spec = {"table": P(sharding.MODEL, None), **{s: P(sharding.MODEL) for s in slot_names}}

    @functools.partial(
      jax.shard_map,
      mesh=self.mesh,
      in_specs=(row_spec, p_specs, P(sharding.BATCH), P(sharding.BATCH)),
      out_specs=row_spec,
      check_vma=False,
    )
    def local(state, prepared, g, count):
      # The whole batch's (ids, pooled grads) on every device: B x (L + D) values.
      every = functools.partial(row_sharded.every, axis=sharding.BATCH)
      prepared = {k: every(v) if k in batch_keys else v for k, v in prepared.items()}
      g, count = every(g), every(count)
      grads = base.unpool(g, count if mean else None, bag)
      local_prepared = {"ids": self._local_ids(prepared["ids"])}
      if "unique" in prepared:
        local_prepared["unique"] = self._local_ids(prepared["unique"])
        local_prepared["inverse"] = prepared["inverse"]
      slots = {k: state[k] for k in slot_names}
      table, slots = row_sharded.update(self.spec, state["table"], slots, local_prepared, grads)
      return {"table": table, **slots}

    return local(state, prepared, g, count)

  def memory(self):
    per_device = self.padded_rows // self.shards * self.spec.row_bytes
    where = "device" if self.shards == 1 else f"rows over {self.shards} devices (MODEL)"
    return base.MemoryReport(per_device, 0, where)

  def table(self, state):
    return np.asarray(jax.device_get(state["table"]))[: self.spec.num_rows]
