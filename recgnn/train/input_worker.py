"""The trainer's input pipeline in a worker process (`train.input_workers=1`): each
batch read, prepared and packed in a forked child (`packing.Packing`, the same code as the
input thread), its packed buffers written into a ring of shared-memory slots; the training
process maps the slot, transfers it to the devices and hands the slot back.

Why a process: the input thread's Python (the batch iterator, every group's `prepare`, the
packing) holds the GIL that the launching thread needs (in GPU traces the two threads' Python
never overlapped: docs/gpu.md); the child has a GIL of its own, and the training process
keeps only a receive, a few views and the transfer.

Why fork (not spawn, not grain's multiprocessing): the child continues the trainer's own
stream as it is at the fork (the task's iterator at the resumed position, the plan's groups,
the feeder's packers), so the child makes byte for byte the buffers the input thread would
(nothing rebuilt: spawn would import and build task and plan again, seconds, and must rebuild
them identically; grain's workers need the pipeline as a random-access source and stateless
maps: each backend's look-ahead `prepare` is neither). The price: the child may run host code
only (numpy, numba, the pytree library), never call into the XLA runtime, whose threads did
not come along; hence `Task.forkable_input` and `Capabilities.stateless_prepare`, checked by
`workers_for`, and the plans they exclude (host tiers: their planners mirror device caches the
step fills and read host tables the writer thread writes) stay on the thread.

Slots: files under /dev/shm made by the child, opened and mapped by the parent, which unlinks
the name at once: both mappings stay valid, and nothing is left behind when either process dies
(the parent's `close` removes any file of the ring it never opened, and so does a child that
finds its parent gone). A slot that is too small
for a batch (an eval batch, 8x a train batch) is replaced by a larger file.

Failures: an exception in the child is sent with its traceback and raised in the training
process (`InputWorkerError`, the child's traceback in its message); a child that dies without
one (killed, a crash) is noticed within `POLL_S` by the receiver: never a wait forever. The
child ignores SIGINT / SIGTERM (the trainer's own handling stops it) and exits when its parent
is gone.
"""

from __future__ import annotations

import contextlib
import glob
import mmap
import multiprocessing
import os
import signal
import threading
import time
import traceback
import uuid
import warnings
from collections.abc import Callable, Iterator

import numpy as np

from recgnn import planner
from recgnn.train import inputs
from recgnn.train import packing as packing_lib
from recgnn.train.packing import Item
from recgnn.train.task import Task

#: Where the ring's files live: memory, not disk.
SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else None
#: Byte alignment of each buffer in a slot (a cache line; XLA's CPU client copies either way).
ALIGN = 64
#: Seconds between checks that the other process is still there.
POLL_S = 0.2
#: train.input_workers values: -1 = auto (a worker where the task and plan allow one and the
#: host has MIN_CPUS).
AUTO = -1
#: CPUs this process may run on below which auto keeps the thread: a worker only pays with a
#: core of its own. On 2 CPUs (shared) it lost to the thread: dlrm_kaggle's no-work ceiling
#: 0.68x at k = 1 and 0.55x at k = 8 (benchmarks/results/host_path_worker_*against_a99a7d3.md),
#: the worker and the training process's threads competing for the same two cores.
MIN_CPUS = 4


def available_cpus() -> int:
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:  # (no affinity on this platform)
    return os.cpu_count() or 1


class InputWorkerError(RuntimeError):
  """The input worker failed: its exception's traceback, or how it died. user_line: the
  child's exception as one line where it was a user error (`packing.USER_ERRORS`)."""

  def __init__(self, text: str, user_line: str | None = None):
    super().__init__(text)
    self.user_line = user_line


def workers_for(setting: int, task: Task, plan: planner.Plan) -> tuple[int, str]:
  """`train.input_workers` -> (worker processes: 0 or 1, a log line saying which and why).

  A worker needs the task's batches readable in a forked child (`Task.forkable_input`) and
  every group's `prepare` free of host state the training process reads
  (`Capabilities.stateless_prepare`). auto (-1): a worker when both hold and this process has
  `MIN_CPUS` CPUs, else the input thread; 1: refused (ValueError, the reasons) when they do
  not hold (whatever the CPUs); 0: the thread."""
  if setting == 0:
    return 0, "input on a thread of the training process (train.input_workers=0)"
  if setting not in (AUTO, 1):
    raise ValueError(
      f"train.input_workers={setting}: valid are -1 (auto), 0 (a thread) and 1 (one worker "
      "process; batches are prepared in stream order, so more than one is not built)"
    )
  why = []
  if SHM_DIR is None or "fork" not in multiprocessing.get_all_start_methods():
    why.append("this platform has no fork or /dev/shm")
  reason = task.forkable_input()
  if reason:
    why.append(reason)
  for group in plan.groups.values():
    if not group.capabilities.stateless_prepare:
      why.append(
        f"group {group.text!r}: its prepare keeps host state the training process reads "
        "(Capabilities.stateless_prepare)"
      )
  cpus = available_cpus()
  if not why and setting == AUTO and cpus < MIN_CPUS:
    return 0, (
      f"input on a thread of the training process: {cpus} CPU(s), and a worker process pays "
      f"from {MIN_CPUS} (train.input_workers=1 uses one anyway)"
    )
  if not why:
    return 1, "input in a worker process (train.input_workers): read, prepare, pack"
  if setting == 1:
    raise ValueError(
      "train.input_workers=1, but the input cannot run in a worker process: "
      f"{'; '.join(why)}. Use train.input_workers=0 (a thread) or -1 (auto)."
    )
  return 0, "input on a thread of the training process: " + "; ".join(why)


