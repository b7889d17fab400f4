"""Host computations (`compute_on("device_host")`): a gather and a scatter of rows of an
array in host memory, inside a jitted function.

No backend runs these inside its step (the host tiers read and write their numpy tables off
the step: recgnn/embeddings/host_tier.py). They make programs with host traffic for the tests
of its readers (`recgnn.comms.host_link_of`, `recgnn.step_model`) and for gpu_check.py's
probe of a platform's pinned host memory. Both are bare XLA gathers / scatters: jnp's index
normalisation would add device-memory constants, which compute_on("device_host") rejects.
"""

from __future__ import annotations

import jax
from jax import lax
from jax.experimental import compute_on as _compute_on

# The function form of compute_on (compute_type=, out_memory_spaces=): jax 0.10 names it
# `compute_on2` (its `compute_on` is a context manager); from jax 0.11 on it is `compute_on`
# and the context manager is gone. Both lower to the same host-compute call.
_HOST_COMPUTE = getattr(_compute_on, "compute_on2", None) or _compute_on.compute_on


def host_compute(fn, *args):
  """fn(*args) as a host computation (XLA compute type "device_host"), its outputs in host
  memory. The args must already be in host memory (`jax.device_put(x, jax.memory.Space.Host)`)."""
  return _HOST_COMPUTE(fn, compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)(
    *args
  )


def gather_rows(x: jax.Array, idx: jax.Array) -> jax.Array:
  """x[idx] for in-range idx, as a bare XLA gather (jnp's index normalisation would add
  device-memory constants, which `compute_on("device_host")` rejects)."""
  dn = lax.GatherDimensionNumbers(
    offset_dims=tuple(range(1, x.ndim)), collapsed_slice_dims=(0,), start_index_map=(0,)
  )
  return lax.gather(x, idx[:, None], dn, (1,) + x.shape[1:], mode=lax.GatherScatterMode.CLIP)


def scatter_rows(x: jax.Array, idx: jax.Array, rows: jax.Array) -> jax.Array:
  """x.at[idx].set(rows); out-of-range idx (padding) are dropped natively by XLA."""
  dn = lax.ScatterDimensionNumbers(
    update_window_dims=tuple(range(1, x.ndim)),
    inserted_window_dims=(0,),
    scatter_dims_to_operand_dims=(0,),
  )
  return lax.scatter(
    x, idx[:, None], rows, dn, mode=lax.GatherScatterMode.FILL_OR_DROP, unique_indices=True
  )
