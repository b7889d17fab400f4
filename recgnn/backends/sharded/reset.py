"""`sharded`'s row reset inside the step (the `RowReset` protocol: what a dynamic table asks of
its inner backend to reuse an evicted row): given global rows of some tables set to given
values, their optimizer slots to the optimizer's initial value, on the devices that store
them, in the storage's own layout.

One concern: rows put back in place. Each device writes only what it holds, found with the
routing's own global -> local index (`Routing.rw_local`, `cw_local`), so a reset goes
wherever a lookup of the same row would read:

  table-wise   row r of table t: shard `placement.shard`, row `placement.offset + r` of its
               [k, R, D] array (the other shards drop it).
  row-wise     row r: shard r // (S / k), its local row r % (S / k) (S: the aligned rows).
  column-wise  row r on every shard, each its column block of the new values; the slots,
               replicated, set on every shard.

The slots of one table's resets are distinct (a batch reuses a row once), and tables of one
table-wise shard sit at disjoint offsets, so each scatter writes distinct rows; the others
(padding, rows another shard owns) fall past the local array and are dropped. O(R * D) per
device, with no collective: the resets are replicated, every DATA replica applies the same.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from recgnn import sharding
from recgnn.backends.sharded.geometry import Geometry
from recgnn.backends.sharded.routing import Routing
from recgnn.backends.sharded.state import state_sharding
from recgnn.backends.sharded.wire import Wire

P = sharding.P


class Reset:
  """`reset_rows` in shard_map over the storage (see the module docstring)."""

  def __init__(self, geometry: Geometry, wire: Wire):
    self._g, self._wire = geometry, wire
    self._routing = Routing(geometry)

  def reset_rows(self, state, resets):
    """resets {table: {"slots": int32[R] (global rows; out of range: none), "rows": f32[R,
    D]}}, replicated, for some of the group's tables -> the state with those rows set and
    their optimizer slots at the initial value; everything else (other rows, the codecs'
    state) as it was."""
    specs = jax.tree.map(
      lambda s: s.spec,
      state_sharding(self._g, self._wire),
      is_leaf=lambda x: isinstance(x, jax.sharding.Sharding),
    )
    resets = {n: resets[n] for n in self._g.specs if n in resets}
    reset_specs = jax.tree.map(lambda _: P(), resets)

    @functools.partial(
      jax.shard_map,
      mesh=self._g.mesh,
      in_specs=(specs, reset_specs),
      out_specs=specs,
      check_vma=False,
    )
    def local(state, resets):
      out = dict(state)
      if any(n in resets for n in self._g.tw):
        out["tw"] = self._reset_tw(state["tw"], resets)
      out["rw"] = {
        n: self._set(s, self._routing.rw_local(n, resets[n]["slots"]), resets[n]["rows"])
        if n in resets
        else s
        for n, s in state["rw"].items()
      }
      out["cw"] = {
        n: self._reset_cw(n, s, resets[n]) if n in resets else s for n, s in state["cw"].items()
      }
      return out

    return local(state, resets)

  def _set(self, store, loc, rows):
    """store {"rows": f32[S, w], slots: f32[S]} (this device's), loc int32[R] (S: none) ->
    the rows at loc set to `rows` f32[R, w], their slots to the initial value."""
    init = self._g.optimizer.initial_accumulator
    out = {"rows": store["rows"].at[loc].set(rows, mode="drop")}
    for s in self._g.slots():
      out[s] = store[s].at[loc].set(init, mode="drop")
    return out

  def _reset_tw(self, store, resets):
    """The table-wise array's resets: every table this group resets, each at its offset on
    its owner (one scatter; the other shards' and the padding's slots dropped)."""
    g = self._g
    me = jax.lax.axis_index(sharding.MODEL)
    locs, rows = [], []
    for n in g.tw:
      if n in resets:
        p, slots = g.placement[n], resets[n]["slots"]
        owned = (me == p.shard) & (slots >= 0) & (slots < g.specs[n].num_rows)
        locs.append(jnp.where(owned, p.offset + slots, g.rows_tw))
        rows.append(resets[n]["rows"])
    local = jax.tree.map(lambda x: x[0], store)  # (the shard axis, 1 here)
    out = self._set(local, jnp.concatenate(locs), jnp.concatenate(rows))
    return jax.tree.map(lambda x: x[None], out)

  def _reset_cw(self, n, store, reset):
    """A column-wise table's resets: this shard's column block of the new rows; its slots
    (replicated) set on every shard alike."""
    w = self._g.specs[n].dim // self._g.k
    me = jax.lax.axis_index(sharding.MODEL)
    block = jax.lax.dynamic_slice_in_dim(reset["rows"], me * w, w, axis=1)
    return self._set(store, self._routing.cw_local(n, reset["slots"]), block)
