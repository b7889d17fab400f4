"""`TableGroup`: the contract's group adapter for backends whose tables are independent.

A per-table backend (`TableBackend`: unpooled rows, one table) becomes a contract `Backend`
here: the group pools each table's rows, `unpool`s the gradient, and holds one member per
table, all constructed with the group's mesh and layout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from recgnn import sharding
from recgnn.embeddings import kernels
from recgnn.embeddings.contract import Backend, Layout, valid_options
from recgnn.embeddings.specs import table_key
from recgnn.embeddings.table_backend import TableBackend


class TableGroup(Backend):
  """A group of independent per-table backends (dense, tt, offload) under contract v3.

  prepared = {table: {"rows": the table backend's prepared, "count": int32[B] (mean pooling)}}
  state    = {table: the table backend's state}
  residuals = {table: the table backend's residuals} (empty for dense; offload: the rows it
              read from host memory; tt: the core slices its vjp needs)
  """

  def __init__(self, cls, specs, mesh, layout: Layout | None = None, text: str = "", **options):
    super().__init__(specs, mesh, layout, text)
    self.name = cls.name
    self.capabilities = cls.capabilities_for(options)
    self.members: dict[str, TableBackend] = {}
    for spec in specs:
      try:
        member = cls(spec, mesh, self.layout, **options)
      except TypeError as e:
        raise ValueError(
          f"Bad options for backend {text!r} (table {spec.name!r}): {e}; valid options: "
          f"{', '.join(valid_options(cls)) or 'none'}"
        ) from None
      self.members[spec.name] = member
    self.lookahead = max([m.lookahead for m in self.members.values()] + [0])
    # Members whose prepare is the contract's default (map padding, dedup for per-row
    # optimizer state: dense) are prepared together, in one pass over the group's ids.
    default = [m.prepares_by_default() and m.dedup_on_host for m in self.members.values()]
    self._stacked = (
      kernels.StackedDedup([m.pad_id for m in self.members.values()])
      if self.members and all(default) and kernels.stacked_dedup_kernel() is not None
      else None
    )

  def describe(self, table=None):
    if table is not None:
      return self.members[table].describe()
    return self.members[next(iter(self.members))].describe() if self.members else self.text

  def init(self, key):
    state = {n: m.init(table_key(key, n)) for n, m in self.members.items()}
    return sharding.put(state, self.state_sharding())

  def state_sharding(self):
    return {n: m.state_sharding() for n, m in self.members.items()}

  def prepare(self, ids, upcoming=(), *, train=True):
    if self._stacked is not None:
      arrays = [np.asarray(ids[n]) for n in self.members]
      if len({x.shape for x in arrays}) == 1:  # (bags of one length: one-hot, or equal)
        return self._prepare_stacked(arrays)
    out = {}
    for n, m in self.members.items():
      x = np.asarray(ids[n])
      p = {"rows": m.prepare(x, [u[n] for u in upcoming[: m.lookahead]], train=train)}
      if m.spec.pooling == "mean":
        p["count"] = np.sum(x >= 0, axis=1).astype(np.int32)
      out[n] = p
    return out

  def prepare_on_device(self, ids):
    """`prepare` inside the step, each member's `prepare_on_device` (the device feed)."""
    out = {}
    for n, m in self.members.items():
      x = ids[n]
      p = {"rows": m.prepare_on_device(x)}
      if m.spec.pooling == "mean":
        p["count"] = jnp.sum(x >= 0, axis=1, dtype=jnp.int32)
      out[n] = p
    return out

  def _prepare_stacked(self, arrays: list) -> dict:
    """The default prepare of every member at once (`kernels.StackedDedup`): the same
    arrays, each table's a view of one [T, ...] array, but `unique`'s order (see there)."""
    mapped, unique, inverse = self._stacked(np.stack(arrays))
    out = {}
    for i, (n, m) in enumerate(self.members.items()):
      p = {"rows": {"ids": mapped[i], "unique": unique[i], "inverse": inverse[i]}}
      if m.spec.pooling == "mean":
        p["count"] = np.sum(arrays[i] >= 0, axis=1).astype(np.int32)
      out[n] = p
    return out

  def prepared_spec(self, prepared):
    out = {}
    for n, p in prepared.items():
      split = self.layout.split_batch
      batch = sharding.BATCH_SPEC if split else sharding.REPLICATED
      keys = self.members[n].batch_major if split else ()
      rows = {
        k: jax.tree.map(lambda _, s=(batch if k in keys else sharding.REPLICATED): s, v)
        for k, v in p["rows"].items()
      }
      out[n] = {"rows": rows, **({"count": batch} if "count" in p else {})}
    return out

  def lookup(self, state, prepared):
    pooled, residuals = {}, {}
    for n, m in self.members.items():
      pooled[n], residuals[n] = m.lookup_pooled(
        state[n], prepared[n]["rows"], prepared[n].get("count")
      )
    return pooled, residuals

  def update(self, state, prepared, residuals, grads):
    return {
      n: m.update_pooled(
        state[n], prepared[n]["rows"], residuals[n], grads[n], prepared[n].get("count")
      )
      for n, m in self.members.items()
    }

  def reset_rows(self, state, resets):
    return {
      n: self.members[n].reset_rows(s, resets[n]) if n in resets else s for n, s in state.items()
    }

  def memory(self):
    return {n: m.memory() for n, m in self.members.items()}

  def num_params(self):
    return {n: m.num_params() for n, m in self.members.items()}

  def tables(self, state):
    return {n: m.table(state[n]) for n, m in self.members.items()}

  def sync(self, state):
    return {n: m.sync(state[n]) for n, m in self.members.items()}

  def restore(self, state):
    return {n: m.restore(state[n]) for n, m in self.members.items()}

  def logical_format(self, table):
    return self.members[table].logical_format

  def export(self, state):
    return {n: m.export(state[n]) for n, m in self.members.items()}

  def logical_target(self):
    return {n: m.logical_target() for n, m in self.members.items()}

  def import_(self, logical):
    return {n: m.import_(logical[n]) for n, m in self.members.items()}

  def stats(self):
    out = {}
    for n, m in self.members.items():
      out.update({f"{n}/{k}": v for k, v in m.stats().items()})
    return out
