"""Embedding tables: specs, row-wise optimizers, the backend contract and the per-table plan.

An embedding table is not a Flax param. Autodiff through a gather builds a table-sized
cotangent (a 10M x 16 table costs ~90x more per step that way, DESIGN.md), so every backend
owns its tables' state and applies a sparse row-wise optimizer to the rows a batch touched.

The contract (v2, `Backend`) is per GROUP of tables on a device mesh: every table the plan
gives the same backend string is one instance, constructed with the mesh:

  prepare(ids, upcoming)       host, off the step's path: {table: int[B, L]} (-1 = padding)
                               -> numpy pytree (dedup, cache plans); `prepared_spec` says
                               which leaves are batch-major (split over the devices)
  lookup(state, prepared)      jit-able: -> {table: f32[B, D]} POOLED
  update(state, prepared, g)   jit-able: g = d loss / d pooled, {table: f32[B, D]}; sparse
                               (O(B * L * D), never O(rows)), state donated
  state_sharding / memory (per device) / sync / restore / stats / tables(state)

Pooled in, pooled out: a model-parallel backend moves [B, D] blocks, never [B, L, D]. The
lookup sits outside `value_and_grad`; `update` gets d loss / d pooled, so a backward
all-to-all (and a codec on it) lives in `update`, with no custom_vjp.

Backends whose tables are independent (dense, tt, offload) implement the per-table
`TableBackend` (unpooled rows, their row-update code unchanged) and are grouped by
`TableGroup`, which pools, `unpool`s the gradient, and places each table on the mesh.

Backends are chosen per table by a plan: regex rules over table names, first match wins:
  [("C(3|4|10)", "tt(rank=32)"), (".*", "dense")]
The backend string's name is the module name in `recgnn.embeddings`, so adding a backend is
one new file exporting `BACKEND` (a `Backend` or a `TableBackend` subclass).
"""

from __future__ import annotations

import abc
import ast
import dataclasses
import functools
import importlib
import pkgutil
import re
import zlib
from collections.abc import Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from recgnn import sharding

PyTree = Any
PAD = -1  # id value that marks an empty slot of a multi-hot bag
# Batches the trainer's input thread prepares ahead of the step: prepare(k + PREFETCH) may run
# before update(k), and backends must give the same results under that interleaving.
PREFETCH = 2
INIT_CHUNK = 1 << 16  # rows per deterministic init chunk (see `init_rows`)
# Row arrays are allocated (and checkpointed) with their row count rounded up to a multiple of
# ROW_ALIGN, so one saved shape splits evenly over any MODEL axis size that divides ROW_ALIGN:
# a checkpoint written on one mesh restores on another without gathering a table anywhere.
# The padding rows are never addressed by an id.
ROW_ALIGN = 1024


