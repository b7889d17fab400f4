"""Embedding backends. `base` holds the specs, the contract and the plan; each other module
is one backend, registered by its module name."""

from recgnn.embeddings.base import (
  PAD,
  Backend,
  MemoryReport,
  OptimizerSpec,
  Plan,
  PlanDoesNotFit,
  TableBackend,
  TableSpec,
  available_backends,
  check_memory,
  format_plan,
  make_backend,
  make_group,
  parse_backend,
  resolve_plan,
  unpool,
)

__all__ = [
  "PAD",
  "Backend",
  "MemoryReport",
  "OptimizerSpec",
  "Plan",
  "PlanDoesNotFit",
  "TableBackend",
  "TableSpec",
  "available_backends",
  "check_memory",
  "format_plan",
  "make_backend",
  "make_group",
  "parse_backend",
  "resolve_plan",
  "unpool",
]
