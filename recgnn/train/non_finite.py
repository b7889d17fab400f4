"""A NaN / inf training loss: where it first appears among the losses read at a log step, and
which tables and dense params hold non-finite values (the loop's error message)."""

from __future__ import annotations

import jax
import numpy as np

from recgnn import planner
from recgnn.embeddings import streamed
from recgnn.train import train_state as state_lib


class NonFiniteLoss(FloatingPointError):
  """A NaN / inf training loss: the run stops without saving (the last checkpoint is good)."""


def first_non_finite(steps: list[int], losses) -> tuple[int, float] | None:
  """(step, loss) of the first non-finite loss among `losses` (of steps `steps`), or None."""
  for s, v in zip(steps, losses):
    if not np.isfinite(v):
      return s, float(v)
  return None


def report(plan: planner.Plan, state: state_lib.TrainState) -> str:
  """Which tables and dense params of a (synced) state hold NaN / inf (their stored form:
  rows, slots, cores)."""
  parts = []
  for key, group in plan.groups.items():
    for name, arrays in group.export(state.emb[key]).items():
      if isinstance(arrays, streamed.StreamedTable):  # (bigger than RAM: a chunk at a time)
        bad = arrays.count(lambda c: sum(int(np.sum(~np.isfinite(x))) for x in c.values()))
      else:
        bad = sum(int(np.sum(~np.isfinite(np.asarray(x)))) for x in jax.tree.leaves(arrays))
      if bad:
        parts.append(f"{name} ({bad:,} values)")
  tables = ", ".join(parts) or "none"
  flat = jax.tree_util.tree_flatten_with_path(jax.device_get(state.params))[0]
  dense = [jax.tree_util.keystr(p) for p, x in flat if not np.all(np.isfinite(np.asarray(x)))]
  shown = ", ".join(dense[:8]) + (f" and {len(dense) - 8} more" if len(dense) > 8 else "")
  return f"tables with non-finite values: {tables}; dense params: {shown or 'none'}"