def aligned_rows(num_rows: int) -> int:
  """num_rows rounded up to a multiple of ROW_ALIGN."""
  return -(-num_rows // ROW_ALIGN) * ROW_ALIGN


OPTIMIZERS = ("sgd", "rowwise_adagrad")
INITIALIZERS = ("uniform", "normal", "zeros")
POOLINGS = ("sum", "mean")
# Shared modules of the package that are not backends (the access profiler, the host-table
# code, the step's micro-batch protocol).
_NOT_BACKENDS = frozenset(
  {"base", "codecs", "testing", "plan", "profile", "host_table", "microbatch"}
)


# ----------------------------------------------------------------------------- specs


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerSpec:
  """Sparse row-wise optimizer applied to the rows a batch touched.

  Attributes:
    name: `sgd` (w -= lr * g; duplicates of a row within a batch add up, as with a dense
      gradient) or `rowwise_adagrad` (FBGEMM / TorchRec semantics: one accumulator per row,
      acc += mean(g_row**2); w -= lr * g_row / (sqrt(acc) + eps), g_row summed over the
      batch's occurrences of that row).
    learning_rate: step size.
    eps: Adagrad's epsilon.
    initial_accumulator: Adagrad's initial accumulator value.
  """

  name: str = "sgd"
  learning_rate: float = 0.1
  eps: float = 1e-8
  initial_accumulator: float = 0.0

  def __post_init__(self):
    if self.name not in OPTIMIZERS:
      raise ValueError(f"Unknown optimizer {self.name!r}; available: {', '.join(OPTIMIZERS)}")
    if self.learning_rate <= 0:
      raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")

  @property
  def needs_unique(self) -> bool:
    """Whether the update needs each touched row once (per-row state) or tolerates repeats."""
    return self.name != "sgd"

  def slot_names(self) -> tuple[str, ...]:
    """Per-row optimizer state arrays, each float32[rows]."""
    return ("accum",) if self.name == "rowwise_adagrad" else ()

  def init_slots(self, num_rows: int, **put) -> dict[str, jax.Array]:
    """Fresh per-row optimizer state for `num_rows` rows. `put`: kwargs for jnp.full."""
    return {
      s: jnp.full((num_rows,), self.initial_accumulator, jnp.float32, **put)
      for s in self.slot_names()
    }

  def apply(
    self, rows: jax.Array, slots: dict[str, jax.Array], grads: jax.Array
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """One optimizer step on gathered rows.

    Args:
      rows: float32[U, D], the current values of U distinct rows (for sgd U may repeat).
      slots: per-row optimizer state, each float32[U].
      grads: float32[U, D], the summed gradient of each row.
    Returns:
      (new rows float32[U, D], new slots).
    """
    lr = self.learning_rate
    if self.name == "sgd":
      return rows - lr * grads, slots
    accum = slots["accum"] + jnp.mean(grads * grads, axis=-1)
    rows = rows - lr * grads / (jnp.sqrt(accum)[:, None] + self.eps)
    return rows, {"accum": accum}


@dataclasses.dataclass(frozen=True, kw_only=True)
class TableSpec:
  """One embedding table.

  Attributes:
    name: table name, matched by the plan's regexes (DLRM: C1..C26).
    num_rows: rows (categorical cardinality).
    dim: embedding width.
    optimizer: the sparse row-wise optimizer of this table.
    initializer: `uniform` U(-1/sqrt(num_rows), 1/sqrt(num_rows)) as in the DLRM reference,
      `normal` N(0, 1/dim), or `zeros`.
    pooling: how a multi-hot bag is reduced: `sum` or `mean` over its non-padded ids.
  """

  name: str
  num_rows: int
  dim: int
  optimizer: OptimizerSpec = OptimizerSpec()
  initializer: str = "uniform"
  pooling: str = "sum"

  def __post_init__(self):
    if self.num_rows <= 0 or self.dim <= 0:
      raise ValueError(f"Table {self.name!r}: num_rows and dim must be > 0")
    if self.initializer not in INITIALIZERS:
      raise ValueError(
        f"Table {self.name!r}: unknown initializer {self.initializer!r}; "
        f"available: {', '.join(INITIALIZERS)}"
      )
    if self.pooling not in POOLINGS:
      raise ValueError(
        f"Table {self.name!r}: unknown pooling {self.pooling!r}; available: {', '.join(POOLINGS)}"
      )

  @property
  def row_bytes(self) -> int:
    """Bytes of one row plus its optimizer state."""
    return 4 * self.dim + 4 * len(self.optimizer.slot_names())

  @property
  def table_bytes(self) -> int:
    return self.num_rows * self.row_bytes


@dataclasses.dataclass(frozen=True)
class MemoryReport:
  """What a backend will allocate for one table, computed before allocating."""

  device_bytes: int  # on EACH device of the mesh (the most any one device holds)
  host_bytes: int  # host memory in all
  placement: str  # human-readable, e.g. "device", "host + 200000-row device cache"


# ----------------------------------------------------------------------------- init


def init_rows(key: jax.Array, spec: TableSpec, start: int, stop: int) -> np.ndarray:
  """Initial values of rows [start, stop) of a table, float32[stop - start, D].

  Deterministic per INIT_CHUNK-row chunk (chunk c draws from fold_in(key, c)), so every
  backend, whatever it keeps where, starts from the same table, and a host-resident table of
  any size can be initialised a chunk at a time without materialising it on a device.
  """
  if not 0 <= start <= stop <= spec.num_rows:
    raise ValueError(f"rows [{start}, {stop}) out of range for {spec.num_rows} rows")
  out = np.empty((stop - start, spec.dim), np.float32)
  c0, c1 = start // INIT_CHUNK, -(-stop // INIT_CHUNK)
  for c in range(c0, c1):
    block = np.asarray(_init_chunk(key, c, spec.dim, spec.num_rows, spec.initializer))
    lo, hi = max(start, c * INIT_CHUNK), min(stop, (c + 1) * INIT_CHUNK)
    out[lo - start : hi - start] = block[lo - c * INIT_CHUNK : hi - c * INIT_CHUNK]
  return out


def init_table(key: jax.Array, spec: TableSpec) -> np.ndarray:
  """The whole initial table, float32[N, D] on the host (see `init_rows`)."""
  return init_rows(key, spec, 0, spec.num_rows)


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _init_chunk(key, chunk, dim, num_rows, initializer):
  k = jax.random.fold_in(key, chunk)
  shape = (INIT_CHUNK, dim)
  if initializer == "uniform":
    bound = 1.0 / np.sqrt(num_rows)
    return jax.random.uniform(k, shape, jnp.float32, -bound, bound)
  if initializer == "normal":
    return jax.random.normal(k, shape, jnp.float32) / np.sqrt(dim)
  return jnp.zeros(shape, jnp.float32)


# ----------------------------------------------------------------------------- bags


def dedup(ids: np.ndarray, num_rows: int) -> tuple[np.ndarray, np.ndarray]:
  """Host-side dedup of a batch's ids, fixed-shape for jit.

  Args:
    ids: int[B, L], PAD for empty slots.
    num_rows: the table's rows; used as the out-of-range filler.
  Returns:
    unique: int32[B * L], the distinct ids then `num_rows` (dropped by scatters).
    inverse: int32[B, L], position of each id in `unique` (padding -> a filler slot).
  """
  flat = ids.reshape(-1)
  flat = np.where(flat < 0, num_rows, flat)
  uniq, inverse = np.unique(flat, return_inverse=True)
  unique = np.full(flat.shape[0], num_rows, np.int32)
  unique[: uniq.shape[0]] = uniq
  return unique, inverse.reshape(ids.shape).astype(np.int32)


def device_dedup(ids: jax.Array, filler: int) -> tuple[jax.Array, jax.Array]:
  """`dedup` on device, inside jit: ids int32[...] with padding already >= the rows ->
  (unique int32[ids.size]: the sorted distinct ids then `filler`, inverse int32[ids.shape]).
  The same arrays as the host's `dedup` up to the filler, so the same update bit for bit."""
  flat = ids.reshape(-1)
  unique, inverse = jnp.unique(flat, size=flat.shape[0], fill_value=filler, return_inverse=True)
  return unique, inverse.reshape(ids.shape)


def segment_rows(grads: jax.Array, inverse: jax.Array, num_unique: int) -> jax.Array:
  """Sum grads float32[B, L, D] per distinct row: -> float32[num_unique, D]."""
  d = grads.shape[-1]
  return jax.ops.segment_sum(grads.reshape(-1, d), inverse.reshape(-1), num_segments=num_unique)


# ----------------------------------------------------------------------------- contract


def table_key(key: jax.Array, name: str) -> jax.Array:
  """A table's init key: depends on its name only, so a table starts from the same values
  whatever backend, group or position in the plan it has."""
  return jax.random.fold_in(key, zlib.crc32(name.encode()) & 0x7FFFFFFF)


def unpool(g: jax.Array, count: jax.Array | None, bag: int) -> jax.Array:
  """d loss / d pooled f32[B, D] -> d loss / d rows f32[B, L, D].

  `count`: int32[B] non-padded ids per bag for mean pooling, None for sum pooling. Padded
  positions get a gradient too (as autodiff through `pool` gives them); every backend's
  update drops padded positions, so their value does not matter.
  """
  if count is not None:
    g = g / jnp.maximum(count, 1).astype(g.dtype)[:, None]
  return jnp.broadcast_to(g[:, None, :], (g.shape[0], bag, g.shape[1]))


class Backend(abc.ABC):
  """Contract v2: the storage and update rule of a GROUP of tables on a device mesh.

  A group is every table the plan gives the same backend string. A backend that fuses its
  tables (one all-to-all for all of them; a popular / non-popular split over all of an
  example's ids) implements this class directly; a backend whose tables are independent
  implements `TableBackend` and is grouped by `TableGroup`.

  Shapes: B = the global batch (split over every device of the mesh when the task shards
  batches), L = bag length, D = the table's dim.
  """

  name: ClassVar[str] = ""
  #: How many upcoming batches `prepare` wants to see (cDLRM's look-ahead window).
  lookahead: int = 0

  def __init__(self, specs: Sequence[TableSpec], mesh: jax.sharding.Mesh, text: str = ""):
    self.specs = {s.name: s for s in specs}
    self.mesh = mesh
    self.text = text or self.name
    #: False while the task's batches are replicated (not split over devices); set by the
    #: trainer before the first `prepare`.
    self.shard_batch = True

  def __repr__(self):
    return f"{type(self).__name__}({', '.join(self.specs)}: {self.describe()})"

  def describe(self, table: str | None = None) -> str:
    """The backend and its options, as a plan string (per table where they differ)."""
    del table
    return self.text

  @abc.abstractmethod
  def init(self, key: jax.Array) -> PyTree:
    """Allocate and initialise the state, placed as `state_sharding()` says. Each table
    starts from `init_rows(table_key(key, name), spec, ...)`."""

  @abc.abstractmethod
  def state_sharding(self) -> PyTree:
    """NamedShardings of the state (jit in/out shardings, checkpoint restore target)."""

  @abc.abstractmethod
  def prepare(
    self, ids: dict[str, np.ndarray], upcoming: Sequence[dict[str, np.ndarray]] = (), *, train=True
  ) -> PyTree:
    """Host side, on the input thread, once per batch in stream order: ids {table: int[B, L]}
    (PAD = -1) -> a pytree of numpy arrays. `upcoming`: up to `lookahead` next batches' ids.
    `train=False`: an eval batch (only `lookup` runs on it)."""

  @abc.abstractmethod
  def prepared_spec(self, prepared: PyTree) -> PyTree:
    """PartitionSpec of each prepared leaf: sharding.BATCH_SPEC for batch-major leaves (axis 0
    split over every device with the batch), sharding.REPLICATED for global ones."""

  @abc.abstractmethod
  def lookup(self, state: PyTree, prepared: PyTree) -> dict[str, jax.Array]:
    """-> {table: f32[B, D]} pooled with each table's pooling. Jit-able."""

  @abc.abstractmethod
  def update(self, state: PyTree, prepared: PyTree, grads: dict[str, jax.Array]) -> PyTree:
    """grads {table: d loss / d pooled, f32[B, D]} -> new state. Jit-able, sparse (cost
    O(B * L * D), never O(rows)), state donated."""

  @abc.abstractmethod
  def memory(self) -> dict[str, MemoryReport]:
    """Per table: bytes PER DEVICE and on the host, known before anything is allocated."""

  @abc.abstractmethod
  def tables(self, state: PyTree) -> dict[str, np.ndarray]:
    """The logical f32[N, D] tables (tests and export; O(N), never called by the trainer)."""

  def device_bytes(self) -> int:
    """The most bytes any one device holds for the whole group. The per-table figures of
    `memory` add up to it unless tables live on different devices (`sharded`)."""
    return sum(m.device_bytes for m in self.memory().values())

  def num_params(self) -> dict[str, int]:
    """Trainable floats per table (rows x dim; fewer for compressed backends)."""
    return {n: s.num_rows * s.dim for n, s in self.specs.items()}

  # Checkpoints hold each table in a LOGICAL form that does not depend on the placement, so
  # a run saved on one mesh (or backend) resumes on another: "rows" = {"rows": f32[S, D],
  # slot: f32[S] per optimizer slot}, S = aligned_rows(N), the padding rows zero. Compressed
  # backends have their own format (TT: its cores), restorable only into the same backend.

  @abc.abstractmethod
  def logical_format(self, table: str) -> str:
    """The checkpoint format of a table ("rows", or the backend's own)."""

  @abc.abstractmethod
  def export(self, state: PyTree) -> dict[str, dict[str, jax.Array]]:
    """{table: logical arrays} of a synced state (no table-sized gather: the arrays keep
    the state's placement)."""

  @abc.abstractmethod
  def logical_target(self) -> dict[str, dict[str, jax.ShapeDtypeStruct]]:
    """Shapes, dtypes and shardings ON THIS MESH to restore each table's logical form into."""

  @abc.abstractmethod
  def import_(self, logical: dict[str, dict[str, jax.Array]]) -> PyTree:
    """The state holding `logical` (as placed by `logical_target`); resets host bookkeeping."""

  def sync(self, state: PyTree) -> PyTree:
    """Write caches back so that `state` alone describes the tables. Batches already
    prepared (up to PREFETCH ahead of the step) must stay valid."""
    return state

  def restore(self, state: PyTree) -> PyTree:
    """Called with a state read from a checkpoint; backends with host bookkeeping reset it."""
    return state

  def stats(self) -> dict[str, float]:
    """Counters since the last call ('table/key' or 'key'), logged with the metrics."""
    return {}

  def extras(self, state: PyTree) -> dict:
    """Small group state outside the tables (e.g. a codec's adaptive bounds), JSON-able:
    saved in the checkpoint's metadata and given back to `restore_extras` on resume."""
    del state
    return {}

  def restore_extras(self, state: PyTree, extras: dict) -> PyTree:
    """The state (as `import_` built it) with saved `extras`; ignore extras that do not fit."""
    del extras
    return state

  def report(self, state: PyTree) -> dict[str, float]:
    """Figures read from the state at the end of a run (written to results.json)."""
    del state
    return {}

  # With many processes, each process may read and prepare only its own slice of every batch
  # (the examples of its devices). That needs a `prepare` that works example by example:
  # every prepared leaf batch-major, nothing planned over the whole batch.

  def process_local_refusal(self) -> str | None:
    """None if `prepare` can run on one process's slice of each batch, else why not."""
    return f"{self.name}'s prepare plans over the whole batch"

  def set_process_local(self) -> None:
    """Switch `prepare` to per-process slices (only if `process_local_refusal()` is None)."""
    if (why := self.process_local_refusal()) is not None:
      raise ValueError(f"backend {self.text!r} cannot read process-local batches: {why}")
    self.process_local = True

  #: Set by `set_process_local`: prepare sees only this process's slice of each batch.
  process_local: bool = False


class TableBackend(abc.ABC):
  """One table of a `TableGroup`: the per-table half of the contract (v1, unpooled).

  prepare(ids, upcoming)       host: int[B, L] ids (-1 = padding) -> numpy pytree
  lookup(state, prepared)      jit-able: -> f32[B, L, D]; padded positions are 0
  update(state, prepared, g)   jit-able: g = d loss / d lookup, f32[B, L, D]; sparse, donated
  sync / restore / memory / table / stats as in `Backend`, for this table.

  On a mesh a table is replicated unless its backend says otherwise: the lookup gathers the
  local examples' rows; the update gathers the batch's (ids, pooled grads) from every device
  (B x D floats, never a table-sized all-reduce) and every replica applies the same sparse
  update. `lookup_pooled` / `update_pooled` are where a backend places rows otherwise
  (`dense(shard=rows)`).
  """

  name: ClassVar[str] = ""
  lookahead: int = 0
  #: Prepared keys whose leaves are batch-major (axis 0 = the batch); the rest are global.
  batch_major: ClassVar[tuple[str, ...]] = ("ids", "inverse")

  def __init__(self, spec: TableSpec, **options):
    if options:
      raise ValueError(
        f"Backend {self.name!r} (table {spec.name!r}) takes no options; got {sorted(options)}"
      )
    self.spec = spec
    self.mesh: jax.sharding.Mesh | None = None

  def __repr__(self):
    return f"{type(self).__name__}({self.spec.name}, {self.describe()})"

  def describe(self) -> str:
    return self.name

  def bind(self, mesh: jax.sharding.Mesh) -> None:
    """Place the table on `mesh`. Refuse (ValueError, before allocating) a mesh or an option
    this backend cannot honour there."""
    self.mesh = mesh

  def replicated(self, memory_kind: str | None = None) -> jax.sharding.NamedSharding:
    return jax.sharding.NamedSharding(self.mesh, sharding.REPLICATED, memory_kind=memory_kind)

  @abc.abstractmethod
  def init(self, key: jax.Array) -> PyTree:
    """Allocate and initialise the state on `self.mesh`."""

  @abc.abstractmethod
  def state_sharding(self) -> PyTree:
    """NamedShardings of the state on `self.mesh` (a pytree matching `init`'s)."""

  def prepare(
    self, ids: np.ndarray, upcoming: Sequence[np.ndarray] = (), *, train: bool = True
  ) -> PyTree:
    del upcoming, train
    ids = np.asarray(ids)
    pad = self.pad_id
    out = {"ids": np.where(ids < 0, pad, ids).astype(np.int32)}
    # A process-local slice is not the batch: the update dedups the gathered ids on device.
    if self.spec.optimizer.needs_unique and not self.process_local:
      out["unique"], out["inverse"] = dedup(ids, pad)
    return out

  #: See `Backend.process_local_refusal`. The default `prepare` above is per example once
  #: the dedup moves to the device; backends with plans (caches, prefix trees) refuse.
  process_local: bool = False

  def process_local_refusal(self) -> str | None:
    if type(self).prepare is not TableBackend.prepare:
      # A backend with its own prepare plans over the batch (a cache, prefix trees) unless
      # it says otherwise by overriding this method.
      return "its prepare plans over the whole batch (cache / prefix plans)"
    return None

  @property
  def pad_id(self) -> int:
    """What `prepare` maps padding ids to: an index past the row array (gathers fill zeros,
    scatters drop it). Backends whose arrays have padding rows past N override it."""
    return self.spec.num_rows

  @abc.abstractmethod
  def lookup(self, state: PyTree, prepared: PyTree) -> jax.Array:
    """-> float32[B, L, D]; rows of padded positions are 0. Jit-able."""

  @abc.abstractmethod
  def update(self, state: PyTree, prepared: PyTree, grads: jax.Array) -> PyTree:
    """Apply the optimizer to touched rows: grads float32[B, L, D]. Jit-able, sparse."""

  def lookup_pooled(self, state, prepared, count: jax.Array | None) -> jax.Array:
    """-> f32[B, D]: `lookup` pooled (count: int32[B] ids per bag for mean pooling)."""
    return pool_rows(self.lookup(state, prepared), count)

  def update_pooled(self, state, prepared, g: jax.Array, count: jax.Array | None) -> PyTree:
    """g f32[B, D] (batch-split on a mesh): gather it and the prepared batch on every device
    (B x (D + L) values per table), unpool, and apply the same sparse update everywhere."""
    g, prepared, count = sharding.replicate((g, prepared, count), self.mesh)
    return self.update(state, prepared, unpool(g, count, prepared["ids"].shape[1]))

  def sync(self, state: PyTree) -> PyTree:
    return state

  def restore(self, state: PyTree) -> PyTree:
    return state

  def num_params(self) -> int:
    return self.spec.num_rows * self.spec.dim

  @abc.abstractmethod
  def memory(self) -> MemoryReport:
    """Bytes PER DEVICE and on the host, without allocating."""

  @abc.abstractmethod
  def table(self, state: PyTree) -> np.ndarray:
    """The logical table float32[N, D] (tests and export only; O(N))."""

  def stats(self) -> dict[str, float]:
    return {}

  #: Checkpoint format (see `Backend.export`): "rows" backends restore from one another.
  logical_format: ClassVar[str] = "rows"

  def row_sharding(self) -> tuple[jax.sharding.Sharding, jax.sharding.Sharding]:
    """(rows f32[S, D], slots f32[S]) shardings of the logical form on this mesh."""
    return self.replicated(), self.replicated()

  def logical_target(self) -> dict[str, jax.ShapeDtypeStruct]:
    """Restore target of the "rows" form (override with `logical_format`)."""
    s, d = aligned_rows(self.spec.num_rows), self.spec.dim
    rows, vec = self.row_sharding()
    out = {"rows": jax.ShapeDtypeStruct((s, d), jnp.float32, sharding=rows)}
    for k in self.spec.optimizer.slot_names():
      out[k] = jax.ShapeDtypeStruct((s,), jnp.float32, sharding=vec)
    return out

  def export(self, state: PyTree) -> dict[str, jax.Array]:
    """The logical form of a synced state (`Backend.export`)."""
    raise NotImplementedError(f"{type(self).__name__} cannot be checkpointed (export)")

  def import_(self, logical: dict[str, jax.Array]) -> PyTree:
    """The state holding a logical form placed as `logical_target` says."""
    raise NotImplementedError(f"{type(self).__name__} cannot be restored (import_)")


def pool_rows(rows: jax.Array, count: jax.Array | None) -> jax.Array:
  """rows f32[B, L, D] (0 at padding) -> f32[B, D]: sum, or mean when `count` is given."""
  summed = jnp.sum(rows, axis=1)
  if count is None:
    return summed
  return summed / jnp.maximum(count, 1).astype(summed.dtype)[:, None]


class TableGroup(Backend):
  """A group of independent per-table backends (dense, tt, offload) under contract v2.

  prepared = {table: {"rows": the table backend's prepared, "count": int32[B] (mean pooling)}}
  state    = {table: the table backend's state}
  """

  def __init__(self, cls, specs, mesh, text: str = "", **options):
    super().__init__(specs, mesh, text)
    self.name = cls.name
    self.members: dict[str, TableBackend] = {}
    for spec in specs:
      try:
        member = cls(spec, **options)
      except TypeError as e:
        raise ValueError(f"Bad options for backend {text!r} (table {spec.name!r}): {e}") from None
      member.bind(mesh)
      self.members[spec.name] = member
    self.lookahead = max([m.lookahead for m in self.members.values()] + [0])

  def describe(self, table=None):
    if table is not None:
      return self.members[table].describe()
    return self.members[next(iter(self.members))].describe() if self.members else self.text

  def init(self, key):
    state = {n: m.init(table_key(key, n)) for n, m in self.members.items()}
    return sharding.put(state, self.state_sharding())

  def state_sharding(self):
    return {n: m.state_sharding() for n, m in self.members.items()}

  def prepare(self, ids, upcoming=(), *, train=True):
    out = {}
    for n, m in self.members.items():
      x = np.asarray(ids[n])
      p = {"rows": m.prepare(x, [u[n] for u in upcoming[: m.lookahead]], train=train)}
      if m.spec.pooling == "mean":
        p["count"] = np.sum(x >= 0, axis=1).astype(np.int32)
      out[n] = p
    return out

  def prepared_spec(self, prepared):
    out = {}
    for n, p in prepared.items():
      batch = sharding.BATCH_SPEC if self.shard_batch else sharding.REPLICATED
      keys = self.members[n].batch_major if self.shard_batch else ()
      rows = {
        k: jax.tree.map(lambda _, s=(batch if k in keys else sharding.REPLICATED): s, v)
        for k, v in p["rows"].items()
      }
      out[n] = {"rows": rows, **({"count": batch} if "count" in p else {})}
    return out

  def lookup(self, state, prepared):
    return {
      n: m.lookup_pooled(state[n], prepared[n]["rows"], prepared[n].get("count"))
      for n, m in self.members.items()
    }

  def update(self, state, prepared, grads):
    return {
      n: m.update_pooled(state[n], prepared[n]["rows"], grads[n], prepared[n].get("count"))
      for n, m in self.members.items()
    }

  def memory(self):
    return {n: m.memory() for n, m in self.members.items()}

  def num_params(self):
    return {n: m.num_params() for n, m in self.members.items()}

  def tables(self, state):
    return {n: m.table(state[n]) for n, m in self.members.items()}

  def sync(self, state):
    return {n: m.sync(state[n]) for n, m in self.members.items()}

  def restore(self, state):
    return {n: m.restore(state[n]) for n, m in self.members.items()}

  def process_local_refusal(self):
    for n, m in self.members.items():
      if (why := m.process_local_refusal()) is not None:
        return f"table {n!r} ({m.describe()}): {why}"
    return None

  def set_process_local(self):
    super().set_process_local()
    for m in self.members.values():
      m.process_local = True

  def logical_format(self, table):
    return self.members[table].logical_format

  def export(self, state):
    return {n: m.export(state[n]) for n, m in self.members.items()}

  def logical_target(self):
    return {n: m.logical_target() for n, m in self.members.items()}

  def import_(self, logical):
    return {n: m.import_(logical[n]) for n, m in self.members.items()}

  def stats(self):
    out = {}
    for n, m in self.members.items():
      out.update({f"{n}/{k}": v for k, v in m.stats().items()})
    return out


def sparse_sgd_or_adagrad(
  spec: TableSpec,
  table: jax.Array,
  slots: dict[str, jax.Array],
  prepared: PyTree,
  grads: jax.Array,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The row-wise update shared by backends that keep rows in an indexable array.

  Args:
    table: float32[R, D] (a full table or a cache; R rows).
    slots: per-row optimizer state, float32[R] each.
    prepared: {"ids": int32[B, L] in [0, R], R = padding} and, when the optimizer needs it,
      {"unique": int32[B*L], "inverse": int32[B, L]} (see `dedup`; without them, with
      process-local input, the ids are deduped here on device).
    grads: float32[B, L, D].
  Returns:
    the new (table, slots), touching only the batch's rows.
  """
  opt = spec.optimizer
  if not opt.needs_unique:
    # Scatter-add sums a row's duplicates, which is exactly SGD on the summed gradient.
    ids = prepared["ids"].reshape(-1)
    g = grads.reshape(-1, grads.shape[-1])
    return table.at[ids].add(-opt.learning_rate * g, mode="drop"), slots
  if "unique" in prepared:
    unique, inverse = prepared["unique"], prepared["inverse"]
  else:  # process-local input: the batch's ids were gathered on device (`update_pooled`)
    unique, inverse = device_dedup(prepared["ids"], table.shape[0])
  g = segment_rows(grads, inverse, unique.shape[0])
  rows = table.at[unique].get(mode="fill", fill_value=0.0)
  old = {k: v.at[unique].get(mode="fill", fill_value=0.0) for k, v in slots.items()}
  rows, new = opt.apply(rows, old, g)
  table = table.at[unique].set(rows, mode="drop")
  slots = {k: slots[k].at[unique].set(new[k], mode="drop") for k in slots}
  return table, slots


# ----------------------------------------------------------------------------- plan


_BACKEND_RE = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(?:\((.*)\))?\s*$", re.S)


def available_backends() -> list[str]:
  """Backend names: the modules of this package that export BACKEND."""
  import recgnn.embeddings as pkg

  return sorted(m.name for m in pkgutil.iter_modules(pkg.__path__) if m.name not in _NOT_BACKENDS)


def parse_backend(text: str) -> tuple[str, dict[str, Any]]:
  """'tt(rank=32, policy=lru)' -> ('tt', {'rank': 32, 'policy': 'lru'}).

  Option values are Python literals; bare words are strings. `_` separators allowed in ints.
  """
  m = _BACKEND_RE.match(text)
  if not m:
    raise ValueError(f"Cannot parse backend {text!r}; expected NAME or NAME(key=value, ...)")
  name, args = m.group(1), (m.group(2) or "").strip()
  options: dict[str, Any] = {}
  if args:
    try:
      call = ast.parse(f"f({args})", mode="eval").body
    except SyntaxError as e:
      raise ValueError(f"Cannot parse options of backend {text!r}: {e.msg}") from None
    if call.args:
      raise ValueError(f"Backend {text!r}: options must be key=value")
    for kw in call.keywords:
      v = kw.value
      options[kw.arg] = v.id if isinstance(v, ast.Name) else ast.literal_eval(v)
  return name, options


def default_mesh() -> jax.sharding.Mesh:
  """The 1 x 1 mesh on the first device (tests, benchmarks and tools without a config)."""
  return sharding.make_mesh(1, 1)


def make_group(
  text: str, specs: Sequence[TableSpec], mesh: jax.sharding.Mesh | None = None
) -> Backend:
  """Instantiate the backend named by a plan string for a group of tables on `mesh`."""
  name, options = parse_backend(text)
  names = available_backends()
  if name not in names:
    raise ValueError(f"Unknown backend {name!r}; available: {', '.join(names)}")
  module = importlib.import_module(f"recgnn.embeddings.{name}")
  mesh = default_mesh() if mesh is None else mesh
  cls = module.BACKEND
  if isinstance(cls, type) and issubclass(cls, TableBackend):
    return TableGroup(cls, specs, mesh, text, **options)
  try:
    return cls(specs, mesh, text=text, **options)
  except TypeError as e:
    raise ValueError(f"Bad options for backend {text!r}: {e}") from None


def make_backend(text: str, spec: TableSpec, mesh: jax.sharding.Mesh | None = None) -> Backend:
  """The backend of one table (a group of one)."""
  return make_group(text, [spec], mesh)


@dataclasses.dataclass
class Plan:
  """Every table's backend: groups keyed by a state key, and each table's group."""

  groups: dict[str, Backend]
  table_group: dict[str, str]
  mesh: jax.sharding.Mesh

  def backend_of(self, table: str) -> Backend:
    return self.groups[self.table_group[table]]

  @property
  def specs(self) -> dict[str, TableSpec]:
    return {n: g.specs[n] for n, g in ((t, self.backend_of(t)) for t in self.table_group)}

  @property
  def lookahead(self) -> int:
    return max([g.lookahead for g in self.groups.values()] + [0])


def resolve_plan(
  rules: Sequence[tuple[str, str]],
  specs: Sequence[TableSpec],
  mesh: jax.sharding.Mesh | None = None,
  log: bool = True,
) -> Plan:
  """Pick each table's backend (the first rule whose regex fully matches its name) and build
  one backend instance per distinct backend string."""
  compiled = []
  for pattern, text in rules:
    try:
      compiled.append((re.compile(pattern), text))
    except re.error as e:
      raise ValueError(f"Bad plan regex {pattern!r}: {e}") from None
  by_text: dict[str, list[TableSpec]] = {}
  for spec in specs:
    for rx, text in compiled:
      if rx.fullmatch(spec.name):
        by_text.setdefault(" ".join(text.split()), []).append(spec)
        break
    else:
      raise ValueError(
        f"No plan rule matches table {spec.name!r}; rules: {[p for p, _ in rules]}. "
        "End the plan with ('.*', 'dense') to give every table a default."
      )
  mesh = default_mesh() if mesh is None else mesh
  groups: dict[str, Backend] = {}
  table_group: dict[str, str] = {}
  for text, members in by_text.items():
    group = make_group(text, members, mesh)
    key = group.name or parse_backend(text)[0]
    i = 1
    while key in groups:
      key, i = f"{group.name}_{i}", i + 1
    groups[key] = group
    table_group.update({s.name: key for s in members})
  # Tables in the task's order (the state and the printed plan follow it).
  table_group = {s.name: table_group[s.name] for s in specs}
  plan = Plan(groups, table_group, mesh)
  if log:
    logging.info("Embedding plan:\n%s", format_plan(plan))
  return plan


def format_plan(plan: Plan) -> str:
  """A table of each table's backend, bytes per device and on the host."""
  d, m = sharding.mesh_shape(plan.mesh)
  lines = [
    f"mesh {sharding.describe(plan.mesh)}",
    f"{'table':<12} {'rows':>12} {'dim':>4} {'backend':<40} {'per device':>10} {'host':>10}",
  ]
  dev = host = params = dense = 0
  for name in plan.table_group:
    g = plan.backend_of(name)
    spec, mem = g.specs[name], g.memory()[name]
    dev, host = dev + mem.device_bytes, host + mem.host_bytes
    params += g.num_params()[name]
    dense += spec.num_rows * spec.dim
    lines.append(
      f"{name:<12} {spec.num_rows:>12,} {spec.dim:>4} {g.describe(name):<40} "
      f"{_mib(mem.device_bytes):>10} {_mib(mem.host_bytes):>10}"
    )
  dev = sum(g.device_bytes() for g in plan.groups.values())
  lines.append(f"{'total':<12} {'':>12} {'':>4} {'':<40} {_mib(dev):>10} {_mib(host):>10}")
  if params:
    lines.append(
      f"embedding parameters: {params:,} ({dense / params:,.1f}x fewer than all-dense {dense:,})"
    )
  return "\n".join(lines)


def _mib(n: int) -> str:
  return f"{n / 2**20:,.1f}M"


class PlanDoesNotFit(ValueError):
  """The plan needs more device memory than the budget allows."""


def check_memory(plan: Plan, device_budget_bytes: int | None) -> int:
  """Refuse, before allocating, a plan whose bytes on one device exceed the budget (per
  device). Returns the plan's bytes per device."""
  per_table = {n: (g, g.memory()[n]) for n in plan.table_group for g in [plan.backend_of(n)]}
  total = sum(g.device_bytes() for g in plan.groups.values())
  if device_budget_bytes is not None and total > device_budget_bytes:
    worst = sorted(per_table.items(), key=lambda kv: -kv[1][1].device_bytes)[:5]
    raise PlanDoesNotFit(
      f"Embedding plan needs {_mib(total)} per device on mesh {sharding.describe(plan.mesh)}, "
      f"budget is {_mib(device_budget_bytes)} per device. Largest tables: "
      + ", ".join(f"{n} {_mib(m.device_bytes)} ({g.describe(n)})" for n, (g, m) in worst)
      + ". Split large tables over the devices ('dense(shard=rows)' with --config.mesh.model=N)"
      " or move them to host memory or a compressed backend in config.embeddings.plan, e.g. "
      "('C(3|4|10)', 'offload(cache_rows=100_000)') or 'tt(rank=32)'."
    )
  return total
