"""`dense`: the whole table and its optimizer state on the accelerator (the reference backend).

State: {"table": float32[N, D], "accum": float32[N] (row-wise Adagrad only)}. Lookup is a
gather; the update touches only the batch's rows (scatter-add for SGD, a dedup'd
gather-apply-scatter for row-wise Adagrad, the dedup done on the host in `prepare`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from recgnn import sharding
from recgnn.embeddings import base


class Dense(base.Backend):
  """Table on the device; optionally row-sharded over the mesh's TABLE axis.

  Options (plan string): `dense` or `dense(shard=rows)` to row-shard the table over
  `sharding.TABLE` when a mesh is given (XLA partitions the gather and scatter).
  """

  name = "dense"

  def __init__(self, spec: base.TableSpec, shard: str = "none"):
    super().__init__(spec)
    if shard not in ("none", "rows"):
      raise ValueError(f"dense: shard must be 'none' or 'rows', got {shard!r}")
    self.shard = shard

  def describe(self) -> str:
    return "dense" if self.shard == "none" else f"dense(shard={self.shard})"

  def init(self, key, mesh=None):
    state = {"table": jnp.asarray(base.init_table(key, self.spec))}
    state.update(self.spec.optimizer.init_slots(self.spec.num_rows))
    shardings = self.state_sharding(mesh)
    return jax.device_put(state, shardings) if shardings is not None else state

  def state_sharding(self, mesh):
    if mesh is None or self.shard == "none":
      return None
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(sharding.TABLE, None))
    vec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(sharding.TABLE))
    return {"table": rows, **{s: vec for s in self.spec.optimizer.slot_names()}}

  def lookup(self, state, prepared):
    # Padding ids were mapped to N by `prepare`; mode="fill" turns them into zero rows.
    return state["table"].at[prepared["ids"]].get(mode="fill", fill_value=0.0)

  def update(self, state, prepared, grads):
    slots = {k: state[k] for k in self.spec.optimizer.slot_names()}
    table, slots = base.sparse_sgd_or_adagrad(self.spec, state["table"], slots, prepared, grads)
    return {"table": table, **slots}

  def memory(self):
    return base.MemoryReport(self.spec.table_bytes, 0, "device")

  def table(self, state):
    return np.asarray(jax.device_get(state["table"]))


BACKEND = Dense
