"""sharded's state: its shardings, init, the tables (tests), checkpoints (export / import_).

One concern: the state's life outside the step. {"tw": {"rows": f32[k, R, D], slots: f32[k,
R]} (split over MODEL; shard m holds its tables one after another), "rw": {t: {"rows": f32[S,
D] P(MODEL), slots}}, "cw": {t: {"rows": f32[S, D] P(None, MODEL), slots replicated}},
"codec": {"fwd"|"bwd": BoundRule state}}. `StateKeeper` is an object the `Sharded` front
holds (recgnn/backends/sharded/backend.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from recgnn import sharding
from recgnn.backends.sharded.geometry import Geometry
from recgnn.backends.sharded.wire import Wire
from recgnn.embeddings import base

P = sharding.P


def state_sharding(g: Geometry, wire: Wire) -> dict:
  """The state's NamedShardings: the storage's (`Geometry.storage_sharding`) and the codecs'
  state, replicated."""
  return {**g.storage_sharding(), "codec": wire.state_sharding()}


class StateKeeper:
  """init, tables, logical_target / export / import_ (one jitted program each, built once)."""

  def __init__(self, geometry: Geometry, wire: Wire):
    self._g, self._wire = geometry, wire
    self._jitted = {}

  def state_sharding(self) -> dict:
    return state_sharding(self._g, self._wire)

  def init(self, key):
    init = {n: base.init_table(base.table_key(key, n), s) for n, s in self._g.specs.items()}
    return self._from_rows(init, None)

  def _from_rows(self, rows: dict[str, np.ndarray], slots: dict[str, dict[str, np.ndarray]] | None):
    """Host arrays of the state from each table's rows f32[N, D] (and slots f32[N])."""
    g = self._g
    opt = g.optimizer
    state = {}
    if g.tw:
      tw = np.zeros((g.k, g.rows_tw, g.dim_tw), np.float32)
      tws = {s: np.full((g.k, g.rows_tw), opt.initial_accumulator, np.float32) for s in g.slots()}
      for n in g.tw:
        p, num = g.placement[n], g.specs[n].num_rows
        tw[p.shard, p.offset : p.offset + num] = rows[n][:num]
        for s in g.slots():
          if slots is not None:
            tws[s][p.shard, p.offset : p.offset + num] = slots[n][s][:num]
      state["tw"] = {"rows": tw, **tws}
    for kind, names in (("rw", g.rw), ("cw", g.cw)):
      state[kind] = {}
      for n in names:
        spec = g.specs[n]
        a = base.aligned_rows(spec.num_rows)
        r = np.zeros((a, spec.dim), np.float32)
        r[: spec.num_rows] = rows[n][: spec.num_rows]
        sl = {}
        for s in g.slots():
          sl[s] = np.full(a, opt.initial_accumulator, np.float32)
          if slots is not None:
            sl[s][: spec.num_rows] = slots[n][s][: spec.num_rows]
        state[kind][n] = {"rows": r, **sl}
    state["codec"] = jax.device_get(self._wire.init_state())
    return sharding.put(state, self.state_sharding())

  def tables(self, state):
    host = jax.device_get({k: v for k, v in state.items() if k != "codec"})
    out = {}
    for n, p in self._g.placement.items():
      num = self._g.specs[n].num_rows
      if p.kind == "table":
        out[n] = np.asarray(host["tw"]["rows"][p.shard, p.offset : p.offset + num])
      else:
        out[n] = np.asarray(host["rw" if p.kind == "row" else "cw"][n]["rows"][:num])
    return out

  def logical_target(self):
    rows = sharding.named(self._g.mesh, P(sharding.MODEL, None))
    vec = sharding.named(self._g.mesh, P(sharding.MODEL))
    out = {}
    for n, s in self._g.specs.items():
      a = base.aligned_rows(s.num_rows)
      out[n] = {"rows": jax.ShapeDtypeStruct((a, s.dim), jnp.float32, sharding=rows)}
      out[n].update(
        {k: jax.ShapeDtypeStruct((a,), jnp.float32, sharding=vec) for k in self._g.slots()}
      )
    return out

  def export(self, state):
    g = self._g
    if "export" not in self._jitted:
      target = jax.tree.map(lambda x: x.sharding, self.logical_target())

      def fn(state):
        out = {}
        for n, p in g.placement.items():
          a, num = base.aligned_rows(g.specs[n].num_rows), g.specs[n].num_rows
          if p.kind == "table":
            src = state["tw"]
            out[n] = {
              k: jnp.pad(
                v[p.shard, p.offset : p.offset + num], [(0, a - num)] + [(0, 0)] * (v.ndim - 2)
              )
              for k, v in src.items()
            }
          else:
            out[n] = dict(state["rw" if p.kind == "row" else "cw"][n])
        return out

      self._jitted["export"] = jax.jit(fn, out_shardings=target)
    return self._jitted["export"](state)

  def import_(self, logical):
    g = self._g
    if "import" not in self._jitted:

      def fn(logical):
        state = {}
        if g.tw:
          tw = {"rows": jnp.zeros((g.k, g.rows_tw, g.dim_tw), jnp.float32)}
          tw.update(
            {s: jnp.full((g.k, g.rows_tw), g.optimizer.initial_accumulator) for s in g.slots()}
          )
          for n in g.tw:
            p, num = g.placement[n], g.specs[n].num_rows
            for k in tw:
              tw[k] = tw[k].at[p.shard, p.offset : p.offset + num].set(logical[n][k][:num])
          state["tw"] = tw
        state["rw"] = {n: dict(logical[n]) for n in g.rw}
        state["cw"] = {n: dict(logical[n]) for n in g.cw}
        state["codec"] = self._wire.init_state()
        return state

      self._jitted["import"] = jax.jit(fn, out_shardings=self.state_sharding())
    return self._jitted["import"](logical)
