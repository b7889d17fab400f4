"""offload's SSD level: the tables' rows and optimizer state in row files on disk
(`row_file.RowFile`), a bounded host-RAM cache of them (`CachedRows`, one per table), the
device cache above unchanged. `DiskRows` has `host_tier.HostRows`'s interface (`gather` on
the input thread, `scatter` on the writer thread, `set`, `table`, `put`), so `HostSide` and
the step do not know where the rows are.

The host cache is offload's own cache planner (`cache_plan.Planner`: its row -> slot map,
victims under the table's policy, dirty bits) over H host slots instead of device slots:
  read (gather, prefetch)  admit the rows: dirty victims written to the file first (one
                           batched write, rows sorted, runs coalesced), then the missing
                           rows read into their slots (the thread pool), then copied out
  write (scatter)          admit the rows without reading them (the whole record is
                           overwritten), victims written back as above, the slots dirty
A lock makes each call atomic: the cache and the file are one map from row to its latest
applied value, whatever thread calls. Which value a step must see is `host_tier`'s ordering
(the device ring of recent write-backs, `Writer.wait`), as for rows in RAM.

Look-ahead over the disk's latency (`prefetch`): the group hands each batch that enters its
look-ahead window to a prefetch thread, which reads the rows the device cache does not
hold into the host cache while the steps before it run; `window` sizes how many batches
ahead from the measured read time per batch and the measured time between batches.
"""

from __future__ import annotations

import itertools
import math
import queue
import threading
import time
import weakref

import jax
import numpy as np

from recgnn import owned_thread
from recgnn.backends.offload.cache_plan import _PROTECTED, Planner, smallest
from recgnn.backends.offload.row_file import RowFile, check_space, remove_stale
from recgnn.embeddings import host_tier, streamed
from recgnn.embeddings.specs import aligned_rows

# A host cache that must evict frees at least 1/EVICT_AHEAD of its slots at once (`_make_room`).
EVICT_AHEAD = 32
_SERIAL = itertools.count()  # (each DiskRows's files get their own names: groups coexist)


