"""Arrays row-sharded over a mesh axis: the one copy of the mechanism every backend that splits
rows uses (dense(shard=rows) over MODEL, hot_cold's hot rows and host rows over every device,
sharded's row-wise tables over MODEL).

The functions run inside `shard_map`, on one device's block of R rows (rows [i * R, (i + 1) *
R) of the logical array on the device at index i of `axis`), but `gather_everywhere` and
`scatter_everywhere`, which take a whole row-sharded array and replicated row indices. A row
has one owner, so the sum of the devices' masked gathers is exact (one non-zero term).

Shapes: R = rows per device, D = row width, [...] any index shape.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from recgnn import sharding
from recgnn.embeddings.kernels import sparse_sgd_or_adagrad


def local_index(ids: jax.Array, rows: int, axis, num_rows: int | None = None) -> jax.Array:
  """ids int32[...] (global rows; negative or >= num_rows: padding) -> this device's local
  index int32[...] in [0, R], R where the row is not owned here (gathers read zeros,
  scatters drop it)."""
  loc = ids - jax.lax.axis_index(axis) * rows
  owned = (loc >= 0) & (loc < rows)
  if num_rows is not None:
    owned = owned & (ids < num_rows)
  return jnp.where(owned, loc, rows)


def gather(block: jax.Array, loc: jax.Array) -> jax.Array:
  """block f32[R, ...], loc int32[...] from `local_index` -> f32[..., ...]: owned rows, zeros
  elsewhere."""
  return block.at[loc].get(mode="fill", fill_value=0.0)


def every(x: jax.Array, axis) -> jax.Array:
  """The batch-major x of every device over `axis`, in device order (tiled all-gather)."""
  return jax.lax.all_gather(x, axis, tiled=True)


def psum_rows(x: jax.Array, axis) -> jax.Array:
  """The sum over `axis` of the devices' masked gathers: every device gets every row."""
  return jax.lax.psum(x, axis)


def reduce_scatter_rows(x: jax.Array, axis) -> jax.Array:
  """x f32[n * b, ...] (masked gathers for the examples of every device over `axis`) -> each
  device's own b examples, summed over the devices (exact: one owner per row)."""
  return jax.lax.psum_scatter(x, axis, scatter_dimension=0, tiled=True)


def scatter(block: jax.Array, loc: jax.Array, values: jax.Array) -> jax.Array:
  """block[loc] = values for the rows this device owns (loc = R: dropped)."""
  return block.at[loc].set(values, mode="drop")


def update(spec, block: jax.Array, slots: dict, local_prepared: dict, grads: jax.Array, **kw):
  """The shared sparse row update on this device's rows: local_prepared {"ids": local
  indices int32[B, L] and, optionally, "unique" (local) / "inverse"}, grads f32[B, L, D] of
  the whole batch (every device sees every example; rows it does not own are dropped)."""
  return sparse_sgd_or_adagrad(spec, block, slots, local_prepared, grads, **kw)


def _row_spec(x: jax.Array, axis) -> jax.sharding.PartitionSpec:
  return sharding.P(axis, *([None] * (x.ndim - 1)))


def gather_everywhere(mesh, axis, array: jax.Array, rows: jax.Array, local_gather=gather):
  """array f32[R * n, ...] row-sharded over `axis`, rows int32[M] (replicated; out of range:
  zeros) -> f32[M, ...] replicated: each device gathers the rows it owns (`local_gather(block,
  loc)`, zeros where loc = R) and a psum adds the one non-zero term per row (exact)."""

  @functools.partial(
    jax.shard_map,
    mesh=mesh,
    in_specs=(_row_spec(array, axis), sharding.REPLICATED),
    out_specs=sharding.REPLICATED,
    check_vma=False,
  )
  def local(block, rows):
    return psum_rows(local_gather(block, local_index(rows, block.shape[0], axis)), axis)

  return local(array, rows)


def scatter_everywhere(
  mesh, axis, array: jax.Array, rows: jax.Array, values: jax.Array, local_scatter=scatter
):
  """array[rows] = values (rows int32[M], values [M, ...] replicated; out of range: dropped)
  on an array row-sharded over `axis`: each device writes the rows it owns
  (`local_scatter(block, loc, values)`, loc = R dropped)."""
  spec = _row_spec(array, axis)

  @functools.partial(
    jax.shard_map,
    mesh=mesh,
    in_specs=(spec, sharding.REPLICATED, sharding.REPLICATED),
    out_specs=spec,
    check_vma=False,
  )
  def local(block, rows, values):
    return local_scatter(block, local_index(rows, block.shape[0], axis), values)

  return local(array, rows, values)
