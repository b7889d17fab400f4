"""`sharded`'s step: the lookup (each device's ids routed to their owners, pooled there, the
forward all-to-all through the codec) and the update (the pooled gradients' way back to the
shards that own the rows, the backward all-to-all, then the shared sparse row update,
`row_sharded.update`: SGD or row-wise Adagrad, on every replica of a shard).

One concern: what runs inside the step. `DeviceStep` is an object the `Sharded` front holds
(recgnn/backends/sharded/backend.py), composed of the routing (`Routing`: where each id goes
and what comes back) and the exchange (`Exchange`: the all-to-all through a codec).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from recgnn import sharding
from recgnn.backends.sharded.exchange import Exchange
from recgnn.backends.sharded.geometry import Geometry
from recgnn.backends.sharded.routing import Routing
from recgnn.backends.sharded.state import state_sharding
from recgnn.backends.sharded.wire import Wire
from recgnn.embeddings import base, row_sharded

P = sharding.P


class DeviceStep:
  """lookup and update inside shard_map (see the module docstring)."""

  def __init__(self, geometry: Geometry, wire: Wire):
    self._g, self._wire = geometry, wire
    self.mesh = geometry.mesh
    self.routing = Routing(geometry)
    self.exchange = Exchange(geometry, wire)

  def _specs_in(self):
    """shard_map in_specs of the state (MODEL-split storage, replicated codec state)."""
    return jax.tree.map(
      lambda s: s.spec,
      state_sharding(self._g, self._wire),
      is_leaf=lambda x: isinstance(x, jax.sharding.Sharding),
    )

  def lookup(self, state, prepared):
    """-> (pooled, residuals). Residuals: this device's routing (`Routing.local_pool`), split
    with the batch, and with an adaptive forward codec the forward message's statistics
    {"max": f32[T], "fell": bool[segments]} (global), so `update` neither routes the ids
    again nor recomputes the forward pooling."""
    ids, count = prepared["ids"], prepared["count"]
    bounds_on = "fwd" in state["codec"]
    res_spec = {"routed": P(sharding.BATCH), **({"fwd": P()} if bounds_on else {})}
    route, ex, codec = self.routing, self.exchange, self._wire.codecs["fwd"]

    @functools.partial(
      jax.shard_map,
      mesh=self.mesh,
      in_specs=(self._specs_in(), {"ids": P(sharding.BATCH), "count": P(sharding.BATCH)}),
      out_specs=(P(sharding.BATCH), res_spec),
      check_vma=False,
    )
    def local(state, prepared):
      ids, count = prepared["ids"], prepared["count"]
      segs, routed = route.local_pool(state, ids)
      bounds = ex.direction_bounds(state["codec"], "fwd", segs, True)
      recv, fell = ex.exchange(
        codec,
        segs,
        ex.seg_bounds(bounds, sender=True, owner_is_sender=True),
        ex.seg_bounds(bounds, sender=False, owner_is_sender=True),
      )
      res = {"routed": routed}
      if bounds_on:
        t = len(self._g.specs)
        res["fwd"] = {"max": ex.wire_max(segs, True), "fell": fell, "bound": bounds[:t]}
      return route.assemble(recv, count), res

    return local(state, {"ids": ids, "count": count})

  def update(self, state, prepared, residuals, grads):
    """grads {table: f32[B, D]} (batch-split) -> the new state: the gradients to the shards
    that own their tables' rows through the backward codec, the codecs' next bound state,
    and every replica's row update at the ids the lookup routed (`residuals["routed"]`)."""
    geo, ex, wire = self._g, self.exchange, self._wire
    res_spec = {"routed": P(sharding.BATCH), **({"fwd": P()} if "fwd" in residuals else {})}

    @functools.partial(
      jax.shard_map,
      mesh=self.mesh,
      in_specs=(
        self._specs_in(),
        {"count": P(sharding.BATCH)},
        res_spec,
        P(sharding.BATCH),
      ),
      out_specs=self._specs_in(),
      check_vma=False,
    )
    def local(state, prepared, residuals, grads):
      g = self._mean_grads(grads, prepared["count"])
      segs = self._bwd_segments(g)
      bounds = ex.direction_bounds(state["codec"], "bwd", segs, False)
      recv, fell_b = ex.exchange(
        wire.codecs["bwd"],
        segs,
        ex.seg_bounds(bounds, sender=True, owner_is_sender=False),
        ex.seg_bounds(bounds, sender=False, owner_is_sender=False),
      )
      new = {"codec": self._next_codec_state(state["codec"], residuals, segs, fell_b, bounds)}
      # Every example of the batch, in batch order: over DATA after the all-to-all.
      every = lambda x: jax.lax.all_gather(x, sharding.DATA, tiled=True)  # noqa: E731
      b = g[next(iter(geo.specs))].shape[0]
      recv = [every(r.reshape(geo.k * b, -1)) for r in recv]
      routed = residuals["routed"]
      if geo.tw:
        new["tw"] = self._update_tw(state["tw"], every(routed["tw"]), recv[: geo.tmax])
      new["rw"], new["cw"] = self._update_split(state, routed["ids"], recv[geo.tmax :])
      return new

    return local(state, {"count": prepared["count"]}, residuals, grads)

  def _mean_grads(self, grads, count):
    """{table: f32[b, D]} -> the same, a bag's gradient divided by its ids (mean pooling:
    the tables in `count`)."""
    return {
      n: grads[n] / jnp.maximum(count[n], 1).astype(jnp.float32)[:, None]
      if n in count
      else grads[n]
      for n in self._g.specs
    }

  def _bwd_segments(self, g) -> list:
    """The backward message: segments [k (destination), b, w], table-wise slots first, then
    the row-wise tables (every shard gets the whole gradient), then the column-wise ones
    (each shard its column block)."""
    geo = self._g
    b = g[next(iter(geo.specs))].shape[0]
    segs = []
    zero = jnp.zeros((b, geo.dim_tw), jnp.float32)
    for s in range(geo.tmax):
      segs.append(jnp.stack([zero if sl[s] is None else g[sl[s]] for sl in geo.owner_slots]))
    for n in geo.rw:
      segs.append(jnp.broadcast_to(g[n], (geo.k, *g[n].shape)))
    for n in geo.cw:
      segs.append(jnp.transpose(g[n].reshape(b, geo.k, -1), (1, 0, 2)))
    return segs

  def _next_codec_state(self, codec_state, residuals, segs, fell_b, bounds):
    """The codecs' next bound state: the backward rule's from this message, the forward
    rule's from the statistics and fallbacks the lookup measured (`residuals["fwd"]`)."""
    wire, new = self._wire, codec_state
    if "bwd" in codec_state:
      new = dict(new)
      new["bwd"] = wire.rules["bwd"].next(
        codec_state["bwd"],
        self.exchange.wire_max(segs, False),
        fell_b,
        wire.codecs["bwd"].dims,
        used=bounds[: len(self._g.specs)],
        bits=wire.codecs["bwd"].bits_per_value(),
      )
    if "fwd" in codec_state:
      fwd = residuals["fwd"]
      new = dict(new)
      new["fwd"] = wire.rules["fwd"].next(
        codec_state["fwd"],
        fwd["max"],
        fwd["fell"],
        wire.codecs["fwd"].dims,
        used=fwd["bound"],
        bits=wire.codecs["fwd"].bits_per_value(),
      )
    return new

  def _update_tw(self, state, loc, recv):
    """The table-wise tables' update: loc i32[B, Tmax, Ltw] (the routed ids, whole batch),
    recv: Tmax gradients f32[B, D], each slot's one per example."""
    geo = self._g
    gtw = jnp.stack(recv, axis=1)  # [B, Tmax, D]
    bsz, _, ltw = loc.shape
    grows = jnp.broadcast_to(gtw[:, :, None, :], (bsz, geo.tmax, ltw, geo.dim_tw))
    return self._apply(
      state,
      loc.reshape(bsz, -1),
      grows.reshape(bsz, -1, geo.dim_tw),
      geo.rows_tw,
      squeeze=True,
    )

  def _update_split(self, state, routed_ids, recv):
    """The row-wise and column-wise tables' updates ({table: state} each) at the lookup's
    MODEL-group ids gathered over DATA (the whole batch's, in batch order); recv: their
    gradients f32[B, w], row-wise tables first."""
    geo, route = self._g, self.routing
    gathered = route.group_ids(routed_ids, geo.rw + geo.cw, sharding.DATA)
    rw, cw = {}, {}
    for i, n in enumerate(geo.rw):
      loc = route.rw_local(n, gathered[n])
      rows = base.aligned_rows(geo.specs[n].num_rows) // geo.k
      gr = jnp.broadcast_to(recv[i][:, None, :], (*loc.shape, geo.specs[n].dim))
      rw[n] = self._apply(state["rw"][n], loc, gr, rows)
    for i, n in enumerate(geo.cw):
      loc = route.cw_local(n, gathered[n])
      r = recv[len(geo.rw) + i]
      gr = jnp.broadcast_to(r[:, None, :], (*loc.shape, r.shape[-1]))
      cw[n] = self._apply(
        state["cw"][n],
        loc,
        gr,
        base.aligned_rows(geo.specs[n].num_rows),
        columns=geo.specs[n].dim,
      )
    return rw, cw

  def _apply(self, state, loc, grads, num_rows, *, squeeze=False, columns=0):
    """Row-wise optimizer on local rows. loc: i32[B, X] (num_rows = dropped); grads
    f32[B, X, w]. squeeze: the storage has a leading shard axis of 1. columns: the table's
    full dim when the storage holds a column block (Adagrad's mean is over every column)."""
    if squeeze:
      state = jax.tree.map(lambda x: x[0], state)
    assert state["rows"].shape[0] == num_rows  # the dedup's filler: past the local rows
    slots = {k: state[k] for k in self._g.slots()}
    mean_square = None
    if columns:
      # Row-wise Adagrad's mean is over the whole row: its columns live on every MODEL shard.
      def mean_square(g):
        return jax.lax.psum(jnp.sum(g * g, axis=-1), sharding.MODEL) / columns

    # The shared row update (the group's tables share one optimizer); no host dedup: the
    # routed ids are deduped on device.
    spec = next(iter(self._g.specs.values()))
    rows, slots = row_sharded.update(
      spec, state["rows"], slots, {"ids": loc}, grads, mean_square=mean_square
    )
    out = {"rows": rows, **slots}
    if squeeze:
      out = jax.tree.map(lambda x: x[None], out)
    return out
