"""The planner's choice for the auto rule's tables: candidates' bytes, then their timing, then
the solver's finalists (`choose_finalists`: the solver's best of each variant,
`finalist_plans`), and the fastest measured whole (`pick_measured`)."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Sequence

import numpy as np

from recgnn import sharding
from recgnn.embeddings.contract import Layout
from recgnn.embeddings.specs import TableSpec
from recgnn.planner import budget as budget_lib
from recgnn.planner import plan as plan_lib
from recgnn.planner.auto.cost_cache import CostCache
from recgnn.planner.auto.cost_model import PlanChoice, _share
from recgnn.planner.auto.milp import check_fits, runner_ups, solve
from recgnn.planner.auto.options import (
  HOST_TIERS,
  MICRO_BATCHES,
  AutoOptions,
  family_of,
  parse_bytes,
)
from recgnn.planner.auto.placements import Candidate, candidates, ids_shapes, memory_of
from recgnn.planner.auto.report import mib as _mib
from recgnn.planner.auto.timing import dispatch_seconds, overheads, shared_cores, timed_cost


def choose(specs: Sequence[TableSpec], options: AutoOptions, mesh, layout: Layout, batches, **kw):
  """The solver's plan of `specs` (`choose_finalists`' first: no whole step timed)."""
  return choose_finalists(specs, options, mesh, layout, batches, **kw)[0]


def choose_finalists(
  specs: Sequence[TableSpec],
  options: AutoOptions,
  mesh,
  layout: Layout,
  batches: Sequence[dict[str, np.ndarray]],
  *,
  fixed_bytes: int = 0,
  fixed_splits: bool = False,
  all_dense_bytes: int | None = None,
  budget_bytes: int | None = None,
  cost: Callable[[str, TableSpec], tuple[float, float]] | None = None,
  cache: CostCache | None = None,
  log: Callable[[str], None] = lambda s: None,
) -> list[PlanChoice]:
  """Up to `options.finalists` plans of `specs` (the tables the auto rule matched), distinct,
  each the solver's best of one variant of the candidates (`finalist_plans`), the best over
  every kind first (which a budget nothing fits refuses, with the numbers). batches: the run's first
  training batches ({table: ids}); fixed_bytes: bytes per device of the tables other rules
  placed (they count against the budget); fixed_splits: one of those splits batches into
  micro-batches (then no auto table may: a batch has one split); all_dense_bytes: the
  all-dense plan's bytes per device of every table (what a fractional budget is a fraction
  of; default: these tables'). budget_bytes: the budget when the options give none (the
  run's device_memory_budget). cost: (text, spec) -> (step s, prepare s), default `measure`
  on `batches` through `cache` (tests pass a model)."""
  _check_mesh(options, mesh)
  started = time.perf_counter()
  by_table, dense_bytes = _sized_candidates(specs, options, mesh, layout, batches, log)
  all_dense = (dense_bytes + fixed_bytes) if all_dense_bytes is None else all_dense_bytes
  total_budget, avail, host_avail = _budgets(options, all_dense, budget_bytes, fixed_bytes)
  # Bytes are known without timing: a budget below the smallest plan is refused before any
  # candidate (or the dispatch) is timed.
  check_fits(
    {
      t: [Candidate(t, text, dev, host) for text, dev, host in rows] for t, rows in by_table.items()
    },
    avail,
    fixed_bytes=fixed_bytes,
    total_budget=total_budget,
  )
  dispatch = 0.0
  measured = cost is None
  if cost is None:
    dispatch = dispatch_seconds(mesh)
    cost = timed_cost(batches, mesh, layout, options.measure_rows, cache)
  options_by_table = _timed_candidates(specs, by_table, avail, cost, log)
  limits = {kind: options.strings_per_kind for kind in HOST_TIERS}
  limits[MICRO_BATCHES] = 0 if fixed_splits else 1
  overhead = _group_overheads(options_by_table, specs, cost, log) if measured else {}
  cores = shared_cores(mesh)
  shares = _solver_shares(options_by_table, overhead, dispatch, cores)
  group_s = {t: max(a - dispatch, 0.0) for t, a in overhead.items()}
  solved = _solved_variants(specs, shares, options, limits, avail, group_s, host_avail, log)
  ordered = _ranked(solved, group_s, options.objective)[: options.finalists]
  fields = dict(
    fixed_bytes=fixed_bytes,
    budget_bytes=total_budget,
    all_dense_bytes=all_dense,
    dispatch_s=dispatch,
    shared_cores=cores,
    overhead_s=overhead,
    candidates={t: tuple(text for text, _, _ in rows) for t, rows in by_table.items()},
  )
  out = [_finalist(v, specs, options_by_table, avail, options.objective, **fields) for v in ordered]
  if len(solved) > len(out):
    log(
      f"auto: {len(solved)} distinct finalist plans, the {len(out)} the solver ranks first kept "
      f"(finalists={options.finalists})"
    )
  elapsed = time.perf_counter() - started
  return [dataclasses.replace(c, planning_s=elapsed) for c in out]


def _check_mesh(options: AutoOptions, mesh) -> None:
  """Refuses the sharded kind on a mesh without a model axis."""
  if "sharded" in options.kinds and sharding.mesh_shape(mesh)[1] == 1:
    raise ValueError(
      f"auto: kinds includes sharded, but mesh {sharding.describe(mesh)} has no model axis to "
      "shard over: drop it or set mesh.model > 1"
    )


def _sized_candidates(
  specs: Sequence[TableSpec],
  options: AutoOptions,
  mesh,
  layout: Layout,
  batches: Sequence[dict[str, np.ndarray]],
  log: Callable[[str], None],
) -> tuple[dict[str, list[tuple[str, int, int]]], int]:
  """({table: [(backend string, device bytes, host bytes)] of its valid candidates}, the
  all-dense bytes per device of `specs`). Refuses a table no candidate is valid for."""
  memo: dict[tuple[str, str], tuple[int, int]] = {}
  shapes = ids_shapes(batches)
  dense_bytes = 0
  by_table: dict[str, list[tuple[str, int, int]]] = {}
  for spec in specs:
    rows = []
    # An offload cache must hold the distinct rows a train batch can touch, B x L at most the
    # table's rows (`Offload.check_batch` refuses a smaller one before allocating).
    shape = shapes.get(spec.name)
    need = spec.distinct_rows(shape) if shape else 0
    for text in candidates(spec, options, mesh):
      name, opts = plan_lib.parse_backend(text)
      if name == "offload" and opts.get("cache_fraction", 1.0) * spec.num_rows < need:
        continue
      try:
        dev, host = memo.setdefault(
          (text, spec.name), memory_of(text, spec, mesh, layout, shapes.get(spec.name))
        )
      except ValueError as e:  # a placement this table cannot take (the backend says why)
        log(f"auto: {spec.name}: {text} left out ({e})")
        continue
      rows.append((text, dev, host))
    if not rows:
      raise ValueError(f"auto: no candidate placement is valid for table {spec.name!r}")
    by_table[spec.name] = rows
    dense_bytes += memory_of("dense", spec, mesh, layout)[0]
  return by_table, dense_bytes


def _budgets(
  options: AutoOptions, all_dense: int, budget_bytes: int | None, fixed_bytes: int
) -> tuple[int | None, int | None, int | None]:
  """(the whole budget per device, what is left of it for these tables, their host budget);
  None: unbounded. Refuses other rules' tables taking more than the whole budget."""
  budget = options.budget
  if budget is None:
    total_budget = budget_bytes
  elif isinstance(budget, str) and budget.strip().endswith("%"):
    total_budget = int(all_dense * float(budget.strip()[:-1]) / 100)
  elif isinstance(budget, str):
    total_budget = parse_bytes(budget)
  else:
    total_budget = int(all_dense * float(budget))
  avail = None if total_budget is None else total_budget - fixed_bytes
  # The host budget is this rule's tables' (the other rules' host bytes are not counted).
  host_avail = None if options.host_budget is None else parse_bytes(options.host_budget)
  if avail is not None and avail < 0:
    raise budget_lib.PlanDoesNotFit(
      f"auto plan: the tables other rules place take {_mib(fixed_bytes)} per device, more than "
      f"the budget {_mib(total_budget)}"
    )
  return total_budget, avail, host_avail


