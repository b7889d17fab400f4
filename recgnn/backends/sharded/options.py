"""`sharded(...)`'s plan-string options: one frozen dataclass, parsed by
`base.BackendOptions.parse` (an option it cannot honour is refused with the reason)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from recgnn.backends.sharded.placement import KINDS
from recgnn.embeddings import base, codecs

DIRECTIONS = ("fwd", "bwd")


@dataclasses.dataclass(frozen=True)
class ShardedOptions(base.BackendOptions):
  """`sharded(...)`'s options (module docstring: placement, codecs).

  Attributes:
    kind: auto | table | row | column: the placement of every table of the group.
    profile: a JSON file {table: lookups per example} that balances table-wise placements;
      refused with kind=row|column (every table is then split over every shard).
    codec: the codec of both directions' all-to-all (`codecs.CODECS`); none when not given.
      Refused when `fwd_codec` and `bwd_codec` both override it.
    fwd_codec: the forward (pooled rows) all-to-all's codec, instead of `codec`.
    bwd_codec: the backward (pooled gradients) all-to-all's codec, instead of `codec`.
    eb: a fixed error bound of both directions (codec=eb only); not given: adaptive.
      Refused when `fwd_eb` and `bwd_eb` both override it.
    fwd_eb: the forward direction's fixed bound, instead of `eb`.
    bwd_eb: the backward direction's fixed bound, instead of `eb`.
    bound: current | ema | rms: the adaptive bound's rule (`codecs.BoundRule`); current when
      not given. Only where a direction adapts (codec=eb without a fixed bound). current /
      ema: the bound from the range (fills the codes); rms: the bound from what training
      tolerates, rel * each table's RMS this iteration (the bits then follow the bound).
    headroom: the adaptive bound's headroom over the measured range (0.25 when not given);
      with widths=auto also the headroom of the width plan.
    rel: bound=rms: the bound relative to each table's RMS (0.1 when not given), both
      directions.
    fwd_rel: the forward direction's rel, instead of `rel`.
    bwd_rel: the backward direction's rel, instead of `rel`.
    warmup: bound=rms's iteration-wise schedule: rel for the first `warmup` steps (0).
    ramp: then a linear ramp over `ramp` steps (0: a jump) ...
    late: ... to rel * late, kept after (1 when not given: no schedule).
    widths: eb only: the code width of the segments: auto (each segment's width planned from
      the range / bound ratio its tables saw, every `replan` steps; needs a bound not set
      from the range: eb= or bound=rms) or one of 2, 4, 8, 16 for every segment; not given:
      int8 codes.
    replan: widths=auto: steps between width plans (100 when not given); each change of the
      widths is a recompile of the step (the trainer calls `Sharded.replan`).
    fwd_widths: the forward (pooled rows) direction's code widths, instead of `widths`.
    bwd_widths: the backward (pooled gradients) direction's code widths, instead of `widths`.
    block: eb with widths only: block-wise steps, `block` values per block (16, 32, 64, 128,
      256; a multiple of every segment's dim): each block's step follows its own range
      under the table's bound, for a one-byte header per block (codecs.Codec.block).
  """

  backend: ClassVar[str] = "sharded"

  kind: str = "auto"
  profile: str | None = None
  codec: str | None = None
  fwd_codec: str | None = None
  bwd_codec: str | None = None
  eb: float | None = None
  fwd_eb: float | None = None
  bwd_eb: float | None = None
  bound: str | None = None
  headroom: float | None = None
  rel: float | None = None
  fwd_rel: float | None = None
  bwd_rel: float | None = None
  warmup: int | None = None
  ramp: int | None = None
  late: float | None = None
  widths: str | int | None = None
  replan: int | None = None
  fwd_widths: str | int | None = None
  bwd_widths: str | int | None = None
  block: int | None = None

  def __post_init__(self):
    self._check_placement()
    self._check_overridden("codec", "_codec")
    self._check_overridden("eb", "_eb")
    self._check_codecs()
    self._check_adaptive()
    self._check_overridden("widths", "_widths")
    for d in DIRECTIONS:
      self._check_widths(d)
    self._check_block()
    auto = "auto" in [self.code_widths[d] for d in DIRECTIONS if self.codec_names[d] == "eb"]
    if self.replan is not None and (not auto or self.replan < 1):
      raise ValueError(
        f"sharded: replan={self.replan} is the width plan's period (>= 1) of widths=auto"
      )

  def _check_placement(self) -> None:
    """Refuses an unknown kind, and a profile that no table-wise placement uses."""
    if self.kind not in KINDS:
      raise ValueError(f"sharded: unknown kind {self.kind!r}; available: {', '.join(KINDS)}")
    if self.profile and self.kind in ("row", "column"):
      raise ValueError(
        f"sharded: profile= (lookups per table) balances table-wise placements; with "
        f"kind={self.kind} every table is split over every shard and nothing uses it: drop "
        "profile="
      )

  def _check_overridden(self, both: str, one: str) -> None:
    """Refuses option `both` when fwd`one`= and bwd`one`= both override it."""
    if getattr(self, both) is not None and all(
      getattr(self, d + one) is not None for d in DIRECTIONS
    ):
      raise ValueError(
        f"sharded: {both}={getattr(self, both)} is overridden in both directions by "
        f"fwd{one}= and bwd{one}=, so nothing uses it: drop {both}="
      )

  def _check_codecs(self) -> None:
    """Refuses an unknown codec, and a fixed bound on a direction whose codec is not eb."""
    names, fixed = self.codec_names, self.fixed_bounds
    for d in DIRECTIONS:
      codecs.Codec(names[d], ())  # refuses an unknown codec
      if fixed[d] and names[d] != "eb":
        raise ValueError(
          f"sharded: the {d} bound {fixed[d]:g} (eb= / {d}_eb=) is an error bound for "
          f"codec=eb; the codecs are {names}"
        )

  def _adaptive(self) -> list[str]:
    """The directions whose bound adapts: codec eb without a fixed bound."""
    names, fixed = self.codec_names, self.fixed_bounds
    return [d for d in DIRECTIONS if names[d] == "eb" and not fixed[d]]

  def _check_adaptive(self) -> None:
    """Refuses bound= / headroom= where no direction adapts, and the tolerance rule's
    settings (rel, schedule) without bound=rms."""
    names, fixed = self.codec_names, self.fixed_bounds
    given = [
      f"{k}={v}" for k, v in (("bound", self.bound), ("headroom", self.headroom)) if v is not None
    ]
    if given and not self._adaptive():
      raise ValueError(
        f"sharded: {', '.join(given)} tune the adaptive eb bound, but no direction adapts "
        f"(codecs {names}, fixed bounds fwd {fixed['fwd']:g} / bwd {fixed['bwd']:g}); drop "
        "them, or give codec=eb without eb= for adaptive bounds"
      )
    schedule = [
      f"{k}={getattr(self, k)}"
      for k in ("rel", "fwd_rel", "bwd_rel", "warmup", "ramp", "late")
      if getattr(self, k) is not None
    ]
    if schedule and self.bound != "rms":
      raise ValueError(
        f"sharded: {', '.join(schedule)} set the tolerance rule's bound (bound=rms); give "
        "bound=rms, or drop them"
      )

  def _check_widths(self, d: str) -> None:
    """Refuses direction d's code width where it is not one, its codec is not eb, or its
    bound is set from the bits (an adaptive range bound, or the EMA's)."""
    names, w = self.codec_names, self.code_widths[d]
    if w is None:
      return
    key = "widths" if getattr(self, d + "_widths") is None else d + "_widths"
    if w != "auto" and w not in codecs.WIDTHS:
      raise ValueError(f"sharded: {key}={w!r}: auto or one of {codecs.WIDTHS} (bits per code)")
    if names[d] != "eb":
      if key != "widths":
        raise ValueError(
          f"sharded: {key}= are code widths of codec=eb; the {d} codec is {names[d]}"
        )
      if "eb" not in names.values():
        raise ValueError(f"sharded: widths= are code widths of codec=eb; the codecs are {names}")
      return
    if w == "auto" and d in self._adaptive() and (self.bound or "current") != "rms":
      raise ValueError(
        f"sharded: widths=auto plans the bits from the bound, but the {d} bound "
        f"(bound={self.bound or 'current'}) is set from the bits (it fills the codes): "
        "give bound=rms (a tolerance) or a fixed eb="
      )
    if self.bound == "ema":
      raise ValueError(
        "sharded: widths= with bound=ema: the EMA's bound fills int8 codes; give bound=current, "
        "bound=rms or eb="
      )

  def _check_block(self) -> None:
    """Refuses a block size not in codecs.BLOCKS, or one where an eb direction has no code
    width."""
    if self.block is None:
      return
    names, coded = self.codec_names, self.code_widths
    if self.block not in codecs.BLOCKS:
      raise ValueError(f"sharded: block={self.block} values; one of {codecs.BLOCKS}")
    bare = [d for d in DIRECTIONS if names[d] == "eb" and coded[d] is None]
    if "eb" not in names.values() or bare:
      raise ValueError(
        "sharded: block= sets the block-wise steps of codec=eb's bit-packed codes; every eb "
        f"direction needs a code width (widths= or fwd_widths= / bwd_widths=): codecs {names}, "
        f"widths {coded}"
      )

  @property
  def rels(self) -> dict[str, float]:
    """{"fwd" | "bwd": bound=rms's relative bound}."""
    both = 0.1 if self.rel is None else self.rel
    return {
      "fwd": both if self.fwd_rel is None else self.fwd_rel,
      "bwd": both if self.bwd_rel is None else self.bwd_rel,
    }

  @property
  def code_widths(self) -> dict[str, str | int | None]:
    """{"fwd" | "bwd": the direction's eb code width (auto, bits, or None: int8 codes)}."""
    return {d: getattr(self, d + "_widths") or self.widths for d in DIRECTIONS}

  @property
  def codec_names(self) -> dict[str, str]:
    """{"fwd" | "bwd": the direction's codec}."""
    both = self.codec or "none"
    return {"fwd": self.fwd_codec or both, "bwd": self.bwd_codec or both}

  @property
  def fixed_bounds(self) -> dict[str, float]:
    """{"fwd" | "bwd": the direction's fixed error bound, 0 = adaptive}."""
    both = self.eb or 0.0
    return {
      "fwd": both if self.fwd_eb is None else self.fwd_eb,
      "bwd": both if self.bwd_eb is None else self.bwd_eb,
    }
