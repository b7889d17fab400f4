"""Plan rules with an auto rule: its tables placed by the planner (`plan_rules`), and the
planner's figures for a plan someone wrote (`predict_rules`, --plan_report)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from recgnn.embeddings.contract import Layout
from recgnn.embeddings.specs import TableSpec
from recgnn.planner import plan as plan_lib
from recgnn.planner.auto.cost_cache import CostCache
from recgnn.planner.auto.cost_model import PlanChoice
from recgnn.planner.auto.finalists import choose_finalists, pick_measured
from recgnn.planner.auto.options import AutoOptions, auto_options, family_of, is_auto
from recgnn.planner.auto.placements import Candidate, candidates, ids_shapes, memory_of
from recgnn.planner.auto.timing import dispatch_seconds, overheads, shared_cores, timed_cost


def plan_rules(
  rules: Sequence[tuple[str, str]],
  specs: Sequence[TableSpec],
  mesh,
  layout: Layout,
  batches: Sequence[dict[str, np.ndarray]],
  *,
  budget_bytes: int | None = None,
  log: Callable[[str], None] = lambda s: None,
  cost: Callable[[str, TableSpec], tuple[float, float]] | None = None,
  cache: CostCache | None = None,
  model_s: float | Callable[[], float] | None = None,
  time_plan: Callable[[list[tuple[str, str]], PlanChoice], float] | None = None,
) -> tuple[list[tuple[str, str]], PlanChoice]:
  """Rules with the auto rule's tables placed by the planner: one exact-name rule per table,
  before the other rules (which keep their tables). The solver's finalists
  (`choose_finalists`) are each timed whole by `time_plan(rules, choice)` (seconds per train
  step as the trainer runs it) and the fastest taken (`pick_measured`); without `time_plan`,
  or with one finalist, the solver's own plan. model_s: the model part's seconds, in every
  finalist's prediction, or a function timing them (called after the candidates, so that a
  budget no plan fits is refused before anything is timed). With many processes every process
  measures the tables and process 0's solver plan is taken by all, untimed (the plan must be
  the same everywhere, and a whole-step timing would have to run in lockstep on every
  process)."""
  options = auto_options(rules)
  assert options is not None
  by_text = plan_lib.assign_rules(rules, specs)
  auto_specs = [s for t, ss in by_text.items() if is_auto(t) for s in ss]
  fixed, fixed_splits = _fixed_groups(by_text, mesh, layout)
  all_dense = sum(memory_of("dense", s, mesh, layout)[0] for s in specs)
  finalists = choose_finalists(
    auto_specs,
    options,
    mesh,
    layout,
    batches,
    fixed_bytes=fixed,
    fixed_splits=fixed_splits,
    all_dense_bytes=all_dense,
    budget_bytes=budget_bytes,
    cost=cost,
    cache=cache,
    log=log,
  )
  if jax.process_count() > 1:
    if len(finalists) > 1 and time_plan is not None:
      log(
        f"auto: {jax.process_count()} processes: the solver's plan is taken untimed (the "
        f"{len(finalists)} finalists' whole-step timing runs on one process only)"
      )
    finalists = [_agree(finalists[0], auto_specs, options, mesh, layout, batches)]
  kept = [(p, t) for p, t in rules if not is_auto(t)]
  others = [s for s in specs if s.name not in finalists[0].chosen]
  if others:  # their step is part of the predicted one too
    given = predict_rules(
      kept, others, mesh, layout, batches, measure_rows=options.measure_rows, cache=cache, cost=cost
    )
    finalists = [
      dataclasses.replace(c, fixed=given.chosen, overhead_s={**given.overhead_s, **c.overhead_s})
      for c in finalists
    ]
  if callable(model_s):  # timed once the budget is known to fit (choose_finalists refuses first)
    model_s = model_s()
  finalists = [dataclasses.replace(c, model_s=model_s) for c in finalists]
  choice = finalists[0]
  if time_plan is not None and len(finalists) > 1:
    choice = _time_finalists(finalists, kept, time_plan, log)
  # Exact names first: an auto table is matched by its own rule before any other rule's
  # regex that also matches it; the other rules keep their tables.
  return [*choice.rules, *kept], choice


def _fixed_groups(by_text: dict, mesh, layout: Layout) -> tuple[int, bool]:
  """by_text {backend string: its tables} -> (bytes per device, whether one splits the batch)
  of the groups the rules written out (not auto) place."""
  fixed, fixed_splits = 0, False
  for text, ss in by_text.items():
    if not is_auto(text):
      group = plan_lib.make_group(text, ss, mesh, layout)
      fixed += group.device_bytes()
      fixed_splits = fixed_splits or group.capabilities.splits_batch
  return fixed, fixed_splits


def _time_finalists(
  finalists: list[PlanChoice], kept: list, time_plan: Callable, log: Callable[[str], None]
) -> PlanChoice:
  """Each finalist timed whole (its rules before the kept ones); the fastest, its planning
  time including the timing."""
  started = time.perf_counter()
  timed = []
  for k, c in enumerate(finalists, 1):
    log(f"auto: timing finalist {k}/{len(finalists)} whole ({c.label}: {c.placed})")
    timed.append(dataclasses.replace(c, whole_step_s=time_plan([*c.rules, *kept], c)))
  choice = pick_measured(timed)
  return dataclasses.replace(choice, planning_s=choice.planning_s + time.perf_counter() - started)


def _agree(
  choice: PlanChoice, specs, options: AutoOptions, mesh, layout, batches: Sequence[dict]
) -> PlanChoice:
  """Process 0's choice on every process (sent as indices into each table's candidate list,
  which every process builds alike); where this process measured another pick, process 0's
  is taken with its bytes and this process's step time left unknown (nan)."""
  from jax.experimental import multihost_utils

  lists = [candidates(s, options, mesh) for s in specs]
  idx = np.array([c.index(choice.chosen[s.name].text) for s, c in zip(specs, lists)], np.int32)
  idx = np.asarray(multihost_utils.broadcast_one_to_all(idx))
  chosen, shapes = dict(choice.chosen), ids_shapes(batches)
  for s, c, i in zip(specs, lists, idx):
    if c[i] != chosen[s.name].text:
      dev, host = memory_of(c[i], s, mesh, layout, shapes.get(s.name))
      chosen[s.name] = Candidate(s.name, c[i], dev, host, family=family_of(c[i]))
  return dataclasses.replace(choice, chosen=chosen)


