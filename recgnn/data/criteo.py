"""Criteo click logs: TSV reader, binary cache, the reference splits and batches.

The Kaggle `train.txt` and the Terabyte `day_N` files are one example per line, 40 fields
separated by tabs:

  label  I1 .. I13  C1 .. C26
  label: 0 or 1.   I*: decimal integers, may be negative or empty.
  C*: 8 hex digits (the raw files use lowercase; uppercase is accepted too, it denotes the
      same 32-bit value), or empty.

Preprocessing follows the DLRM reference (facebookresearch/dlrm `data_utils.py`):
  dense  = log(max(x, 0) + 1) as float32; empty -> 0 (so log(1) = 0).
  sparse = one int32 id per table, by `ReaderConfig.categorical`:
    "frequency": every raw value is counted first; values seen >= `min_count` times get ids
                 FIRST_ID, FIRST_ID + 1, ... in order of decreasing count (ties by value), so
                 id order is popularity order; rarer values share UNKNOWN_ID. Vocabularies
                 are counted over all rows (train, valid and test), as the DLRM reference
                 does. The text is parsed once: the raw values wait in a temporary file
                 (108 bytes/row) until the counts are complete, then are remapped.
    "hash":      id = FIRST_ID + raw % (size - FIRST_ID), size from `hash_sizes`.
    "raw":       id = the 32-bit value itself, exact, as int64 in raw_ids.npy (no counting
                 pass, no fold; for dynamic tables: `ctr_schema`'s vocab="raw").
  An empty field gets MISSING_ID = 0 (raw: RAW_MISSING).

Criteo is one schema among others (`schema()`; data.schema="criteo" in a config);
this module is its fast format: the files stream in blocks (`block_bytes`, default 8 MiB)
parsed with numpy on their bytes (no per-line Python; optionally in `num_workers` processes)
through the generic converter (`ctr_cache`), writing .npy files under a cache directory:
  labels.npy int8[N]   dense.npy float32[N, 13]   sparse.npy int32[N, 26]   manifest.json
  (categorical="raw": sparse.npy int32[N, 0] and raw_ids.npy int64[N, 26], `ctr_cache`)
The manifest records the sources' sizes and mtimes: a changed source rebuilds the cache, an
unchanged one is opened as read-only memmaps (no copy). Malformed lines are skipped, counted
by reason and reported with the line numbers of the first few; past the error budget
(`max_bad_lines`, `max_bad_fraction`) the conversion stops with an error naming the file.

Splits (`split=`; ctr_dataset):
  "kaggle":    rows cut into 7 contiguous day-chunks (the first `N % 7` one row longer);
               days 0-5 train, day 6 split in two by np.array_split: first half test,
               second half valid (as DLRM's `getCriteoAdData`).
  "last_file": Terabyte: all files but the last train; the last file's first half test,
               second half valid (as DLRM / MLPerf for day_23).

The real data is not redistributable (Criteo's terms): never commit it; tests and the default
dataset use `recgnn.data.criteo_synthetic`, which writes the same TSV format.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from recgnn.data import ctr_cache
from recgnn.data.ctr_cache import VALUE, Budget, MalformedDataError, Parsed  # noqa: F401
from recgnn.data.ctr_dataset import (  # noqa: F401 (the Criteo names of the generic parts)
  KAGGLE_DAYS,
  SPLIT_NAMES,
  SPLITS,
  Batch,
  kaggle_split,
  last_file_split,
  padded_batch,
  process_rows,
)
from recgnn.data.ctr_dataset import CTRDataset as CriteoDataset
from recgnn.data.ctr_schema import (  # noqa: F401
  FIRST_ID,
  MISSING_ID,
  UNKNOWN_ID,
  Categorical,
  Schema,
)
from recgnn.data.text_blocks import block_ranges, iter_blocks, read_range  # noqa: F401

NUM_DENSE = 13
NUM_SPARSE = 26
NUM_TABS = NUM_DENSE + NUM_SPARSE  # tabs per well-formed line
DENSE_NAMES = tuple(f"I{i}" for i in range(1, NUM_DENSE + 1))
TABLE_NAMES = tuple(f"C{i}" for i in range(1, NUM_SPARSE + 1))

# Distinct values per table in the Kaggle train.txt, as counted by the DLRM reference.
KAGGLE_CARDINALITIES = (
  1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
  27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip
CATEGORICAL_MODES = ("frequency", "hash", "raw")
CACHE_VERSION = ctr_cache.CACHE_VERSION

_PAD = 8  # bytes of slack before and after a block, so 8-byte loads never leave the buffer
_ZEROS = np.uint64(0x3030303030303030)  # eight ASCII '0'
_MAX_EXAMPLES = ctr_cache.MAX_EXAMPLES
_INT_RE = re.compile(rb"-?[0-9]+")
_SORTED_LOOKUP = 512  # vocabularies larger than this are searched with sorted queries


# ----------------------------------------------------------------------------- config


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReaderConfig:
  """How TSV files become ids and features.

  Attributes:
    categorical: "frequency" (contiguous ids by count, a counting pass first), "hash", or
      "raw" (the keys as ids, no counting pass: for dynamic tables; recgnn.data.ctr_schema).
    min_count: "frequency": values seen fewer times share UNKNOWN_ID.
    hash_sizes: "hash": rows per table, one int for all tables or 26 ints (>= 3 each).
    max_bad_lines: malformed lines tolerated regardless of file size.
    max_bad_fraction: malformed lines tolerated per line read; the budget is
      max(max_bad_lines, max_bad_fraction * lines read so far), checked after every block.
    block_bytes: bytes parsed at a time (small blocks keep the temporaries in cache; memory
      peaks at about 12x this per process).
    num_workers: processes parsing blocks in parallel (0: parse in this process). Each costs
      a Python start-up and ~12 * block_bytes of memory; they are spawned,
      so the calling script needs the usual `if __name__ == "__main__":` guard. Pays off on
      an idle multi-core machine, not on an oversubscribed one.
  """

  categorical: str = "frequency"
  min_count: int = 1
  hash_sizes: int | tuple[int, ...] = 40_000_000
  max_bad_lines: int = 100
  max_bad_fraction: float = 0.0
  block_bytes: int = 8 << 20
  num_workers: int = 0

  def __post_init__(self):
    if self.categorical not in CATEGORICAL_MODES:
      raise ValueError(
        f"Unknown categorical mode {self.categorical!r}; available: {', '.join(CATEGORICAL_MODES)}"
      )
    if self.min_count < 1:
      raise ValueError(f"min_count must be >= 1, got {self.min_count}")
    sizes = self.table_sizes() if self.categorical == "hash" else ()
    if any(s < FIRST_ID + 1 for s in sizes):
      raise ValueError(f"hash_sizes must be >= {FIRST_ID + 1} (ids 0..{FIRST_ID - 1} reserved)")
    if self.num_workers < 0:
      raise ValueError(f"num_workers must be >= 0, got {self.num_workers}")
    if self.block_bytes < 1 << 16:
      raise ValueError(f"block_bytes must be >= 65536, got {self.block_bytes}")

  def table_sizes(self) -> tuple[int, ...]:
    """The 26 hash sizes."""
    if np.ndim(self.hash_sizes) == 0:
      return (int(self.hash_sizes),) * NUM_SPARSE
    if len(self.hash_sizes) != NUM_SPARSE:
      raise ValueError(f"hash_sizes needs {NUM_SPARSE} entries, got {len(self.hash_sizes)}")
    return tuple(int(s) for s in self.hash_sizes)

  def cache_key(self) -> dict[str, Any]:
    """The fields that change the cached arrays (the error budget does not)."""
    if self.categorical == "hash":
      return {"categorical": "hash", "hash_sizes": list(self.table_sizes())}
    if self.categorical == "raw":  # (int64 ids: a cache of 31-bit folded ids lacks "ids")
      return {"categorical": "raw", "ids": "int64"}
    return {"categorical": "frequency", "min_count": self.min_count}


def schema(reader: ReaderConfig | None = None) -> Schema:
  """Criteo as a schema: label, I1..I13 (log), C1..C26 one-hot hex, ids by `reader`."""
  reader = reader or ReaderConfig()
  hashed = reader.categorical == "hash"
  sizes = reader.table_sizes() if hashed else (0,) * NUM_SPARSE
  cats = tuple(
    Categorical(
      name=n, kind="hex", vocab=reader.categorical, min_count=reader.min_count, hash_size=s
    )
    for n, s in zip(TABLE_NAMES, sizes)
  )
  return Schema(
    name="criteo", label="label", dense=DENSE_NAMES, categorical=cats, format="tsv",
    columns=("label", *DENSE_NAMES, *TABLE_NAMES),
  )  # fmt: skip


# ----------------------------------------------------------------------------- parsing


@dataclasses.dataclass
class ParsedBlock:
  """The well-formed lines of one block.

  Attributes:
    labels: int8[n].
    dense: float32[n, 13], log(max(x, 0) + 1).
    raw: uint32[n, 26], the hex values (0 where missing).
    missing: bool[n, 26], empty categorical fields.
    bad: (line index in the block, reason) of each malformed line, in order.
    num_lines: lines in the block, good and bad.
  """

  labels: np.ndarray
  dense: np.ndarray
  raw: np.ndarray
  missing: np.ndarray
  bad: list[tuple[int, str]]
  num_lines: int


def _u64_at(buf: np.ndarray) -> np.ndarray:
  """Unaligned little-endian uint64 load at every byte offset: out[i] = buf[i : i + 8]."""
  return np.ndarray(shape=(buf.size - 7,), dtype="<u8", buffer=buf, strides=(1,))


def _pair_table(chars: bytes, values: range, invalid: int) -> np.ndarray:
  """uint16[65536]: a little-endian pair of chars (c0 | c1 << 8) -> value(c0) * base +
  value(c1), or `invalid` if either char is not in `chars`."""
  one = np.full(256, -1, np.int64)
  for c, v in zip(chars, values):
    one[c] = v
  base = max(values) + 1
  pair = np.arange(1 << 16)
  c0, c1 = one[pair & 0xFF], one[pair >> 8]
  return np.where((c0 >= 0) & (c1 >= 0), c0 * base + c1, invalid).astype(np.uint16)


# Two chars per table lookup: a 128 KiB table stays in cache and halves the work per byte.
_DEC_PAIRS = _pair_table(b"0123456789", range(10), 0x8000)
# Uppercase accepted: the same value, and rejecting it would buy nothing.
_HEX_PAIRS = _pair_table(b"0123456789abcdefABCDEF", [*range(16), *range(10, 16)], 0xFFFF)
_SHIFTS = 8 * (8 - np.arange(9))  # bits below a field of length 0..8 in its last 8 bytes
_KEEP = np.array([0] + [((1 << 64) - 1) ^ ((1 << int(s)) - 1) for s in _SHIFTS[1:]], np.uint64)
_FILL = _ZEROS & ~_KEEP  # '0' in the bytes before the field
_FIRST = np.minimum(_SHIFTS, 56).astype(np.uint64)  # bit offset of the field's first char
_MINUS = np.uint64(ord("-") ^ ord("0")) << _FIRST  # turns a leading '-' into '0'


def _parse_decimal(u64, data, starts, ends):
  """Dense fields -> (int64 values, bad bool), both [n, 13].

  Up to 8 chars at once: load the field's last 8 bytes as one uint64, fill the bytes before
  the field with '0', then digit pairs by table lookup and Lemire's SWAR combine. Longer
  fields (> 99,999,999; rare) go through Python.
  """
  length = ends - starts
  short = np.minimum(length, 8)
  w = (u64[ends - 8] & _KEEP[short]) | _FILL[short]
  neg = ((w >> _FIRST[short]) & np.uint64(0xFF)) == ord("-")
  w ^= np.where(neg, _MINUS[short], np.uint64(0))
  v = _DEC_PAIRS[w.view(np.uint16)].view(np.uint64)  # four 0..99 lanes, or 0x8000 flags
  bad = ((v & np.uint64(0x8000800080008000)) != 0) | (neg & (length == 1))
  v = (v * np.uint64(6553601)) >> np.uint64(16)
  v = ((v & np.uint64(0x0000FFFF0000FFFF)) * np.uint64(42949672960001)) >> np.uint64(32)
  values = np.where(neg, 0, v.astype(np.int64))  # negative -> 0 (DLRM reference)
  for i, k in zip(*np.nonzero(length > 8)):
    text = data[starts[i, k] : ends[i, k]].tobytes()
    ok = _INT_RE.fullmatch(text) is not None and len(text) <= 18
    bad[i, k] = not ok
    values[i, k] = max(int(text), 0) if ok else 0
  return values, bad


def _parse_hex(u64, starts, ends):
  """Categorical fields -> (uint32 values, missing, bad), each [n, 26]: the 8 chars as one
  uint64 load, char pairs -> bytes by table lookup, bytes -> big-endian uint32."""
  length = ends - starts
  v = _HEX_PAIRS[u64[starts].view(np.uint16)]
  invalid = (v.view(np.uint64) & np.uint64(0xFF00FF00FF00FF00)) != 0
  raw = v.astype(np.uint8).view(">u4").astype(np.uint32)
  missing = length == 0
  bad = ~missing & ((length != 8) | invalid)
  raw[missing | bad] = 0
  return raw, missing, bad


def parse_block(buf: np.ndarray, size: int) -> ParsedBlock:
  """Parse whole lines, vectorized.

  Args:
    buf: uint8[_PAD + size + _PAD]; the lines are buf[_PAD : _PAD + size] and end with b"\\n".
      Lines may end in "\\r\\n".
    size: bytes of lines in `buf`.
  Returns:
    The well-formed lines' values and the malformed lines' indices and reasons.
  """
  data = buf[: _PAD + size]
  body = data[_PAD:]
  nl = np.flatnonzero(body == 10) + _PAD
  tabs = np.flatnonzero(body == 9) + _PAD
  n = nl.size
  line_start = np.empty(n, np.int64)
  line_start[:1] = _PAD
  line_start[1:] = nl[:-1] + 1
  line_end = nl - (data[nl - 1] == 13)
  bad_reason = np.zeros(n, np.int8)  # 0 ok, 1 columns, 2 label, 3 dense, 4 categorical
  if tabs.size == NUM_TABS * n:
    t = tabs.reshape(n, NUM_TABS)  # right iff every line's first and last tab lie inside it
    fast = n == 0 or bool(np.all(t[:, 0] >= line_start) and np.all(t[:, -1] < nl))
  else:
    fast = False
  if fast:
    good = np.arange(n)
  else:
    before = np.searchsorted(tabs, nl)  # tabs before each newline
    counts = np.diff(before, prepend=0)
    bad_reason[counts != NUM_TABS] = 1
    good = np.flatnonzero(counts == NUM_TABS)
    t = tabs[(before[good] - NUM_TABS)[:, None] + np.arange(NUM_TABS)]
  fs = np.empty((good.size, NUM_TABS + 1), np.int64)
  fe = np.empty_like(fs)
  fs[:, 0], fs[:, 1:] = line_start[good], t + 1
  fe[:, :-1], fe[:, -1] = t, line_end[good]
  del t

  label_char = data[fs[:, 0]]
  label_bad = (fe[:, 0] - fs[:, 0] != 1) | ((label_char != 48) & (label_char != 49))
  u64 = _u64_at(buf)
  values, dense_bad = _parse_decimal(u64, data, fs[:, 1:14], fe[:, 1:14])
  raw, missing, hex_bad = _parse_hex(u64, fs[:, 14:], fe[:, 14:])
  dense_bad = dense_bad.any(axis=1)
  hex_bad = hex_bad.any(axis=1)
  reason = np.where(label_bad, 2, np.where(dense_bad, 3, np.where(hex_bad, 4, 0)))
  bad_reason[good] = reason
  ok = reason == 0
  if not ok.all():
    values, raw, missing, label_char = values[ok], raw[ok], missing[ok], label_char[ok]
  bad_idx = np.flatnonzero(bad_reason)
  names = ("", "columns", "label", "dense", "categorical")
  bad = [(int(i), names[bad_reason[i]]) for i in bad_idx]
  dense = np.log1p(values.astype(np.float32))
  return ParsedBlock(
    labels=(label_char - 48).astype(np.int8),
    dense=dense,
    raw=raw,
    missing=missing,
    bad=bad,
    num_lines=n,
  )


def _line_text(buf: np.ndarray, size: int, index: int, limit: int = 80) -> str:
  """The `index`-th line of a block, shortened, for error messages."""
  body = buf[_PAD : _PAD + size]
  nl = np.flatnonzero(body == 10)
  start = 0 if index == 0 else nl[index - 1] + 1
  text = body[start : nl[index]].tobytes().decode("utf-8", "replace").rstrip("\r")
  return text if len(text) <= limit else text[:limit] + "..."


class CriteoTSV:
  """The Criteo TSV as a `ctr_cache` format: byte-range tasks through `parse_block`."""

  unit = "MiB"
  raw_dtype = np.dtype(np.uint32)

  def __init__(self, block_bytes: int):
    self.block_bytes = block_bytes

  def size(self, path: str) -> int:
    return os.path.getsize(path)

  def tasks(self, path: str):
    return block_ranges(path, self.block_bytes)

  def layout(self, path: str) -> None:
    return None

  def parse(self, path: str, start: int, stop: int, layout) -> Parsed:
    del layout
    buf, size = read_range(path, start, stop)
    block = parse_block(buf, size)
    return Parsed(
      labels=block.labels,
      dense=block.dense,
      raw=block.raw,
      state=np.where(block.missing, ctr_cache.EMPTY, VALUE).astype(np.uint8),
      bad=block.bad,
      examples=[(i, r, _line_text(buf, size, i)) for i, r in block.bad[:_MAX_EXAMPLES]],
      num_lines=block.num_lines,
    )


def _vocab_ids(raw: np.ndarray, missing: np.ndarray, vocab) -> np.ndarray:
  """uint32[n, 26] raw values, bool[n, 26] missing, [(vals, ids)] * 26 -> int32[n, 26]."""
  out = np.empty(raw.shape, np.int32)
  for t, (vals, ids) in enumerate(vocab):
    out[:, t] = ctr_cache.lookup(raw[:, t], vals, ids, _SORTED_LOOKUP)
  out[missing] = MISSING_ID
  return out


# ----------------------------------------------------------------------------- cache


def _budget(reader: ReaderConfig) -> ctr_cache.BadLines:
  return ctr_cache.BadLines(
    Budget(reader.max_bad_lines, reader.max_bad_fraction),
    "ReaderConfig(max_bad_lines=..., max_bad_fraction=...) (--config.data.max_bad_lines)",
  )


def _cache_dir(cache_dir: str, paths: Sequence[str], reader: ReaderConfig) -> str:
  key = json.dumps({"paths": [os.path.abspath(p) for p in paths], **reader.cache_key()})
  return os.path.join(cache_dir, "criteo-" + hashlib.sha1(key.encode()).hexdigest()[:16])


def convert(
  paths: Sequence[str],
  out_dir: str,
  reader: ReaderConfig,
  progress: Callable[[str], None] | None = print,
) -> dict[str, Any]:
  """TSV files -> labels.npy, dense.npy, sparse.npy and manifest.json in `out_dir`
  (`ctr_cache.convert` with the Criteo format). Returns the manifest."""
  return ctr_cache.convert(
    paths, out_dir, CriteoTSV(reader.block_bytes), schema(reader).categorical,
    num_dense=NUM_DENSE, key=reader.cache_key(), bad=_budget(reader),
    num_workers=reader.num_workers, progress=progress, label="criteo",
  )  # fmt: skip


def open_criteo(
  paths: str | Sequence[str],
  cache_dir: str,
  *,
  reader: ReaderConfig | None = None,
  split: str = "kaggle",
  progress: Callable[[str], None] | None = print,
) -> CriteoDataset:
  """Open Criteo TSV files, converting them to the binary cache the first time.

  Args:
    paths: `train.txt` (Kaggle) or `day_0`, ..., `day_23` (Terabyte), read in this order.
    cache_dir: where converted datasets live (one subdirectory per sources + reader settings).
    reader: parsing and id settings.
    split: "kaggle" or "last_file" (see the module docstring).
    progress: where progress lines go (None: silent).
  Returns:
    The dataset, memmapped from the cache.
  Raises:
    MalformedDataError: more malformed lines than the reader's budget.
  """
  paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
  paths = [os.fspath(p) for p in paths]
  reader = reader or ReaderConfig()
  for p in paths:
    if not os.path.isfile(p):
      raise FileNotFoundError(
        f"Criteo file {p!r} not found. Download the Kaggle train.txt or the Terabyte day_N "
        "files yourself (their terms forbid redistribution), or omit the path to use the "
        "embedded synthetic dataset."
      )
  out = _cache_dir(cache_dir, paths, reader)
  why = ctr_cache.cache_valid(out, paths, reader.cache_key())
  if why is not None:
    if progress is not None:
      progress(f"criteo: converting {', '.join(paths)} -> {out} ({why})")
    convert(paths, out, reader, progress)
  if split not in SPLITS:
    raise ValueError(f"Unknown split {split!r}; available: {', '.join(SPLITS)}")
  dataset = CriteoDataset(out, split, reused_cache=why is None)
  # The cached counts are re-checked so a smaller budget than at conversion time still bites.
  _budget(reader).recheck(dataset.manifest["bad_lines"], paths, dataset.manifest["file_rows"])
  return dataset
