"""Timing candidates: a table's train step alone on the run's batches (`measure`, through
the cost cache: `timed_cost`), a group's fixed part (`group_overhead`, `overheads`), the
dispatch of one jitted call and the host cores a CPU mesh shares with the input thread."""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Callable, Iterable, Sequence

import jax
import numpy as np

from recgnn import sharding
from recgnn.embeddings.contract import Layout, split_to_host
from recgnn.embeddings.specs import TableSpec
from recgnn.planner import plan as plan_lib
from recgnn.planner.auto.cost_cache import CostCache


def measure(
  text: str,
  spec: TableSpec,
  batches: Sequence[np.ndarray],
  mesh,
  layout: Layout,
  measure_rows: int,
  copies: int = 1,
) -> tuple[float, float]:
  """(median device step seconds, median prepare seconds) of `text` for `spec` alone on
  `mesh`: the backend's lookup and update (the gradient is the pooled lookup) on each of
  `batches` (ids int[B] or [B, L]), the table folded to `measure_rows` rows; timed on a second
  pass over the batches, after a first that compiled every step shape they need. copies > 1:
  that many copies of the table in one group (same ids), for the group's own cost
  (`group_overhead`)."""
  rows = min(spec.num_rows, measure_rows)
  names = [spec.name] if copies == 1 else [f"{spec.name}__{i}" for i in range(copies)]
  smalls = [dataclasses.replace(spec, name=n, num_rows=rows) for n in names]
  group = plan_lib.make_group(text, smalls, mesh, layout)
  ahead = group.lookahead
  fold = [np.where(b >= 0, b % rows, b) if rows < spec.num_rows else b for b in batches]
  state = group.init(jax.random.key(0))

  # The state donated, as the trainer's step donates it: without, every update would copy
  # the whole table (O(rows) per step) where the trainer's
  # scatters in place.
  @functools.partial(jax.jit, donate_argnums=0)
  def step(state, prepared):
    pooled, res = group.lookup(state, prepared)
    # (a host tier's evicted rows: an output, handed to its writer as the trainer does)
    return split_to_host(group.update(state, prepared, res, {n: pooled[n] for n in names}))

  steps, preps = [], []
  # Two passes over the batches: the first compiles every step shape they need (and warms a
  # cache), the second is timed.
  for timed in (False, True):
    for i, ids in enumerate(fold):
      upcoming = [{n: u for n in names} for u in fold[i + 1 : i + 1 + ahead]]
      t0 = time.perf_counter()
      prepared = group.prepare({n: ids for n in names}, upcoming, train=True)
      t1 = time.perf_counter()
      prepared = jax.device_put(prepared)
      jax.block_until_ready(prepared)
      t2 = time.perf_counter()
      state, to_host = step(state, prepared)
      if to_host is not None:
        group.after_update(state, to_host)
      jax.block_until_ready(state)
      t3 = time.perf_counter()
      if timed:
        steps.append(t3 - t2)
        preps.append(t1 - t0)
  return float(np.median(steps)), float(np.median(preps))


def timed_cost(
  batches: Sequence[dict[str, np.ndarray]],
  mesh,
  layout: Layout,
  measure_rows: int,
  cache: CostCache | None = None,
) -> Callable[..., tuple[float, float]]:
  """The planner's default cost, (text, spec, copies=1) -> (step s, prepare s): `measure` on
  the run's batches, through `cache` if given."""

  def cost(text: str, spec: TableSpec, copies: int = 1) -> tuple[float, float]:
    ids = [b[spec.name] for b in batches]
    tag = text if copies == 1 else f"{text} x{copies}"
    key = CostCache.key(tag, spec, ids, mesh, layout, measure_rows) if cache else ""
    hit = cache.get(key) if cache else None
    if hit is not None:
      return hit
    out = measure(text, spec, ids, mesh, layout, measure_rows, copies)
    if cache:
      cache.put(key, out)
    return out

  return cost


GROUP_COPIES = 4  # tables in the group timed for each backend string's own cost


def group_overhead(
  alone: float, cost: Callable[..., tuple[float, float]], text: str, spec: TableSpec
) -> float:
  """Seconds a group of `text` costs whatever its tables (its program's fixed part, dispatch
  included), from the step of `spec` alone (`alone`) and of GROUP_COPIES copies of it in one
  group: with c(k) = a + k b, a = c(1) - (c(k) - c(1)) / (k - 1), kept within [0, c(1)]. A
  table timed alone carries a; in the train step its group pays a once, however many tables
  it holds (26 dense tables are one group, one gather, one scatter)."""
  many = cost(text, spec, GROUP_COPIES)[0]
  per_table = max(many - alone, 0.0) / (GROUP_COPIES - 1)
  return min(max(alone - per_table, 0.0), alone)


def shared_cores(mesh) -> int | None:
  """The host cores a CPU mesh computes on (which the input thread shares), else None."""
  if mesh.devices.flat[0].platform != "cpu":
    return None
  return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def dispatch_seconds(mesh, calls: int = 50) -> float:
  """Median seconds of a jitted call that computes nothing worth timing, on `mesh`."""
  x = sharding.put(
    np.zeros((8,), np.float32), jax.sharding.NamedSharding(mesh, sharding.REPLICATED)
  )
  f = jax.jit(lambda x: x + 1)
  jax.block_until_ready(f(x))
  times = []
  for _ in range(calls):
    t0 = time.perf_counter()
    x = jax.block_until_ready(f(x))
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def overheads(
  texts: Iterable[str],
  specs: Sequence[TableSpec],
  cost: Callable[..., tuple[float, float]],
  alone: Callable[[str, TableSpec], float | None] | None = None,
  log: Callable[[str], None] = lambda s: None,
) -> dict[str, float]:
  """Each backend string's group overhead (`group_overhead`), measured on the largest table
  that can take it: the one rule for a plan the planner makes (`choose`, whose `alone` gives
  the steps it timed: candidates that fit the budget left) and one a person wrote
  (`predict_rules`: any table whose cost can be measured). alone(text, spec): the step of
  the table alone, None where it cannot be had; default `cost`'s (None on ValueError)."""

  def measured_alone(text: str, spec: TableSpec) -> float | None:
    try:
      return cost(text, spec)[0]
    except ValueError:  # e.g. a cache that cannot hold this table's batch
      return None

  alone = alone or measured_alone
  out = {}
  for text in dict.fromkeys(texts):
    for spec in sorted(specs, key=lambda s: -s.num_rows):
      step_s = alone(text, spec)
      if step_s is not None and step_s == step_s:
        out[text] = group_overhead(step_s, cost, text, spec)
        break
  if out:
    log("auto: group overheads " + ", ".join(f"{t} {a * 1e3:.2f} ms" for t, a in out.items()))
  return out
