"""Kernels shared by the backends: host and device dedup of a batch's ids, per-row gradient
sums, pooling and its transpose, and the sparse row update of an indexable row array.

Shapes: B = batch, L = bag length, D = dim, U = distinct rows of a batch.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from recgnn import hostpool
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


def _stacked_dedup_kernel(ids, fillers, offsets, mark, mapped, unique, inverse):  # pragma: no cover
  """StackedDedup's loop (compiled by numba; see there): per table, two passes over its ids."""
  t_count, n = ids.shape
  for t in range(t_count):
    f, off = fillers[t], offsets[t]
    for i in range(n):  # padding -> the filler; every key of the batch unmarked
      x = ids[t, i]
      if x < 0:
        x = f
      mapped[t, i] = x
      mark[off + x] = -1
    u = 0
    for i in range(n):  # first occurrences numbered in batch order
      x = mapped[t, i]
      j = mark[off + x]
      if j < 0:
        j = u
        mark[off + x] = u
        unique[t, u] = x
        u += 1
      inverse[t, i] = j
    for i in range(u, n):
      unique[t, i] = f


_compiled_stacked_dedup = None


def stacked_dedup_kernel():
  """The compiled kernel (numba, GIL released while it runs), or None without numba."""
  global _compiled_stacked_dedup
  if _compiled_stacked_dedup is None:
    try:
      import numba
    except ImportError:
      return None
    _compiled_stacked_dedup = numba.njit(nogil=True, cache=True)(_stacked_dedup_kernel)
  return _compiled_stacked_dedup


class StackedDedup:
  """`dedup` of T tables' ids in one call without a sort: the prepare of a group of
  per-example tables (`TableGroup`). One `np.unique` per table is nearly all sorting; a
  vectorized numpy form of the loop below (scatter, gather, cumsum, nonzero over [T, n]) is
  ~12 passes over the ids and no faster; this compiled loop is two passes, with the GIL
  released (docs/running.md, "Measurements behind the host-side code").

  Each table's ids live in their own range of one scratch array `mark` (int32, one entry per
  row of every table plus its filler: 4 bytes per row on the host, allocated once per
  preparing thread, never cleared: a batch first unmarks every key it will read).

  `unique` lists a table's distinct ids in the order they first occur, not sorted as
  `dedup`'s: the sparse update reads and writes each row of `unique` once and sums a row's
  gradients in batch order either way, so its result is the same bit for bit.

  A large batch's tables are split over `hostpool.threads()` threads, each a contiguous
  range of tables: a table touches only its own rows of every array, `mark` included, so
  the threads share this thread's scratch."""

  # Fewest ids (tables x ids per table) a thread's range of tables gets: below it the small
  # gain does not pay for a second core taken from the step on a CPU host (26 x 2048 ids stay
  # one call, 26 x 4096 split; docs/running.md).
  MIN_IDS_PER_CHUNK = 1 << 15

  def __init__(self, fillers: Sequence[int]):
    """fillers: int[T] each table's out-of-range id (its rows, or its padded rows), which
    padding ids become and which fills `unique` after the distinct ids."""
    self.kernel = stacked_dedup_kernel()
    if self.kernel is None:
      raise RuntimeError("StackedDedup needs numba (stacked_dedup_kernel() is None)")
    self.fillers = np.asarray(fillers, np.int64)
    self.offsets = np.concatenate([[0], np.cumsum(self.fillers + 1)[:-1]]).astype(np.int64)
    self._total = int(np.sum(self.fillers + 1))
    self._local = threading.local()  # one scratch per thread that prepares

  def __call__(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ids int[T, B, L] (< 0: padding) -> (ids with padding -> filler int32[T, B, L],
    unique int32[T, B * L], inverse int32[T, B, L])."""
    t = ids.shape[0]
    flat = np.ascontiguousarray(ids.reshape(t, -1))
    mark = getattr(self._local, "mark", None)
    if mark is None:
      mark = self._local.mark = np.empty(self._total, np.int32)
    mapped = np.empty(flat.shape, np.int32)
    unique = np.empty(flat.shape, np.int32)
    inverse = np.empty(flat.shape, np.int32)
    k, f, o = self.kernel, self.fillers, self.offsets

    def tables(a: int, b: int) -> None:  # (row ranges of C arrays: the kernel's one signature)
      k(flat[a:b], f[a:b], o[a:b], mark, mapped[a:b], unique[a:b], inverse[a:b])

    per_table = max(1, flat.shape[1])
    hostpool.run(tables, hostpool.chunks(t, -(-self.MIN_IDS_PER_CHUNK // per_table)))
    return mapped.reshape(ids.shape), unique, inverse.reshape(ids.shape)


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
