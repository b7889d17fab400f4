"""`sharded`: model-parallel tables over the mesh's MODEL axis, the embedding all-to-all in
shard_map, optionally carried by a lossy codec (recgnn/embeddings/codecs.py).

DLRM's model parallelism (TorchRec's table-, row- and column-wise sharding), replicated over
DATA (2D parallelism). Within a MODEL group of k devices (the devices sharing a DATA index,
holding k * b consecutive examples of the batch, b per device):

  table-wise   a whole table on one MODEL shard. Its ids go to the owner (all-to-all of ids),
               the owner gathers and pools them for the group's k * b examples, and the
               pooled [b, D] blocks go back to each example's device (the all-to-all).
  row-wise     rows split over MODEL. Ids all-gathered over MODEL; each shard pools the rows
               it owns (zeros elsewhere) and the partial sums go back through the same
               all-to-all, summed by the receiver (a reduce-scatter's bytes).
  column-wise  dims split over MODEL (D / k columns per shard). Ids all-gathered; each shard
               pools its columns; the all-to-all returns each device its examples' columns.

Forward and backward move ONE fused message per step and direction: every table's segment
of every example, [k, b, W] per device (W = Tmax * D + sum of row-wise D + sum of column-wise
D / k, Tmax the most tables one shard owns), so one all-to-all per payload array (one for
f32; codes + scales for int8). Backward is the reverse: pooled gradients to the owners, then
an all-gather over DATA of (ids, gradients) of the group's examples so every replica of a
shard applies the same sparse row-wise update (SGD, row-wise Adagrad): O(B) bytes, never a
table-sized all-reduce. The lookup's routing (each device's routed ids) and, under an
adaptive forward codec, the forward message's statistics reach `update` as the contract's
residuals (as TorchRec keeps them from the forward): nothing is routed or pooled twice.

Files: placement.py (the placement planner); this file, the `Sharded` group (routing, the
fused all-to-all and its codec fallback, the update), one class: the sharding type's input
distribution, lookup and output distribution read as the steps of one step.

Placement (`kind`): `auto` (default) puts a table row-wise when it holds more than 1 / k of
the group's bytes (it would unbalance the shards) and table-wise otherwise, assigning the
table-wise ones greedily (largest first) to the shard with the least cost, cost = its
share of the group's bytes + its share of expected lookups (bag length, or an access profile
JSON {table: lookups per example} given as `profile=path`). `table`, `row`, `column` force
one placement for every table of the group (give tables different plan strings to mix).

Codecs: `codec=` for both directions, `fwd_codec=` / `bwd_codec=` to override one; the error-
bounded `eb` takes `eb=<fixed bound>` (or `fwd_eb=`, `bwd_eb=`) or adapts per table and
iteration (`codecs.BoundRule`: `bound=current` from each iteration's own ranges, the
default, or `bound=ema`; `headroom=`). A segment (table) that `eb` cannot carry within its
bound goes again as f32 that step (agreed over the mesh, so every device takes the same
branch); the count of such fallbacks is in the state and in `report`.

State: {"tw": {"rows": f32[k, R, D], slots: f32[k, R]} (split over MODEL; shard m holds its
tables one after another), "rw": {t: {"rows": f32[S, D] P(MODEL), slots}}, "cw": {t: {"rows":
f32[S, D] P(None, MODEL), slots replicated}}, "codec": {"fwd"|"bwd": BoundRule state}}.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from recgnn import sharding
from recgnn.backends.sharded.placement import KINDS, Placement, plan_placements  # noqa: F401
from recgnn.embeddings import base, codecs, row_sharded

P = sharding.P
FALLBACK_SCOPE = "codec_fallback"  # named scope of the f32 fallback all-to-all (comms.py)


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
    bound: current | ema: the adaptive bound's rule (`codecs.BoundRule`); current when not
      given. Only where a direction adapts (codec=eb without a fixed bound).
    headroom: the adaptive bound's headroom over the measured range (0.25 when not given).
      Only where a direction adapts.
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

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"sharded: unknown kind {self.kind!r}; available: {', '.join(KINDS)}")
    if self.profile and self.kind in ("row", "column"):
      raise ValueError(
        f"sharded: profile= (lookups per table) balances table-wise placements; with "
        f"kind={self.kind} every table is split over every shard and nothing uses it: drop "
        "profile="
      )
    for both, one in (("codec", "_codec"), ("eb", "_eb")):
      if getattr(self, both) is not None and all(
        getattr(self, d + one) is not None for d in DIRECTIONS
      ):
        raise ValueError(
          f"sharded: {both}={getattr(self, both)} is overridden in both directions by "
          f"fwd{one}= and bwd{one}=, so nothing uses it: drop {both}="
        )
    names, fixed = self.codec_names, self.fixed_bounds
    for d in DIRECTIONS:
      codecs.Codec(names[d], ())  # refuses an unknown codec
      if fixed[d] and names[d] != "eb":
        raise ValueError(
          f"sharded: the {d} bound {fixed[d]:g} (eb= / {d}_eb=) is an error bound for "
          f"codec=eb; the codecs are {names}"
        )
    # bound= and headroom= steer the adaptive rule: refuse them where nothing adapts.
    adaptive = [d for d in DIRECTIONS if names[d] == "eb" and not fixed[d]]
    given = [
      f"{k}={v}" for k, v in (("bound", self.bound), ("headroom", self.headroom)) if v is not None
    ]
    if given and not adaptive:
      raise ValueError(
        f"sharded: {', '.join(given)} tune the adaptive eb bound, but no direction adapts "
        f"(codecs {names}, fixed bounds fwd {fixed['fwd']:g} / bwd {fixed['bwd']:g}); drop "
        "them, or give codec=eb without eb= for adaptive bounds"
      )

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


@base.register_backend("sharded")
class Sharded(base.Backend):
  """Model-parallel tables (see the module docstring). Options: `ShardedOptions`."""

  Options = ShardedOptions
  # Routes each device's ids to their owners; prepare is per example.
  capabilities = base.Capabilities(needs_split_ids=True)

  def __init__(self, specs, mesh, layout: base.Layout | None = None, text: str = "", **options):
    super().__init__(specs, mesh, layout, text, **options)
    o = self.options
    if not self.layout.split_batch:
      raise ValueError(
        "sharded: this task's batches are replicated over the devices (split_batch=False); "
        "model-parallel tables need the batch split over the mesh. Use dense or offload here."
      )
    self.k = mesh.shape[sharding.MODEL]
    self.n_data = mesh.shape[sharding.DATA]
    if base.ROW_ALIGN % self.k:
      raise ValueError(
        f"sharded: the mesh's model axis has {self.k} devices; sharded tables need a model size "
        f"dividing {base.ROW_ALIGN} (1, 2, 4, 8, ...) so that checkpoints restore on any such mesh."
      )
    opts = {s.optimizer for s in self.specs.values()}
    if len(opts) > 1:
      raise ValueError(
        "sharded: every table of a group must share its optimizer (one fused update); got "
        + ", ".join(
          f"{n}: {s.optimizer.name}(lr={s.optimizer.learning_rate})" for n, s in self.specs.items()
        )
        + ". Give tables with other optimizers another plan string."
      )
    self.optimizer = next(iter(opts))
    lookups = None
    if o.profile:
      with open(o.profile) as f:
        lookups = {k: float(v) for k, v in json.load(f).items()}
    self.placement = plan_placements(self.specs, self.k, o.kind, lookups)
    self.tw = [n for n, p in self.placement.items() if p.kind == "table"]
    self.rw = [n for n, p in self.placement.items() if p.kind == "row"]
    self.cw = [n for n, p in self.placement.items() if p.kind == "column"]
    dims = {self.specs[n].dim for n in self.tw}
    if len(dims) > 1:
      raise ValueError(
        "sharded: table-wise tables of one group share one array per shard, so they need one "
        f"dim; got {sorted(dims)} ({', '.join(f'{n}: {self.specs[n].dim}' for n in self.tw)}). "
        "Give tables of another dim another plan string, or kind=row."
      )
    self.dim_tw = dims.pop() if dims else 0
    # Table-wise layout: owner_slots[m][s] = the table in slot s of shard m (None: empty).
    self.tmax = max([p.slot + 1 for p in self.placement.values() if p.kind == "table"] + [0])
    self.owner_slots = [[None] * self.tmax for _ in range(self.k)]
    for n in self.tw:
      p = self.placement[n]
      self.owner_slots[p.shard][p.slot] = n
    shard_rows = [
      sum(self.specs[n].num_rows for n in slots if n is not None) for slots in self.owner_slots
    ]
    self.rows_tw = max(shard_rows + [1])
    self.table_index = {n: i for i, n in enumerate(self.specs)}
    self.rules = {
      d: codecs.BoundRule(
        fixed=float(bound),
        headroom=0.25 if o.headroom is None else float(o.headroom),
        mode=o.bound or "current",
      )
      for d, bound in o.fixed_bounds.items()
    }
    self.codecs = {
      d: codecs.Codec(c, self._segment_dims()) for d, c in self.options.codec_names.items()
    }
    self._jitted = {}
    self._batch = 0  # the last prepared batch's size (for `stats`)
    logging.info("sharded placements:\n%s", self.format_placements())

  # ------------------------------------------------------------------------- layout

  def describe(self, table=None):
    if table is None:
      return self.text
    p = self.placement[table]
    where = f"table@{p.shard}" if p.kind == "table" else p.kind
    return f"{self.text} [{where}]"

  def _segment_dims(self) -> tuple[int, ...]:
    """Widths of the fused message's segments: Tmax table-wise slots, row-wise tables,
    column-wise tables' column blocks."""
    return (
      (self.dim_tw,) * self.tmax
      + tuple(self.specs[n].dim for n in self.rw)
      + tuple(self.specs[n].dim // self.k for n in self.cw)
    )

  def _segment_tables(self) -> np.ndarray:
    """int32[k, nseg]: the table index (into the bounds vector) of each segment as sent by
    shard m; T (a dummy) for an empty slot."""
    t = len(self.specs)
    out = []
    for m in range(self.k):
      row = [t if n is None else self.table_index[n] for n in self.owner_slots[m]]
      row += [self.table_index[n] for n in self.rw + self.cw]
      out.append(row)
    return np.asarray(out, np.int32).reshape(self.k, len(self._segment_dims()))

  def format_placements(self) -> str:
    lines = [f"{'table':<12} {'rows':>12} {'placement':<12} {'bytes on its devices':>20}"]
    for n, p in self.placement.items():
      s = self.specs[n]
      where = f"shard {p.shard}" if p.kind == "table" else f"{p.kind}-wise"
      per = s.table_bytes if p.kind == "table" else -(-s.table_bytes // self.k)
      lines.append(f"{n:<12} {s.num_rows:>12,} {where:<12} {per:>20,}")
    per_dev = self.device_bytes_by_shard()
    lines.append("per MODEL shard: " + ", ".join(f"{b / 2**20:.1f}M" for b in per_dev))
    lines.append(
      f"wire per example: fwd {self.codecs['fwd'].name} {self.codecs['fwd'].bits_per_value():.1f} "
      f"bits/value, bwd {self.codecs['bwd'].name} {self.codecs['bwd'].bits_per_value():.1f}; "
      f"{sum(self._segment_dims())} values per destination"
    )
    return "\n".join(lines)

  # ------------------------------------------------------------------------- memory

  def _slots(self):
    return self.optimizer.slot_names()

  def device_bytes_by_shard(self) -> list[int]:
    """Bytes each MODEL shard holds (the same on every DATA replica)."""
    nslot = len(self._slots())
    tw = self.rows_tw * (4 * self.dim_tw + 4 * nslot) if self.tw else 0
    rw = sum(
      base.aligned_rows(self.specs[n].num_rows) // self.k * self.specs[n].row_bytes for n in self.rw
    )
    cw = sum(
      base.aligned_rows(self.specs[n].num_rows) * (4 * self.specs[n].dim // self.k + 4 * nslot)
      for n in self.cw
    )
    return [tw + rw + cw] * self.k

  def memory(self):
    out = {}
    for n, p in self.placement.items():
      s = self.specs[n]
      if p.kind == "table":
        out[n] = base.MemoryReport(s.table_bytes, 0, f"whole on MODEL shard {p.shard}")
      elif p.kind == "row":
        out[n] = base.MemoryReport(
          base.aligned_rows(s.num_rows) // self.k * s.row_bytes, 0, f"rows over {self.k} devices"
        )
      else:
        out[n] = base.MemoryReport(
          base.aligned_rows(s.num_rows) * (4 * s.dim // self.k + 4 * len(self._slots())),
          0,
          f"columns over {self.k} devices",
        )
    return out

  def device_bytes(self) -> int:
    """The most one device holds for the whole group (table-wise tables live on one shard,
    so the per-table figures of `memory` do not add up to it)."""
    return max(self.device_bytes_by_shard())

  # ------------------------------------------------------------------------- state

  def state_sharding(self):
    named = functools.partial(sharding.named, self.mesh)
    out = {}
    if self.tw:
      out["tw"] = {"rows": named(P(sharding.MODEL, None, None))}
      out["tw"].update({s: named(P(sharding.MODEL, None)) for s in self._slots()})
    out["rw"] = {
      n: {
        "rows": named(P(sharding.MODEL, None)),
        **{s: named(P(sharding.MODEL)) for s in self._slots()},
      }
      for n in self.rw
    }
    out["cw"] = {
      n: {"rows": named(P(None, sharding.MODEL)), **{s: named(P()) for s in self._slots()}}
      for n in self.cw
    }
    out["codec"] = jax.tree.map(lambda _: named(P()), self._codec_init())
    return out

  def _codec_init(self):
    t = len(self.specs)
    return {d: self.rules[d].init(t) for d, c in self.codecs.items() if c.needs_bound}

  def init(self, key):
    init = {n: base.init_table(base.table_key(key, n), s) for n, s in self.specs.items()}
    return self._from_rows(init, None)

  def _from_rows(self, rows: dict[str, np.ndarray], slots: dict[str, dict[str, np.ndarray]] | None):
    """Host arrays of the state from each table's rows f32[N, D] (and slots f32[N])."""
    opt = self.optimizer
    state = {}
    if self.tw:
      tw = np.zeros((self.k, self.rows_tw, self.dim_tw), np.float32)
      tws = {
        s: np.full((self.k, self.rows_tw), opt.initial_accumulator, np.float32)
        for s in self._slots()
      }
      for n in self.tw:
        p, num = self.placement[n], self.specs[n].num_rows
        tw[p.shard, p.offset : p.offset + num] = rows[n][:num]
        for s in self._slots():
          if slots is not None:
            tws[s][p.shard, p.offset : p.offset + num] = slots[n][s][:num]
      state["tw"] = {"rows": tw, **tws}
    for kind, names in (("rw", self.rw), ("cw", self.cw)):
      state[kind] = {}
      for n in names:
        spec = self.specs[n]
        a = base.aligned_rows(spec.num_rows)
        r = np.zeros((a, spec.dim), np.float32)
        r[: spec.num_rows] = rows[n][: spec.num_rows]
        sl = {}
        for s in self._slots():
          sl[s] = np.full(a, opt.initial_accumulator, np.float32)
          if slots is not None:
            sl[s][: spec.num_rows] = slots[n][s][: spec.num_rows]
        state[kind][n] = {"rows": r, **sl}
    state["codec"] = jax.device_get(self._codec_init())
    return sharding.put(state, self.state_sharding())

  def tables(self, state):
    host = jax.device_get({k: v for k, v in state.items() if k != "codec"})
    out = {}
    for n, p in self.placement.items():
      num = self.specs[n].num_rows
      if p.kind == "table":
        out[n] = np.asarray(host["tw"]["rows"][p.shard, p.offset : p.offset + num])
      else:
        out[n] = np.asarray(host["rw" if p.kind == "row" else "cw"][n]["rows"][:num])
    return out

  # ------------------------------------------------------------------------- checkpoints

  def logical_format(self, table):
    return "rows"

  def logical_target(self):
    rows = sharding.named(self.mesh, P(sharding.MODEL, None))
    vec = sharding.named(self.mesh, P(sharding.MODEL))
    out = {}
    for n, s in self.specs.items():
      a = base.aligned_rows(s.num_rows)
      out[n] = {"rows": jax.ShapeDtypeStruct((a, s.dim), jnp.float32, sharding=rows)}
      out[n].update(
        {k: jax.ShapeDtypeStruct((a,), jnp.float32, sharding=vec) for k in self._slots()}
      )
    return out

  def export(self, state):
    if "export" not in self._jitted:
      target = jax.tree.map(lambda x: x.sharding, self.logical_target())

      def fn(state):
        out = {}
        for n, p in self.placement.items():
          a, num = base.aligned_rows(self.specs[n].num_rows), self.specs[n].num_rows
          if p.kind == "table":
            src = state["tw"]
            out[n] = {
              k: jnp.pad(
                v[p.shard, p.offset : p.offset + num], [(0, a - num)] + [(0, 0)] * (v.ndim - 2)
              )
              for k, v in src.items()
            }
          else:
            out[n] = dict(state["rw" if p.kind == "row" else "cw"][n])
        return out

      self._jitted["export"] = jax.jit(fn, out_shardings=target)
    return self._jitted["export"](state)

  def import_(self, logical):
    if "import" not in self._jitted:

      def fn(logical):
        state = {}
        if self.tw:
          tw = {"rows": jnp.zeros((self.k, self.rows_tw, self.dim_tw), jnp.float32)}
          tw.update(
            {
              s: jnp.full((self.k, self.rows_tw), self.optimizer.initial_accumulator)
              for s in self._slots()
            }
          )
          for n in self.tw:
            p, num = self.placement[n], self.specs[n].num_rows
            for k in tw:
              tw[k] = tw[k].at[p.shard, p.offset : p.offset + num].set(logical[n][k][:num])
          state["tw"] = tw
        state["rw"] = {n: dict(logical[n]) for n in self.rw}
        state["cw"] = {n: dict(logical[n]) for n in self.cw}
        state["codec"] = self._codec_init()
        return state

      self._jitted["import"] = jax.jit(fn, out_shardings=self.state_sharding())
    return self._jitted["import"](logical)

  # ------------------------------------------------------------------------- host side

  def prepare(self, ids, upcoming=(), *, train=True):
    del upcoming
    out = {"ids": {}, "count": {}}
    for n, s in self.specs.items():
      x = np.asarray(ids[n])
      # Out-of-range ids would be dropped silently by the gathers: refuse them here.
      if x.size and (x.max() >= s.num_rows or x.min() < base.PAD):
        raise ValueError(f"sharded: table {n!r} got ids outside [-1, {s.num_rows})")
      out["ids"][n] = x.astype(np.int32)
      if train:  # the global batch (a process-local slice is 1 / processes of it)
        self._batch = x.shape[0] * (jax.process_count() if self.process_local else 1)
      if s.pooling == "mean":
        out["count"][n] = np.sum(x >= 0, axis=1).astype(np.int32)
    return out

  def prepared_spec(self, prepared):
    return jax.tree.map(lambda _: sharding.BATCH_SPEC, prepared)

  # ------------------------------------------------------------------------- device side

  def _specs_in(self):
    """shard_map in_specs of the state (MODEL-split storage, replicated codec state)."""
    spec = jax.tree.map(
      lambda s: s.spec,
      self.state_sharding(),
      is_leaf=lambda x: isinstance(x, jax.sharding.Sharding),
    )
    return spec

  def _bounds(self, codec_state, direction):
    """f32[T + 1] error bounds (the last one for empty slots), or None."""
    if direction not in codec_state:
      return None
    return jnp.concatenate([codec_state[direction]["bound"], jnp.ones((1,), jnp.float32)])

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

  def _exchange(self, codec, segs, send_bounds, recv_bounds):
    """All-to-all over MODEL of a message of segments [k, b, w] through `codec`, with the f32
    fallback of the segments it cannot carry within their bound. -> (segments [k (source),
    b, w], bool[nseg]: the segments sent as f32)."""

    def raw(segs, scope):
      with jax.named_scope(scope):
        x = jnp.concatenate(segs, axis=-1)
        return codec._split(jax.lax.all_to_all(x, sharding.MODEL, 0, 0))

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

  def _bounds_now(self, direction, segs, forward: bool):
    """f32[T + 1] bounds from this message's largest |value| per table (mode "current")."""
    step_max = self._wire_max(segs, forward)
    return jnp.concatenate([self.rules[direction].from_max(step_max), jnp.ones((1,), jnp.float32)])

  def _seg_bounds(self, bounds, sender: bool, owner_is_sender: bool):
    """Bounds f32 of each segment, broadcastable to [k, b, nseg], or None."""
    if bounds is None:
      return None
    idx = jnp.asarray(self._segment_tables())
    if owner_is_sender == sender:
      # The segments of this device's own table-wise slots: one row of the table.
      return bounds[idx[jax.lax.axis_index(sharding.MODEL)]]
    return bounds[idx][:, None, :]  # per peer (the peer's slots)

  def lookup(self, state, prepared):
    """-> (pooled, residuals). Residuals: this device's routing (`_local_pool`), split with
    the batch, and with an adaptive forward codec the forward message's statistics
    {"max": f32[T], "fell": bool[segments]} (global), so `update` neither routes the ids
    again nor recomputes the forward pooling."""
    ids, count = prepared["ids"], prepared["count"]
    in_specs = (self._specs_in(), P(sharding.BATCH))
    bounds_on = "fwd" in state["codec"]
    res_spec = {"routed": P(sharding.BATCH), **({"fwd": P()} if bounds_on else {})}

    @functools.partial(
      jax.shard_map,
      mesh=self.mesh,
      in_specs=(in_specs[0], {"ids": P(sharding.BATCH), "count": P(sharding.BATCH)}),
      out_specs=(P(sharding.BATCH), res_spec),
      check_vma=False,
    )
    def local(state, prepared):
      ids, count = prepared["ids"], prepared["count"]
      segs, routed = self._local_pool(state, ids)
      bounds = self._bounds(state["codec"], "fwd") if bounds_on else None
      if bounds_on and self.rules["fwd"].uses_current:
        bounds = self._bounds_now("fwd", segs, True)
      recv, fell = self._exchange(
        self.codecs["fwd"],
        segs,
        self._seg_bounds(bounds, sender=True, owner_is_sender=True),
        self._seg_bounds(bounds, sender=False, owner_is_sender=True),
      )
      res = {"routed": routed}
      if bounds_on:
        res["fwd"] = {"max": self._wire_max(segs, True), "fell": fell}
      return self._assemble(recv, count), res

    return local(state, {"ids": ids, "count": count})

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

  def update(self, state, prepared, residuals, grads):
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
      bounds = self._bounds(codec_state, "bwd")
      if bounds is not None and self.rules["bwd"].uses_current:
        bounds = self._bounds_now("bwd", segs, False)
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
          codec_state["bwd"], self._wire_max(segs, False), fell_b, self.codecs["bwd"].dims
        )
      if "fwd" in codec_state:
        # The forward message's statistics and fallbacks, as the lookup measured them.
        fwd = residuals["fwd"]
        new["codec"] = dict(new["codec"])
        new["codec"]["fwd"] = self.rules["fwd"].next(
          codec_state["fwd"], fwd["max"], fwd["fell"], self.codecs["fwd"].dims
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

  def _wire_max(self, segs, forward: bool):
    """f32[T]: the largest |value| each table put on the wire this step (over the mesh)."""
    t = len(self.specs)
    idx = jnp.asarray(self._segment_tables())
    if forward:
      seg_idx = idx[jax.lax.axis_index(sharding.MODEL)]
      m = jnp.stack([jnp.max(jnp.abs(s)) for s in segs])
    else:  # backward: segment s sent to peer j belongs to peer j's table
      seg_idx = idx.T.reshape(-1)  # [nseg * k]
      m = jnp.stack([jnp.max(jnp.abs(s), axis=(1, 2)) for s in segs]).reshape(-1)
    out = jnp.zeros((t + 1,), jnp.float32).at[seg_idx].max(m)
    return jax.lax.pmax(out, (sharding.DATA, sharding.MODEL))[:t]

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

  # ------------------------------------------------------------------------- reporting

  def wire_bytes(self, batch: int) -> dict[str, int]:
    """Bytes each device sends per step in each direction's all-to-all (payload only; the
    ids' routing adds L int32 per example and table)."""
    b = batch // self.mesh.size
    return {d: codecs.payload_bytes(c, self.k * b) for d, c in self.codecs.items()}

  def stats(self):
    """Per step: each direction's all-to-all payload bytes per device (at the last prepared
    batch's size; the fallback steps of `eb` send f32, see `report`) and bits per value."""
    out = {}
    wire = self.wire_bytes(self._batch) if self._batch else {}
    for d, c in self.codecs.items():
      out[f"{d}_bits_per_value"] = c.bits_per_value()
      out[f"{d}_values_per_vector"] = c.width
      if d in wire:
        out[f"{d}_bytes_per_step"] = wire[d]
    return out

  def extras(self, state):
    """The codec's adaptive state (bounds, EMAs, counters), for the checkpoint."""
    if not state["codec"]:
      return {}
    host = jax.device_get(state["codec"])
    return {
      "backend": self.text,
      "tables": list(self.specs),
      "codec": {d: {k: np.asarray(v).tolist() for k, v in s.items()} for d, s in host.items()},
    }

  def restore_extras(self, state, extras):
    # Only into the same tables and codecs; otherwise the bounds start afresh.
    if extras.get("tables") != list(self.specs) or set(extras.get("codec", {})) != set(
      state["codec"]
    ):
      return state
    fresh = jax.device_get(state["codec"])
    codec = {
      d: {k: np.asarray(v, dtype=np.asarray(fresh[d][k]).dtype) for k, v in s.items()}
      for d, s in extras["codec"].items()
    }
    return {**state, "codec": sharding.put(codec, self.state_sharding()["codec"])}

  def report(self, state):
    return {**self.stats(), **self.codec_report(state)}

  def codec_report(self, state) -> dict[str, float]:
    """Bounds and fallbacks of an `eb` codec (reads the state: host sync; not per step)."""
    out = {}
    for d, s in jax.device_get(state["codec"]).items():
      out[f"{d}/fallbacks"] = int(s["fallbacks"])
      out[f"{d}/fallback_values"] = int(s["fallback_values"])
      out[f"{d}/steps"] = int(s["steps"])
      for n, i in self.table_index.items():
        out[f"{d}/bound/{n}"] = float(s["bound"][i])
    return out


def _all_to_all_bits(x: jax.Array) -> jax.Array:
  """all_to_all over MODEL (split and concat on axis 0) that moves x's own bits: XLA:CPU
  widens bf16 and fp8 collectives to f32 / f16 (measured from the HLO: a bf16 all-to-all
  moved as many bytes as f32), so narrow floats travel bitcast to unsigned ints."""
  if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize < 4:
    carrier = {1: jnp.uint8, 2: jnp.uint16}[x.dtype.itemsize]
    y = jax.lax.all_to_all(jax.lax.bitcast_convert_type(x, carrier), sharding.MODEL, 0, 0)
    return jax.lax.bitcast_convert_type(y, x.dtype)
  return jax.lax.all_to_all(x, sharding.MODEL, 0, 0)
