"""The trainer's input thread: the stream of train and eval batches, each prepared (every
group's `prepare`, in stream order) and packed into per-dtype host buffers on a background
thread, ahead of the step; the transfer happens on the main thread (`InputThread.get`).

The thread never calls into the devices: on CPU devices, 8-device runs hung in XLA:CPU while
a transfer was made during a step's launch (recgnn.train.loop's docstring, issue 30).
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

from recgnn import planner
from recgnn.train import inputs
from recgnn.train import step as step_lib
from recgnn.train.task import Task


@dataclasses.dataclass
class Item:
  kind: str  # "train" | "eval" | "eval_end"
  split: str | None
  batch_size: int
  prepared: Any  # (buffers, layout) of (prepared ids, batch), step.Feeder.pack: host buffers
  # on the queue, device buffers once `InputThread.get` transferred them


def stream(task: Task, start: int, total: int, eval_every: int, eval_split: str, final):
  """(kind, split, batch): train batches of steps [start, total), one per call of k =
  `task.steps_per_call` steps (start, total and eval_every multiples of k: the loop checks),
  with an eval pass of `eval_split` after every `eval_every` steps, then a pass of each split
  in `final`; each pass ends with ("eval_end", split, None)."""
  train = task.train_batches(start)
  k = task.steps_per_call
  for s in range(start, total, k):
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
  """Runs every group's `prepare` (inputs.prepare_stream) and the packing of each batch into
  per-dtype host buffers ahead of the step on a background thread; `get` (main thread) makes
  the transfer. The thread never calls into the devices (see the module docstring).

  scale: examples counted per example of a batch (a process-local batch is 1 / processes of
  the global one; samples/s counts global examples)."""

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
    self._queue: queue.Queue = queue.Queue(maxsize=depth)
    self._stop = threading.Event()
    self.busy_seconds = 0.0
    self._thread = threading.Thread(target=self._run, args=(items,), daemon=True)
    self._thread.start()

  def _run(self, items):
    try:
      prepared = inputs.prepare_stream(self._plan, items)
      while not self._stop.is_set():
        t0 = time.perf_counter()
        try:
          it = next(prepared)  # prepare runs here
        except StopIteration:
          break
        host = None
        if it.batch is not None:
          host = self._feeder.pack(it.prepared, it.batch, f"{it.kind} batch")
        self.busy_seconds += time.perf_counter() - t0
        size = self._task.num_examples(it.batch) * self._scale if it.batch is not None else 0
        self._put(Item(it.kind, it.split, size, host))
      self._put(None)
    except BaseException as e:  # forwarded to the main thread, which re-raises
      self._put(e)

  def _put(self, item):
    while not self._stop.is_set():
      try:
        self._queue.put(item, timeout=0.1)
        return
      except queue.Full:
        continue

  def get(self) -> Item | None:
    """The next item, its batch transferred to the devices (from the calling thread)."""
    item = self._queue.get()
    if isinstance(item, BaseException):
      raise item
    if item is not None and item.prepared is not None:
      buffers, layout = item.prepared
      item.prepared = (self._feeder.put(buffers), layout)
    return item

  def close(self):
    self._stop.set()
    self._thread.join(timeout=5)
