"""`Offload`: one table in host memory behind a device cache (the per-table member of
`OffloadGroup`; see the package docstring). Holds one concern: the table's host planning
(`prepare`), its host arrays and its memory. Its cache is a slice of its stack's one cache
array and its device code is the group's (one op per stack, not per table)."""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import numpy as np

from recgnn.backends.offload import row_file
from recgnn.backends.offload.cache_plan import (
  EVICT_ROWS,
  Exchange,
  Planner,
  _pad,
)
from recgnn.backends.offload.options import OffloadOptions
from recgnn.embeddings import base, host_cache

# Key of a per-table prepared batch, popped by the group: (now, next) whether each exchange
# was planned (an unplanned "next" keeps the steady list length).
PLANNED = "planned"


class Offload(base.TableBackend):
  """Table in host memory, a C-row device cache filled ahead of the step (cDLRM). Options:
  `OffloadOptions`.

  Exchanges (`exchange=`, `OffloadOptions`): the group (`OffloadGroup`) lays every table's
  out in one list per stack (dim, optimizer) and direction, sized by the group's real
  misses (`bucket`, the default: ~1.05-1.2x the missed rows over the host link, a few step
  shapes for a 26-table group) or padded to the batch (`fixed`). This class plans the
  table's exchanges (exact lengths, its own slots 0..C-1); the group moves them into the
  stack's slots, reads and writes the host arrays and runs the step on the stack's cache.

  A batch touching more distinct rows than the cache holds is an error at plan time that
  names the size needed (no micro-batching: exactness vs dense needs the whole batch's update
  at once).
  """

  name = "offload"  # the member class; `OffloadGroup` is what the registry names
  Options = OffloadOptions
  # The cache plan is global; the step returns the rows it evicts (TO_HOST); reused rows are
  # reset by the group (`OffloadGroup.place_resets`, `reset_rows`).
  capabilities = base.Capabilities(
    plans_globally=True, writes_host=True, stacks_calls=True, resets_rows=True
  )
  batch_major = ("ids", "inverse", "now_pos")

  def __init__(self, spec: base.TableSpec, mesh, layout: base.Layout | None = None, **options):
    super().__init__(spec, mesh, layout, **options)
    o = self.options
    if o.cache_rows is not None:
      rows = o.cache_rows
    else:
      rows = max(math.ceil(o.cache_fraction * spec.num_rows), o.min_cache_rows)
    self.cache_rows = min(rows, spec.num_rows)
    self.lookahead = o.lookahead
    if not all(d.process_index == jax.process_index() for d in mesh.devices.flat):
      raise ValueError(
        f"offload (table {spec.name!r}) runs within one process: its host table and planner "
        "live in this process's memory; a mesh over several processes needs a table split "
        "per process (not built yet). Use dense / dense(shard=rows) for this table, or run "
        "one process."
      )
    self._planner: Planner | None = None  # O(N) host bookkeeping: allocated by init
    self._counters = host_cache.Counters()
    self._window_cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}

  def check_batch(self, shape: tuple[int, ...]) -> None:
    """Refuse, before anything is allocated, a cache smaller than the distinct rows a train
    batch of ids `shape` ([B, L]) can touch: B x L, at most the table's rows."""
    bound = self.spec.distinct_rows(shape)
    if self.cache_rows >= bound:
      return
    o = self.options
    fix = (
      f"cache_rows={bound}" if o.cache_rows is not None
      else f"min_cache_rows={bound} beside cache_fraction={o.cache_fraction}"
    )  # fmt: skip
    raise ValueError(
      f"offload (table {self.spec.name!r}): a train batch of {shape[0]:,} examples x "
      f"{math.prod(shape[1:])} ids can touch {bound:,} distinct rows, but its device cache "
      f"holds {self.cache_rows:,} ({self.describe()}). Use offload({fix}, ...), or a smaller "
      "batch."
    )

  def describe(self) -> str:
    o = self.options
    if o.cache_rows is not None:
      size = f"cache_rows={o.cache_rows}"
    else:
      size = f"cache_fraction={o.cache_fraction}"
      size += f", min_cache_rows={o.min_cache_rows}" if o.min_cache_rows else ""
    extra = "" if o.exchange == "bucket" else f", exchange={o.exchange}"
    if o.storage_dir is not None:
      extra += f", host_cache={o.host_cache}, storage='{o.storage}'"
      extra += f", io={o.io}" if o.io != "direct" else ""
    return f"offload({size}, policy={o.policy}, lookahead={self.lookahead}{extra})"

  offloaded = True  # (every offload table's rows are in host RAM)

  # --------------------------------------------------------------------------- placement

  # The table's device state lives in its group's (`OffloadGroup`): its cache rows as a
  # slice of its stack's one cache array (every table of the group with its dim and
  # optimizer: one gather, one update, one exchange per stack in the step); its host arrays
  # are numpy, in the group's `host_tier.HostRows` (never an argument of the step). This
  # class gives its parts: the host arrays, an empty cache, and its planner's reset.

  def state_sharding(self):
    return {}

  def init_host(self, key) -> dict:
    """The table's initial host arrays (numpy): {"table": f32[S, D], slot: f32[S]}, with S =
    base.aligned_rows(N) (the checkpoint's logical shape; the padding rows are never
    addressed by an id)."""
    spec = self.spec
    opt = spec.optimizer
    pad = base.aligned_rows(spec.num_rows) - spec.num_rows
    table = base.init_table(key, spec)
    host = {"table": np.concatenate([table, np.zeros((pad, spec.dim), np.float32)])}
    host.update(
      {s: np.full(spec.num_rows + pad, opt.initial_accumulator, np.float32)
       for s in opt.slot_names()}
    )  # fmt: skip
    return host

  def init(self, key):
    """The table's host arrays (numpy) and a fresh planner (its cache: `empty_cache`)."""
    return self.fresh(self.init_host(key))

  def init_chunk(self, key, first: int, n: int) -> dict:
    """Rows [first, first + n) of `init_host`'s arrays, O(n) (the SSD level writes its row
    file a chunk at a time: `base.init_rows` draws the same rows as the whole table)."""
    spec = self.spec
    stop = min(first + n, spec.num_rows)
    table = np.zeros((n, spec.dim), np.float32)
    if stop > first:
      table[: stop - first] = base.init_rows(key, spec, first, stop)
    out = {"table": table}
    acc = spec.optimizer.initial_accumulator
    out.update({s: np.full(n, acc, np.float32) for s in spec.optimizer.slot_names()})
    return out

  @property
  def planner(self) -> Planner | None:
    """The host bookkeeping of the cache (None until `init` / `restore_planner`)."""
    return self._planner

  def reset_planner(self) -> None:
    """New host bookkeeping (an empty cache: the group pairs it with `empty_cache`)."""
    self._planner = Planner(self.spec.num_rows, self.cache_rows, self.options.policy)
    self._window_cache.clear()

  def fresh(self, host: dict) -> dict:
    """`host` (the whole table: numpy, or arrays restored from a checkpoint) as writable numpy
    arrays (one copy, O(N), at init / restore only); new host bookkeeping (an empty cache:
    the group pairs it with `empty_cache`)."""
    self.reset_planner()
    return {k: np.array(jax.device_get(v), np.float32) for k, v in host.items()}

  def empty_cache(self) -> dict:
    """An empty cache (numpy): {"cache": {"table": f32[C, D], slot: f32[C]}, "slot_rows":
    int32[C] (N: empty)}; the group stacks these per stack."""
    spec, c = self.spec, self.cache_rows
    opt = spec.optimizer
    cache = {"table": np.zeros((c, spec.dim), np.float32)}
    cache.update({s: np.full(c, opt.initial_accumulator, np.float32) for s in opt.slot_names()})
    return {"cache": cache, "slot_rows": np.full(c, spec.num_rows, np.int32)}

  def row_sharding(self):
    repl = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
    return repl, repl

  def export(self, host: dict):
    """The logical form of the host arrays after the group's `sync` (every resident row
    written back): copies, as the writer keeps writing the arrays while a checkpoint saves."""
    return {
      "rows": host["table"].copy(),
      **{k: host[k].copy() for k in self.spec.optimizer.slot_names()},
    }

  def import_(self, logical):
    """The table in host memory (placed), new bookkeeping: its cache starts empty and refills
    from the next batch (hit rates restart, values do not change)."""
    host = {"table": logical["rows"], **{k: logical[k] for k in self.spec.optimizer.slot_names()}}
    return self.fresh(host)

  def memory(self):
    spec, c = self.spec, self.cache_rows
    # Its rows of the stack's cache + optimizer state and slot map, and its entries of the
    # group's version / stale vectors (int32 each).
    device = c * spec.row_bytes + c * 4 + 8
    planner = spec.num_rows * (
      4 + (8 if self.options.policy == "lfu" else 0)
    )  # row->slot (+ counts)
    # One host copy in all (numpy, this process's RAM); its rows aligned as the
    # checkpoint's logical shape is (`init_host`); the device ring of recent write-backs is
    # the batch's (`OffloadGroup.batch_memory`).
    table = base.aligned_rows(spec.num_rows) * spec.row_bytes
    if self.options.storage_dir is None:
      host = table + planner
      return base.MemoryReport(
        device, host, f"host RAM + {c}-row device cache ({self.options.policy})"
      )
    # The SSD level: the row file (records padded to the disk's block: `record_bytes`), a
    # host cache of H records with its planner (row -> slot int32[S], per slot its row,
    # recency and dirty bit), the device cache above.
    h, rec = self.host_cache_rows, self.record_bytes
    host = h * rec + base.aligned_rows(spec.num_rows) * 4 + h * 17 + planner
    disk = row_file.HEADER_BYTES + base.aligned_rows(spec.num_rows) * rec
    return base.MemoryReport(
      device, host,
      f"{self.options.storage_dir} + {h}-row host cache + {c}-row device cache "
      f"({self.options.policy})", disk,
    )  # fmt: skip

  @property
  def host_cache_rows(self) -> int:
    """Rows of the host cache at the SSD level (`host_cache`: a fraction of the rows)."""
    return self.options.host_cache_rows(self.spec.num_rows)

  @property
  def record_bytes(self) -> int:
    """Bytes per row in the row file at the SSD level (`row_file.record_bytes`)."""
    o = self.options
    return row_file.record_bytes(self.spec.dim, len(self.spec.optimizer.slot_names()), o.io,
                                 o.storage_dir)  # fmt: skip

  # --------------------------------------------------------------------------- host side

  def _unique(self, ids: np.ndarray) -> np.ndarray:
    """Sorted distinct non-padding ids, memoised for the arrays of the look-ahead window
    (each batch is seen up to `lookahead` + 1 times)."""
    hit = self._window_cache.get(id(ids))
    if hit is not None and hit[0] is ids:
      return hit[1]
    ids = np.asarray(ids)
    u = np.unique(ids[ids >= 0]).astype(np.int64)
    if len(self._window_cache) > 4 * (self.lookahead + 2):
      self._window_cache.clear()
    self._window_cache[id(ids)] = (ids, u)
    return u

  def _pack(self, ex: Exchange, width: int, now: np.ndarray | None = None) -> np.ndarray:
    """One exchange as int32[4, width] (rows EVICT_SLOTS, EVICT_ROWS, LOAD_ROWS, LOAD_SLOTS),
    padded; with `now` (the same step's packed "now" exchange), the "next" exchange as
    int32[5, width], row NEXT_FROM_NOW: each load's position among now[EVICT_ROWS] (now's
    width where absent). One array per exchange: a quarter of the leaves the trainer packs
    per table (pack's cost is per leaf)."""
    n, c = self.spec.num_rows, self.cache_rows
    out = [
      _pad(ex.evict_slots, width, c),
      # Padding points past the host arrays (aligned_rows(N) rows): dropped by the scatter,
      # whose indices must stay unique.
      _pad(ex.evict_rows, width, base.aligned_rows(n)),
      # Padding loads gather row 0 on the host (in range) and are dropped at slot C.
      _pad(ex.load_rows, width, 0),
      _pad(ex.load_slots, width, c),
    ]
    if now is not None:
      pos = np.full(width, now.shape[1], np.int32)
      loads, back = ex.load_rows, now[EVICT_ROWS]
      if loads.shape[0] and back.shape[0]:
        order = np.argsort(back, kind="stable")
        ranked = back[order]
        i = np.minimum(np.searchsorted(ranked, loads), ranked.shape[0] - 1)
        hit = ranked[i] == loads
        pos[: loads.shape[0]][hit] = order[i[hit]]
      out.append(pos)
    return np.stack(out)

  def add_counters(self, **kv):
    """Adds to the table's counters (`host_cache.Counters.add`), read by `stats()`."""
    self._counters.add(**kv)

  def prepare(self, ids, upcoming=(), *, train: bool = True):
    """Plan one batch: ids int[B, L] (PAD = -1); upcoming: the next batches' ids.

    train=False (eval batches, whose update never runs) plans read-only: nothing moves.
    Returns {"ids": int32[B, L] cache slots (C = padding), "unique"/"inverse" (Adagrad),
    "now": int32[4, M] the on-demand exchange of this batch (rows EVICT_SLOTS, EVICT_ROWS,
    LOAD_ROWS, LOAD_SLOTS), "now_pos": int32[B, L] index into now[LOAD_ROWS] (M = cached),
    "next": int32[5, M'] the exchange admitting the next batch (+ NEXT_FROM_NOW),
    "version": int32[] (-1: read-only), PLANNED: (now, next) whether each exchange was
    planned (popped by the group)}. M, M': the exchanges' exact lengths; the group lays every
    table's out in one list per stack (`OffloadGroup`), sized by the `exchange` option.
    """
    t0 = time.perf_counter()
    ids = np.asarray(ids)
    p = self._planner
    if p is None and train:
      raise RuntimeError("offload: call init (or restore) before prepare(train=True)")
    rows = self._unique(ids)
    if not train:  # read-only: rows need not fit, cold ones are read from the host table
      return self._prepare_read_only(ids, rows, t0)
    p.check_fits(rows.shape[0], self.spec.name)
    upcoming = list(upcoming)[: self.lookahead]
    t = p.version
    if p.admitted is not None and p.admitted.shape == ids.shape and np.array_equal(p.admitted, ids):
      now, now_planned = Exchange.empty(), False  # admitted by the previous step's update
    else:
      window = [self._unique(u) for u in upcoming] if self.options.policy == "lookahead" else []
      now, now_planned = p.admit(rows, t, window), True
      self.add_counters(hits=now.hits, misses=now.load_rows.shape[0])
    slots = np.where(ids >= 0, p.row_slot[np.maximum(ids, 0)], -1)
    row_slots = p.row_slot[rows]  # before admitting the next batch, which may evict them
    p.dirty[row_slots] = True
    if p.lfu is not None:
      p.lfu.add_rows(rows)
    ahead = self._unique(upcoming[0]) if upcoming else None
    # A batch that does not fit is not admitted ahead (an eval batch need not fit, a train
    # batch fails at its own prepare), nor one with more ids than this batch: its loads
    # travel in this step's list, whose window per table is this batch's id count.
    if (
      ahead is not None
      and ahead.shape[0] <= self.cache_rows
      and np.asarray(upcoming[0]).size <= ids.size
    ):
      window = [self._unique(u) for u in upcoming[1:]] if self.options.policy == "lookahead" else []
      nxt, next_planned = p.admit(ahead, t + 1, window), True
      self.add_counters(hits=nxt.hits, misses=nxt.load_rows.shape[0])
      p.admitted = np.array(upcoming[0], copy=True)
    else:
      nxt, next_planned = Exchange.empty(), False
      p.admitted = None
    p.version += 1
    out = self._prepared(ids, (rows, row_slots), slots, now, nxt, t)
    out[PLANNED] = (now_planned, next_planned)
    self.add_counters(
      steps=1,
      rows_h2d=now.load_rows.shape[0] + nxt.load_rows.shape[0],
      rows_h2d_on_demand=now.load_rows.shape[0],
      rows_d2h=now.evict_rows.shape[0] + nxt.evict_rows.shape[0],
      plan_seconds=time.perf_counter() - t0,
    )
    return out

  def _prepare_read_only(self, ids, rows, t0):
    p = self._planner
    if p is None:
      # Before init (the trainer prepares an example batch to lay out and check its transfer):
      # nothing is resident; the plan has the shapes of any read-only plan of this batch.
      resident, slots = np.zeros(rows.shape, bool), np.full(ids.shape, -1)
    else:
      resident = p.row_slot[rows] >= 0
      slots = np.where(ids >= 0, p.row_slot[np.maximum(ids, 0)], -1)
    cold = rows[~resident].astype(np.int32)
    # Slots C: should an update ever run with this plan, its scatters drop these rows.
    ex = dataclasses.replace(
      Exchange.empty(), load_rows=cold, load_slots=np.full_like(cold, self.cache_rows)
    )
    if p is not None:
      self.add_counters(eval_hits=int(resident.sum()), eval_misses=cold.shape[0])
      self.add_counters(plan_seconds=time.perf_counter() - t0)
    out = self._prepared(ids, None, slots, ex, Exchange.empty(), -1)
    out[PLANNED] = (True, False)
    return out

  def _prepared(self, ids, rows, slots, now, nxt, version: int):
    """rows: (sorted distinct rows, their slots) of a train batch, None when read-only. The
    exchanges are packed at their exact lengths: the group lays every table's out in one
    list (`OffloadGroup`)."""
    c = self.cache_rows
    out = {"ids": np.where(slots >= 0, slots, c).astype(np.int32)}
    if self.spec.optimizer.needs_unique:
      # base.dedup's contract from the distinct rows already at hand (a second np.unique
      # per table per step is the input thread's largest cost): distinct rows sit in
      # distinct slots, each id's position among the sorted rows indexes them, padding
      # points past them at a filler slot C. The order of `unique` does not change any
      # row's summed gradient (segment_sum adds a row's occurrences in position order).
      if rows is not None:
        rows, row_slots = rows
        unique = np.full(ids.size, c, np.int32)
        unique[: rows.shape[0]] = row_slots
        inverse = np.where(ids >= 0, np.searchsorted(rows, ids), rows.shape[0])
        out["unique"], out["inverse"] = unique, inverse.astype(np.int32)
      else:  # read-only: update never runs with it (placeholders of the right shapes)
        out["unique"], out["inverse"] = base.dedup(slots, c)
    out["now"] = self._pack(now, now.load_rows.shape[0])
    out["next"] = self._pack(nxt, nxt.load_rows.shape[0], out["now"])
    m = out["now"].shape[1]
    now_pos = np.full(ids.shape, m, np.int32)
    if now.load_rows.shape[0]:
      # Rows loaded on demand are read from the host table by lookup (the cache gets them
      # only in update); `now.load_rows` is sorted.
      pos = np.searchsorted(now.load_rows, ids)
      pos = np.minimum(pos, now.load_rows.shape[0] - 1)
      found = (ids >= 0) & (now.load_rows[pos] == ids)
      now_pos[found] = pos[found]
    out["now_pos"] = now_pos
    out["version"] = np.asarray(version, np.int32)
    return out

  def stats(self) -> dict[str, float]:
    """Since the last call: hit_rate (distinct rows of admitted batches already resident),
    rows/bytes host->device and device->host per step, the share of loads prefetched one
    step ahead (off the step's critical path), and host planning ms per step (input
    thread). Eval batches are counted separately (eval_hit_rate)."""
    c = self._counters.take()
    steps = max(c.get("steps", 0), 1)
    looked = c.get("hits", 0) + c.get("misses", 0)
    row_bytes = self.spec.row_bytes
    out = {
      "misses_per_step": c.get("misses", 0) / steps,
      "h2d_rows_per_step": c.get("rows_h2d", 0) / steps,
      "d2h_rows_per_step": c.get("rows_d2h", 0) / steps,
      "h2d_bytes_per_step": c.get("rows_h2d", 0) * row_bytes / steps,
      "d2h_bytes_per_step": c.get("rows_d2h", 0) * row_bytes / steps,
      "h2d_padded_bytes_per_step": c.get("padded_rows_h2d", 0) * row_bytes / steps,
      "h2d_prefetched_fraction": (
        1 - c.get("rows_h2d_on_demand", 0) / c["rows_h2d"] if c.get("rows_h2d") else 1.0
      ),
      "plan_ms_per_step": 1e3 * c.get("plan_seconds", 0.0) / steps,
      "steps": c.get("steps", 0),
    }
    if looked:  # (absent rather than NaN when nothing was admitted: metrics stay valid JSON)
      out["hit_rate"] = c.get("hits", 0) / looked
    ev = c.get("eval_hits", 0) + c.get("eval_misses", 0)
    if ev:
      out["eval_hit_rate"] = c.get("eval_hits", 0) / ev
    return out

  # --------------------------------------------------------------------------- device side

  # The step runs per group (`OffloadGroup.lookup` / `update`): one gather, one sparse
  # update and one set of exchange kernels per stack of tables, one host read per exchange
  # and one write-back. A table alone has no step of its own.

  def lookup(self, state, prepared):
    raise NotImplementedError(
      "offload tables look up through their group (OffloadGroup.lookup: one cache array per "
      "stack of tables); build it with recgnn.planner.make_backend / make_group"
    )

  def update(self, state, prepared, grads):
    raise NotImplementedError(
      "offload tables update through their group (OffloadGroup.update: the exchanges of "
      "every table travel in one list); build it with recgnn.planner.make_backend / make_group"
    )

  def restore_planner(self, slot_rows: np.ndarray, version: int) -> None:
    """Host bookkeeping from a restored state's slot map (int32[C], N = empty) and version
    (history of LRU/LFU is lost)."""
    self._planner = Planner.from_slots(slot_rows, self.spec.num_rows, self.options.policy, version)
    self._window_cache.clear()

  def table(self, state):
    raise NotImplementedError(
      "an offload table's rows: OffloadGroup.tables (its cache is a stack's slice)"
    )

  def table_of(self, host: dict, slot_rows: np.ndarray, cache: np.ndarray) -> np.ndarray:
    """The logical table f32[N, D] from its host array and its cache (slot_rows int32[C],
    cache f32[C, D], numpy). O(N): tests and export only."""
    out = np.array(host["table"][: self.spec.num_rows])
    resident = slot_rows < self.spec.num_rows
    out[slot_rows[resident]] = cache[resident]
    return out
