"""`hot_cold`: Hotline / FAE. Popular rows row-sharded over the mesh, the rest in host memory.

Plan string: `hot_cold(budget=0.05, profile_batches=20, reprofile=0, split=True)`; options in
`HotColdOptions`. One instance per GROUP of tables: an example is popular only when ALL its ids in
the group's tables are hot (FAE's rule), so put the large tables in one hot_cold rule and the
small ones (wholly on the devices anyway) under `dense`.

Why (Adnan et al., ISCA'24 "Hotline"; FAE, VLDB'22): a few rows take most accesses. Those
rows, with their optimizer state, live in one device array per table, split by rows over every
device of the mesh (NamedSharding P(BATCH)); the long tail stays in pinned host memory (the
`host_table` module shared with `offload`). A batch is split into a popular micro-batch (every
id hot: computed from device memory only) and a non-popular one (some id cold: its cold rows
come from the host), so the accelerators work on the popular examples while cold rows arrive.

How a batch flows:

  input thread, prepare(k)   counts accesses while profiling (recgnn.embeddings.access_counts);
                             maps each id to a hot slot or to the batch's list of distinct
                             cold rows (padded to the batch's id count); splits a train
                             batch's examples per device into the popular and the non-popular
                             micro-batch (the popular one's size fixed per hot set, the other
                             the rest: the step compiles a few times per run, not per batch);
                             when a profile completes, picks the hot set for the byte budget
                             and plans the migration (rows in / out of the hot arrays).
  step k, lookup             popular micro-batch: hot rows only (a masked gather on each
                             device's shard, a reduce-scatter of the rows: exact, every row
                             has one non-zero term). Non-popular: the same, plus the cold rows
                             gathered from the host table (compute_on("device_host")).
  step k, update             ONE sparse update for the whole batch, as `dense` applies it:
                             hot rows on their owner devices, cold rows on the gathered copy
                             and written back to the host table (exact: the same adds in the
                             same order as dense's). Then the migration planned with batch k.

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
popularity. A checkpoint holds the logical rows only (restorable into any "rows" backend, on
any mesh): the hot set is re-profiled after `import_`.

State {"tables": {table: {"hot": {"table": f32[Ha, D], slot: f32[Ha]}   rows over the mesh
                          "hot_rows": int32[Ha] (the row in each hot slot; N = empty)
                          "host": {"table": f32[S, D], slot: f32[S]}}}  host_table placement
       "version": int32[], "stale": int32[]}
Ha = the hot capacity rounded up to a multiple of the devices; S = base.aligned_rows(N). The
host table holds every row; a hot row's host copy is stale until `sync` writes it back.

Limits, and why:
  - The budget is per table (each table's hot array holds `budget` of its rows), not FAE's one
    budget over all tables: the hot arrays' shapes are fixed at init (memory is reported
    before allocating), before any profile exists. `profile.hot_set_for_budget` makes the
    global choice within those capacities.
  - The order "popular first, cold rows meanwhile" is a data dependency, not a schedule: the
    popular micro-batch never reads a host array, so XLA may run it while the cold gather is
    in flight (on an accelerator the host gather and copy are asynchronous); XLA:CPU runs
    host and device computations on the same cores, so nothing overlaps there.
  - Lookup and update each gather the cold rows from the host (the contract gives `update`
    no handle on what `lookup` read); inside one jitted step XLA may merge the two.

One concern in one file: the `HotCold` group (host planning of the hot set, micro-batches and
migrations; its device code). Shared mechanisms live in recgnn/embeddings (row_sharded,
host_table, host_cache, access_counts, microbatch).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Sequence
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from recgnn import sharding
from recgnn.embeddings import access_counts as profile
from recgnn.embeddings import base, host_cache, host_table, microbatch, row_sharded

P = sharding.P
MARGIN = 4.0  # popular micro-batch size: the popular count less this many binomial std devs


def _popular_size(cnt: int, b: int) -> int:
  """The popular micro-batch size for a device's popular count cnt of b examples: cnt less
  MARGIN binomial standard deviations, so later batches rarely have fewer (each new size
  recompiles the step: 10-20 s on CPU, a seventh of an epoch of the synthetic default).
  Popular examples past it run in the non-popular micro-batch: the same compute."""
  sd = math.sqrt(cnt * (1 - cnt / b)) if b else 0.0
  return max(0, math.floor(cnt - MARGIN * sd))


def _pad(a: np.ndarray, size: int, fill: int) -> np.ndarray:
  out = np.full(size, fill, np.int32)
  out[: a.shape[0]] = a
  return out


@dataclasses.dataclass
class _Rows:
  """Host bookkeeping of one table: the hot slot of each row, the row of each slot."""

  spec: base.TableSpec
  capacity: int  # hot rows the budget allows (H)
  alloc: int  # hot slots allocated (Ha >= H, a multiple of the devices)
  row_slot: np.ndarray  # int32[N], -1 = cold
  slot_row: np.ndarray  # int64[Ha], -1 = empty
  profile: profile.AccessProfile

  @property
  def hot(self) -> np.ndarray:
    """Sorted hot row ids."""
    return np.sort(self.slot_row[self.slot_row >= 0])


@dataclasses.dataclass(frozen=True)
class HotColdOptions(base.BackendOptions):
  """`hot_cold(...)`'s options: `budget` or `hot_rows` (not both; budget=0.05 when neither).

  Attributes:
    budget: share of each table's bytes (rows + optimizer state) kept on the devices, in all
      (each of n devices holds 1 / n of it), in (0, 1].
    hot_rows: the hot rows per table (>= 1), instead of `budget`.
    profile_batches: train batches profiled before the first hot set is picked (>= 1).
    reprofile: re-pick the hot set every this many train batches from the accesses counted
      since the last pick, migrating rows (0 = never). Refused with budget=1: every row is
      hot, so no pick can differ.
    split: run the batch as popular + non-popular micro-batches (the step's micro-batch
      feature). False: one lookup of the whole batch (same values).
    host_memory: `pinned_host` or `device` (no offload: benchmarks, debugging).
  """

  backend: ClassVar[str] = "hot_cold"

  budget: float | None = None
  hot_rows: int | None = None
  profile_batches: int = 20
  reprofile: int = 0
  split: bool = True
  host_memory: str = "pinned_host"

  def __post_init__(self):
    if self.budget is not None and self.hot_rows is not None:
      raise ValueError("hot_cold: give budget=FRACTION or hot_rows=ROWS, not both")
    if self.budget is not None and not 0 < self.budget <= 1:
      raise ValueError(f"hot_cold: budget must be in (0, 1], got {self.budget}")
    if self.hot_rows is not None and self.hot_rows < 1:
      raise ValueError(f"hot_cold: hot_rows must be >= 1, got {self.hot_rows}")
    if self.profile_batches < 1 or self.reprofile < 0:
      raise ValueError(
        f"hot_cold: need profile_batches >= 1 and reprofile >= 0, got {self.profile_batches}, "
        f"{self.reprofile}"
      )
    if self.reprofile and self.budget == 1:
      raise ValueError(
        f"hot_cold: reprofile={self.reprofile} re-picks the hot set, but budget=1 keeps every "
        "row hot, so a new pick never differs: drop reprofile= or give a budget under 1"
      )

  @property
  def fraction(self) -> float | None:
    """The budget in effect: `budget`, its default 0.05, or None with `hot_rows`."""
    return None if self.hot_rows is not None else (0.05 if self.budget is None else self.budget)


@base.register_backend("hot_cold")
class HotCold(base.Backend):
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
    self._rows: dict[str, _Rows] = {}
    for name, spec in self.specs.items():
      cap = o.hot_rows if o.hot_rows is not None else math.ceil(o.fraction * spec.num_rows)
      cap = max(1, min(int(cap), spec.num_rows))
      self._rows[name] = _Rows(
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
    owner = f"hot_cold (tables {', '.join(self.specs)})"
    self._syncer = host_cache.Syncer(self._flush, owner, "hot / cold")
    self._initialised = False

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
    return {"tables": out, "version": self._repl(), "stale": self._repl()}

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
    self._pending = None
    for r in self._rows.values():
      r.profile.reset()
    self._initialised = True
    # Two buffers: the state is donated, and one buffer donated twice is an error.
    zero = lambda: jax.device_put(np.zeros((), np.int32), self._repl())  # noqa: E731
    return {"tables": tables, "version": zero(), "stale": zero()}

  def use_profile(self, profiles: dict[str, profile.AccessProfile]) -> profile.HotSet:
    """Pick the hot set from a profile made elsewhere (e.g. `profile.profile_sample` over 5 %
    of the training input). Before `init`: init places it. After: the next train batch's
    prepare plans the migration. Ends the initial profiling."""
    chosen = self._choose(profiles)
    if not self._initialised:
      for name, r in self._rows.items():
        r.row_slot[:] = -1
        r.slot_row[:] = -1
        rows = chosen.rows[name]
        r.slot_row[: rows.size] = rows
        r.row_slot[rows] = np.arange(rows.size, dtype=np.int32)
    else:
      self._pending = chosen.rows
    self._picked = True
    return chosen

  def _choose(self, profiles) -> profile.HotSet:
    """The hot set of the budget: the most accessed rows per byte, each table capped at its
    hot capacity (profile.hot_set_for_budget)."""
    row_bytes = {n: s.row_bytes for n, s in self.specs.items()}
    caps = {n: r.capacity for n, r in self._rows.items()}
    budget = sum(caps[n] * row_bytes[n] for n in self.specs)
    return profile.hot_set_for_budget(
      {n: profiles[n] for n in self.specs}, row_bytes, budget, capacity=caps
    )

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
    self._since_pick, self._p0, self._pending = 0, {}, None
    self._initialised = True
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

  def hot_set(self) -> dict[str, np.ndarray]:
    """The current hot rows of each table (as prepared batches see them), sorted."""
    return {n: r.hot for n, r in self._rows.items()}

  # --------------------------------------------------------------------------- host side

  def _devices(self) -> int:
    """How many pieces the batch is split into (its examples per device)."""
    return self.mesh.size if self.layout.split_batch else 1

  def _count(self, **kv):
    self._counters.add(**kv)

  def prepare(self, ids, upcoming=(), *, train=True):
    """ids {table: int[B, L]} (PAD = -1) -> the prepared pytree (see `prepared_spec`).

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
    out = {"tables": {}}
    for name, (x, valid, slot, hot, cold, cold_rows, cold_pos) in per.items():
      r = self._rows[name]
      # Every id of the batch may be cold: a cold list of that length has one shape for
      # the whole run (a list sized to the batch's count recompiled the step whenever a
      # batch had more distinct cold rows than any before; ~15 s each on CPU). Its padding
      # costs O(batch) gathers, the bytes `dense` reads for the batch.
      uc = min(x.size, r.spec.num_rows)
      cold_ids = np.full(x.shape, uc, np.int32)
      cold_ids[cold] = cold_pos
      t = {
        "hot_ids": np.where(hot, slot, r.alloc).astype(np.int32),
        "cold_ids": cold_ids,
        "cold_rows": _pad(cold_rows, uc, base.aligned_rows(r.spec.num_rows)),
      }
      if r.spec.optimizer.needs_unique:
        t["hot_unique"], t["hot_inverse"] = base.dedup(np.where(hot, slot, -1), r.alloc)
      if r.spec.pooling == "mean":
        t["count"] = valid.sum(axis=1).astype(np.int32)
      out["tables"][name] = t
    # Eval batches run whole: the eval step has no model to split, only lookups to merge.
    micro = (
      self._micro(out["tables"], ~example_cold, n_dev, b) if self.options.split and train else None
    )
    if micro is not None:
      out["micro"] = micro
    migrate = self._plan_profile(ids, train)
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
        rows_d2h=cold_rows_n,
        bytes_h2d=cold_bytes,
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

  def _micro(self, tables, popular, n_dev, b):
    """Per device, its first P0 popular examples (in batch order), then the rest (its other
    popular examples, then its non-popular ones), as two micro-batches of P0 and b - P0
    examples (every device the same; no padding). P0 (`_popular_size`) is fixed from the
    first train batch of a hot set and only shrinks, when a batch has fewer popular
    examples on some device: a few step shapes per run. None (run the batch whole) while
    P0 is 0; the popular micro-batch alone when P0 = b. Each micro-batch: {"idx":
    int32[n * Pm] local example index, table: {"hot": int32[n * Pm, L], "cold":
    int32[n * Pm, L] (non-popular only), "count": int32[n * Pm] (mean pooling)}}."""
    h = popular.reshape(n_dev, b)
    cnt = int(h.sum(axis=1).min())
    p0 = self._p0.get(b)
    if p0 is None or cnt < p0:
      p0 = self._p0[b] = _popular_size(cnt, b)
    if p0 == 0:
      return None
    order = np.argsort(~h, axis=1, kind="stable")  # popular first, each in batch order
    micro = []
    # Every example popular: no non-popular micro-batch (a piece of 0 examples).
    for popular_only, idx in ((True, order[:, :p0]), (False, order[:, p0:]))[: 1 + (p0 < b)]:
      glob = (idx + np.arange(n_dev)[:, None] * b).reshape(-1)
      mb = {"idx": idx.reshape(-1).astype(np.int32)}
      for name, t in tables.items():
        e = {"hot": t["hot_ids"][glob]}
        if not popular_only:  # the popular micro-batch never waits for the host
          e["cold"] = t["cold_ids"][glob]
        if "count" in t:
          e["count"] = t["count"][glob]
        mb[name] = e
      micro.append(mb)
    return tuple(micro)

  def _plan_profile(self, ids, train) -> dict[str, tuple[np.ndarray, np.ndarray] | None]:
    """Count this train batch; when a profile window completes, pick the hot set and plan
    the migration run at the end of this batch's update. -> {table: (rows in, rows out)}."""
    if not train:
      return {}
    if self._pending is None and (not self._picked or self.options.reprofile):
      for name, x in ids.items():
        self._rows[name].profile.add(x)
      self._since_pick += 1
      window = self.options.reprofile if self._picked else self.options.profile_batches
      if self._since_pick >= window:
        self._pending = self._choose({n: r.profile for n, r in self._rows.items()}).rows
        for r in self._rows.values():
          r.profile.reset()
        self._since_pick, self._picked = 0, True
    if self._pending is None:
      return {}
    chosen, self._pending = self._pending, None
    out = {}
    for name, new in chosen.items():
      out[name] = self._migrate(self._rows[name], new)
    # The popular share changes with the hot set: the first batch prepared for it sets the
    # popular micro-batch size again.
    self._p0 = {}
    return out

  @staticmethod
  def _migrate(r: _Rows, new: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Make `new` (sorted rows) the hot set: rows staying keep their slots. -> (rows in,
    their slots, slots out) with the row map updated for the batches after this one."""
    old_slots = np.flatnonzero(r.slot_row >= 0)
    old_rows = r.slot_row[old_slots]
    stay = np.isin(old_rows, new)
    out_slots = old_slots[~stay]
    r.row_slot[old_rows[~stay]] = -1
    r.slot_row[out_slots] = -1
    incoming = new[r.row_slot[new] < 0]
    free = np.flatnonzero(r.slot_row < 0)[: incoming.size]
    r.slot_row[free] = incoming
    r.row_slot[incoming] = free.astype(np.int32)
    out_rows = None  # (the rows leaving are read from the state's slot map)
    del out_rows
    return incoming, free, out_slots

  def _pack_migration(self, name, m) -> dict:
    r = self._rows[name]
    if m is None:
      m = (np.zeros(0, np.int64),) * 3
    incoming, slots_in, slots_out = m
    # Every migration's lists have the hot capacity's length: one more step shape per run
    # (migrations are rare; an exact-size list would recompile the step at each one).
    k_in = r.alloc if incoming.size else 0
    k_out = r.alloc if slots_out.size else 0
    return {
      # Padding: row 0 is read (in range) and dropped at slot Ha.
      "in_rows": _pad(incoming, k_in, 0),
      "in_slots": _pad(slots_in, k_in, r.alloc),
      # Padding slot Ha reads zeros; its row (from hot_rows: none) is dropped by the scatter.
      "out_slots": _pad(slots_out, k_out, r.alloc),
    }

  _BATCH_MAJOR = ("hot_ids", "cold_ids", "hot_inverse", "count")

  def prepared_spec(self, prepared):
    batch = sharding.BATCH_SPEC if self.layout.split_batch else sharding.REPLICATED
    out = {
      "tables": {
        n: {k: batch if k in self._BATCH_MAJOR else sharding.REPLICATED for k in t}
        for n, t in prepared["tables"].items()
      },
      "version": sharding.REPLICATED,
    }
    if "micro" in prepared:
      out["micro"] = jax.tree.map(lambda _: batch, prepared["micro"])
    return out

  def stats(self):
    """Since the last call, per train step: popular_fraction (examples whose ids are all
    hot), hot_coverage (ids served by a hot row), rows / bytes host -> device and back
    (cold rows), migrated rows, micro-batch sizes (all devices), plan ms on the
    input thread. Eval batches: eval_popular_fraction, eval_hot_coverage."""
    c = self._counters.take()
    out = {}
    steps = c.get("steps", 0)
    if steps:
      out.update(
        popular_fraction=c["popular"] / max(c["examples"], 1),
        hot_coverage=c["hot_ids"] / max(c["ids"], 1),
        h2d_rows_per_step=c["rows_h2d"] / steps,
        d2h_rows_per_step=c["rows_d2h"] / steps,
        # A cold row comes in and goes back once per step (rows + optimizer state).
        h2d_bytes_per_step=c["bytes_h2d"] / steps,
        d2h_bytes_per_step=c["bytes_h2d"] / steps,
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

  # --------------------------------------------------------------------------- device side

  def _hot_get(self, hot: jax.Array, slots: jax.Array) -> jax.Array:
    """hot[slots] (slots >= Ha: zeros) as a replicated array: each device gathers the slots
    it owns, a psum adds the one non-zero term per slot (exact)."""
    return row_sharded.gather_everywhere(self.mesh, sharding.BATCH, hot, slots)

  def _hot_set(self, hot: jax.Array, slots: jax.Array, values: jax.Array) -> jax.Array:
    """hot[slots] = values (replicated; slots >= Ha dropped): each device its own slots."""
    return row_sharded.scatter_everywhere(self.mesh, sharding.BATCH, hot, slots, values)

  @staticmethod
  def _local(slots: jax.Array, h: int) -> jax.Array:
    """Hot slots -> this device's local index, h (dropped / zero) where not owned."""
    return row_sharded.local_index(slots, h, sharding.BATCH)

  def _hot_lookup(self, hot: jax.Array, ids: jax.Array) -> jax.Array:
    """Rows of hot slots ids int32[B, L] (batch-split; >= Ha: zeros) -> f32[B, L, D]. Each
    device gathers the rows it owns for the ids of every device and a reduce-scatter hands
    each device its examples' rows (one non-zero term per row: exact)."""
    split = self.layout.split_batch
    ids_spec = P(sharding.BATCH, None) if split else sharding.REPLICATED
    out_spec = P(sharding.BATCH, None, None) if split else sharding.REPLICATED

    @functools.partial(
      jax.shard_map,
      mesh=self.mesh,
      in_specs=(P(sharding.BATCH, None), ids_spec),
      out_specs=out_spec,
      check_vma=False,
    )
    def local(h, ids):
      if split:
        ids = row_sharded.every(ids, sharding.BATCH)
      rows = row_sharded.gather(h, self._local(ids, h.shape[0]))
      if split:
        return row_sharded.reduce_scatter_rows(rows, sharding.BATCH)
      return row_sharded.psum_rows(rows, sharding.BATCH)

    return local(hot, ids)

  def _cold_rows(self, state, prepared, name, keys=("table",)) -> dict[str, jax.Array]:
    """The batch's cold rows (and optimizer state) from the host table: replicated
    [Uc, ...] arrays (the padding entries read row 0 ... and are never used)."""
    t = state["tables"][name]
    rows = prepared["tables"][name]["cold_rows"]
    s = t["host"]["table"].shape[0]
    rows = jnp.minimum(rows, s - 1)
    return {k: self.host.gather(t["host"][k], rows) for k in keys}

  def micro_batches(self, prepared) -> tuple[jax.Array, ...] | None:
    """The step's micro-batch feature: int32[n * Pm] per micro-batch, batch-major, each
    device's local example indices (b = padding) in the order to run them: popular first."""
    if "micro" not in prepared:
      return None
    return tuple(mb["idx"] for mb in prepared["micro"])

  def _cold(self, state, prepared) -> dict[str, dict[str, jax.Array]]:
    """The residuals: {table: the batch's cold rows and their optimizer state, gathered from
    the host table once ([Uc, D] / [Uc], replicated)}, read by the lookup and updated and
    written back by `update` (no second trip to host memory). An eval step drops them, and
    XLA with them the slots' gather."""
    return {
      name: self._cold_rows(state, prepared, name, ("table", *spec.optimizer.slot_names()))
      for name, spec in self.specs.items()
    }

  def lookup_micro(self, state, prepared) -> tuple[tuple[dict[str, jax.Array], ...], dict]:
    """-> ({table: f32[n * Pm, D]} pooled rows of each micro-batch's examples (padding:
    zeros), in `micro_batches`' order; residuals for `update`)."""
    cold = self._cold(state, prepared)
    parts = []
    for mb in prepared["micro"]:
      out = {}
      for name, spec in self.specs.items():
        e = mb[name]
        rows = self._hot_lookup(state["tables"][name]["hot"]["table"], e["hot"])
        if "cold" in e:
          c = cold[name]["table"]
          got = c.at[e["cold"]].get(mode="fill", fill_value=0.0)
          rows = jnp.where((e["cold"] < c.shape[0])[..., None], got, rows)
        count = e.get("count") if spec.pooling == "mean" else None
        out[name] = base.pool_rows(rows, count)
      parts.append(out)
    return tuple(parts), cold

  def lookup(self, state, prepared):
    if "micro" not in prepared:
      cold = self._cold(state, prepared)
      return self._lookup_whole(state, prepared, cold), cold
    parts, cold = self.lookup_micro(state, prepared)
    idx = [mb["idx"] for mb in prepared["micro"]]
    batch = next(iter(prepared["tables"].values()))["hot_ids"].shape[0]
    split = self.layout.split_batch
    pooled = {
      n: microbatch.merge(self.mesh, split, batch, idx, [p[n] for p in parts]) for n in self.specs
    }
    return pooled, cold

  def _lookup_whole(self, state, prepared, cold_rows):
    out = {}
    for name, spec in self.specs.items():
      t = prepared["tables"][name]
      rows = self._hot_lookup(state["tables"][name]["hot"]["table"], t["hot_ids"])
      cold = cold_rows[name]["table"]
      got = cold.at[t["cold_ids"]].get(mode="fill", fill_value=0.0)
      rows = jnp.where((t["cold_ids"] < cold.shape[0])[..., None], got, rows)
      out[name] = base.pool_rows(rows, t.get("count") if spec.pooling == "mean" else None)
    return out

  def update(self, state, prepared, residuals, grads):
    tables = {}
    for name, spec in self.specs.items():
      t, p = state["tables"][name], prepared["tables"][name]
      count = p.get("count") if spec.pooling == "mean" else None
      hot = self._update_hot(spec, t["hot"], p, grads[name], count)
      host = self._update_cold(spec, state, prepared, name, grads[name], count, residuals[name])
      tables[name] = self._migration({**t, "hot": hot, "host": host}, p, spec)
    return {"tables": tables, **host_cache.advance(state, prepared)}

  def _update_hot(self, spec, hot, p, g, count):
    """dense(shard=rows)'s update on the hot slots: the batch's (ids, pooled grads) on
    every device, each device updates the slots it owns (cold positions: slot Ha, dropped)."""
    slot_names = spec.optimizer.slot_names()
    keys = ["hot_ids"] + (["hot_unique", "hot_inverse"] if spec.optimizer.needs_unique else [])
    sub = {k: p[k] for k in keys}
    mean = count is not None
    count = count if mean else jnp.zeros((g.shape[0],), jnp.int32)
    split = self.layout.split_batch
    bspec = P(sharding.BATCH) if split else sharding.REPLICATED
    p_specs = {k: bspec if k in self._BATCH_MAJOR else sharding.REPLICATED for k in sub}
    row_spec = {"table": P(sharding.BATCH, None), **{s: P(sharding.BATCH) for s in slot_names}}
    bag = p["hot_ids"].shape[1]

    @functools.partial(
      jax.shard_map,
      mesh=self.mesh,
      in_specs=(row_spec, p_specs, bspec, bspec),
      out_specs=row_spec,
      check_vma=False,
    )
    def local(hot, sub, g, count):
      if split:
        every = functools.partial(row_sharded.every, axis=sharding.BATCH)
        sub = {k: every(v) if k in self._BATCH_MAJOR else v for k, v in sub.items()}
        g, count = every(g), every(count)
      grads = base.unpool(g, count if mean else None, bag)
      h = hot["table"].shape[0]
      lp = {"ids": self._local(sub["hot_ids"], h)}
      if "hot_unique" in sub:
        lp["unique"] = self._local(sub["hot_unique"], h)
        lp["inverse"] = sub["hot_inverse"]
      slots = {k: hot[k] for k in slot_names}
      table, slots = row_sharded.update(spec, hot["table"], slots, lp, grads)
      return {"table": table, **slots}

    return local(hot, sub, g, count)

  def _update_cold(self, spec, state, prepared, name, g, count, got):
    """The cold rows' update on the copy the lookup gathered (`got`, replicated: every device
    applies the same), then written back to the host table (each device its own rows when it
    is split)."""
    t, p = state["tables"][name], prepared["tables"][name]
    slot_names = spec.optimizer.slot_names()
    g, ids, count = sharding.replicate((g, p["cold_ids"], count), self.mesh)
    grads = base.unpool(g, count, ids.shape[1])
    uc = p["cold_rows"].shape[0]
    lp = {"ids": ids}
    if spec.optimizer.needs_unique:
      # The distinct cold rows are the gathered rows themselves; cold_ids index them, and
      # every other position points at the filler entry uc (read as zeros, never written).
      lp["unique"] = jnp.arange(uc + 1, dtype=jnp.int32)
      lp["inverse"] = ids
    slots = {k: got[k] for k in slot_names}
    table, slots = base.sparse_sgd_or_adagrad(spec, got["table"], slots, lp, grads)
    host = dict(t["host"])
    new = {"table": table, **slots}
    for k in host:
      host[k] = self.host.scatter(host[k], p["cold_rows"], new[k])
    return host

  def _migration(self, t, p, spec):
    """Rows leaving the hot set -> host; rows joining it <- host (after this batch's cold
    write-back, so a row cold in this batch and hot from the next moves its new value)."""
    if p["in_rows"].shape[0] == 0 and p["out_slots"].shape[0] == 0:
      return t
    n = spec.num_rows
    hot, host = dict(t["hot"]), dict(t["host"])
    hot_rows = t["hot_rows"]
    if p["out_slots"].shape[0]:
      rows = hot_rows.at[p["out_slots"]].get(mode="fill", fill_value=n)
      rows = jnp.where(rows < n, rows, base.aligned_rows(n))  # empty / padding: dropped
      for k in hot:
        host[k] = self.host.scatter(host[k], rows, self._hot_get(hot[k], p["out_slots"]))
      hot_rows = hot_rows.at[p["out_slots"]].set(n, mode="drop")
    if p["in_rows"].shape[0]:
      for k in hot:
        hot[k] = self._hot_set(hot[k], p["in_slots"], self.host.gather(host[k], p["in_rows"]))
      hot_rows = hot_rows.at[p["in_slots"]].set(p["in_rows"], mode="drop")
    return {**t, "hot": hot, "host": host, "hot_rows": hot_rows}
