"""`auto(...)`: pick each table's backend for a per-device memory budget from measured costs.

A plan rule whose backend string is `auto(...)` hands its tables to this planner:

  config.embeddings.plan = (("C(3|4)", "tt(rank=32)"), (".*", "auto(budget=0.25)"))

For each such table the planner lists candidate placements (`candidates`): dense (and
dense(shard=rows) / sharded when the mesh has a model axis), offload and hot_cold at a few cache
/ hot fractions, tt at the ranks the user accepts (TT changes the model: only ranks named in
`tt_ranks`, the quality constraint, are candidates). Each candidate's bytes per device and on
the host come from the backend's own `memory()` (nothing allocated); its cost is the measured
time of that table's train step (lookup + update, the backend alone on the run's mesh, on the
run's first batches: `measure`) and the host time of its `prepare` (which the trainer's input
thread runs beside the step). The search is a multiple-choice knapsack solved exactly as an
integer program (scipy.optimize.milp, HiGHS): minimize the sum of step times (objective=time)
or of device bytes (objective=memory) with one candidate per table and the bytes per device
within the budget. A budget no choice can meet is refused before anything is allocated,
naming the smallest budget that fits and the tables that force it.

The per-table costs add: the step of the chosen plan is predicted as the sum of its tables'
own shares of their steps and each group's fixed part once (`group_overhead`), plus the model
part (the MLPs and the interaction: the same for every plan, timed once and kept in the cost
cache with the tables' figures, `cached_model_seconds`) and the input thread's prepare. That
ignores what XLA fuses across tables and what overlaps, which the plan report
(`PlanChoice.report`) says next to the figures.

The package, one concern a module, each importing only those above it in this list:

  options     `AutoOptions`, the kinds and families; the auto rule of a plan's rules
  report      a plan's figures as text and JSON
  placements  a table's candidate placements (`Candidate`, `candidates`) and their bytes
  cost_cache  the JSON cost cache (`CostCache`, `cached_model_seconds`)
  timing      timing a candidate (`measure`, `timed_cost`), group overheads, dispatch
  cost_model  `PlanChoice`: the predicted step of a plan from its tables' costs
  milp        the integer program (`solve`) and the runner-ups
  finalists   `choose_finalists`: bytes, the budget, timing, the solver's finalists
  rules       `plan_rules` (an auto rule's tables placed) and `predict_rules` (a written plan)

No module is named as a function the package exports (`auto.solve` is the function).
`rules` imports the rest; `options` and `report` nothing of the package.
"""

from recgnn.planner.auto.cost_cache import (
  MEASURE_VERSION,
  MODEL_VERSION,
  CostCache,
  cached_model_seconds,
)
from recgnn.planner.auto.cost_model import PlanChoice
from recgnn.planner.auto.finalists import choose, choose_finalists, finalist_plans, pick_measured
from recgnn.planner.auto.milp import runner_ups, solve
from recgnn.planner.auto.options import (
  HOST_TIERS,
  KINDS,
  MICRO_BATCHES,
  OBJECTIVES,
  AutoOptions,
  auto_options,
  family_of,
  is_auto,
  parse_bytes,
  placeholder_rules,
)
from recgnn.planner.auto.placements import Candidate, candidates, ids_shapes, memory_of
from recgnn.planner.auto.rules import plan_rules, predict_rules
from recgnn.planner.auto.timing import (
  GROUP_COPIES,
  dispatch_seconds,
  group_overhead,
  measure,
  overheads,
  shared_cores,
  timed_cost,
)

__all__ = [
  "GROUP_COPIES",
  "HOST_TIERS",
  "KINDS",
  "MEASURE_VERSION",
  "MICRO_BATCHES",
  "MODEL_VERSION",
  "OBJECTIVES",
  "AutoOptions",
  "Candidate",
  "CostCache",
  "PlanChoice",
  "auto_options",
  "cached_model_seconds",
  "candidates",
  "choose",
  "choose_finalists",
  "dispatch_seconds",
  "family_of",
  "finalist_plans",
  "group_overhead",
  "ids_shapes",
  "is_auto",
  "measure",
  "memory_of",
  "overheads",
  "parse_bytes",
  "pick_measured",
  "placeholder_rules",
  "plan_rules",
  "predict_rules",
  "runner_ups",
  "shared_cores",
  "solve",
  "timed_cost",
]
