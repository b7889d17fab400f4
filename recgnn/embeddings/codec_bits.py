"""Fixed-width codes of the error-bounded codec (`codecs.Codec`'s `eb`): code widths and
their largest codes, the step per bound (a hair under 2 eb, with the f32 margins that make the
bound exact), bit packing into uint32 words, block steps, and the refusal of non-finite values.
The arithmetic both `codecs` (encoding) and `codec_bounds` (bounds and widths) build on.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

QMAX = 127  # largest int8 code used (the range is symmetric)
WIDTHS = (2, 4, 8, 16)  # bit-packed code widths of `eb` with `widths`
BLOCKS = (16, 32, 64, 128, 256)  # values per block of `eb` with `block`
# A block's header j (step = table step * 2^(-j / 4)) is one byte: 0 .. 254, sent as the 8-bit code
# j - 127 (`pack`). j is also capped so that the block step stays a normal f32.
JMAX = 254


def qmax_of(bits: int) -> int:
  """Largest code of a `bits`-wide symmetric code: 2 -> 1 (-1, 0, 1), 4 -> 7, 8 -> 127."""
  return 2 ** (bits - 1) - 1


def step_factor(bits: int) -> float:
  """A `bits`-wide code's step in units of the bound eb (a hair under 2)."""
  return STEP16 if bits == 16 else STEP


def words_of(dim: int, bits: int) -> int:
  """uint32 words carrying `dim` codes of `bits` bits (32 // bits per word)."""
  per = 32 // bits
  return -(-dim // per)


def pack(codes: jax.Array, bits: int) -> jax.Array:
  """int[..., D] codes in [-qmax, qmax] -> uint32[..., words_of(D, bits)]: each code offset
  by qmax (so 0 .. 2 qmax < 2^bits) at bit bits * (i % per) of word i // per."""
  per, qmax = 32 // bits, qmax_of(bits)
  d = codes.shape[-1]
  u = (codes.astype(jnp.int32) + qmax).astype(jnp.uint32)
  u = jnp.pad(u, [(0, 0)] * (u.ndim - 1) + [(0, (-d) % per)])
  u = u.reshape(*u.shape[:-1], -1, per)
  shifts = jnp.arange(per, dtype=jnp.uint32) * jnp.uint32(bits)
  # The fields do not overlap, so their sum is their bitwise or.
  return jnp.sum(u << shifts, axis=-1, dtype=jnp.uint32)


def unpack(words: jax.Array, bits: int, dim: int) -> jax.Array:
  """`pack`'s inverse: uint32[..., W] -> int32[..., dim]."""
  per, qmax = 32 // bits, qmax_of(bits)
  shifts = jnp.arange(per, dtype=jnp.uint32) * jnp.uint32(bits)
  mask = jnp.uint32((1 << bits) - 1)
  u = (words[..., None] >> shifts) & mask
  u = u.reshape(*words.shape[:-1], -1)[..., :dim]
  return u.astype(jnp.int32) - qmax


# The encoder checks |x - decoded| <= eb * SAFETY in f32, so the exact error is within eb
# although the f32 subtraction rounds (by half an ulp of the difference, 2^-24 relative) and
# the bound itself was rounded to f32 (2^-24). Values within 2^-20 of the bound are refused.
SAFETY = 1.0 - 2.0**-20
# The step is a hair finer than 2 eb, so that rounding to the nearest code (error <= step / 2)
# plus f32 rounding of code * step (<= 2^-16 eb for codes up to 127) stays below eb * SAFETY:
# every value whose code fits is carried, midpoints included.
STEP = 2.0 * (1.0 - 2.0**-12)
# 16-bit codes reach 32767, where f32 rounding of code * step is up to 2^-8 eb: a step 2^-7
# finer keeps rounding + that under eb * SAFETY, so midpoints are still carried.
STEP16 = 2.0 * (1.0 - 2.0**-7)


# A block's step is the table's * 2^(-j / 4): quarter-octave headers, so the step is within
# 19% of the finest that holds the block (a power of two alone wastes up to 2x: one bit).
_QUARTER = np.float32([1.0, 2.0**-0.25, 2.0**-0.5, 2.0**-0.75])


def block_step(table_step: jax.Array, j: jax.Array) -> jax.Array:
  """table_step * 2^(-j / 4), the same f32 on both sides of the wire: one rounded product
  (by 2^(-j % 4)), then an exact power of two (ldexp). Never above table_step."""
  frac = jnp.asarray(_QUARTER)[j % 4]
  return jnp.ldexp(table_step * frac, -(j // 4))


def check_finite(x, what: str = "values") -> None:
  """Raise ValueError if a concrete array holds NaN or inf (no-op on tracers)."""
  if isinstance(x, jax.core.Tracer):
    return
  a = np.asarray(x)
  bad = ~np.isfinite(a)
  if bad.any():
    first = tuple(int(i) for i in np.argwhere(bad)[0])
    raise ValueError(
      f"Cannot encode {what}: {int(bad.sum())} NaN/inf values (first at index {first}, "
      f"value {a[first]}); an error bound cannot hold for them. Check the loss and the "
      "learning rate: non-finite activations or gradients mean training has diverged."
    )
