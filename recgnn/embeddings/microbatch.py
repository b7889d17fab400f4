"""Micro-batches: a group of tables may ask the train step to run a batch in pieces.

A backend declares a split with `Capabilities(splits_batch=True)` and implements two methods,
the MicroBatching protocol (`recgnn.embeddings.protocols`; `make_group` refuses the declaration
without them). `dense`, `tt`, `offload` and `sharded` do not split, and the step runs their
batches whole:

  micro_batches(prepared) -> tuple[int32[n * P_m], ...] | None
      inside jit. One index array per micro-batch, in the order to run them; batch-major
      (split over the devices like the batch): device i's slice holds indices of ITS OWN
      b = B / n examples (b = padding). Every example is in exactly one micro-batch, and the
      sizes P_m are the same on every device (bucketed by the backend so the step compiles
      a few times per run). None: run the batch whole.
  lookup_micro(state, prepared) -> (({table: f32[n * P_m, D]}, ...), residuals)
      the pooled rows of every micro-batch m (padding rows: anything finite), in the order
      of `micro_batches`, and the residuals `update` takes (as `lookup`'s).

`hot_cold` (Hotline) splits a batch into a popular micro-batch (every id hot: device memory
only) and a non-popular one (cold rows from the host), so the step's first piece never waits
for the host. The step (recgnn.train.step) runs the task's loss per micro-batch, combines the
pieces as the weighted mean the Task contract says a loss is, reassembles d loss / d pooled
in batch order and applies ONE embedding update for the whole batch.

The helpers below move rows between the batch order and a micro-batch on each device, with
no communication (shard_map over the batch axis; a replicated batch is one piece).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from recgnn import sharding

P = sharding.P


def _spec(x, split: bool):
  return P(sharding.BATCH, *([None] * (x.ndim - 1))) if split else sharding.REPLICATED


def take(mesh, split: bool, x: jax.Array, idx: jax.Array) -> jax.Array:
  """Rows of a batch-major x f32[B, ...] for one micro-batch: -> [n * P, ...], each device
  its own examples idx (local; b = padding -> zeros)."""

  def local(x, idx):
    return x.at[idx].get(mode="fill", fill_value=0)

  f = jax.shard_map(
    local,
    mesh=mesh,
    in_specs=(_spec(x, split), _spec(idx, split)),
    out_specs=_spec(x, split),
    check_vma=False,
  )
  return f(x, idx)


def merge(
  mesh, split: bool, batch: int, idx: Sequence[jax.Array], parts: Sequence[jax.Array]
) -> jax.Array:
  """Micro-batch rows back in batch order: parts[m] [n * P_m, ...] with idx[m] int32[n * P_m]
  (local example index, b = padding: dropped) -> [batch, ...]. Each example is in exactly
  one micro-batch, so `set` is exact."""
  n = mesh.size if split else 1
  b = batch // n

  def local(idx, parts):
    out = jnp.zeros((b,) + parts[0].shape[1:], parts[0].dtype)
    for i, x in zip(idx, parts):
      out = out.at[i].set(x, mode="drop")
    return out

  f = jax.shard_map(
    local,
    mesh=mesh,
    in_specs=([_spec(i, split) for i in idx], [_spec(x, split) for x in parts]),
    out_specs=_spec(parts[0], split),
    check_vma=False,
  )
  return f(list(idx), list(parts))
