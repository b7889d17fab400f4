"""Embedding tables: specs, the backend contract (v3), `register_backend`, and the mechanisms
backends share (row-sharded arrays, host tables, access counts, codecs, micro-batches). The
backends themselves live in `recgnn.backends`; the plan (which backend serves each table, the
registry's lookup, the memory budget) in `recgnn.planner`."""

from recgnn.embeddings.base import (
  PAD,
  Backend,
  Capabilities,
  Layout,
  MemoryReport,
  OptimizerSpec,
  TableBackend,
  TableSpec,
  register_backend,
  unpool,
)

__all__ = [
  "PAD",
  "Backend",
  "Capabilities",
  "Layout",
  "MemoryReport",
  "OptimizerSpec",
  "TableBackend",
  "TableSpec",
  "register_backend",
  "unpool",
]
