"""Rows in host RAM behind a device tier, moved with the batch, never inside the step.

Shared by the backends that keep rows on the host (`offload`: the table behind a device cache;
`hot_cold`: the cold rows). Why this shape (docs/architecture.md, "The host tier"): host
computations inside the jitted step (`compute_on` gathers and scatters on pinned host tables)
make every launch wait for each host call, and XLA:GPU copies every host table whole into the
write-back (pinned -> pinned): O(rows) per step, which XLA:CPU's program never shows. So:

  prepare (input thread)   plans which rows move; reads the rows a step loads from the numpy
                           tables (`HostRows.gather`) into the prepared batch: they reach the
                           devices with the batch's own transfer, issued ahead of the step
  step (jitted)            takes the loaded rows as an input and returns the rows it evicts /
                           updated as an output (`contract.TO_HOST`): no host computation, no
                           host array among its arguments
  after the step           `Backend.after_update` (O(1), main thread) hands that output to
                           the writer thread, which copies it to the host and writes it into
                           the numpy tables in place, in step order (`Writer`)

Ordering: the input thread runs ahead of the step (prepare(k + PREFETCH) may run before step k
does), so a row a step wrote back may be read for a later step before the write-back reached
the host. `Recent` makes that exact without waiting: the step also writes what it evicts into
a device ring of the last V rows written back (in the backend's state), and a load planned
while its row's write-back may still be in flight is taken from the ring instead of the
host (a position per loaded row, `Recent.sources`). A row whose ring entry has been
overwritten since is read from the host, after the writer has applied the step that wrote it
back (`Writer.wait`: in practice long done; correct in any case). The ring is O(batch): V is a
few steps' exchanges.
"""

from __future__ import annotations

import collections
import functools
import queue
import threading
import time
from collections.abc import Callable

import jax
import numpy as np

from recgnn import owned_thread

ABSENT = np.iinfo(np.int32).max  # no ring position: the row comes from the host


def _numpy_take(src: np.ndarray, rows: np.ndarray, out: np.ndarray) -> None:
  np.take(src, rows, axis=0, out=out)


def _numpy_put(dst: np.ndarray, rows: np.ndarray, values: np.ndarray, pos: np.ndarray) -> None:
  dst[rows] = values[pos]


def _numpy_take_tables(srcs: tuple, tabs: np.ndarray, rows: np.ndarray, out: np.ndarray) -> None:
  for t in np.unique(tabs):
    at = tabs == t
    out[at] = srcs[t][rows[at]]


def _numpy_put_tables(dsts: tuple, tabs, rows, values, pos) -> None:
  for t in np.unique(tabs):
    at = tabs == t
    dsts[t][rows[at]] = values[pos[at]]


# The row copies run on the input thread (reads) and the writer thread (writes), beside the
# thread that launches steps: compiled without the GIL (numba, nogil) they do not hold it
# against that thread (numpy's fancy indexing does, for the whole copy). numpy where numba
# is missing: the same copies.
try:
  from numba import njit

  @njit(nogil=True, cache=True)
  def _take_2d(src, rows, out):  # pragma: no cover (compiled)
    for i in range(rows.shape[0]):
      out[i, :] = src[rows[i], :]

  @njit(nogil=True, cache=True)
  def _put_2d(dst, rows, values, pos):  # pragma: no cover (compiled)
    for i in range(rows.shape[0]):
      dst[rows[i], :] = values[pos[i], :]

  @njit(nogil=True, cache=True)
  def _take_tables(srcs, tabs, rows, out):  # pragma: no cover (compiled)
    """out[i] = srcs[tabs[i]][rows[i]]: one call for the rows of every table (srcs: a
    tuple of the tables' [S, ...] arrays, 2-d), not one per table."""
    for i in range(rows.shape[0]):
      out[i, :] = srcs[tabs[i]][rows[i], :]

  @njit(nogil=True, cache=True)
  def _put_tables(dsts, tabs, rows, values, pos):  # pragma: no cover (compiled)
    """dsts[tabs[i]][rows[i]] = values[pos[i]]: a step's write-backs to every table in one
    call (dsts: a tuple of the tables' [S, ...] arrays, 2-d), in order."""
    for i in range(rows.shape[0]):
      dsts[tabs[i]][rows[i], :] = values[pos[i], :]

  def _take(src: np.ndarray, rows: np.ndarray, out: np.ndarray) -> None:
    """out[i] = src[rows[i]] (rows in range), without the GIL."""
    _take_2d(src.reshape(src.shape[0], -1), rows.astype(np.int64, copy=False),
             out.reshape(out.shape[0], -1))  # fmt: skip

  def _put(dst: np.ndarray, rows: np.ndarray, values: np.ndarray, pos: np.ndarray) -> None:
    """dst[rows[i]] = values[pos[i]], without the GIL."""
    _put_2d(dst.reshape(dst.shape[0], -1), rows.astype(np.int64, copy=False),
            values.reshape(values.shape[0], -1), pos.astype(np.int64, copy=False))  # fmt: skip

