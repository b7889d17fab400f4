"""hot_cold's frozen layout: what the constructor decides once from the specs, the mesh, the
contract's `Layout` and the options, and every other part reads (never changes).

One concern: the group's shape. Each table's hot capacity and its allocation over the mesh,
the stacks of tables one cold list carries (one row layout: dim, optimizer slots), where each
table sits in them and in the host tier's arrays, and the state's shardings.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from recgnn import sharding
from recgnn.backends.hot_cold.options import HotColdOptions
from recgnn.embeddings import base, host_tier

P = sharding.P

# The prepared leaves split with the batch (the others reach every device whole).
BATCH_MAJOR = ("hot_ids", "cold_ids", "hot_inverse", "count")


@dataclasses.dataclass(frozen=True, eq=False)
class Geometry:
  """hot_cold's layout, fixed at construction (`build`).

  specs: {table: TableSpec}, in the group's order. capacity / alloc: {table: H} the hot rows
  the budget allows, {table: Ha} the hot slots allocated (H rounded up to a multiple of the
  devices). stacks: table names per row layout (`host_tier.layouts`); stack_of: {table:
  (stack, position in it)}; index: {table: its place in the host tier's arrays (specs
  order)}; row_base: per stack int64[T + 1], each table's first row when the stack's rows
  are numbered table after table (the ring's bookkeeping, `host_tier.Recent`)."""

  specs: dict[str, base.TableSpec]
  mesh: jax.sharding.Mesh
  split_batch: bool
  capacity: dict[str, int]
  alloc: dict[str, int]
  stacks: tuple[tuple[str, ...], ...]
  stack_of: dict[str, tuple[int, int]]
  index: dict[str, int]
  row_base: tuple[np.ndarray, ...]

  @classmethod
  def build(cls, specs: dict[str, base.TableSpec], mesh, layout: base.Layout, o: HotColdOptions):
    n = mesh.size
    capacity, alloc = {}, {}
    for name, spec in specs.items():
      cap = o.hot_rows if o.hot_rows is not None else math.ceil(o.fraction * spec.num_rows)
      capacity[name] = max(1, min(int(cap), spec.num_rows))
      alloc[name] = -(-capacity[name] // n) * n
    # One cold list per stack of tables with the same row layout (dim, optimizer slots):
    # every table's cold rows in one list, one length for the stack, so the step's shape
    # follows the stack's total (which moves little) rather than every table's own.
    stacks = host_tier.layouts(specs)
    return cls(
      specs=dict(specs),
      mesh=mesh,
      split_batch=layout.split_batch,
      capacity=capacity,
      alloc=alloc,
      stacks=stacks,
      stack_of={t: (s, i) for s, names in enumerate(stacks) for i, t in enumerate(names)},
      index={t: i for i, t in enumerate(specs)},
      row_base=tuple(
        np.cumsum([0] + [specs[t].num_rows for t in names]).astype(np.int64) for names in stacks
      ),
    )

  @property
  def owner(self) -> str:
    """The group, in the host tier's and the stale check's errors."""
    return f"hot_cold (tables {', '.join(self.specs)})"

  def devices(self) -> int:
    """How many pieces the batch is split into (its examples per device)."""
    return self.mesh.size if self.split_batch else 1

  def slots(self, names) -> tuple[str, ...]:
    """The optimizer slots of a stack (every table of it has the same)."""
    return self.specs[names[0]].optimizer.slot_names()

  def repl(self) -> jax.sharding.NamedSharding:
    return sharding.named(self.mesh, sharding.REPLICATED)

  def state_sharding(self) -> dict:
    """{"tables": {table: {"hot": rows over the mesh, "hot_rows": replicated}}, "ring": per
    stack {"table": .., slot: ..} (replicated: every device applies the same cold update),
    "version", "stale"}. The host tables are not state: numpy, in the group's host tier,
    never an argument of the step."""
    rows = sharding.named(self.mesh, P(sharding.BATCH, None))
    vec = sharding.named(self.mesh, P(sharding.BATCH))
    out = {}
    for name, spec in self.specs.items():
      slots = spec.optimizer.slot_names()
      out[name] = {"hot": {"table": rows, **{s: vec for s in slots}}, "hot_rows": self.repl()}
    return {
      "tables": out,
      "ring": tuple(
        {"table": self.repl(), **{s: self.repl() for s in self.slots(names)}}
        for names in self.stacks
      ),
      "version": self.repl(),
      "stale": self.repl(),
    }

  def memory(self) -> dict[str, base.MemoryReport]:
    out = {}
    n = self.mesh.size
    for name, spec in self.specs.items():
      alloc = self.alloc[name]
      device = alloc // n * spec.row_bytes + alloc * 4  # hot shard + slot map
      # Every row in host RAM (one copy, numpy; aligned as the checkpoint's logical shape
      # is), the row -> slot map, the profile. The ring is the batch's (`batch_memory`).
      host = base.aligned_rows(spec.num_rows) * spec.row_bytes + spec.num_rows * (4 + 8)
      out[name] = base.MemoryReport(device, host, f"{alloc} hot rows over {n} device(s) + host")
    return out