class CachedRows:
  """One table's rows: a RowFile behind H host-RAM slots (`Planner` over them).

  Records are float32[floats]: the row (dim), its optimizer slots, padding."""

  def __init__(self, file: RowFile, host_rows: int, policy: str):
    self.file = file
    self.host_rows = max(1, min(int(host_rows), file.num_rows))
    self.policy = "lru" if policy == "lookahead" else policy  # (its window is `prefetch`'s)
    self.lock = threading.Lock()
    self.loaded = threading.Condition(self.lock)  # (a read-ahead's records landed)
    self.planner = Planner(file.num_rows, self.host_rows, self.policy)
    self.data = file.buffer(self.host_rows).view(np.float32)  # [H, floats]
    # Per slot, the read-ahead reading its record from the disk without the lock (its token;
    # 0: none). A read of such a slot waits for it; a write, or the slot's reuse, cancels it.
    self.pending = np.zeros(self.host_rows, np.int64)
    self._tokens = itertools.count(1)
    self.clock = 0
    self.counts = {"hits": 0, "misses": 0, "evicted": 0, "prefetched": 0}

  def reset(self) -> None:
    self.planner = Planner(self.file.num_rows, self.host_rows, self.policy)
    self.pending[:] = 0
    self.clock = 0

  def _admit(self, rows: np.ndarray, load: bool, count: str = "") -> np.ndarray:
    """Make sorted distinct rows (at most H) resident -> their slots. Lock held. count:
    "" (a read: hits and misses counted), or the counter of the rows it loads."""
    self.clock += 1
    self._make_room(rows)
    ex = self.planner.admit(rows, self.clock, ())
    if count:
      self.counts[count] += ex.load_rows.shape[0]
    elif load:
      self.counts["hits"] += ex.hits
      self.counts["misses"] += ex.load_rows.shape[0]
      if self.planner.lfu is not None:  # (LFU: the step's reads are the accesses counted)
        self.planner.lfu.add_rows(rows)
    self._write_victims(ex)
    if load and ex.load_rows.shape[0]:
      buf = self.file.buffer(ex.load_rows.shape[0])
      self.file.read(ex.load_rows.astype(np.int64), buf)  # (admit's rows are sorted)
      self.data[ex.load_slots] = buf.view(np.float32)
    return self.planner.row_slot[rows]

  def _make_room(self, rows: np.ndarray) -> None:
    """Free slots for `rows`' misses ahead of `Planner.admit`, at least H / EVICT_AHEAD at a
    time (the least recently used, by the table's policy; dirty ones written back in one
    batch; the request's resident rows and read-aheads in flight kept). The planner's victim
    search is O(H) per admission that evicts (on a full host cache of many rows, most of the
    step's CPU); with the slots freed ahead, most admissions take free slots."""
    p = self.planner
    free = p.slot_row < 0
    need = int(np.count_nonzero(p.row_slot[rows] < 0)) - int(np.count_nonzero(free))
    if need <= 0:
      return
    k = min(max(need, self.host_rows // EVICT_AHEAD), self.host_rows)
    keys = p.eviction_keys(())
    keep = p.row_slot[rows]
    keys[keep[keep >= 0]] = _PROTECTED
    keys[free | (self.pending != 0)] = _PROTECTED
    k = min(k, int(np.count_nonzero(keys < _PROTECTED)))
    if k <= 0:
      return
    victims = np.sort(smallest(keys, k))
    old = p.slot_row[victims]
    d = p.dirty[victims]
    self.counts["evicted"] += self._write_back(victims[d], old[d])
    p.row_slot[old] = -1
    p.slot_row[victims] = -1
    p.dirty[victims] = False

  def _write_back(self, slots: np.ndarray, rows: np.ndarray) -> int:
    """records of `rows` = data[slots], batched writes (rows sorted) of streamed.CHUNK_BYTES
    each (a checkpoint's flush of a whole dirty host cache held it twice at once) -> how many."""
    order = np.argsort(rows)
    step = streamed.chunk_rows(self.file.record)
    for a in range(0, order.shape[0], step):
      part = order[a : a + step]
      buf = self.file.buffer(part.shape[0])
      buf.view(np.float32)[:] = self.data[slots[part]]
      self.file.write(rows[part].astype(np.int64), buf)
    return int(order.shape[0])

  def _write_victims(self, ex) -> None:
    """Dirty victims to the file before their slots are reused; the slots' read-aheads
    cancelled (their records belong to other rows now)."""
    self.pending[ex.load_slots] = 0
    self.counts["evicted"] += self._write_back(ex.evict_slots, ex.evict_rows)

  def _resident(self, rows: np.ndarray) -> np.ndarray:
    """`_admit(rows, load=True)`, after any read-ahead still reading one of them landed (the
    wait releases the lock; the rows are admitted again, their loads counted as misses)."""
    slots = self._admit(rows, load=True)
    while self.pending[slots].any():
      if not self.loaded.wait(timeout=host_tier.WAIT_SECONDS):
        n = int(np.count_nonzero(self.pending[slots]))
        raise RuntimeError(
          f"offload SSD tier: {n} rows a read needs are still being read ahead from "
          f"{self.file.path} after {host_tier.WAIT_SECONDS:g} s (the read-ahead thread is "
          "stuck in the file's read, or the disk stopped answering)"
        )
      slots = self._admit(rows, load=True, count="misses")
    return slots

  def _chunks(self, rows: np.ndarray):
    u, inv = np.unique(rows, return_inverse=True)
    for a in range(0, u.shape[0], self.host_rows):
      yield u[a : a + self.host_rows], inv, a

  def read(self, rows: np.ndarray, out: np.ndarray | None) -> None:
    """out[i] = record of rows[i] (float32[n, floats]; None: only make them resident)."""
    if rows.shape[0] == 0:
      return
    with self.lock:
      for part, inv, a in self._chunks(rows.astype(np.int64)):
        slots = self._resident(part)
        if out is not None:
          pick = (inv >= a) & (inv < a + part.shape[0])
          out[pick] = self.data[slots[inv[pick] - a]]

  def prefetch(self, rows: np.ndarray) -> None:
    """Read the rows not in the host cache (at most H, the rest skipped). Their slots are
    taken under the lock, the disk read without it (the input thread's reads of other rows
    and the writer's write-backs go on meanwhile: with the lock held through the read, each
    batch's gather waited for the next batches' disk time); a read of a row still in flight
    waits for it (`_resident`)."""
    rows = np.unique(rows.astype(np.int64))[: self.host_rows]
    with self.lock:
      missing = rows[self.planner.row_slot[rows] < 0]
      if not missing.shape[0]:
        return
      self.clock += 1
      self._make_room(missing)
      ex = self.planner.admit(missing, self.clock, ())
      self.counts["prefetched"] += ex.load_rows.shape[0]
      self._write_victims(ex)
      token = next(self._tokens)
      slots = ex.load_slots.astype(np.int64)
      self.pending[slots] = token
    buf = self.file.buffer(slots.shape[0])
    try:
      self.file.read(ex.load_rows.astype(np.int64), buf)  # (admit's rows are sorted)
    except BaseException:
      with self.lock:  # (the rows unmapped: a later read loads them again, none waits)
        mine = slots[self.pending[slots] == token]
        self.pending[mine] = 0
        self.planner.row_slot[self.planner.slot_row[mine]] = -1
        self.planner.slot_row[mine] = -1
        self.loaded.notify_all()
      raise
    with self.lock:  # (only into slots still waiting for this read: not rewritten, not reused)
      mine = self.pending[slots] == token
      self.data[slots[mine]] = buf.view(np.float32)[mine]
      self.pending[slots[mine]] = 0
      self.loaded.notify_all()

  def write(self, rows: np.ndarray, values: np.ndarray) -> None:
    """record of rows[i] = values[i] (rows distinct; values float32[n, floats])."""
    if rows.shape[0] == 0:
      return
    rows = rows.astype(np.int64)
    with self.lock:
      order = np.argsort(rows)
      for a in range(0, rows.shape[0], self.host_rows):
        sel = order[a : a + self.host_rows]
        slots = self._admit(rows[sel], load=False)
        self.pending[slots] = 0  # (a read-ahead of these rows would bring older values)
        self.data[slots] = values[sel]
        self.planner.dirty[slots] = True

  def flush(self) -> None:
    """Every dirty cached row written to the file (they stay cached, now clean)."""
    with self.lock:
      self.flush_locked()

  def flush_locked(self) -> None:
    """As `flush`, the caller holding `lock`."""
    p = self.planner
    slots = np.flatnonzero(p.dirty & (p.slot_row >= 0))
    self._write_back(slots, p.slot_row[slots])
    p.dirty[slots] = False


class DiskRows(host_tier.HostRows):
  """`HostRows` whose tables are `CachedRows` (one row file each, in `directory`).

  specs: the tables' specs in the host tier's order; host_rows: each table's host-cache
  rows; io: `row_file.IO_MODES`."""

  def __init__(self, owner, specs, directory, host_rows, policy, io="direct", lookahead=8):
    super().__init__(owner)
    self.specs = list(specs)
    tag = f".g{next(_SERIAL)}"
    self.tables = [
      CachedRows(
        RowFile(
          directory, s.name, aligned_rows(s.num_rows), s.dim, s.optimizer.slot_names(), io, tag
        ),  # fmt: skip
        h,
        policy,
      )
      for s, h in zip(self.specs, host_rows)
    ]
    check_space(directory, [c.file for c in self.tables])  # (at plan time: before init)
    remove_stale(directory)
    self.lookahead = lookahead
    self._queue: queue.Queue = queue.Queue()
    self._thread: threading.Thread | None = None
    self.read_seconds_per_batch = 0.0  # prefetch's measured time per batch (an average)
    self._last_prepare = None
    self.batch_seconds = 0.0  # measured time between batches (an average)
    self._ready = False
    # The files go with the object (scratch: the checkpoint holds the tables).
    weakref.finalize(self, _remove, [c.file for c in self.tables])
    self._prefetch_error: BaseException | None = None
    self._last_counts: dict[str, int] | None = None

  # -- the logical tables

  def _keys(self, t: int) -> tuple[str, ...]:
    return ("table", *self.specs[t].optimizer.slot_names())

  def _to_records(self, t: int, arrays: dict, rows: slice | np.ndarray) -> np.ndarray:
    """float32[n, floats] from {k: f32[..]} (the rows `rows` of each)."""
    s = self.specs[t]
    first = arrays["table"][rows]
    out = np.zeros((first.shape[0], self.tables[t].file.floats), np.float32)
    out[:, : s.dim] = first
    for j, k in enumerate(s.optimizer.slot_names()):
      out[:, s.dim + j] = arrays[k][rows]
    return out

  def _from_records(self, t: int, rec: np.ndarray) -> dict:
    s = self.specs[t]
    out = {"table": np.ascontiguousarray(rec[:, : s.dim])}
    for j, k in enumerate(s.optimizer.slot_names()):
      out[k] = np.ascontiguousarray(rec[:, s.dim + j])
    return out

  def set(self, arrays: list[dict]) -> None:
    """Write each table's row file from these arrays (the whole table, its aligned rows as
    the checkpoint's logical shape: import)."""
    self.fill(
      [lambda a, n, x=x: {k: v[a : a + n] for k, v in x.items()} for x in arrays]
    )  # fmt: skip

  def fill(self, sources) -> None:
    """Write each table's row file from sources[t](first, n) -> {k: its rows [first, first
    + n)} (a chunk at a time: init never holds a whole table), new host caches."""
    self.writer.drain()
    self.drain_prefetch()
    for t, (c, src) in enumerate(zip(self.tables, sources)):
      c.file.create(lambda a, n, t=t, src=src: self._to_records(t, src(a, n), slice(None)))
      c.reset()
    self._ready = True

  def loaded(self) -> bool:
    return self._ready

  def table(self, t: int) -> dict:
    """Table t's logical arrays (numpy copies, O(N): tests, `tables`), read from its file
    after every dirty cached row is flushed; the file verified first (checkpoints: `stream`)."""
    self.drain_prefetch()
    c = self.tables[t]
    c.flush()
    c.file.verify()
    with c.lock:
      return self._from_records(t, c.file.read_all(0, c.file.num_rows))

  def stream(self, t: int) -> streamed.StreamedTable:
    """Table t's logical "rows" form, produced a chunk at a time (export: a checkpoint of a
    table bigger than RAM): each call flushes the dirty cached rows, verifies the file, then
    reads it in order, streamed.chunk_rows(record) records per read, the table's lock held
    throughout (the input thread's reads wait: the file is the table's state at the step)."""
    c, s = self.tables[t], self.specs[t]
    slots = s.optimizer.slot_names()
    c.file.verify()  # (a damaged file refused at export, before the checkpoint starts)

    def produce(sink) -> None:
      self.drain_prefetch()
      with c.lock:
        c.flush_locked()
        c.file.verify()
        step = streamed.chunk_rows(c.file.record)
        for a in range(0, c.file.num_rows, step):
          rec = c.file.read_all(a, min(step, c.file.num_rows - a))
          chunk = {"rows": rec[:, : s.dim]}
          chunk.update({k: rec[:, s.dim + j] for j, k in enumerate(slots)})
          sink(a, chunk)

    return streamed.StreamedTable(c.file.num_rows, s.dim, tuple(slots), produce)

  def put(self, t: int, rows: np.ndarray, values: dict) -> None:
    """table t's rows[i] = values[k][i] (the resident device rows, before a checkpoint)."""
    self.tables[t].write(rows, self._to_records(t, values, slice(None)))

  def close(self, remove: bool = True) -> None:
    self.drain_prefetch()
    for c in self.tables:
      c.file.close(remove)

  # -- the input thread and the writer

  def gather(self, segments, width: int) -> dict[str, np.ndarray]:
    """As `HostRows.gather`, the rows read through the host cache (disk on a miss)."""
    if self._prefetch_error is not None:
      raise RuntimeError(f"{self.owner}: a read ahead failed: {self._prefetch_error}")
    t0 = segments[0][0] if segments else 0
    s = self.specs[t0]
    out = {"table": np.zeros((width, s.dim), np.float32)}
    out.update({k: np.zeros(width, np.float32) for k in s.optimizer.slot_names()})
    at = 0
    for t, rows in segments:
      n = rows.shape[0]
      if n:
        rec = np.empty((n, self.tables[t].file.floats), np.float32)
        self.tables[t].read(rows, rec)
        for k, v in self._from_records(t, rec).items():
          out[k][at : at + n] = v
      at += n
    return out

  def scatter(self, writes, values: dict) -> None:
    """As `HostRows.scatter`: into the host cache (dirty), evictions to the file."""
    for t, rows, pos in writes:
      if rows.shape[0]:
        sel = {k: np.asarray(values[k])[pos] for k in self._keys(t)}
        self.tables[t].write(rows, self._to_records(t, sel, slice(None)))

  # -- look-ahead

  def window(self) -> int:
    """Batches to read ahead: the measured read time of a batch over the measured time
    between batches, + 1, within 1 .. lookahead."""
    if self.batch_seconds <= 0:
      return max(1, self.lookahead)
    need = math.ceil(self.read_seconds_per_batch / self.batch_seconds) + 1
    return int(min(max(need, 1), max(1, self.lookahead)))

  def tick(self) -> None:
    """A batch was prepared (the input thread's cadence: a step's time in steady state)."""
    now = time.perf_counter()
    if self._last_prepare is not None:
      dt = now - self._last_prepare
      self.batch_seconds = dt if self.batch_seconds == 0 else 0.9 * self.batch_seconds + 0.1 * dt
    self._last_prepare = now

  def prefetch(self, rows: list[tuple[int, np.ndarray]]) -> None:
    """Read [(table, rows)] of a batch ahead into the host caches, on the prefetch thread
    (never on the caller's)."""
    if self._thread is None:
      self._thread = owned_thread.serve(self, self._queue, "_read_ahead", "offload ssd prefetch")
    self._queue.put(rows)

  def _read_ahead(self, job: list[tuple[int, np.ndarray]]) -> None:
    """One batch's reads ahead, on the prefetch thread (`owned_thread`: it ends when this
    object is dropped, and with it the finalizer that removes the row files can run)."""
    try:
      t0 = time.perf_counter()
      for t, rows in job:
        self.tables[t].prefetch(rows)
      dt = time.perf_counter() - t0
      r = self.read_seconds_per_batch
      self.read_seconds_per_batch = dt if r == 0 else 0.9 * r + 0.1 * dt
    except BaseException as e:  # re-raised by the next gather (on the input thread)
      self._prefetch_error = e

  def drain_prefetch(self) -> None:
    if self._thread is not None:
      self._queue.join()

  def stats(self, steps: int) -> dict[str, float]:
    """Since the last call, over `steps` train steps: host_hit_rate (rows the step lists
    read that the host cache held), disk read / written bytes per step (records asked of
    the files: a record is the row, its slots and the padding), rows read ahead per step,
    and the look-ahead window in batches."""
    now = self.counts()
    last = self._last_counts or dict.fromkeys(now, 0)
    self._last_counts = now
    d = {k: now[k] - last[k] for k in now}
    out = {"ssd_window": float(self.window())}
    if d["hits"] + d["misses"]:
      out["ssd_host_hit_rate"] = d["hits"] / (d["hits"] + d["misses"])
    if steps:
      out["ssd_read_bytes_per_step"] = d["bytes_read"] / steps
      out["ssd_written_bytes_per_step"] = d["bytes_written"] / steps
      out["ssd_read_ahead_rows_per_step"] = d["prefetched"] / steps
    return out

  def counts(self) -> dict[str, int]:
    """Host-cache hits / misses / evicted rows and file bytes, summed over the tables."""
    out = {"hits": 0, "misses": 0, "evicted": 0, "prefetched": 0, "bytes_read": 0,
           "bytes_written": 0}  # fmt: skip
    for c in self.tables:
      for k, v in c.counts.items():
        out[k] += v
      out["bytes_read"] += c.file.bytes_read
      out["bytes_written"] += c.file.bytes_written
    return out


def source_of(logical):
  """`DiskRows.fill`'s source for a table's "rows" form: a `streamed.TableReader` (a
  checkpoint of the SSD level: one read per file and chunk) or its arrays (a checkpoint of
  another backend, already whole in memory): first, n -> {"table", slot: rows [first, first
  + n)}."""
  if isinstance(logical, streamed.TableReader):
    get = logical.chunk
  elif isinstance(next(iter(logical.values())), jax.Array):

    def get(a, n):  # (through one window program per chunk size, not a slice per chunk)
      return host_tier.rows_to_host(logical, a, a + n, n)

  else:

    def get(a, n):
      return {k: v[a : a + n] for k, v in logical.items()}

  def chunk(a, n):
    out = get(a, n)
    return {"table": out.pop("rows"), **out}

  return chunk


def _remove(files: list[RowFile]) -> None:
  for f in files:
    f.close(remove=True)