except ImportError:  # pragma: no cover
  _take, _put = _numpy_take, _numpy_put
  _take_tables, _put_tables = _numpy_take_tables, _numpy_put_tables

# How long `Writer.wait` waits for a write-back before it calls the order broken: a step's
# write-back arrives once that step ran (the trainer's main thread may first compile it), so
# only a driver that prepares more train batches ahead than the ring covers, on the thread
# that runs their steps, or skips one, ever waits this long.
WAIT_SECONDS = 600.0


class Writer:
  """One thread applying the steps' write-backs to host arrays, in the order submitted.

  `submit(job)`: job() runs on the writer thread (it may block on device arrays: it copies
  them to the host first). `applied` counts the jobs done; `wait(n)` blocks until n are;
  `drain()` until all are. An error in a job is re-raised by the next call on any thread."""

  def __init__(self, owner: str):
    self.owner = owner
    self._jobs: queue.Queue = queue.Queue()
    self._cond = threading.Condition()
    self.submitted = 0
    self.applied = 0
    self.busy_seconds = 0.0
    self._error: BaseException | None = None
    self._thread: threading.Thread | None = None
    self._counts: collections.deque = collections.deque()  # steps each queued job applies
    self._submitters: set[int] = set()  # the threads that handed steps over (idents)

  def _apply(self, job: Callable[[], None]) -> None:
    """One job, on the writer thread (`owned_thread`: it ends when this Writer is dropped)."""
    t0 = time.perf_counter()
    try:
      if self._error is None:
        job()
    except BaseException as e:  # re-raised on the next submit / wait / drain
      self._error = e
    self.busy_seconds += time.perf_counter() - t0
    with self._cond:
      self.applied += self._counts.popleft()
      self._cond.notify_all()

  def _check(self):
    if self._error is not None:
      raise RuntimeError(f"{self.owner}: a host write-back failed: {self._error}") from self._error

  def submit(self, job: Callable[[], None], steps: int = 1) -> None:
    """job: the write-backs of `steps` train steps (a call of k steps hands its k over as
    one job): `submitted` / `applied` count steps, so `wait(n)` means "step n applied"
    however the steps were called."""
    self._check()
    if self._thread is None:
      self._thread = owned_thread.serve(self, self._jobs, "_apply", f"{self.owner} writer")
    with self._cond:
      self.submitted += steps
      self._counts.append(steps)
      self._submitters.add(threading.get_ident())
      self._cond.notify_all()
    self._jobs.put(job)

  def wait(self, n: int, why: str = "") -> None:
    """Block until `n` jobs are applied (no wait when they are). A job not handed over yet
    is waited for too: on the trainer's input thread the step it needs may not have been
    launched yet (the main thread is behind by the run-ahead, or compiling). Never forever:
    a wait on the only thread that has handed steps over, for a step not handed over, can
    never end (that thread is the one waiting): refused at once; any other wait is refused
    after WAIT_SECONDS. Both refusals name the step waited for and why it did not come."""
    if self.applied >= n:
      self._check()
      return
    with self._cond:
      if n > self.submitted and self._submitters == {threading.get_ident()}:
        raise RuntimeError(self._never_message(n, why, "this thread runs the steps: refused"))
      if not self._cond.wait_for(
        lambda: self.applied >= n or self._error is not None, timeout=WAIT_SECONDS
      ):
        if n > self.submitted:
          raise RuntimeError(self._never_message(n, why, f"waited {WAIT_SECONDS:g} s"))
        raise RuntimeError(
          f"{self.owner}: write-back of train step {n} handed over but not applied in "
          f"{WAIT_SECONDS:g} s (the writer thread is stuck copying a step's output to the host)"
        )
    self._check()

  def _never_message(self, n: int, why: str, waited: str) -> str:
    """The refusal of a wait for a step that was never handed over: what and why."""
    return (
      f"{self.owner}: a read needs the write-back of train step {n} (counted from the "
      f"last init / restore), whose step has not run ({self.submitted} handed over{why}; "
      f"{waited}). A prepared train batch was skipped, or its update's output was not handed "
      "to `after_update`, or more batches were prepared ahead, on the thread that runs the "
      "steps, than the device ring covers, or no step runs at all (a benchmark timing "
      "prepare alone: benchmarks/harness's prepare_without_steps)."
    )

  def drain(self) -> None:
    self.wait(self.submitted)


