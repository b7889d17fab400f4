"""The input's planning stage on a thread of its own: the first half of every group's
`prepare` (offload's planner: `OffloadGroup.prepare_ahead`) for batch k + 1 runs while the
input thread makes batch k's lists, reads its rows from the host tier and packs it.

Why: with offload tables the input thread can be the loop's slowest stage (the main thread
waits for it), and half of its work, the compiled planner, holds no GIL: on a thread of its
own it overlaps the other half, mostly Python (docs/running.md, "Measurements behind the
host-side code").

Ordering: each half runs in stream order on its own thread, and a second half reads only what
its first half returned (never the planners' state, which the next first half changes). The
host tier's reads, its ring and its waits for write-backs stay in the second half, on the
input thread, run ahead of the steps by the input thread's run-ahead; only the planning
runs up to `DEPTH` batches further ahead, and it reads no host row. A plan with a group that
does not split its prepare and keeps host state (hot_cold; offload at the SSD level) is
prepared on one thread (`splits`): its whole prepare would run further ahead of the steps than
its ring of recent write-backs covers.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator

from recgnn import planner
from recgnn.train import inputs

# Batches planned ahead of the input thread's second halves (besides the one being planned),
# and batches read ahead of the planning.
DEPTH = 2


def splits(plan: planner.Plan) -> bool:
  """Whether `prepare_stream` here gains over `inputs.prepare_stream`: a group splits its
  prepare (`splits_prepare`), and every group that keeps host state does (module doc)."""
  groups = list(plan.groups.values())
  split = [g.splits_prepare for g in groups]
  return any(split) and all(s or not g.capabilities.writes_host for g, s in zip(groups, split))


def bounded(depth: int) -> tuple[queue.SimpleQueue, queue.SimpleQueue]:
  """(items, room): a queue of at most `depth` items made of C calls only. A producer takes a
  token from `room` before each put, the consumer puts one back after each get: a producer
  ahead blocks in C, taking no GIL while it waits. (A polled bound would wake each waiting
  thread often, each wake taking the GIL from the launching thread; `queue.Queue`'s condition
  variable costs the main thread ~20 Python calls per step.)"""
  room: queue.SimpleQueue = queue.SimpleQueue()
  for _ in range(depth):
    room.put(None)
  return queue.SimpleQueue(), room


def ahead(items: Iterable, depth: int, name: str) -> Iterator:
  """The items of `items`, in order, made on a thread of their own (`name`) up to `depth`
  items ahead of the consumer; an error there is raised here, after the items before it.
  Closed early, the thread stops before its next item."""
  out, room = bounded(max(1, depth))
  stop = threading.Event()

  def run():
    try:
      for x in items:
        room.get()
        if stop.is_set():
          return
        out.put((x,))
      out.put(None)
    except BaseException as e:  # raised on the consuming thread
      out.put(e)

  thread = threading.Thread(target=run, name=name, daemon=True)
  thread.start()
  try:
    while True:
      x = out.get()
      room.put(None)
      if x is None:
        return
      if isinstance(x, BaseException):
        raise x
      yield x[0]
  finally:
    stop.set()
    room.put(None)


def prepare_stream(plan: planner.Plan, stream: Iterable, depth: int = DEPTH) -> Iterator:
  """`inputs.prepare_stream`, the first halves (`inputs.plan_stream`) run on a planning thread up to
  `depth` batches ahead, the second halves here, and the batches read on a reading thread up to
  `depth` batches ahead of the planning (the read holds no GIL, but on the planning thread it would
  keep the input's slowest stage from planning). The same `Prepared` items in the same order; an
  error of either thread is raised here, after the items before it."""
  read = ahead(stream, depth, "input reading")
  for kind, split, batch, second in ahead(inputs.plan_stream(plan, read), depth, "input planning"):
    yield inputs.Prepared(kind, split, batch, inputs.finish(second))
