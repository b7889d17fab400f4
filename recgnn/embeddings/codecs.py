"""Codecs for the embedding all-to-all of `sharded`: what the wire carries instead of f32.

A message is a list of SEGMENTS, one per table, each f32[..., D_t] (a pooled embedding, or
its gradient, per example and destination). A codec turns it into a payload: a dict of
arrays with the same leading dims (one all-to-all per payload array), and back.

  none          f32, 32 bits per value
  fp16, bf16    a cast: 16 bits
  fp8_e4m3,     a cast after a per-vector scale (max |x| -> the format's largest finite
  fp8_e5m2      value; without it gradients of 1e-4 underflow e4m3's 2^-9 smallest
                subnormal): 8 bits + one f32 per vector
  int8          symmetric per-vector scale (max |x| / 127), as TorchRec's row-wise int8
                comms: 8 bits + one f32 per vector
  eb            error-bounded: q = round(x / 2eb) in int8 (a step a hair under 2 eb),
                with the bound `eb` of the segment's table; |x - decode(encode(x))| <= eb
                for EVERY value. The bound is known to both sides (it lives in the backend
                state), so the wire carries 8 bits per value and nothing else. A value
                whose code would not fit in int8 (or whose decoded value would miss the
                bound by rounding) makes its segment not ok (`segments_ok`); `sharded` then
                sends that step's offending segments (tables) again as f32 (agreed over the
                mesh), so the bound always holds.
                With `widths` (one per segment, from WIDTHS): the same codes in 2, 4, 8 or
                16 bits per value, bit-packed into uint32 words (32 / width codes per word,
                each segment padded to whole words): a table whose range / bound needs
                only 7 codes each side travels in 4 bits. Widths are static (shapes):
                `sharded` re-plans them every few steps, a recompile each time they change.
                With `block` (values per block, from BLOCKS; needs `widths`): block-wise
                steps. A segment's vectors are cut into blocks of `block` values (block / D
                consecutive vectors of one destination), and each block carries a one-byte
                header j: its step is the table's step * 2^(-j / 4), the finest that still
                holds the block's largest |value| in the segment's codes. The table's bound
                stays the ceiling (j >= 0), so the bound holds for every value,
                and a block of small values (a small gradient, a short vector) is carried
                with an error relative to its own range instead of the table's: 8 / block
                bits more per value.

Non-finite values cannot be carried within a bound: `check_finite` refuses them on concrete
arrays with a clear error; inside a jitted step `eb` reports them not ok, the fallback
carries them as they are, and the loss check of the trainer stops the run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

# The codes' arithmetic and the adaptive bounds live beside the codec; their names are
# importable from here, where `sharded` and the tests have always found them.
from recgnn.embeddings.codec_bits import (  # noqa: F401
  BLOCKS,
  JMAX,
  QMAX,
  SAFETY,
  STEP,
  STEP16,
  WIDTHS,
  block_step,
  check_finite,
  pack,
  qmax_of,
  step_factor,
  unpack,
  words_of,
)
from recgnn.embeddings.codec_bounds import BOUND_MODES, BoundRule, width_for  # noqa: F401

CODECS = ("none", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "int8", "eb")
_FLOAT = {"fp16": jnp.float16, "bf16": jnp.bfloat16}
_FP8 = {"fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2}


@dataclasses.dataclass(frozen=True)
class Codec:
  """A codec over messages of segments of widths `dims` (one per table).

  Attributes:
    name: one of CODECS.
    dims: the width D_t of each segment.
    widths: `eb` only: the code width in bits of each segment (from WIDTHS), bit-packed;
      empty: int8 codes for every segment.
    block: `eb` with widths only: values per block of the block-wise steps (from BLOCKS; a
      multiple of every segment's dim); 0: one step per segment (the table's).
  """

  name: str
  dims: tuple[int, ...]
  widths: tuple[int, ...] = ()
  block: int = 0

  def __post_init__(self):
    if self.name not in CODECS:
      raise ValueError(f"Unknown codec {self.name!r}; available: {', '.join(CODECS)}")
    if self.widths:
      if self.name != "eb":
        raise ValueError(f"code widths are for the eb codec, not {self.name!r}")
      if len(self.widths) != len(self.dims):
        raise ValueError(f"eb codec: {len(self.widths)} widths for {len(self.dims)} segments")
      bad = [w for w in self.widths if w not in WIDTHS]
      if bad:
        raise ValueError(f"eb codec: widths {bad} not in {WIDTHS}")
    if self.block:
      if not self.widths:
        raise ValueError("eb codec: block-wise steps (block=) need code widths (widths=)")
      if self.block not in BLOCKS:
        raise ValueError(f"eb codec: block={self.block} values; one of {BLOCKS}")
      odd = [d for d in self.dims if self.block % d]
      if odd:
        raise ValueError(
          f"eb codec: a block of {self.block} values holds whole vectors, so it must be a "
          f"multiple of every segment's dim; {odd} do not divide it (a larger block, or none)"
        )

  @property
  def width(self) -> int:
    return sum(self.dims)

  @property
  def needs_bound(self) -> bool:
    return self.name == "eb"

  def bits_per_value(self) -> float:
    """Wire bits per f32 value of a message (scales included)."""
    if self.name == "none":
      return 32.0
    if self.name in _FLOAT:
      return 16.0
    if self.name == "eb":
      if self.block:
        # Codes fill whole words per block; headers are one byte per block (4 per word:
        # exact when a message's block count is a multiple of 4, as at every batch we run).
        return sum(d * w for d, w in zip(self.dims, self.widths)) / self.width + 8.0 / self.block
      if self.widths:
        words = sum(words_of(d, w) for d, w in zip(self.dims, self.widths))
        return 32.0 * words / self.width
      return 8.0
    return 8.0 + 32.0 * len(self.dims) / self.width  # fp8 / int8: one f32 scale per vector

  def encode(
    self, segments: Sequence[jax.Array], bounds: jax.Array | None = None
  ) -> tuple[dict[str, jax.Array], jax.Array]:
    """segments: f32[..., D_t] per table; bounds: f32[T] (eb only).

    Returns (payload, ok): payload arrays share the segments' leading dims; `ok` is a bool
    scalar, False when `eb` cannot hold its bound for some value of this message.
    """
    x = jnp.concatenate([s.astype(jnp.float32) for s in segments], axis=-1)
    ok = jnp.array(True)
    if self.name == "none":
      return {"v": x}, ok
    if self.name in _FLOAT:
      return {"v": x.astype(_FLOAT[self.name])}, ok
    if self.name == "eb" and self.block:
      return self._block_encode(segments, bounds)
    if self.name == "eb":
      q, okv = self._eb_codes(x, bounds)
      if self.widths:
        words = [pack(c, w) for c, w in zip(self.split(q), self.widths)]
        return {"w": jnp.concatenate(words, axis=-1)}, jnp.all(okv)
      return {"q": q.astype(jnp.int8)}, jnp.all(okv)
    # Per-vector scale: fp8 and int8.
    scales, parts = [], []
    top = QMAX if self.name == "int8" else float(jnp.finfo(_FP8[self.name]).max)
    for s in self.split(x):
      m = jnp.max(jnp.abs(s), axis=-1, keepdims=True)
      scale = jnp.where(m > 0, m / top, 1.0)
      scales.append(scale)
      v = s / scale
      parts.append(
        jnp.round(v).astype(jnp.int8) if self.name == "int8" else v.astype(_FP8[self.name])
      )
    return {"q": jnp.concatenate(parts, axis=-1), "scale": jnp.concatenate(scales, axis=-1)}, ok

  def _qmax(self) -> jax.Array | int:
    """The largest code of each value f32[W] (widths) or QMAX."""
    if not self.widths:
      return QMAX
    return jnp.concatenate(
      [jnp.full((d,), qmax_of(w), jnp.float32) for d, w in zip(self.dims, self.widths)]
    )

  def _step(self, bounds) -> jax.Array:
    """Each value's quantization step f32[..., W]: a hair under 2 eb (STEP, STEP16)."""
    eb = self._per_value(bounds)
    if not self.widths or 16 not in self.widths:
      return STEP * eb
    factor = jnp.concatenate(
      [
        jnp.full((d,), STEP16 if w == 16 else STEP, jnp.float32)
        for d, w in zip(self.dims, self.widths)
      ]
    )
    return factor * eb

  def _eb_codes(self, x, bounds):
    """Codes (int32) of x f32[..., W] and whether each value is within its bound."""
    eb = self._per_value(bounds)
    step = self._step(bounds)
    qmax = self._qmax()
    q = jnp.round(x / step)
    dec = jnp.clip(q, -qmax, qmax) * step
    okv = (jnp.abs(q) <= qmax) & (jnp.abs(x - dec) <= eb * SAFETY)
    return jnp.clip(q, -qmax, qmax).astype(jnp.int32), okv

  def segments_ok(self, segments: Sequence[jax.Array], bounds=None) -> jax.Array:
    """bool[nseg]: whether the codec carries every value of each segment (within its bound
    for `eb`; the other codecs always do)."""
    if self.name != "eb":
      return jnp.ones((len(self.dims),), bool)
    if self.block:
      return jnp.stack(
        [jnp.all(self._block_codes(s, i, bounds)[2]) for i, s in enumerate(segments)]
      )
    x = jnp.concatenate([s.astype(jnp.float32) for s in segments], axis=-1)
    _, okv = self._eb_codes(x, bounds)
    return jnp.stack([jnp.all(v) for v in self.split(okv)])

  def decode(
    self, payload: dict[str, jax.Array], bounds: jax.Array | None = None
  ) -> list[jax.Array]:
    """payload -> f32[..., D_t] per table."""
    if self.name == "eb" and self.block:
      return self._block_decode(payload, bounds)
    if self.name in ("none", *_FLOAT):
      x = payload["v"].astype(jnp.float32)
    elif self.name == "eb":
      if self.widths:
        words, codes, lo = payload["w"], [], 0
        for d, w in zip(self.dims, self.widths):
          n = words_of(d, w)
          codes.append(unpack(words[..., lo : lo + n], w, d))
          lo += n
        q = jnp.concatenate(codes, axis=-1)
      else:
        q = payload["q"]
      x = q.astype(jnp.float32) * self._step(bounds)
    else:
      q = payload["q"].astype(jnp.float32)
      scale = payload["scale"]
      x = jnp.concatenate([s * scale[..., i : i + 1] for i, s in enumerate(self.split(q))], axis=-1)
    return self.split(x)

  # --------------------------------------------------------------- block-wise steps (block)

  def _block_bound(self, i: int, bounds, vectors_shape) -> jax.Array:
    """Segment i's bound per block f32[..., nb] (the smallest over the block's vectors:
    `sharded` gives one bound per segment and destination, so they are all equal there)."""
    b = jnp.asarray(bounds, jnp.float32)
    if b.shape[-1] != len(self.dims):
      raise ValueError(f"eb codec: {b.shape[-1]} bounds for {len(self.dims)} segments")
    if not isinstance(b, jax.core.Tracer) and not bool(jnp.all(b > 0)):
      raise ValueError(f"eb codec: error bounds must be > 0, got {np.asarray(b)}")
    b = jnp.maximum(b[..., i], jnp.finfo(jnp.float32).tiny)
    # bounds broadcast against the message's leading dims [..., V] (V: vectors).
    b = jnp.broadcast_to(b, vectors_shape)
    g = self.block // self.dims[i]
    return jnp.min(b.reshape(*vectors_shape[:-1], -1, g), axis=-1)

  def _block_codes(self, seg: jax.Array, i: int, bounds):
    """Segment i, f32[..., V, D] -> (codes int32[..., nb, block], headers j int32[..., nb],
    ok bool[..., nb, block]): V * D / block blocks of block / D vectors each.

    Step of a block: the table's step (a hair under 2 eb) * 2^(-j/4), j >= 0 the largest that
    still holds the block's largest |value| in qmax codes (one correction for log2's
    rounding), capped so that the step stays a normal f32. Every value is then checked
    against its bound as at any width; a block the table's step cannot hold (j = 0 and a
    code beyond qmax) is not ok, so its segment falls back."""
    *lead, v, d = seg.shape
    if (v * d) % self.block:
      raise ValueError(
        f"eb codec: {v} vectors of {d} values do not fill whole blocks of {self.block}"
      )
    w = self.widths[i]
    qmax = qmax_of(w)
    x = seg.astype(jnp.float32).reshape(*lead, v * d // self.block, self.block)
    eb = self._block_bound(i, bounds, (*lead, v))
    st = step_factor(w) * eb
    m = jnp.max(jnp.abs(x), axis=-1)
    # j at most: st * 2^(-j / 4) >= 2^-125 (a normal f32: code * step loses no precision).
    cap = jnp.clip(4 * (jnp.floor(jnp.log2(st)) + 125), 0, JMAX)
    j = jnp.floor(4 * (jnp.log2(qmax * st) - jnp.log2(m)))  # m = 0: +inf, capped
    j = jnp.where(jnp.isnan(j), 0, jnp.clip(j, 0, cap)).astype(jnp.int32)
    over = jnp.round(m / block_step(st, j)) > qmax  # log2's rounding: one step back
    j = jnp.where(over & (j > 0), j - 1, j)
    sb = block_step(st, j)[..., None]
    q = jnp.round(x / sb)
    qc = jnp.clip(q, -qmax, qmax)
    ok = (jnp.abs(q) <= qmax) & (jnp.abs(x - qc * sb) <= eb[..., None] * SAFETY)
    return qc.astype(jnp.int32), j, ok

  def _block_encode(self, segments, bounds):
    """-> ({"w": uint32[..., code words], "h": uint32[..., header words]}, ok): the leading
    dims of the segments without the vector axis (blocks span vectors)."""
    words, heads, oks = [], [], []
    for i, s in enumerate(segments):
      q, j, ok = self._block_codes(s, i, bounds)
      words.append(pack(q, self.widths[i]).reshape(*q.shape[:-2], -1))
      heads.append(j - 127)  # 0 .. 254 as an 8-bit code
      oks.append(jnp.all(ok))
    h = pack(jnp.concatenate(heads, axis=-1), 8)
    return {"w": jnp.concatenate(words, axis=-1), "h": h}, jnp.all(jnp.stack(oks))

  def _block_decode(self, payload, bounds):
    words, h = payload["w"], payload["h"]
    per_vector = sum(d * w for d, w in zip(self.dims, self.widths))  # bits
    v = words.shape[-1] * 32 // per_vector
    lead = words.shape[:-1]
    nbs = [v * d // self.block for d in self.dims]
    j = unpack(h, 8, sum(nbs)) + 127
    out, lo, hlo = [], 0, 0
    for i, (d, w) in enumerate(zip(self.dims, self.widths)):
      nb = nbs[i]
      n = nb * self.block * w // 32
      q = unpack(words[..., lo : lo + n].reshape(*lead, nb, -1), w, self.block)
      eb = self._block_bound(i, bounds, (*lead, v))
      sb = block_step(step_factor(w) * eb, j[..., hlo : hlo + nb])
      out.append((q.astype(jnp.float32) * sb[..., None]).reshape(*lead, v, d))
      lo, hlo = lo + n, hlo + nb
    return out

  def split(self, x):
    """x [..., sum(dims)] -> its segments, [..., d] for each d of dims."""
    out, lo = [], 0
    for d in self.dims:
      out.append(x[..., lo : lo + d])
      lo += d
    return out

  def _per_value(self, bounds) -> jax.Array:
    """bounds f32[..., nseg] (one per segment, leading dims broadcasting against the
    message's) -> f32[..., W], each value's bound."""
    if bounds is None:
      raise ValueError("the eb codec needs one error bound per segment")
    b = jnp.asarray(bounds, jnp.float32)
    if b.shape[-1] != len(self.dims):
      raise ValueError(f"eb codec: {b.shape[-1]} bounds for {len(self.dims)} segments")
    if not isinstance(b, jax.core.Tracer) and not bool(jnp.all(b > 0)):
      raise ValueError(f"eb codec: error bounds must be > 0, got {np.asarray(b)}")
    b = jnp.maximum(b, jnp.finfo(jnp.float32).tiny)
    return jnp.concatenate(
      [jnp.broadcast_to(b[..., i : i + 1], (*b.shape[:-1], d)) for i, d in enumerate(self.dims)],
      axis=-1,
    )


def roundtrip(codec: Codec, segments, bounds=None, *, check: bool = True):
  """decode(encode(x)) on concrete arrays (tests, benchmarks): refuses NaN / inf first.

  Returns (decoded segments, ok)."""
  if check:
    for s in segments:
      check_finite(s, f"a message for the {codec.name!r} codec")
  payload, ok = codec.encode(segments, bounds)
  return codec.decode(payload, bounds), ok


def payload_bytes(codec: Codec, leading: int) -> int:
  """Wire bytes of a message with `leading` vectors of every segment."""
  return int(round(leading * codec.width * codec.bits_per_value() / 8))
