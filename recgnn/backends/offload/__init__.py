"""`offload`: cDLRM. The table and its optimizer state in host memory, a device cache of C rows.

Plan string: `offload(cache_rows=200_000, policy=lru, lookahead=8)`; see `Offload` for options.

How a batch flows (cDLRM, Balasubramanian et al., RecSys'21):

  input thread, prepare(k)   the planner (numpy, host) admits batch k+1 into the cache: picks
                             victim slots (LRU / LFU / look-ahead-aware), lists the dirty
                             victims to write back and the missing rows to load, and remaps
                             batch k's ids to cache slots. It runs ahead of the step.
  step k, lookup             gather from the cache (rows of batch k are resident).
  step k, update             row-wise optimizer on the cache slots of batch k; then the
                             exchange for batch k+1: evicted rows -> host table (D2H, scatter
                             on the host), missing rows <- host table (gather on the host,
                             H2D) -> their cache slots.

So the rows a step needs were copied in by the previous step, after its optimizer: the copy
for k+1 overlaps nothing on XLA:CPU but is independent of step k+1's compute, and XLA on an
accelerator runs the host gather and the copies on their own streams. Only a batch the
planner did not see coming (the first, one after an eval pass, or `lookahead=0`) is loaded
on demand inside its own step ("now" exchange: lookup reads those rows straight from the
host table, update inserts them first).

Where the state lives, and why (measured on this CPU, jax 0.10; see tests/test_offload.py):
the host table is a `pinned_host` jax.Array *inside* the state, not a numpy array owned by
the backend. The step's outputs reach the host only through the state: the contract gives
`prepare` no handle on step k's evicted rows, so a numpy table on the input thread could not
receive write-backs without a host callback (a host sync in the step). In the state, the
write-back is an in-place scatter on the donated pinned_host buffer under
`compute_on("device_host")`: no copy of the table (the exchange is ordered read-cache ->
write-host -> read-host -> write-cache so XLA inserts no defensive table copy; reading and
writing a buffer in unrelated order made XLA copy the whole table, 25 ms for 1M x 16), the
state alone is checkpointable with Orbax, and after `sync` describes the whole table.
`prepare` returns numpy only: the row indices of host gathers/scatters reach host memory by
a `device_put` inside the step (small int arrays), because a device_put per table on the
input thread cost ~0.8 ms of Python each (26 tables: the input thread fell behind the step).

State:
  host:      {"table": float32[N, D], "accum": float32[N] (row-wise Adagrad)}  pinned_host
  cache:     {"table": float32[C, D], "accum": float32[C]}                      device
  slot_rows: int32[C], the row in each slot (N = empty)                          device
  version:   int32[], train batches applied; stale: int32[], updates that ran with a plan
             made for another cache layout (checked by `sync`, which raises).

Eval batches: the trainer runs `lookup` without `update` for them, so a plan that moves rows
would never execute. `prepare(ids, upcoming, train=False)` plans read-only (resident rows from
the cache, the others straight from the host table). If an update ever runs with a plan made
for another layout, `stale` counts it and `sync` raises (never a silent wrong table).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from recgnn.backends.offload import planner as hostplan
from recgnn.embeddings import access_counts as profile
from recgnn.embeddings import base, host_cache, host_table

POLICIES = ("lru", "lfu", "lookahead")
HOST_MEMORIES = host_table.HOST_MEMORIES
_PROTECTED = np.iinfo(np.int64).max
_NEEDED = np.int64(1) << 62  # look-ahead keys: rows needed within the window sort after others
_FAR = np.int64(1) << 40
# Rows of a prepared exchange array int32[4, L].
EVICT_SLOTS, EVICT_ROWS, LOAD_ROWS, LOAD_SLOTS = range(4)


def _bucket(n: int) -> int:
  """Padded length of an exchange list under `exchange=pow2`: 0, or a power of two >= 16."""
  return 0 if n == 0 else max(16, 1 << (n - 1).bit_length())


def _pad(a: np.ndarray, size: int, fill: int) -> np.ndarray:
  out = np.full(size, fill, np.int32)
  out[: a.shape[0]] = a
  return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class Exchange:
  """One cache exchange, host-planned: write back dirty victims, then load missing rows.

  Attributes:
    evict_slots: int32[E], cache slots whose (dirty) rows go back to the host.
    evict_rows: int32[E], the rows they hold.
    load_rows: int32[M], rows to copy host -> cache.
    load_slots: int32[M], their slots.
    hits: distinct rows of the admitted batch already resident.
  """

  evict_slots: np.ndarray
  evict_rows: np.ndarray
  load_rows: np.ndarray
  load_slots: np.ndarray
  hits: int = 0

  @staticmethod
  def empty() -> Exchange:
    z = np.zeros(0, np.int32)
    return Exchange(evict_slots=z, evict_rows=z, load_rows=z, load_slots=z)


def smallest(keys: np.ndarray, k: int) -> np.ndarray:
  """Indices of the k smallest keys, ties to the smaller index (a total order: the numpy and
  the compiled planner pick the same victims). O(len(keys))."""
  v = np.partition(keys, k - 1)[k - 1]
  below = np.flatnonzero(keys < v)
  return np.concatenate([below, np.flatnonzero(keys == v)[: k - below.shape[0]]])


class Planner:
  """Host-side cache bookkeeping of one table: which row sits in which slot, and victims.

  Time is counted in train batches (`version`). Costs O(C) numpy work per admission (victim
  selection by `smallest` over the slots' keys), never O(N).
  """

  def __init__(self, num_rows: int, cache_rows: int, policy: str):
    self.num_rows, self.cache_rows, self.policy = num_rows, cache_rows, policy
    self.row_slot = np.full(num_rows, -1, np.int32)
    self.slot_row = np.full(cache_rows, -1, np.int64)
    self.last_used = np.zeros(cache_rows, np.int64)
    # A row is dirty once a train batch touched it since it was loaded; only dirty victims
    # are written back. `sync` does not clean rows: batches prepared ahead of it still hold
    # plans that touch them.
    self.dirty = np.zeros(cache_rows, bool)
    # LFU: each batch counts each of its distinct rows once (the shared profiler); `freq` is
    # its count array.
    self.lfu = profile.AccessProfile(num_rows) if policy == "lfu" else None
    self.freq = self.lfu.counts if self.lfu is not None else None
    self.version = 0
    self.admitted: np.ndarray | None = None  # ids of the batch admitted ahead

  @classmethod
  def from_slots(cls, slot_rows: np.ndarray, num_rows: int, policy: str, version: int):
    """Rebuild bookkeeping from a state's slot map (after a restore). History is lost:
    LRU/LFU start fresh, which changes hit rates, never values."""
    p = cls(num_rows, slot_rows.shape[0], policy)
    resident = slot_rows < num_rows
    p.slot_row[resident] = slot_rows[resident]
    p.row_slot[slot_rows[resident]] = np.flatnonzero(resident)
    p.version = version
    return p

  def check_fits(self, n: int, table: str) -> None:
    if n > self.cache_rows:
      raise ValueError(
        f"offload: a batch touches {n} distinct rows of table {table!r} but its device cache "
        f"holds {self.cache_rows}. Use offload(cache_rows>={n}, ...) (or a smaller batch)."
      )

  def _keys(self, window: Sequence[np.ndarray]) -> np.ndarray:
    """Eviction order of every slot: smaller keys go first."""
    rows = self.slot_row
    if self.policy == "lru":
      return self.last_used.copy()
    if self.policy == "lfu":
      f = self.freq[np.maximum(rows, 0)]
      return (f << 32) | self.last_used
    # lookahead: rows not needed within the window go first (least recently used first);
    # only if the window does not fit, needed rows go, farthest next use first (Belady).
    keys = self.last_used.copy()
    if window:
      w = np.concatenate(window)
      t = np.concatenate([np.full(u.shape[0], j, np.int64) for j, u in enumerate(window)])
      uniq, first = np.unique(w, return_index=True)  # first occurrence = nearest batch
      pos = np.minimum(np.searchsorted(uniq, rows), uniq.shape[0] - 1)
      needed = (uniq[pos] == rows) & (rows >= 0)
      keys[needed] = _NEEDED + (_FAR - t[first[pos[needed]]])
    return keys

  def admit(self, rows: np.ndarray, t: int, window: Sequence[np.ndarray]) -> Exchange:
    """Make the distinct rows `rows` (sorted) resident for the batch at time t.

    window: distinct rows of the batches after it (look-ahead policy only).
    """
    slots = self.row_slot[rows]
    hit = slots >= 0
    self.last_used[slots[hit]] = t
    miss = rows[~hit]
    m = miss.shape[0]
    if m == 0:
      return dataclasses.replace(Exchange.empty(), hits=int(hit.sum()))
    # Free slots first, taken directly (argpartition over many equal keys is slow: 9 ms for
    # 125k slots, 69k of them free); then the policy's order over the occupied ones.
    free = np.flatnonzero(self.slot_row < 0)
    if free.shape[0] >= m:
      victims = free[:m]
    else:
      keys = self._keys(window)
      keys[free] = _PROTECTED  # already taken
      keys[slots[hit]] = _PROTECTED
      victims = np.sort(np.concatenate([free, smallest(keys, m - free.shape[0])]))
    old = self.slot_row[victims]
    valid = old >= 0
    back = valid & self.dirty[victims]
    self.row_slot[old[valid]] = -1
    self.slot_row[victims] = miss
    self.row_slot[miss] = victims
    self.last_used[victims] = t
    self.dirty[victims] = False
    return Exchange(
      evict_slots=victims[back].astype(np.int32),
      evict_rows=old[back].astype(np.int32),
      load_rows=miss.astype(np.int32),
      load_slots=victims.astype(np.int32),
      hits=int(hit.sum()),
    )


class Offload(base.TableBackend):
  """Table in host memory, a C-row device cache filled ahead of the step (cDLRM).

  Options (plan string):
    cache_rows: device cache size in rows (capped at the table's rows), or
    cache_fraction: the cache as a fraction of the rows, at least `min_cache_rows`.
    policy: `lru`, `lfu` (per-row access counts since init/restore, ties by recency) or
      `lookahead` (never evicts a row needed within the look-ahead window while the cache
      can hold the window; then farthest next use first).
    lookahead: upcoming batches `prepare` wants (the trainer passes them). >= 1 prefetches
      batch k+1 inside step k; 0 loads every batch on demand inside its own step.
    exchange: shapes of the exchange lists, which are jit arguments. `fixed` (default): every
      list holds min(ids per batch, C) entries, padded, so a step compiles once however the
      misses vary (a trainer step holds every table's lists: per-table size buckets would
      multiply into a recompile almost every step). `pow2`: the next power of two >= the
      entries (less padding moved, a few shapes per table). Padding gathers row 0 on the
      host and is dropped on the device; stats count real rows and padded bytes apart.
    host_memory: `pinned_host` (default; falls back to `device` where the platform has no
      host memory space) or `device` (no offload: debugging, benchmarks).

  A batch touching more distinct rows than the cache holds is an error at plan time that
  names the size needed (no micro-batching: exactness vs dense needs the whole batch's update
  at once).
  """

  name = "offload"  # the member class; `OffloadGroup` is what the registry names
  capabilities = base.Capabilities(plans_globally=True)  # the cache plan is global
  batch_major = ("ids", "inverse", "now_pos")

  def __init__(
    self,
    spec: base.TableSpec,
    mesh,
    layout: base.Layout | None = None,
    cache_rows: int | None = None,
    cache_fraction: float | None = None,
    min_cache_rows: int = 0,
    policy: str = "lru",
    lookahead: int = 8,
    exchange: str = "fixed",
    host_memory: str = "pinned_host",
  ):
    super().__init__(spec, mesh, layout)
    if (cache_rows is None) == (cache_fraction is None):
      raise ValueError(
        f"offload (table {spec.name!r}): give exactly one of cache_rows=ROWS or "
        "cache_fraction=F, e.g. offload(cache_rows=200_000)"
      )
    if cache_rows is not None:
      if min_cache_rows:
        raise ValueError(
          f"offload: min_cache_rows={min_cache_rows} is a floor under cache_fraction's rows; "
          f"with cache_rows={cache_rows} the size is given: drop min_cache_rows"
        )
      if int(cache_rows) <= 0:
        raise ValueError(f"offload: cache_rows must be > 0, got {cache_rows}")
      rows = int(cache_rows)
    else:
      if not 0 < cache_fraction <= 1:
        raise ValueError(f"offload: cache_fraction must be in (0, 1], got {cache_fraction}")
      rows = max(math.ceil(cache_fraction * spec.num_rows), int(min_cache_rows))
    if policy not in POLICIES:
      raise ValueError(f"offload: unknown policy {policy!r}; available: {', '.join(POLICIES)}")
    if int(lookahead) < 0:
      raise ValueError(f"offload: lookahead must be >= 0, got {lookahead}")
    if policy == "lookahead" and int(lookahead) < 1:
      raise ValueError("offload: policy=lookahead needs lookahead>=1 (its window)")
    self.cache_rows = min(rows, spec.num_rows)
    self._options = dict(
      cache_rows=cache_rows, cache_fraction=cache_fraction, min_cache_rows=min_cache_rows
    )
    self.policy = policy
    self.lookahead = int(lookahead)
    # The host arrays' placement and in-step access (shared with hot_cold).
    self.host = host_table.HostTable(host_memory, f"offload (table {spec.name!r})", mesh)
    self.host_memory = self.host.host_memory
    if exchange not in ("fixed", "pow2"):
      raise ValueError(f"offload: exchange must be 'fixed' or 'pow2', got {exchange!r}")
    self.exchange = exchange
    self._planner: Planner | None = None  # O(N) host bookkeeping: allocated by init
    self._host_sharding = self._dev_sharding = None
    self._counters = host_cache.Counters()
    self._window_cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}

  def describe(self) -> str:
    size = (
      f"cache_rows={self._options['cache_rows']}"
      if self._options["cache_rows"] is not None
      else f"cache_fraction={self._options['cache_fraction']}"
      + (
        f", min_cache_rows={self._options['min_cache_rows']}"
        if self._options["min_cache_rows"]
        else ""
      )
    )
    extra = "" if self.exchange == "fixed" else f", exchange={self.exchange}"
    extra += "" if self.host_memory == "pinned_host" else f", host_memory={self.host_memory}"
    return f"offload({size}, policy={self.policy}, lookahead={self.lookahead}{extra})"

  @property
  def offloaded(self) -> bool:
    return self.host.offloaded

  # --------------------------------------------------------------------------- placement

  @property
  def host_split(self) -> bool:
    """Whether the host arrays are split by rows over the devices of the mesh: ONE host copy
    of the table in all (each device's pinned host memory holds S / n rows), instead of a
    replica per device."""
    return self.host.split

  def state_sharding(self):
    """The cache in device memory, replicated over the mesh: every device holds the same
    cache, so lookups of its examples are local, and every device applies the same update
    to it (exact, as `dense` replicated). The host arrays in `host_memory`: on one device,
    whole; on a mesh, split by rows over every device (one table in all; an exchange moves
    each row between its owner's host memory and the replicated cache)."""
    host, host_vec = self.row_sharding()
    dev = self.replicated("device")
    slots = self.spec.optimizer.slot_names()
    return {
      "host": {"table": host, **{s: host_vec for s in slots}},
      "cache": {"table": dev, **{s: dev for s in slots}},
      "slot_rows": dev,
      "version": dev,
      "stale": dev,
    }

  def init(self, key):
    spec = self.spec
    opt = spec.optimizer
    # Host arrays have base.aligned_rows(N) rows (the checkpoint's logical shape); the
    # padding rows are never addressed by an id.
    pad = base.aligned_rows(spec.num_rows) - spec.num_rows
    table = base.init_table(key, spec)
    host = {"table": np.concatenate([table, np.zeros((pad, spec.dim), np.float32)])}
    host.update(
      {s: np.full(spec.num_rows + pad, opt.initial_accumulator, np.float32)
       for s in opt.slot_names()}
    )  # fmt: skip
    return self._fresh(host)

  def _fresh(self, host: dict) -> dict:
    """A state holding `host` (the whole table, numpy or placed) and an empty cache; new
    host bookkeeping."""
    spec, c = self.spec, self.cache_rows
    sh = self.state_sharding()
    self._host_sharding, self._dev_sharding = sh["host"]["table"], sh["cache"]["table"]
    self._planner = Planner(spec.num_rows, c, self.policy)
    self._window_cache.clear()
    opt = spec.optimizer
    cache = {"table": np.zeros((c, spec.dim), np.float32)}
    cache.update({s: np.full(c, opt.initial_accumulator, np.float32) for s in opt.slot_names()})
    rest = {
      "cache": cache,
      "slot_rows": np.full(c, spec.num_rows, np.int32),
      "version": np.zeros((), np.int32),
      "stale": np.zeros((), np.int32),
    }
    rest = jax.device_put(rest, {k: v for k, v in sh.items() if k != "host"})
    return {"host": self._placed_host(host, sh["host"]), **rest}

  def _placed_host(self, host: dict, shardings: dict) -> dict:
    return self.host.place(host, shardings)

  def row_sharding(self):
    return self.host.row_sharding()

  def export(self, state):
    """The host arrays of a synced state (every resident row written back by `sync`)."""
    self._check_stale(state)
    host = state["host"]
    return {"rows": host["table"], **{k: host[k] for k in self.spec.optimizer.slot_names()}}

  def import_(self, logical):
    """The table in host memory, an empty device cache (it refills from the next batch:
    hit rates restart, values do not change)."""
    host = {"table": logical["rows"], **{k: logical[k] for k in self.spec.optimizer.slot_names()}}
    return self._fresh(host)

  def memory(self):
    spec, c = self.spec, self.cache_rows
    device = c * spec.row_bytes + c * 4  # cache rows + optimizer state, slot map
    planner = spec.num_rows * (4 + (8 if self.policy == "lfu" else 0))  # row->slot (+ counts)
    # One host copy in all: whole on one device, split by rows over the devices of a mesh.
    host = spec.table_bytes + planner
    if not self.offloaded:
      device, host = device + spec.table_bytes, planner
    where = self.host_memory if self.offloaded else "device (no offload)"
    return base.MemoryReport(device, host, f"{where} + {c}-row device cache ({self.policy})")

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

  def _pack(self, ex: Exchange, capacity: int) -> dict:
    n, c = self.spec.num_rows, self.cache_rows
    if self.exchange == "pow2":
      e, m = _bucket(ex.evict_slots.shape[0]), _bucket(ex.load_rows.shape[0])
    else:
      # An exchange moves at most min(ids of its batch, C) rows (read-only: all its ids).
      e = m = capacity
    # One int32[4, L] array per exchange (rows: EVICT_SLOTS, EVICT_ROWS, LOAD_ROWS,
    # LOAD_SLOTS): a quarter of the leaves the trainer packs per table (pack's cost is per
    # leaf: 2.4 ms per batch for 26 tables with four arrays each). Evictions never outnumber
    # loads (each victim slot receives a missing row), so e <= m pads nothing real.
    e = m = max(e, m)
    return np.stack(
      [
        _pad(ex.evict_slots, e, c),
        # Padding points past the host arrays (aligned_rows(N) rows): dropped by the scatter,
        # whose indices must stay unique.
        _pad(ex.evict_rows, e, base.aligned_rows(n)),
        # Padding loads gather row 0 on the host (in range) and are dropped at slot C.
        _pad(ex.load_rows, m, 0),
        _pad(ex.load_slots, m, c),
      ]
    )

  def _count(self, **kv):
    self._counters.add(**kv)

  def prepare(self, ids, upcoming=(), *, train: bool = True):
    """Plan one batch: ids int[B, L] (PAD = -1); upcoming: the next batches' ids.

    train=False (eval batches, whose update never runs) plans read-only: nothing moves.
    Returns {"ids": int32[B, L] cache slots (C = padding), "unique"/"inverse" (Adagrad),
    "now": int32[4, M] exchange run before this step (rows EVICT_SLOTS, EVICT_ROWS,
    LOAD_ROWS, LOAD_SLOTS), "now_pos": int32[B, L] index into now[LOAD_ROWS] (M = cached),
    "next": int32[4, M'] exchange run after this step's update,
    "version": int32[] (-1: read-only)}.
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
    now_cap = 0
    if p.admitted is not None and p.admitted.shape == ids.shape and np.array_equal(p.admitted, ids):
      now = Exchange.empty()  # admitted by the previous step's update
    else:
      window = [self._unique(u) for u in upcoming] if self.policy == "lookahead" else []
      now = p.admit(rows, t, window)
      now_cap = min(ids.size, self.cache_rows)
      self._count(hits=now.hits, misses=now.load_rows.shape[0])
    slots = np.where(ids >= 0, p.row_slot[np.maximum(ids, 0)], -1)
    row_slots = p.row_slot[rows]  # before admitting the next batch, which may evict them
    p.dirty[row_slots] = True
    if p.lfu is not None:
      p.lfu.add_rows(rows)
    ahead = self._unique(upcoming[0]) if upcoming else None
    next_cap = 0
    if ahead is not None and ahead.shape[0] <= self.cache_rows:
      # (A batch that does not fit is not admitted ahead: an eval batch need not fit, a
      # train batch fails at its own prepare.)
      next_cap = min(np.asarray(upcoming[0]).size, self.cache_rows)
      window = [self._unique(u) for u in upcoming[1:]] if self.policy == "lookahead" else []
      nxt = p.admit(ahead, t + 1, window)
      self._count(hits=nxt.hits, misses=nxt.load_rows.shape[0])
      p.admitted = np.array(upcoming[0], copy=True)
    else:
      nxt = Exchange.empty()
      p.admitted = None
      if self.exchange == "fixed" and self.lookahead:
        # The steady shapes, padded: the last batch of a run (nothing upcoming) otherwise
        # compiled a train step of its own, 10-40 s in the last interval here.
        next_cap = min(ids.size, self.cache_rows)
    p.version += 1
    out = self._prepared(ids, (rows, row_slots), slots, now, nxt, t, now_cap, next_cap)
    self._count(
      steps=1,
      rows_h2d=now.load_rows.shape[0] + nxt.load_rows.shape[0],
      rows_h2d_on_demand=now.load_rows.shape[0],
      rows_d2h=now.evict_rows.shape[0] + nxt.evict_rows.shape[0],
      padded_rows_h2d=out["now"].shape[1] + out["next"].shape[1],
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
      self._count(eval_hits=int(resident.sum()), eval_misses=cold.shape[0])
      self._count(plan_seconds=time.perf_counter() - t0)
    return self._prepared(ids, None, slots, ex, Exchange.empty(), -1, ids.size, 0)

  def _prepared(self, ids, rows, slots, now, nxt, version: int, now_cap: int, next_cap: int):
    """rows: (sorted distinct rows, their slots) of a train batch, None when read-only.
    now_cap / next_cap: list lengths under exchange=fixed, 0 where no exchange is planned
    (so a step's shapes change only at the first batch and after an unforeseen one)."""
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
    out["now"], out["next"] = self._pack(now, now_cap), self._pack(nxt, next_cap)
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

  def _exchange(self, state: dict, ex: dict) -> dict:
    """Write back the dirty victims, then load the missing rows into their slots.

    Per array the order is read cache -> write host -> read host -> write cache: a data
    chain, so XLA updates both donated buffers in place (unordered reads and writes of one
    buffer make it copy the whole table).
    """
    if ex.shape[1] == 0:
      return state
    host, cache = dict(state["host"]), dict(state["cache"])
    for k in cache:
      out = cache[k].at[ex[EVICT_SLOTS]].get(mode="fill", fill_value=0.0)
      host[k] = self._host_scatter(host[k], ex[EVICT_ROWS], out)
      loaded = self._host_gather(host[k], ex[LOAD_ROWS])
      cache[k] = cache[k].at[ex[LOAD_SLOTS]].set(loaded, mode="drop")
    slot_rows = state["slot_rows"].at[ex[LOAD_SLOTS]].set(ex[LOAD_ROWS], mode="drop")
    return {**state, "host": host, "cache": cache, "slot_rows": slot_rows}

  def _host_scatter(self, h: jax.Array, rows: jax.Array, values: jax.Array) -> jax.Array:
    return self.host.scatter(h, rows, values)

  def _host_gather(self, h: jax.Array, rows: jax.Array) -> jax.Array:
    return self.host.gather(h, rows)

  def lookup(self, state, prepared):
    rows = state["cache"]["table"].at[prepared["ids"]].get(mode="fill", fill_value=0.0)
    load_rows = prepared["now"][LOAD_ROWS]
    m = load_rows.shape[0]
    if m == 0:
      return rows
    fresh = self._host_gather(state["host"]["table"], load_rows)
    pos = prepared["now_pos"]
    return jnp.where((pos < m)[..., None], fresh.at[pos].get(mode="fill", fill_value=0.0), rows)

  def update(self, state, prepared, grads):
    state = self._exchange(state, prepared["now"])
    cache = state["cache"]
    slots = {k: cache[k] for k in self.spec.optimizer.slot_names()}
    table, slots = base.sparse_sgd_or_adagrad(self.spec, cache["table"], slots, prepared, grads)
    state = {**state, "cache": {"table": table, **slots}}
    state = self._exchange(state, prepared["next"])
    return {**state, **host_cache.advance(state, prepared)}

  def _flush(self, state):
    # Empty slots hold N: the scatter (unique indices) drops them.
    host = host_cache.flush(
      self.host, state["host"], state["slot_rows"], self.spec.num_rows, state["cache"]
    )
    return {**state, "host": host}

  def _check_stale(self, state):
    host_cache.check_stale(state, f"offload (table {self.spec.name!r})", "cache")

  def sync(self, state):
    """Write every resident cache row back to the host table (O(C)); the cache stays."""
    self._check_stale(state)
    if not hasattr(self, "_flush_jit"):
      self._flush_jit = jax.jit(self._flush, donate_argnums=0)
    return self._flush_jit(state)

  def restore(self, state):
    """Reset host bookkeeping to a restored state's cache (history of LRU/LFU is lost)."""
    self._check_stale(state)
    state = {**state, "host": self._placed_host(state["host"], self.state_sharding()["host"])}
    sh = jax.tree.map(lambda x: x.sharding, state)
    self._host_sharding, self._dev_sharding = sh["host"]["table"], sh["cache"]["table"]
    self._planner = Planner.from_slots(
      np.asarray(jax.device_get(state["slot_rows"])),
      self.spec.num_rows,
      self.policy,
      int(jax.device_get(state["version"])),
    )
    self._window_cache.clear()
    return state

  def table(self, state):
    out = np.array(jax.device_get(state["host"]["table"]))[: self.spec.num_rows]
    slot_rows = np.asarray(jax.device_get(state["slot_rows"]))
    cache = np.asarray(jax.device_get(state["cache"]["table"]))
    resident = slot_rows < self.spec.num_rows
    out[slot_rows[resident]] = cache[resident]
    return out


@base.register_backend("offload")
class OffloadGroup(base.TableGroup):
  """The offload tables of one plan rule: `TableGroup` with the planning of a train batch
  done for every table at once by the compiled kernel (`recgnn.backends.offload.planner.plan_step`).

  The kernel covers the steady state, a batch admitted by the previous step with the next
  one admitted now under `exchange=fixed`; everything else (the first batch, one after an
  eval pass, eval batches, `exchange=pow2`, a batch that does not fit, numba missing) goes
  through each table's numpy planner. Both work on the same planner arrays: the group keeps
  every table's row->slot map, slot->row map, recency and dirty bits in flat arrays, and
  each `Planner` holds views of its slices. The decisions are the same either way
  (tests/test_offload.py compares every prepared array).

  Each batch's ids and sorted distinct rows are computed once, into a ring of
  lookahead + 3 batches (bounded memory), and reused while it moves through the window.
  """

  capabilities = Offload.capabilities

  def __init__(self, specs, mesh, layout: base.Layout | None = None, text: str = "", **options):
    super().__init__(Offload, specs, mesh, layout, text, **options)
    self._flat = None
    self._ring = None
    self._admitted = None  # the arrays of the batch the kernel admitted ahead
    self.fast_batches = 0  # batches planned by the compiled kernel (tests, benchmarks)

  # -- state: the planners' arrays as slices of flat ones

  def init(self, key):
    state = super().init(key)
    self._adopt()
    return state

  def restore(self, state):
    state = super().restore(state)
    self._adopt()
    return state

  def import_(self, logical):
    state = super().import_(logical)
    self._adopt()
    return state

  def _adopt(self):
    self._flat, self._ring, self._admitted = None, None, None
    members = list(self.members.values())
    if not members or any(m._planner is None for m in members):
      return
    ps = [m._planner for m in members]
    row_off = np.cumsum([0] + [p.num_rows for p in ps]).astype(np.int64)
    slot_off = np.cumsum([0] + [p.cache_rows for p in ps]).astype(np.int64)
    lfu = members[0].policy == "lfu"
    flat = {
      "row_slot": np.concatenate([p.row_slot for p in ps]),
      "slot_row": np.concatenate([p.slot_row for p in ps]),
      "last_used": np.concatenate([p.last_used for p in ps]),
      "dirty": np.concatenate([p.dirty for p in ps]),
      "freq": np.concatenate([p.freq for p in ps]) if lfu else np.zeros(0, np.int64),
    }
    for i, p in enumerate(ps):
      r, c = slice(row_off[i], row_off[i + 1]), slice(slot_off[i], slot_off[i + 1])
      p.row_slot, p.slot_row = flat["row_slot"][r], flat["slot_row"][c]
      p.last_used, p.dirty = flat["last_used"][c], flat["dirty"][c]
      if lfu:
        p.freq = p.lfu._dense = flat["freq"][r]
    self._flat = dict(flat, row_off=row_off, slot_off=slot_off)
    self._flat["num_rows"] = np.array([p.num_rows for p in ps], np.int64)
    self._flat["evict_pad"] = np.array([base.aligned_rows(p.num_rows) for p in ps], np.int64)

  # -- the ring of batches (ids and distinct rows, computed once per batch)

  def _layout(self, ids: dict):
    """The ring for batches shaped as this one (rebuilt when the shapes change)."""
    ring = self._ring
    if ring is not None and ids[next(iter(self.members))] is ring["last"]:
      return ring
    shapes = tuple(np.shape(ids[n]) for n in self.members)
    if self._ring is None or self._ring["shapes"] != shapes:
      sizes = [int(np.prod(sh)) for sh in shapes]
      id_off = np.cumsum([0] + sizes).astype(np.int64)
      r, total, t_n = self.lookahead + 3, int(id_off[-1]), len(sizes)
      self._ring = {
        "shapes": shapes,
        "id_off": id_off,
        "ids": np.empty((r, total), np.int64),
        "rows": np.empty((r, total), np.int64),
        "n": np.zeros((r, t_n), np.int64),
        "keys": {},  # id() of the batch's first array -> (ring row, the arrays)
        "order": [],  # ring rows, oldest first
      }
    self._ring["last"] = ids[next(iter(self.members))]
    return self._ring

  def _ring_row(self, ids: dict, busy: list[int]) -> int | None:
    """The ring row of a batch, computed on its first visit. Batches are known by the
    identity of their arrays (as `Offload._unique`): a batch's ids must not change once
    prepare has seen it, in the window or as the batch itself."""
    ring = self._ring
    arrays = tuple(ids[n] for n in self.members)
    hit = ring["keys"].get(id(arrays[0]))
    if hit is not None and all(a is b for a, b in zip(hit[1], arrays)):
      return hit[0]
    if tuple(np.shape(a) for a in arrays) != ring["shapes"]:
      return None
    if len(ring["order"]) < ring["ids"].shape[0]:
      row = len(ring["order"])
    else:
      row = next(r for r in ring["order"] if r not in busy)
      ring["order"].remove(row)
      ring["keys"] = {k: v for k, v in ring["keys"].items() if v[0] != row}
    ring["order"].append(row)
    ring["keys"][id(arrays[0])] = (row, arrays)
    flat = ring["ids"][row]
    np.concatenate([np.asarray(a).reshape(-1) for a in arrays], out=flat)
    sizes = np.diff(ring["id_off"])
    if (sizes == sizes[0]).all():  # one vectorized numpy sort for every table
      ordered = np.sort(flat.reshape(sizes.shape[0], -1), axis=1).reshape(-1)
    else:
      ordered = np.concatenate([np.sort(np.asarray(a).reshape(-1)) for a in arrays])
    bad = np.empty(len(arrays), np.int64)
    hostplan.over_tables(
      hostplan.distinct, len(arrays), flat, ordered.astype(np.int64, copy=False),
      ring["id_off"], self._flat["num_rows"], ring["rows"][row], ring["n"][row], bad,
    )  # fmt: skip
    if (bad >= 0).any():
      ring["keys"].pop(id(arrays[0]))
      ring["order"].remove(row)
      t = int(np.flatnonzero(bad >= 0)[0])
      name = list(self.members)[t]
      raise ValueError(
        f"offload (table {name!r}): id {int(bad[t])} out of range for "
        f"{self.members[name].spec.num_rows} rows"
      )
    return row

  # -- prepare

  def prepare(self, ids, upcoming=(), *, train=True):
    if train and self._flat is not None and hostplan.enabled():
      out = self._prepare_fast(ids, list(upcoming))
      if out is not None:
        return out
    if train:
      self._admitted = None  # the numpy planners admit (or not) the next batch themselves
    return super().prepare(ids, upcoming, train=train)

  def _prepare_fast(self, ids: dict, upcoming: list) -> dict | None:
    t0 = time.perf_counter()
    members = list(self.members.values())
    first = members[0]
    if first.exchange != "fixed" or first.lookahead < 1 or not upcoming:
      return None
    known = self._admitted
    if known is None or not all(ids[n] is a for n, a in zip(self.members, known)):
      for n, m in self.members.items():
        adm = m._planner.admitted
        x = ids[n]
        if adm is None or adm.shape != np.shape(x) or not np.array_equal(adm, x):
          return None  # not admitted ahead: the "now" exchange, per table
    ring = self._layout(ids)
    busy: list[int] = []
    window = upcoming[: first.lookahead]
    for batch in [ids] + window[: (first.lookahead if first.policy == "lookahead" else 1)]:
      row = self._ring_row(batch, busy)
      if row is None:
        return None
      busy.append(row)
    cur, ahead, win = busy[0], busy[1], np.array(busy[2:], np.int64)
    f = self._flat
    caps = np.array([p.cache_rows for p in (m._planner for m in members)], np.int64)
    if (ring["n"][ahead] > caps).any():
      return None  # the next batch does not fit: not admitted ahead (as the numpy planner)
    id_off = ring["id_off"]
    sizes = np.diff(id_off)
    unique = first.spec.optimizer.needs_unique
    cap = np.minimum(sizes, caps)
    per = (3 if unique else 1) * sizes + 4 * cap
    out_off = np.concatenate([[0], np.cumsum(per)]).astype(np.int64)
    out = np.empty(int(out_off[-1]), np.int32)
    stats = np.empty((len(members), 3), np.int64)
    t_now = members[0]._planner.version
    policy = hostplan.POLICY_CODES[first.policy]
    hostplan.over_tables(
      hostplan.plan_step, len(members), ring["ids"], ring["rows"], ring["n"], id_off, cur,
      ahead, win, f["row_off"], f["slot_off"], f["row_slot"], f["slot_row"], f["last_used"],
      f["dirty"], f["freq"], f["evict_pad"], t_now, policy, unique, out, out_off, cap, stats,
    )  # fmt: skip
    admitted = ring["ids"][ahead].copy()
    self._admitted = tuple(window[0][n] for n in self.members)
    dt = (time.perf_counter() - t0) / len(members)
    result = {}
    now = np.zeros((4, 0), np.int32)
    for i, (name, m) in enumerate(self.members.items()):
      p = m._planner
      shape = ring["shapes"][i]
      n, k, o = int(sizes[i]), int(cap[i]), int(out_off[i])
      prep = {"ids": out[o : o + n].reshape(shape)}
      if unique:
        prep["unique"] = out[o + n : o + 2 * n]
        prep["inverse"] = out[o + 2 * n : o + 3 * n].reshape(shape)
        o += 2 * n
      e = o + n
      prep["now"] = now
      prep["next"] = out[e : e + 4 * k].reshape(4, k)
      prep["now_pos"] = np.zeros(shape, np.int32)
      prep["version"] = np.asarray(p.version, np.int32)
      p.version += 1
      p.admitted = admitted[id_off[i] : id_off[i + 1]].reshape(ring["shapes"][i])
      if p.lfu is not None:
        p.lfu.accesses += int(ring["n"][cur, i])
        p.lfu.batches += 1
      hits, loads, back = (int(v) for v in stats[i])
      m._count(
        hits=hits, misses=loads, steps=1, rows_h2d=loads, rows_h2d_on_demand=0,
        rows_d2h=back, padded_rows_h2d=k, plan_seconds=dt,
      )  # fmt: skip
      entry = {"rows": prep}
      if m.spec.pooling == "mean":
        entry["count"] = np.sum(np.asarray(ids[name]) >= 0, axis=1).astype(np.int32)
      result[name] = entry
    self.fast_batches += 1
    return result
