"""OGB link-property datasets (ogbl-ddi, ogbl-collab, ogbl-citation2, ...) from their files.

Reads the layout an OGB linkproppred download unpacks to, from a path the user gives
(nothing is downloaded here), with the split files as .npz instead of torch's .pt:

  <path>/raw/num-node-list.csv.gz     the node count (optional: else the largest id + 1)
  <path>/raw/node-feat.csv.gz         F comma-separated floats per line (optional; ddi has none)
  <path>/split/<type>/{train,valid,test}.npz   the arrays of OGB's {train,valid,test}.pt:
      `edge` int[E, 2] (+ `edge_neg` int[M, 2] in valid / test): ddi, collab, ppa; or
      `source_node`, `target_node` int[E] (+ `target_node_neg` int[E, K]): citation2

OGB ships the split files as torch pickles; this project does not depend on torch. Convert
them once, in the split folder, with any Python that has torch: the one line is in
docs/linkpred.md ("OGB's split files").

The message graph is the train split's edges (OGB's examples); the raw edge list is not read.
Extra training-only fields (collab's `weight` and `year`) are ignored.
"""

from __future__ import annotations

import os

import numpy as np

from recgnn.data import ogb
from recgnn.data.link_split import LinkSplit, undirected_edges
from recgnn.graphs import store


def _pairs(arrays, path: str) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
  """(positives int64[E, 2], fixed negatives int64[M, 2] or None, per-positive negative
  targets int64[E, K] or None) of one split file's arrays."""
  if "edge" in arrays:
    pos = np.asarray(arrays["edge"], np.int64).reshape(-1, 2)
    neg = arrays.get("edge_neg")
    return pos, None if neg is None else np.asarray(neg, np.int64).reshape(-1, 2), None
  if "source_node" in arrays and "target_node" in arrays:
    pos = np.stack([arrays["source_node"], arrays["target_node"]], axis=1).astype(np.int64)
    tneg = arrays.get("target_node_neg")
    if tneg is None:
      return pos, None, None
    tneg = np.asarray(tneg, np.int64).reshape(pos.shape[0], -1)
    # The fixed negatives for ROC-AUC / Hits@K: each positive's first negative target.
    return pos, np.stack([pos[:, 0], tneg[:, 0]], axis=1), tneg
  raise ogb.MalformedDataError(
    f"{path}: holds {sorted(arrays)}; expected 'edge' (+ 'edge_neg') or 'source_node' / "
    "'target_node' (+ 'target_node_neg'), the arrays of OGB's split .pt files"
  )


def _read_split(folder: str, name: str):
  path = os.path.join(folder, f"{name}.npz")
  if not os.path.exists(path):
    pt = os.path.join(folder, f"{name}.pt")
    hint = f" ({pt} is there: convert it, docs/linkpred.md)" if os.path.exists(pt) else ""
    raise FileNotFoundError(f"split file {path} missing{hint}")
  with np.load(path, allow_pickle=False) as f:
    return _pairs({k: f[k] for k in f.files}, path)


def load(path: str, *, split: str | None = None) -> LinkSplit:
  """The link split of an unpacked OGB linkproppred folder (holding raw/ and split/)."""
  split_root = os.path.join(path, "split")
  if not os.path.isdir(split_root):
    raise FileNotFoundError(
      f"{split_root} not found: pass --config.data.path=<folder holding raw/ and split/>, "
      "the folder an OGB linkproppred download (e.g. ogbl_ddi.zip) unpacks to"
    )
  if split is None:
    kinds = sorted(os.listdir(split_root))
    if len(kinds) != 1:
      raise ValueError(
        f"{split_root} holds split schemes {kinds}; choose one with --config.data.split=..."
      )
    split = kinds[0]
  folder = os.path.join(split_root, split)
  parts = {name: _read_split(folder, name) for name in store.SPLITS}
  for name in ("valid", "test"):
    if parts[name][1] is None:
      raise ogb.MalformedDataError(f"{folder}/{name}.npz has no negatives (edge_neg)")
  raw = os.path.join(path, "raw")
  count_file = os.path.join(raw, "num-node-list.csv.gz")
  ids = [a.max(initial=-1) for p in parts.values() for a in p[:2] if a is not None]
  num_nodes = int(max(ids)) + 1
  if os.path.exists(count_file):
    num_nodes = int(ogb.read_table(count_file, "int", columns=1)[0, 0])
  feat_file = os.path.join(raw, "node-feat.csv.gz")
  features = None
  if os.path.exists(feat_file):
    features = ogb.read_table(feat_file, "float").astype(np.float32)
  train = parts["train"][0]
  # Canonical u < v pairs without repeats (collab repeats a pair per year).
  train = undirected_edges(store.csr_from_edges(train[:, 0], train[:, 1], num_nodes))
  return LinkSplit(
    name=os.path.basename(os.path.normpath(path)),
    num_nodes=num_nodes,
    train=train,
    valid=parts["valid"][0],
    test=parts["test"][0],
    valid_neg=parts["valid"][1],
    test_neg=parts["test"][1],
    valid_target_neg=parts["valid"][2],
    test_target_neg=parts["test"][2],
    features=features,
    test_messages="train",
  )
