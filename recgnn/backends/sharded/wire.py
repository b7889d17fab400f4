"""sharded's codecs: each direction's `codecs.Codec` (its code widths a static shape of the
step, re-planned with widths=auto), the adaptive bounds' rules and their state, and what they
report.

One concern: what the all-to-all's message is coded with, and how that changes while
training. `Wire` is an object the `Sharded` front holds (recgnn/backends/sharded/backend.py);
the exchange (exchange.py) reads its codecs when the step is traced, so a width change is
seen by the steps the trainer rebuilds after `replan` says so.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from recgnn import sharding
from recgnn.backends.sharded.geometry import Geometry
from recgnn.backends.sharded.options import ShardedOptions
from recgnn.embeddings import codecs as codecs_lib

P = sharding.P


class Wire:
  """codecs: {"fwd" | "bwd": Codec}; rules: {direction: BoundRule} of the directions whose
  bound adapts. replan_every: steps between width plans (0: widths fixed)."""

  def __init__(self, geometry: Geometry, o: ShardedOptions, replans: bool):
    self._g, self._o = geometry, o
    rels = o.rels
    self.rules = {
      d: codecs_lib.BoundRule(
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
    dims = geometry.segment_dims()

    # Code widths (eb): static shapes of the step. widths=auto starts at 8 bits and is
    # re-planned every `replan` steps by `replan` (a recompile when they change).
    def first(w):
      return {None: (), "auto": (8,) * len(dims)}.get(w, (w,) * len(dims))

    self.codecs = {
      d: codecs_lib.Codec(c, dims, first(o.code_widths[d]), block=o.block or 0)
      if c == "eb"
      else codecs_lib.Codec(c, dims)
      for d, c in o.codec_names.items()
    }
    self.replan_every = (o.replan or 100) if replans else 0
    self.width_changes = 0  # re-plans that changed some width (each a recompile)

  # ------------------------------------------------------------------ state
  def init_state(self) -> dict:
    """The adaptive bounds' state of each direction that has one (`BoundRule.init`)."""
    t = len(self._g.specs)
    return {d: self.rules[d].init(t, c.widths) for d, c in self.codecs.items() if c.needs_bound}

  def state_sharding(self) -> dict:
    return jax.tree.map(lambda _: sharding.named(self._g.mesh, P()), self.init_state())

  def replan(self, state, step: int):
    """widths=auto, every `replan` steps (the trainer calls it after each step; a host read
    of T floats then): each segment's code width from the range / bound ratio its tables
    reached since the last plan (`BoundRule.peak`), with the headroom. -> (state with the
    new widths and the window reset, whether a width changed: the caller then rebuilds its
    jitted steps, which close over the codecs)."""
    if not self.replan_every or step % self.replan_every or not state["codec"]:
      return state, False
    host = jax.device_get(state["codec"])
    changed = False
    for d, s in host.items():
      if self._o.code_widths[d] != "auto":
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
    return {**state, "codec": sharding.put(host, self.state_sharding())}, changed

  def _plan_widths(self, peak: np.ndarray, headroom: float) -> tuple[int, ...]:
    """Each segment's code width: the widest of its tables' (a table-wise slot carries one
    table of each shard), each the narrowest holding the table's peak range / bound."""
    idx, t = self._g.segment_tables(), len(self._g.specs)
    out = []
    for s in range(idx.shape[1]):
      tables = [int(i) for i in idx[:, s] if i < t]
      out.append(max([codecs_lib.width_for(float(peak[i]), headroom) for i in tables] + [2]))
    return tuple(out)

  # ------------------------------------------------------------------ checkpoints
  def extras(self, state, text: str):
    """The codec's adaptive state (bounds, EMAs, counters), for the checkpoint."""
    if not state["codec"]:
      return {}
    host = jax.device_get(state["codec"])
    return {
      "backend": text,
      "tables": list(self._g.specs),
      "codec": {d: {k: np.asarray(v).tolist() for k, v in s.items()} for d, s in host.items()},
    }

  def restore_extras(self, state, extras):
    # Only into the same tables and codecs; otherwise the bounds start afresh.
    if extras.get("tables") != list(self._g.specs) or set(extras.get("codec", {})) != set(
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
    return {**state, "codec": sharding.put(codec, self.state_sharding())}

  # ------------------------------------------------------------------ reporting
  def wire_bytes(self, batch: int) -> dict[str, int]:
    """Bytes each device sends per step in each direction's all-to-all (payload only; the
    ids' routing adds L int32 per example and table)."""
    b = batch // self._g.mesh.size
    return {d: codecs_lib.payload_bytes(c, self._g.k * b) for d, c in self.codecs.items()}

  def stats(self, batch: int):
    """Per step: each direction's all-to-all payload bytes per device (at `batch`, the last
    prepared batch's size; 0: none yet) and bits per value."""
    out = {}
    wire = self.wire_bytes(batch) if batch else {}
    for d, c in self.codecs.items():
      out[f"{d}_bits_per_value"] = c.bits_per_value()
      out[f"{d}_values_per_vector"] = c.width
      if d in wire:
        out[f"{d}_bytes_per_step"] = wire[d]
    return out

  def report(self, state) -> dict[str, float]:
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
      for n, i in self._g.table_index.items():
        out[f"{d}/bound/{n}"] = float(s["bound"][i])
    return out
