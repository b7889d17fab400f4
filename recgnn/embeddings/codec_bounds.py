"""The error bound of each table at each iteration for `sharded`'s `eb` codec (`BoundRule`:
fixed, range rules "current" / "ema", the tolerance rule "rms") and the code width a table's
range needs (`width_for`). The codes themselves are codec_bits'; the codec is codecs'.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from recgnn.embeddings.codec_bits import QMAX, WIDTHS, qmax_of, step_factor

BOUND_MODES = ("current", "ema", "rms")  # BoundRule.mode


@dataclasses.dataclass(frozen=True, kw_only=True)
class BoundRule:
  """How `sharded` sets the error bound of each table at each iteration (eb codec).

  fixed > 0: the same bound for every table and iteration (the baseline the paper compares
    its adaptive bound with).
  fixed == 0, mode "current" / "ema" (the range rules): table-wise and iteration-wise. Each
    table's bound at each iteration is the finest one whose codes hold the largest |value|
    it puts on the wire, with `headroom`:  eb_t,i = max_t,i * (1 + headroom) / (2 * qmax),
    qmax = 127 for int8 codes (the table's code width's largest code with `widths`), where
    max_t,i is
    mode "current" (default): this iteration's largest |value| of table t over the mesh
      (a pmax of T floats before encoding, ~100 bytes), so the codes always hold the range
      and no step falls back;
    mode "ema": an exponential moving average of past iterations' maxima (no extra
      collective; a range that jumps past the headroom, and the first step, fall back).
    Why: with fixed-size codes the bytes are the same at every bound, so the bound that
    serves accuracy best is the smallest one that does not force a fallback; tables differ
    by orders of magnitude in their ranges and ranges drift over training, so both levels
    are needed. Here the bound follows the bits: it buys accuracy, never bytes.
  fixed == 0, mode "rms" (the tolerance rule): the direction reversed: the bound is what
    training tolerates, relative to each table's typical magnitude this iteration,
      eb_t,i = rel_i * rms_t,i,   rms_t,i = sqrt(mean of x^2 over the table's wire values)
    (one psum of 2 T floats before encoding), and the bits follow the bound: `sharded`
    with widths=auto plans each segment's code width from the range / bound ratio it saw
    (`peak`, below). rel_i is the iteration-wise schedule: `rel` for the first `warmup`
    iterations, then a linear ramp over `ramp` iterations to rel * `late`, kept after.
    Why that shape (a choice, not the paper's schedule, which we do not have): early
    iterations move every row furthest from its random start and set where training
    goes; later updates are small corrections averaged over many steps, so their noise
    matters less (a looser bound late trades bits where they buy least AUC).
  decay: the EMA's weight of the past.

  The state also keeps `peak`: f32[T], the largest max_t,i / eb_t,i since the last width
  plan (how many bounds each table's range spans: its codes need peak / step of them), and
  `widths`: int32[segments], the code widths the step is compiled with (0: int8 codes).
  """

  fixed: float = 0.0
  headroom: float = 0.25
  decay: float = 0.9
  initial: float = 1e-3  # the bound before the first statistics (iteration 0)
  # "current": the bound of each table at each iteration from THIS iteration's largest
  # |value| (one all-reduce of T floats before encoding): the codes always hold the range,
  # so no step falls back. "ema": from the EMA of past iterations (no extra collective; a
  # range that jumps past the headroom falls back, and so does the first step). "rms": a
  # tolerance relative to this iteration's RMS of each table, scheduled (rel, warmup,
  # ramp, late).
  mode: str = "current"
  rel: float = 0.1
  warmup: int = 0
  ramp: int = 0
  late: float = 1.0

  def __post_init__(self):
    if self.mode not in BOUND_MODES:
      raise ValueError(f"bound mode must be one of {BOUND_MODES}, got {self.mode!r}")
    if self.rel <= 0 or self.late <= 0 or self.warmup < 0 or self.ramp < 0:
      raise ValueError(
        f"bound rule: rel ({self.rel}) and late ({self.late}) must be > 0, warmup "
        f"({self.warmup}) and ramp ({self.ramp}) >= 0"
      )

  def from_max(self, step_max: jax.Array, qmax=QMAX) -> jax.Array:
    """f32[T]: the bound whose codes (largest `qmax`, per table or one) hold |values| up to
    step_max with the headroom."""
    return jnp.maximum(step_max * (1 + self.headroom) / (2 * jnp.asarray(qmax, jnp.float32)), 1e-30)

  def rel_at(self, steps: jax.Array) -> jax.Array:
    """The schedule's relative bound at iteration `steps` (rel, then a ramp to rel * late)."""
    t = jnp.asarray(steps, jnp.float32) - self.warmup
    frac = jnp.clip(t / max(self.ramp, 1), 0.0, 1.0) if self.ramp else (t >= 0).astype(jnp.float32)
    return jnp.float32(self.rel) * (1.0 + (self.late - 1.0) * frac)

  def from_rms(self, rms: jax.Array, steps: jax.Array) -> jax.Array:
    """f32[T]: the tolerance rule's bound, rel_at(steps) * rms (a floor for all-zero tables)."""
    return jnp.maximum(self.rel_at(steps) * rms, 1e-30)

  @property
  def uses_current(self) -> bool:
    return self.fixed <= 0 and self.mode in ("current", "rms")

  def init(self, num_tables: int, widths: Sequence[int] = ()) -> dict[str, jax.Array]:
    start = self.fixed if self.fixed > 0 else self.initial
    return {
      "bound": jnp.full((num_tables,), start, jnp.float32),
      "ema_max": jnp.zeros((num_tables,), jnp.float32),
      "peak": jnp.zeros((num_tables,), jnp.float32),
      "widths": jnp.asarray(list(widths) or [0], jnp.int32),
      "steps": jnp.zeros((), jnp.int32),
      "wire_bits": jnp.zeros((), jnp.float32),  # sum over steps of coded bits per value
      "fallbacks": jnp.zeros((), jnp.int32),  # steps with any segment sent as f32
      "fallback_values": jnp.zeros((), jnp.int32),  # sum over steps of f32 values / vector
    }

  def next(
    self,
    state: dict[str, jax.Array],
    step_max: jax.Array,
    fallback: jax.Array,
    widths: Sequence[int] = (),
    used: jax.Array | None = None,
    bits: float = 8.0,
  ):
    """state after an iteration whose largest |value| per table was step_max f32[T];
    fallback: bool[nseg], the segments sent as f32 (widths: their values per vector);
    used: f32[T], the bounds this iteration was sent under (the state's when not given);
    bits: the coded bits per value this iteration (its widths), summed in `wire_bits`."""
    first = state["steps"] == 0
    ema = jnp.where(first, step_max, self.decay * state["ema_max"] + (1 - self.decay) * step_max)
    # A range that jumps past the EMA would fall back every step until the EMA catches up.
    ema = jnp.maximum(ema, step_max)
    used = state["bound"] if used is None else used
    if self.fixed > 0:
      bound = state["bound"]
    elif self.mode == "ema":
      bound = self.from_max(ema)
    else:
      bound = used  # the bound this iteration used ("current", "rms")
    return {
      **state,
      "bound": bound,
      "ema_max": ema,
      "peak": jnp.maximum(state["peak"], step_max / jnp.maximum(used, 1e-30)),
      "steps": state["steps"] + 1,
      "wire_bits": state["wire_bits"] + jnp.float32(bits),
      "fallbacks": state["fallbacks"] + jnp.any(fallback).astype(jnp.int32),
      "fallback_values": state["fallback_values"]
      + jnp.sum(jnp.where(fallback, jnp.asarray(widths, jnp.int32), 0)),
    }


def width_for(peak: float, headroom: float) -> int:
  """The narrowest of WIDTHS whose codes hold a range of `peak` bounds with the headroom
  (codes needed: peak * (1 + headroom) / step_factor); 16 when none does (the excess falls
  back to f32 that step)."""
  for w in WIDTHS:
    if qmax_of(w) >= peak * (1 + headroom) / step_factor(w):
      return w
  return WIDTHS[-1]
