"""`eb` with block-wise steps (recgnn.embeddings.codecs, Codec.block): the bound holds for
every value at every width and block size; a block of small values is carried with an error
relative to its own range; bytes (codes + one-byte headers) as documented; bad shapes and
options refused."""

import functools

import hypothesis as hyp
import hypothesis.extra.numpy as hnp
import hypothesis.strategies as hst
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from recgnn.embeddings import codecs

DIMS = (16, 8, 2)  # a table-wise slot, a smaller table, a column block


@functools.cache
def _jitted(widths, block):
  codec = codecs.Codec("eb", DIMS, widths, block=block)
  return jax.jit(lambda s, b: codecs.roundtrip(codec, s, b, check=False))


def _roundtrip(segs, bounds, widths, block):
  dec, ok = _jitted(widths, block)([jnp.asarray(s) for s in segs], jnp.asarray(bounds))
  err = [np.abs(np.asarray(d, np.float64) - s.astype(np.float64)) for d, s in zip(dec, segs)]
  return bool(ok), err


def _message(rng, vectors, scale):
  """Segments f32[2, vectors, D]: each vector with its own magnitude (10^-4 .. scale), as
  pooled rows and gradients of examples differ."""
  return [
    (
      rng.standard_normal((2, vectors, d)) * scale * 10.0 ** rng.uniform(-4, 0, (2, vectors, 1))
    ).astype(np.float32)
    for d in DIMS
  ]


# Every width and every block size, each at least once.
@pytest.mark.parametrize(
  "bits, block", [(2, 16), (4, 32), (8, 64), (16, 128), (4, 256), (4, 16), (8, 32)]
)
def test_bound_holds_and_blocks_follow_their_range(bits, block):
  """Bounds that hold the message in the codes (as bound=current sets them): carried, every
  value within its table's bound, and every block within half its own step, which is at most
  2^(1/4) times the block's largest |value| / qmax (quarter-octave headers), far finer than
  the table's step for the small blocks."""
  rng = np.random.default_rng(bits * 1000 + block)
  vectors = 128  # a multiple of every block's vectors (block / D)
  segs = _message(rng, vectors, 1.0)
  qmax = codecs.qmax_of(bits)
  bounds = np.array(
    [np.abs(s).max() * 1.25 / (codecs.step_factor(bits) * qmax) for s in segs], np.float32
  )
  ok, err = _roundtrip(segs, bounds, (bits,) * 3, block)
  assert ok
  finer = 0
  for s, e, eb, d in zip(segs, err, bounds, DIMS):
    assert (e <= eb).all()
    blocks = np.abs(s).reshape(2, -1, block)  # vectors * d / block blocks of `block` values
    m = blocks.max(-1, keepdims=True)
    eblk = e.reshape(blocks.shape)
    assert (eblk <= np.minimum(eb, 0.6 * m / qmax) * (1 + 1e-6) + 1e-30).all(), d
    finer += int((eblk.max(-1) < eb / 8).sum())
  if block <= 64:  # (larger blocks span 8+ vectors: their largest is near the table's)
    assert finer > 0, "no block stepped finer than its table: the headers are not used"


@pytest.mark.parametrize("block", (16, 128))
@pytest.mark.parametrize("bits", (2, 4))
def test_out_of_range_is_reported_never_wrong(bits, block):
  """A value beyond the table's codes (no j >= 0 holds it): not ok, so `sharded` falls back;
  the segments that fit stay ok."""
  codec = codecs.Codec("eb", DIMS, (bits,) * 3, block=block)
  bounds = jnp.full((3,), 1e-2, jnp.float32)
  segs = [jnp.full((2, 64, d), 1e-3, jnp.float32) for d in DIMS]
  segs[1] = segs[1].at[1, 5, 3].set(0.3)  # 15 steps: beyond 2- and 4-bit codes
  ok, all_ok = jax.jit(lambda s, b: (codec.segments_ok(s, b), codec.encode(s, b)[1]))(segs, bounds)
  assert np.asarray(ok).tolist() == [True, False, True]
  assert not bool(all_ok)


