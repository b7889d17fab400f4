"""`hot_cold`: Hotline / FAE. Popular rows row-sharded over the mesh, the rest in host RAM.

Plan string: `hot_cold(budget=0.05, profile_batches=20, reprofile=0, split=True)`; options in
`HotColdOptions`. One instance per GROUP of tables: an example is popular only when ALL its
ids in the group's tables are hot (FAE's rule), so put the large tables in one hot_cold rule
and the small ones (wholly on the devices anyway) under `dense`.

Why (Adnan et al., ISCA'24 "Hotline"; FAE, VLDB'22): a few rows take most accesses. Those
rows, with their optimizer state, live in one device array per table, split by rows over every
device of the mesh (NamedSharding P(BATCH)); the long tail stays in host RAM (numpy, the
host tier shared with `offload`: recgnn.embeddings.host_tier). A batch is split into a popular
micro-batch (every id hot: computed from device memory only) and a non-popular one (some id
cold: its cold rows came with the batch), so the accelerators work on the popular examples
first.

How a batch flows (issue 42: no host computation and no host array inside the step):

  input thread, prepare(k)   counts accesses while profiling (recgnn.embeddings.access_counts);
                             maps each id to a hot slot or to the batch's list of distinct
                             cold rows: ONE list for every table of a row layout (dim,
                             optimizer), table after table, padded to a bucketed length
                             (`hot_set.Buckets` over the layout's total); READS the list's
                             rows and their optimizer state from the numpy host tables into
                             the prepared batch ("vals": they reach the devices with the
                             batch's own transfer, ahead of the step), with a ring slot per
                             row whose newest value may still be on the device ("src", below);
                             splits a train batch's examples per device into the popular and
                             the non-popular micro-batch (the popular one's size fixed per hot
                             set, the other the rest: the step compiles a few times per run,
                             not per batch; when the popular size per device rounds to 0 the
                             batch runs whole and the log says why: `micro.off_reason`);
                             when a profile completes, picks the hot set for the byte budget
                             and plans the migration (rows in / out of the hot arrays), the
                             rows joining read from the host tables too ("in_vals").
  step k, lookup             popular micro-batch: hot rows only (a masked gather on each
                             device's shard, a reduce-scatter of the rows: exact, every row
                             has one non-zero term). Non-popular: the same, plus the cold rows
                             the batch brought (the ring's value where "src" says so): the
                             residuals carry them to the update.
  step k, update             ONE sparse update for the whole batch, as `dense` applies it:
                             hot rows on their owner devices, cold rows on the batch's copy
                             (exact: the same adds in the same order as dense's). Every cold
                             row the step touched is written into the device ring ("dst") and
                             returned as the step's output for the host (contract.TO_HOST).
                             Then the migration planned with k: rows leaving the hot set read
                             off the updated hot arrays, written into the ring and returned
                             for the host; rows joining take their value from the ring (this
                             step's cold rows are in it by then: a row cold in k and hot from
                             k + 1 moves its NEW value; or an earlier write-back still in
                             flight) or from "in_vals".
  after the step             `after_update` (main thread, O(1)) hands TO_HOST to the host
                             writer thread, which copies it to the host and writes it into the
                             numpy tables in place, in step order (`host_tier.Writer`).

Ordering (exact under the trainer's run-ahead of `prepare`, PREFETCH batches): every cold row
a train step touches is written back, so "cold in batch k, cold again in k + 1, prepared
before step k ran" is the common case, not a corner. The device ring of recent write-backs
(`host_tier.Recent`, one per row layout, in the state) covers it: a load planned while its
row's write-back may be in flight reads the ring ("src"); a row whose ring entry was
overwritten since is read from the host after the writer applied the step that wrote it
(`Writer.wait`: in practice long done). The ring holds RING_BATCHES (= PREFETCH) steps' worth of
write-backs: the cold list's cap (the sum of min(ids per batch, rows) over the layout's tables)
and, with reprofile, the hot slots a re-pick may empty (not capped at the layout's rows: a
FIFO of write-backs, two steps may each write back most of a small table). The hot /
cold layout changes only by a migration that runs at the end of the update of the batch whose
`prepare` planned it, and every later batch is prepared for the new layout. `version` in the
state checks that updates run in prepare order (as `offload`); a step's write-back that does
not match what its prepare planned is refused by the writer.

The hot set: the first `profile_batches` train batches are profiled (every row cold
meanwhile); then the most accessed rows that fit the budget are migrated in. FAE samples 5 %
of the input before training: the trainer gives a backend no look at the data before it
runs, so the sample is the head of the (shuffled) stream; `use_profile` takes a profile made
elsewhere (e.g. `profile.profile_sample` over a 5 % sample) instead. `reprofile=N` re-picks
the hot set every N train batches from the accesses counted since the last pick, for drifting
popularity. A checkpoint holds the logical rows (restorable into any "rows" backend, on any
mesh) and the hot set (`extras`, the checkpoint's metadata): `restore_extras` migrates it in
after `import_` (on the host tables and the hot arrays, not by a step), so a resumed run
neither re-profiles nor starts all cold. hotline_kaggle sets `profile_batches` to a share of
an epoch of its data (train rows // batch size).

State {"tables": {table: {"hot": {"table": f32[Ha, D], slot: f32[Ha]}   rows over the mesh
                          "hot_rows": int32[Ha]}}   (the row in each hot slot; N = empty)
       "ring": per row layout {"table": f32[V, D], slot: f32[V]}   recent write-backs
       "version": int32[], "stale": int32[]}
Ha = the hot capacity rounded up to a multiple of the devices; V = the ring's rows
(`_ring_rows`; [0, ...] until the first train step sizes it from its batch's "ring" shape),
replicated as the cold rows are. The host tables (numpy, every row, aligned to
base.aligned_rows(N)) are the group's, never state and never an argument of the step; a hot
row's host copy is stale until `sync` writes it back. The ring is not checkpointed: `export`
drains the writer, so the host tables hold every cold row's value.

What moved, and why (issue 42). Before, the step gathered its cold rows from pinned-host
tables with host computations (`compute_on("device_host")`) and wrote them back with another,
and a "prefetch" read batch k + 1's rows during step k into a device buffer in the state
("next", with "from_now" / "from_hot" forwarding of rows the step updated or evicted from the
hot set). On the one GPU measured (H100) each host computation made the launch wait ~1 ms and
XLA:GPU copied every host table whole into the write-back (pinned -> pinned, O(rows) per
step). Now the reads happen in prepare (the input pipeline already ran a batch's prepare ahead
of its step, so every batch's rows are read ahead: the old prefetch is what every batch gets),
the write-back is an output applied by a host thread, and the forwarding the prefetch did
inside one step is the ring's, across the pipeline's depth. The `prefetch` option is kept
parseable as a no-op (plan strings, the planner's candidates and saved configs carry it).
tests/test_host_tier.py reads the lowered step (CPU and CUDA): no host computation, no host
memory, no table-sized tensor.

Limits, and why:
  - The budget is per table (each table's hot array holds `budget` of its rows), not FAE's one
    budget over all tables: the hot arrays' shapes are fixed at init (memory is reported
    before allocating), before any profile exists. `profile.hot_set_for_budget` makes the
    global choice within those capacities.
  - The order "popular first, cold rows meanwhile" is a data dependency, not a schedule: the
    popular micro-batch never reads a cold row (tests/test_hot_cold_tiers.py checks it on the
    step's HLO). With the cold rows an input of the step, there is nothing left to overlap
    inside it: their transfer is the batch's, issued ahead of the step.
  - The ring costs V rows (with optimizer state) of device memory on every device
    (`batch_memory`: the planner and the trainer's budget count it): with a batch of 26 x
    2048 ids and 68-byte rows, 2 x 53k rows, 7.2 MB; reprofile adds 2 x the hot slots.
    A hot set given by `use_profile` after init, without reprofile, may empty more slots in one
    step than the ring holds beyond its cold rows: a row leaving then read within the run-ahead
    is refused by the writer's check ("has not run"), not read stale.
  - The cold list moves each way whole (padding included: within ~1.1x of the cold ids, a
    few lengths per run, tests/test_hot_cold_tiers.py); every device gets it whole (it is
    replicated, as the update on it is).
  - The split is off (batches run whole, logged once per group, then a count) when the popular
    micro-batch size rounds to 0 on the device with fewest popular examples: every device
    runs the same sizes and the popular micro-batch holds popular examples only.

Files: options.py (`HotColdOptions`), hot_set.py (the row <-> slot maps, profile, pick and
migrations: `HotSetPlanning`), micro.py (the popular / non-popular split), host_side.py (the
host tier: a batch's rows read and its ring slots handed out, the writer, the ring's size,
sync / export: `HostTier`), device.py (the step's lookup, update, ring and migration:
`DeviceSteps`); this file, the `HotCold` class (placement, state, checkpoints, `prepare`),
which those three mixins complete. Shared mechanisms live in recgnn/embeddings (row_sharded,
host_tier, host_cache, access_counts, microbatch).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from recgnn import sharding
from recgnn.backends.hot_cold import hot_set
from recgnn.backends.hot_cold.device import DeviceSteps
from recgnn.backends.hot_cold.host_side import RING_BATCHES, HostTier
from recgnn.backends.hot_cold.hot_set import HotSetPlanning, TableRows, cold_cap
from recgnn.backends.hot_cold.micro import MARGIN, split
from recgnn.backends.hot_cold.options import HotColdOptions
from recgnn.embeddings import access_counts as profile
from recgnn.embeddings import base, host_cache, host_tier

P = sharding.P
ABSENT = host_tier.ABSENT
__all__ = ["MARGIN", "RING_BATCHES", "HotCold", "HotColdOptions"]


@base.register_backend("hot_cold")
class HotCold(HotSetPlanning, HostTier, DeviceSteps, base.Backend):
  """Hot rows on the devices (row-sharded), cold rows in host RAM (numpy, read by prepare and
  written by the host writer); popular / non-popular micro-batches. Options:
  `HotColdOptions`."""

  Options = HotColdOptions

  def __init__(
    self,
    specs: Sequence[base.TableSpec],
    mesh: jax.sharding.Mesh,
    layout: base.Layout | None = None,
    text: str = "",
    **options,
  ):
    super().__init__(specs, mesh, layout, text, **options)
    o = self.options
    self.capabilities = self._capabilities(o)
    n = mesh.size
    self._rows: dict[str, TableRows] = {}
    for name, spec in self.specs.items():
      cap = o.hot_rows if o.hot_rows is not None else math.ceil(o.fraction * spec.num_rows)
      cap = max(1, min(int(cap), spec.num_rows))
      self._rows[name] = TableRows(
        spec=spec,
        capacity=cap,
        alloc=-(-cap // n) * n,
        row_slot=np.full(spec.num_rows, -1, np.int32),
        slot_row=np.full(-(-cap // n) * n, -1, np.int64),
        profile=profile.AccessProfile(spec.num_rows),
      )
    self._version = 0
    self._since_pick = 0  # train batches counted since the last pick
    self._picked = False  # a hot set has been picked (initial profile done)
    self._pending: dict[str, np.ndarray] | None = None  # a hot set to migrate to
    self._p0: dict[int, int] = {}  # per-device batch size b -> popular micro-batch size
    self._counters = host_cache.Counters()
    # One cold list per stack of tables with the same row layout (dim, optimizer slots):
    # every table's cold rows in one list, one length for the stack, so the step's shape
    # follows the stack's total (which moves little) rather than every table's own. Its
    # length per stack, for train and eval batches apart (their steps are separate
    # programs): bucketed, so each takes a few shapes per run.
    self._stacks = host_tier.layouts(self.specs)
    self._stack_of = {
      n: (s, i) for s, names in enumerate(self._stacks) for i, n in enumerate(names)
    }
    self._index = {n: i for i, n in enumerate(self.specs)}  # in the host tier's arrays
    grow = hot_set.SHRINK_AFTER
    self._cold_len = {t: [hot_set.Buckets(grow) for _ in self._stacks] for t in (True, False)}
    self.cold_shapes: set[tuple[int, ...]] = set()  # the train steps' cold-list lengths seen
    owner = f"hot_cold (tables {', '.join(self.specs)})"
    self._syncer = host_cache.StaleCheck(owner, "hot / cold")
    # The host tier (recgnn.embeddings.host_tier): every row in host RAM (numpy, in `specs`
    # order), read on the input thread, written by one writer thread; per stack, the ring of
    # recent write-backs (rows numbered table after table: `_row_base`); the write-backs
    # planned for steps not yet handed over.
    self._host = host_tier.HostRows(owner)
    self._row_base = [
      np.cumsum([0] + [self.specs[n].num_rows for n in names]).astype(np.int64)
      for names in self._stacks
    ]
    self._recent: list[host_tier.Recent] = []
    self._outbox = host_tier.Outbox()
    self._written = 0  # the writer's jobs handed over before the last init / restore
    self._initialised = False
    # Every batch's cold rows are read by its own prepare (the input pipeline runs ahead of
    # the step): nothing to look ahead for.
    self.lookahead = 0
    self._off_key = self.describe()  # the split-off warning's group (`micro.OFF_LOG`)

  @classmethod
  def capabilities_for(cls, options):
    return cls._capabilities(HotColdOptions.parse(options))

  @staticmethod
  def _capabilities(o: HotColdOptions) -> base.Capabilities:
    # The hot set and the popular / non-popular split are planned over the whole batch; the
    # step returns the cold rows it updated for the host writer (TO_HOST).
    return base.Capabilities(splits_batch=o.split, plans_globally=True, writes_host=True)

  def describe(self, table=None):
    del table
    o = self.options
    size = f"hot_rows={o.hot_rows}" if o.fraction is None else f"budget={o.fraction}"
    extra = f", reprofile={o.reprofile}" if o.reprofile else ""
    extra += "" if o.split else ", split=False"
    extra += "" if o.cold_list == "bucket" else f", cold_list={o.cold_list}"
    return f"hot_cold({size}, profile_batches={o.profile_batches}{extra})"

  # --------------------------------------------------------------------------- placement

  def _hot_sharding(self):
    return (
      sharding.named(self.mesh, P(sharding.BATCH, None)),
      sharding.named(self.mesh, P(sharding.BATCH)),
    )

  def _repl(self):
    return sharding.named(self.mesh, sharding.REPLICATED)

  def state_sharding(self):
    """{"tables": {table: {"hot": rows over the mesh, "hot_rows": replicated}}, "ring": per
    stack {"table": .., slot: ..} (replicated: every device applies the same cold update),
    "version", "stale"}. The host tables are not state: numpy, in the group's host tier,
    never an argument of the step."""
    rows, vec = self._hot_sharding()
    out = {}
    for name, spec in self.specs.items():
      slots = spec.optimizer.slot_names()
      out[name] = {"hot": {"table": rows, **{s: vec for s in slots}}, "hot_rows": self._repl()}
    return {
      "tables": out,
      "ring": tuple(
        {"table": self._repl(), **{s: self._repl() for s in self._slots(names)}}
        for names in self._stacks
      ),
      "version": self._repl(),
      "stale": self._repl(),
    }

  def _slots(self, names) -> tuple[str, ...]:
    return self.specs[names[0]].optimizer.slot_names()

  def memory(self):
    out = {}
    n = self.mesh.size
    for name, r in self._rows.items():
      spec = r.spec
      device = r.alloc // n * spec.row_bytes + r.alloc * 4  # hot shard + slot map
      # Every row in host RAM (one copy, numpy; aligned as the checkpoint's logical shape
      # is), the row -> slot map, the profile. The ring is the batch's (`batch_memory`).
      host = base.aligned_rows(spec.num_rows) * spec.row_bytes + spec.num_rows * (4 + 8)
      out[name] = base.MemoryReport(device, host, f"{r.alloc} hot rows over {n} device(s) + host")
    return out

  # --------------------------------------------------------------------------- state

  def init(self, key):
    host = {}
    for name, spec in self.specs.items():
      opt = spec.optimizer
      s = base.aligned_rows(spec.num_rows)
      table = np.zeros((s, spec.dim), np.float32)
      table[: spec.num_rows] = base.init_table(base.table_key(key, name), spec)
      host[name] = {"table": table}
      host[name].update(
        {k: np.full(s, opt.initial_accumulator, np.float32) for k in opt.slot_names()}
      )
    return self._fresh(host, keep_hot_set=True)

  def _fresh(self, host: dict, keep_hot_set: bool) -> dict:
    """A state for `host` (every row, numpy: to the host tier); the hot arrays hold the
    current hot set (from `use_profile` before init) or nothing."""
    sh = self.state_sharding()
    self._host.set([host[n] for n in self.specs])
    tables = {}
    if not keep_hot_set:
      for r in self._rows.values():
        r.row_slot[:] = -1
        r.slot_row[:] = -1
      self._picked = False
    for name, r in self._rows.items():
      spec, opt = r.spec, r.spec.optimizer
      hot = {"table": np.zeros((r.alloc, spec.dim), np.float32)}
      hot.update(
        {k: np.full(r.alloc, opt.initial_accumulator, np.float32) for k in opt.slot_names()}
      )
      filled = r.slot_row >= 0
      if filled.any():  # a hot set picked before init: its rows start from the host values
        src = self._host_of(name)
        for k in hot:
          hot[k][filled] = src[k][r.slot_row[filled]]
      hot_rows = np.where(filled, r.slot_row, spec.num_rows).astype(np.int32)
      tables[name] = {
        "hot": jax.device_put(hot, sh["tables"][name]["hot"]),
        "hot_rows": jax.device_put(hot_rows, sh["tables"][name]["hot_rows"]),
      }
    self._version, self._since_pick, self._p0 = 0, 0, {}
    self._pending = None
    for r in self._rows.values():
      r.profile.reset()
    self._initialised = True
    self._adopt()
    # Two buffers: the state is donated, and one buffer donated twice is an error.
    zero = lambda: jax.device_put(np.zeros((), np.int32), self._repl())  # noqa: E731
    return {"tables": tables, "ring": self._empty_ring(), "version": zero(), "stale": zero()}

  def _empty_ring(self) -> tuple[dict, ...]:
    """The rings before the first train step: [0, ...] per stack (that step sizes them from
    its batch's "ring" shape: `_ring_rows`)."""
    out = []
    for names in self._stacks:
      d = self.specs[names[0]].dim
      b = {
        "table": np.zeros((0, d), np.float32),
        **{k: np.zeros(0, np.float32) for k in self._slots(names)},
      }
      out.append(jax.device_put(b, self._repl()))
    return tuple(out)

  def logical_format(self, table):
    return "rows"

  def logical_target(self):
    out = {}
    repl = self._repl()
    for name, spec in self.specs.items():
      s, d = base.aligned_rows(spec.num_rows), spec.dim
      t = {"rows": jax.ShapeDtypeStruct((s, d), jnp.float32, sharding=repl)}
      for k in spec.optimizer.slot_names():
        t[k] = jax.ShapeDtypeStruct((s,), jnp.float32, sharding=repl)
      out[name] = t
    return out

  def import_(self, logical):
    """Every row to the host tables (numpy, one copy: O(N) at restore only), empty hot
    arrays: the hot set is profiled again, or comes from the checkpoint (`restore_extras`)."""
    host = {}
    for n, s in self.specs.items():
      arrays = {"table": logical[n]["rows"], **{k: logical[n][k] for k in s.optimizer.slot_names()}}
      host[n] = {k: np.array(jax.device_get(v), np.float32) for k, v in arrays.items()}
    return self._fresh(host, keep_hot_set=False)

  def restore(self, state):
    """Host bookkeeping from a state of this group's run (its hot slots; the host tables are
    the group's, after every write-back handed over); the profile restarts."""
    self._check_stale(state)
    for name, r in self._rows.items():
      t = state["tables"][name]
      hot_rows = np.asarray(jax.device_get(t["hot_rows"])).astype(np.int64)
      if hot_rows.shape[0] != r.alloc:
        raise ValueError(
          f"hot_cold: the state has {hot_rows.shape[0]} hot slots for table {name!r}, this "
          f"backend {r.alloc}; restore checkpoints through export / import_ (the logical rows)"
        )
      r.slot_row = np.where(hot_rows < r.spec.num_rows, hot_rows, -1)
      r.row_slot[:] = -1
      filled = r.slot_row >= 0
      r.row_slot[r.slot_row[filled]] = np.flatnonzero(filled).astype(np.int32)
      r.profile.reset()
    self._picked = any((r.slot_row >= 0).any() for r in self._rows.values())
    self._version = int(jax.device_get(state["version"]))
    self._since_pick, self._p0, self._pending = 0, {}, None
    self._initialised = True
    self._adopt()
    return state

  def extras(self, state):
    """The hot set, saved beside the logical rows in the checkpoint's metadata: each table's
    hot rows as the state holds them (its slot map, not the input thread's bookkeeping,
    which may be ahead by a migration planned for a batch not yet run), delta-coded."""
    out = {}
    for name, t in state["tables"].items():
      rows = np.asarray(jax.device_get(t["hot_rows"])).astype(np.int64)
      out[name] = hot_set.encode_rows(np.sort(rows[rows < self.specs[name].num_rows]))
    return {"hot_set": out}

  def restore_extras(self, state, extras):
    """The saved hot set migrated into the state `import_` built (every row on the host, no
    step run since): the resumed run computes from the same hot rows at once, with no new
    profile. Done here, on the host tables and the hot arrays, not by a step. A hot set
    that does not fit this backend (another budget, other tables) is ignored: profiled
    again."""
    saved = extras.get("hot_set") or {}
    rows = {}
    for name, r in self._rows.items():
      x = hot_set.decode_rows(saved[name]) if name in saved else None
      if x is None or x.size > r.capacity or (x.size and x[-1] >= r.spec.num_rows):
        logging.info("hot_cold: the checkpoint's hot set does not fit table %r: profiling", name)
        return state
      rows[name] = x
    self._host.writer.drain()
    tables = dict(state["tables"])
    for name, r in self._rows.items():
      spec = r.spec
      m = self._migrate(r, rows[name])
      packed = self._pack_migration(name, m)
      host = self._host_of(name)
      # (the state import_ built: nothing hot yet, so nothing leaves; every row's value is
      # the host's)
      packed["in_src"] = np.full(packed["in_rows"].shape[0], ABSENT, np.int32)
      packed["in_vals"] = {k: v[packed["in_rows"]] for k, v in host.items()}
      move = jax.jit(functools.partial(self._migration, spec=spec))
      ring = {k: jnp.zeros((0,) + v.shape[1:], v.dtype) for k, v in packed["in_vals"].items()}
      tables[name], gone = move(tables[name], jax.device_put(packed, self._repl()), ring)
      if gone is not None:
        out_rows = m[3]
        values = jax.device_get(gone)
        for k, v in host.items():
          v[out_rows] = values[k][: out_rows.size]
    self._picked = bool(any(x.size for x in rows.values()))
    self._since_pick, self._p0, self._pending = 0, {}, None
    return {**state, "tables": tables}

  def _check_stale(self, state):
    self._syncer.check(state)

  # --------------------------------------------------------------------------- host side

  def _devices(self) -> int:
    """How many pieces the batch is split into (its examples per device)."""
    return self.mesh.size if self.layout.split_batch else 1

  def _count(self, **kv):
    self._counters.add(**kv)

  def prepare(self, ids, upcoming=(), *, train=True):
    """ids {table: int[B, L]} (PAD = -1) -> the prepared pytree: {"tables": {table:
    {"hot_ids": int32[B, L] (hot slot; Ha: none), "cold_ids": int32[B, L] (position in its
    stack's cold list; W: none), ..., the migration's "in_rows" / "in_slots" / "out_slots"
    and host tier's "in_src" / "in_vals" / "out_dst" (`_stage_migration`)}}, "cold": per
    stack {"off": int32[T + 1] (each table's segment of the list), "vals": {k: f32[W,
    ...]} (the list's rows read from the host tables here), "src": int32[W] (ring slots),
    train: "dst": int32[W], "ring": int32[0, V] (`_stage_cold`)}, "micro": the split
    (`micro.split`), "version": int32[]}.

    upcoming: ignored (each batch's prepare reads its own rows; kept for the contract).
    train=False (eval): read-only; neither counts toward the profile nor migrates.
    """
    del upcoming
    t0 = time.perf_counter()
    if train and not self._initialised:
      raise RuntimeError("hot_cold: call init (or import_ / restore) before prepare(train=True)")
    ids = {n: np.asarray(ids[n]).astype(np.int64) for n in self.specs}
    batch = next(iter(ids.values())).shape[0]
    n_dev = self._devices()
    if batch % n_dev:
      sharding.check_batch(batch, self.mesh)
    b = batch // n_dev
    per, example_cold = {}, np.zeros(batch, bool)
    hot_ids_total = ids_total = 0
    for name, x in ids.items():
      r = self._rows[name]
      valid = x >= 0
      slot = np.where(valid, r.row_slot[np.maximum(x, 0)], -1)
      hot = slot >= 0
      cold = valid & ~hot
      example_cold |= cold.any(axis=1)
      cold_rows, cold_pos = np.unique(x[cold], return_inverse=True)
      per[name] = (x, valid, slot, hot, cold, cold_rows, cold_pos)
      hot_ids_total += int(hot.sum())
      ids_total += int(valid.sum())
    # Each stack's list: its distinct cold rows, table after table, padded to a bucketed
    # length (`Buckets`: within 12.5 % of the need, grown at once, shrunk after a while):
    # host traffic is what the cold ids need, and the step compiles a few times per run.
    own = []  # per stack: (segments, offsets, caps, length)
    for stack, names in enumerate(self._stacks):
      segs = [per[n][5] for n in names]
      off = np.cumsum([0] + [x.size for x in segs]).astype(np.int32)
      caps = [cold_cap(per[n][0].shape, self.specs[n]) for n in names]
      # Before the first hot set (the profile) every id is cold, and the phase ends at the
      # pick: one length for it, the batch's ids (as `fixed`), not the few a sizer takes
      # over a phase of a few batches (each a compile; the pick's migration step is one).
      if self.options.cold_list == "fixed" or (train and not self._picked):
        uc = sum(caps)
        self._cold_len[train][stack].tick()  # (decision points at the same steps as others')
      else:
        uc = self._cold_len[train][stack](max(int(off[-1]), 1), sum(caps))
      own.append((segs, off, caps, uc))
    p0s = self._p0  # (the split of a batch planning a migration keeps the old hot set's)
    migrate = self._plan_profile(ids, train)
    if any(m is not None for m in migrate.values()):
      # A new hot set changes every later batch's cold rows: their lists start over (the
      # next batch's need sets the length, instead of waiting out the old hot set's).
      for s in self._cold_len[True]:
        s.reset()
    out = {"tables": {}, "cold": []}
    lengths, writes, ring_rows = [], [], 0
    for stack, names in enumerate(self._stacks):
      segs, off, caps, uc = own[stack]
      lengths.append(uc)
      for i, name in enumerate(names):
        x, valid, slot, hot, cold, cold_rows, cold_pos = per[name]
        r = self._rows[name]
        cold_ids = np.full(x.shape, uc, np.int32)  # positions in the stack's list
        cold_ids[cold] = off[i] + cold_pos
        t = {"hot_ids": np.where(hot, slot, r.alloc).astype(np.int32), "cold_ids": cold_ids}
        if r.spec.optimizer.needs_unique:
          t["hot_unique"], t["hot_inverse"] = base.dedup(np.where(hot, slot, -1), r.alloc)
        if r.spec.pooling == "mean":
          t["count"] = valid.sum(axis=1).astype(np.int32)
        t.update(self._pack_migration(name, migrate.get(name)))
        out["tables"][name] = t
      lst, w, held = self._stage(stack, segs, off, caps, uc, migrate, out["tables"], train)
      out["cold"].append(lst)
      writes.append(w)
      ring_rows += held
    out["tables"] = {n: out["tables"][n] for n in self.specs}
    out["cold"] = tuple(out["cold"])
    if train:
      self._outbox.plan(writes)
    # Eval batches run whole: the eval step has no model to split, only lookups to merge.
    micro = (
      split(p0s, out["tables"], ~example_cold, n_dev, b, self._off_key)
      if self.options.split and train
      else None
    )
    if micro is not None:
      out["micro"] = micro
    if train:
      self.cold_shapes.add(tuple(lengths))
    version = -1 if not train else self._version
    if train:
      self._version += 1
    out["version"] = np.asarray(version, np.int32)
    popular = int((~example_cold).sum())
    cold_rows_n = sum(p[5].size for p in per.values())
    cold_bytes = sum(p[5].size * self.specs[n].row_bytes for n, p in per.items())
    stats = dict(
      examples=batch,
      popular=popular,
      hot_ids=hot_ids_total,
      ids=ids_total,
      plan_seconds=time.perf_counter() - t0,
    )
    if train:
      stats.update(
        steps=1,
        rows_h2d=cold_rows_n,
        cold_list=sum(lengths),  # the rows moved each way, padding included
        rows_d2h=cold_rows_n,
        bytes_h2d=cold_bytes,
        ring_rows=ring_rows,
        migrated_rows=sum(
          int(m[1].size) + int(m[0].size) for m in migrate.values() if m is not None
        ),
      )
      if self.options.split:
        p0 = out["micro"][0]["idx"].shape[0] if micro else 0
        stats.update(micro_popular=p0, micro_cold=batch - p0)
    else:
      stats = {f"eval_{k}": v for k, v in stats.items()}
    self._count(**stats)
    return out

  _BATCH_MAJOR = ("hot_ids", "cold_ids", "hot_inverse", "count")

  def prepared_spec(self, prepared):
    batch = sharding.BATCH_SPEC if self.layout.split_batch else sharding.REPLICATED
    out = {
      "tables": {
        n: jax.tree.map(lambda _: sharding.REPLICATED, t)
        | {k: batch for k in t if k in self._BATCH_MAJOR}
        for n, t in prepared["tables"].items()
      },
      "version": sharding.REPLICATED,
      # (the cold rows read from the host and their ring slots: every device gets them whole)
      "cold": jax.tree.map(lambda _: sharding.REPLICATED, prepared["cold"]),
    }
    if "micro" in prepared:
      out["micro"] = jax.tree.map(lambda _: batch, prepared["micro"])
    return out

  def stats(self):
    """Since the last call, per train step: popular_fraction (examples whose ids are all
    hot), hot_coverage (ids served by a hot row), rows / bytes host -> device and back
    (cold rows), the padded cold lists' rows and their distinct lengths so far, the loads
    the device ring served (ring_rows_per_step: rows a recent step wrote back, read ahead
    of its write-back), migrated rows, micro-batch sizes (all devices), plan ms on the
    input thread, hot_fill (hot rows / the hot arrays' capacity, as later batches are
    prepared: below 1 when the profile saw fewer rows than the budget holds,
    `HotSetPlanning._note_fill`). Eval batches: eval_popular_fraction, eval_hot_coverage."""
    c = self._counters.take()
    hot = sum(int((r.slot_row >= 0).sum()) for r in self._rows.values())
    out = {"hot_fill": hot / max(sum(r.capacity for r in self._rows.values()), 1)}
    steps = c.get("steps", 0)
    if steps:
      out.update(
        popular_fraction=c["popular"] / max(c["examples"], 1),
        hot_coverage=c["hot_ids"] / max(c["ids"], 1),
        h2d_rows_per_step=c["rows_h2d"] / steps,
        # The cold lists' padded lengths (the rows the batch and the write-back really
        # move) and how many distinct lengths (step shapes) the run has compiled for so far.
        cold_list_rows_per_step=c["cold_list"] / steps,
        cold_list_shapes=len(self.cold_shapes),
        d2h_rows_per_step=c["rows_d2h"] / steps,
        # A cold row comes in and goes back once per step (rows + optimizer state).
        h2d_bytes_per_step=c["bytes_h2d"] / steps,
        d2h_bytes_per_step=c["bytes_h2d"] / steps,
        ring_rows_per_step=c["ring_rows"] / steps,
        migrated_rows_per_step=c["migrated_rows"] / steps,
        plan_ms_per_step=1e3 * c["plan_seconds"] / steps,
        steps=steps,
      )
      if "micro_popular" in c:
        out["micro_popular_size"] = c["micro_popular"] / steps
        out["micro_cold_size"] = c["micro_cold"] / steps
    if c.get("eval_examples"):
      out["eval_popular_fraction"] = c["eval_popular"] / c["eval_examples"]
      out["eval_hot_coverage"] = c["eval_hot_ids"] / max(c["eval_ids"], 1)
    return out
