"""`sharded`'s update: the pooled gradients' way back to the shards that own the rows (the
backward all-to-all), then the shared sparse row update (`row_sharded.update`: SGD or
row-wise Adagrad) on every replica of a shard.

One concern: the backward half of the step. `Update` is one part of the `Sharded` class
(recgnn/backends/sharded/__init__.py), using its routing (`Routing`) and exchange
(`CodecExchange`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from recgnn import sharding
from recgnn.embeddings import base, row_sharded

P = sharding.P


class Update:
  """The backward all-to-all and the row update (see the module docstring)."""

  def update(self, state, prepared, residuals, grads):
    """grads {table: f32[B, D]} (batch-split) -> the new state: the gradients to the shards
    that own their tables' rows through the backward codec, the codecs' next bound state,
    and every replica's row update at the ids the lookup routed (`residuals["routed"]`)."""
    names = list(self.specs)
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
      count = prepared["count"]
      routed = residuals["routed"]
      g = {
        n: grads[n] / jnp.maximum(count[n], 1).astype(jnp.float32)[:, None]
        if n in count
        else grads[n]
        for n in names
      }
      b = g[names[0]].shape[0]
      # The backward message: segments [k (destination), b, w].
      segs = []
      zero = jnp.zeros((b, self.dim_tw), jnp.float32)
      for s in range(self.tmax):
        segs.append(jnp.stack([zero if sl[s] is None else g[sl[s]] for sl in self.owner_slots]))
      for n in self.rw:
        segs.append(jnp.broadcast_to(g[n], (self.k, *g[n].shape)))
      for n in self.cw:
        segs.append(jnp.transpose(g[n].reshape(b, self.k, -1), (1, 0, 2)))
      codec_state = state["codec"]
      bounds = self._direction_bounds(codec_state, "bwd", segs, False)
      recv, fell_b = self._exchange(
        self.codecs["bwd"],
        segs,
        self._seg_bounds(bounds, sender=True, owner_is_sender=False),
        self._seg_bounds(bounds, sender=False, owner_is_sender=False),
      )
      new = {"codec": codec_state}
      if "bwd" in codec_state:
        new["codec"] = dict(new["codec"])
        new["codec"]["bwd"] = self.rules["bwd"].next(
          codec_state["bwd"],
          self._wire_max(segs, False),
          fell_b,
          self.codecs["bwd"].dims,
          used=bounds[: len(names)],
          bits=self.codecs["bwd"].bits_per_value(),
        )
      if "fwd" in codec_state:
        # The forward message's statistics and fallbacks, as the lookup measured them.
        fwd = residuals["fwd"]
        new["codec"] = dict(new["codec"])
        new["codec"]["fwd"] = self.rules["fwd"].next(
          codec_state["fwd"],
          fwd["max"],
          fwd["fell"],
          self.codecs["fwd"].dims,
          used=fwd["bound"],
          bits=self.codecs["fwd"].bits_per_value(),
        )
      # Every example of the batch, in batch order: over DATA after the all-to-all.
      every = lambda x: jax.lax.all_gather(x, sharding.DATA, tiled=True)  # noqa: E731
      recv = [every(r.reshape(self.k * b, -1)) for r in recv]
      if self.tw:
        loc = every(routed["tw"])  # [B, Tmax, Ltw]
        gtw = jnp.stack(recv[: self.tmax], axis=1)  # [B, Tmax, D]
        bsz, _, ltw = loc.shape
        grows = jnp.broadcast_to(gtw[:, :, None, :], (bsz, self.tmax, ltw, self.dim_tw))
        new["tw"] = self._apply(
          state["tw"],
          loc.reshape(bsz, -1),
          grows.reshape(bsz, -1, self.dim_tw),
          self.rows_tw,
          squeeze=True,
        )
      # The lookup's MODEL-group ids gathered over DATA: the whole batch's, in batch order.
      gathered = self._group_ids(routed["ids"], self.rw + self.cw, sharding.DATA)
      new["rw"], new["cw"] = {}, {}
      for i, n in enumerate(self.rw):
        loc = self._rw_local(n, gathered[n])
        rows = base.aligned_rows(self.specs[n].num_rows) // self.k
        gr = jnp.broadcast_to(recv[self.tmax + i][:, None, :], (*loc.shape, self.specs[n].dim))
        new["rw"][n] = self._apply(state["rw"][n], loc, gr, rows)
      for i, n in enumerate(self.cw):
        loc = self._cw_local(n, gathered[n])
        r = recv[self.tmax + len(self.rw) + i]
        gr = jnp.broadcast_to(r[:, None, :], (*loc.shape, r.shape[-1]))
        new["cw"][n] = self._apply(
          state["cw"][n],
          loc,
          gr,
          base.aligned_rows(self.specs[n].num_rows),
          columns=self.specs[n].dim,
        )
      return new

    return local(state, {"count": prepared["count"]}, residuals, grads)

  def _apply(self, state, loc, grads, num_rows, *, squeeze=False, columns=0):
    """Row-wise optimizer on local rows. loc: i32[B, X] (num_rows = dropped); grads
    f32[B, X, w]. squeeze: the storage has a leading shard axis of 1. columns: the table's
    full dim when the storage holds a column block (Adagrad's mean is over every column)."""
    if squeeze:
      state = jax.tree.map(lambda x: x[0], state)
    assert state["rows"].shape[0] == num_rows  # the dedup's filler: past the local rows
    slots = {k: state[k] for k in self._slots()}
    mean_square = None
    if columns:
      # Row-wise Adagrad's mean is over the whole row: its columns live on every MODEL shard.
      def mean_square(g):
        return jax.lax.psum(jnp.sum(g * g, axis=-1), sharding.MODEL) / columns

    # The shared row update (the group's tables share one optimizer); no host dedup: the
    # routed ids are deduped on device.
    spec = next(iter(self.specs.values()))
    rows, slots = row_sharded.update(
      spec, state["rows"], slots, {"ids": loc}, grads, mean_square=mean_square
    )
    out = {"rows": rows, **slots}
    if squeeze:
      out = jax.tree.map(lambda x: x[None], out)
    return out
