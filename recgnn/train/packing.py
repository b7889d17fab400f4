"""The host half of the trainer's input: the stream's batches read, prepared (every group's
`prepare`, in stream order, with the look-ahead window) and packed into per-dtype host buffers,
a call's k train batches stacked into one. One copy, run by the input thread
(`input_thread.InputThread`) or in a worker process (`input_worker.InputWorker`): the same code
makes the same buffers either way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterable
from typing import Any

from recgnn import planner
from recgnn.train import feeder as feeder_lib
from recgnn.train import inputs, plan_ahead
from recgnn.train.task import Task

#: Errors of the data or the plan (a malformed file, a cache too small for a batch): raised on
#: the input side, they reach the user as one line naming the fix (`user_line`), exit 2, as
#: the plan's own errors do before the first step; any other exception is a bug (traceback).
USER_ERRORS = (ValueError, LookupError, OSError)


def user_line(e: BaseException) -> str | None:
  """The line an input-side user error reaches the user as (`USER_ERRORS`), else None."""
  if not isinstance(e, USER_ERRORS):
    return None
  text = str(e).strip().splitlines()
  return f"{type(e).__name__}: {text[0] if text else ''} (raised on the input side)"


def mark_input_side(e: BaseException) -> BaseException:
  """`e` with `user_line` set where it is a user error (run.py prints it, exit 2)."""
  line = user_line(e)
  if line is not None and getattr(e, "user_line", None) is None:
    with contextlib.suppress(AttributeError):  # (an exception type with __slots__)
      e.user_line = line
  return e


@dataclasses.dataclass
class Item:
  kind: str  # "train" | "eval" | "eval_end"
  split: str | None
  batch_size: int
  # ((buffers, host leaves), layout) of (prepared ids, batch), `feeder.Feeder.pack` (None for
  # "eval_end"): device buffers once transferred (`on_device`)
  prepared: Any
  on_device: bool = False
  # Hands the host buffers' memory back once they are transferred (a worker's slot); None
  # when they are the item's own.
  release: Callable[[], None] | None = None


class Packing:
  """(kind, split, batch) items -> `Item`s with packed host buffers, in order. busy_seconds:
  wall time spent here (prepare, pack, stack, and the reads the look-ahead pulls; with a
  planning thread, `plan_ahead`, its work only as far as this thread waits for it); batches:
  batches packed. scale: examples counted per example of a batch (a process-local batch is
  1 / processes of the global one; samples/s counts global examples)."""

  def __init__(
    self,
    items: Iterable,
    plan: planner.Plan,
    feeder: feeder_lib.Feeder,
    task: Task,
    scale: int = 1,
  ):
    self._items, self._plan, self._feeder = items, plan, feeder
    self._task, self._scale = task, scale
    self.busy_seconds = 0.0
    self.batches = 0
    # Where each item's buffers are made (`inputs.Alloc`; a worker's slot), None: new arrays.
    self.alloc: inputs.Alloc | None = None

  def __iter__(self):
    # (the planning stage on a thread of its own where the plan's groups allow it: plan_ahead)
    stream = plan_ahead.prepare_stream if plan_ahead.splits(self._plan) else inputs.prepare_stream
    prepared = stream(self._plan, self._items)
    per_call = self._task.batches_per_call
    call: list = []  # train batches of the call being gathered (per_call > 1)
    while True:
      t0 = time.perf_counter()
      try:
        it = next(prepared)  # prepare runs here
      except StopIteration:
        return
      host, size = None, 0
      if it.batch is not None:
        size = self._task.num_examples(it.batch) * self._scale
        self.batches += 1
      if it.kind == "train" and per_call > 1:
        # Each batch prepared alone (every batch's prepare in stream order), the call's k
        # batches made one shape by their groups, packed and stacked into one transfer.
        call.append((it.prepared, it.batch, size))
        self.busy_seconds += time.perf_counter() - t0
        if len(call) < per_call:
          continue
        t0 = time.perf_counter()
        host = self._feeder.pack_call([c[:2] for c in call], self.alloc)
        size, call = sum(c[2] for c in call), []
      elif it.batch is not None:
        host = self._feeder.pack(it.prepared, it.batch, f"{it.kind} batch", self.alloc)
      self.busy_seconds += time.perf_counter() - t0
      yield Item(it.kind, it.split, size, host)
