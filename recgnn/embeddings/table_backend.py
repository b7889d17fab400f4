"""The per-table half of the backend contract (`TableBackend`, contract v1, unpooled rows):
one table of a `recgnn.embeddings.group.TableGroup`, which makes a group of them a contract
`Backend` (`recgnn.embeddings.contract`).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from recgnn import sharding
from recgnn.embeddings.backend_options import BackendOptions, parse_options
from recgnn.embeddings.contract import AutoContext, Backend, Capabilities, Layout, PyTree
from recgnn.embeddings.kernels import dedup, pool_rows, unpool
from recgnn.embeddings.specs import MemoryReport, TableSpec, aligned_rows


class TableBackend(abc.ABC):
  """One table of a `TableGroup`: the per-table half of the contract (v1, unpooled).

  The core a per-table backend implements:
  __init__(spec, mesh, layout, **options)   everything at construction, as for `Backend`
  init(key) / state_sharding() the state and its placement
  lookup(state, prepared)      jit-able: -> f32[B, L, D]; padded positions are 0
  update(state, prepared, g)   jit-able: g = d loss / d lookup, f32[B, L, D]; sparse, donated
  memory() / table(state)      bytes before allocating; the logical f32[N, D] rows (O(N))
  with defaults:
  prepare(ids, upcoming)       host: int[B, L] ids (-1 = padding) -> {"ids", and for per-row
                               optimizer state "unique", "inverse"} (`dedup`)
  export / import_             the "rows" checkpoint from `table` and `slots` (the state's
                               slot arrays under their names) and back through `from_rows`
                               (default {"table": rows, **slots}): checkpoints, resume and
                               resharding with no more code
  sync / restore / stats       as in `Backend`, for this table.

  On a mesh a table is replicated unless its backend says otherwise: the lookup gathers the
  local examples' rows; the update gathers the batch's (ids, pooled grads) from every device
  (B x D floats, never a table-sized all-reduce) and every replica applies the same sparse
  update. `lookup_pooled` / `update_pooled` are where a backend places rows otherwise
  (`dense(shard=rows)`). The optional protocols (recgnn.embeddings.protocols) belong to the
  group: a per-table backend that needs one gives its tables a group class (`group_class`).
  """

  name: ClassVar[str] = ""
  #: See `Backend.Options`.
  Options: ClassVar[type[BackendOptions] | None] = None
  #: The default `prepare` is per example (its dedup moves to the device with process-local
  #: input); a backend whose prepare plans over the batch (a cache, prefix trees) declares
  #: `plans_globally`.
  capabilities: ClassVar[Capabilities] = Capabilities()
  lookahead: int = 0
  #: Prepared keys whose leaves are batch-major (axis 0 = the batch); the rest are global.
  batch_major: ClassVar[tuple[str, ...]] = ("ids", "inverse")

  def __init__(
    self, spec: TableSpec, mesh: jax.sharding.Mesh, layout: Layout | None = None, **options
  ):
    """Place the table on `mesh`. Refuse (ValueError, before allocating) a mesh or an option
    this backend cannot honour there: the options through `Options.parse` (`self.options`),
    what depends on the table or the mesh in the subclass's constructor."""
    self.options = parse_options(type(self), options, f"{self.name!r} (table {spec.name!r})")
    self.spec = spec
    self.mesh = mesh
    self.layout = Layout() if layout is None else layout

  @classmethod
  def group_class(cls, specs: Sequence[TableSpec], options: dict[str, Any]) -> type | None:
    """The group class for these tables and plan options (a `TableGroup` subclass, e.g.
    `dense`'s fused tables), or None: `TableGroup`."""
    return None

  @classmethod
  def capabilities_for(cls, options: dict[str, Any]) -> Capabilities:
    """See `Backend.capabilities_for`."""
    del options
    return cls.capabilities

  @classmethod
  def auto_candidates(cls, spec: TableSpec, context: AutoContext) -> list[str]:
    """See `Backend.auto_candidates` (the AutoCandidates protocol). Default: none."""
    del spec, context
    return []

  process_local = Backend.process_local

  def __repr__(self):
    return f"{type(self).__name__}({self.spec.name}, {self.describe()})"

  def describe(self) -> str:
    return self.name

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
    if self.dedup_on_host:
      out["unique"], out["inverse"] = dedup(ids, pad)
    return out

  @property
  def dedup_on_host(self) -> bool:
    """`prepare` dedups the batch's ids (unique / inverse) for the update's per-row optimizer
    state; False: none is needed (SGD), or the update dedups on device (a process-local slice
    is not the batch; `dense(dedup=device)`)."""
    return self.spec.optimizer.needs_unique and not self.process_local and not self.ids_on_device

  @property
  def ids_on_device(self) -> bool:
    """The step gets this table's ids from the device feed (`Layout.ids_on_device`, and the
    backend `prepares_on_device`): `prepare_on_device` runs, `prepare` never does."""
    return self.layout.ids_on_device and self.capabilities.prepares_on_device

  def prepare_on_device(self, ids: jax.Array) -> PyTree:
    """Inside the step (`Capabilities.prepares_on_device`): ids int32[B, L] -> what `prepare`
    makes of them without a host dedup (`dedup_on_host` is False with `Layout.ids_on_device`):
    padding mapped to `pad_id`. A backend whose `prepare` is its own overrides both."""
    return {"ids": jnp.where(ids < 0, self.pad_id, ids).astype(jnp.int32)}

  def prepares_by_default(self) -> bool:
    """`prepare` makes the default's arrays (padding mapped, the dedup where `dedup_on_host`),
    or passes the ids through for a step that maps them itself: nothing a device could not
    do. A `TableGroup` prepares such members that dedup on the host together, in one pass
    (`kernels.StackedDedup`); data-parallel GraphSAGE prepares them on the device."""
    return type(self).prepare is TableBackend.prepare

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

  def lookup_pooled(self, state, prepared, count: jax.Array | None) -> tuple[jax.Array, PyTree]:
    """-> (f32[B, D]: `lookup` pooled, residuals for `update_pooled`; `()` here). count:
    int32[B] ids per bag for mean pooling, None for sum pooling."""
    return pool_rows(self.lookup(state, prepared), count), ()

  def update_pooled(
    self, state, prepared, residuals: PyTree, g: jax.Array, count: jax.Array | None
  ) -> PyTree:
    """g f32[B, D] (batch-split on a mesh): gather it and the prepared batch on every device
    (B x (D + L) values per table), unpool, and apply the same sparse update everywhere."""
    del residuals
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

  # The default "rows" checkpoint, from the table view: a backend that implements `table`
  # (and keeps its optimizer slots under their names, or overrides `slots`) and can build its
  # state from rows (`from_rows`) checkpoints, resumes and reshards with no more code.

  def slots(self, state: PyTree) -> dict[str, np.ndarray]:
    """The optimizer's per-row state {slot: f32[N]} on the host (O(N)). Default: the first N
    entries of `state[slot]` for each of `spec.optimizer.slot_names()`."""
    n = self.spec.num_rows
    return {
      k: np.asarray(jax.device_get(state[k]), np.float32)[:n]
      for k in self.spec.optimizer.slot_names()
    }

  def from_rows(self, rows: np.ndarray, slots: dict[str, np.ndarray]) -> PyTree:
    """The state holding rows f32[N, D] and slots {slot: f32[N]} (the inverse of `table` and
    `slots`), placed as `state_sharding()` says. Default: {"table": rows, **slots}."""
    return sharding.put({"table": rows, **slots}, self.state_sharding())

  def export(self, state: PyTree) -> dict[str, jax.Array]:
    """The logical "rows" form of a synced state (`Backend.export`): {"rows": f32[S, D],
    slot: f32[S]}, S = aligned_rows(N), the padding rows zero and their slots the optimizer's
    initial value (as every backend's), placed as `logical_target`
    says. Default: from `table` and `slots`, through the host (O(N) host memory: a table
    every process can read whole); a backend whose state already is that form (`dense`) or
    that places rows itself overrides it."""
    n, s = self.spec.num_rows, aligned_rows(self.spec.num_rows)
    rows = np.zeros((s, self.spec.dim), np.float32)
    rows[:n] = self.table(state)
    out = {"rows": rows}
    for k, v in self.slots(state).items():
      out[k] = np.full((s,), self.spec.optimizer.initial_accumulator, np.float32)
      out[k][:n] = v
    target = self.logical_target()
    return sharding.put(out, {k: target[k].sharding for k in out})

  def import_(self, logical: dict[str, jax.Array]) -> PyTree:
    """The state holding a logical form placed as `logical_target` says. Default: its first
    N rows and slot entries handed to `from_rows`."""
    n = self.spec.num_rows
    host = {k: np.asarray(jax.device_get(v), np.float32)[:n] for k, v in logical.items()}
    rows = host.pop("rows")
    return self.from_rows(rows, {k: host[k] for k in self.spec.optimizer.slot_names()})
