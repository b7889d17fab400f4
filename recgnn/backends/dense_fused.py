"""`dense` tables of one group in one array: the table-batched layout (FBGEMM's TBE, TorchRec's
fused EmbeddingBagCollection) for a group's replicated dense tables of one dim and one
optimizer.

Why: a step's host cost grows with the arrays it takes and returns (jit's dispatch costs the
launching thread a few microseconds per argument leaf: docs/backends/dense.md), and Criteo's 26
tables with row-wise Adagrad are 52 of `dlrm_kaggle`'s 97 state leaves; on a GPU each table is also
its own gather and its own scatter. Fused, the group's state is two leaves and its step one gather
and one scatter, whatever the table count.

State:  {"table": float32[S, D], <slot>: float32[S]} (slot: row-wise Adagrad's "accum"), S =
        sum over the tables of their aligned rows; table t's rows at [offset_t, offset_t + R_t)
        (R_t = aligned_rows(N_t), as `dense`'s own arrays), replicated on every device.
The prepared batch is each member's own (`TableGroup.prepare`: padding mapped past the table,
the dedup per table); `lookup` and `update` shift each table's ids by its offset inside the
step (padding -> S: zero rows, dropped writes), so the row updates are the per-table ones
(the same rows, the same gradient sums in the same order). Checkpoints, `tables`, `memory` and
`export` / `import_` are per table, as for unfused `dense`: a checkpoint restores into either
layout, any backend, any mesh.

Cost: `export` slices each table out of the fused array (a device copy of the group while a
checkpoint is written); `dense(fuse=false)` keeps one array per table.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from recgnn import sharding
from recgnn.embeddings import base
from recgnn.embeddings.group import TableGroup


def fusable(specs) -> bool:
  """Whether these tables can share one array: two or more, of one dim and one optimizer
  (`Dense.group_class` also asks for fuse=True and shard=none)."""
  dims, optimizers = {s.dim for s in specs}, {s.optimizer for s in specs}
  return len(specs) > 1 and len(dims) == 1 and len(optimizers) == 1


class FusedDense(TableGroup):
  """A group of replicated `dense` tables of one dim and optimizer in one array (see the
  module docstring). `members` are the per-table `Dense` backends: prepare, specs, memory."""

  def __init__(self, cls, specs, mesh, layout=None, text: str = "", **options):
    super().__init__(cls, specs, mesh, layout, text, **options)
    rows = [base.aligned_rows(s.num_rows) for s in specs]
    #: Each table's first row in the fused array.
    self.offsets = dict(zip(self.members, np.cumsum([0, *rows[:-1]]).tolist(), strict=True))
    self.rows = dict(zip(self.members, rows, strict=True))
    self.total = int(sum(rows))
    self.spec0 = specs[0]
    self.slot_names = self.spec0.optimizer.slot_names()
    #: The members' dedup runs in the step (`DenseOptions.dedup`: one option for the group).
    self.dedup_on_device = next(iter(self.members.values())).dedup == "device"

  def describe(self, table=None):
    return "dense"

  def state_sharding(self):
    repl = sharding.named(self.mesh, sharding.REPLICATED)
    return {"table": repl, **{s: repl for s in self.slot_names}}

  def init(self, key):
    # Each table's values as unfused `dense` makes them (its own key, zero padding rows),
    # written straight into the fused host array: one copy of the group on the host.
    table = np.zeros((self.total, self.spec0.dim), np.float32)
    for n, spec in self.specs.items():
      off = self.offsets[n]
      table[off : off + spec.num_rows] = base.init_table(base.table_key(key, n), spec)
    state = {"table": table}
    init = self.spec0.optimizer.initial_accumulator
    state.update({s: np.full(self.total, init, np.float32) for s in self.slot_names})
    return sharding.put(state, self.state_sharding())

  def _shift(self, n: str, ids: jax.Array) -> jax.Array:
    """Table n's prepared ids (padding: its pad_id past its aligned rows, or < 0 as read with
    dedup=device) -> fused rows (padding -> S: zero rows on lookup, dropped by the update's
    scatters)."""
    return jnp.where((ids < 0) | (ids >= self.rows[n]), self.total, ids + self.offsets[n])

  def lookup(self, state, prepared):
    names = list(self.members)
    ids = jnp.concatenate([self._shift(n, prepared[n]["rows"]["ids"]) for n in names], axis=1)
    rows = state["table"].at[ids].get(mode="fill", fill_value=0.0)  # [B, sum L, D]
    pooled, start = {}, 0
    for n in names:
      bag = prepared[n]["rows"]["ids"].shape[1]
      pooled[n] = base.pool_rows(rows[:, start : start + bag], prepared[n].get("count"))
      start += bag
    return pooled, {n: () for n in names}

  def update(self, state, prepared, residuals, grads):
    del residuals
    # As `TableBackend.update_pooled`: the batch's (ids, pooled grads) on every replica.
    grads, prepared = sharding.replicate((grads, prepared), self.mesh)
    g = {
      n: base.unpool(grads[n], prepared[n].get("count"), prepared[n]["rows"]["ids"].shape[1])
      for n in self.members
    }
    opt = self.spec0.optimizer
    if not opt.needs_unique:  # SGD: one scatter-add sums every table's duplicates
      ids = jnp.concatenate([self._shift(n, prepared[n]["rows"]["ids"]) for n in g], axis=1)
      step = jnp.concatenate([-opt.learning_rate * g[n] for n in g], axis=1)
      table = state["table"].at[ids.reshape(-1)].add(step.reshape(-1, step.shape[-1]), mode="drop")
      return {"table": table, **{s: state[s] for s in self.slot_names}}
    # Row-wise Adagrad: one gather and one scatter for the group; each table's gradient sums
    # and row updates in arrays of its own shapes, as unfused `dense` computes them (XLA:CPU
    # sums [U, D] blocks of other shapes in another order: ulps apart, and the trainer's tests
    # compare the other backends with dense bit for bit).
    if self.dedup_on_device:
      deduped = self._group_dedup(prepared)
    else:
      deduped = {
        n: (self._shift(n, prepared[n]["rows"]["unique"]), prepared[n]["rows"]["inverse"])
        for n in g
      }
    unique, sums = {}, {}
    for n in g:
      unique[n], inverse = deduped[n]
      sums[n] = base.segment_rows(g[n], inverse, unique[n].shape[0])
    at = jnp.concatenate(list(unique.values()))
    rows = state["table"].at[at].get(mode="fill", fill_value=0.0)
    slots = {s: state[s].at[at].get(mode="fill", fill_value=0.0) for s in self.slot_names}
    new_rows, new_slots, start = [], {s: [] for s in self.slot_names}, 0
    for n in g:
      end = start + unique[n].shape[0]
      r, sl = opt.apply(rows[start:end], {s: v[start:end] for s, v in slots.items()}, sums[n])
      new_rows.append(r)
      for s in self.slot_names:
        new_slots[s].append(sl[s])
      start = end
    table = state["table"].at[at].set(jnp.concatenate(new_rows), mode="drop")
    out = {s: state[s].at[at].set(jnp.concatenate(new_slots[s]), mode="drop") for s in new_slots}
    return {"table": table, **out}

  def reset_rows(self, state, resets):
    """As `Dense.reset_rows`, each table's rows shifted into the fused array."""
    names = [n for n in self.members if n in resets]
    if not names:
      return state
    at = jnp.concatenate([self._shift(n, resets[n]["slots"]) for n in names])
    rows = jnp.concatenate([resets[n]["rows"] for n in names])
    init = self.spec0.optimizer.initial_accumulator
    out = {"table": state["table"].at[at].set(rows, mode="drop")}
    out.update({s: state[s].at[at].set(init, mode="drop") for s in self.slot_names})
    return out

  def _group_dedup(self, prepared) -> dict:
    """dedup=device: every table's (unique, inverse) from ONE sort of the group's shifted ids
    (an accelerator sorts the group once, not once per table). The tables own disjoint,
    ordered ranges of fused rows, so table n's distinct rows are one run of the sorted
    distinct ids, [lo_n, hi_n) (searchsorted of its first row): cut out into arrays of the
    shapes its own dedup makes (U = B * L_n, then the filler S), the same values as
    `device_dedup` of its ids shifted, so the update below runs as per table (its sums and
    row updates in arrays of its own shapes: bit for bit on XLA:CPU).
    -> {table: (unique int32[B * L_n] fused rows, inverse int32[B, L_n])}."""
    names = list(prepared)
    ids = [self._shift(n, prepared[n]["rows"]["ids"]) for n in names]
    unique, inverse = base.device_dedup(jnp.concatenate([x.reshape(-1) for x in ids]), self.total)
    firsts = jnp.asarray([self.offsets[n] for n in names] + [self.total], jnp.int32)
    bounds = jnp.searchsorted(unique, firsts)  # [T + 1]: lo_n, and the last table's hi
    # Per position of the concatenated ids: its table's lo and hi, its index in its table
    # (broadcasts and iotas XLA fuses), so every table's run is cut by ONE gather.
    sizes = [x.size for x in ids]
    lo = jnp.concatenate([jnp.full(k, bounds[i]) for i, k in enumerate(sizes)])
    hi = jnp.concatenate([jnp.full(k, bounds[i + 1]) for i, k in enumerate(sizes)])
    at = jnp.concatenate([jnp.arange(k, dtype=jnp.int32) for k in sizes])
    mine = unique.at[lo + at].get(mode="fill", fill_value=self.total)
    cut = jnp.where(at < hi - lo, mine, self.total)
    # (padding's inverse points past hi - lo, at a filler slot or none: dropped either way)
    local = inverse.reshape(-1) - lo
    out, start = {}, 0
    for n, x, k in zip(names, ids, sizes, strict=True):
      out[n] = (cut[start : start + k], local[start : start + k].reshape(x.shape))
      start += k
    return out

  def export(self, state):
    out = {}
    for n in self.members:
      lo, hi = self.offsets[n], self.offsets[n] + self.rows[n]
      out[n] = {"rows": state["table"][lo:hi], **{s: state[s][lo:hi] for s in self.slot_names}}
    return out

  def import_(self, logical):
    names = list(self.members)
    state = {"table": jnp.concatenate([logical[n]["rows"] for n in names])}
    state.update({s: jnp.concatenate([logical[n][s] for n in names]) for s in self.slot_names})
    return sharding.put(state, self.state_sharding())

  def tables(self, state):
    table = np.asarray(jax.device_get(state["table"]))
    return {n: table[self.offsets[n] : self.offsets[n] + s.num_rows] for n, s in self.specs.items()}

  def sync(self, state):
    return state

  def restore(self, state):
    return state
