"""How the generic reader's files become parsed blocks (`ctr_cache.Parsed`): a format cuts a
file into tasks and parses one task in a worker; see `ctr_reader` for what is read and the
malformed reasons.

  TextFormat     TSV / CSV lines: ctr_fast's compiled pass, and per line in Python (`_Rows`)
                 what it leaves (CSV lines holding a quote, multi-byte delimiters)
  ParquetFormat  one row group per task, columns by name (pyarrow), rows through `_Rows`
"""

from __future__ import annotations

import csv
import dataclasses
import math
import os
import re
from collections.abc import Callable

import numpy as np

from recgnn.data import ctr_fast, ctr_ids
from recgnn.data.bad_lines import MAX_EXAMPLES, MalformedDataError
from recgnn.data.ctr_cache import Parsed
from recgnn.data.ctr_ids import EMPTY, PADDED
from recgnn.data.ctr_schema import Categorical, Schema, string_key
from recgnn.data.text_blocks import PAD_BYTES, block_ranges, read_range

_MASK = (1 << 64) - 1
_PARQUET_BATCH = 1 << 14  # rows turned into Python objects at a time
_INT_RE = re.compile(rb"-?[0-9]+")
_HEX_RE = re.compile(rb"[0-9a-fA-F]+")
# What ctr_fast's decimal parser takes: Python's float() also takes spaces, '_', inf and nan.
_FLOAT_RE = re.compile(rb"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


# ----------------------------------------------------------------------------- rows


class _Bad(Exception):
  """A malformed line: its reason."""


def _key(value, kind: str, known: dict | None = None) -> int:
  """A value (bytes, str or int) -> its 64-bit key (see ctr_schema); `known`: string keys
  hashed ahead (ctr_fast.hash_bytes), by value."""
  if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
    return int(value) & _MASK if kind != "string" else string_key(str(int(value)).encode())
  if isinstance(value, str):
    value = value.encode("utf-8", "surrogateescape")
  if kind == "string":
    if known is not None and value in known:
      return known[value]
    return string_key(value)
  if kind == "int":
    if not _INT_RE.fullmatch(value):
      raise _Bad("categorical")
    return int(value) & _MASK
  if not _HEX_RE.fullmatch(value):
    raise _Bad("categorical")
  return int(value, 16) & _MASK


def _items(value, c: Categorical) -> list:
  """A field's values: [] for empty / null; a multi-hot string split on the separator."""
  if value is None:
    return []
  if isinstance(value, (list, tuple, np.ndarray)):
    return [v for v in value if v is not None and v != b"" and v != ""]
  if isinstance(value, (bytes, str)):
    if value in (b"", ""):
      return []
    if c.bag > 1:
      sep = c.separator.encode() if isinstance(value, bytes) else c.separator
      return [v for v in value.split(sep) if v]
  return [value]


def _fill_row(raw, state, i: int, cols, offsets, values, known=None) -> None:
  """Row i's id slots from its categorical field values (raises _Bad)."""
  for t, c in enumerate(cols):
    o = offsets[t]
    items = _items(values[t], c)
    if not items:
      state[i, o] = EMPTY
      state[i, o + 1 : o + c.bag] = PADDED
      continue
    if len(items) > c.bag:
      if c.overflow == "error":
        raise _Bad("bag_length")
      items = items[: c.bag]
    for k, v in enumerate(items):
      raw[i, o + k] = _key(v, c.kind, known)
    state[i, o + len(items) : o + c.bag] = PADDED


def _label(v) -> int:
  if isinstance(v, (bytes, str)):
    v = v.decode("latin1") if isinstance(v, bytes) else v
    if v not in ("0", "1"):
      raise _Bad("label")
    return int(v)
  if v is None or isinstance(v, (list, dict)) or v not in (0, 1):
    raise _Bad("label")
  return int(v)


def _dense(v) -> float:
  if v is None or v in (b"", ""):
    return 0.0
  if isinstance(v, (bytes, str)):
    b = v.encode("utf-8", "surrogateescape") if isinstance(v, str) else v
    if not _FLOAT_RE.fullmatch(b):
      raise _Bad("dense")
  try:
    x = float(v)
  except (TypeError, ValueError):
    raise _Bad("dense") from None
  if not math.isfinite(x):
    raise _Bad("dense")
  return x


class _Rows:
  """Accumulates parsed rows of one task into a `Parsed` block."""

  def __init__(self, schema: Schema, n: int, known: dict | None = None):
    self.schema = schema
    self.known = known
    self.cols = schema.categorical
    self.offsets = ctr_ids.offsets(self.cols)
    s = int(self.offsets[-1])
    self.labels = np.zeros(n, np.int8)
    self.dense = np.zeros((n, len(schema.dense)), np.float64)
    self.raw = np.zeros((n, s), np.uint64)
    self.state = np.zeros((n, s), np.uint8)
    self.rows = 0
    self.bad: list[tuple[int, str]] = []
    self.examples: list[tuple[int, str, str]] = []

  def add(self, index: int, label, dense, cats, text: Callable[[], str]) -> None:
    """Line `index` of the task, or a malformed-line record if a field is wrong."""
    i = self.rows
    try:
      self.labels[i] = _label(label)
      for k, v in enumerate(dense):
        self.dense[i, k] = _dense(v)
      self.state[i] = 0
      self.raw[i] = 0
      _fill_row(self.raw, self.state, i, self.cols, self.offsets, cats, self.known)
    except _Bad as e:
      self.reject(index, str(e), text)
      return
    self.rows += 1

  def reject(self, index: int, reason: str, text: Callable[[], str]) -> None:
    self.bad.append((index, reason))
    if len(self.examples) < MAX_EXAMPLES:
      t = text()
      self.examples.append((index, reason, t if len(t) <= 80 else t[:80] + "..."))

  def done(self, num_lines: int) -> Parsed:
    n = self.rows
    d = self.dense[:n]
    if self.schema.dense_transform == "log":
      d = np.log1p(np.maximum(d, 0.0))
    return Parsed(
      labels=self.labels[:n],
      dense=d.astype(np.float32),
      raw=self.raw[:n],
      state=self.state[:n],
      bad=self.bad,
      examples=self.examples,
      num_lines=num_lines,
    )


# ----------------------------------------------------------------------------- formats


@dataclasses.dataclass(frozen=True)
class _Layout:
  num_columns: int
  label: int
  dense: tuple[int, ...]
  cats: tuple[int, ...]
  header: bool


class TextFormat:
  """TSV / CSV lines (see the module docstring). Picklable: it travels to the workers."""

  unit = "MiB"
  raw_dtype = np.dtype(np.uint64)

  def __init__(self, schema: Schema, block_bytes: int):
    self.schema = schema
    self.block_bytes = block_bytes
    self.delim = schema.field_delimiter.encode()
    self.quoted = schema.format == "csv"
    # The compiled pass splits on single bytes.
    self.fast = len(self.delim) == 1 and all(
      len(c.separator.encode()) == 1 for c in schema.categorical if c.bag > 1
    )

  def split(self, line: bytes) -> list[bytes]:
    if self.quoted and b'"' in line:
      try:
        rows = list(
          csv.reader([line.decode("utf-8", "surrogateescape")], delimiter=self.delim.decode(),
                     strict=True)
        )  # fmt: skip
      except csv.Error:
        raise _Bad("quoting") from None
      if len(rows) != 1:
        raise _Bad("quoting")
      return [f.encode("utf-8", "surrogateescape") for f in rows[0]]
    return line.split(self.delim)

  def size(self, path: str) -> int:
    return os.path.getsize(path)

  def tasks(self, path: str):
    return block_ranges(path, self.block_bytes)

  def layout(self, path: str) -> _Layout:
    s = self.schema
    if s.header:
      with open(path, "rb") as f:
        first = f.readline().rstrip(b"\n").rstrip(b"\r")
      if not first:
        raise MalformedDataError(
          f"{path}: the schema says the file starts with a header line, but "
          + ("the file is empty" if os.path.getsize(path) == 0 else "its first line is empty")
          + " (header=False and `columns` read a file without one)"
        )
      try:
        names = [x.decode("utf-8", "replace") for x in self.split(first)]
      except _Bad:
        raise MalformedDataError(f"{path}: the header line has broken quoting") from None
      n, lab, dense, cats = s.column_indices(names, f"the header of {path}")
    else:
      n, lab, dense, cats = s.column_indices(s.columns, "the schema's `columns`")
    return _Layout(n, lab, tuple(dense), tuple(cats), s.header)

  def parse(self, path: str, start: int, stop: int, layout: _Layout) -> Parsed:
    """Every line through ctr_fast's compiled pass; what it leaves (CSV lines holding a
    quote, or every line when a delimiter or separator is longer than a byte) through
    `_python_line`."""
    buf, size = read_range(path, start, stop)
    body = buf[PAD_BYTES : PAD_BYTES + size]
    nl = np.flatnonzero(body == 10)
    starts = np.zeros(nl.size, np.int64)
    starts[1:] = nl[:-1] + 1
    ends = nl.astype(np.int64)
    ends -= (ends > starts) & (body[np.maximum(ends - 1, 0)] == 13)  # CRLF
    first = 1 if start == 0 and layout.header and nl.size else 0  # the header is line 1
    s = self.schema
    if self.fast:
      cols = s.categorical
      reason, labels, dense, raw, state = ctr_fast.parse_block(
        body, starts[first:], ends[first:], self.delim[0], 34 if self.quoted else -1,
        layout.num_columns, layout.label, np.asarray(layout.dense, np.int64),
        np.asarray(layout.cats, np.int64),
        np.array([ctr_fast.KIND_CODES[c.kind] for c in cols], np.int64),
        np.array([c.bag for c in cols], np.int64),
        np.array([c.separator.encode()[0] if c.bag > 1 else -1 for c in cols], np.int64),
        np.array([c.overflow == "error" for c in cols]), ctr_ids.offsets(cols),
      )  # fmt: skip
    else:
      n, slots = nl.size - first, s.num_slots
      reason = np.full(n, ctr_fast.NEEDS_PYTHON, np.int8)
      labels, dense = np.zeros(n, np.int8), np.zeros((n, len(s.dense)))
      raw, state = np.zeros((n, slots), np.uint64), np.zeros((n, slots), np.uint8)
    python_reasons = {}
    for r in np.flatnonzero(reason == ctr_fast.NEEDS_PYTHON):
      row = _Rows(s, 1)
      why = self._python_line(row, body[starts[first + r] : ends[first + r]].tobytes(), layout)
      if why is None:
        reason[r] = ctr_fast.OK
        labels[r], dense[r], raw[r], state[r] = (
          row.labels[0],
          row.dense[0],
          row.raw[0],
          row.state[0],
        )
      else:
        reason[r] = -1
        python_reasons[int(r)] = why
    ok = reason == ctr_fast.OK
    bad = [
      (first + int(r), python_reasons.get(int(r)) or ctr_fast.REASONS[int(reason[r])])
      for r in np.flatnonzero(~ok)
    ]
    examples = []
    for i, why in bad[:MAX_EXAMPLES]:
      t = body[starts[i] : ends[i]].tobytes().decode("utf-8", "replace")
      examples.append((i, why, t if len(t) <= 80 else t[:80] + "..."))
    d = dense[ok]
    if s.dense_transform == "log":
      d = np.log1p(np.maximum(d, 0.0))
    return Parsed(
      labels=labels[ok],
      dense=d.astype(np.float32),
      raw=raw[ok],
      state=state[ok],
      bad=bad,
      examples=examples,
      num_lines=int(nl.size),
    )

  def _python_line(self, row: _Rows, line: bytes, layout: _Layout) -> str | None:
    """One line into `row` (a one-row _Rows); the reason it is malformed, or None."""
    try:
      fields = self.split(line)
    except _Bad as e:
      return str(e)
    if len(fields) != layout.num_columns:
      return "columns"
    row.add(
      0,
      fields[layout.label],
      [fields[k] for k in layout.dense],
      [fields[k] for k in layout.cats],
      lambda: "",
    )
    return row.bad[0][1] if row.bad else None


class ParquetFormat:
  """Parquet files, one row group per task, columns by name (pyarrow)."""

  unit = "row groups"
  raw_dtype = np.dtype(np.uint64)

  def __init__(self, schema: Schema):
    self.schema = schema

  @staticmethod
  def _file(path: str):
    import pyarrow.parquet as pq

    return pq.ParquetFile(path)

  def size(self, path: str) -> int:
    return self._file(path).num_row_groups

  def tasks(self, path: str):
    return ((g, g + 1) for g in range(self.size(path)))

  def layout(self, path: str) -> None:
    self.schema.column_indices(self._file(path).schema_arrow.names, path)  # names checked

  def _string_keys(self, cols: dict[str, list]) -> dict[bytes, int]:
    """The keys of every distinct "string" value of a row group, hashed in one compiled call
    (a Python loop over each value's bytes would dominate the read)."""
    values = set()
    for c in self.schema.categorical:
      if c.kind == "string":
        for v in cols[c.name]:
          for item in _items(v, c):
            if isinstance(item, str):
              values.add(item.encode("utf-8", "surrogateescape"))
            elif isinstance(item, bytes):
              values.add(item)
    values = list(values)
    return dict(zip(values, ctr_fast.hash_bytes(values).tolist())) if values else {}

  def parse(self, path: str, start: int, stop: int, layout) -> Parsed:
    del layout
    s = self.schema
    names = [s.label, *s.dense, *s.table_names]
    f = self._file(path)
    groups = list(range(start, stop))
    n = sum(f.metadata.row_group(g).num_rows for g in groups)
    rows = _Rows(s, n)
    base = 0
    # Python objects cost ~50x the column bytes: a slice of the row group at a time.
    for batch in f.iter_batches(batch_size=_PARQUET_BATCH, row_groups=groups, columns=names):
      cols = {name: batch.column(name).to_pylist() for name in names}
      rows.known = self._string_keys(cols)
      for i in range(batch.num_rows):
        rows.add(
          base + i,
          cols[s.label][i],
          [cols[d][i] for d in s.dense],
          [cols[c][i] for c in s.table_names],
          lambda i=i, cols=cols: repr({k: v[i] for k, v in cols.items()}),
        )
      base += batch.num_rows
    return rows.done(n)
