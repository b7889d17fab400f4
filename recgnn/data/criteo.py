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
  In both modes an empty field gets MISSING_ID = 0.

Conversion streams the files in blocks (`block_bytes`, default 8 MiB) and parses each block
with numpy on its bytes (no per-line Python; optionally in `num_workers` processes), writing
.npy files under a cache directory:
  labels.npy int8[N]   dense.npy float32[N, 13]   sparse.npy int32[N, 26]   manifest.json
The manifest records the sources' sizes and mtimes: a changed source rebuilds the cache, an
unchanged one is opened as read-only memmaps (no copy). Malformed lines are skipped, counted
by reason and reported with the line numbers of the first few; past the error budget
(`max_bad_lines`, `max_bad_fraction`) the conversion stops with an error naming the file.

Splits (`split=`):
  "kaggle":    rows cut into 7 contiguous day-chunks (the first `N % 7` one row longer);
               days 0-5 train, day 6 split in two by np.array_split: first half test,
               second half valid (as DLRM's `getCriteoAdData`).
  "last_file": Terabyte: all files but the last train; the last file's first half test,
               second half valid (as DLRM / MLPerf for day_23).

The real data is not redistributable (Criteo's terms): never commit it; tests and the default
dataset use `recgnn.data.criteo_synthetic`, which writes the same TSV format.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import multiprocessing
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

NUM_DENSE = 13
NUM_SPARSE = 26
NUM_TABS = NUM_DENSE + NUM_SPARSE  # tabs per well-formed line
DENSE_NAMES = tuple(f"I{i}" for i in range(1, NUM_DENSE + 1))
TABLE_NAMES = tuple(f"C{i}" for i in range(1, NUM_SPARSE + 1))

MISSING_ID = 0  # an empty categorical field, in both modes
UNKNOWN_ID = 1  # "frequency" mode: a value seen fewer than `min_count` times
FIRST_ID = 2  # first id of a real value (both modes, so the two id spaces line up)

KAGGLE_DAYS = 7
# Distinct values per table in the Kaggle train.txt, as counted by the DLRM reference.
KAGGLE_CARDINALITIES = (
  1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
  27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip
CATEGORICAL_MODES = ("frequency", "hash")
SPLITS = ("kaggle", "last_file")
SPLIT_NAMES = ("train", "valid", "test")
CACHE_VERSION = 1

_PAD = 8  # bytes of slack before and after a block, so 8-byte loads never leave the buffer
_ZEROS = np.uint64(0x3030303030303030)  # eight ASCII '0'
_MAX_EXAMPLES = 10  # malformed lines quoted in reports
_INT_RE = re.compile(rb"-?[0-9]+")
_SORTED_LOOKUP = 512  # vocabularies larger than this are searched with sorted queries

Batch = dict[str, Any]


# ----------------------------------------------------------------------------- config


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReaderConfig:
  """How TSV files become ids and features.

  Attributes:
    categorical: "frequency" (contiguous ids by count, a counting pass first) or "hash".
    min_count: "frequency": values seen fewer times share UNKNOWN_ID.
    hash_sizes: "hash": rows per table, one int for all tables or 26 ints (>= 3 each).
    max_bad_lines: malformed lines tolerated regardless of file size.
    max_bad_fraction: malformed lines tolerated per line read; the budget is
      max(max_bad_lines, max_bad_fraction * lines read so far), checked after every block.
    block_bytes: bytes parsed at a time (small blocks keep the temporaries in cache; memory
      peaks at about 12x this per process).
    num_workers: processes parsing blocks in parallel (0: parse in this process). Each costs
      a Python start-up (~0.3 s of CPU) and ~12 * block_bytes of memory; they are spawned,
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
    return {"categorical": "frequency", "min_count": self.min_count}


class MalformedDataError(ValueError):
  """Too many malformed lines in a source file."""


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


def block_ranges(path: str, block_bytes: int) -> Iterator[tuple[int, int]]:
  """Byte ranges [start, stop) of about `block_bytes` each, cut after a newline.

  A line longer than `block_bytes` is an error (not a Criteo TSV file, or raise block_bytes).
  """
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    start = 0
    while start < size:
      stop = start + block_bytes
      if stop >= size:
        yield start, size
        return
      f.seek(stop)
      scanned = 0
      while True:  # to the end of the line that holds byte stop - 1
        piece = f.read(1 << 16)
        found = piece.find(b"\n")
        if found >= 0:
          stop += scanned + found + 1
          break
        scanned += len(piece)
        if not piece or scanned > block_bytes:
          if not piece:  # the last line has no newline: it ends the file
            stop = size
            break
          raise MalformedDataError(
            f"{path}: no newline in {scanned:,} bytes after byte {stop:,}: not a Criteo TSV "
            f"file (or a line longer than block_bytes={block_bytes}; raise "
            "ReaderConfig.block_bytes)"
          )
      yield start, stop
      start = stop


def read_range(path: str, start: int, stop: int) -> tuple[np.ndarray, int]:
  """Bytes [start, stop) of a file as a padded block for `parse_block`: (buf, size).

  A last line without its newline gets one.
  """
  n = stop - start
  buf = np.zeros(_PAD + n + 1 + _PAD, np.uint8)
  with open(path, "rb") as f:
    f.seek(start)
    got = f.readinto(memoryview(buf)[_PAD : _PAD + n])
  if got != n:
    raise OSError(f"{path}: read {got} bytes at {start}, expected {n} (file changed?)")
  if n and buf[_PAD + n - 1] != 10:
    buf[_PAD + n] = 10
    n += 1
  return buf, n


def iter_blocks(path: str, block_bytes: int) -> Iterator[tuple[np.ndarray, int, int]]:
  """Read a file in blocks of whole lines: yields (buf, size, end offset) for `parse_block`."""
  for start, stop in block_ranges(path, block_bytes):
    buf, size = read_range(path, start, stop)
    yield buf, size, stop


# ----------------------------------------------------------------------------- cache files


class _NpyWriter:
  """Appends rows to a .npy file whose length is known only at the end (header rewritten)."""

  HEADER = 128

  def __init__(self, path: str, dtype, row_shape: tuple[int, ...]):
    self.path, self.dtype, self.row_shape, self.rows = path, np.dtype(dtype), row_shape, 0
    self.f = open(path, "wb")  # noqa: SIM115 (closed in `close`)
    self.f.write(b"\0" * self.HEADER)

  def append(self, a: np.ndarray):
    a = np.ascontiguousarray(a, self.dtype)
    assert a.shape[1:] == self.row_shape, (a.shape, self.row_shape)
    self.f.write(a.data)
    self.rows += a.shape[0]

  def close(self):
    shape = (self.rows, *self.row_shape)
    d = f"{{'descr': '{self.dtype.str}', 'fortran_order': False, 'shape': {shape}, }}"
    head = b"\x93NUMPY\x01\x00"
    body = d.encode("latin1")
    pad = self.HEADER - len(head) - 2 - len(body) - 1
    assert pad >= 0, d
    self.f.seek(0)
    self.f.write(head + np.uint16(len(body) + pad + 1).tobytes() + body + b" " * pad + b"\n")
    self.f.close()


def _source_stats(paths: Sequence[str]) -> list[dict[str, Any]]:
  out = []
  for p in paths:
    st = os.stat(p)
    out.append({"path": os.path.abspath(p), "size": st.st_size, "mtime_ns": st.st_mtime_ns})
  return out


def _cache_dir(cache_dir: str, paths: Sequence[str], reader: ReaderConfig) -> str:
  key = json.dumps({"paths": [os.path.abspath(p) for p in paths], **reader.cache_key()})
  return os.path.join(cache_dir, "criteo-" + hashlib.sha1(key.encode()).hexdigest()[:16])


class _BadLines:
  """Counts malformed lines per file and enforces the error budget."""

  def __init__(self, reader: ReaderConfig):
    self.reader = reader
    self.files: dict[str, dict[str, Any]] = {}

  def add(self, path: str, result: dict[str, Any], first_line: int, lines_read: int):
    """Record one block's malformed lines (`_work`'s result) and enforce the budget."""
    if result["bad"]:
      rec = self.files.setdefault(path, {"count": 0, "by_reason": {}, "examples": []})
      for _, reason in result["bad"]:
        rec["count"] += 1
        rec["by_reason"][reason] = rec["by_reason"].get(reason, 0) + 1
      for index, reason, text in result["examples"]:
        if len(rec["examples"]) < _MAX_EXAMPLES:
          rec["examples"].append({"line": first_line + index, "reason": reason, "text": text})
    self.check(path, lines_read)

  def check(self, path: str, lines_read: int):
    rec = self.files.get(path)
    if not rec:
      return
    r = self.reader
    budget = max(r.max_bad_lines, int(r.max_bad_fraction * lines_read))
    if rec["count"] > budget:
      first = "; ".join(f"line {e['line']} ({e['reason']}): {e['text']!r}" for e in rec["examples"])
      raise MalformedDataError(
        f"{path}: {rec['count']} malformed lines in the first {lines_read} "
        f"({_reasons(rec)}), over the budget of {budget}. First: {first}. "
        "If the file is right, raise the budget: ReaderConfig(max_bad_lines=..., "
        "max_bad_fraction=...) (--config.data.max_bad_lines)."
      )

  def total(self) -> int:
    return sum(r["count"] for r in self.files.values())


def _reasons(rec) -> str:
  return ", ".join(f"{v} {k}" for k, v in sorted(rec["by_reason"].items()))


def _progress_printer(progress: Callable[[str], None] | None, label: str):
  t0 = time.perf_counter()
  last = [t0]

  def report(rows: int, bytes_done: int, total_bytes: int, final: bool = False):
    now = time.perf_counter()
    if progress is None or (not final and now - last[0] < 2.0):
      return
    last[0] = now
    dt = max(now - t0, 1e-9)
    progress(
      f"criteo {label}: {rows:,} rows, {bytes_done / 2**20:,.0f}/{total_bytes / 2**20:,.0f} MiB, "
      f"{rows / dt:,.0f} rows/s, {bytes_done / 2**20 / dt:,.1f} MiB/s"
    )

  return report


# What a worker needs besides its task (the hash sizes), set once per process.
_WORKER: dict[str, Any] = {}


def _init_worker(state: dict[str, Any]):
  _WORKER.clear()
  _WORKER.update(state)


def _work(task: tuple[str, int, int, str]) -> dict[str, Any]:
  """Parse one byte range and do the pass's per-block work. Runs in a worker process (or
  in-process with num_workers=0); returns only numpy arrays and small lists."""
  path, start, stop, what = task
  buf, size = read_range(path, start, stop)
  block = parse_block(buf, size)
  out: dict[str, Any] = {
    "num_lines": block.num_lines,
    "bad": block.bad,
    "examples": [(i, r, _line_text(buf, size, i)) for i, r in block.bad[:_MAX_EXAMPLES]],
    "rows": block.labels.shape[0],
    "stop": stop,
  }
  out.update(labels=block.labels, dense=block.dense)
  if what == "parse":  # "frequency" mode's first pass: ids need the counts of every block
    out["counts"] = [
      np.unique(block.raw[:, t][~block.missing[:, t]], return_counts=True)
      for t in range(NUM_SPARSE)
    ]
    out.update(raw=block.raw, missing=_pack_bits(block.missing))
  else:
    out["ids"] = _hash_ids(block, _WORKER["sizes"])
  return out


def _pack_bits(missing: np.ndarray) -> np.ndarray:
  """bool[n, 26] -> uint32[n], bit t = column t."""
  return (missing.astype(np.uint32) << np.arange(NUM_SPARSE, dtype=np.uint32)).sum(
    axis=1, dtype=np.uint32
  )


def _unpack_bits(bits: np.ndarray) -> np.ndarray:
  return ((bits[:, None] >> np.arange(NUM_SPARSE, dtype=np.uint32)) & 1).astype(bool)


def _stream(paths, what: str, reader: ReaderConfig, bad: _BadLines, label: str, progress, state):
  """Yields (file index, `_work` result) over all blocks of all files in order, enforcing the
  error budget; with reader.num_workers > 0 the blocks are parsed in worker processes, at
  most 2 per worker in flight so memory stays bounded."""
  total_bytes = sum(os.path.getsize(p) for p in paths)
  report = _progress_printer(progress, label)
  tasks = (
    (fi, (os.path.abspath(p), start, stop, what))
    for fi, p in enumerate(paths)
    for start, stop in block_ranges(p, reader.block_bytes)
  )
  base = np.cumsum([0] + [os.path.getsize(p) for p in paths])
  pool = None
  if reader.num_workers > 0:
    # spawn, not fork: the parent may run JAX threads, and forking those can deadlock.
    ctx = multiprocessing.get_context("spawn")
    pool = ctx.Pool(reader.num_workers, initializer=_init_worker, initargs=(state,))
    results = _bounded_imap(pool, tasks, 2 * reader.num_workers)
  else:
    _init_worker(state)
    results = ((fi, _work(task)) for fi, task in tasks)
  try:
    rows, line, current = 0, 1, -1
    for fi, result in results:
      if fi != current:
        current, line = fi, 1
      bad.add(os.path.abspath(paths[fi]), result, line, line - 1 + result["num_lines"])
      line += result["num_lines"]
      rows += result["rows"]
      yield fi, result
      report(rows, int(base[fi]) + result["stop"], total_bytes)
    report(rows, total_bytes, total_bytes, final=True)
  finally:
    if pool is not None:
      pool.terminate()
    _WORKER.clear()


def _bounded_imap(pool, tasks, window: int):
  """Ordered results of `_work` over (key, task) pairs, at most `window` submitted ahead."""
  pending: collections.deque = collections.deque()
  for key, task in tasks:
    pending.append((key, pool.apply_async(_work, (task,))))
    if len(pending) >= window:
      k, r = pending.popleft()
      yield k, r.get()
  while pending:
    k, r = pending.popleft()
    yield k, r.get()


class _Counter:
  """Per-table value counts, merged lazily so the cost stays O(values log values)."""

  def __init__(self):
    self.values = [np.zeros(0, np.uint32) for _ in range(NUM_SPARSE)]
    self.counts = [np.zeros(0, np.int64) for _ in range(NUM_SPARSE)]
    self.pending: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(NUM_SPARSE)]
    self.pending_size = [0] * NUM_SPARSE

  def add(self, counts: list[tuple[np.ndarray, np.ndarray]]):
    for t, (u, c) in enumerate(counts):
      self.pending[t].append((u, c))
      self.pending_size[t] += u.size
      if self.pending_size[t] > max(self.values[t].size, 1 << 20):
        self._merge(t)

  def _merge(self, t: int):
    vals = np.concatenate([self.values[t]] + [u for u, _ in self.pending[t]])
    cnts = np.concatenate([self.counts[t]] + [c for _, c in self.pending[t]])
    u, inv = np.unique(vals, return_inverse=True)
    self.values[t] = u
    self.counts[t] = np.bincount(inv, weights=cnts, minlength=u.size).astype(np.int64)
    self.pending[t], self.pending_size[t] = [], 0

  def vocabularies(self, min_count: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per table: (kept values sorted ascending, their ids)."""
    out = []
    for t in range(NUM_SPARSE):
      self._merge(t)
      keep = self.counts[t] >= min_count
      vals, cnts = self.values[t][keep], self.counts[t][keep]
      order = np.lexsort((vals, -cnts))  # by count desc, then value
      ids = np.empty(vals.size, np.int32)
      ids[order] = FIRST_ID + np.arange(vals.size, dtype=np.int32)
      out.append((vals, ids))
    return out


def _hash_ids(block: ParsedBlock, sizes: np.ndarray) -> np.ndarray:
  ids = FIRST_ID + block.raw % (sizes - FIRST_ID).astype(np.uint32)
  return np.where(block.missing, MISSING_ID, ids).astype(np.int32)


def _vocab_ids(raw: np.ndarray, missing: np.ndarray, vocab) -> np.ndarray:
  """uint32[n, 26] raw values, bool[n, 26] missing -> int32[n, 26] frequency ids."""
  out = np.empty(raw.shape, np.int32)
  for t, (vals, ids) in enumerate(vocab):
    col = raw[:, t]
    if vals.size == 0:
      out[:, t] = UNKNOWN_ID
      continue
    if vals.size > _SORTED_LOOKUP:
      # numpy's binary search starts from the previous key's bounds: sorted queries walk a
      # big vocabulary in order instead of missing the cache at every level (~5x here).
      order = np.argsort(col)
      pos = np.empty(col.size, np.int64)
      pos[order] = np.searchsorted(vals, col[order])
    else:
      pos = np.searchsorted(vals, col)
    pos = np.minimum(pos, vals.size - 1)
    out[:, t] = np.where(vals[pos] == col, ids[pos], UNKNOWN_ID)
  out[missing] = MISSING_ID
  return out


def _remap(tmp: str, vocab, progress, chunk: int = 1 << 16):
  """raw.tmp + missing.tmp -> sparse.npy through the vocabularies; removes the temporaries."""
  raw = np.load(os.path.join(tmp, "raw.tmp"), mmap_mode="r")
  bits = np.load(os.path.join(tmp, "missing.tmp"), mmap_mode="r")
  out = _NpyWriter(os.path.join(tmp, "sparse.npy"), np.int32, (NUM_SPARSE,))
  report = _progress_printer(progress, "frequency ids")
  n = raw.shape[0]
  for lo in range(0, n, chunk):
    hi = min(lo + chunk, n)
    out.append(_vocab_ids(np.asarray(raw[lo:hi]), _unpack_bits(np.asarray(bits[lo:hi])), vocab))
    report(hi, hi * 108, n * 108)  # 108 bytes of temporaries per row
  out.close()
  report(n, n * 108, n * 108, final=True)
  del raw, bits
  os.remove(os.path.join(tmp, "raw.tmp"))
  os.remove(os.path.join(tmp, "missing.tmp"))


def convert(
  paths: Sequence[str],
  out_dir: str,
  reader: ReaderConfig,
  progress: Callable[[str], None] | None = print,
) -> dict[str, Any]:
  """TSV files -> labels.npy, dense.npy, sparse.npy and manifest.json in `out_dir`.

  Builds in a sibling temporary directory renamed into place at the end, so an interrupted
  conversion never leaves a cache that looks complete. Returns the manifest.
  """
  t0 = time.perf_counter()
  sources = _source_stats(paths)
  tmp = f"{out_dir}.tmp-{os.getpid()}"
  shutil.rmtree(tmp, ignore_errors=True)
  os.makedirs(tmp)
  frequency = reader.categorical == "frequency"
  try:
    writers = {
      "labels": _NpyWriter(os.path.join(tmp, "labels.npy"), np.int8, ()),
      "dense": _NpyWriter(os.path.join(tmp, "dense.npy"), np.float32, (NUM_DENSE,)),
    }
    if frequency:
      # Ids need every value's count first: the raw values wait on disk (108 bytes/row),
      # which is cheaper than parsing the text twice.
      writers["raw"] = _NpyWriter(os.path.join(tmp, "raw.tmp"), np.uint32, (NUM_SPARSE,))
      writers["missing"] = _NpyWriter(os.path.join(tmp, "missing.tmp"), np.uint32, ())
      counter = _Counter()
      state = {}
    else:
      cardinalities = list(reader.table_sizes())
      writers["sparse"] = _NpyWriter(os.path.join(tmp, "sparse.npy"), np.int32, (NUM_SPARSE,))
      state = {"sizes": np.asarray(cardinalities, np.uint32)}
    bad = _BadLines(reader)
    file_rows = [0] * len(paths)
    positives = 0
    what = "parse" if frequency else "convert"
    for fi, result in _stream(paths, what, reader, bad, "conversion", progress, state):
      writers["labels"].append(result["labels"])
      writers["dense"].append(result["dense"])
      if frequency:
        counter.add(result["counts"])
        writers["raw"].append(result["raw"])
        writers["missing"].append(result["missing"])
      else:
        writers["sparse"].append(result["ids"])
      file_rows[fi] += result["rows"]
      positives += int(result["labels"].sum(dtype=np.int64))
    for w in writers.values():
      w.close()
    if frequency:
      vocab = counter.vocabularies(reader.min_count)
      cardinalities = [FIRST_ID + v.size for v, _ in vocab]
      _remap(tmp, vocab, progress)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  seconds = time.perf_counter() - t0
  num_rows = sum(file_rows)
  manifest = {
    "version": CACHE_VERSION,
    "sources": sources,
    "reader": reader.cache_key(),
    "num_rows": num_rows,
    "file_rows": file_rows,
    "positives": positives,
    "cardinalities": cardinalities,
    "table_names": list(TABLE_NAMES),
    "ids": {"missing": MISSING_ID, "unknown": UNKNOWN_ID, "first": FIRST_ID},
    "bad_lines": bad.files,
    "num_bad_lines": bad.total(),
    "conversion_seconds": seconds,
    "rows_per_second": num_rows / max(seconds, 1e-9),
    "num_workers": reader.num_workers,
  }
  with open(os.path.join(tmp, "manifest.json"), "w") as f:
    json.dump(manifest, f, indent=1)
  shutil.rmtree(out_dir, ignore_errors=True)
  os.replace(tmp, out_dir)
  if progress is not None:
    skipped = f"; skipped {bad.total()} malformed lines" if bad.total() else ""
    progress(
      f"criteo: cached {num_rows:,} rows in {out_dir} ({seconds:.1f} s, "
      f"{manifest['rows_per_second']:,.0f} rows/s{skipped})"
    )
    for path, rec in bad.files.items():
      progress(f"  {path}: {rec['count']} malformed lines skipped ({_reasons(rec)})")
  return manifest


# ----------------------------------------------------------------------------- splits


def kaggle_split(num_rows: int, days: int = KAGGLE_DAYS) -> dict[str, tuple[int, int]]:
  """Row ranges [start, stop) of the DLRM reference Kaggle split (see the module docstring)."""
  per_day, extras = divmod(num_rows, days)
  day_rows = [per_day + (d < extras) for d in range(days)]
  last = num_rows - day_rows[-1]
  test_rows = -(-day_rows[-1] // 2)  # np.array_split: the first part gets the odd row
  return {
    "train": (0, last),
    "test": (last, last + test_rows),
    "valid": (last + test_rows, num_rows),
  }


def last_file_split(file_rows: Sequence[int]) -> dict[str, tuple[int, int]]:
  """Terabyte: all files but the last train; the last file's halves test, then valid."""
  if len(file_rows) < 2:
    raise ValueError("split='last_file' needs at least 2 files (day_0 .. day_23); use 'kaggle'")
  last = sum(file_rows[:-1])
  test_rows = -(-file_rows[-1] // 2)
  total = last + file_rows[-1]
  return {"train": (0, last), "test": (last, last + test_rows), "valid": (last + test_rows, total)}


# ----------------------------------------------------------------------------- dataset


class CriteoDataset:
  """A converted dataset: memmapped arrays, split row ranges, table sizes, batches.

  Attributes:
    labels: int8[N]; dense: float32[N, 13]; sparse: int32[N, 26] (read-only memmaps).
    splits: {"train" | "valid" | "test": (start, stop)}, contiguous row ranges.
    cardinalities: rows of each table C1..C26 (ids are < this).
    manifest: the cache manifest (counts, sources, malformed lines).
    reused_cache: whether opening reused an existing cache (no parsing).
    path: the cache directory.
  """

  table_names = TABLE_NAMES

  def __init__(self, path: str, split: str = "kaggle", reused_cache: bool = False):
    if split not in SPLITS:
      raise ValueError(f"Unknown split {split!r}; available: {', '.join(SPLITS)}")
    with open(os.path.join(path, "manifest.json")) as f:
      self.manifest = json.load(f)
    self.path = path
    self.reused_cache = reused_cache
    self.labels = np.load(os.path.join(path, "labels.npy"), mmap_mode="r")
    self.dense = np.load(os.path.join(path, "dense.npy"), mmap_mode="r")
    self.sparse = np.load(os.path.join(path, "sparse.npy"), mmap_mode="r")
    self.cardinalities = tuple(self.manifest["cardinalities"])
    n = self.manifest["num_rows"]
    if split == "kaggle":
      self.splits = kaggle_split(n)
    else:
      self.splits = last_file_split(self.manifest["file_rows"])
    self._perm_cache: dict[tuple[str, int, int], np.ndarray] = {}

  @property
  def num_rows(self) -> int:
    return int(self.manifest["num_rows"])

  def split_size(self, split: str) -> int:
    start, stop = self._range(split)
    return stop - start

  def _range(self, split: str) -> tuple[int, int]:
    if split not in self.splits:
      raise ValueError(f"Unknown split {split!r}; available: {', '.join(self.splits)}")
    return self.splits[split]

  def describe(self) -> str:
    sizes = ", ".join(f"{s} {self.split_size(s):,}" for s in SPLIT_NAMES)
    ctr = self.manifest["positives"] / max(self.num_rows, 1)
    return (
      f"Criteo-format data: {self.num_rows:,} rows ({sizes}), CTR {ctr:.3f}, "
      f"{sum(self.cardinalities):,} embedding rows in 26 tables, "
      f"{self.manifest['num_bad_lines']} malformed lines skipped; cache {self.path}"
    )

  def num_batches(self, split: str, batch_size: int, drop_remainder: bool = True) -> int:
    """Batches in one pass over `split`."""
    n = self.split_size(split)
    return n // batch_size if drop_remainder else -(-n // batch_size)

  def _perm(self, split: str, seed: int, epoch: int) -> np.ndarray:
    key = (split, seed, epoch)
    if key not in self._perm_cache:
      rng = np.random.default_rng([seed, epoch])
      n = self.split_size(split)
      dtype = np.int32 if n < 2**31 else np.int64
      self._perm_cache.clear()  # one epoch at a time: a permutation is 4 bytes per row
      self._perm_cache[key] = rng.permutation(n).astype(dtype)
    return self._perm_cache[key]

  def batch_rows(
    self,
    split: str,
    step: int,
    batch_size: int,
    *,
    shuffle_seed: int | None = None,
    drop_remainder: bool = True,
  ) -> np.ndarray:
    """Row indices (into the whole dataset) of batch `step`, int64[<= batch_size].

    Pass e = step // num_batches covers the split once; with `shuffle_seed` in the order of
    a permutation drawn from (shuffle_seed, e), else in file order. Depends on nothing but the
    arguments, so a run resumed at `step` sees the batches an uninterrupted one would.
    """
    start, _ = self._range(split)
    per_pass = self.num_batches(split, batch_size, drop_remainder)
    if per_pass == 0:
      raise ValueError(
        f"split {split!r} has {self.split_size(split)} rows, fewer than batch_size={batch_size}"
        " with drop_remainder=True; use a smaller batch or drop_remainder=False"
      )
    epoch, k = divmod(step, per_pass)
    lo, hi = k * batch_size, min((k + 1) * batch_size, self.split_size(split))
    if shuffle_seed is None:
      return np.arange(start + lo, start + hi, dtype=np.int64)
    # Sorted within the batch: the memmap reads then go forward through the file.
    return start + np.sort(self._perm(split, shuffle_seed, epoch)[lo:hi]).astype(np.int64)

  def gather(self, rows: np.ndarray, batch_size: int | None = None) -> Batch:
    """The batch of the given rows, padded to `batch_size` rows with weight 0.

    Returns:
      {"dense": float32[B, 13], "label": float32[B], "weight": float32[B],
       "ids": {"C1": int32[B, 1], ..., "C26": int32[B, 1]}}. Padding rows are zeros, with
      ids MISSING_ID (a valid id, so no backend needs special handling) and weight 0.
    """
    n = rows.shape[0]
    b = n if batch_size is None else batch_size
    if n > b:
      raise ValueError(f"{n} rows do not fit a batch of {b}")
    if n and np.all(np.diff(rows) == 1):  # contiguous: slices, no fancy-index gather
      sl = slice(int(rows[0]), int(rows[0]) + n)
      label, dense, sparse = self.labels[sl], self.dense[sl], self.sparse[sl]
    else:
      label, dense, sparse = self.labels[rows], self.dense[rows], self.sparse[rows]
    return padded_batch(b, dense, label, sparse)

  def batch(
    self,
    split: str,
    step: int,
    batch_size: int,
    *,
    shuffle_seed: int | None = None,
    drop_remainder: bool = True,
    shard: tuple[int, int] = (0, 1),
  ) -> Batch:
    """Batch `step` of `split` (see `batch_rows` and `gather`); always `batch_size` rows.
    With `shard=(index, count)`: only process `index`'s contiguous 1 / count of them
    (batch_size / count rows; the other processes' rows are never read)."""
    rows = self.batch_rows(
      split, step, batch_size, shuffle_seed=shuffle_seed, drop_remainder=drop_remainder
    )
    return self.gather(*process_rows(rows, batch_size, shard))

  def batches(
    self,
    split: str,
    batch_size: int,
    *,
    start_step: int = 0,
    shuffle_seed: int | None = None,
    drop_remainder: bool = True,
    num_epochs: int | None = 1,
    shard: tuple[int, int] = (0, 1),
  ) -> Iterator[Batch]:
    """Batches `start_step`, `start_step + 1`, ... of `split` (`shard`: see `batch`).

    Training: `shuffle_seed=seed, num_epochs=None` (endless, a fresh permutation per pass).
    Eval: `drop_remainder=False` (the last batch padded to `batch_size`, weight 0).
    """
    total = (
      None
      if num_epochs is None
      else num_epochs * self.num_batches(split, batch_size, drop_remainder)
    )
    step = start_step
    while total is None or step < total:
      yield self.batch(
        split, step, batch_size, shuffle_seed=shuffle_seed, drop_remainder=drop_remainder,
        shard=shard,
      )  # fmt: skip
      step += 1


def padded_batch(batch_size: int, dense, label, sparse) -> Batch:
  """n rows (dense float[n, 13], label [n], sparse int[n, 26]) as a batch of `batch_size`
  rows: {"dense": float32[B, 13], "label": float32[B], "weight": float32[B], "ids": {"C1":
  int32[B, 1], ...}}. Padding rows are zeros with weight 0 and ids MISSING_ID (a valid id,
  so no backend needs special handling)."""
  n = len(label)
  out_dense = np.zeros((batch_size, NUM_DENSE), np.float32)
  out_dense[:n] = dense
  out_label = np.zeros(batch_size, np.float32)
  out_label[:n] = label
  weight = np.zeros(batch_size, np.float32)
  weight[:n] = 1.0
  ids = np.full((NUM_SPARSE, batch_size), MISSING_ID, np.int32)
  ids[:, :n] = np.asarray(sparse).T
  return {
    "dense": out_dense,
    "label": out_label,
    "weight": weight,
    "ids": {name: ids[t][:, None] for t, name in enumerate(TABLE_NAMES)},
  }


def process_rows(
  rows: np.ndarray, batch_size: int, shard: tuple[int, int]
) -> tuple[np.ndarray, int]:
  """A batch's rows -> (process `index` of `count`'s contiguous slice of them, its batch
  size batch_size / count): the examples of that process's devices."""
  index, count = shard
  if batch_size % count:
    raise ValueError(f"batch_size {batch_size} does not split over {count} processes")
  per = batch_size // count
  return rows[index * per : (index + 1) * per], per


def _cache_valid(path: str, paths: Sequence[str], reader: ReaderConfig) -> str | None:
  """None if the cache at `path` matches the sources, else why not."""
  try:
    with open(os.path.join(path, "manifest.json")) as f:
      manifest = json.load(f)
  except (OSError, ValueError):
    return "no cache yet"
  if manifest.get("version") != CACHE_VERSION:
    return "cache format changed"
  if manifest.get("reader") != reader.cache_key():
    return "reader settings changed"
  if manifest.get("sources") != _source_stats(paths):
    return "a source file changed (size or mtime)"
  return None


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
  why = _cache_valid(out, paths, reader)
  if why is not None:
    if progress is not None:
      progress(f"criteo: converting {', '.join(paths)} -> {out} ({why})")
    convert(paths, out, reader, progress)
  dataset = CriteoDataset(out, split, reused_cache=why is None)
  # The cached counts are re-checked so a smaller budget than at conversion time still bites.
  bad = _BadLines(reader)
  bad.files = dataset.manifest["bad_lines"]
  for path, rows in zip(paths, dataset.manifest["file_rows"]):
    rec = bad.files.get(os.path.abspath(path))
    if rec:
      bad.check(os.path.abspath(path), rows + rec["count"])
  return dataset
