"""Planetoid citation graphs (Cora, CiteSeer, PubMed) in their original pickled layout.

The files (`ind.<name>.{x,y,tx,ty,allx,ally,graph,test.index}`, Yang et al., ICML 2016) are
Python-2 pickles. Unpickling runs arbitrary code, so they are read by a restricted unpickler
that admits only the numpy / scipy / collections types these files hold. The split is the
standard one (Kipf & Welling; PyG's `Planetoid(split="public")`): the first 20 labelled nodes
per class (`x`, 140 for Cora) train, the next 500 validate, the 1000 of `test.index` test,
with the test rows put back at the positions `test.index` names.
"""

from __future__ import annotations

import collections
import os
import pickle

import numpy as np
import scipy.sparse as sp

from recgnn.graphs import store

BUNDLED = os.path.join(os.path.dirname(__file__), "..", "..", "third_party")
NAMES = ("cora", "citeseer", "pubmed")

# (module, name) -> object: everything a Planetoid pickle may reference. Both the Python-2
# module names (what the bytes say) and their Python-3 homes are listed.
_ALLOWED = {
  ("numpy", "ndarray"): np.ndarray,
  ("numpy", "dtype"): np.dtype,
  ("numpy.core.multiarray", "_reconstruct"): np._core.multiarray._reconstruct,
  ("numpy._core.multiarray", "_reconstruct"): np._core.multiarray._reconstruct,
  ("scipy.sparse.csr", "csr_matrix"): sp.csr_matrix,
  ("scipy.sparse._csr", "csr_matrix"): sp.csr_matrix,
  ("collections", "defaultdict"): collections.defaultdict,
  ("__builtin__", "list"): list,
  ("builtins", "list"): list,
  ("__builtin__", "int"): int,
  ("builtins", "int"): int,
}


class _RestrictedUnpickler(pickle.Unpickler):
  def find_class(self, module, name):
    try:
      return _ALLOWED[(module, name)]
    except KeyError:
      raise pickle.UnpicklingError(
        f"Planetoid file references {module}.{name}, which the restricted unpickler does not "
        "admit. If the file is genuine, add that type to planetoid._ALLOWED."
      ) from None


def restricted_load(path: str):
  """Unpickle a Python-2 Planetoid file, admitting only numpy / scipy / list types."""
  with open(path, "rb") as f:
    return _RestrictedUnpickler(f, encoding="latin1").load()


def _as_csr(m) -> sp.csr_matrix:
  # Pickles from old scipy carry a bare __dict__; rebuild through the public constructor.
  m = sp.csr_matrix((np.asarray(m.data), np.asarray(m.indices), np.asarray(m.indptr)), m.shape)
  return m


def load(
  name: str = "cora", root: str | None = None, *, normalize_features: bool = True
) -> store.Graph:
  """Load a Planetoid graph with the standard public split.

  Args:
    name: cora, citeseer or pubmed.
    root: folder holding `<name>/ind.<name>.*`; default: the bundled `third_party/`.
    normalize_features: divide each feature row by its sum (Kipf & Welling, PyG's
      NormalizeFeatures), which the published accuracies assume.
  """
  name = name.lower()
  if name not in NAMES:
    raise ValueError(f"Unknown Planetoid graph {name!r}; available: {', '.join(NAMES)}")
  folder = os.path.join(root or BUNDLED, name)
  path = lambda part: os.path.join(folder, f"ind.{name}.{part}")
  if not os.path.exists(path("graph")):
    raise FileNotFoundError(
      f"{path('graph')} not found. Cora is bundled in third_party/cora; for CiteSeer / PubMed "
      "put the kimiyoung/planetoid data/ files in <root>/<name>/ and pass root=."
    )
  x, y, tx, ty, allx, ally = (
    restricted_load(path(p)) for p in ("x", "y", "tx", "ty", "allx", "ally")
  )
  graph = restricted_load(path("graph"))
  with open(path("test.index")) as f:
    test_index = np.array([int(line) for line in f if line.strip()], np.int64)
  test_sorted = np.sort(test_index)

  tx, allx = _as_csr(tx), _as_csr(allx)
  ty, ally = np.asarray(ty), np.asarray(ally)
  if name == "citeseer":
    # CiteSeer has test ids with no test row (isolated nodes): give them zero rows, as
    # Kipf's loader does, so that positions line up.
    full = np.arange(test_sorted[0], test_sorted[-1] + 1)
    tx_ext = sp.lil_matrix((full.size, tx.shape[1]), dtype=tx.dtype)
    tx_ext[test_sorted - test_sorted[0], :] = tx
    ty_ext = np.zeros((full.size, ty.shape[1]), ty.dtype)
    ty_ext[test_sorted - test_sorted[0], :] = ty
    tx, ty = tx_ext.tocsr(), ty_ext

  features = sp.vstack([allx, tx]).tocsr().toarray().astype(np.float32)
  onehot = np.concatenate([ally, ty]).astype(np.float32)
  # The test rows come after allx in file order; test.index says where each belongs.
  features[test_index] = features[test_sorted]
  onehot[test_index] = onehot[test_sorted]
  labels = np.where(onehot.sum(1) > 0, onehot.argmax(1), -1).astype(np.int32)
  if normalize_features:
    rowsum = features.sum(1, keepdims=True)
    features = features / np.where(rowsum == 0, 1.0, rowsum)

  num_nodes = features.shape[0]
  src = np.concatenate([np.full(len(v), k, np.int64) for k, v in graph.items()])
  dst = np.concatenate([np.asarray(v, np.int64) for v in graph.values()])
  adj = store.csr_from_edges(src, dst, num_nodes, undirected=True)

  num_train = np.asarray(y).shape[0]
  splits = {
    "train": np.arange(num_train, dtype=np.int64),
    "valid": np.arange(num_train, num_train + 500, dtype=np.int64),
    "test": test_sorted,
  }
  return store.Graph(
    name=name,
    adj=adj,
    labels=labels,
    num_classes=onehot.shape[1],
    splits=splits,
    features=features.astype(np.float32),
  )
