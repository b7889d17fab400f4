"""A plan's whole train step, timed as the trainer runs it (`plan=auto`'s finalists).

The planner ranks plans by a sum: each table's step timed alone, each group's fixed part once,
the model part once (`recgnn.planner.auto.PlanChoice.predicted_step_s`). What the sum
cannot see (what XLA fuses or serializes across groups, a micro-batch split running the model
in pieces, the input thread's prepare competing for the cores, host-tier groups each
compiling their own list sizes) is in the trainer's step: so the planner's few finalists are
each built (`recgnn.train.setup.build`) and run here on the run's first batches through the
trainer's own input thread, and the fastest is taken.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import jax

from recgnn.embeddings import base
from recgnn.train.input_thread import InputThread

# Part of a whole step's cost cache key: raised whenever `whole_step_seconds` changes what it
# times.
VERSION = 1
# Calls before the clock starts: they compile the step for the shapes the first batches need
# (a host tier's bucketed list sizes) and fill the host tiers' caches from cold.
WARM_CALLS = 6
# Calls per timed chunk (one host sync at its end, as the trainer syncs at its log lines), and
# chunks: a chunk that compiled a new list size is an outlier the median leaves out.
CHUNK_CALLS = 3
CHUNKS = 8


def batches_needed(batches_per_call: int = 1) -> int:
  """Train batches `whole_step_seconds` runs (its calls x `Task.batches_per_call`)."""
  return (WARM_CALLS + CHUNK_CALLS * CHUNKS) * batches_per_call


def whole_step_seconds(run, batches: Sequence[dict]) -> float:
  """Median seconds per train step of `run` (a `recgnn.train.setup.Run`, its initial state
  donated) over `batches` (task batches, `Task.batches_per_call` per call;
  `batches_needed(batches_per_call)` of them, in order),
  each chunk of CHUNK_CALLS calls timed after the first WARM_CALLS, batches prepared and
  packed ahead on the trainer's input thread (`InputThread`), steps dispatched without a
  sync between them."""
  need = (WARM_CALLS + CHUNK_CALLS) * run.task.batches_per_call  # (k batches per call: k > 1)
  if len(batches) < need:
    raise ValueError(f"whole_step_seconds needs at least {need} batches, got {len(batches)}")
  items = iter([("train", None, b) for b in batches])
  feed = InputThread(items, run.plan, run.feeder, depth=base.PREFETCH, task=run.task)
  per_call = run.task.steps_per_call
  state, chunks, calls = run.state, [], 0
  try:
    t0 = None
    while (item := feed.get()) is not None:
      state, _ = run.train_step(state, *item.prepared)
      calls += 1
      if calls >= WARM_CALLS and (calls - WARM_CALLS) % CHUNK_CALLS == 0:
        jax.block_until_ready(state)
        now = time.perf_counter()
        if t0 is not None:
          chunks.append((now - t0) / (CHUNK_CALLS * per_call))
        t0 = now
  finally:
    feed.close()
  del state
  return float(statistics.median(chunks))