def _timed_candidates(
  specs: Sequence[TableSpec],
  by_table: dict[str, list[tuple[str, int, int]]],
  avail: int | None,
  cost: Callable[[str, TableSpec], tuple[float, float]],
  log: Callable[[str], None],
) -> dict[str, list[Candidate]]:
  """{table: its candidates with their step and prepare seconds}: only what could be chosen
  is timed (a candidate over the budget left is skipped; a table whose every candidate is
  over it keeps them all, untimed)."""
  options_by_table: dict[str, list[Candidate]] = {}
  n = sum(len(v) for v in by_table.values())
  done = itertools.count(1)
  t0 = time.perf_counter()
  for spec in specs:
    cs = []
    for text, dev, host in by_table[spec.name]:
      if avail is not None and dev > avail:
        next(done)
        continue
      try:
        step_s, prep_s = cost(text, spec)
      except ValueError as e:  # e.g. a cache smaller than one batch's distinct rows
        log(f"auto: {spec.name}: {text} left out ({e})")
      else:
        cs.append(Candidate(spec.name, text, dev, host, step_s, prep_s, family_of(text)))
      k = next(done)
      if k % 10 == 0 or k == n:
        log(f"auto: timed {k}/{n} candidates ({time.perf_counter() - t0:.0f} s)")
    if not cs:  # every candidate of this table alone exceeds the budget
      cs = [Candidate(spec.name, t, d, h, family=family_of(t)) for t, d, h in by_table[spec.name]]
    options_by_table[spec.name] = cs
  return options_by_table