@contextlib.contextmanager
def _forking():
  """Python 3.12 (multi-threaded process) and JAX (its runtime's threads) warn at every fork:
  the child here never calls into the runtime (module docstring), so the warnings say
  nothing about this fork."""
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=r".*fork\(\).*", category=DeprecationWarning)
    warnings.filterwarnings("ignore", message=r".*fork\(\).*", category=RuntimeWarning)
    yield


class InputWorker:
  """The parent's side: starts the child on `produce()` (a `packing.Packing`: `Item`s with
  host buffers, run in the child) and iterates the items it sends, each batch's buffers
  numpy views of its slot: call `item.release()` once they are transferred (the slot is then
  the child's again). `slots`: batches packed ahead at most. copy_out: each batch copied out
  of its slot as it arrives and the slot handed back at once (`item.release` None): where
  the transfer may alias host memory instead of copying it (XLA's CPU client maps an aligned
  numpy buffer into the device array, may_alias=False or not), a device array
  would otherwise show the slot's next batch."""

  def __init__(self, produce: Callable[[], Iterator], slots: int, copy_out: bool = False):
    ctx = multiprocessing.get_context("fork")
    self._items, items_w = ctx.Pipe(duplex=False)
    frees_r, self._frees = ctx.Pipe(duplex=False)
    self._prefix = os.path.join(SHM_DIR or "", f"recgnn-input-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    self._proc = ctx.Process(
      target=_child,
      args=(produce, items_w, frees_r, max(1, slots), self._prefix),
      name="recgnn-input",
      daemon=True,
    )
    with _forking():
      self._proc.start()
    items_w.close()  # (the child's ends: only the child holds them now)
    frees_r.close()
    self._send_lock = threading.Lock()
    self._maps: dict[int, tuple[str, mmap.mmap]] = {}  # slot -> (its file, the mapping)
    self._layouts: dict[int, inputs.PackLayout] = {}  # the child's layout ids
    self.busy_seconds = 0.0  # the child's wall time in read / prepare / pack (Packing's)
    self.cpu_seconds = 0.0  # the child's CPU time (all its threads)
    self.batches = 0
    self._copy_out = copy_out

  @property
  def pid(self) -> int | None:
    return self._proc.pid

  def __iter__(self) -> Iterator:
    while True:
      msg = self._recv()
      kind = msg[0]
      if kind == "error":
        raise InputWorkerError(
          f"the input worker (pid {self.pid}) failed; its traceback:\n{msg[1]}", msg[2]
        )
      self.busy_seconds, self.cpu_seconds, self.batches = msg[-3:]
      if kind == "end":
        return
      _, what, split, size, slot, path, metas, host, lid, layout = msg[:10]
      if layout is not None:  # a new structure: its layout once, then its id
        self._layouts[lid] = inputs.PackLayout(*layout)
      prepared, release = None, None
      if slot is not None:
        buf = self._map(slot, path)
        bufs = [
          np.frombuffer(buf, np.dtype(d), int(np.prod(shape)), off).reshape(shape)
          for d, shape, off in metas
        ]
        if self._copy_out:
          bufs = [b.copy() for b in bufs]
          self.release(slot)
        else:
          release = _Release(self, slot)
        prepared = ((bufs, host), self._layouts[lid])
      yield Item(what, split, size, prepared, release=release)

  def _recv(self):
    while not self._items.poll(POLL_S):
      if not self._proc.is_alive() and not self._items.poll(0):
        raise self._died()
    try:
      return self._items.recv()
    except EOFError:  # (its end closed: it is exiting)
      self._proc.join(timeout=5)
      raise self._died() from None

  def _died(self) -> InputWorkerError:
    return InputWorkerError(
      f"the input worker (pid {self.pid}) died with exit code {self._proc.exitcode} before "
      "sending its next batch (a negative code is the signal that ended it; its stderr, "
      "above, may say more)"
    )

  def _map(self, slot: int, path: str | None):
    """The slot's mapping; a new file (first use, or grown): opened, mapped, unlinked."""
    if path is not None:
      with open(path, "r+b") as f:
        m = mmap.mmap(f.fileno(), 0)
      os.unlink(path)
      old = self._maps.pop(slot, None)
      if old is not None:
        with contextlib.suppress(BufferError):  # (views still alive: unmapped when they go)
          old[1].close()
      self._maps[slot] = (path, m)
    return self._maps[slot][1]

  def release(self, slot: int) -> None:
    with self._send_lock, contextlib.suppress(OSError):  # (a child gone: nothing to hand)
      self._frees.send(slot)

  def stop(self) -> None:
    """Ends the child: asked through its pipe, terminated if it has not gone in 5 s."""
    with self._send_lock, contextlib.suppress(OSError):
      self._frees.send(None)
    self._proc.join(timeout=5)
    if self._proc.is_alive():
      self._proc.terminate()
      self._proc.join(timeout=5)

  def close(self) -> None:
    """After `stop` and once nothing reads the items (the receiving thread joined)."""
    self.stop()
    for f in glob.glob(self._prefix + "-*"):  # files of slots the parent never opened
      with contextlib.suppress(OSError):
        os.unlink(f)
    self._items.close()
    self._frees.close()


