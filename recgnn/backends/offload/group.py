"""`OffloadGroup`: the offload tables of one plan rule, planned together by the compiled kernel
(the registered `offload` backend)."""

from __future__ import annotations

import functools

import jax
import numpy as np

from recgnn import sharding
from recgnn.backends.offload import cache_plan, call_lists, host_side, row_resets, stacked_batch
from recgnn.backends.offload import planner as hostplan
from recgnn.backends.offload.cache_plan import EVICT_SLOTS, LOAD_SLOTS, NEXT_FROM_NOW
from recgnn.backends.offload.device_step import DeviceStep
from recgnn.backends.offload.disk_rows import source_of
from recgnn.backends.offload.fast_plan import SteadyPlanner
from recgnn.backends.offload.planned import Planned
from recgnn.backends.offload.stacked_batch import ABSENT
from recgnn.backends.offload.table import Offload
from recgnn.embeddings import base, host_cache, host_tier, streamed

# Padding of a group's exchange lists, per row (EVICT_SLOTS, EVICT_ROWS, LOAD_ROWS,
# LOAD_SLOTS, NEXT_FROM_NOW): past every table's window, never read as a table's entry.
FILL = (ABSENT, ABSENT, 0, ABSENT, ABSENT)


@base.register_backend("offload")
class OffloadGroup(base.TableGroup):
  """The offload tables of one plan rule: `TableGroup` with the planning of a train batch
  done for every table at once by the compiled kernel (`recgnn.backends.offload.planner.plan_step`),
  and the device state and step of the whole group: one cache array per stack of tables
  (dim, optimizer), so a stack's lookup, sparse update and exchanges are one op each
  whatever its number of tables (the package docstring: "One cache per stack").

  Three objects, one phase each: the compiled steady-state planner (`fast_plan.SteadyPlanner`,
  the numpy planners of the members otherwise), the host tier (`host_side.HostSide`: the
  rows read for a step and written back, in RAM or behind the SSD level's host cache) and
  the device step (`device_step.DeviceStep`); this class keeps the state, the exchange lists
  (one per stack and direction) and the checkpoint hand-over (sync / export / restore).
  """

  capabilities = Offload.capabilities

  def __init__(self, specs, mesh, layout: base.Layout | None = None, text: str = "", **options):
    super().__init__(Offload, specs, mesh, layout, text, **options)
    # One stack per row layout and optimizer (its tables' caches in ONE device array, table
    # after table: one gather, one sparse update, one set of exchange kernels for all of
    # them, as FBGEMM's table-batched embeddings; one optimizer, as the update is one) and
    # one exchange list per stack and direction: the step's shapes are one (now, next)
    # length pair per stack, sized over its tables together (their total moves little from
    # batch to batch; each table sized apart changed the step's signature every few steps).
    self._stacks = host_tier.layouts({n: m.spec for n, m in self.members.items()}, True)
    self._index = {n: i for i, n in enumerate(self.members)}  # in the version / stale vectors
    # Each table's first slot in its stack's cache, and the stack's rows (the last entry).
    self._slot_off = [
      np.cumsum([0] + [self.members[n].cache_rows for n in names]).astype(np.int64)
      for names in self._stacks
    ]
    self._stack_idx = [np.array([self._index[n] for n in s], np.int64) for s in self._stacks]
    # Per-table counts of the steady planner and of the lists, one add per batch for all
    # tables ({key: float64[T] or a scalar for each}), handed to the members by `stats`.
    self._table_counters = host_cache.Counters()
    self._steady = SteadyPlanner(self.members, self.lookahead, self._table_counters)
    self._step = DeviceStep(self._stacks, self.specs, self.mesh)
    self._syncer = host_cache.StaleCheck(f"offload (tables {', '.join(self.members)})", "cache")
    self._sizers = []
    self.list_widths: set[tuple[int, int]] = set()  # (now, next) lengths of train steps
    self._list_counters = host_cache.Counters()
    self._ring_rows: list[int] = []  # per stack, the rings' rows (`expect_batches`)
    # The host tier: the tables' rows in host RAM, what each step loads and writes back.
    self._tier = host_side.HostSide(
      f"offload (tables {', '.join(self.members)})",
      self._stacks,
      self.specs,
      self._index,
      next(iter(self.members.values())).options if self.members else None,
      self.layout.steps_per_call,
    )

  # -- state: one cache array per stack; the planners' arrays as slices of flat ones

  def state_sharding(self):
    """{"cache": per stack {"table": .., slot: ..}, "ring": per stack, the same (the recent
    write-backs, `host_tier.Recent`), "slot_rows": per stack, "version", "stale"}: the
    caches, rings, slot maps and counters replicated in device memory (every device holds
    the same cache, so lookups of its examples are local, and applies the same update to it:
    exact, as `dense` replicated). The host tables are not state: numpy, in the group's
    host tier, never an argument of the step."""
    dev = jax.sharding.NamedSharding(self.mesh, sharding.REPLICATED, memory_kind="device")
    caches = tuple(
      {k: dev for k in ("table", *self.specs[names[0]].optimizer.slot_names())}
      for names in self._stacks
    )
    return {
      "cache": caches,
      "ring": caches,
      "slot_rows": tuple(dev for _ in self._stacks),
      "version": dev,
      "stale": dev,
    }

  def _state(self, host: dict) -> dict:
    """The group's state: empty caches (stacked: table after table at `_slot_off`), rings of
    recent write-backs (zeros: a slot is read only once a step wrote it) at the rows
    `expect_batches` was told train batches need, or at zero rows (the first train step
    sizes them), and zero counters; `host` (each table's numpy arrays) goes to the host
    tier."""
    parts = {n: m.empty_cache() for n, m in self.members.items()}
    caches, slot_rows = [], []
    for names in self._stacks:
      caches.append(
        {k: np.concatenate([parts[n]["cache"][k] for n in names]) for k in parts[names[0]]["cache"]}
      )
      slot_rows.append(np.concatenate([parts[n]["slot_rows"] for n in names]))
    t = len(self.members)
    rows = self._ring_rows or [0] * len(caches)  # (`expect_batches`)
    rings = tuple(
      {k: np.zeros((r,) + v.shape[1:], v.dtype) for k, v in c.items()} for r, c in zip(rows, caches)
    )
    dev = {
      "cache": tuple(caches),
      "ring": rings,
      "slot_rows": tuple(slot_rows),
      "version": np.zeros(t, np.int32),
      "stale": np.zeros(t, np.int32),
    }
    if host is not None:
      self._tier.set_tables([host[n] for n in self.members])
    return sharding.put(dev, self.state_sharding())

  def init(self, key):
    if self._tier.disk:  # the SSD level: each row file written a chunk at a time, O(chunk)
      keys = [base.table_key(key, n) for n in self.members]
      return self._fill(
        [lambda a, n, m=m, k=k: m.init_chunk(k, a, n) for m, k in zip(self.members.values(), keys)]
      )
    state = self._state({n: m.init(base.table_key(key, n)) for n, m in self.members.items()})
    self._adopt()
    return state

  def _fill(self, sources):
    """The SSD level's state: each row file written from sources[t](first, n) -> {"table",
    slot: its rows [first, first + n)}, a chunk at a time; empty caches."""
    for m in self.members.values():
      m.reset_planner()
    self._tier.rows.fill(sources)
    state = self._state(None)
    self._adopt()
    return state

  def reads_streams(self) -> bool:
    return self._tier.disk

  def import_(self, logical):
    """logical[n]: the "rows" form's arrays, or (the SSD level) a `streamed.TableReader`
    read a chunk at a time into the new row file (a restore never holds the table)."""
    if self._tier.disk:
      return self._fill([source_of(logical[n]) for n in self.members])
    state = self._state({n: m.import_(logical[n]) for n, m in self.members.items()})
    self._adopt()
    return state

  def restore(self, state):
    """Reset host bookkeeping to a state's caches (history of LRU/LFU is lost); the host
    tables are the group's, after every write-back handed over."""
    self._syncer.check(state)
    self._tier.drain()
    version = np.asarray(jax.device_get(state["version"]))
    for s, names in enumerate(self._stacks):
      slot_rows = np.asarray(jax.device_get(state["slot_rows"][s]))
      for n, (a, b) in zip(names, self._slices(s)):
        self.members[n].restore_planner(slot_rows[a:b], int(version[self._index[n]]))
    self._adopt()
    return state

  def _slices(self, stack: int) -> list[tuple[int, int]]:  # each table's rows of the cache
    off = self._slot_off[stack]
    return [(int(off[i]), int(off[i + 1])) for i in range(len(off) - 1)]

  def sync(self, state):
    """Every write-back handed over applied, then every resident cache row written to the
    host tables (O(C), a host read of the caches); the caches and the state stay."""
    self._syncer.check(state)
    self._tier.drain()
    for s, names in enumerate(self._stacks):
      slot_rows = np.asarray(jax.device_get(state["slot_rows"][s]))
      cache = state["cache"][s]
      # (a streamed.CHUNK_BYTES piece of the cache at a time: O(chunk) host memory)
      step = streamed.chunk_rows(self.specs[names[0]].row_bytes)
      for n, (a, b) in zip(names, self._slices(s)):
        for i in range(a, b, step):
          j = min(i + step, b)
          piece = host_tier.rows_to_host(cache, i, j, step)
          self._tier.write_resident(n, slot_rows[i:j], piece)
    return state

  def export(self, state):
    """{table: its "rows" form}: copies of the host arrays, or (the SSD level) each row file
    as a `streamed.StreamedTable` (read a chunk at a time when the checkpoint writes it)."""
    self._syncer.check(state)
    self._tier.drain()
    if self._tier.disk:
      return {n: self._tier.stream(n) for n in self.members}
    return {n: m.export(self._tier.table(n)) for n, m in self.members.items()}

  def tables(self, state):
    self._tier.drain()
    out = {}
    for s, names in enumerate(self._stacks):
      slot_rows = np.asarray(jax.device_get(state["slot_rows"][s]))
      cache = np.asarray(jax.device_get(state["cache"][s]["table"]))
      for n, (a, b) in zip(names, self._slices(s)):
        out[n] = self.members[n].table_of(self._tier.table(n), slot_rows[a:b], cache[a:b])
    return out

  def _stack_caps(self, stack: int, ids_shapes) -> dict[str, int]:
    """A stack's tables' most loads per batch for train ids shaped `ids_shapes` (min(ids
    per batch, C) each; a table not in ids_shapes left out): what `_lists` caps its lists at
    and the host tier sizes its ring by (`HostSide.ring_rows`)."""
    return {
      n: min(int(np.prod(ids_shapes[n])), self.members[n].cache_rows)
      for n in self._stacks[stack]
      if n in ids_shapes
    }

  def batch_memory(self, ids_shapes):
    """The device ring of recent write-backs (`_ring_rows`, with its optimizer state),
    replicated on every device; each table's share by its most loads per batch."""
    out = {}
    for stack in range(len(self._stacks)):
      caps = self._stack_caps(stack, ids_shapes)
      rows = self._tier.ring_rows(stack, sum(caps.values()))
      total = max(sum(caps.values()), 1)
      for n in caps:
        out[n] = int(rows * caps[n] / total) * self.specs[n].row_bytes
    return out

  def expect_batches(self, ids_shapes):
    """Rings of states built from now on at the rows train batches shaped `ids_shapes` need
    (as `HostSide.stage` sizes the host's), not zero rows, which the first train step resized:
    a second compile of the whole step (with k per call, a first step outside the scan)."""
    for n in (n for n in self.members if n in ids_shapes):  # (the plan's order: one message)
      self.members[n].check_batch(ids_shapes[n])
    self._ring_rows = [
      self._tier.ring_rows(s, sum(caps.values()))
      if len(caps := self._stack_caps(s, ids_shapes)) == len(names)
      else 0
      for s, names in enumerate(self._stacks)
    ]

  def host_write_seconds(self) -> float:
    """Seconds the host writer spent writing rows back (not waiting), after every hand-over."""
    self._tier.drain()
    return self._tier.rows.write_seconds

  def after_update(self, state, to_host=None, steps=1):
    """The step's evicted rows (TO_HOST: per stack {"now" / "next": {k: f32[W, ...]}}; k steps:
    [k, W, ...]) to the host writer (`HostSide.hand_over`); O(1), no wait for the step."""
    if to_host is None:
      state, to_host = base.split_to_host(state)
    self._tier.hand_over(to_host, steps)
    return state

  def planned_to_host(self, prepared):  # (prepare-only drivers: their steps never run)
    return host_side.zero_write_backs(prepared)

  def stack_call(self, prepared):
    """A call's k train batches with each stack's lists of one width (`call_lists`)."""
    out, added = call_lists.one_width(prepared, FILL, host_tier.ABSENT)
    if added:
      self._list_counters.add(padded_rows_h2d=added)
    for p in out:
      self.list_widths.update(tuple(e[k].shape[1] for k in ("now", "next")) for e in p["lists"])
    return out

  def _adopt(self):
    self._tier.reset()
    # New cache bookkeeping: the lists start from the cap again (`Sizer(start_at_cap)`).
    self._sizers = [
      {k: cache_plan.Sizer(cache_plan.PATIENCE, start_at_cap=True) for k in ("now", "next")}
      for _ in self._stacks
    ]
    self._steady.adopt()

  @property
  def fast_batches(self) -> int:  # batches planned by the compiled kernel (tests, benchmarks)
    return self._steady.fast_batches

  # -- prepare

  def prepare(self, ids, upcoming=(), *, train=True):
    """ids {table: int[B, L]} -> {"batch": per stack, every table's batch stacked
    (`stacked_batch`: slots of the stack's cache), "version": int32[T] (each table's plan's,
    -1: read-only), "lists": per stack (`host_tier.layouts(.., by_optimizer=True)`), {"now":
    int32[4, Wn], "now_off": int32[T + 1], "next": int32[5, Wx], "next_off": int32[T + 1]:
    every table's exchange in one list (table i's at [off[i], off[i + 1]), its own rows, the
    stack's slots: `stacked_batch.segments`), and the host tier's part (`HostSide.stage`):
    "now_rows" / "next_rows" {k: f32[W, ...]} the rows loaded, read from the host tables
    here; "now_src" / "next_src" int32[W] ring slots; train: "now_dst" / "next_dst"
    int32[W], "ring" int32[0, V]}. Each table plans as `Offload.prepare` (`table_batch` /
    `table_exchanges` give its part back as it planned it)."""
    return self.prepare_ahead(ids, upcoming, train=train)()

  @property
  def splits_prepare(self) -> bool:
    """Whether `prepare_ahead` leaves the lists and the host reads to its second half (not
    at the SSD level, whose read-ahead reads the planners' state after the batch's plan)."""
    return not self._tier.disk

  def prepare_ahead(self, ids, upcoming=(), *, train=True):
    """`prepare` in two halves, each called in stream order (`recgnn.train.plan_ahead`: the
    first on the trainer's planning thread, the second on its input thread): the planning
    of every table (the planners' state), its lists and stacked batch (`_lists`) now; -> a
    callable making the rest, the host tier's part (`_stage`: its ring and its waits for
    write-backs, run ahead of the steps by the input thread's run-ahead). The
    second half reads only what its first half returned, never the planners' state, so the
    planning of later batches may run meanwhile (the SSD level: all of it now,
    `splits_prepare`)."""
    planned = None
    if train and self._steady.ready and hostplan.enabled():
      planned = self._steady.plan(ids, list(upcoming))
    if planned is None:
      if train:
        self._steady.forget()
      planned = Planned.of_tables(super().prepare(ids, upcoming, train=train), self.members)
    # The lists and the stacked batch depend on the plan only: made here, on the planning
    # thread (which waited for the input thread ~28% of the time), not in the second half.
    built, caps = self._lists(planned, train)
    if self.splits_prepare:
      return functools.partial(self._stage, built, caps, train)
    out = self._stage(built, caps, train)
    if train:  # (the SSD level: the window's rows read ahead into the host cache)
      self._tier.read_ahead(upcoming, {n: m.planner for n, m in self.members.items()})
    return lambda: out

  # -- one exchange list per stack (row layout and optimizer)

  def _width(self, stack: int, kind: str, need: int | None, cap: int) -> int:
    """Length of a layout's exchange list ("now" or "next") under the `exchange` option.
    need: the rows it loads over the layout's tables (evictions never outnumber them: each
    victim slot receives a missing row), None when no table planned one; cap: the most it
    can load, the sum of min(ids per batch, C) over its tables. Both planners go through
    here (their prepared batches stay equal)."""
    mode = next(iter(self.members.values())).options.exchange
    # Nothing planned: empty, except a "next" of a run with look-ahead (the last batch of a
    # stream, or one before a batch that is not admitted ahead): the steady shapes, so it
    # does not compile a train step of its own.
    steady = kind == "next" and self.lookahead > 0
    if mode == "fixed":
      return cap if need is not None or steady else 0
    if mode == "pow2":
      return min(cache_plan.pow2_bucket(need or 0), cap)
    sizer = self._sizers[stack][kind]
    if need is None:
      return sizer.hold(cap) if steady else 0
    return sizer(need, cap)

  def _lists(self, planned: Planned, train: bool) -> tuple[dict, list[int]]:
    """Each stack's exchange lists (its tables' exchanges one after another, `_width` long:
    `stacked_batch.segments`) and its batch (`stacked_batch.stack`) -> ({"batch", "version",
    "lists"}, the lists without the host tier's part (`_stage`); each stack's most loads
    per batch, the sum of min(ids per batch, C) over its tables)."""
    lists, stack_caps = [], []
    padded = 0
    shares = np.zeros(len(self.members))
    for stack, idx in enumerate(self._stack_idx):
      slot_off = self._slot_off[stack]
      caps = np.minimum(planned.ids.n[idx], np.diff(slot_off))
      entry = {}
      for j, (kind, fill) in enumerate((("now", FILL[:4]), ("next", FILL))):
        src = planned.lists[kind]
        c = src.n[idx]
        off = np.concatenate([[0], np.cumsum(c)]).astype(np.int32)
        if train:
          need = int(off[-1]) if planned.exchange_planned[idx, j].any() else None
          width = self._width(stack, kind, need, int(caps.sum()))
        else:  # read-only: the batch's cold rows on demand, at most its ids (one shape)
          width = int(planned.ids.n[idx].sum()) if kind == "now" else 0
        lst = np.repeat(np.asarray(fill, np.int32)[:, None], width, axis=1)
        stacked_batch.segments(src, idx, slot_off, lst, entry.get("now_off"))
        entry[kind], entry[f"{kind}_off"] = lst, off
        if train:
          padded += width
          # Each table's share of the list (its rows and of the padding, by its rows), so
          # the tables' h2d_padded_bytes_per_step add up to the list's.
          total = int(off[-1])
          share = c / total if total else np.full(len(idx), 1 / len(idx))
          shares[idx] += c + (width - total) * share
      stack_caps.append(int(caps.sum()))
      lists.append(entry)
      if train:
        self.list_widths.add(tuple(entry[k].shape[1] for k in ("now", "next")))
    if train:
      self._list_counters.add(steps=1, padded_rows_h2d=padded)
      self._table_counters.add(padded_rows_h2d=shares)  # (one add per batch, all tables)
    batch = stacked_batch.stack(self._stacks, self._slot_off, self.specs, planned, lists, ABSENT)
    return {"batch": batch, "version": planned.version, "lists": tuple(lists)}, stack_caps

  def _stage(self, built: dict, caps: list[int], train: bool) -> dict:
    """`_lists`'s prepared batch with the host tier's part of each stack's lists (in place:
    `HostSide.stage`), its write-backs planned for the step (train)."""
    writes = [
      self._tier.stage(entry, stack, train, cap, self._list_counters)
      for stack, (entry, cap) in enumerate(zip(built["lists"], caps))
    ]
    if train:
      self._tier.plan(writes)
    return built

  def table_batch(self, prepared: dict, table: str) -> dict[str, np.ndarray]:
    """A prepared batch of one table as `Offload.prepare` planned it: {"ids": int32[B, L]
    (its own slots, C = padding), "now_pos": int32[B, L], "version": int32[]}
    (`stacked_batch.stack` undone). Host side (tests, inspection)."""
    stack, i, bag, j = stacked_batch.bag_of(self._stacks, prepared, table)
    first, c = int(self._slot_off[stack][i]), self.members[table].cache_rows
    ids = np.asarray(bag["ids"])[:, j]
    return {
      "ids": np.where(ids == ABSENT, c, ids - first),
      "now_pos": np.asarray(bag["now_pos"])[:, j],
      "version": np.asarray(prepared["version"])[self._index[table]],
    }

  def place_resets(self, prepared, resets):
    """RowReset (a dynamic table in front): where each row the batch just prepared reuses
    is in its step (`row_resets.place`)."""
    return prepared, row_resets.place(self._stacks, self.specs, prepared, resets)

  def reset_rows(self, state, resets):
    """Inside the step: the cache slots `place_resets` named set (`DeviceStep.reset_rows`)."""
    return self._step.reset_rows(state, resets)

  def table_exchanges(self, prepared: dict, table: str) -> dict[str, np.ndarray]:
    """A prepared batch's exchanges of one table, as `Offload.prepare` planned them: {"now":
    int32[4, n], "next": int32[5, m]} (its segments of its stack's lists, slots its own
    (C: padding), NEXT_FROM_NOW as positions in its "now" (n: absent); `stacked_batch.segments`
    undone). Host side (tests, inspection)."""
    stack, i, _, _ = stacked_batch.bag_of(self._stacks, prepared, table)
    lists = prepared["lists"][stack]
    first, c = int(self._slot_off[stack][i]), self.members[table].cache_rows
    out = {}
    for kind in ("now", "next"):
      off = np.asarray(lists[f"{kind}_off"])
      seg = np.array(lists[kind])[:, off[i] : off[i + 1]]
      for r in (EVICT_SLOTS, LOAD_SLOTS):
        seg[r] = np.where(seg[r] == ABSENT, c, seg[r] - first)
      if kind == "next":
        now_off = np.asarray(lists["now_off"])
        pos = seg[NEXT_FROM_NOW]
        seg[NEXT_FROM_NOW] = np.where(pos == ABSENT, now_off[i + 1] - now_off[i], pos - now_off[i])
      out[kind] = seg
    return out

  def prepared_spec(self, prepared):
    """The bags' leaves are batch-major (axis 0: the batch) when the layout splits the
    batch; "unique", the versions and the lists are global."""
    batch = sharding.BATCH_SPEC if self.layout.split_batch else sharding.REPLICATED
    return {
      "batch": tuple(
        {
          "bags": jax.tree.map(lambda _: batch, s["bags"]),
          **({"unique": sharding.REPLICATED} if "unique" in s else {}),
        }
        for s in prepared["batch"]
      ),
      "version": sharding.REPLICATED,
      # (the lists and the rows read from the host: every device gets them whole)
      "lists": jax.tree.map(lambda _: sharding.REPLICATED, prepared["lists"]),
    }

  def stats(self):
    """Every table's (`Offload.stats`), and the group's: list_rows_h2d_per_step (the rows
    the host reads move per step, padding included: what the host link carries),
    list_shapes (the distinct (now, next) list lengths so far: the step's shapes)."""
    # (on the main thread at each log: one add per table, not one per table and key)
    c = self._table_counters.take()
    cols = {k: np.broadcast_to(v, (len(self.members),)).tolist() for k, v in c.items()}
    for i, m in enumerate(self.members.values()):
      if cols:
        m.add_counters(**{k: v[i] for k, v in cols.items()})
    out = super().stats()
    c = self._list_counters.take()
    if c.get("steps"):
      out["list_rows_h2d_per_step"] = c["padded_rows_h2d"] / c["steps"]
      out["list_shapes"] = len(self.list_widths)
      # Rows loaded from the device ring of recent write-backs, not the host (their
      # write-back may have been in flight when their step was prepared).
      out["ring_rows_per_step"] = c.get("ring_rows", 0) / c["steps"]
    if self._tier.disk:  # the SSD level: its host cache and the disk (`DiskRows.stats`)
      out.update(self._tier.rows.stats(c.get("steps", 0)))
    return out

  # -- the step (`DeviceStep`: per stack, one host read per exchange, one gather, one sparse
  # update, one set of exchange kernels and one write-back for all of its tables)

  def lookup(self, state, prepared):
    return self._step.lookup(state, prepared)

  def update(self, state, prepared, residuals, grads):
    return self._step.update(state, prepared, residuals, grads)