def _group_overheads(
  options_by_table: dict[str, list[Candidate]],
  specs: Sequence[TableSpec],
  cost: Callable[[str, TableSpec], tuple[float, float]],
  log: Callable[[str], None],
) -> dict[str, float]:
  """{backend string: its group's fixed seconds} (`timing.overheads`) of the measured
  candidates (a model's costs have no group part)."""
  timed = {(c.text, t): c.step_s for t, cs in options_by_table.items() for c in cs}
  texts = [text for (text, _), v in timed.items() if v == v]
  return overheads(texts, specs, cost, lambda text, s: timed.get((text, s.name)), log)


def _solver_shares(
  options_by_table: dict[str, list[Candidate]], overhead: dict, dispatch: float, cores
) -> dict[str, list[Candidate]]:
  """The candidates as the solver sees them, as the predicted step counts them
  (`PlanChoice.predicted_step_s`): each table's own share, its prepare spread over the cores
  on CPU devices (the input thread computes on the same cores); each group's fixed part is
  counted once apart (group_s)."""

  def seen(c: Candidate) -> float:
    prep = c.prepare_s / cores if cores and c.prepare_s == c.prepare_s else 0.0
    return _share(c, overhead, dispatch) + prep

  return {
    t: [dataclasses.replace(c, step_s=seen(c)) for c in cs] for t, cs in options_by_table.items()
  }


def _solved_variants(
  specs: Sequence[TableSpec],
  shares: dict[str, list[Candidate]],
  options: AutoOptions,
  limits: dict[str, int],
  avail: int | None,
  group_s: dict[str, float],
  host_avail: int | None,
  log: Callable[[str], None],
) -> list[tuple]:
  """(label, picked, limits, kept) of each variant (`finalist_plans`) the budget can meet,
  distinct plans only, the solver's own plan first (a budget it cannot meet is refused)."""
  solved = []
  for label, kept, lims in finalist_plans(shares, options, limits):
    try:
      picked = solve(kept, avail, options.objective, lims, group_s, host_avail)
    except budget_lib.PlanDoesNotFit as e:
      if not solved:  # the solver's own plan: a budget nothing fits, refused with the numbers
        raise
      log(f"auto: no {label} plan fits ({str(e).split(';')[0]})")
      continue
    if any(all(picked[s.name].text == p[s.name].text for s in specs) for _, p, _, _ in solved):
      continue  # the same plan as another variant's
    solved.append((label, picked, lims, kept))
  return solved


def _ranked(solved: list[tuple], group_s: dict[str, float], objective: str) -> list[tuple]:
  """The solver's own plan; then the best of each kind of variant (one string per tier, each
  tier first, no host tier: the sum may misrank a whole kind, and a whole step is timed to
  catch that), then the rest, each by what the solver minimized."""
  rest = sorted(solved[1:], key=lambda v: _objective(v[1], group_s, objective))
  best_of_kind: dict[str, tuple] = {}
  for v in rest:
    best_of_kind.setdefault(v[0].split()[0] if v[0].endswith(" first") else v[0], v)
  firsts = {id(v) for v in best_of_kind.values()}
  return [solved[0], *best_of_kind.values(), *[v for v in rest if id(v) not in firsts]]


