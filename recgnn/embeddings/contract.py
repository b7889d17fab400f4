"""The backend contract (v3): what the trainer asks of a backend, and what it tells one.

The core, which every backend implements (`Backend`'s abstract methods):

  Backend(specs, mesh, layout, text, **options)   one instance per GROUP of tables (every
                               table the plan gives the same backend string); everything given
                               here, nothing set afterwards; the options parsed into the
                               backend's frozen `Options` dataclass (`BackendOptions.parse`)
  capabilities                 declared (`Capabilities`), read before anything is built
  init(key) / state_sharding()
  prepare(ids, upcoming, *, train)   host, input thread: {table: int[B, L]} (-1 = padding)
                               -> numpy pytree; `prepared_spec` says which leaves are
                               batch-major (split over the devices with the batch)
  lookup(state, prepared)      jit-able -> ({table: f32[B, D]} POOLED, residuals)
  update(state, prepared, residuals, g)   jit-able, g = d loss / d pooled {table: f32[B, D]};
                               sparse (O(B * L * D), never O(rows)), state donated
  memory() per device / tables(state) / logical_format / export / logical_target / import_
  (defaults: sync / restore / stats / extras / restore_extras / report)

The optional protocols, each declared and grouped below the core in `Backend` (no-op
defaults of what the trainer calls on every group; `recgnn.embeddings.protocols` lists them
and refuses a backend that declares one without its methods):

  HostTier             Capabilities.writes_host     after_update, stack_call, batch_memory,
                                                    expect_batches, splits_prepare,
                                                    prepare_ahead
  DevicePrepare        Capabilities.prepares_on_device  prepare_on_device (raises by default)
  Replanning           Capabilities.replans_shapes  replan
  MicroBatching        Capabilities.splits_batch    micro_batches, lookup_micro (no default)
  StreamedCheckpoints  reads_streams() -> True      reads_streams
  AutoCandidates       overriding the classmethod   auto_candidates(spec, AutoContext)
  RowReset             Capabilities.resets_rows     reset_rows (raises by default),
                                                    place_resets

Pooled in, pooled out: a model-parallel backend moves [B, D] blocks, never [B, L, D]. The
lookup sits outside `value_and_grad`; `update` gets d loss / d pooled, so a backward
all-to-all (and a codec on it) lives in `update`, with no custom_vjp. `residuals` carry what
`lookup` computed into `update` (see docs/architecture.md).

Backends whose tables are independent (dense, tt, offload) implement the per-table
`recgnn.embeddings.table_backend.TableBackend` (unpooled rows; its core: init,
state_sharding, lookup, update, memory, table, with a default prepare and a default "rows"
checkpoint from `table`) and are grouped by `recgnn.embeddings.group.TableGroup`.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import jax
import numpy as np

from recgnn.embeddings.backend_options import (  # noqa: F401 (the contract's names, as before)
  BackendOptions,
  parse_options,
  valid_options,
)
from recgnn.embeddings.specs import MemoryReport, TableSpec

PyTree = Any


@dataclasses.dataclass(frozen=True, kw_only=True)
class Layout:
  """How the trainer feeds a backend's `prepare` and step: decided before the plan is built
  (recgnn.train.inputs.choose_layout) and given to every backend's constructor.

  Attributes:
    split_batch: the ids' batch axis is split over every device of the mesh (B / n examples
      each); False: every device gets the whole batch (e.g. one sampled subgraph per step).
    process_local: with many processes, each reads and prepares only its own contiguous
      slice of every batch (the examples of its devices), never the whole batch.
    steps_per_call: k train batches per call of the train step (`train.steps_per_call`):
      each prepared alone, in stream order, then `Backend.stack_call` makes their leaves one
      shape, and ONE step runs the k updates in a scan. Their write-backs reach a host tier
      only after the call, so it sizes what it keeps on the device (a ring of recent
      write-backs) to cover a call.
    ids_on_device: the batch's ids exist only on the devices (the device feed,
      `recgnn.train.device_feed`): a group that declares `Capabilities.prepares_on_device`
      gets them inside the step (`Backend.prepare_on_device`), never on the host, so any
      per-batch work of its own (a dedup) runs in the step.
  """

  split_batch: bool = True
  process_local: bool = False
  steps_per_call: int = 1
  ids_on_device: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class Capabilities:
  """What a backend declares about itself, read by the trainer and the tasks before anything
  is constructed (`recgnn.planner.capabilities_of`): never found by `hasattr` or by
  matching plan strings.

  Attributes:
    needs_split_ids: the ids must be split over the devices (`Layout.split_batch`): a
      model-parallel backend routes each device's ids to their owners (sharded).
    splits_batch: the backend splits a batch into micro-batches (`lookup_micro`, see
      recgnn.embeddings.microbatch): the step then runs the loss per micro-batch (hot_cold).
    plans_globally: `prepare` plans over the global batch (a cache, prefix trees), so it
      cannot run on one process's slice (`Layout.process_local`).
    replans_shapes: the backend re-plans static shapes of its step while training (sharded's
      code widths): the trainer calls `replan(state, step)` after every step and rebuilds
      the jitted steps when it reports a change.
    writes_host: `update` returns rows for the host (TO_HOST: offload's evicted rows): whoever
      runs the step hands them to `after_update` (the trainer's step does).
    stacks_calls: (a `writes_host` backend) k > 1 train steps per call work: `stack_call`
      makes a call's prepared batches one shape, `after_update(steps=k)` takes a call's
      rows, and what the call's steps read before its write-backs reach the host stays on
      the device (`Layout.steps_per_call`). Without it such a backend is refused with k > 1.
    stateless_prepare: `prepare` reads only its arguments and what the backend was built
      with, and keeps nothing the step, a writer, `stats` or a checkpoint reads, so the
      trainer may run it in a worker process (`recgnn.train.input_worker`) on a copy of the
      backend (dense; not a cache planner, a host table, counters of what it saw).
    prepares_on_device: `prepare_on_device` makes, inside the jitted step, from the batch's
      device ids, what `prepare` would (dense, sharded): the device feed then never reads
      this group's ids on the host (`Layout.ids_on_device`).
    resets_rows: `reset_rows` puts given rows back to given values with fresh optimizer
      state inside the step, where `place_resets` placed them (dense, sharded, offload,
      hot_cold): a dynamic table (`dynamic(inner=...)`) that reuses an evicted row needs it.
    maps_ids: `prepare` maps raw ids to rows of its own (dynamic): the only kind of backend
      a table of raw ids (`TableSpec.raw_ids`) may have.
  """

  needs_split_ids: bool = False
  splits_batch: bool = False
  plans_globally: bool = False
  replans_shapes: bool = False
  writes_host: bool = False
  stacks_calls: bool = False
  stateless_prepare: bool = False
  prepares_on_device: bool = False
  resets_rows: bool = False
  maps_ids: bool = False


@dataclasses.dataclass(frozen=True)
class AutoContext:
  """What `auto(...)` tells a backend it asks for candidates (`Backend.auto_candidates`).

  Attributes:
    mesh: the run's mesh.
    fractions: the auto rule's cache / hot fractions (shares of each table).
    kinds: the built-in kinds the rule considers (`AutoOptions.kinds`).
  """

  mesh: jax.sharding.Mesh
  fractions: tuple[float, ...] = ()
  kinds: tuple[str, ...] = ()


# Key of an updated state's output for the host (`Backend.update`): the rows a host tier
# takes back, written into its host tables by its writer, off the step.
TO_HOST = "to_host"


def split_to_host(state: PyTree) -> tuple[PyTree, PyTree]:
  """(the updated state without TO_HOST, its TO_HOST output or None)."""
  if isinstance(state, dict) and TO_HOST in state:
    state = dict(state)
    return state, state.pop(TO_HOST)
  return state, None


class Backend(abc.ABC):
  """Contract v3: the storage and update rule of a GROUP of tables on a device mesh.

  A group is every table the plan gives the same backend string. A backend that fuses its
  tables (one all-to-all for all of them; a popular / non-popular split over all of an
  example's ids) implements this class directly; a backend whose tables are independent
  implements `TableBackend` and is grouped by `TableGroup`.

  Everything is given at construction (specs, mesh, `Layout`, options); nothing reconfigures
  a backend afterwards. Shapes: B = the global batch (split over every device of the mesh
  when `layout.split_batch`), L = bag length, D = the table's dim.
  """

  #: The registry name (set by `register_backend`), the first word of a plan string.
  name: ClassVar[str] = ""
  #: What the trainer must know before constructing anything (see `Capabilities`). A backend
  #: whose capabilities depend on its options overrides `capabilities_for`.
  capabilities: ClassVar[Capabilities] = Capabilities()
  #: How many upcoming batches `prepare` wants to see (cDLRM's look-ahead window).
  lookahead: int = 0
  #: The plan-string options' frozen dataclass (a `BackendOptions`); None: no options.
  Options: ClassVar[type[BackendOptions] | None] = None

  def __init__(
    self,
    specs: Sequence[TableSpec],
    mesh: jax.sharding.Mesh,
    layout: Layout | None = None,
    text: str = "",
    **options,
  ):
    self.specs = {s.name: s for s in specs}
    self.mesh = mesh
    self.layout = Layout() if layout is None else layout
    self.text = text or self.name
    #: The parsed options (an `Options` instance; None for a backend without options).
    self.options = parse_options(type(self), options, repr(self.text))

  @classmethod
  def capabilities_for(cls, options: dict[str, Any]) -> Capabilities:
    """The capabilities of this backend with these plan-string options (no construction)."""
    del options
    return cls.capabilities

  def __repr__(self):
    return f"{type(self).__name__}({', '.join(self.specs)}: {self.describe()})"

  def describe(self, table: str | None = None) -> str:
    """The backend and its options, as a plan string (per table where they differ)."""
    del table
    return self.text

  # ---- core: what every backend implements (abstract), the checkpoint's logical form
  # included; then the core's defaults (sync, restore, stats, extras, report)

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
    split over every device with the batch), sharding.REPLICATED for global ones, or
    sharding.HOST_SPEC for a leaf that only host computations read (an index list of a host
    table): the input transfer puts it in pinned host memory, replicated, so it never
    crosses the host link (to the device and back)."""

  @abc.abstractmethod
  def lookup(self, state: PyTree, prepared: PyTree) -> tuple[dict[str, jax.Array], PyTree]:
    """-> ({table: f32[B, D]} pooled with each table's pooling, residuals). Jit-able.

    residuals: what the lookup computed that `update` needs again (routed ids, rows gathered
    from host memory, prefix products), handed to `update` unchanged so nothing is computed
    twice; an empty pytree (`()`) when there is nothing to keep. Eval steps drop them (XLA
    then never computes what only they needed)."""

  @abc.abstractmethod
  def update(
    self, state: PyTree, prepared: PyTree, residuals: PyTree, grads: dict[str, jax.Array]
  ) -> PyTree:
    """grads {table: d loss / d pooled, f32[B, D]} -> new state. Jit-able, sparse (cost
    O(B * L * D), never O(rows)), state donated. `residuals`: this batch's `lookup`'s.

    A backend with rows in host memory returns what the host must take back (rows it
    evicted / updated) under the state's key TO_HOST: the train step returns it as an
    output of its own (`split_to_host`) and whoever runs the step hands it to
    `after_update` (a state never carries it into the next step)."""

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
    the state's placement), or a `streamed.StreamedTable` for a table read a chunk at a
    time (`reads_streams`)."""

  @abc.abstractmethod
  def logical_target(self) -> dict[str, dict[str, jax.ShapeDtypeStruct]]:
    """Shapes, dtypes and shardings ON THIS MESH to restore each table's logical form into."""

  @abc.abstractmethod
  def import_(self, logical: dict[str, dict[str, jax.Array]]) -> PyTree:
    """The state holding `logical` (as placed by `logical_target`); resets host bookkeeping."""

  # ---- core, with defaults

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

  @property
  def process_local(self) -> bool:
    """`prepare` sees only this process's slice of each batch (`Layout.process_local`)."""
    return self.layout.process_local

  # The optional protocols (recgnn.embeddings.protocols): no-op defaults of what the
  # trainer calls on every group. A backend opts into one by its declaration and
  # overrides these; the micro-batching protocol (`micro_batches`, `lookup_micro`) has no
  # default here: the step asks only a group that declares `splits_batch`.

  # ---- HostTier (Capabilities.writes_host): rows in host memory, a host writer

  @property
  def splits_prepare(self) -> bool:
    """Whether `prepare_ahead` leaves work to its second half (`recgnn.train.plan_ahead`)."""
    return False

  def prepare_ahead(self, ids, upcoming=(), *, train=True) -> Callable[[], PyTree]:
    """`prepare` in two halves, each called in stream order: the first now -> the second (it
    reads only what the first returned; later first halves may run meanwhile). Default: all."""
    out = self.prepare(ids, upcoming, train=train)
    return lambda: out

  def after_update(self, state: PyTree, to_host: PyTree | None = None, steps: int = 1) -> PyTree:
    """Host side, after a jitted `update` (O(1): no wait for the step): takes the step's
    TO_HOST output (from `state`, or given apart by a train step that split it off) and
    hands it to the backend's host writer. -> the state without it. steps = k > 1: the
    output of a call of k steps, every leaf stacked [k, ...] in step order. Default:
    nothing."""
    del to_host, steps
    return state

  def stack_call(self, prepared: list[PyTree]) -> list[PyTree]:
    """Host side, input thread: the k prepared train batches of one call
    (`Layout.steps_per_call`, each from its own `prepare`, in stream order) -> the same
    batches with every leaf one shape across them, so the call stacks them for one scan
    (a list sized per batch padded to the call's longest, with entries that move nothing).
    Values a step reads must not change. Default: as they are (shapes set by the batch)."""
    return prepared

  def batch_memory(self, ids_shapes: dict[str, tuple[int, ...]]) -> dict[str, int]:
    """Per table: bytes PER DEVICE the state comes to hold beyond `memory()` once it trains
    on batches whose ids are shaped ids_shapes[table] (the global train batch): buffers
    sized by the batch, not by the table (hot_cold's prefetched cold rows of the next
    batch). Known before anything is allocated, as `memory`; a table left out holds none."""
    del ids_shapes
    return {}

  def expect_batches(self, ids_shapes: dict[str, tuple[int, ...]]) -> None:
    """Told, before `init` / `import_` / `restore`, the global train batch's ids shapes (as
    `batch_memory`, which must not be empty): buffers sized by the batch are made at that
    size, so the first train step runs every later step's program (not a resize: a second
    compile). A hint: the first train batch's own shapes decide."""
    del ids_shapes

  # ---- DevicePrepare (Capabilities.prepares_on_device): prepare inside the step

  def prepare_on_device(self, ids: dict[str, jax.Array]) -> PyTree:
    """Inside the jitted step (capability `prepares_on_device` only): ids {table: int32[B, L]}
    (PAD = -1, batch-split as `prepared_spec` says) -> the pytree `prepare` makes for them
    under `Layout.ids_on_device`, as jax arrays of the same structure, shapes and dtypes."""
    raise NotImplementedError(
      f"backend {self.text!r} prepares its ids on the host (no Capabilities.prepares_on_device)"
    )

  # ---- RowReset (Capabilities.resets_rows): rows put back to new values in the step

  def reset_rows(self, state: PyTree, resets: dict[str, dict[str, jax.Array]]) -> PyTree:
    """Jit-able (capability `resets_rows` only): resets {table: {"slots": int32[R] (rows, or
    where `place_resets` put them; out of range: none), "rows": f32[R, D]}} -> the state
    with each listed slot's values set to its `rows` entry and its optimizer slots to their
    initial value. O(R * D)."""
    raise NotImplementedError(
      f"backend {self.text!r} cannot reset rows in the step (no Capabilities.resets_rows)"
    )

  def place_resets(self, prepared: PyTree, resets: dict[str, dict[str, np.ndarray]]):
    """Host side, input thread, right after `prepare` made `prepared` (numpy) for the batch
    the resets belong to: resets {table: {"slots": int32[R] rows (out of range: none),
    "rows": f32[R, D], "at": int32[R] where each row is first read in the table's ids,
    flattened}} -> (prepared, {table: {"slots", "rows"}} for `reset_rows` in this batch's
    step). A backend whose rows move between memories says here where the step holds each
    row (a device slot) or, for a row the step itself brings from the host, puts the reset
    into the rows `prepared` carries (in place). O(R). Default: the rows are the slots."""
    return prepared, {n: {"slots": r["slots"], "rows": r["rows"]} for n, r in resets.items()}

  # ---- Replanning (Capabilities.replans_shapes): static shapes re-planned

  def replan(self, state: PyTree, step: int) -> tuple[PyTree, bool]:
    """After train step `step` (capability `replans_shapes` only): (state, whether the step's
    static shapes changed, so the trainer rebuilds its jitted steps)."""
    del step
    return state, False

  # ---- StreamedCheckpoints (reads_streams() -> True): tables read a chunk at a time

  def reads_streams(self) -> bool:
    """Whether `import_` takes a `streamed.TableReader` in place of a table's arrays (and
    reads it a chunk at a time); `export` may give a `streamed.StreamedTable` (a table
    bigger than host RAM). Others get the reader's arrays, placed by `logical_target`."""
    return False

  # ---- AutoCandidates (overridden): plan strings the backend offers to auto(...)

  @classmethod
  def auto_candidates(cls, spec: TableSpec, context: AutoContext) -> list[str]:
    """Plan strings of this backend worth trying for `spec` under `auto(...)`, asked of every
    registered backend beside the planner's built-in list (`recgnn.planner.auto.candidates`).
    Default: none (the built-in backends' candidates are the planner's own list)."""
    del spec, context
    return []
