"""OGB node-property datasets (ogbn-arxiv, ogbn-products, ...) from their raw files.

Reads the layout the OGB downloads unpack to, from a path the user gives (nothing is
downloaded here):

  <path>/raw/edge.csv.gz              "src,dst" per line, no header
  <path>/raw/node-feat.csv.gz         F comma-separated floats per line (optional)
  <path>/raw/node-label.csv.gz        one int per line (NaN / empty = unlabelled)
  <path>/raw/num-node-list.csv.gz     the node count (optional; else from labels / features)
  <path>/split/<type>/{train,valid,test}.csv.gz   one node id per line

`<type>` is the dataset's split scheme (time for arxiv, sales_ranking for products, species
for proteins); with one folder under split/ it is found on its own.
"""

from __future__ import annotations

import gzip
import os

import numpy as np

from recgnn.graphs import store


def _read_numbers(path: str, dtype) -> np.ndarray:
  """A gzipped CSV of numbers -> a flat array (fast: one numpy parse of the whole text)."""
  with gzip.open(path, "rt") as f:
    text = f.read()
  text = text.replace("\n", ",").strip(",")
  if not text:
    return np.zeros(0, dtype)
  if np.issubdtype(dtype, np.integer):
    return np.fromstring(text, dtype=np.int64, sep=",").astype(dtype)
  return np.fromstring(text.replace("nan", "-1"), dtype=np.float64, sep=",").astype(dtype)


def _lines(path: str) -> int:
  with gzip.open(path, "rt") as f:
    first = f.readline()
  return first.count(",") + 1 if first.strip() else 0


def load(path: str, *, split: str | None = None, undirected: bool = True) -> store.Graph:
  """Load an OGB node-property dataset from its unpacked folder.

  Args:
    path: the dataset folder (holding raw/ and split/), e.g. .../ogbn_arxiv.
    split: the split scheme folder under split/; None picks the only one.
    undirected: add reverse edges (what PyG / OGB examples do for arxiv, a directed graph).
  """
  raw = os.path.join(path, "raw")
  edge_file = os.path.join(raw, "edge.csv.gz")
  if not os.path.exists(edge_file):
    raise FileNotFoundError(
      f"{edge_file} not found: pass --config.data.path=<folder holding raw/ and split/>, "
      "the folder an OGB node-property download (e.g. ogbn_arxiv.zip) unpacks to."
    )
  split_root = os.path.join(path, "split")
  if split is None:
    kinds = sorted(os.listdir(split_root)) if os.path.isdir(split_root) else []
    if len(kinds) != 1:
      raise ValueError(
        f"{split_root} holds split schemes {kinds}; choose one with split= "
        "(--config.data.split=...)."
      )
    split = kinds[0]

  edges = _read_numbers(edge_file, np.int64).reshape(-1, 2)
  labels_raw = _read_numbers(os.path.join(raw, "node-label.csv.gz"), np.float64)
  labels = labels_raw.astype(np.int64)
  feat_file = os.path.join(raw, "node-feat.csv.gz")
  features = None
  if os.path.exists(feat_file):
    features = _read_numbers(feat_file, np.float32).reshape(-1, _lines(feat_file))
  count_file = os.path.join(raw, "num-node-list.csv.gz")
  if os.path.exists(count_file):
    num_nodes = int(_read_numbers(count_file, np.int64)[0])
  else:
    num_nodes = labels.shape[0]
  if labels.shape[0] != num_nodes:
    raise ValueError(f"{raw}: {labels.shape[0]} labels for {num_nodes} nodes")

  splits = {}
  for name in store.SPLITS:
    f = os.path.join(split_root, split, f"{name}.csv.gz")
    if not os.path.exists(f):
      raise FileNotFoundError(f"split file {f} missing")
    splits[name] = _read_numbers(f, np.int64)
  # OGB writes unlabelled nodes as NaN (read as -1 above).
  labels = np.where(labels_raw < 0, -1, labels).astype(np.int32)
  return store.Graph(
    name=os.path.basename(os.path.normpath(path)),
    adj=store.csr_from_edges(edges[:, 0], edges[:, 1], num_nodes, undirected=undirected),
    labels=labels,
    num_classes=int(labels.max()) + 1,
    splits=splits,
    features=features,
  )
