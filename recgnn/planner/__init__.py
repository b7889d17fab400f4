"""The planner: which backend serves each table, and whether the plan fits.

  plan       the registry's lookup (`backend_class`, `available_backends`, `capabilities_of`,
             loading the built-in backends and the entry points), plan strings
             (`parse_backend`), `make_group` / `make_backend`, `Plan`, `resolve_plan`,
             `format_plan`, `rules_of` (a config's plan read as rules), `load_modules`
             (a config's `embeddings.modules`: backends in their own files)
  budget     device budgets (`parse_bytes`, `parse_budget`, `RelativeBudget`) and
             `check_memory` / `check_host_memory` (`PlanDoesNotFit`)
  auto       `auto(...)`: each table's backend for a memory budget from measured costs
             (a package, one module a concern: `from recgnn.planner import auto`)

It sits above the backends and below the trainer and the tasks (docs/architecture.md,
"Layers"); `from recgnn import planner` gives this module's names.
"""

from recgnn.planner.budget import (
  PlanDoesNotFit,
  RelativeBudget,
  batch_bytes,
  check_host_memory,
  check_memory,
  parse_budget,
  parse_bytes,
)
from recgnn.planner.plan import (
  ENTRY_POINT_GROUP,
  Plan,
  assign_rules,
  available_backends,
  backend_class,
  capabilities_of,
  check_layout,
  default_mesh,
  format_plan,
  load_modules,
  make_backend,
  make_group,
  parse_backend,
  resolve_plan,
  rules_of,
)

__all__ = [
  "ENTRY_POINT_GROUP",
  "Plan",
  "PlanDoesNotFit",
  "RelativeBudget",
  "assign_rules",
  "available_backends",
  "backend_class",
  "batch_bytes",
  "capabilities_of",
  "check_layout",
  "check_host_memory",
  "check_memory",
  "default_mesh",
  "format_plan",
  "load_modules",
  "make_backend",
  "make_group",
  "parse_backend",
  "parse_budget",
  "parse_bytes",
  "resolve_plan",
  "rules_of",
]
