"""The trainer's input thread: the stream of train and eval batches, each prepared (every
group's `prepare`, in stream order), packed into per-dtype host buffers and, where the
platform allows it, transferred to the devices on a background thread, ahead of the step.

Where the transfer is made, by platform (`sharding.needs_one_in_flight`):
  one device, or GPUs / TPUs   on a transfer thread of its own, as each batch is packed:
                               batch k+1 is on its way before step k's results are waited
                               on, the launching thread does no per-batch work but take it
                               (the H100 traces: 0.6-1.1 ms of main-thread `device_put` per
                               step), and the input thread, the slower stage for host-tier
                               plans, does not carry it either (on the input thread it cost
                               cdlrm_kaggle's no-work ceiling ~10%: benchmarks/host_path.py)
  several XLA:CPU devices      on the main thread (`InputThread.get`): 8-device runs hung in
                               XLA:CPU while a transfer was made during a step's launch
                               (recgnn.train.loop's docstring, issue 30)
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

from recgnn import planner, sharding
from recgnn.train import inputs
from recgnn.train import step as step_lib
from recgnn.train.task import Task


@dataclasses.dataclass
class Item:
  kind: str  # "train" | "eval" | "eval_end"
  split: str | None
  batch_size: int
  prepared: Any  # (buffers, layout) of (prepared ids, batch), step.Feeder.pack: device
  # buffers once transferred (by the input thread, or by `InputThread.get`: module docstring)
  on_device: bool = False


def stream(task: Task, start: int, total: int, eval_every: int, eval_split: str, final):
  """(kind, split, batch): train batches of steps [start, total), `task.batches_per_call` per
  call of k = `task.steps_per_call` steps (start, total and eval_every multiples of k: the
  loop checks),
  with an eval pass of `eval_split` after every `eval_every` steps, then a pass of each split
  in `final`; each pass ends with ("eval_end", split, None)."""
  train = task.train_batches(start)
  k = task.steps_per_call
  for s in range(start, total, k):
    for _ in range(task.batches_per_call):  # (k > 1: InputThread stacks them into one call)
      try:
        batch = next(train)
      except StopIteration:
        raise RuntimeError(
          f"{type(task).__name__}.train_batches ended at step {s}; it must cycle over epochs"
        ) from None
      yield "train", None, batch
    if eval_every and (s + k) % eval_every == 0 and s + k < total:
      for b in task.eval_batches(eval_split):
        yield "eval", eval_split, b
      yield "eval_end", eval_split, None
  for split in final:
    for b in task.eval_batches(split):
      yield "eval", split, b
    yield "eval_end", split, None


class InputThread:
  """Runs every group's `prepare` (inputs.prepare_stream), the packing of each batch into
  per-dtype host buffers and, where the platform allows (module docstring), its transfer,
  ahead of the step on a background thread; `get` (main thread) takes the next batch (and
  transfers it where the input thread may not).

  scale: examples counted per example of a batch (a process-local batch is 1 / processes of
  the global one; samples/s counts global examples)."""

  # How often a full queue is looked at again (the input thread is then `depth` batches
  # ahead). A polled bound keeps `get` one C call (`queue.SimpleQueue`): a `queue.Queue`'s
  # condition variable cost the main thread ~20 Python calls per step.
  POLL_S = 0.0005

  def __init__(
    self,
    items: Iterator,
    plan: planner.Plan,
    feeder: step_lib.Feeder,
    depth: int,
    task: Task,
    scale: int = 1,
  ):
    self._plan = plan
    self._scale = scale
    self._feeder = feeder
    self._task = task
    self._depth = max(1, depth)
    self._queue: queue.SimpleQueue = queue.SimpleQueue()
    self._stop = threading.Event()
    self.put_here = not sharding.needs_one_in_flight(plan.mesh)
    self.busy_seconds = 0.0
    # Packed batches on their way to the transfer thread (None: get() transfers them).
    self._packed: queue.SimpleQueue | None = queue.SimpleQueue() if self.put_here else None
    self._thread = threading.Thread(target=self._run, args=(items,), daemon=True)
    self._thread.start()
    self._transfer = None
    if self._packed is not None:
      self._transfer = threading.Thread(target=self._transfers, daemon=True)
      self._transfer.start()

  def _run(self, items):
    try:
      prepared = inputs.prepare_stream(self._plan, items)
      per_call = self._task.batches_per_call
      call: list = []  # train batches of the call being gathered (per_call > 1)
      while not self._stop.is_set():
        t0 = time.perf_counter()
        try:
          it = next(prepared)  # prepare runs here
        except StopIteration:
          break
        host, size = None, 0
        if it.batch is not None:
          size = self._task.num_examples(it.batch) * self._scale
        if it.kind == "train" and per_call > 1:
          # Each batch prepared alone (every batch's prepare in stream order), the call's k
          # batches made one shape by their groups, packed and stacked into one transfer.
          call.append((it.prepared, it.batch, size))
          self.busy_seconds += time.perf_counter() - t0
          if len(call) < per_call:
            continue
          t0 = time.perf_counter()
          host = self._feeder.pack_call([c[:2] for c in call])
          size, call = sum(c[2] for c in call), []
        elif it.batch is not None:
          host = self._feeder.pack(it.prepared, it.batch, f"{it.kind} batch")
        self.busy_seconds += time.perf_counter() - t0
        self._put(Item(it.kind, it.split, size, host), self._packed)
      self._put(None, self._packed)
    except BaseException as e:  # forwarded to the main thread, which re-raises
      self._put(e, self._packed)

  def _transfers(self):
    """The transfer thread: each packed batch to the devices, in order, then on to `get`."""
    while not self._stop.is_set():
      item = self._packed.get()
      if isinstance(item, Item):
        try:
          if item.prepared is not None:
            item.prepared = (self._feeder.put(item.prepared[0]), item.prepared[1])
          item.on_device = True
        except BaseException as e:  # forwarded to the main thread, which re-raises
          item = e
      self._put(item)
      if item is None or isinstance(item, BaseException):
        return

  def _put(self, item, into: queue.SimpleQueue | None = None):
    """`item` onto `into` (default: the queue `get` reads), once it holds fewer than
    `depth` items."""
    into = self._queue if into is None else into
    while into.qsize() >= self._depth and not self._stop.is_set():
      time.sleep(self.POLL_S)
    if not self._stop.is_set():
      into.put(item)

  def get(self) -> Item | None:
    """The next item, its batch on the devices (transferred here where the input thread may
    not: several XLA:CPU devices)."""
    item = self._queue.get()
    if isinstance(item, BaseException):
      raise item
    if item is not None and item.prepared is not None and not item.on_device:
      buffers, layout = item.prepared
      item.prepared = (self._feeder.put(buffers), layout)
      item.on_device = True
    return item

  def close(self):
    self._stop.set()
    if self._packed is not None:
      self._packed.put(None)  # (wakes the transfer thread if it waits for a batch)
    self._thread.join(timeout=5)
    if self._transfer is not None:
      self._transfer.join(timeout=5)
