"""Mesh axis names and mesh construction. Use these constants, never string literals."""

from __future__ import annotations

import jax
import numpy as np

DATA = "data"  # batch (data-parallel) axis
TABLE = "table"  # model-parallel axis embedding tables are split over


def make_mesh(data: int = 1, table: int | None = None) -> jax.sharding.Mesh:
  """A (DATA, TABLE) mesh over the local devices, with Auto axes.

  Auto axes let XLA partition a gather on a row-sharded table (with Explicit axes, the
  default of jax.make_mesh, `jnp.take` then needs an out_sharding; DESIGN.md).
  `table=None` uses every device not taken by `data`.
  """
  n = jax.device_count()
  if table is None:
    table = n // data
  if data * table > n:
    raise ValueError(f"mesh {data}x{table} needs {data * table} devices; {n} available")
  devices = np.asarray(jax.devices()[: data * table]).reshape(data, table)
  return jax.sharding.Mesh(devices, (DATA, TABLE), axis_types=(jax.sharding.AxisType.Auto,) * 2)