class HostRows:
  """Row arrays of a set of tables in host RAM (numpy, written in place by one `Writer`).

  arrays: per table {"table": f32[S, D], slot: f32[S]} (S = aligned rows). The reads run on
  the input thread, the writes on the writer thread; the ordering that keeps a read from
  racing a write of the same row is the caller's (`Recent`: a row with a write-back in
  flight is read from the device ring, or after `Writer.wait`)."""

  def __init__(self, owner: str):
    self.owner = owner
    self.arrays: list[dict[str, np.ndarray]] = []
    self.writer = Writer(owner)
    self._by_key: dict | None = None
    self.write_seconds = 0.0  # the writer's copies to the host and scatters (not its waits)

  def set(self, arrays: list[dict[str, np.ndarray]]) -> None:
    """Own these arrays (after any write-back in flight has landed)."""
    self.writer.drain()
    self.arrays = [{k: np.ascontiguousarray(v) for k, v in a.items()} for a in arrays]
    # Per array name, every table's array as 2-d (rows first), for `gather`'s one call.
    self._by_key = (
      {k: tuple(a[k].reshape(a[k].shape[0], -1) for a in self.arrays) for k in self.arrays[0]}
      if self.arrays and all(a.keys() == self.arrays[0].keys() for a in self.arrays)
      else None
    )

  def loaded(self) -> bool:
    """Whether tables were set (an example batch prepared before init reads none)."""
    return bool(self.arrays)

  def table(self, t: int) -> dict[str, np.ndarray]:
    """Table t's arrays (the live ones: current once the writer drained)."""
    return self.arrays[t]

  def put(self, t: int, rows: np.ndarray, values: dict[str, np.ndarray]) -> None:
    """table t's rows[i] = values[k][i] for each array k (caller's thread; writer drained)."""
    for k, v in self.arrays[t].items():
      v[rows] = values[k]

  def gather(self, segments: list[tuple[int, np.ndarray]], width: int) -> dict[str, np.ndarray]:
    """{k: [width, ...]}: the rows of segments [(table index, rows int[n_i])] one after
    another, then zeros. O(width) (the rows a list carries, never a table's)."""
    first = self.arrays[segments[0][0]] if segments else self.arrays[0]
    out = {k: np.zeros((width,) + v.shape[1:], v.dtype) for k, v in first.items()}
    if self._by_key is not None and len(segments) > 1:  # every table in one call per array
      tabs = np.repeat(np.array([t for t, _ in segments], np.int64),
                       [r.shape[0] for _, r in segments])  # fmt: skip
      rows = np.concatenate([r for _, r in segments]).astype(np.int64, copy=False)
      n = rows.shape[0]
      for k, v in out.items():
        if n:
          _take_tables(self._by_key[k], tabs, rows, v[:n].reshape(n, -1))
      return out
    at = 0
    for t, rows in segments:
      n = rows.shape[0]
      if n:
        for k, v in self.arrays[t].items():
          _take(v, rows, out[k][at : at + n])
      at += n
    return out

  def write_back(self, to_host, apply: Callable[[dict], None], steps: int = 1) -> None:
    """A step's output for the host (device arrays, O(1) here: no wait for the step) to the
    writer thread: its copy to the host starts as soon as the step ends; the writer waits
    for it, then `apply(values)` (numpy) scatters it into the tables, in step order.
    `write_seconds` counts the copy and the scatter, not the wait for the step. steps: the
    train steps whose write-backs `to_host` holds (a call of k: `Writer.submit`)."""
    for x in jax.tree.leaves(to_host):
      if isinstance(x, jax.Array):
        x.copy_to_host_async()

    def job():
      jax.block_until_ready(to_host)  # (the step's own time: not the writer's work)
      t0 = time.perf_counter()
      apply(to_host_values(to_host))
      self.write_seconds += time.perf_counter() - t0

    self.writer.submit(job, steps)

  def scatter(self, writes: list[tuple[int, np.ndarray, np.ndarray]], values: dict) -> None:
    """arrays[t][k][rows] = values[k][positions] for writes [(t, rows, positions)], in order.
    (Writer thread.) Every table's rows in one compiled call per array where the tables
    share their arrays' names: a call per table holds the GIL for its own dispatch."""
    writes = [w for w in writes if w[1].shape[0]]
    if self._by_key is not None and len(writes) > 1:
      tabs = np.repeat(np.array([t for t, _, _ in writes], np.int64),
                       [r.shape[0] for _, r, _ in writes])  # fmt: skip
      rows = np.concatenate([r for _, r, _ in writes]).astype(np.int64, copy=False)
      pos = np.concatenate([p for _, _, p in writes]).astype(np.int64, copy=False)
      for k, dsts in self._by_key.items():
        v = np.ascontiguousarray(values[k])
        _put_tables(dsts, tabs, rows, v.reshape(v.shape[0], -1), pos)
      return
    for t, rows, pos in writes:
      for k, v in self.arrays[t].items():
        _put(v, rows, np.ascontiguousarray(values[k]), pos)


