"""The trainer's input thread: the stream of train and eval batches, each prepared (every
group's `prepare`, in stream order) and packed into per-dtype host buffers (`packing`: here,
or in a worker process, `input_worker`, train.input_workers) and, where the platform allows
it, transferred to the devices on a background thread, ahead of the step.

Where the transfer is made, by platform (`sharding.needs_one_in_flight`):
  one device, or GPUs / TPUs   on a transfer thread of its own, as each batch is packed:
                               batch k+1 is on its way before step k's results are waited
                               on, the launching thread does no per-batch work but take it
                               (on a GPU the main thread's `device_put` is a per-step cost:
                               docs/gpu.md), and the input thread, the slower stage for
                               host-tier plans, does not carry it either (docs/gpu.md)
  several XLA:CPU devices      on the main thread (`InputThread.get`): 8-device runs hung in
                               XLA:CPU while a transfer was made during a step's launch
                               (recgnn.train.loop's docstring; docs/multi-device.md)
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import jax

from recgnn import planner, sharding
from recgnn.train import feeder as feeder_lib
from recgnn.train import plan_ahead
from recgnn.train.input_worker import InputWorker
from recgnn.train.packing import Item, Packing, mark_input_side
from recgnn.train.task import Task


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
  """Runs the host half of the input (`packing.Packing`: every group's `prepare`, the
  packing of each batch into per-dtype host buffers) ahead of the step, on a background
  thread or, with `worker`, in a worker process (`input_worker.InputWorker`: this thread then
  only receives its batches), and, where the platform allows (module docstring), the
  transfer; `get` (main thread) takes the next batch (and transfers it where the input
  thread may not).

  scale: examples counted per example of a batch (a process-local batch is 1 / processes of
  the global one; samples/s counts global examples)."""

  def __init__(
    self,
    items: Iterator,
    plan: planner.Plan,
    feeder: feeder_lib.Feeder,
    depth: int,
    task: Task,
    scale: int = 1,
    worker: bool = False,
  ):
    self._feeder = feeder
    self._depth = max(1, depth)
    self._stop = threading.Event()
    self.put_here = not sharding.needs_one_in_flight(plan.mesh)
    self._packing = Packing(items, plan, feeder, task, scale)
    # The worker forks here, before this object's threads exist (its copy of the stream is
    # the one `_packing` holds, not yet started).
    # (XLA:CPU's device arrays alias the host buffers they were put from: `copy_out`)
    cpu = plan.mesh.devices.flat[0].platform == "cpu"
    self.worker = (
      InputWorker(lambda: self._packing, slots=self._depth + 1, copy_out=cpu) if worker else None
    )
    # The queue `get` reads, and its room (`plan_ahead.bounded`).
    self._queue, self._room = plan_ahead.bounded(self._depth)
    # Packed batches on their way to the transfer thread (None: no transfer thread; with a
    # worker, the thread that receives its batches has nothing else to do and transfers them).
    self._packed = plan_ahead.bounded(self._depth) if self.put_here and not worker else None
    source = self._packing if self.worker is None else self.worker
    self._thread = threading.Thread(target=self._run, args=(source,), daemon=True)
    self._thread.start()
    self._transfer = None
    if self._packed is not None:
      self._transfer = threading.Thread(target=self._transfers, daemon=True)
      self._transfer.start()

  @property
  def busy_seconds(self) -> float:
    """Wall seconds of read, prepare and pack (the worker's, with one)."""
    return (self.worker or self._packing).busy_seconds

  def _run(self, source):
    inline = self.put_here and self.worker is not None
    try:
      for item in source:
        if inline:
          self._to_device(item)
        self._put(item, self._packed)
        if self._stop.is_set():
          break
      self._put(None, self._packed)
    except BaseException as e:  # forwarded to the main thread, which re-raises
      self._put(mark_input_side(e), self._packed)

  def _transfers(self):
    """The transfer thread: each packed batch to the devices, in order, then on to `get`."""
    items, room = self._packed
    while not self._stop.is_set():
      item = items.get()
      room.put(None)
      if isinstance(item, Item):
        try:
          self._to_device(item)
        except BaseException as e:  # forwarded to the main thread, which re-raises
          item = mark_input_side(e)
      self._put(item)
      if item is None or isinstance(item, BaseException):
        return

  def _put(self, item, into: tuple | None = None):
    """`item` onto `into` (default: the queue `get` reads) once it has room
    (`plan_ahead.bounded`)."""
    items, room = (self._queue, self._room) if into is None else into
    room.get()
    if not self._stop.is_set():
      items.put(item)

  def get(self) -> Item | None:
    """The next item, its batch on the devices (transferred here where the input thread may
    not: several XLA:CPU devices)."""
    item = self._queue.get()
    self._room.put(None)
    if isinstance(item, BaseException):
      raise item
    if item is not None and not item.on_device:
      self._to_device(item)
    return item

  def _to_device(self, item: Item) -> None:
    """The item's batch transferred; a worker's slot handed back once the copy is done
    (a transfer may read its host buffer after `put` returns)."""
    if item.prepared is not None:
      buffers, layout = item.prepared
      item.prepared = (self._feeder.put(buffers), layout)
      if item.release is not None:
        jax.block_until_ready(item.prepared[0])
        item.release()
    item.on_device = True

  def close(self):
    self._stop.set()
    if self.worker is not None:
      self.worker.stop()  # (the receiving thread then ends within the worker's POLL_S)
    for _, room in (self._queue, self._room), self._packed or (None, None):
      for _ in range(self._depth + 2) if room is not None else ():  # (wakes the producers)
        room.put(None)
    if self._packed is not None:
      self._packed[0].put(None)  # (wakes the transfer thread if it waits for a batch)
    self._thread.join(timeout=5)
    if self._transfer is not None:
      self._transfer.join(timeout=5)
    if self.worker is not None:
      self.worker.close()
