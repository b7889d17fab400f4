"""The graph a node task's config.data names (data.source: planetoid | ogb | synthetic |
tfds), relabelled by data.node_order (the permutation computed once and cached), and the
adjacency-eigenvector init file of a node table (embeddings.node_init=eigen).

Both files are verified before they are used: each has a sidecar manifest (FILE.manifest.json:
the graph's key, the file's bytes and the SHA-256 of its head, `file_check`); a file that
does not match it (cut short, damaged, another graph's) is computed again from the graph."""

from __future__ import annotations

import hashlib
import os
import time

import ml_collections
import numpy as np
from absl import logging

from recgnn.data import file_check
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
  why = file_check.sidecar_problem(path, key)
  if why is None:
    return np.load(path), path
  if os.path.exists(path) and not os.path.exists(path + file_check.SIDECAR):
    # Written before the caches carried a manifest: kept if it is a whole permutation of
    # this graph's nodes (a partition order computed again may differ, and a resumed run's
    # checkpoint holds the first one), then recorded.
    perm = _whole_permutation(path, graph.num_nodes)
    if perm is not None:
      file_check.write_sidecar(path, key)
      return perm, path
  if os.path.exists(path):
    logging.warning("node order cache %s: %s; computing it again", path, why)
  t0 = time.perf_counter()
  perm = reorder.node_order(graph, order, levels=levels)
  _save(path, perm, key)
  logging.info("node order %s: %.1f s, saved %s", order, time.perf_counter() - t0, path)
  return perm, path


def _whole_permutation(path: str, n: int) -> np.ndarray | None:
  """The permutation of range(n) in the .npy at `path`, or None if it holds anything else."""
  try:
    perm = np.load(path)
  except (OSError, ValueError, EOFError):
    return None
  if perm.shape != (n,) or perm.dtype.kind not in "iu":
    return None
  return perm if np.array_equal(np.sort(perm), np.arange(n)) else None


def _save(path: str, array: np.ndarray, key: str) -> None:
  """`array` at `path` (.npy, through a temporary file renamed into place), then its sidecar
  manifest (its bytes, head checksum and `key`, `file_check.write_sidecar`): a crash between
  the two leaves a file without a record, which is computed again, never read."""
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  tmp = f"{path}.{os.getpid()}.tmp.npy"
  np.save(tmp, array)
  os.replace(tmp, path)
  file_check.write_sidecar(path, key)


def write_eigen_init(graph: store.Graph, dim: int, path: str) -> str:
  """Adjacency eigenvectors float32[N, dim] of `graph` (its current ids) at `path` (.npy),
  rewritten when the graph or dim changed or the file is not whole (its sidecar manifest,
  `file_check`: the graph's key, the file's bytes and head checksum)."""
  from recgnn.graphs import spectral

  path = os.path.expanduser(path)
  key = _graph_key(graph, "eigen", dim)
  why = file_check.sidecar_problem(path, key)
  if why is None:
    return path
  if os.path.exists(path + file_check.SIDECAR):  # (not the first write: say why again)
    logging.warning("eigen init %s: %s; computing it again", path, why)
  t0 = time.perf_counter()
  vecs, vals = spectral.eigen_embedding(graph.adj, dim)
  _save(path, vecs, key)
  if os.path.exists(path + ".key"):  # the record before the manifest (graph key only)
    os.remove(path + ".key")
  logging.info(
    "eigen init: %d eigenvectors (eigenvalues %.3f..%.3f) in %.1f s -> %s",
    dim, vals[0], vals[-1], time.perf_counter() - t0, path,
  )  # fmt: skip
  return path


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