class Recent:
  """Where the device still holds a row a step wrote back: a ring of `size` rows in the
  backend's state, written by each step with what it evicts (positions handed out here, in
  step order, on the input thread), read by a later step's loads.

  Rows are numbered over the tables of one ring (table t's row r: `row_off[t] + r`). A ring
  position is a counter (its slot: the counter modulo `size`); a position is still held at
  step k when fewer than `size` positions were handed out after it before step k."""

  def __init__(self, total_rows: int, steps_per_call: int = 1):
    self.steps_per_call = steps_per_call
    self.last_pos = np.full(total_rows, -1, np.int64)  # the latest write-back's position
    self.last_step = np.full(total_rows, -1, np.int64)  # ... and its step
    self.head = 0  # positions handed out so far
    self.size = 0  # ring rows (set by the first train batch: `resize`)
    self.step = 0  # train steps planned so far (the writer's job count at their end)

  def resize(self, size: int) -> None:
    """A ring of `size` rows (positions handed out before are no longer held)."""
    if size != self.size:
      self.size = int(size)
      self.head += self.size  # nothing older is held any more
      self.last_pos[:] = -1

  def sources(self, rows: np.ndarray) -> tuple[np.ndarray, int]:
    """rows int64[n] (numbered over the ring's tables) loaded by the next step planned ->
    (int32[n] their ring slots, ABSENT where the host holds the current value; the write-back
    count the host reads need: every step that wrote back a host-read row applied)."""
    pos = self.last_pos[rows]
    held = (pos >= 0) & (pos >= self.head - self.size)
    src = np.where(held, pos % max(self.size, 1), ABSENT).astype(np.int32)
    steps = self.last_step[rows][~held]
    return src, int(steps.max()) + 1 if steps.shape[0] else 0

  def check_in_call(self, need: int, owner: str) -> None:
    """Refuse (rather than wait forever) a host read that needs the write-back of a step of
    the call being prepared (`sources`' count `need`: steps since the last reset): with k
    steps per call, a call's write-backs reach the host only after the call, which runs
    once all its k batches are prepared. The ring is sized so that this never happens
    (`call_ring_steps`); a ring too small for a call says so."""
    k = self.steps_per_call
    first = self.step - self.step % k  # the first step of the call this step belongs to
    if k > 1 and need > first:
      raise RuntimeError(
        f"{owner}: train step {self.step} (of a call of {k} steps from step {first}) loads a "
        f"row that step {need - 1} of the same call wrote back, and the device ring of "
        f"recent write-backs ({self.size} rows) no longer holds it: its host copy is stale "
        "until the call ends. A step wrote back more rows than the ring was sized for; use "
        "train.steps_per_call=1 with this plan."
      )

  def assign(self, rows: np.ndarray) -> np.ndarray:
    """Ring slots for the rows the planned step writes back (int64[n], numbered over the
    ring's tables, distinct) -> int32[n]."""
    n = rows.shape[0]
    pos = self.head + np.arange(n, dtype=np.int64)
    self.head += n
    self.last_pos[rows] = pos
    self.last_step[rows] = self.step
    return (pos % max(self.size, 1)).astype(np.int32)

  def end_step(self) -> None:
    self.step += 1


class Outbox:
  """The write-backs planned for train steps not yet handed to the writer, in order: each
  prepare(train) adds one (`plan`), each update's output takes the oldest (`take`)."""

  def __init__(self):
    self._plans: collections.deque = collections.deque()

  def plan(self, writes) -> None:
    self._plans.append(writes)

  def take(self):
    if not self._plans:
      raise RuntimeError(
        "a step's write-back arrived with no prepared train batch left for it: every "
        "update must run on a batch prepare(train=True) returned, in order"
      )
    return self._plans.popleft()

  def clear(self) -> None:
    self._plans.clear()


