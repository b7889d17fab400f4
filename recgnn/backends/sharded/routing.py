"""`sharded`'s input and output distribution inside shard_map: each device's ids routed to
the shards that own their rows (all-to-all of the table-wise ids, all-gather of the row- and
column-wise ones), the owners' local pooling into the forward message, and the received
segments assembled into pooled rows.

One concern: where each id goes and what comes back. `Routing` is an object the device step
(step.py) holds, over the frozen `Geometry`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from recgnn import sharding
from recgnn.backends.sharded.geometry import Geometry
from recgnn.embeddings import base, row_sharded


class Routing:
  """Ids to their owners, pooled segments back (see the module docstring)."""

  def __init__(self, geometry: Geometry):
    self._g = geometry

  def _route_tw(self, ids):
    """Local ids {t: i32[b, L]} -> i32[k * b, Tmax, Ltw]: the ids of this shard's table-wise
    slots for the MODEL group's examples (all-to-all over MODEL)."""
    ltw = max(ids[n].shape[1] for n in self._g.tw)
    b = ids[self._g.tw[0]].shape[0]
    empty = jnp.full((b, ltw), base.PAD, jnp.int32)
    padded = {
      n: jnp.pad(ids[n], ((0, 0), (0, ltw - ids[n].shape[1])), constant_values=base.PAD)
      for n in self._g.tw
    }
    send = jnp.stack(
      [
        jnp.stack([empty if n is None else padded[n] for n in slots], axis=1)
        for slots in self._g.owner_slots
      ]
    )  # [k, b, Tmax, Ltw]
    recv = jax.lax.all_to_all(send, sharding.MODEL, 0, 0)
    return recv.reshape(self._g.k * b, self._g.tmax, ltw)

  def _tw_local(self, routed):
    """Routed ids -> local row indices of this shard's table-wise array (R = dropped)."""
    off = np.zeros((self._g.k, self._g.tmax), np.int32)
    num = np.zeros((self._g.k, self._g.tmax), np.int32)
    for m, slots in enumerate(self._g.owner_slots):
      for s, n in enumerate(slots):
        if n is not None:
          off[m, s], num[m, s] = self._g.placement[n].offset, self._g.specs[n].num_rows
    me = jax.lax.axis_index(sharding.MODEL)
    o, nr = jnp.asarray(off)[me][None, :, None], jnp.asarray(num)[me][None, :, None]
    return jnp.where((routed >= 0) & (routed < nr), o + routed, self._g.rows_tw)

  def rw_local(self, n, ids):
    rows = base.aligned_rows(self._g.specs[n].num_rows) // self._g.k
    return row_sharded.local_index(ids, rows, sharding.MODEL, self._g.specs[n].num_rows)

  def cw_local(self, n, ids):
    num = self._g.specs[n].num_rows
    return jnp.where((ids >= 0) & (ids < num), ids, base.aligned_rows(num))

  def group_ids(self, ids, names, axes):
    """All-gather the ids of `names` over `axes`: {t: i32[b * |axes|, L]} (one collective)."""
    if not names:
      return {}
    flat = jnp.concatenate([ids[n] for n in names], axis=1)
    flat = jax.lax.all_gather(flat, axes, tiled=True)
    out, lo = {}, 0
    for n in names:
      w = ids[n].shape[1]
      out[n] = flat[:, lo : lo + w]
      lo += w
    return out

  def local_pool(self, state, ids):
    """The forward message this device sends: (segments [k (destination), b, width], the
    routing the update reuses: {"tw": local rows of the routed table-wise ids i32[k * b,
    Tmax, Ltw], "ids": the MODEL group's ids of the row- / column-wise tables {t: i32[k * b,
    L]}})."""
    b = next(iter(ids.values())).shape[0]
    segs, routed = [], {}
    if self._g.tw:
      loc = self._tw_local(self._route_tw(ids))
      routed["tw"] = loc
      rows = state["tw"]["rows"][0].at[loc].get(mode="fill", fill_value=0.0)
      pooled = jnp.sum(rows, axis=2)  # [k * b, Tmax, D]
      segs += [pooled[:, s].reshape(self._g.k, b, self._g.dim_tw) for s in range(self._g.tmax)]
    gathered = self.group_ids(ids, self._g.rw + self._g.cw, sharding.MODEL)
    routed["ids"] = gathered
    for n in self._g.rw:
      rows = (
        state["rw"][n]["rows"].at[self.rw_local(n, gathered[n])].get(mode="fill", fill_value=0.0)
      )
      segs.append(jnp.sum(rows, axis=1).reshape(self._g.k, b, -1))
    for n in self._g.cw:
      rows = (
        state["cw"][n]["rows"].at[self.cw_local(n, gathered[n])].get(mode="fill", fill_value=0.0)
      )
      segs.append(jnp.sum(rows, axis=1).reshape(self._g.k, b, -1))
    return segs, routed

  def assemble(self, recv, count):
    """Received forward segments [k (source), b, w] -> {t: f32[b, D]} pooled."""
    out = {}
    for n in self._g.tw:
      p = self._g.placement[n]
      out[n] = recv[p.slot][p.shard]
    for i, n in enumerate(self._g.rw):
      out[n] = jnp.sum(recv[self._g.tmax + i], axis=0)
    for i, n in enumerate(self._g.cw):
      r = recv[self._g.tmax + len(self._g.rw) + i]  # [k, b, D / k]
      out[n] = jnp.transpose(r, (1, 0, 2)).reshape(r.shape[1], -1)
    for n, c in count.items():
      out[n] = out[n] / jnp.maximum(c, 1).astype(jnp.float32)[:, None]
    return out
