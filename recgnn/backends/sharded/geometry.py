"""sharded's frozen layout: what the constructor decides once from the specs, the mesh and the
options, and every other part reads (never changes).

One concern: where every table and every message segment lives. The placements (the planner:
placement.py), the table-wise slots of each MODEL shard, the fused message's segments and
which table each carries, the bytes each shard holds, the storage's shardings.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import numpy as np

from recgnn import sharding
from recgnn.backends.sharded.options import ShardedOptions
from recgnn.backends.sharded.placement import Placement, plan_placements
from recgnn.embeddings import base

P = sharding.P


@dataclasses.dataclass(frozen=True, eq=False)
class Geometry:
  """sharded's layout, fixed at construction (`build`).

  k / n_data: the mesh's MODEL / DATA sizes. placement: {table: Placement}; tw / rw / cw: the
  table-, row- and column-wise tables, in specs order. dim_tw: the table-wise tables' one dim
  (0: none); tmax: the most table-wise tables one shard owns; owner_slots[m][s]: the table in
  slot s of shard m (None: empty); rows_tw: the rows of the largest shard's table-wise array.
  table_index: {table: its index in per-table vectors (the codecs' bounds)}."""

  specs: dict[str, base.TableSpec]
  mesh: jax.sharding.Mesh
  k: int
  n_data: int
  optimizer: base.OptimizerSpec
  placement: dict[str, Placement]
  tw: list[str]
  rw: list[str]
  cw: list[str]
  dim_tw: int
  tmax: int
  owner_slots: list[list[str | None]]
  rows_tw: int
  table_index: dict[str, int]

  @classmethod
  def build(cls, specs: dict[str, base.TableSpec], mesh, layout: base.Layout, o: ShardedOptions):
    """The layout, or a ValueError naming what the mesh, layout or tables cannot serve."""
    if not layout.split_batch:
      raise ValueError(
        "sharded: this task's batches are replicated over the devices (split_batch=False); "
        "model-parallel tables need the batch split over the mesh. Use dense or offload here."
      )
    k = mesh.shape[sharding.MODEL]
    if base.ROW_ALIGN % k:
      raise ValueError(
        f"sharded: the mesh's model axis has {k} devices; sharded tables need a model size "
        f"dividing {base.ROW_ALIGN} (1, 2, 4, 8, ...) so that checkpoints restore on any such mesh."
      )
    opts = {s.optimizer for s in specs.values()}
    if len(opts) > 1:
      raise ValueError(
        "sharded: every table of a group must share its optimizer (one fused update); got "
        + ", ".join(
          f"{n}: {s.optimizer.name}(lr={s.optimizer.learning_rate})" for n, s in specs.items()
        )
        + ". Give tables with other optimizers another plan string."
      )
    lookups = None
    if o.profile:
      with open(o.profile) as f:
        lookups = {t: float(v) for t, v in json.load(f).items()}
    placement = plan_placements(specs, k, o.kind, lookups)
    tw = [n for n, p in placement.items() if p.kind == "table"]
    dims = {specs[n].dim for n in tw}
    if len(dims) > 1:
      raise ValueError(
        "sharded: table-wise tables of one group share one array per shard, so they need one "
        f"dim; got {sorted(dims)} ({', '.join(f'{n}: {specs[n].dim}' for n in tw)}). "
        "Give tables of another dim another plan string, or kind=row."
      )
    tmax = max([p.slot + 1 for p in placement.values() if p.kind == "table"] + [0])
    owner_slots = [[None] * tmax for _ in range(k)]
    for n in tw:
      p = placement[n]
      owner_slots[p.shard][p.slot] = n
    shard_rows = [sum(specs[n].num_rows for n in slots if n is not None) for slots in owner_slots]
    return cls(
      specs=dict(specs),
      mesh=mesh,
      k=k,
      n_data=mesh.shape[sharding.DATA],
      optimizer=next(iter(opts)),
      placement=placement,
      tw=tw,
      rw=[n for n, p in placement.items() if p.kind == "row"],
      cw=[n for n, p in placement.items() if p.kind == "column"],
      dim_tw=dims.pop() if dims else 0,
      tmax=tmax,
      owner_slots=owner_slots,
      rows_tw=max(shard_rows + [1]),
      table_index={n: i for i, n in enumerate(specs)},
    )

  def slots(self) -> tuple[str, ...]:
    """The optimizer's slots (every table of the group has the same)."""
    return self.optimizer.slot_names()

  # ------------------------------------------------------------------ the message
  def segment_dims(self) -> tuple[int, ...]:
    """Widths of the fused message's segments: Tmax table-wise slots, row-wise tables,
    column-wise tables' column blocks."""
    return (
      (self.dim_tw,) * self.tmax
      + tuple(self.specs[n].dim for n in self.rw)
      + tuple(self.specs[n].dim // self.k for n in self.cw)
    )

  def segment_tables(self) -> np.ndarray:
    """int32[k, nseg]: the table index (into the bounds vector) of each segment as sent by
    shard m; T (a dummy) for an empty slot."""
    t = len(self.specs)
    out = []
    for m in range(self.k):
      row = [t if n is None else self.table_index[n] for n in self.owner_slots[m]]
      row += [self.table_index[n] for n in self.rw + self.cw]
      out.append(row)
    return np.asarray(out, np.int32).reshape(self.k, len(self.segment_dims()))

  def table_segment(self) -> list[int]:
    """The segment of each table (index into the message's segments)."""
    out = []
    for n in self.specs:
      p = self.placement[n]
      if p.kind == "table":
        out.append(p.slot)
      elif p.kind == "row":
        out.append(self.tmax + self.rw.index(n))
      else:
        out.append(self.tmax + len(self.rw) + self.cw.index(n))
    return out

  # ------------------------------------------------------------------ bytes and shardings
  def device_bytes_by_shard(self) -> list[int]:
    """Bytes each MODEL shard holds (the same on every DATA replica)."""
    nslot = len(self.slots())
    tw = self.rows_tw * (4 * self.dim_tw + 4 * nslot) if self.tw else 0
    rw = sum(
      base.aligned_rows(self.specs[n].num_rows) // self.k * self.specs[n].row_bytes for n in self.rw
    )
    cw = sum(
      base.aligned_rows(self.specs[n].num_rows) * (4 * self.specs[n].dim // self.k + 4 * nslot)
      for n in self.cw
    )
    return [tw + rw + cw] * self.k

  def memory(self) -> dict[str, base.MemoryReport]:
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
          base.aligned_rows(s.num_rows) * (4 * s.dim // self.k + 4 * len(self.slots())),
          0,
          f"columns over {self.k} devices",
        )
    return out

  def storage_sharding(self) -> dict:
    """The tables' storage: {"tw": {"rows": [k, R, D] over MODEL, slots}, "rw": {t: rows over
    MODEL}, "cw": {t: columns over MODEL, slots replicated}}."""
    named = functools.partial(sharding.named, self.mesh)
    out = {}
    if self.tw:
      out["tw"] = {"rows": named(P(sharding.MODEL, None, None))}
      out["tw"].update({s: named(P(sharding.MODEL, None)) for s in self.slots()})
    out["rw"] = {
      n: {
        "rows": named(P(sharding.MODEL, None)),
        **{s: named(P(sharding.MODEL)) for s in self.slots()},
      }
      for n in self.rw
    }
    out["cw"] = {
      n: {"rows": named(P(None, sharding.MODEL)), **{s: named(P()) for s in self.slots()}}
      for n in self.cw
    }
    return out

  def format_placements(self, codecs: dict) -> str:
    """The placements, the bytes per shard and the wire per example (the log at build)."""
    lines = [f"{'table':<12} {'rows':>12} {'placement':<12} {'bytes on its devices':>20}"]
    for n, p in self.placement.items():
      s = self.specs[n]
      where = f"shard {p.shard}" if p.kind == "table" else f"{p.kind}-wise"
      per = s.table_bytes if p.kind == "table" else -(-s.table_bytes // self.k)
      lines.append(f"{n:<12} {s.num_rows:>12,} {where:<12} {per:>20,}")
    per_dev = self.device_bytes_by_shard()
    lines.append("per MODEL shard: " + ", ".join(f"{b / 2**20:.1f}M" for b in per_dev))
    lines.append(
      f"wire per example: fwd {codecs['fwd'].name} {codecs['fwd'].bits_per_value():.1f} "
      f"bits/value, bwd {codecs['bwd'].name} {codecs['bwd'].bits_per_value():.1f}; "
      f"{sum(self.segment_dims())} values per destination"
    )
    return "\n".join(lines)
