"""Planetoid citation graphs (Cora, CiteSeer, PubMed) in their original pickled layout.

The files (`ind.<name>.{x,y,tx,ty,allx,ally,graph,test.index}`, Yang et al., ICML 2016) are
Python-2 pickles. Unpickling runs arbitrary code, so they are read by a restricted unpickler
that admits only the numpy / scipy / collections types these files hold. The split is the
standard one (Kipf & Welling; PyG's `Planetoid(split="public")`): the first 20 labelled nodes
per class (`x`, 140 for Cora) train, the next 500 validate, the 1000 of `test.index` test,
with the test rows put back at the positions `test.index` names.

A file that is not such a pickle (truncated, damaged, another type inside) or whose parts do
not fit together (row counts, node ids out of range) raises MalformedDataError (an
UnpicklingError and a ValueError) naming the file; nothing else escapes the loader.
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
# numpy's array unpickler (`numpy._core.multiarray._reconstruct`), as pickle itself finds it.
_RECONSTRUCT = np.ndarray((0,)).__reduce__()[0]
_ALLOWED = {
  ("numpy", "ndarray"): np.ndarray,
  ("numpy", "dtype"): np.dtype,
  ("numpy.core.multiarray", "_reconstruct"): _RECONSTRUCT,
  ("numpy._core.multiarray", "_reconstruct"): _RECONSTRUCT,
  ("scipy.sparse.csr", "csr_matrix"): sp.csr_matrix,
  ("scipy.sparse._csr", "csr_matrix"): sp.csr_matrix,
  ("collections", "defaultdict"): collections.defaultdict,
  ("__builtin__", "list"): list,
  ("builtins", "list"): list,
  ("__builtin__", "int"): int,
  ("builtins", "int"): int,
}


class MalformedDataError(pickle.UnpicklingError, ValueError):
  """A Planetoid file that is damaged or does not hold what the format says (names it)."""


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
  """Unpickle a Python-2 Planetoid file, admitting only numpy / scipy / list types.

  Raises pickle.UnpicklingError for a type outside the list, MalformedDataError for a file
  that is not a whole pickle (truncated, damaged) or that has bytes after its end.
  """
  with open(path, "rb") as f:
    try:
      obj = _RestrictedUnpickler(f, encoding="latin1").load()
    except pickle.UnpicklingError as e:
      if "restricted unpickler" in str(e):
        raise
      raise MalformedDataError(f"{path}: damaged Planetoid pickle ({e})") from None
    except Exception as e:  # noqa: BLE001 (EOFError, ValueError, MemoryError: a damaged
      # length field asks for more bytes than exist, ...)
      raise MalformedDataError(
        f"{path}: not a whole Planetoid pickle ({type(e).__name__}: {str(e)[:200]}); "
        "download it again"
      ) from None
    if f.read(1):
      raise MalformedDataError(f"{path}: bytes after the end of the pickle (a damaged file)")
  return obj


def _require(ok: bool, path: str, what: str) -> None:
  if not ok:
    raise MalformedDataError(f"{path}: {what}")


def _as_matrix(m, path: str) -> sp.csr_matrix:
  """A pickled csr_matrix (or its bare __dict__ from old scipy) -> a checked csr_matrix."""
  try:
    data, indices, indptr = (np.asarray(getattr(m, k)) for k in ("data", "indices", "indptr"))
    shape = tuple(int(x) for x in m.shape)
    out = sp.csr_matrix((data, indices, indptr), shape)
    out.check_format(full_check=True)
  except Exception as e:  # noqa: BLE001 (anything a damaged matrix throws)
    raise MalformedDataError(f"{path}: not a valid sparse feature matrix ({e})") from None
  _require(np.all(np.isfinite(out.data)), path, "non-finite feature values")
  return out


def _as_onehot(m, path: str) -> np.ndarray:
  _require(isinstance(m, np.ndarray) and m.ndim == 2, path, "labels are not a 2-D array")
  try:
    m = m.astype(np.float32)
  except (TypeError, ValueError) as e:
    raise MalformedDataError(f"{path}: labels are not numbers ({e})") from None
  _require(bool(np.all((m == 0) | (m == 1))), path, "labels are not one-hot 0 / 1 rows")
  return m


def _as_csr(m) -> sp.csr_matrix:
  # Pickles from old scipy carry a bare __dict__; rebuild through the public constructor.
  m = sp.csr_matrix((np.asarray(m.data), np.asarray(m.indices), np.asarray(m.indptr)), m.shape)
  return m


def _read_index(path: str) -> np.ndarray:
  """test.index: one non-negative node id per line (blank lines skipped)."""
  with open(path, "rb") as f:
    lines = f.read().split(b"\n")
  out, bad = [], []
  for i, line in enumerate(lines, start=1):
    v = line.strip()
    if not v:
      continue
    if v.isdigit() and len(v) <= 12:
      out.append(int(v))
    else:
      bad.append(i)
  if bad:
    raise MalformedDataError(
      f"{path}: {len(bad)} malformed lines (not a node id; first: line {bad[0]}: "
      f"{lines[bad[0] - 1][:80]!r})"
    )
  return np.asarray(out, np.int64)


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
  path = _part_paths(name, root)
  x, y, tx, ty, allx, ally = (
    restricted_load(path(p)) for p in ("x", "y", "tx", "ty", "allx", "ally")
  )
  graph = restricted_load(path("graph"))
  test_index = _read_index(path("test.index"))
  test_sorted = np.sort(test_index)

  tx, allx = _as_matrix(tx, path("tx")), _as_matrix(allx, path("allx"))
  ty, ally, y = _as_onehot(ty, path("ty")), _as_onehot(ally, path("ally")), _as_onehot(y, path("y"))
  _check_parts(name, path, y, tx, ty, allx, ally, graph, test_index)
  if name == "citeseer":
    tx, ty = _fill_test_gaps(tx, ty, test_sorted)
  features, onehot = _node_rows(allx, tx, ally, ty, test_index, test_sorted)
  labels = np.where(onehot.sum(1) > 0, onehot.argmax(1), -1).astype(np.int32)
  if normalize_features:
    rowsum = features.sum(1, keepdims=True)
    features = features / np.where(rowsum == 0, 1.0, rowsum)
  adj = _adjacency(graph, features.shape[0], path("graph"))
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


def _part_paths(name: str, root: str | None):
  """part -> the path of `ind.<name>.<part>` under root (default: the bundled folder);
  refuses an unknown name or a folder without the graph."""
  if name not in NAMES:
    raise ValueError(f"Unknown Planetoid graph {name!r}; available: {', '.join(NAMES)}")
  folder = os.path.join(root or BUNDLED, name)
  path = lambda part: os.path.join(folder, f"ind.{name}.{part}")
  if not os.path.exists(path("graph")):
    raise FileNotFoundError(
      f"{path('graph')} not found. Cora is bundled in third_party/cora; for CiteSeer / PubMed "
      "put the kimiyoung/planetoid data/ files in <root>/<name>/ and pass root=."
    )
  return path


def _check_parts(name: str, path, y, tx, ty, allx, ally, graph, test_index) -> None:
  """Refuses (MalformedDataError) parts whose shapes disagree, or test ids that are empty,
  repeated or outside the rows after allx."""
  test_sorted = np.sort(test_index)
  _require(tx.shape[0] == ty.shape[0], path("ty"), f"{ty.shape[0]} rows for {tx.shape[0]} in tx")
  _require(
    allx.shape[0] == ally.shape[0], path("ally"), f"{ally.shape[0]} rows, allx {allx.shape[0]}"
  )
  _require(tx.shape[1] == allx.shape[1], path("tx"), "another feature width than allx")
  _require(ty.shape[1] == ally.shape[1], path("ty"), "another class count than ally")
  _require(test_index.size == tx.shape[0] or name == "citeseer", path("test.index"),
           f"{test_index.size} ids for {tx.shape[0]} test rows")  # fmt: skip
  n_all = allx.shape[0]
  _require(y.shape[0] + 500 <= n_all, path("y"), f"{y.shape[0]} train rows + 500 valid > {n_all}")
  _require(bool(test_index.size) and np.unique(test_index).size == test_index.size,
           path("test.index"), "empty, or an id twice")  # fmt: skip
  span = test_sorted[-1] - test_sorted[0] + 1 if name == "citeseer" else tx.shape[0]
  _require(bool(test_sorted[0] >= n_all) and test_sorted[-1] < n_all + span, path("test.index"),
           f"ids outside {n_all}..{n_all + span - 1} (the test rows follow allx)")  # fmt: skip
  _require(isinstance(graph, dict), path("graph"), "not a dict of adjacency lists")


def _fill_test_gaps(tx, ty, test_sorted: np.ndarray):
  """CiteSeer has test ids with no test row (isolated nodes): zero rows for them, as Kipf's
  loader does, so that positions line up -> (tx, ty) over every id in the test span."""
  full = np.arange(test_sorted[0], test_sorted[-1] + 1)
  tx_ext = sp.lil_matrix((full.size, tx.shape[1]), dtype=tx.dtype)
  tx_ext[test_sorted - test_sorted[0], :] = tx
  ty_ext = np.zeros((full.size, ty.shape[1]), ty.dtype)
  ty_ext[test_sorted - test_sorted[0], :] = ty
  return tx_ext.tocsr(), ty_ext


def _node_rows(allx, tx, ally, ty, test_index, test_sorted) -> tuple[np.ndarray, np.ndarray]:
  """(features f32[N, F], one-hot labels f32[N, C]) of every node, in node order."""
  features = sp.vstack([allx, tx]).tocsr().toarray().astype(np.float32)
  onehot = np.concatenate([ally, ty]).astype(np.float32)
  # The test rows come after allx in file order; test.index says where each belongs.
  features[test_index] = features[test_sorted]
  onehot[test_index] = onehot[test_sorted]
  return features, onehot


def _adjacency(graph: dict, num_nodes: int, path: str):
  """{node: neighbours} -> the undirected CSR adjacency; refuses ids outside the nodes."""
  try:
    src = np.concatenate([np.full(len(v), k, np.int64) for k, v in graph.items()] + [[]])
    dst = np.concatenate([np.asarray(v, np.int64).reshape(-1) for v in graph.values()] + [[]])
  except (TypeError, ValueError, OverflowError) as e:
    raise MalformedDataError(f"{path}: adjacency lists are not node ids ({e})") from None
  src, dst = src.astype(np.int64), dst.astype(np.int64)
  out = (src < 0) | (src >= num_nodes) | (dst < 0) | (dst >= num_nodes)
  _require(not out.any(), path, f"{int(out.sum())} edges name nodes outside 0..{num_nodes - 1}")
  return store.csr_from_edges(src, dst, num_nodes, undirected=True)
