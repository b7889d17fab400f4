"""The graph a node task's config.data names (data.source: planetoid | ogb | synthetic |
tfds), relabelled by data.node_order (the permutation computed once and cached), and the
adjacency-eigenvector init file of a node table (embeddings.node_init=eigen)."""

from __future__ import annotations

import hashlib
import os
import time

import ml_collections
import numpy as np
from absl import logging

from recgnn.graphs import store


def load_graph(data: ml_collections.ConfigDict, info: dict | None = None) -> store.Graph:
  """The graph named by config.data, relabelled by data.node_order (`info` gets the
  permutation file's path under "node_order_file")."""
  graph = load_raw_graph(data)
  order = data.get("node_order", "none") or "none"
  if order == "none":
    return graph
  levels = data.get("partition_levels", None)
  perm, path = _cached_order(graph, order, levels, data.get("cache_dir", None) or DEFAULT_CACHE)
  if info is not None:
    info["node_order_file"] = path
  return graph.relabel(perm)


DEFAULT_CACHE = "~/.cache/recgnn"  # node orders under DEFAULT_CACHE/node_order


def _graph_key(graph: store.Graph, *parts) -> str:
  h = hashlib.sha1(repr((graph.name, graph.num_nodes, graph.num_edges, *parts)).encode())
  h.update(np.ascontiguousarray(graph.adj.indptr).tobytes())
  h.update(np.ascontiguousarray(graph.adj.indices).tobytes())
  return h.hexdigest()[:16]


def _cached_order(graph: store.Graph, order: str, levels, cache_dir: str):
  """The permutation of `order`, computed once per graph and kept under cache_dir/node_order:
  a resumed run (or another pymetis build) relabels exactly as the first run did."""
  from recgnn.graphs import reorder

  if order not in reorder.ORDERS:
    raise ValueError(f"Unknown data.node_order {order!r}; available: {', '.join(reorder.ORDERS)}")
  levels = tuple(levels) if levels else None
  key = _graph_key(graph, order, levels)
  path = os.path.join(
    os.path.expanduser(cache_dir), "node_order", f"{graph.name}-{order}-{key}.npy"
  )
  if os.path.exists(path):
    perm = np.load(path)
    return perm, path
  t0 = time.perf_counter()
  perm = reorder.node_order(graph, order, levels=levels)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  tmp = f"{path}.{os.getpid()}.tmp.npy"
  np.save(tmp, perm)
  os.replace(tmp, path)
  logging.info("node order %s: %.1f s, saved %s", order, time.perf_counter() - t0, path)
  return perm, path


def write_eigen_init(graph: store.Graph, dim: int, path: str) -> str:
  """Adjacency eigenvectors float32[N, dim] of `graph` (its current ids) at `path` (.npy),
  rewritten only when the graph or dim changed (a key file beside it)."""
  from recgnn.graphs import spectral

  path = os.path.expanduser(path)
  key = _graph_key(graph, "eigen", dim)
  if os.path.exists(path) and _read(path + ".key") == key:
    return path
  t0 = time.perf_counter()
  vecs, vals = spectral.eigen_embedding(graph.adj, dim)
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  tmp = f"{path}.{os.getpid()}.tmp.npy"
  np.save(tmp, vecs)
  os.replace(tmp, path)
  with open(path + ".key", "w") as f:
    f.write(key)
  logging.info(
    "eigen init: %d eigenvectors (eigenvalues %.3f..%.3f) in %.1f s -> %s",
    dim, vals[0], vals[-1], time.perf_counter() - t0, path,
  )  # fmt: skip
  return path


def _read(path: str) -> str:
  try:
    with open(path) as f:
      return f.read()
  except OSError:
    return ""


def load_raw_graph(data: ml_collections.ConfigDict) -> store.Graph:
  if data.source == "planetoid":
    from recgnn.data import planetoid

    return planetoid.load(data.get("name", "cora"), data.get("path", None) or None)
  if data.source == "ogb":
    from recgnn.data import ogb

    if not data.get("path", None):
      raise ValueError("data.source=ogb needs --config.data.path=<unpacked OGB dataset folder>")
    return ogb.load(data.path, split=data.get("split", None) or None)
  if data.source == "synthetic":
    from recgnn.graphs import synthetic

    fields = dict(data.synthetic)
    if "split" in fields:
      fields["split"] = tuple(fields["split"])
    return synthetic.generate(synthetic.SyntheticSpec(**fields))
  if data.source == "tfds":
    from recgnn.data import tfds_builders

    return tfds_builders.load_graph_config(data)
  raise ValueError(
    f"Unknown data.source {data.source!r}; available: planetoid, synthetic, ogb, tfds"
  )
