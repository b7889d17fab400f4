"""`sharded`'s all-to-all of a fused message through a codec, with the f32 fallback of the
segments an error-bounded codec cannot carry within their bound, and the per-table bounds
(`codecs.BoundRule`) it is sent under.

One concern: moving a message over MODEL, lossy or not. `Exchange` is an object the device
step (step.py) holds, over the frozen `Geometry` and the codecs' `Wire`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from recgnn import sharding
from recgnn.backends.sharded.geometry import Geometry
from recgnn.backends.sharded.wire import Wire
from recgnn.embeddings import codecs

FALLBACK_SCOPE = "codec_fallback"  # named scope of the f32 fallback all-to-all (comms.py)


class Exchange:
  """The message's all-to-all, codecs and fallbacks (see the module docstring)."""

  def __init__(self, geometry: Geometry, wire: Wire):
    self._g, self._wire = geometry, wire

  def _bounds(self, codec_state, direction):
    """f32[T + 1] error bounds (the last one for empty slots), or None."""
    if direction not in codec_state:
      return None
    return jnp.concatenate([codec_state[direction]["bound"], jnp.ones((1,), jnp.float32)])

  def exchange(self, codec, segs, send_bounds, recv_bounds):
    """All-to-all over MODEL of a message of segments [k, b, w] through `codec`, with the f32
    fallback of the segments it cannot carry within their bound. -> (segments [k (source),
    b, w], bool[nseg]: the segments sent as f32)."""

    def raw(segs, scope):
      with jax.named_scope(scope):
        x = jnp.concatenate(segs, axis=-1)
        return codec.split(jax.lax.all_to_all(x, sharding.MODEL, 0, 0))

    def coded(segs):
      payload, _ = codec.encode(segs, send_bounds)  # values it cannot carry: resent below
      payload = {k: _all_to_all_bits(v) for k, v in payload.items()}
      return codec.decode(payload, recv_bounds)

    nseg = len(codec.dims)
    if codec.name == "none":
      return raw(segs, "embedding_all_to_all"), jnp.zeros((nseg,), bool)
    recv = coded(segs)
    if not codec.needs_bound:
      return recv, jnp.zeros((nseg,), bool)
    # A segment (one table-wise slot, row- or column-wise table) that some device cannot
    # carry within its bound goes again as f32, that segment only: every device takes the
    # same branch (the flags are summed over the mesh).
    bad = jax.lax.psum(
      (~codec.segments_ok(segs, send_bounds)).astype(jnp.int32), (sharding.DATA, sharding.MODEL)
    )

    def resend(s, r):
      with jax.named_scope(FALLBACK_SCOPE):
        return jax.lax.all_to_all(s, sharding.MODEL, 0, 0)

    out = [jax.lax.cond(bad[i] > 0, resend, lambda s, r: r, segs[i], recv[i]) for i in range(nseg)]
    return out, bad > 0

  def _bounds_now(self, direction, segs, forward: bool, codec_state):
    """f32[T + 1] bounds from this message's statistics per table: its largest |value|
    (mode "current", filling each table's codes) or its RMS (mode "rms", the schedule's
    rel at this iteration)."""
    rule = self._wire.rules[direction]
    if rule.mode == "rms":
      b = rule.from_rms(self._wire_rms(segs, forward), codec_state[direction]["steps"])
    else:
      b = rule.from_max(self.wire_max(segs, forward), self._table_qmax(direction))
    return jnp.concatenate([b, jnp.ones((1,), jnp.float32)])

  def direction_bounds(self, codec_state, direction, segs, forward: bool):
    """f32[T + 1] the bounds a direction's message is sent under this step, or None."""
    if direction not in codec_state:
      return None
    if self._wire.rules[direction].uses_current:
      return self._bounds_now(direction, segs, forward, codec_state)
    return self._bounds(codec_state, direction)

  def _table_qmax(self, direction) -> np.ndarray | int:
    """Each table's largest code (its segment's width), or int8's 127 without widths."""
    widths = self._wire.codecs[direction].widths
    if not widths:
      return codecs.QMAX
    return np.asarray([codecs.qmax_of(widths[s]) for s in self._g.table_segment()], np.float32)

  def _wire_rms(self, segs, forward: bool):
    """f32[T]: the RMS of each table's values on the wire this step (over the mesh)."""
    t = len(self._g.specs)
    idx = jnp.asarray(self._g.segment_tables())
    if forward:
      seg_idx = idx[jax.lax.axis_index(sharding.MODEL)]
      sq = jnp.stack([jnp.sum(jnp.square(s)) for s in segs])
      n = jnp.asarray([float(s.size) for s in segs], jnp.float32)
    else:  # backward: segment s sent to peer j belongs to peer j's table
      seg_idx = idx.T.reshape(-1)
      sq = jnp.stack([jnp.sum(jnp.square(s), axis=(1, 2)) for s in segs]).reshape(-1)
      n = jnp.asarray([float(s[0].size) for s in segs for _ in range(self._g.k)], jnp.float32)
    acc = jnp.zeros((2, t + 1), jnp.float32).at[0, seg_idx].add(sq).at[1, seg_idx].add(n)
    acc = jax.lax.psum(acc, (sharding.DATA, sharding.MODEL))[:, :t]
    return jnp.sqrt(acc[0] / jnp.maximum(acc[1], 1.0))

  def seg_bounds(self, bounds, sender: bool, owner_is_sender: bool):
    """Bounds f32 of each segment, broadcastable to [k, b, nseg], or None."""
    if bounds is None:
      return None
    idx = jnp.asarray(self._g.segment_tables())
    if owner_is_sender == sender:
      # The segments of this device's own table-wise slots: one row of the table.
      return bounds[idx[jax.lax.axis_index(sharding.MODEL)]]
    return bounds[idx][:, None, :]  # per peer (the peer's slots)

  def wire_max(self, segs, forward: bool):
    """f32[T]: the largest |value| each table put on the wire this step (over the mesh)."""
    t = len(self._g.specs)
    idx = jnp.asarray(self._g.segment_tables())
    if forward:
      seg_idx = idx[jax.lax.axis_index(sharding.MODEL)]
      m = jnp.stack([jnp.max(jnp.abs(s)) for s in segs])
    else:  # backward: segment s sent to peer j belongs to peer j's table
      seg_idx = idx.T.reshape(-1)  # [nseg * k]
      m = jnp.stack([jnp.max(jnp.abs(s), axis=(1, 2)) for s in segs]).reshape(-1)
    out = jnp.zeros((t + 1,), jnp.float32).at[seg_idx].max(m)
    return jax.lax.pmax(out, (sharding.DATA, sharding.MODEL))[:t]


def _all_to_all_bits(x: jax.Array) -> jax.Array:
  """all_to_all over MODEL (split and concat on axis 0) that moves x's own bits: XLA:CPU
  widens bf16 and fp8 collectives to f32 / f16 (in the compiled HLO a bf16 all-to-all moves
  as many bytes as f32), so narrow floats travel bitcast to unsigned ints."""
  if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize < 4:
    carrier = {1: jnp.uint8, 2: jnp.uint16}[x.dtype.itemsize]
    y = jax.lax.all_to_all(jax.lax.bitcast_convert_type(x, carrier), sharding.MODEL, 0, 0)
    return jax.lax.bitcast_convert_type(y, x.dtype)
  return jax.lax.all_to_all(x, sharding.MODEL, 0, 0)