def test_bytes_codes_and_headers():
  codec = codecs.Codec("eb", (16, 16), (4, 2), block=32)
  # (16 * 4 + 16 * 2) bits per vector over 32 values + 8 / 32 bits of header per value
  assert codec.bits_per_value() == pytest.approx(96 / 32 + 0.25)
  vectors = 256
  payload, _ = jax.jit(codec.encode)([jnp.zeros((8, vectors, 16))] * 2, jnp.ones(2))
  assert payload["w"].dtype == payload["h"].dtype == jnp.uint32
  nbytes = sum(v.size * 4 for v in payload.values())
  assert nbytes == codecs.payload_bytes(codec, 8 * vectors)
  assert 32 / codecs.Codec("eb", (16,), (4,), block=32).bits_per_value() == pytest.approx(
    32 / 4.25
  )  # 7.5x fewer bytes than f32


def test_zero_and_tiny_blocks_are_exact_or_within_range():
  """All-zero blocks (empty slots, padding) decode to exact zeros; a subnormal-sized block
  under a large bound is still within its bound (the step stays a normal f32)."""
  codec = codecs.Codec("eb", (16,), (4,), block=16)
  x = np.zeros((1, 4, 16), np.float32)
  x[0, 1] = 1e-38
  x[0, 2] = 3.0
  (dec,), ok = jax.jit(lambda s, b: codecs.roundtrip(codec, s, b, check=False))(
    [jnp.asarray(x)], jnp.asarray([1.0], jnp.float32)
  )
  assert bool(ok)
  dec = np.asarray(dec)
  assert (dec[0, 0] == 0).all() and (dec[0, 3] == 0).all()
  assert (np.abs(dec - x) <= 1.0).all()


@pytest.mark.parametrize(
  "kwargs, match",
  [
    (dict(widths=(), block=32), "need code widths"),
    (dict(widths=(4, 4, 4), block=24), "block=24"),
    (dict(widths=(4, 4, 4), block=16, dims=(32, 8, 2)), "multiple of every segment's dim"),
  ],
)
def test_refused(kwargs, match):
  dims = kwargs.pop("dims", DIMS)
  with pytest.raises(ValueError, match=match):
    codecs.Codec("eb", dims, **kwargs)


def test_partial_blocks_refused():
  codec = codecs.Codec("eb", (16,), (4,), block=64)
  with pytest.raises(ValueError, match="do not fill whole blocks"):
    codec.encode([jnp.zeros((2, 3, 16))], jnp.ones(1))  # 3 vectors: 48 values


@pytest.mark.parametrize("bits, block", [(2, 16), (4, 32), (8, 128), (16, 16), (4, 16)])
@hyp.settings(max_examples=30, derandomize=True, deadline=None)
@hyp.given(
  x=hnp.arrays(
    np.float32, (2, 64, 26), elements=hst.floats(width=32, allow_nan=False, allow_infinity=False)
  ),
  eb=hnp.arrays(
    np.float32,
    (3,),
    elements=hst.floats(float(np.float32(1e-30)), float(np.float32(1e30)), width=32),
  ),
)
def test_bound_property(bits, block, x, eb):
  """Any finite message, any bounds, every width and block size: ok means every value within
  its table's bound; a message within the table's codes (one code of margin) is carried."""
  segs = np.split(x, np.cumsum(DIMS)[:-1], axis=-1)
  ok, err = _roundtrip(segs, eb, (bits,) * 3, block)
  limits = [(codecs.qmax_of(bits) - 1) * codecs.step_factor(bits) * float(b) for b in eb]
  if ok:
    for e, b in zip(err, eb):
      assert (e <= float(b)).all()
  else:
    assert not all(np.abs(s).max() <= lim for s, lim in zip(segs, limits)), "a fit was refused"