def call_ring_steps(steps_per_call: int, prefetch: int, per_step: int = 1) -> int:
  """How many steps' worth of write-backs a device ring of recent write-backs holds.

  One step per call: `prefetch`, the input thread's run-ahead (a row read after that waits
  for its write-back on the host, `Writer.wait`: long landed in practice). k > 1 steps per
  call: at least every write-back of a call's k - 1 earlier steps, `per_step` lists each
  (the most write-back lists one step has): a row one step of a call evicts and a later
  step of the same call loads again is prepared before the call runs, and its host copy is
  current only after the call, so the ring MUST hold it (`Recent.check_in_call` refuses
  otherwise). Why the ring rather than pinning every row of the call's k batches in the
  device tier: pinning would refuse calls whose k batches outgrow the cache (k batches of
  misses over every table), while the ring is what one step per call already relies on
  (the step writes what it evicts there, a later step of the scan reads it there), only
  longer: O(k x a step's write-backs) rows, never O(table rows)."""
  if steps_per_call <= 1:
    return prefetch
  return max(prefetch, per_step * (steps_per_call - 1))


def widen(x: np.ndarray, width: int, fill, axis: int = 0) -> np.ndarray:
  """x with axis `axis` padded to `width` with `fill` (a scalar, or an array that
  broadcasts against the result, e.g. one value per row: [R, 1]), x itself when that wide
  already: a list sized per batch made its call's width (`Backend.stack_call`)."""
  x = np.asarray(x)
  axis %= x.ndim
  have = x.shape[axis]
  if have == width:
    return x
  out = np.empty(x.shape[:axis] + (width,) + x.shape[axis + 1 :], x.dtype)
  out[...] = fill
  out[(slice(None),) * axis + (slice(0, have),)] = x
  return out


def reset_staged(
  staged: dict, src: np.ndarray, pos: np.ndarray, rows: np.ndarray, initial: float
) -> None:
  """Rows a prepared batch carries from the host (staged {"table": f32[W, D], slot: f32[W,
  ...]}, src int32[W] their ring sources) reset in place at positions pos int[R]: the table
  to rows f32[R, D], every optimizer slot to `initial`, the ring source dropped (ABSENT), so
  the step trains the row from its reset values whatever the host or the ring held for it
  (a dynamic table's reused row, `Backend.place_resets`). O(R)."""
  if pos.size == 0:
    return
  for k, v in staged.items():
    v[pos] = rows if k == "table" else initial
  src[pos] = ABSENT


def to_host_values(values) -> dict:
  """The step's output copied to host memory (writer thread; waits for the step)."""
  return jax.device_get(values)


def rows_to_host(arrays: dict, lo: int, hi: int, window: int) -> dict:
  """Rows [lo, hi) (hi - lo <= window) of each device array [R, ...] on the host, read
  through a `window`-row slice: one program per array shape and window, wherever the rows
  start. Slicing [lo:hi] compiled a program per start and length (a cache's sync, a piece
  per table and chunk: ~100 programs at a smoke run's first checkpoint, a kernel build each
  on a GPU)."""
  total = next(iter(arrays.values())).shape[0]
  if not 0 <= lo <= hi <= total or hi - lo > window:
    raise ValueError(f"rows [{lo}, {hi}) of {total} through a window of {window} rows")
  window = min(window, total)
  start = max(0, min(lo, total - window))
  got = jax.device_get(_window(arrays, np.int32(start), window))
  return {k: v[lo - start : hi - start] for k, v in got.items()}


@functools.partial(jax.jit, static_argnums=2)
def _window(arrays: dict, start, window: int) -> dict:
  return {k: jax.lax.dynamic_slice_in_dim(v, start, window) for k, v in arrays.items()}


def layouts(specs, by_optimizer: bool = False) -> tuple[tuple[str, ...], ...]:
  """Table names (specs: {name: TableSpec}) grouped by row layout (dim, optimizer slots), in
  order: the tables one host list can carry (one array per key for all of them). by_optimizer:
  by the whole optimizer too (its learning rate, ...): tables one sparse update can take
  (offload's stacked caches)."""
  out: dict[tuple, list[str]] = {}
  for name, spec in specs.items():
    opt = spec.optimizer if by_optimizer else spec.optimizer.slot_names()
    out.setdefault((spec.dim, opt), []).append(name)
  return tuple(tuple(v) for v in out.values())
