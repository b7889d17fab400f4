"""The sampler a config names: `make` builds the host (`recgnn.graphs.sampling`), one-device
(`recgnn.graphs.device_sampling`) or split-graph (`recgnn.graphs.split_sampling`) sampler of a
kind. Kept apart from the device code so that host sampling does not go through it."""

from __future__ import annotations

from recgnn.graphs import ladies, sampling
from recgnn.graphs.device_ladies import DeviceLadiesSampler
from recgnn.graphs.device_sampling import DeviceNeighborSampler
from recgnn.graphs.split_sampling import SplitLadiesSampler, SplitNeighborSampler

WHERE = ("host", "device")


def make(
  adj,
  kind: str,
  where: str,
  *,
  batch_size: int,
  fanouts=None,
  layer_sizes=None,
  capacities=None,
  mesh=None,
  exchange: str = "reduce_scatter",
  exchange_capacity: float | None = None,
):
  """The sampler of `kind` (node | ladies) at `where` (host | device); `mesh` with more
  than one device splits the graph's rows over it (`SplitNeighborSampler`, with `exchange`
  and `exchange_capacity`; `SplitLadiesSampler`, reduce_scatter only)."""
  if where not in WHERE:
    raise ValueError(f"Unknown sampler.where {where!r}; available: {', '.join(WHERE)}")
  if kind == "ladies":
    if capacities is not None:  # (node-wise frontier sizes: LADIES' are fixed by layer_sizes)
      raise ValueError("capacities are node-wise sampling's; LADIES' frontiers are exact")
    kw = dict(layer_sizes=list(layer_sizes), batch_size=batch_size)
    if where == "host":
      return ladies.LadiesSampler(adj, **kw)
    if mesh is not None and mesh.size > 1:
      if exchange != "reduce_scatter":
        raise ValueError("sampler.kind=ladies splits the graph with split_exchange=reduce_scatter")
      return SplitLadiesSampler(adj, mesh=mesh, **kw)
    return DeviceLadiesSampler(adj, **kw)
  kw = dict(fanouts=list(fanouts), batch_size=batch_size, capacities=capacities)
  if where == "host":
    return sampling.NeighborSampler(adj, **kw)
  if mesh is not None and mesh.size > 1:
    return SplitNeighborSampler(
      adj, mesh=mesh, exchange=exchange, exchange_capacity=exchange_capacity, **kw
    )
  return DeviceNeighborSampler(adj, **kw)