def predict_rules(
  rules: Sequence[tuple[str, str]],
  specs: Sequence[TableSpec],
  mesh,
  layout: Layout,
  batches: Sequence[dict[str, np.ndarray]],
  *,
  measure_rows: int = AutoOptions.measure_rows,
  cache: CostCache | None = None,
  cost: Callable[[str, TableSpec], tuple[float, float]] | None = None,
) -> PlanChoice:
  """The planner's figures for a plan someone wrote (no auto rule): each table's bytes and
  measured step under the backend its rule gives it, as `choose` would have them, so a
  hand-written plan's prediction can be set against its measured step (`--plan_report`)."""
  started = time.perf_counter()
  dispatch = 0.0
  measured = cost is None
  if cost is None:
    dispatch = dispatch_seconds(mesh)
    cost = timed_cost(batches, mesh, layout, measure_rows, cache)
  chosen = {}
  shapes = ids_shapes(batches)
  by_text = plan_lib.assign_rules(rules, specs)
  for text, ss in by_text.items():
    for spec in ss:
      dev, host = memory_of(text, spec, mesh, layout, shapes.get(spec.name))
      step_s, prep_s = cost(text, spec)
      chosen[spec.name] = Candidate(spec.name, text, dev, host, step_s, prep_s, family_of(text))
  chosen = {s.name: chosen[s.name] for s in specs}
  # The same rule as `choose`'s, so a hand-written plan and the planner's agree on it.
  overhead = overheads(by_text, specs, cost) if measured else {}
  return PlanChoice(
    chosen=chosen,
    runner_up={t: None for t in chosen},
    fixed_bytes=0,
    budget_bytes=None,
    # (a table of raw ids has no dense form: only a backend that maps ids takes it)
    all_dense_bytes=sum(memory_of("dense", s, mesh, layout)[0] for s in specs if not s.raw_ids),
    objective="given",
    dispatch_s=dispatch,
    planning_s=time.perf_counter() - started,
    shared_cores=shared_cores(mesh),
    overhead_s=overhead,
  )