def _finalist(
  variant: tuple,
  specs: Sequence[TableSpec],
  options_by_table: dict[str, list[Candidate]],
  avail: int | None,
  objective: str,
  **fields,
) -> PlanChoice:
  """A solved variant (label, picked, limits, kept) as a finalist: its picks as measured,
  each table's runner-up among what the variant kept; `fields`: the rest of PlanChoice."""
  label, picked, lims, kept = variant
  chosen = _as_measured(specs, options_by_table, picked)
  runner_up = runner_ups(_allowed(options_by_table, kept), chosen, avail, objective, lims)
  return PlanChoice(chosen=chosen, runner_up=runner_up, objective=objective, label=label, **fields)


def _as_measured(
  specs: Sequence[TableSpec],
  options_by_table: dict[str, list[Candidate]],
  picked: dict[str, Candidate],
) -> dict[str, Candidate]:
  """The picked candidates as measured (their step alone), not their shares."""
  return {
    s.name: next(c for c in options_by_table[s.name] if c.text == picked[s.name].text)
    for s in specs
  }


def _allowed(
  options_by_table: dict[str, list[Candidate]], kept: dict[str, list[Candidate]]
) -> dict[str, list[Candidate]]:
  """The measured candidates a variant kept, per table."""
  return {
    t: [c for c in cs if c.text in {k.text for k in kept[t]}] for t, cs in options_by_table.items()
  }


def finalist_plans(
  options_by_table: dict[str, list[Candidate]], options: AutoOptions, limits: dict[str, int]
) -> list[tuple[str, dict[str, list[Candidate]], dict[str, int]]]:
  """(label, candidates per table, the families' limits) of each plan the solver gives a
  finalist for: every kind under `limits` (the solver's own plan, first); every kind with one
  backend string per host tier (fewer groups: fewer step programs and fixed parts); for each
  host tier and fraction, that tier at that fraction first (the plans a person writes: a table
  that leaves device memory goes to it, and to the other tier at the same fraction only where
  it has no such candidate, e.g. an offload cache too small for a batch's rows); no host tier
  at all. A variant that leaves a table no candidate is left out; one the budget cannot meet
  is skipped by the caller."""

  def kind(c: Candidate) -> str:
    return plan_lib.parse_backend(c.text)[0]

  def fraction(c: Candidate) -> float | None:
    name, opts = plan_lib.parse_backend(c.text)
    return opts.get("cache_fraction" if name == "offload" else "budget")

  def only(keep: Callable[[str, Candidate], bool]) -> dict[str, list[Candidate]] | None:
    out = {t: [c for c in cs if keep(t, c)] for t, cs in options_by_table.items()}
    return out if all(out.values()) else None

  def first(tier: str, f: float) -> Callable[[str, Candidate], bool]:
    has = {
      t
      for t, cs in options_by_table.items()
      if any(kind(c) == tier and fraction(c) == f for c in cs)
    }

    def keep(t: str, c: Candidate) -> bool:
      if kind(c) not in HOST_TIERS:
        return True
      return fraction(c) == f and (kind(c) == tier or t not in has)

    return keep

  one = {f: min(n, 1) for f, n in limits.items()}
  out = [("every kind", options_by_table, limits)]
  if one != limits:
    out.append(("one string per tier", options_by_table, one))
  for tier in HOST_TIERS:
    for f in options.fractions if tier in options.kinds else ():
      kept = only(first(tier, f))
      if kept is not None:
        out.append((f"{tier} {f:g} first", kept, one))
  kept = only(lambda t, c: kind(c) not in HOST_TIERS)
  if kept is not None and any(k in options.kinds for k in HOST_TIERS):
    out.append(("no host tier", kept, limits))
  return out


def _objective(picked: dict[str, Candidate], group_s: dict[str, float], objective: str):
  """What the solver minimized for `picked` (candidates with their shares as step_s): the
  finalists after the solver's own are taken in this order."""
  secs = sum(c.step_s for c in picked.values())
  secs += sum(group_s.get(t, 0.0) for t in {c.text for c in picked.values()})
  nbytes = sum(c.device_bytes for c in picked.values())
  return (secs, nbytes) if objective == "time" else (nbytes, secs)


def pick_measured(timed: Sequence[PlanChoice]) -> PlanChoice:
  """The finalist whose whole step measured fastest (ties: the solver's order), carrying
  every finalist's figures (`PlanChoice.finalists`)."""
  best = min(range(len(timed)), key=lambda i: (timed[i].whole_step_s, i))
  summary = tuple((c.label, c.placed, c.predicted_step_s, c.whole_step_s) for c in timed)
  return dataclasses.replace(timed[best], finalists=summary)
