"""The embeddings' public face: one import for the specs, the contract, the shared kernels and
the plan (`from recgnn.embeddings import base`; `base.TableSpec`, `base.resolve_plan`).

Each concern lives in its own module (docs/architecture.md, "Package layout"):
  specs     TableSpec, OptimizerSpec (the shared row update `OptimizerSpec.apply`), init
  kernels   dedup, segment sums, pooling, `sparse_sgd_or_adagrad`
  contract  Layout, Capabilities, Backend, TableBackend (contract v3), BackendOptions
  group     TableGroup (per-table backends as a contract Backend)
  plan      parse / registry (`register_backend`, `capabilities_of`) / resolve_plan / budget
"""

from recgnn.embeddings.contract import (
  Backend,
  BackendOptions,
  Capabilities,
  Layout,
  PyTree,
  TableBackend,
)
from recgnn.embeddings.group import TableGroup
from recgnn.embeddings.kernels import (
  dedup,
  device_dedup,
  pool_rows,
  segment_rows,
  sparse_sgd_or_adagrad,
  unpool,
)
from recgnn.embeddings.plan import (
  ENTRY_POINT_GROUP,
  Plan,
  PlanDoesNotFit,
  RelativeBudget,
  assign_rules,
  available_backends,
  backend_class,
  batch_bytes,
  capabilities_of,
  check_layout,
  check_memory,
  default_mesh,
  format_plan,
  make_backend,
  make_group,
  parse_backend,
  parse_budget,
  parse_bytes,
  register_backend,
  resolve_plan,
)
from recgnn.embeddings.specs import (
  INIT_CHUNK,
  INITIALIZERS,
  OPTIMIZERS,
  PAD,
  POOLINGS,
  PREFETCH,
  ROW_ALIGN,
  MemoryReport,
  OptimizerSpec,
  TableSpec,
  aligned_rows,
  init_rows,
  init_table,
  shapes_only,
  table_key,
)

__all__ = [
  "ENTRY_POINT_GROUP",
  "INITIALIZERS",
  "INIT_CHUNK",
  "OPTIMIZERS",
  "PAD",
  "POOLINGS",
  "PREFETCH",
  "ROW_ALIGN",
  "Backend",
  "BackendOptions",
  "Capabilities",
  "Layout",
  "MemoryReport",
  "OptimizerSpec",
  "Plan",
  "PlanDoesNotFit",
  "RelativeBudget",
  "PyTree",
  "TableBackend",
  "TableGroup",
  "TableSpec",
  "aligned_rows",
  "assign_rules",
  "available_backends",
  "backend_class",
  "capabilities_of",
  "check_layout",
  "batch_bytes",
  "check_memory",
  "dedup",
  "default_mesh",
  "device_dedup",
  "format_plan",
  "init_rows",
  "init_table",
  "shapes_only",
  "make_backend",
  "make_group",
  "parse_backend",
  "parse_budget",
  "parse_bytes",
  "pool_rows",
  "register_backend",
  "resolve_plan",
  "segment_rows",
  "sparse_sgd_or_adagrad",
  "table_key",
  "unpool",
]
