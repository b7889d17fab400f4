"""`hot_cold`: Hotline / FAE. Popular rows row-sharded over the mesh, the rest in host memory.

Plan string: `hot_cold(budget=0.05, profile_batches=20, reprofile=0, split=True,
prefetch=True)`; options in `HotColdOptions`. One instance per GROUP of tables: an example
is popular only when ALL its ids in the group's tables are hot (FAE's rule), so put the large
tables in one hot_cold rule and the small ones (wholly on the devices anyway) under `dense`.

Why (Adnan et al., ISCA'24 "Hotline"; FAE, VLDB'22): a few rows take most accesses. Those
rows, with their optimizer state, live in one device array per table, split by rows over every
device of the mesh (NamedSharding P(BATCH)); the long tail stays in pinned host memory (the
`host_table` module shared with `offload`). A batch is split into a popular micro-batch (every
id hot: computed from device memory only) and a non-popular one (some id cold: its cold rows
come from the host), so the accelerators work on the popular examples while cold rows arrive.

How a batch flows:

  input thread, prepare(k)   counts accesses while profiling (recgnn.embeddings.access_counts);
                             maps each id to a hot slot or to the batch's list of distinct
                             cold rows: ONE list for every table of a row layout (dim,
                             optimizer), table after table, padded to a bucketed length
                             (`hot_set.Buckets` over the layout's total); splits a train
                             batch's examples per device into the popular and the non-popular
                             micro-batch (the popular one's size fixed per hot set, the other
                             the rest: the step compiles a few times per run, not per batch;
                             when the popular size per device rounds to 0 the batch runs
                             whole and the log says why: `micro.off_reason`);
                             when a profile completes, picks the hot set for the byte budget
                             and plans the migration (rows in / out of the hot arrays).
                             Prefetch (once a hot set is in): also lists batch k + 1's
                             cold rows ("next", under the hot set k + 1 is prepared for),
                             each with its position in k's list ("from_now") and, when k
                             plans a migration, the hot slot a row leaving the hot set had
                             ("from_hot"); k + 1's prepare then finds its rows gathered.
  step k, lookup             popular micro-batch: hot rows only (a masked gather on each
                             device's shard, a reduce-scatter of the rows: exact, every row
                             has one non-zero term). Non-popular: the same, plus the cold rows
                             gathered from the host table (compute_on("device_host")) ONCE
                             per step, or with prefetch taken from the state's buffer (the
                             step before gathered them): the residuals carry them (and, on
                             one device, the row list left on the host) to the update.
                             Prefetch: batch k + 1's rows read from the host tables as they
                             came into the step (depends on nothing the step computes).
  step k, update             ONE sparse update for the whole batch, as `dense` applies it:
                             hot rows on their owner devices, cold rows on the gathered copy
                             and written back to the host table (exact: the same adds in the
                             same order as dense's), ordered after the next batch's read by
                             an optimization barrier (write after read on the donated host
                             arrays, as offload's). The next batch's rows, with those of
                             from_now / from_hot taken from k's updated cold / hot rows
                             (their host copies are stale until the write-back / migration),
                             become the state's buffer. Then the migration planned with k.

Exact under the trainer's run-ahead of `prepare`: a step reads the host table and writes its
cold rows back within itself (the state carries them in order); the hot / cold layout changes
only by a migration that runs at the end of the update of the batch whose `prepare` planned it,
and every later batch is prepared for the new layout. `version` in the state checks that
updates run in prepare order (as `offload`).

The hot set: the first `profile_batches` train batches are profiled (every row cold
meanwhile); then the most accessed rows that fit the budget are migrated in. FAE samples 5 %
of the input before training: the trainer gives a backend no look at the data before it
runs, so the sample is the head of the (shuffled) stream; `use_profile` takes a profile made
elsewhere (e.g. `profile.profile_sample` over a 5 % sample) instead. `reprofile=N` re-picks
the hot set every N train batches from the accesses counted since the last pick, for drifting
popularity. A checkpoint holds the logical rows (restorable into any "rows" backend, on any
mesh) and the hot set (`extras`, the checkpoint's metadata): `restore_extras` migrates it in
after `import_`, so a resumed run neither re-profiles nor starts all cold. hotline_kaggle
sets `profile_batches` to a share of an epoch of its data (train rows // batch size).

State {"tables": {table: {"hot": {"table": f32[Ha, D], slot: f32[Ha]}   rows over the mesh
                          "hot_rows": int32[Ha] (the row in each hot slot; N = empty)
                          "host": {"table": f32[S, D], slot: f32[S]}}}  host_table placement
       "version": int32[], "stale": int32[],
       "next": per stack {"table": f32[C, D], slot: f32[C]},   the next batch's cold rows
       "next_for": int32[]}                                    (their batch's version; -1)
Ha = the hot capacity rounded up to a multiple of the devices; S = base.aligned_rows(N). The
host table holds every row; a hot row's host copy is stale until `sync` writes it back. C =
the most distinct cold rows a batch has in the stack (its tables' ids, at most their rows):
one length for the run, so the state keeps its shapes ([0, ...] until the first prefetch);
replicated, as the gathered cold rows. Not checkpointed: after every step the host tables
hold every cold row's value, so a resumed run's first batch gathers its own.

Limits, and why:
  - The budget is per table (each table's hot array holds `budget` of its rows), not FAE's one
    budget over all tables: the hot arrays' shapes are fixed at init (memory is reported
    before allocating), before any profile exists. `profile.hot_set_for_budget` makes the
    global choice within those capacities.
  - The order "popular first, cold rows meanwhile" is a data dependency, not a schedule: the
    popular micro-batch never reads a host array, so XLA may run it while the cold gather is
    in flight (on an accelerator the host gather and copy are asynchronous); XLA:CPU runs
    host and device computations on the same cores, so nothing overlaps there.
    tests/test_hot_cold_tiers.py checks the dependency on the step's HLO.
  - Prefetch (issue 24): the cold rows of batch k + 1 are read during step k, from the host
    tables as they came into it, so on an accelerator the host-link copy overlaps step k's
    compute (offload's next-batch loads, `recgnn/backends/offload/__init__.py`), and step
    k + 1's micro-batches read no host value (tests/test_hot_cold_prefetch.py checks the
    HLO of a one-device step: the read depends on no dot, scatter or write-back, each
    write-back depends on its row layout's read, no host array is copied; and exactness vs
    dense on 1x1, 8x1, 2x4 with migrations, eval passes and a resume on another mesh;
    ignoring from_now fails it). Where it differs from
    the design first written here: (a) a batch planning a migration still prefetches the
    next one, under the new hot set: a row leaving the hot set is taken from the updated hot
    arrays ("from_hot", gathered on migration steps only), so a re-pick costs no on-demand
    step (and no extra step program); (b) the batch's own list, which its step writes back,
    takes the next list's length whenever that holds it (the sizers' lengths hold their
    latest needs, so always but after a new hot set): a step's shapes are then one length
    per stack, not the pair (k's, k + 1's), which made one more program at every change of
    length; (c) the buffer has a fixed length C (the batch's ids), not the longest list,
    for the same reason; the step slices it to the list's length. Not prefetched: the
    profile phase (every id cold: its steps gather their own, the batch's ids, as before;
    prefetching it needs a program for its first batch too, and tests/test_tier_warmup.py
    holds a warm-up to 4), the first batch after init / a restore, and a batch shaped
    otherwise than the one before. `prefetch=False` gathers on demand throughout. Host-link
    bytes to the device are those of on demand (the same rows, a step earlier); to the host
    a prefetched step sends its write-back's indices again (4 bytes a list entry: on demand
    the read leaves its list in host memory for the write-back, prefetched the list read is
    the next batch's): 1.27x / 1.30x / 1.22x the cold ids x row bytes at 1 / 5 / 20 %
    budgets (one 16-dim Adagrad table), against 1.20x / 1.23x / 1.15x on demand. Keeping
    the list in host memory between steps (a host array in the state) would remove it; a
    first try made XLA:CPU return that array in device memory when lookup and update are
    jitted apart (a PjRt memory-kind error): not built.
    The buffer costs C rows of device memory per device (26 x 2048 rows x 68 bytes: 3.6 MB).
  - On a mesh the host table is split by rows and each device reads the whole cold list
    against its share (rows it does not own come back as zeros, a psum adds them): each
    device's link moves the list's indices to the host and the list's length of rows back,
    not its own rows' share (tests/test_hot_cold_tiers.py measures it per device).
  - The split is off (batches run whole, logged once per group, then a count) when the popular
    micro-batch size rounds to 0 on the device with fewest popular examples: every device
    runs the same sizes and the popular micro-batch holds popular examples only.

Files: options.py (`HotColdOptions`), hot_set.py (the row <-> slot maps, profile, pick and
migrations: `HotSetPlanning`), micro.py (the popular / non-popular split), device.py (the
step's lookup, update and migration: `DeviceSteps`); this file, the `HotCold` class
(placement, state, checkpoints, `prepare`), which those two mixins complete. Shared
mechanisms live in recgnn/embeddings (row_sharded, host_table, host_cache, access_counts,
microbatch).
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
from recgnn.backends.hot_cold.hot_set import HotSetPlanning, TableRows, cold_cap, pad_to
from recgnn.backends.hot_cold.micro import MARGIN, split
from recgnn.backends.hot_cold.options import HotColdOptions
from recgnn.embeddings import access_counts as profile
from recgnn.embeddings import base, host_cache, host_table

P = sharding.P
__all__ = ["MARGIN", "HotCold", "HotColdOptions"]


@base.register_backend("hot_cold")
class HotCold(HotSetPlanning, DeviceSteps, base.Backend):
  """Hot rows on the devices (row-sharded), cold rows in host memory; popular / non-popular
  micro-batches. Options: `HotColdOptions`."""

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
    self.host = host_table.HostTable(
      o.host_memory, f"hot_cold (tables {', '.join(self.specs)})", mesh
    )
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
    # The cold list's length per table, for train and eval batches apart (their steps are
    # separate programs): bucketed, so each takes a few shapes per run.
    # One cold list per stack of tables with the same row layout (dim, optimizer slots):
    # every table's cold rows in one list, one length for the stack (`host_table.
    # gather_segments`), so the step's shape follows the stack's total (which moves little)
    # rather than every table's own.
    self._stacks = host_table.layouts(self.specs)
    self._stack_of = {
      n: (s, i) for s, names in enumerate(self._stacks) for i, n in enumerate(names)
    }
    grow = hot_set.SHRINK_AFTER
    self._cold_len = {t: [hot_set.Buckets(grow) for _ in self._stacks] for t in (True, False)}
    # The window the step reads of each table's segment of the list: its longest segment,
    # bucketed with more headroom (`host_cache.window_sizer`). Windows of a batch's ids
    # (whatever the hot set covers) made the host computations touch tables x ids rows,
    # several times the list.
    self._cold_win = {
      t: [host_cache.window_sizer(grow) for _ in self._stacks] for t in (True, False)
    }
    self.cold_shapes: set[tuple[int, ...]] = set()  # the train steps' cold-list lengths seen
    owner = f"hot_cold (tables {', '.join(self.specs)})"
    self._syncer = host_cache.Syncer(self._flush, owner, "hot / cold")
    self._initialised = False
    # Prefetch: prepare(k) lists batch k + 1's cold rows, so it looks one batch ahead. The
    # lists it made for k + 1 ("_ahead": k + 1's ids, version and own list lengths) tell
    # prepare(k + 1) that its rows are in the state's buffer.
    self.lookahead = 1 if o.prefetch else 0
    self._ahead: dict | None = None
    self._off_key = self.describe()  # the split-off warning's group (`micro.OFF_LOG`)

  @classmethod
  def capabilities_for(cls, options):
    return cls._capabilities(HotColdOptions.parse(options))

  @staticmethod
  def _capabilities(o: HotColdOptions) -> base.Capabilities:
    # The hot set and the popular / non-popular split are planned over the whole batch.
    return base.Capabilities(splits_batch=o.split, plans_globally=True)

  def describe(self, table=None):
    del table
    o = self.options
    size = f"hot_rows={o.hot_rows}" if o.fraction is None else f"budget={o.fraction}"
    extra = f", reprofile={o.reprofile}" if o.reprofile else ""
    extra += "" if o.split else ", split=False"
    extra += "" if self.host.host_memory == "pinned_host" else ", host_memory=device"
    extra += "" if o.cold_list == "bucket" else f", cold_list={o.cold_list}"
    extra += "" if o.prefetch else ", prefetch=False"
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
    rows, vec = self._hot_sharding()
    out = {}
    for name, spec in self.specs.items():
      slots = spec.optimizer.slot_names()
      out[name] = {
        "hot": {"table": rows, **{s: vec for s in slots}},
        "hot_rows": self._repl(),
        "host": self.host.sharding(slots),
      }
    return {
      "tables": out,
      "version": self._repl(),
      "stale": self._repl(),
      # the next batch's cold rows, per stack (replicated, as the gathered cold rows), and
      # the version of the batch they are for (-1: none)
      "next": tuple(
        {"table": self._repl(), **{s: self._repl() for s in self._slots(names)}}
        for names in self._stacks
      ),
      "next_for": self._repl(),
    }

  def _allocs(self, names) -> np.ndarray:
    return np.array([self._rows[n].alloc for n in names], np.int64)

  def _slots(self, names) -> tuple[str, ...]:
    return self.specs[names[0]].optimizer.slot_names()

  def batch_memory(self, ids_shapes):
    """The prefetch buffer (`DeviceSteps._buffer`): the next batch's cold rows with their
    optimizer state, as many as a batch has ids (at most the table's rows), replicated on
    every device; none without prefetch."""
    if not self.options.prefetch:
      return {}
    return {
      n: hot_set.cold_cap(ids_shapes[n], spec) * spec.row_bytes
      for n, spec in self.specs.items()
      if n in ids_shapes
    }

  def memory(self):
    out = {}
    n = self.mesh.size
    for name, r in self._rows.items():
      spec = r.spec
      device = r.alloc // n * spec.row_bytes + r.alloc * 4  # hot shard + slot map
      # Every row on the host (one copy over the mesh), the row -> slot map, the profile.
      host = base.aligned_rows(spec.num_rows) * spec.row_bytes + spec.num_rows * (4 + 8)
      if not self.host.offloaded:
        device, host = device + base.aligned_rows(spec.num_rows) * spec.row_bytes, host
      where = (
        f"{r.alloc} hot rows over {n} device(s) + {self.host.host_memory}"
        if self.host.offloaded
        else "device (no offload)"
      )
      out[name] = base.MemoryReport(device, host, where)
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
    """A state holding `host` (every row; numpy or placed); the hot arrays hold the current
    hot set (from `use_profile` before init) or nothing."""
    sh = self.state_sharding()
    tables = {}
    if not keep_hot_set:
      for r in self._rows.values():
        r.row_slot[:] = -1
        r.slot_row[:] = -1
      self._picked = False
    for name, r in self._rows.items():
      spec, opt = r.spec, r.spec.optimizer
      placed = self.host.place(host[name], sh["tables"][name]["host"])
      hot = {"table": np.zeros((r.alloc, spec.dim), np.float32)}
      hot.update(
        {k: np.full(r.alloc, opt.initial_accumulator, np.float32) for k in opt.slot_names()}
      )
      filled = r.slot_row >= 0
      if filled.any():  # a hot set picked before init: its rows start from the host values
        src = jax.device_get(placed)
        for k in hot:
          hot[k][filled] = np.asarray(src[k])[r.slot_row[filled]]
      hot_rows = np.where(filled, r.slot_row, spec.num_rows).astype(np.int32)
      tables[name] = {
        "hot": jax.device_put(hot, sh["tables"][name]["hot"]),
        "hot_rows": jax.device_put(hot_rows, sh["tables"][name]["hot_rows"]),
        "host": placed,
      }
    self._version, self._since_pick, self._p0 = 0, 0, {}
    self._pending, self._ahead = None, None
    for r in self._rows.values():
      r.profile.reset()
    self._initialised = True
    # Two buffers: the state is donated, and one buffer donated twice is an error.
    zero = lambda: jax.device_put(np.zeros((), np.int32), self._repl())  # noqa: E731
    return {
      "tables": tables,
      "version": zero(),
      "stale": zero(),
      "next": self._empty_next(),
      "next_for": jax.device_put(np.full((), -1, np.int32), self._repl()),
    }

  def _empty_next(self) -> tuple[dict, ...]:
    """The prefetch buffers before any step filled them: [0, ...] per stack (the first step
    that prefetches sets their length, the batch's most cold rows: `DeviceSteps._buffer`)."""
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

  def export(self, state):
    """The host arrays of a synced state (`sync` wrote every hot row back)."""
    self._check_stale(state)
    out = {}
    for name, spec in self.specs.items():
      h = state["tables"][name]["host"]
      out[name] = {"rows": h["table"], **{k: h[k] for k in spec.optimizer.slot_names()}}
    return out

  def logical_target(self):
    out = {}
    for name, spec in self.specs.items():
      s, d = base.aligned_rows(spec.num_rows), spec.dim
      rows, vec = self.host.row_sharding()
      t = {"rows": jax.ShapeDtypeStruct((s, d), jnp.float32, sharding=rows)}
      for k in spec.optimizer.slot_names():
        t[k] = jax.ShapeDtypeStruct((s,), jnp.float32, sharding=vec)
      out[name] = t
    return out

  def import_(self, logical):
    """Every row to the host table, empty hot arrays: the hot set is profiled again (values
    do not change, only where rows live)."""
    host = {
      n: {"table": logical[n]["rows"], **{k: logical[n][k] for k in s.optimizer.slot_names()}}
      for n, s in self.specs.items()
    }
    return self._fresh(host, keep_hot_set=False)

  def restore(self, state):
    """Host bookkeeping from a restored state's hot slots (the profile restarts)."""
    self._check_stale(state)
    sh = self.state_sharding()
    tables = {}
    for name, r in self._rows.items():
      t = state["tables"][name]
      t = {**t, "host": self.host.place(t["host"], sh["tables"][name]["host"])}
      tables[name] = t
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
    self._since_pick, self._p0, self._pending, self._ahead = 0, {}, None, None
    self._initialised = True
    if "next" not in state:  # (a state saved before prefetch existed)
      state = {**state, "next": self._empty_next(), "next_for": jax.device_put(
        np.full((), -1, np.int32), self._repl())}  # fmt: skip
    return {**state, "tables": tables}

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
    """The saved hot set migrated into the state `import_` built (every row on the host):
    the resumed run computes from the same hot rows at once, with no new profile. A hot set
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
    tables = dict(state["tables"])
    repl = self._repl()
    for name, r in self._rows.items():
      packed = jax.device_put(self._pack_migration(name, self._migrate(r, rows[name])), repl)
      move = jax.jit(functools.partial(self._migration, spec=r.spec))
      tables[name] = move(tables[name], packed)
    self._picked = bool(any(x.size for x in rows.values()))
    self._since_pick, self._p0, self._pending, self._ahead = 0, {}, None, None
    return {**state, "tables": tables}

  def _check_stale(self, state):
    self._syncer.check(state)

  def sync(self, state):
    """Write every hot row back to the host table (O(hot rows)); the hot arrays stay."""
    return self._syncer(state)

  def _flush(self, state):
    tables = {}
    for name, t in state["tables"].items():
      slots = jnp.arange(t["hot_rows"].shape[0], dtype=jnp.int32)
      hot = {k: self._hot_get(v, slots) for k, v in t["hot"].items()}
      n = self.specs[name].num_rows
      tables[name] = {**t, "host": host_cache.flush(self.host, t["host"], t["hot_rows"], n, hot)}
    return {**state, "tables": tables}

  def tables(self, state):
    out = {}
    for name, t in state["tables"].items():
      n = self.specs[name].num_rows
      table = np.array(jax.device_get(t["host"]["table"]))[:n]
      hot_rows = np.asarray(jax.device_get(t["hot_rows"]))
      hot = np.asarray(jax.device_get(t["hot"]["table"]))
      filled = hot_rows < n
      table[hot_rows[filled]] = hot[filled]
      out[name] = table
    return out

  # --------------------------------------------------------------------------- host side

  def _devices(self) -> int:
    """How many pieces the batch is split into (its examples per device)."""
    return self.mesh.size if self.layout.split_batch else 1

  def _count(self, **kv):
    self._counters.add(**kv)

  def prepare(self, ids, upcoming=(), *, train=True):
    """ids {table: int[B, L]} (PAD = -1) -> the prepared pytree: {"tables": {table:
    {"hot_ids": int32[B, L] (hot slot; Ha: none), "cold_ids": int32[B, L] (position in its
    stack's cold list; W: none), ...}}, "cold": per stack {"rows": int32[W] (the batch's
    distinct cold rows, table after table), "off": int32[T + 1], "win": int32[0, w]},
    "micro": the split (`micro.split`), "version": int32[], the migration's arrays, and
    with prefetch: "prefetched": int32[0] (present: the batch's cold rows are in the state's
    buffer, gathered by the previous step; "cold" lists them for the write-back), "next":
    per stack, batch k + 1's list (`_next_lists`)}.

    upcoming: the next train batches' ids (the first is prefetched during this step).
    train=False (eval): read-only; neither counts toward the profile nor migrates.
    """
    t0 = time.perf_counter()
    if train and not self._initialised:
      raise RuntimeError("hot_cold: call init (or import_ / restore) before prepare(train=True)")
    given = ids
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
    # Was this batch's cold list gathered by the previous step (listed by the previous
    # prepare, for this version: nothing ran in between)? Eval batches leave it alone.
    ahead = None
    if train:
      ahead, self._ahead = self._ahead, None
      if ahead is not None and not (
        ahead["version"] == self._version and _same_ids(ahead["ids"], given, self.specs)
      ):
        ahead = None
    # Each stack's list: its distinct cold rows, table after table, padded to a bucketed
    # length (`Buckets`: within 12.5 % of the need, grown at once, shrunk after a while):
    # host traffic is what the cold ids need, and the step compiles a few times per run.
    own = []  # per stack: (segments, offsets, caps, need, most, length, window)
    for stack, names in enumerate(self._stacks):
      segs = [per[n][5] for n in names]
      off = np.cumsum([0] + [x.size for x in segs]).astype(np.int32)
      caps = [cold_cap(per[n][0].shape, self.specs[n]) for n in names]
      most = max(int(np.diff(off).max()), 1)
      if ahead is not None:  # sized by the prepare that listed it
        uc, win = ahead["lists"][stack]
      # Before the first hot set (the profile) every id is cold, and the phase ends at the
      # pick: one length for it, the batch's ids (as `fixed`), not the few a sizer takes
      # over a phase of a few batches (each a compile; the pick's migration step is one).
      elif self.options.cold_list == "fixed" or (train and not self._picked):
        uc, win = sum(caps), max(caps)
        self._cold_len[train][stack].tick()  # (decision points at the same steps as others')
        self._cold_win[train][stack].tick()
      else:
        uc = self._cold_len[train][stack](max(int(off[-1]), 1), sum(caps))
        win = min(self._cold_win[train][stack](most, max(caps)), uc)
      own.append((segs, off, caps, int(off[-1]), most, uc, win))
    p0s = self._p0  # (the split of a batch planning a migration keeps the old hot set's)
    migrate = self._plan_profile(ids, train)
    if any(m is not None for m in migrate.values()):
      # A new hot set changes every later batch's cold rows: their lists start over (the
      # next batch's need sets the length, instead of waiting out the old hot set's).
      for s in (*self._cold_len[True], *self._cold_win[True]):
        s.reset()
    nxt = None
    if train and self.options.prefetch and self._picked:
      if upcoming:
        nxt = self._next_lists(upcoming[0], ids, per, migrate, own, tick=ahead is not None)
      elif ahead is not None and not any(m is not None for m in migrate.values()):
        # (only where a chain of prefetches breaks: a caller that never looks ahead gets
        # on-demand steps, with no list of padding read each step)
        nxt = self._idle_next(own, tick=True)
    out = {"tables": {}, "cold": []}
    lengths = []
    for stack, names in enumerate(self._stacks):
      segs, off, caps, need, most, uc, win = own[stack]
      if nxt is not None:
        # This batch's list takes the next one's length (and window) when they hold it: the
        # step writes this batch's rows back and reads the next's, and one length for both
        # keeps the step's shapes those of one list (two would make a program per pair of
        # lengths: one more at every change). They hold it but after a new hot set, since
        # the sizer's lengths hold the latest needs (`host_cache.ListSizer`).
        n_len, n_win = nxt["lists"][stack]
        if need <= n_len <= sum(caps):
          uc, win = n_len, (n_win if most <= n_win else min(win, n_len))
      lengths.append(uc)
      out["cold"].append({
        "rows": pad_to(np.concatenate(segs), uc, 0),
        "off": off,
        # (its shape only: the window the step reads per table, >= every segment)
        "win": np.zeros((0, win), np.int32),
      })  # fmt: skip
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
        out["tables"][name] = t
    out["tables"] = {n: out["tables"][n] for n in self.specs}
    out["cold"] = tuple(out["cold"])
    if ahead is not None:
      out["prefetched"] = np.zeros(0, np.int32)
    if nxt is not None:
      for stack, lst in enumerate(nxt["prepared"]):  # absent in this batch's list: past it
        lst["from_now"] = np.where(lst["from_now"] < 0, lengths[stack], lst["from_now"])
        lst["from_now"] = lst["from_now"].astype(np.int32)
      out["next"] = tuple(nxt["prepared"])
      if upcoming:
        self._ahead = {
          "ids": upcoming[0], "version": self._version + 1, "lists": nxt["lists"],
        }  # fmt: skip
    # Eval batches run whole: the eval step has no model to split, only lookups to merge.
    micro = (
      split(p0s, out["tables"], ~example_cold, n_dev, b, self._off_key)
      if self.options.split and train
      else None
    )
    if micro is not None:
      out["micro"] = micro
    nl_lists = out.get("next", ())
    if train:
      nl = tuple(x["rows"].shape[0] for x in nl_lists)
      self.cold_shapes.add(tuple(lengths) + nl)
    for name, t in out["tables"].items():
      t.update(self._pack_migration(name, migrate.get(name)))
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
        # the rows the step reads from the host: its own list (on demand) or none
        # (prefetched), and the next batch's
        cold_list=(0 if ahead is not None else sum(lengths)) + sum(nl),
        rows_d2h=cold_rows_n,
        bytes_h2d=cold_bytes,
        migrated_rows=sum(
          int(m[1].size) + int(m[0].size) for m in migrate.values() if m is not None
        ),
        prefetched=int(ahead is not None),
        next_from_now=sum(int((x["from_now"] < w).sum()) for x, w in zip(nl_lists, lengths)),
        next_from_hot=sum(
          int((x["from_hot"] < self._allocs(names)[:, None]).sum())
          for x, names in zip(nl_lists, self._stacks)
          if "from_hot" in x
        ),
      )
      if self.options.split:
        p0 = out["micro"][0]["idx"].shape[0] if micro else 0
        stats.update(micro_popular=p0, micro_cold=batch - p0)
    else:
      stats = {f"eval_{k}": v for k, v in stats.items()}
    self._count(**stats)
    return out

  def _next_lists(self, up, ids, per, migrate, own, tick: bool) -> dict | None:
    """Batch k + 1's cold lists (up: its ids), listed by prepare(k) for step k to gather
    into the state's buffer, under the hot set k + 1 is prepared for (after the migration
    this batch plans, if any). -> {"prepared": per stack {"rows": int32[L], "off":
    int32[T + 1], "win": int32[0, w] (as "cold"), "from_now": int32[L] (the row's position
    in batch k's list, -1 absent: prepare sets the list's length there), with a migration
    "from_hot": int32[T, L] (table i's row: the hot slot a row leaving the hot set had,
    Ha_i: none)}, "lists": per stack (L, w)}, or None (k + 1 is shaped otherwise: its
    windows and buffer are sized from k's shapes).

    A row of k + 1's list is current in the host table as step k starts, but for a row in
    batch k's list (updated by step k, written back after the read: "from_now") or leaving
    the hot set at k's migration (its value in the hot arrays: "from_hot"). A row hot in k
    and staying hot is not in k + 1's list. O(k + 1's ids + the rows migrating)."""
    up = {n: np.asarray(up[n]).astype(np.int64) for n in self.specs}
    if any(up[n].shape != ids[n].shape for n in self.specs):
      return None
    moving = any(m is not None for m in migrate.values())
    prepared, lists = [], []
    for stack, names in enumerate(self._stacks):
      segs, from_now = [], []
      _, off_k, caps, *_ = own[stack]
      for i, n in enumerate(names):
        x = up[n]
        rows = np.unique(x[x >= 0])
        rows = rows[self._rows[n].row_slot[rows] < 0]
        segs.append(rows)
        pos, hit = _find(per[n][5], rows)  # in batch k's cold rows of the table (sorted)
        from_now.append(np.where(hit, off_k[i] + pos, -1))
      off = np.cumsum([0] + [x.size for x in segs]).astype(np.int32)
      most = max(int(np.diff(off).max()), 1)
      length = self._cold_len[True][stack](max(int(off[-1]), 1), sum(caps), tick=tick)
      win = min(self._cold_win[True][stack](most, max(caps), tick=tick), length)
      lst = {
        "rows": pad_to(np.concatenate(segs), length, 0),
        "off": off,
        "win": np.zeros((0, win), np.int32),
        "from_now": pad_to(np.concatenate(from_now), length, -1),
      }
      if moving:
        from_hot = np.empty((len(names), length), np.int32)
        for i, n in enumerate(names):
          from_hot[i] = self._rows[n].alloc
          m = migrate.get(n)
          if m is not None and m[3].size:
            order = np.argsort(m[3])
            pos, hit = _find(m[3][order], segs[i])
            from_hot[i, off[i] : off[i + 1]][hit] = m[2][order][pos[hit]]
        lst["from_hot"] = from_hot
      prepared.append(lst)
      lists.append((length, win))
    return {"prepared": prepared, "lists": lists}

  def _idle_next(self, own, tick: bool) -> dict | None:
    """A next list with no rows, at the lengths in use (`_next_lists`' form): for a
    prefetched batch with no next train batch in sight (the last before an eval pass or the
    stream's end), so its step keeps the steady shapes instead of compiling a program of its
    own (10-40 s on CPU); it reads the list's length of padding rows once. None before any
    length."""
    prepared, lists = [], []
    for stack, names in enumerate(self._stacks):
      sizers = (self._cold_len[True][stack], self._cold_win[True][stack])
      if any(z.width is None for z in sizers):
        return None
      if tick:
        for z in sizers:
          z.tick()
      length = min(sizers[0].width, sum(own[stack][2]))
      win = min(sizers[1].width, length)
      prepared.append({
        "rows": np.zeros(length, np.int32),
        "off": np.zeros(len(names) + 1, np.int32),
        "win": np.zeros((0, win), np.int32),
        "from_now": np.full(length, -1, np.int32),
      })  # fmt: skip
      lists.append((length, win))
    return {"prepared": prepared, "lists": lists}

  _BATCH_MAJOR = ("hot_ids", "cold_ids", "hot_inverse", "count")

  def _list_spec(self, lst: dict) -> dict:
    """A cold list's leaves: its rows only host computations read (the host gather and the
    write-back: `HostTable.list_spec`); offsets, windows and from_now / from_hot are read on
    the device."""
    return {k: self.host.list_spec if k == "rows" else sharding.REPLICATED for k in lst}

  def prepared_spec(self, prepared):
    batch = sharding.BATCH_SPEC if self.layout.split_batch else sharding.REPLICATED
    out = {
      "tables": {
        n: {k: batch if k in self._BATCH_MAJOR else sharding.REPLICATED for k in t}
        for n, t in prepared["tables"].items()
      },
      "version": sharding.REPLICATED,
      "cold": tuple(self._list_spec(x) for x in prepared["cold"]),
    }
    if "next" in prepared:
      out["next"] = tuple(self._list_spec(x) for x in prepared["next"])
    if "prefetched" in prepared:
      out["prefetched"] = sharding.REPLICATED
    if "micro" in prepared:
      out["micro"] = jax.tree.map(lambda _: batch, prepared["micro"])
    return out

  def stats(self):
    """Since the last call, per train step: popular_fraction (examples whose ids are all
    hot), hot_coverage (ids served by a hot row), rows / bytes host -> device and back
    (cold rows), the padded cold lists' rows and their distinct lengths so far, migrated
    rows, micro-batch sizes (all devices), plan ms on the input thread, hot_fill (hot rows /
    the hot arrays' capacity, as later batches are prepared: below 1 when the profile saw
    fewer rows than the budget holds, `HotSetPlanning._note_fill`). Eval batches:
    eval_popular_fraction, eval_hot_coverage."""
    c = self._counters.take()
    hot = sum(int((r.slot_row >= 0).sum()) for r in self._rows.values())
    out = {"hot_fill": hot / max(sum(r.capacity for r in self._rows.values()), 1)}
    steps = c.get("steps", 0)
    if steps:
      out.update(
        popular_fraction=c["popular"] / max(c["examples"], 1),
        hot_coverage=c["hot_ids"] / max(c["ids"], 1),
        h2d_rows_per_step=c["rows_h2d"] / steps,
        # The cold lists' padded lengths (the rows the step's host gather really moves) and
        # how many distinct lengths (step shapes) the run has compiled for so far.
        cold_list_rows_per_step=c["cold_list"] / steps,
        cold_list_shapes=len(self.cold_shapes),
        d2h_rows_per_step=c["rows_d2h"] / steps,
        # A cold row comes in and goes back once per step (rows + optimizer state).
        h2d_bytes_per_step=c["bytes_h2d"] / steps,
        d2h_bytes_per_step=c["bytes_h2d"] / steps,
        migrated_rows_per_step=c["migrated_rows"] / steps,
        plan_ms_per_step=1e3 * c["plan_seconds"] / steps,
        # prefetch: the steps whose cold rows the step before gathered, and the next
        # batch's rows taken from this step's cold rows / its migration's hot rows
        prefetched_fraction=c["prefetched"] / steps,
        next_from_now_per_step=c["next_from_now"] / steps,
        next_from_hot_per_step=c["next_from_hot"] / steps,
        steps=steps,
      )
      if "micro_popular" in c:
        out["micro_popular_size"] = c["micro_popular"] / steps
        out["micro_cold_size"] = c["micro_cold"] / steps
    if c.get("eval_examples"):
      out["eval_popular_fraction"] = c["eval_popular"] / c["eval_examples"]
      out["eval_hot_coverage"] = c["eval_hot_ids"] / max(c["eval_ids"], 1)
    return out


def _find(sorted_rows: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Each of `rows` in `sorted_rows` (int64[n], sorted): (its position, whether there)."""
  pos = np.searchsorted(sorted_rows, rows)
  hit = pos < sorted_rows.size
  hit[hit] = sorted_rows[pos[hit]] == rows[hit]
  return pos, hit


def _same_ids(a: dict, b: dict, names) -> bool:
  """Whether two batches' ids are the same (the arrays themselves, as the trainer passes a
  batch's ids to the prepare before it and to its own; else compared)."""
  return all(
    a[n] is b[n] or (np.shape(a[n]) == np.shape(b[n]) and np.array_equal(a[n], b[n])) for n in names
  )
