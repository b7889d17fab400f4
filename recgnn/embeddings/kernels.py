"""Kernels shared by the backends: host and device dedup of a batch's ids, per-row gradient
sums, pooling and its transpose, and the sparse row update of an indexable row array.

Shapes: B = batch, L = bag length, D = dim, U = distinct rows of a batch.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from recgnn.embeddings.specs import TableSpec

PyTree = Any


def dedup(ids: np.ndarray, num_rows: int) -> tuple[np.ndarray, np.ndarray]:
  """Host-side dedup of a batch's ids, fixed-shape for jit.

  Args:
    ids: int[B, L], PAD for empty slots.
    num_rows: the table's rows; used as the out-of-range filler.
  Returns:
    unique: int32[B * L], the distinct ids then `num_rows` (dropped by scatters).
    inverse: int32[B, L], position of each id in `unique` (padding -> a filler slot).
  """
  flat = ids.reshape(-1)
  flat = np.where(flat < 0, num_rows, flat)
  uniq, inverse = np.unique(flat, return_inverse=True)
  unique = np.full(flat.shape[0], num_rows, np.int32)
  unique[: uniq.shape[0]] = uniq
  return unique, inverse.reshape(ids.shape).astype(np.int32)


def device_dedup(ids: jax.Array, filler: int) -> tuple[jax.Array, jax.Array]:
  """`dedup` on device, inside jit: ids int32[...] with padding already >= the rows ->
  (unique int32[ids.size]: the sorted distinct ids then `filler`, inverse int32[ids.shape]).
  The same arrays as the host's `dedup` up to the filler, so the same update bit for bit."""
  flat = ids.reshape(-1)
  unique, inverse = jnp.unique(flat, size=flat.shape[0], fill_value=filler, return_inverse=True)
  return unique, inverse.reshape(ids.shape)


def segment_rows(grads: jax.Array, inverse: jax.Array, num_unique: int) -> jax.Array:
  """Sum grads float32[B, L, D] per distinct row: -> float32[num_unique, D]."""
  d = grads.shape[-1]
  return jax.ops.segment_sum(grads.reshape(-1, d), inverse.reshape(-1), num_segments=num_unique)


def unpool(g: jax.Array, count: jax.Array | None, bag: int) -> jax.Array:
  """d loss / d pooled f32[B, D] -> d loss / d rows f32[B, L, D].

  `count`: int32[B] non-padded ids per bag for mean pooling, None for sum pooling. Padded
  positions get a gradient too (as autodiff through `pool` gives them); every backend's
  update drops padded positions, so their value does not matter.
  """
  if count is not None:
    g = g / jnp.maximum(count, 1).astype(g.dtype)[:, None]
  return jnp.broadcast_to(g[:, None, :], (g.shape[0], bag, g.shape[1]))


def pool_rows(rows: jax.Array, count: jax.Array | None) -> jax.Array:
  """rows f32[B, L, D] (0 at padding) -> f32[B, D]: sum, or mean when `count` is given."""
  summed = jnp.sum(rows, axis=1)
  if count is None:
    return summed
  return summed / jnp.maximum(count, 1).astype(summed.dtype)[:, None]


def sparse_sgd_or_adagrad(
  spec: TableSpec,
  table: jax.Array,
  slots: dict[str, jax.Array],
  prepared: PyTree,
  grads: jax.Array,
  mean_square=None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The row-wise update shared by backends that keep rows in an indexable array.

  Args:
    table: float32[R, D] (a full table or a cache; R rows).
    slots: per-row optimizer state, float32[R] each.
    prepared: {"ids": int32[B, L] in [0, R], R = padding} and, when the optimizer needs it,
      {"unique": int32[B*L], "inverse": int32[B, L]} (see `dedup`; without them, with
      process-local input, the ids are deduped here on device).
    grads: float32[B, L, D].
    mean_square: see `OptimizerSpec.apply` (a column block of a row).
  Returns:
    the new (table, slots), touching only the batch's rows.
  """
  opt = spec.optimizer
  if not opt.needs_unique:
    # Scatter-add sums a row's duplicates, which is exactly SGD on the summed gradient.
    ids = prepared["ids"].reshape(-1)
    g = grads.reshape(-1, grads.shape[-1])
    return table.at[ids].add(-opt.learning_rate * g, mode="drop"), slots
  if "unique" in prepared:
    unique, inverse = prepared["unique"], prepared["inverse"]
  else:  # process-local input: the batch's ids were gathered on device (`update_pooled`)
    unique, inverse = device_dedup(prepared["ids"], table.shape[0])
  g = segment_rows(grads, inverse, unique.shape[0])
  rows = table.at[unique].get(mode="fill", fill_value=0.0)
  old = {k: v.at[unique].get(mode="fill", fill_value=0.0) for k, v in slots.items()}
  rows, new = opt.apply(rows, old, g, mean_square)
  table = table.at[unique].set(rows, mode="drop")
  slots = {k: slots[k].at[unique].set(new[k], mode="drop") for k in slots}
  return table, slots
