"""tt's state: its shapes and shardings, init, memory, the table (tests), checkpoints.

One concern: the state's life outside the step. {"cores": [f32[n_k, r_{k-1}, d_k, r_k]],
"accum": [f32[n_k]] (row-wise Adagrad), with a cache "cache": f32[C, D], "cache_ids":
int32[C] (N: an empty slot), "cache_<slot>": f32[C]}, replicated on every device of the mesh.
Checkpoints hold the cores themselves (`logical_format`). `StateKeeper` is an object the `TT`
front holds (recgnn/backends/tt/backend.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from recgnn.backends.tt.options import TTOptions
from recgnn.backends.tt.shape import (
  TTShape,
  init_cores,
  load_init_table,
  reconstruct,
  target_variance,
)
from recgnn.embeddings import base


class StateKeeper:
  """init, shardings, memory, table, logical_target; `hot_set(state)` for a restore.
  replicated: the mesh's replicated NamedSharding."""

  def __init__(
    self,
    spec: base.TableSpec,
    shape: TTShape,
    o: TTOptions,
    cache_rows: int,
    replicated: jax.sharding.NamedSharding,
  ):
    self._spec, self._shape, self._o = spec, shape, o
    self._cache_rows, self._replicated = cache_rows, replicated

  def _init_shapes(self):
    spec, opt = self._spec, self._spec.optimizer
    state = {"cores": [jnp.zeros(s, jnp.float32) for s in self._shape.core_shapes()]}
    if opt.needs_unique:
      state["accum"] = [jnp.zeros((s[0],), jnp.float32) for s in self._shape.core_shapes()]
    if self._cache_rows:
      c = self._cache_rows
      state["cache"] = jnp.zeros((c, spec.dim), jnp.float32)
      state["cache_ids"] = jnp.zeros((c,), jnp.int32)
      state.update({f"cache_{s}": jnp.zeros((c,), jnp.float32) for s in opt.slot_names()})
    return state

  def state_sharding(self):
    """The cores are small: replicated on every device of the mesh (and the cache with them,
    so a batch-split lookup reads its rows locally)."""
    shapes = jax.eval_shape(self._init_shapes)
    return jax.tree.map(lambda _: self._replicated, shapes)

  def init(self, key):
    spec, opt, o = self._spec, self._spec.optimizer, self._o
    target = load_init_table(o.init_path, spec) if o.init_path else None
    cores = init_cores(key, self._shape, target_variance(spec), o.init, target)
    state = {"cores": cores}
    if opt.needs_unique:
      state["accum"] = [opt.init_slots(s[0])["accum"] for s in self._shape.core_shapes()]
    if self._cache_rows:
      c = self._cache_rows
      state["cache"] = jnp.zeros((c, spec.dim), jnp.float32)
      # num_rows marks an empty slot; the first update that sees the hot set fills the cache.
      state["cache_ids"] = jnp.full((c,), spec.num_rows, jnp.int32)
      state.update({f"cache_{s}": v for s, v in opt.init_slots(c).items()})
    return state

  def memory(self) -> base.MemoryReport:
    slots = len(self._spec.optimizer.slot_names())
    b = 4 * self._shape.num_params + 4 * slots * sum(self._shape.row_factors)
    b += self._cache_rows * (4 * self._spec.dim + 4 * slots + 4)
    where = "device" + (f" + {self._cache_rows}-row cache" if self._cache_rows else "")
    return base.MemoryReport(b, 0, where)

  def table(self, state) -> np.ndarray:
    """The TT reconstruction overridden by the cache's rows: f32[N, D] (O(N): tests)."""
    rows = np.array(reconstruct(state["cores"], self._spec.num_rows))
    if self._cache_rows:
      ids = np.asarray(state["cache_ids"])
      ok = ids < self._spec.num_rows
      rows[ids[ok]] = np.asarray(state["cache"])[ok]
    return rows

  def logical_target(self):
    shapes = jax.eval_shape(self._init_shapes)
    return jax.tree.map(
      lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
      shapes,
      self.state_sharding(),
    )

  def hot_set(self, state) -> np.ndarray | None:
    """The cache's hot rows in a state (sorted), or None: none fixed yet (the warm-up
    restarts). The hot set lives in the state."""
    if not self._cache_rows:
      return None
    ids = np.asarray(state["cache_ids"])
    if (ids < self._spec.num_rows).any():
      return np.sort(ids[ids < self._spec.num_rows])
    return None