class _Release:
  """An item's `release`: hands its slot back to the child, once."""

  __slots__ = ("_slot", "_worker")

  def __init__(self, worker: InputWorker, slot: int):
    self._worker, self._slot = worker, slot

  def __call__(self):
    if self._slot is not None:
      self._worker.release(self._slot)
      self._slot = None


# ----------------------------------------------------------------------------- the child


class _Stopped(Exception):
  """The parent said stop (or is gone) while the child waited for a slot."""


class _Ring:
  """The child's slots: a file and mapping each, replaced by a larger one when a batch does
  not fit. `alloc` (the packing's `inputs.Alloc`) waits for a slot the parent has handed back
  and lays the batch's buffers out in it, so the packing writes them there (no copy)."""

  def __init__(self, prefix: str, slots: int, frees, parent: int):
    self._prefix, self._frees, self._parent = prefix, frees, parent
    self._free = list(range(slots))
    self._maps: dict[int, tuple[int, mmap.mmap]] = {}  # slot -> (its size, the mapping)
    self._made = 0
    self.paths: list[str] = []  # every file made (`_child` removes them when stopped)
    # (slot, its new file or None, [(dtype, shape, offset)]) of the buffers `alloc` made last
    self.current: tuple | None = None

  def _take(self) -> int:
    while not self._free:
      if self._frees.poll(POLL_S):
        slot = self._frees.recv()
        if slot is None:
          raise _Stopped
        self._free.append(slot)
      elif os.getppid() != self._parent:
        raise _Stopped
    return self._free.pop(0)

  def alloc(self, shapes: list) -> list:
    """[(dtype str, shape)] -> an array of each, laid out in a free slot (`current`)."""
    slot = self._take()
    metas, end = [], 0
    for d, shape in shapes:
      metas.append((d, shape, end))
      end += -(-int(np.prod(shape)) * np.dtype(d).itemsize // ALIGN) * ALIGN
    size, m = self._maps.get(slot, (0, None))
    path = None
    if end > size:
      size = max(end, 2 * size, mmap.PAGESIZE)
      self._made += 1
      path = f"{self._prefix}-{slot}-{self._made}"
      self.paths.append(path)
      fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
      try:
        os.ftruncate(fd, size)
        m = mmap.mmap(fd, size)
      finally:
        os.close(fd)
      self._maps[slot] = (size, m)
    self.current = (slot, path, metas)
    return [
      np.frombuffer(m, np.dtype(d), int(np.prod(sh)), off).reshape(sh) for d, sh, off in metas
    ]


def _child(produce, items_w, frees_r, slots: int, prefix: str) -> None:
  # The trainer's SIGTERM / Ctrl-C handling stops the child through its pipe (a signal to the
  # process group must not end the input mid-checkpoint).
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  signal.signal(signal.SIGTERM, signal.SIG_IGN)
  parent = os.getppid()
  ring = _Ring(prefix, slots, frees_r, parent)
  layouts: dict[int, int] = {}  # id(layout) -> the id sent (the layouts kept alive below)
  kept: list = []
  packing = None
  try:
    packing = produce()
    packing.alloc = ring.alloc  # (every batch packed straight into a slot)
    for item in packing:
      slot = path = metas = lid = layout = None
      host: list = []
      if item.prepared is not None:
        (bufs, host), lay = item.prepared
        lid = layouts.get(id(lay))
        if lid is None:
          lid = layouts[id(lay)] = len(kept)
          kept.append(lay)
          layout = (lay.treedef, lay.where)
        if ring.current is None:  # (a producer that made its own buffers: copied in)
          for b, view in zip(bufs, ring.alloc([(b.dtype.str, b.shape) for b in bufs])):
            view[...] = b
        slot, path, metas = ring.current
      ring.current = None
      stats = (packing.busy_seconds, time.process_time(), packing.batches)
      items_w.send(
        ("item", item.kind, item.split, item.batch_size, slot, path, metas, host, lid, layout)
        + stats
      )
    items_w.send(("end", packing.busy_seconds, time.process_time(), packing.batches))
  except _Stopped:  # (stopped, or the parent is gone: a file it never opened is left to us)
    for path in ring.paths:
      with contextlib.suppress(OSError):
        os.unlink(path)
  except BaseException as e:  # sent to the parent, which raises it with this traceback
    with contextlib.suppress(OSError):
      items_w.send(("error", traceback.format_exc(), packing_lib.user_line(e)))
