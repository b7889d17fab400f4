"""The embeddings' public face: one import for the specs, the contract, the shared kernels and
`register_backend` (`from recgnn.embeddings import base`; `base.TableSpec`, `base.Layout`).
The plan (the registry's lookup, resolve_plan, the memory budget) is the planner's:
`from recgnn import planner`.

Each concern lives in its own module (docs/architecture.md, "Package layout"):
  specs     TableSpec, OptimizerSpec (the shared row update `OptimizerSpec.apply`), init
  kernels   dedup, segment sums, pooling, `sparse_sgd_or_adagrad`
  contract  Layout, Capabilities, AutoContext, Backend (contract v3), BackendOptions
  protocols the optional protocols a backend declares (`recgnn.embeddings.protocols`)
  table_backend  TableBackend (the per-table half, unpooled rows)
  group     TableGroup (per-table backends as a contract Backend)
  registry  `register_backend` (the registry's table; its lookup is `recgnn.planner`'s)
"""

from recgnn.embeddings.contract import (
  TO_HOST,
  AutoContext,
  Backend,
  BackendOptions,
  Capabilities,
  Layout,
  PyTree,
  split_to_host,
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
from recgnn.embeddings.registry import register_backend
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
from recgnn.embeddings.table_backend import TableBackend

__all__ = [
  "INITIALIZERS",
  "INIT_CHUNK",
  "OPTIMIZERS",
  "PAD",
  "POOLINGS",
  "PREFETCH",
  "ROW_ALIGN",
  "TO_HOST",
  "AutoContext",
  "Backend",
  "BackendOptions",
  "Capabilities",
  "Layout",
  "MemoryReport",
  "OptimizerSpec",
  "PyTree",
  "TableBackend",
  "TableGroup",
  "TableSpec",
  "aligned_rows",
  "dedup",
  "device_dedup",
  "init_rows",
  "init_table",
  "shapes_only",
  "pool_rows",
  "register_backend",
  "segment_rows",
  "sparse_sgd_or_adagrad",
  "split_to_host",
  "table_key",
  "unpool",
]
