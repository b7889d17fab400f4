"""A table's candidate placements (`candidates`: the built-in list and what the registered
backends offer, `offered`) and their bytes from the backends' own `memory()` (`memory_of`),
nothing allocated."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from recgnn import sharding
from recgnn.embeddings.contract import AutoContext, Layout
from recgnn.embeddings.specs import TableSpec
from recgnn.planner import plan as plan_lib
from recgnn.planner.auto.options import AutoOptions


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One placement of one table: its plan string, bytes and measured costs (seconds per step:
  the device step of this table alone, and its host-side prepare)."""

  table: str
  text: str
  device_bytes: int
  host_bytes: int
  step_s: float = float("nan")
  prepare_s: float = float("nan")
  # Candidates of one family share a limit on how many distinct backend strings (groups) the
  # plan may hold (`solve`'s limits): those that split a batch into micro-batches (hot_cold;
  # a batch has one split) and the host tiers, whose list sizes each group re-plans (every
  # new combination of group shapes is a step program to compile). None: no limit.
  family: str | None = None


def candidates(spec: TableSpec, options: AutoOptions, mesh: jax.sharding.Mesh) -> list[str]:
  """The plan strings worth trying for one table (duplicates and ones that are the same as
  dense for this table, e.g. a cache holding every row, left out): the built-in list, then
  what the registered backends offer (`offered`)."""
  _, model = sharding.mesh_shape(mesh)
  out = []
  if "dense" in options.kinds:
    out.append("dense")
    if model > 1:
      out.append("dense(shard=rows)")
  if "sharded" in options.kinds and model > 1:
    out.append("sharded")
  for f in options.fractions:
    if f * spec.num_rows < 1:
      continue
    if "offload" in options.kinds:
      out.append(f"offload(cache_fraction={f})")
      if options.ssd is not None:  # the SSD level: its host cache above the device cache
        out += [
          f"offload(cache_fraction={f}, host_cache={h}, storage='ssd:{options.ssd}')"
          for h in options.host_caches
          if h > f
        ]
    if "hot_cold" in options.kinds:
      out.append(f"hot_cold(budget={f})")
  if "tt" in options.kinds:
    out += [f"tt(rank={r})" for r in options.tt_ranks]
  return out + [t for t in offered(spec, options, mesh) if t not in out]


def offered(spec: TableSpec, options: AutoOptions, mesh: jax.sharding.Mesh) -> list[str]:
  """The plan strings the registered backends offer for `spec` themselves
  (`Backend.auto_candidates`; the built-in ones offer none), in the registry's name order:
  a backend loaded from its own file (`embeddings.modules`) is a candidate like the rest."""
  context = AutoContext(mesh=mesh, fractions=tuple(options.fractions), kinds=tuple(options.kinds))
  out = []
  for name in plan_lib.available_backends():
    out += [t for t in plan_lib.backend_class(name).auto_candidates(spec, context) if t not in out]
  return out


def memory_of(
  text: str, spec: TableSpec, mesh, layout: Layout, ids_shape: tuple[int, ...] | None = None
) -> tuple[int, int]:
  """(bytes per device, host bytes) of `text` for `spec`, from the backend's own `memory`,
  and with ids_shape (a train batch's ids of this table, global) the buffers its state
  comes to hold for such batches (`batch_memory`, e.g. the host tiers' rings)."""
  group = plan_lib.make_group(text, [spec], mesh, layout)
  mem = group.memory()[spec.name]
  extra = group.batch_memory({spec.name: tuple(ids_shape)}) if ids_shape is not None else {}
  return mem.device_bytes + extra.get(spec.name, 0), mem.host_bytes


def ids_shapes(batches: Sequence[dict[str, np.ndarray]]) -> dict[str, tuple[int, ...]]:
  """{table: the largest ids shape of `batches`} (train batches' ids)."""
  out: dict[str, tuple[int, ...]] = {}
  for b in batches:
    for t, ids in b.items():
      shape = tuple(np.shape(ids))
      out[t] = max(out.get(t, shape), shape, key=lambda x: int(np.prod(x)))
  return out
