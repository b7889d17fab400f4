"""The PyG contestant of the sampling benchmarks (benchmarks/sampling.py and
benchmarks/sampling_data_parallel.py): PyG's NeighborLoader over a recgnn graph, timed."""

from __future__ import annotations

import time

import numpy as np


def status() -> str | None:
  """None when PyG's NeighborLoader can run here, else why not."""
  try:
    import torch  # noqa: F401
    import torch_geometric  # noqa: F401
    import torch_sparse  # noqa: F401
  except Exception as e:  # noqa: BLE001 (any import failure means: no peer)
    return f"{type(e).__name__}: {e}"
  return None


def loader(graph, fanouts, batch_size, seed, with_features=False):
  import torch
  from torch_geometric.data import Data
  from torch_geometric.loader import NeighborLoader

  coo = graph.adj.tocoo()
  # Row v of adj aggregates from column u: PyG's message direction is u -> v.
  edge_index = torch.from_numpy(np.stack([coo.col, coo.row]).astype(np.int64))
  data = Data(edge_index=edge_index, num_nodes=graph.num_nodes)
  if with_features:
    data.x = torch.from_numpy(graph.features)
    data.y = torch.from_numpy(graph.labels.astype(np.int64))
  torch.manual_seed(seed)
  return NeighborLoader(
    data,
    num_neighbors=list(fanouts),
    batch_size=batch_size,
    input_nodes=torch.from_numpy(graph.splits["train"]),
    shuffle=True,
  )


def endless(loader):
  while True:
    yield from loader


def method(graph, fanouts, bsz: int, batches: int):
  """A timed contestant: `batches` of PyG's NeighborLoader -> (edges, batches, seconds)."""
  it = endless(loader(graph, fanouts, bsz, seed=0))

  def pyg():
    t0 = time.perf_counter()
    edges = 0
    for _ in range(batches):
      edges += int(next(it).edge_index.shape[1])
    return edges, batches, time.perf_counter() - t0

  return pyg
