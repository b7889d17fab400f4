"""`sharded`'s input and output distribution inside shard_map: each device's ids routed to
the shards that own their rows (all-to-all of the table-wise ids, all-gather of the row- and
column-wise ones), the owners' local pooling into the forward message, and the received
segments assembled into pooled rows.

One concern: where each id goes and what comes back. `Routing` is one part of the `Sharded`
class (recgnn/backends/sharded/__init__.py): it reads the layout Sharded's constructor
computes (`k`, `tw` / `rw` / `cw`, `placement`, `owner_slots`, `tmax`, `rows_tw`, `dim_tw`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from recgnn import sharding
from recgnn.embeddings import base, row_sharded


class Routing:
  """Ids to their owners, pooled segments back (see the module docstring)."""

  def _route_tw(self, ids):
    """Local ids {t: i32[b, L]} -> i32[k * b, Tmax, Ltw]: the ids of this shard's table-wise
    slots for the MODEL group's examples (all-to-all over MODEL)."""
    ltw = max(ids[n].shape[1] for n in self.tw)
    b = ids[self.tw[0]].shape[0]
    empty = jnp.full((b, ltw), base.PAD, jnp.int32)
    padded = {
      n: jnp.pad(ids[n], ((0, 0), (0, ltw - ids[n].shape[1])), constant_values=base.PAD)
      for n in self.tw
    }
    send = jnp.stack(
      [
        jnp.stack([empty if n is None else padded[n] for n in slots], axis=1)
        for slots in self.owner_slots
      ]
    )  # [k, b, Tmax, Ltw]
    recv = jax.lax.all_to_all(send, sharding.MODEL, 0, 0)
    return recv.reshape(self.k * b, self.tmax, ltw)

  def _tw_local(self, routed):
    """Routed ids -> local row indices of this shard's table-wise array (R = dropped)."""
    off = np.zeros((self.k, self.tmax), np.int32)
    num = np.zeros((self.k, self.tmax), np.int32)
    for m, slots in enumerate(self.owner_slots):
      for s, n in enumerate(slots):
        if n is not None:
          off[m, s], num[m, s] = self.placement[n].offset, self.specs[n].num_rows
    me = jax.lax.axis_index(sharding.MODEL)
    o, nr = jnp.asarray(off)[me][None, :, None], jnp.asarray(num)[me][None, :, None]
    return jnp.where((routed >= 0) & (routed < nr), o + routed, self.rows_tw)

  def _rw_local(self, n, ids):
    rows = base.aligned_rows(self.specs[n].num_rows) // self.k
    return row_sharded.local_index(ids, rows, sharding.MODEL, self.specs[n].num_rows)

  def _cw_local(self, n, ids):
    num = self.specs[n].num_rows
    return jnp.where((ids >= 0) & (ids < num), ids, base.aligned_rows(num))

  def _group_ids(self, ids, names, axes):
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

  def _local_pool(self, state, ids):
    """The forward message this device sends: (segments [k (destination), b, width], the
    routing the update reuses: {"tw": local rows of the routed table-wise ids i32[k * b,
    Tmax, Ltw], "ids": the MODEL group's ids of the row- / column-wise tables {t: i32[k * b,
    L]}})."""
    b = next(iter(ids.values())).shape[0]
    segs, routed = [], {}
    if self.tw:
      loc = self._tw_local(self._route_tw(ids))
      routed["tw"] = loc
      rows = state["tw"]["rows"][0].at[loc].get(mode="fill", fill_value=0.0)
      pooled = jnp.sum(rows, axis=2)  # [k * b, Tmax, D]
      segs += [pooled[:, s].reshape(self.k, b, self.dim_tw) for s in range(self.tmax)]
    gathered = self._group_ids(ids, self.rw + self.cw, sharding.MODEL)
    routed["ids"] = gathered
    for n in self.rw:
      rows = (
        state["rw"][n]["rows"].at[self._rw_local(n, gathered[n])].get(mode="fill", fill_value=0.0)
      )
      segs.append(jnp.sum(rows, axis=1).reshape(self.k, b, -1))
    for n in self.cw:
      rows = (
        state["cw"][n]["rows"].at[self._cw_local(n, gathered[n])].get(mode="fill", fill_value=0.0)
      )
      segs.append(jnp.sum(rows, axis=1).reshape(self.k, b, -1))
    return segs, routed

  def _assemble(self, recv, count):
    """Received forward segments [k (source), b, w] -> {t: f32[b, D]} pooled."""
    out = {}
    for n in self.tw:
      p = self.placement[n]
      out[n] = recv[p.slot][p.shard]
    for i, n in enumerate(self.rw):
      out[n] = jnp.sum(recv[self.tmax + i], axis=0)
    for i, n in enumerate(self.cw):
      r = recv[self.tmax + len(self.rw) + i]  # [k, b, D / k]
      out[n] = jnp.transpose(r, (1, 0, 2)).reshape(r.shape[1], -1)
    for n, c in count.items():
      out[n] = out[n] / jnp.maximum(c, 1).astype(jnp.float32)[:, None]
    return out
