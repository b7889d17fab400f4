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

Every file is parsed strictly: a value that is not a number, a line with another number of
columns, an empty field, a node id outside 0..N-1, or a damaged gzip stream raises
MalformedDataError naming the file, how many lines are malformed and the first few (line
number and text). Nothing is skipped: a dropped label or feature line would shift every node
after it, so a malformed file is refused rather than read around.
"""

from __future__ import annotations

import gzip
import os
import re
import warnings
import zlib

import numpy as np

from recgnn.graphs import store

_MAX_EXAMPLES = 5
_INT_CHARS = np.zeros(256, bool)
_INT_CHARS[np.frombuffer(b"0123456789,\n", np.uint8)] = True
# Decimal and exponent notation, nan and inf; not C's hex floats ("0x1p3"), which a CSV of
# features never means.
_FLOAT_CHARS = np.zeros(256, bool)
_FLOAT_CHARS[np.frombuffer(b"0123456789.eE+-naifNAIF,\n", np.uint8)] = True
_LABEL_RE = re.compile(rb"[0-9]{1,9}(\.0*)?")


class MalformedDataError(ValueError):
  """An OGB file that is not what the raw layout specifies (the message names it)."""


def _read_bytes(path: str) -> bytes:
  """A gzip file's text, with one newline at the end; a damaged stream is refused."""
  try:
    with gzip.open(path, "rb") as f:
      data = f.read()
  except (OSError, EOFError, zlib.error) as e:  # BadGzipFile is an OSError
    raise MalformedDataError(
      f"{path}: not a readable gzip file ({type(e).__name__}: {e}); download it again"
    ) from None
  data = data.replace(b"\r\n", b"\n")
  if data and not data.endswith(b"\n"):
    data += b"\n"
  return data


def _refuse(path: str, data: bytes, lines: np.ndarray, what: str) -> None:
  """Raise MalformedDataError for the (0-based) line indices `lines` of `data`."""
  lines = np.unique(lines)
  text = data.split(b"\n")
  first = "; ".join(
    f"line {i + 1}: {text[i][:80].decode('utf-8', 'replace')!r}" for i in lines[:_MAX_EXAMPLES]
  )
  raise MalformedDataError(f"{path}: {lines.size} malformed lines ({what}; first: {first})")


def read_table(path: str, kind: str, columns: int | None = None) -> np.ndarray:
  """A gzipped CSV of numbers -> int64 or float64 [lines, columns], strictly.

  kind: "int" (non-negative decimal integers, at most 18 digits) or "float".
  columns: the columns every line must have; None: those of the first line.
  Fast: one vectorized check of the bytes, then one numpy parse of the whole text.
  """
  data = _read_bytes(path)
  if not data:
    return np.zeros((0, columns or 1), np.int64 if kind == "int" else np.float64)
  b = np.frombuffer(data, np.uint8)
  nl = np.flatnonzero(b == 10)
  line_of = lambda pos: np.searchsorted(nl, pos)
  allowed = _INT_CHARS if kind == "int" else _FLOAT_CHARS
  bad_char = np.flatnonzero(~allowed[b])
  if bad_char.size:
    _refuse(path, data, line_of(bad_char), "a character that is not part of a number")
  sep = np.flatnonzero((b == 44) | (b == 10))
  length = np.diff(sep, prepend=-1) - 1  # of the field ending at each separator
  empty = sep[length == 0]
  if empty.size:
    _refuse(path, data, line_of(empty), "an empty field")
  if kind == "int" and length.max() > 18:
    _refuse(path, data, line_of(sep[length > 18]), "an integer of more than 18 digits")
  commas = np.cumsum(b == 44)[nl]
  per_line = np.diff(commas, prepend=0)
  columns = int(per_line[0]) + 1 if columns is None else columns
  wrong = np.flatnonzero(per_line != columns - 1)
  if wrong.size:
    _refuse(path, data, wrong, f"not {columns} comma-separated columns")
  dtype = np.int64 if kind == "int" else np.float64
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # numpy's "could not be read to its end"
    try:
      values = np.fromstring(data.replace(b"\n", b",")[:-1].decode("ascii"), dtype, sep=",")
    except ValueError:
      values = np.zeros(0, dtype)
  if values.size != nl.size * columns:  # a field numpy could not read whole ("1e", "--1")
    bad = []
    for i, line in enumerate(data.split(b"\n")[:-1]):
      for field in line.split(b","):
        try:
          float(field)
        except ValueError:
          bad.append(i)
          break
    if not bad:
      bad = [values.size // columns]
    _refuse(path, data, np.asarray(bad), "a field that is not a number")
  return values.reshape(nl.size, columns)


def _read_labels(path: str) -> np.ndarray:
  """One label per line -> int32[N]; "nan" or an empty line is unlabelled (-1)."""
  data = _read_bytes(path)
  out = np.empty(data.count(b"\n"), np.int32)
  bad = []
  for i, line in enumerate(data.split(b"\n")[:-1]):
    v = line.strip()
    if not v or v.lower() == b"nan":
      out[i] = -1
    elif _LABEL_RE.fullmatch(v):
      out[i] = int(float(v))
    else:
      bad.append(i)
  if bad:
    _refuse(path, data, np.asarray(bad), "a label that is not a class number, nan or empty")
  return out


def _check_ids(path: str, ids: np.ndarray, num_nodes: int) -> None:
  """Refuse node ids outside 0..num_nodes-1 (they would index another node or crash later)."""
  if ids.size == 0:
    return
  out = np.flatnonzero((ids.max(axis=1) if ids.ndim == 2 else ids) >= num_nodes)
  if out.size:
    data = _read_bytes(path)
    _refuse(path, data, out, f"a node id outside 0..{num_nodes - 1}")


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

  edges = read_table(edge_file, "int", columns=2)
  label_file = os.path.join(raw, "node-label.csv.gz")
  labels = _read_labels(label_file)
  feat_file = os.path.join(raw, "node-feat.csv.gz")
  features = None
  if os.path.exists(feat_file):
    features = read_table(feat_file, "float").astype(np.float32)
  count_file = os.path.join(raw, "num-node-list.csv.gz")
  if os.path.exists(count_file):
    counts = read_table(count_file, "int", columns=1)
    if counts.shape[0] != 1:
      raise MalformedDataError(f"{count_file}: {counts.shape[0]} lines; expected one node count")
    num_nodes = int(counts[0, 0])
  else:
    num_nodes = labels.shape[0]
  if labels.shape[0] != num_nodes:
    raise MalformedDataError(f"{label_file}: {labels.shape[0]} labels for {num_nodes} nodes")
  if features is not None and features.shape[0] != num_nodes:
    raise MalformedDataError(f"{feat_file}: {features.shape[0]} rows for {num_nodes} nodes")
  if num_nodes == 0:
    raise MalformedDataError(f"{raw}: no nodes")
  _check_ids(edge_file, edges, num_nodes)

  splits = {}
  for name in store.SPLITS:
    f = os.path.join(split_root, split, f"{name}.csv.gz")
    if not os.path.exists(f):
      raise FileNotFoundError(f"split file {f} missing")
    splits[name] = read_table(f, "int", columns=1)[:, 0]
    _check_ids(f, splits[name], num_nodes)
  return store.Graph(
    name=os.path.basename(os.path.normpath(path)),
    adj=store.csr_from_edges(edges[:, 0], edges[:, 1], num_nodes, undirected=undirected),
    labels=labels,
    num_classes=int(labels.max()) + 1,
    splits=splits,
    features=features,
  )
