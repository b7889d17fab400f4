"""The planner's figures of a run's plan before it is built: an `auto(...)` rule's tables
placed (recgnn.planner.auto), or with --plan_report the plan as written timed as the planner
would time it. Candidates are timed on the run's first training batches under the input
layout dense would take, through the cost cache `embeddings.cost_cache` names (a JSON file;
"" for none); the part of the step every plan shares (the model) through the same cache.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable

import ml_collections

from recgnn.planner import auto as auto_lib
from recgnn.train import inputs, model_timing, plan_timing
from recgnn.train import train_state as state_lib


def config_text(section) -> str:
  """A config section as text that is the same for the same values (a cache key's part)."""
  if isinstance(section, ml_collections.ConfigDict):
    return section.to_json_best_effort(sort_keys=True)
  return repr(section)


@dataclasses.dataclass
class Timing:
  """What the figures are timed on and how: the run's first train batches, the mesh, the
  cost cache, and the key of the model part (the task, model, optimizer and dims)."""

  config: ml_collections.ConfigDict
  task: object
  mesh: object
  batches: list  # the first train batches (the candidates' n, or a finalist's whole steps)
  n: int  # batches the candidates are timed on
  cache: auto_lib.CostCache | None
  what: str  # the model part's key
  dims: dict
  model_time: float = 0.0

  def model_seconds(self) -> float:
    """The model part's step (timed when first asked: after the candidates' bytes are
    checked against the budget, so a plan no budget fits is refused before any timing)."""
    t0 = time.perf_counter()
    tx = state_lib.make_optimizer(self.config.optimizer)
    out = auto_lib.cached_model_seconds(
      self.cache,
      auto_lib.CostCache.model_key(self.what, self.batches[: self.n], self.mesh),
      lambda: model_timing.model_step_seconds(
        self.task, tx, self.mesh, self.batches[: self.n], self.dims
      ),
    )
    self.model_time += time.perf_counter() - t0
    return out

  def plan_timer(self, build: Callable, budget, log) -> Callable:
    """time_plan(rules, choice) -> a finalist's whole train step (`plan_timing`), through the
    cost cache: keyed by its rules and the model part's key, on every timing batch."""

    def time_plan(plan_rules: list[tuple[str, str]], choice) -> float:
      key = auto_lib.CostCache.model_key(
        repr(("whole step", plan_timing.VERSION, plan_rules, self.what)), self.batches, self.mesh
      )

      def measure() -> float:
        cfg = self.config.copy_and_resolve_references()
        with cfg.unlocked():
          cfg.embeddings.plan = tuple(plan_rules)
        run = build(cfg, mesh=self.mesh, task=self.task, device_memory_budget=budget)
        return plan_timing.whole_step_seconds(run, self.batches)

      out = auto_lib.cached_model_seconds(self.cache, key, measure)
      log(
        f"auto: {choice.label}: whole step {out * 1e3:.2f} ms (predicted "
        f"{choice.predicted_step_s * 1e3:.2f} ms)"
      )
      return out

    return time_plan


def _timing(config, task, specs, mesh, options) -> tuple[Timing, bool]:
  """The batches and cache the figures are timed with; whether finalists are timed whole."""
  n = (options or auto_lib.AutoOptions()).batches
  finalists = options is not None and options.finalists > 1
  whole = plan_timing.batches_needed(task.batches_per_call) if finalists else 0
  batches = list(itertools.islice(task.train_batches(0), max(n, whole)))
  path = config.embeddings.get("cost_cache", "")
  dims = {s.name: s.dim for s in specs}
  what = repr((config.task, config_text(config.get("model")), config_text(config.optimizer), dims))
  cache = auto_lib.CostCache(path) if path else None
  return Timing(config, task, mesh, batches, n, cache, what, dims), bool(whole)


def plan_figures(config, task, rules, specs, mesh, budget, report, log, build: Callable):
  """(rules, figures): with an auto(...) rule, its tables placed by the planner and its
  figures; with `report` (--plan_report) and no auto rule, the planner's figures for the
  plan as written; else (rules, None). build: `setup.build` (a finalist is built whole)."""
  options = auto_lib.auto_options(rules)
  if options is None and not report:
    return rules, None
  process_input = config.train.get("process_input", "auto")
  placeholder = auto_lib.placeholder_rules(rules)
  layout, _, _ = inputs.choose_layout(task, placeholder, specs, mesh, process_input)
  timing, whole = _timing(config, task, specs, mesh, options)
  ids = [b["ids"] for b in timing.batches[: timing.n]]
  if options is not None:
    log(f"auto plan: timing candidate placements on {len(ids)} training batches")
    rules, choice = auto_lib.plan_rules(
      rules, specs, mesh, layout, ids, budget_bytes=budget, log=log, cache=timing.cache,
      model_s=timing.model_seconds,
      time_plan=timing.plan_timer(build, budget, log) if whole else None,
    )  # fmt: skip
    model_s = choice.model_s
  else:
    log(f"plan report: timing each table's placement on {len(ids)} training batches")
    model_s = timing.model_seconds()
    choice = auto_lib.predict_rules(rules, specs, mesh, layout, ids, cache=timing.cache)
  planning_s = choice.planning_s + timing.model_time
  choice = dataclasses.replace(choice, model_s=model_s, planning_s=planning_s)
  log(choice.report())
  if timing.cache is not None:
    log(f"cost cache {timing.cache.path}: {timing.cache.hits} reused, {timing.cache.misses} timed")
  return rules, choice
