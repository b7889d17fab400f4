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

Files: options.py (`ShardedOptions`), placement.py (the placement planner), routing.py (ids
to their owners, pooled segments back: `Routing`), exchange.py (the all-to-all through a
codec and its f32 fallback: `CodecExchange`), update.py (the backward all-to-all and the
shared row update: `Update`); this file, the `Sharded` class (layout, memory, state,
checkpoints, prepare, the lookup), which those three mixins complete: the sharding type's
input distribution, lookup and output distribution read as the steps of one step.

Placement (`kind`): `auto` (default) puts a table row-wise when it holds more than 1 / k of
the group's bytes (it would unbalance the shards) and table-wise otherwise, assigning the
table-wise ones greedily (largest first) to the shard with the least cost, cost = its
share of the group's bytes + its share of expected lookups (bag length, or an access profile
JSON {table: lookups per example} given as `profile=path`). `table`, `row`, `column` force
one placement for every table of the group (give tables different plan strings to mix).

Codecs: `codec=` for both directions, `fwd_codec=` / `bwd_codec=` to override one; the error-
bounded `eb` takes `eb=<fixed bound>` (or `fwd_eb=`, `bwd_eb=`) or adapts per table and
iteration (`codecs.BoundRule`: `bound=current` from each iteration's own ranges, the
default, or `bound=ema`; `headroom=`; or `bound=rms`, a tolerance rel * each table's RMS,
scheduled by `warmup=` / `ramp=` / `late=`). `widths=2|4|8|16|auto` carries `eb`'s codes
bit-packed in that many bits per segment; `auto` re-plans them every `replan=` steps from
the range / bound ratio the tables reached (`replan`, a host check the trainer calls after
each step: the jitted steps close over `self.codecs` and are rebuilt when a width changes,
a few recompiles per run); `fwd_widths=` / `bwd_widths=` set one direction's. `block=16|32|
64|128|256` adds block-wise steps: each block of that many values (whole vectors of a segment
and destination) steps at its table's step * 2^(-j/4), j a one-byte header chosen from the
block's own range, so the table's bound is a ceiling and a small block (a small gradient, a
short pooled row) is carried relative to itself (codecs.Codec.block; 8 / block bits more per
value). A segment (table) that `eb` cannot carry within its
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

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from recgnn import sharding
from recgnn.backends.sharded.exchange import FALLBACK_SCOPE, CodecExchange
from recgnn.backends.sharded.options import ShardedOptions
from recgnn.backends.sharded.placement import KINDS, Placement, plan_placements
from recgnn.backends.sharded.routing import Routing
from recgnn.backends.sharded.update import Update
from recgnn.embeddings import base, codecs

P = sharding.P
__all__ = ["FALLBACK_SCOPE", "KINDS", "Placement", "Sharded", "ShardedOptions", "plan_placements"]


@base.register_backend("sharded")
class Sharded(Routing, CodecExchange, Update, base.Backend):
  """Model-parallel tables (see the module docstring). Options: `ShardedOptions`."""

  Options = ShardedOptions
  # Routes each device's ids to their owners; prepare is per example.
  capabilities = base.Capabilities(needs_split_ids=True)

  @classmethod
  def capabilities_for(cls, options):
    return cls._capabilities(ShardedOptions.parse(options))

  @staticmethod
  def _capabilities(o: ShardedOptions) -> base.Capabilities:
    # widths=auto re-plans the codes' widths (static shapes) while training.
    return base.Capabilities(needs_split_ids=True, replans_shapes="auto" in o.code_widths.values())

  def __init__(self, specs, mesh, layout: base.Layout | None = None, text: str = "", **options):
    super().__init__(specs, mesh, layout, text, **options)
    o = self.options
    self.capabilities = self._capabilities(o)
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
    rels = o.rels
    self.rules = {
      d: codecs.BoundRule(
        fixed=float(bound),
        headroom=0.25 if o.headroom is None else float(o.headroom),
        mode=o.bound or "current",
        rel=float(rels[d]),
        warmup=o.warmup or 0,
        ramp=o.ramp or 0,
        late=1.0 if o.late is None else float(o.late),
      )
      for d, bound in o.fixed_bounds.items()
    }
    nseg = len(self._segment_dims())

    # Code widths (eb): static shapes of the step. widths=auto starts at 8 bits and is
    # re-planned every `replan` steps by `replan` (a recompile when they change).
    def first(w):
      return {None: (), "auto": (8,) * nseg}.get(w, (w,) * nseg)

    self.codecs = {
      d: codecs.Codec(c, self._segment_dims(), first(o.code_widths[d]), block=o.block or 0)
      if c == "eb"
      else codecs.Codec(c, self._segment_dims())
      for d, c in self.options.codec_names.items()
    }
    self.replan_every = (o.replan or 100) if self.capabilities.replans_shapes else 0
    self.width_changes = 0  # re-plans that changed some width (each a recompile)
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
    return {d: self.rules[d].init(t, c.widths) for d, c in self.codecs.items() if c.needs_bound}

  def replan(self, state, step: int):
    """widths=auto, every `replan` steps (the trainer calls it after each step; a host read
    of T floats then): each segment's code width from the range / bound ratio its tables
    reached since the last plan (`BoundRule.peak`), with the headroom. -> (state with the
    new widths and the window reset, whether a width changed: the caller then rebuilds its
    jitted steps, which close over `self.codecs`)."""
    if not self.replan_every or step % self.replan_every or not state["codec"]:
      return state, False
    host = jax.device_get(state["codec"])
    changed = False
    for d, s in host.items():
      if self.options.code_widths[d] != "auto":
        continue
      if int(s["steps"]) == 0:
        continue
      widths = self._plan_widths(np.asarray(s["peak"]), self.rules[d].headroom)
      if widths != self.codecs[d].widths:
        self.codecs[d] = dataclasses.replace(self.codecs[d], widths=widths)
        changed = True
      host[d] = {
        **s,
        "peak": np.zeros_like(s["peak"]),
        "widths": np.asarray(widths, np.int32),
      }
    self.width_changes += int(changed)
    return {**state, "codec": sharding.put(host, self.state_sharding()["codec"])}, changed

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
      bounds = self._direction_bounds(state["codec"], "fwd", segs, True)
      recv, fell = self._exchange(
        self.codecs["fwd"],
        segs,
        self._seg_bounds(bounds, sender=True, owner_is_sender=True),
        self._seg_bounds(bounds, sender=False, owner_is_sender=True),
      )
      res = {"routed": routed}
      if bounds_on:
        t = len(self.specs)
        res["fwd"] = {"max": self._wire_max(segs, True), "fell": fell, "bound": bounds[:t]}
      return self._assemble(recv, count), res

    return local(state, {"ids": ids, "count": count})

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
    # Keys an older checkpoint lacks (peak, widths) start afresh.
    codec = {
      d: {
        k: np.asarray(extras["codec"][d].get(k, v), dtype=np.asarray(v).dtype)
        for k, v in fresh[d].items()
      }
      for d in fresh
    }
    for d, s in codec.items():
      # The widths the saved run's step was compiled with: the step is built with them.
      widths = tuple(int(w) for w in s["widths"] if w)
      if self.codecs[d].widths and len(widths) == len(self.codecs[d].dims):
        self.codecs[d] = dataclasses.replace(self.codecs[d], widths=widths)
      s["widths"] = np.asarray(self.codecs[d].widths or (0,), np.int32)
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
      if self.codecs[d].widths:
        # Coded bits per value, averaged over the steps (the widths change with re-plans).
        out[f"{d}/mean_bits_per_value"] = float(s["wire_bits"]) / max(int(s["steps"]), 1)
        out[f"{d}/width_changes"] = self.width_changes
        for i, w in enumerate(self.codecs[d].widths):
          out[f"{d}/width/{i}"] = w
      for n, i in self.table_index.items():
        out[f"{d}/bound/{n}"] = float(s["bound"][i])
    return out
