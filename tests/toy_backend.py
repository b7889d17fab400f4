"""A backend written outside the package, in one file: what a researcher adds to try an idea.

`toy` keeps each table as one replicated float32[N, D] array (and a float32[N] accumulator for
row-wise Adagrad) and applies the row update itself, from the contract's public helpers only
(`recgnn.embeddings`: the per-table contract `TableBackend`, `dedup`'s unique / inverse ids
from the default `prepare`, `segment_rows`, `OptimizerSpec.apply`). Importing this module
registers it; a plan then names it like any built-in backend:

  import toy_backend  # noqa: F401
  config.embeddings.plan = [("C(3|4)", "toy"), (".*", "dense")]

It implements only the per-table core (`init`, `state_sharding`, `lookup`, `update`, `memory`,
`table`): `TableBackend`'s default "rows" checkpoint (export / import_ from `table` and the
state's `accum`, back through the default `from_rows`) saves, resumes and reshards it.

tests/test_toy_backend.py runs the contract test on it (1x1, 8x1, 2x4 against `dense`). A
backend in an installed package registers through the `recgnn.backends` entry-point group
instead of an import (docs/architecture.md).
"""

from __future__ import annotations

import jax
import numpy as np

from recgnn.embeddings import base


@base.register_backend("toy")
class Toy(base.TableBackend):
  """One replicated table. State: {"table": f32[N, D], "accum": f32[N] (Adagrad only)}.

  The default `prepare` gives {"ids": int32[B, L] (padding -> N)} and, for optimizers with
  per-row state, the batch's distinct rows {"unique": int32[B * L], "inverse": int32[B, L]};
  the group (`TableGroup`) pools, unpools the gradient and gathers the batch on every device
  so every replica applies the same update.
  """

  def init(self, key):
    opt = self.spec.optimizer
    state = {"table": base.init_table(key, self.spec)}
    state.update(
      {
        s: np.full(self.spec.num_rows, opt.initial_accumulator, np.float32)
        for s in opt.slot_names()
      }
    )
    return jax.device_put(state, self.replicated())

  def state_sharding(self):
    return {
      "table": self.replicated(),
      **{s: self.replicated() for s in self.spec.optimizer.slot_names()},
    }

  def lookup(self, state, prepared):
    """ids int32[B, L] -> f32[B, L, D]; padding (id N) reads zeros."""
    return state["table"].at[prepared["ids"]].get(mode="fill", fill_value=0.0)

  def update(self, state, prepared, grads):
    """grads f32[B, L, D] -> the new state, touching only the batch's rows."""
    opt = self.spec.optimizer
    table = state["table"]
    if not opt.needs_unique:
      # SGD: a scatter-add sums a row's repeats, exactly the summed gradient's step.
      flat = grads.reshape(-1, grads.shape[-1])
      return {
        "table": table.at[prepared["ids"].reshape(-1)].add(-opt.learning_rate * flat, mode="drop")
      }
    unique, inverse = prepared["unique"], prepared["inverse"]
    g = base.segment_rows(grads, inverse, unique.shape[0])  # f32[U, D], one sum per row
    rows = table.at[unique].get(mode="fill", fill_value=0.0)
    slots = {k: state[k].at[unique].get(mode="fill", fill_value=0.0) for k in opt.slot_names()}
    rows, slots = opt.apply(rows, slots, g)
    new = {"table": table.at[unique].set(rows, mode="drop")}
    new.update({k: state[k].at[unique].set(v, mode="drop") for k, v in slots.items()})
    return new

  def memory(self):
    return base.MemoryReport(self.spec.table_bytes, 0, "device (replicated)")

  def table(self, state):
    return np.asarray(jax.device_get(state["table"]))


__all__ = ["Toy"]
