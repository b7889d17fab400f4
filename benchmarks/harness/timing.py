"""Timing inside one process: calls blocked on their results, contestants in round-robin.

  time_calls(fn, repeat)                  min / median / max of blocked calls
  jitted_runner(fn, state, inputs)        run(k): k donated steps, then block
  interleaved_timing(runners, ...)        contestants in round-robin (rep r of each before
                                          r + 1 of any), with CPU time and page faults
  prepare_without_steps()                 a host tier's prepare timed with no step run (its
                                          reads of written-back rows do not wait)

The machine is shared: interleaving exposes every contestant to the same load, so their ratios
are fair when the absolute numbers drift. Separate processes: harness/processes.py.
"""

from __future__ import annotations

import contextlib
import resource
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np


def time_calls(fn: Callable[[], Any], repeat: int, warmup: int = 1) -> dict:
  """Seconds of `repeat` calls of fn() (after `warmup` untimed ones), each blocked on its
  result (jax.block_until_ready: asynchronous dispatch inside the measurement): min, median,
  max and every run."""
  block = _blocker()
  for _ in range(warmup):
    block(fn())
  runs = []
  for _ in range(repeat):
    t0 = time.perf_counter()
    block(fn())
    runs.append(time.perf_counter() - t0)
  return {
    "min_s": min(runs),
    "median_s": statistics.median(runs),
    "max_s": max(runs),
    "runs_s": runs,
  }


def _blocker() -> Callable[[Any], Any]:
  jax = sys.modules.get("jax")
  return jax.block_until_ready if jax is not None else (lambda x: x)


def jitted_runner(fn, state, inputs):
  """run(k): k steps of `state = fn(state, inputs[i])` (state donated), then block on it.

  Blocking at the end of each run puts asynchronous dispatch inside the measurement.
  """
  import jax

  box = {"state": state, "i": 0}

  def run(k: int):
    st = box["state"]
    for _ in range(k):
      st = fn(st, inputs[box["i"] % len(inputs)])
      box["i"] += 1
    box["state"] = jax.block_until_ready(st)
    return box["state"]

  run.box = box
  return run


def interleaved_timing(
  runners: dict[str, Callable[[int], Any]],
  warmup: int,
  reps: int,
  steps_per_rep: dict[str, int] | int,
) -> dict[str, dict]:
  """Times several contestants in round-robin: rep r of each before rep r + 1 of any.

  The machine is shared; interleaving exposes every contestant to the same load, so their
  ratios are fair even when the absolute numbers drift. Returns, per name,
  {"step_ms": median over reps of the mean step time, "per_rep_ms": [...]}.
  """
  if isinstance(steps_per_rep, int):
    steps_per_rep = dict.fromkeys(runners, steps_per_rep)
  for run in runners.values():
    run(warmup)
  per = {n: [] for n in runners}
  usage = {n: np.zeros(3) for n in runners}  # minor page faults, user s, system s
  for _ in range(reps):
    for n, run in runners.items():
      k = steps_per_rep[n]
      r0 = resource.getrusage(resource.RUSAGE_SELF)
      t0 = time.perf_counter()
      run(k)
      per[n].append((time.perf_counter() - t0) / k)
      r1 = resource.getrusage(resource.RUSAGE_SELF)
      usage[n] += [
        r1.ru_minflt - r0.ru_minflt,
        r1.ru_utime - r0.ru_utime,
        r1.ru_stime - r0.ru_stime,
      ]
  out = {}
  for n, v in per.items():
    steps = reps * steps_per_rep[n]
    faults, user, system = usage[n] / steps
    out[n] = {
      "step_ms": 1e3 * statistics.median(v),
      "per_rep_ms": [1e3 * x for x in v],
      # Process-wide counters over this contestant's reps (contestants run one at a time).
      "minor_faults_per_step": float(faults),
      "cpu_user_ms_per_step": 1e3 * float(user),
      "cpu_system_ms_per_step": 1e3 * float(system),
    }
  return out


@contextlib.contextmanager
def prepare_without_steps():
  """Within the block, a host tier's prepare does not wait for write-backs (`Writer.wait`
  returns at once). For timing the input side alone, with no train step run: a row that a
  step would have written back is re-read from the host later (offload: evicted more than the
  device ring's steps before), and that read waits for the step's write-back, which never
  comes without steps (the wait's bound, `host_tier.WAIT_SECONDS`, then refuses the read).
  The host copy's values do not change the time a prepare takes, so the timing stays true;
  the rows read are stale, never use them. Not thread-safe against a trainer in the same
  process (it patches the class)."""
  from recgnn.embeddings import host_tier

  wait = host_tier.Writer.wait
  host_tier.Writer.wait = lambda self, n, why="": None
  try:
    yield
  finally:
    host_tier.Writer.wait = wait
