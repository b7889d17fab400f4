"""Streaming conversion of CTR files into the memmap cache, for any format and schema.

A format (`criteo.CriteoTSV`, `ctr_formats.TextFormat`, `ctr_formats.ParquetFormat`) cuts a file
into tasks (byte ranges of whole lines, or Parquet row groups) and parses one task into a
`Parsed` block; this module runs the tasks in order (in `num_workers` spawned processes, at
most 2 per worker in flight so memory stays bounded), counts malformed lines against the
error budget, turns raw keys into ids per column and writes

  labels.npy int8[N]   dense.npy float32[N, D]   sparse.npy int32[N, S]   manifest.json
  raw_ids.npy int64[N, S_r]   only when a column is vocab="raw" (manifest "raw_tables")

S = the sum of the tables' bag lengths; table t's ids are columns [o_t, o_t + L_t) of
sparse.npy (PAD after a multi-hot bag's last id). Raw columns' ids are 64-bit keys, kept
apart in raw_ids.npy (their slots, in column order) and left out of sparse.npy (S then the
other tables' slots): every cache without a raw column is int32 ids byte for byte as before,
and the device feed places sparse.npy alone (raw ids are mapped to rows on the host,
`dynamic`: no int64 array goes to a device). With frequency vocabularies the raw keys wait
in temporary files until every value is counted, then are remapped (the text is parsed once).
The cache is built in a sibling temporary directory renamed into place at the end, so an
interrupted conversion never leaves a cache that looks complete.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import multiprocessing
import os
import shutil
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from recgnn.data import file_check
from recgnn.data.bad_lines import (  # noqa: F401 (importable from here, as before the split)
  MAX_EXAMPLES,
  BadLines,
  Budget,
  MalformedDataError,
  reasons,
)
from recgnn.data.ctr_ids import (  # noqa: F401 (likewise)
  EMPTY,
  PADDED,
  SORTED_LOOKUP,
  VALUE,
  Counter,
  column_ids,
  lookup,
  offsets,
  raw_column_ids,
  slots,
)
from recgnn.data.ctr_schema import (
  FIRST_ID,
  MISSING_ID,
  PAD,
  RAW_ID_SPACE,
  RAW_MISSING,
  UNKNOWN_ID,
  Categorical,
)
from recgnn.data.file_check import HEAD_BYTES  # noqa: F401

# 2: the manifest lists each array's bytes and a checksum of its head (`file_records`), checked
# before the arrays are trusted (a cache of version 1 is rebuilt from its sources).
CACHE_VERSION = 2
ARRAYS = ("labels.npy", "dense.npy", "sparse.npy")
RAW_ARRAY = "raw_ids.npy"  # the raw columns' int64 ids (manifest "raw_tables")


def arrays_of(manifest: dict[str, Any]) -> tuple[str, ...]:
  """The array files of a cache whose manifest is `manifest`."""
  return ARRAYS + (RAW_ARRAY,) * bool(manifest.get("raw_tables"))


@dataclasses.dataclass
class Parsed:
  """The well-formed lines of one task.

  Attributes:
    labels: int8[n].
    dense: float32[n, D], transformed.
    raw: uint32 or uint64[n, S], the keys of the id slots (0 where state != VALUE).
    state: uint8[n, S]: VALUE, EMPTY (an empty field: MISSING_ID) or PADDED (PAD).
    bad: (line index in the task, reason) of each malformed line, in order.
    examples: (line index, reason, text) of the first MAX_EXAMPLES malformed lines.
    num_lines: lines (or Parquet rows) in the task, good and bad.
  """

  labels: np.ndarray
  dense: np.ndarray
  raw: np.ndarray
  state: np.ndarray
  bad: list[tuple[int, str]]
  examples: list[tuple[int, str, str]]
  num_lines: int


# ----------------------------------------------------------------------------- files


class NpyWriter:
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


def source_stats(paths: Sequence[str]) -> list[dict[str, Any]]:
  out = []
  for p in paths:
    st = os.stat(p)
    out.append({"path": os.path.abspath(p), "size": st.st_size, "mtime_ns": st.st_mtime_ns})
  return out


head_sha256 = file_check.head_sha256  # (a file's size and this: what a manifest records)


def file_records(path: str, names: Sequence[str] = ARRAYS) -> dict[str, dict[str, Any]]:
  """{array file: {"bytes", "head_sha256"}} of a cache directory's arrays (`names`): what the
  manifest records at conversion and `check_files` compares before the arrays are read."""
  return file_check.file_records(path, names)


def check_files(
  path: str, manifest: dict[str, Any], names: Sequence[str] | None = None
) -> str | None:
  """None if every array of the cache at `path` (or `names`; default `arrays_of(manifest)`)
  has the bytes and head checksum its manifest recorded, else what differs
  (`file_check.check_files`)."""
  return file_check.check_files(path, manifest, arrays_of(manifest) if names is None else names)


def cache_valid(path: str, paths: Sequence[str], key: dict[str, Any]) -> str | None:
  """None if the cache at `path` matches the sources and the id settings `key` and its arrays
  are whole (`check_files`), else why not (the caller converts again)."""
  manifest = file_check.read_manifest(os.path.join(path, "manifest.json"))
  if manifest is None:
    return "no cache yet"
  if manifest.get("version") != CACHE_VERSION:
    return "cache format changed"
  if manifest.get("reader") != key:
    return "reader settings changed"
  if manifest.get("sources") != source_stats(paths):
    return "a source file changed (size or mtime)"
  bad = check_files(path, manifest)
  if bad is not None:
    return f"the cache is damaged: {bad}"
  return None


def progress_printer(progress: Callable[[str], None] | None, label: str, unit: str = "MiB"):
  t0 = time.perf_counter()
  last = [t0]
  scale = 2**20 if unit == "MiB" else 1

  def report(rows: int, done: int, total: int, final: bool = False):
    now = time.perf_counter()
    if progress is None or (not final and now - last[0] < 2.0):
      return
    last[0] = now
    dt = max(now - t0, 1e-9)
    progress(
      f"{label}: {rows:,} rows, {done / scale:,.0f}/{total / scale:,.0f} {unit}, "
      f"{rows / dt:,.0f} rows/s"
    )

  return report


# ----------------------------------------------------------------------------- streaming

# What a worker needs besides its task (the format and the columns), set once per process.
_WORKER: dict[str, Any] = {}


def _init_worker(state: dict[str, Any]):
  _WORKER.clear()
  _WORKER.update(state)


def _work(task) -> dict[str, Any]:
  """Parse one task and do the pass's per-block work. Runs in a worker process (or in-process
  with num_workers=0); returns only numpy arrays and small lists."""
  path, start, stop, what, layout = task
  fmt, columns = _WORKER["format"], _WORKER["columns"]
  block = fmt.parse(path, start, stop, layout)
  out: dict[str, Any] = {
    "num_lines": block.num_lines,
    "bad": block.bad,
    "examples": block.examples[:MAX_EXAMPLES],
    "rows": block.labels.shape[0],
    "stop": stop,
    "labels": block.labels,
    "dense": block.dense,
  }
  if what == "parse":  # frequency vocabularies: ids need the counts of every block
    o = offsets(columns)
    out["counts"] = {
      t: np.unique(block.raw[:, o[t] : o[t + 1]][block.state[:, o[t] : o[t + 1]] == VALUE],
                   return_counts=True)
      for t, c in enumerate(columns) if c.vocab == "frequency"
    }  # fmt: skip
    out.update(raw=block.raw, state=block.state)
  else:
    out["ids"] = column_ids(block.raw, block.state, columns)
    if any(c.raw for c in columns):
      out["raw_ids"] = raw_column_ids(block.raw, block.state, columns)
  return out


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


def stream(paths, fmt, columns, what: str, bad: BadLines, num_workers: int, progress, label):
  """Yields (file index, `_work` result) over all tasks of all files in order, enforcing the
  error budget; line numbers restart at 1 in each file."""
  layouts = [fmt.layout(p) for p in paths]
  sizes = [fmt.size(p) for p in paths]
  total = sum(sizes)
  report = progress_printer(progress, label, fmt.unit)
  tasks = (
    (fi, (os.path.abspath(p), start, stop, what, layouts[fi]))
    for fi, p in enumerate(paths)
    for start, stop in fmt.tasks(p)
  )
  base = np.cumsum([0] + sizes)
  state = {"format": fmt, "columns": tuple(columns)}
  pool = None
  if num_workers > 0:
    # spawn, not fork: the parent may run JAX threads, and forking those can deadlock.
    ctx = multiprocessing.get_context("spawn")
    pool = ctx.Pool(num_workers, initializer=_init_worker, initargs=(state,))
    results = _bounded_imap(pool, tasks, 2 * num_workers)
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
      report(rows, int(base[fi]) + result["stop"], total)
    report(rows, total, total, final=True)
  finally:
    if pool is not None:
      pool.terminate()
    _WORKER.clear()


def _remap(tmp: str, columns, vocab, progress, chunk: int = 1 << 16):
  """raw.tmp + state.tmp -> sparse.npy through the vocabularies (and raw_ids.npy); removes
  the temporaries."""
  raw = np.load(os.path.join(tmp, "raw.tmp"), mmap_mode="r")
  state = np.load(os.path.join(tmp, "state.tmp"), mmap_mode="r")
  out = _id_writers(tmp, columns)
  report = progress_printer(progress, "frequency ids", "rows")
  n = raw.shape[0]
  for lo in range(0, n, chunk):
    hi = min(lo + chunk, n)
    r, st = np.asarray(raw[lo:hi]), np.asarray(state[lo:hi])
    out["sparse"].append(column_ids(r, st, columns, vocab))
    if "raw_ids" in out:
      out["raw_ids"].append(raw_column_ids(r, st, columns))
    report(hi, hi, n)
  for w in out.values():
    w.close()
  report(n, n, n, final=True)
  del raw, state
  os.remove(os.path.join(tmp, "raw.tmp"))
  os.remove(os.path.join(tmp, "state.tmp"))


def _bag_fill(path: str, columns, chunk: int = 1 << 16) -> list[float]:
  """Each table's share of its id slots that hold an id (sparse.npy's and raw_ids.npy's)."""
  filled = np.zeros(int(offsets(columns)[-1]), np.int64)
  n = 1
  for name, raw in (("sparse.npy", False), (RAW_ARRAY, True)):
    cols = slots(columns, raw)
    if not cols.size:
      continue
    ids = np.load(os.path.join(path, name), mmap_mode="r")
    for lo in range(0, ids.shape[0], chunk):
      filled[cols] += (np.asarray(ids[lo : lo + chunk]) != PAD).sum(axis=0)
    n = max(ids.shape[0], 1)
  o = offsets(columns)
  return [float(filled[o[t] : o[t + 1]].sum() / (n * c.bag)) for t, c in enumerate(columns)]


def convert(
  paths: Sequence[str],
  out_dir: str,
  fmt,
  columns: Sequence[Categorical],
  *,
  num_dense: int,
  key: dict[str, Any],
  bad: BadLines,
  num_workers: int = 0,
  extra: dict[str, Any] | None = None,
  progress: Callable[[str], None] | None = print,
  label: str = "ctr",
) -> dict[str, Any]:
  """Files -> labels.npy, dense.npy, sparse.npy and manifest.json in `out_dir` (see the module
  docstring). `key`: the id settings recorded in the manifest ("reader"); `extra`: more
  manifest fields. Returns the manifest."""
  t0 = time.perf_counter()
  sources = source_stats(paths)
  tmp = f"{out_dir}.tmp-{os.getpid()}"
  shutil.rmtree(tmp, ignore_errors=True)
  os.makedirs(tmp)
  columns = tuple(columns)
  try:
    written = _write_arrays(tmp, paths, fmt, columns, num_dense, bad, num_workers, progress, label)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  seconds = time.perf_counter() - t0
  num_rows = sum(written["file_rows"])
  manifest = {
    "version": CACHE_VERSION,
    "sources": sources,
    "reader": key,
    "num_rows": num_rows,
    **written,
    "table_names": [c.name for c in columns],
    "ids": {"missing": MISSING_ID, "unknown": UNKNOWN_ID, "first": FIRST_ID},
    **_raw_fields(columns),
    "bad_lines": bad.files,
    "num_bad_lines": bad.total(),
    "conversion_seconds": seconds,
    "rows_per_second": num_rows / max(seconds, 1e-9),
    "num_workers": num_workers,
  }
  if any(c.bag > 1 for c in columns):  # absent: all one-hot (caches written before bags)
    manifest["bag_lengths"] = [c.bag for c in columns]
    manifest["pad"] = PAD
    # What padding costs: the share of each table's id slots that hold an id.
    manifest["bag_fill"] = _bag_fill(tmp, columns)
  manifest.update(extra or {})
  manifest["files"] = file_records(tmp, arrays_of(manifest))
  with open(os.path.join(tmp, "manifest.json"), "w") as f:
    json.dump(manifest, f, indent=1)
  shutil.rmtree(out_dir, ignore_errors=True)
  os.replace(tmp, out_dir)
  if progress is not None:
    _report_cached(progress, label, out_dir, num_rows, seconds, bad)
  return manifest


def _id_writers(tmp: str, columns) -> dict[str, NpyWriter]:
  """sparse.npy's writer (int32, the slots of the columns that are not raw) and, when a
  column is vocab="raw", raw_ids.npy's (int64, the raw columns' slots)."""
  ids = slots(columns, False).size
  out = {"sparse": NpyWriter(os.path.join(tmp, "sparse.npy"), np.int32, (ids,))}
  raw = slots(columns, True).size
  if raw:
    out["raw_ids"] = NpyWriter(os.path.join(tmp, RAW_ARRAY), np.int64, (raw,))
  return out


def _raw_fields(columns) -> dict[str, Any]:
  """The manifest's record of raw columns (absent without one): their tables, in the order
  of raw_ids.npy's slots, and the id of an empty field."""
  raw = [c.name for c in columns if c.raw]
  return {"raw_tables": raw, "raw_missing": RAW_MISSING} if raw else {}


def _writers(tmp: str, fmt, columns, num_dense: int, frequency: bool) -> dict[str, NpyWriter]:
  """The arrays a conversion writes in `tmp`: labels, dense, and ids (`_id_writers`; or, when
  a column has a frequency vocabulary, the raw keys and their states, remapped once
  counted)."""
  slots_all = int(offsets(columns)[-1])
  writers = {
    "labels": NpyWriter(os.path.join(tmp, "labels.npy"), np.int8, ()),
    "dense": NpyWriter(os.path.join(tmp, "dense.npy"), np.float32, (num_dense,)),
  }
  if frequency:
    # Ids need every key's count first: the keys wait on disk, which is cheaper than
    # parsing the text twice.
    writers["raw"] = NpyWriter(os.path.join(tmp, "raw.tmp"), fmt.raw_dtype, (slots_all,))
    writers["state"] = NpyWriter(os.path.join(tmp, "state.tmp"), np.uint8, (slots_all,))
  else:
    writers.update(_id_writers(tmp, columns))
  return writers


def _write_arrays(
  tmp: str, paths, fmt, columns, num_dense: int, bad: BadLines, num_workers, progress, label
) -> dict[str, Any]:
  """Parses every file into the arrays in `tmp` (ids through the vocabularies) -> the
  manifest's {"file_rows", "positives", "cardinalities"}."""
  frequency = any(c.vocab == "frequency" for c in columns)
  writers = _writers(tmp, fmt, columns, num_dense, frequency)
  if frequency:
    counter = Counter(len(columns), fmt.raw_dtype)
  file_rows = [0] * len(paths)
  positives = 0
  what = "parse" if frequency else "convert"
  for fi, result in stream(paths, fmt, columns, what, bad, num_workers, progress, label):
    writers["labels"].append(result["labels"])
    writers["dense"].append(result["dense"])
    if frequency:
      counter.add(result["counts"])
      writers["raw"].append(result["raw"])
      writers["state"].append(result["state"])
    else:
      writers["sparse"].append(result["ids"])
      if "raw_ids" in writers:
        writers["raw_ids"].append(result["raw_ids"])
    file_rows[fi] += result["rows"]
    positives += int(result["labels"].sum(dtype=np.int64))
  for w in writers.values():
    w.close()
  if frequency:
    vocab = {
      t: counter.vocabulary(t, c.min_count) for t, c in enumerate(columns) if c.vocab == "frequency"
    }
    _remap(tmp, columns, vocab, progress)
  cardinalities = [
    {"hash": c.hash_size, "raw": RAW_ID_SPACE}[c.vocab]
    if c.vocab != "frequency"
    else FIRST_ID + vocab[t][0].size
    for t, c in enumerate(columns)
  ]
  return {"file_rows": file_rows, "positives": positives, "cardinalities": cardinalities}


def _report_cached(progress, label, out_dir, num_rows: int, seconds: float, bad: BadLines) -> None:
  """The conversion's closing lines: rows, time, rate, and each file's skipped lines."""
  skipped = f"; skipped {bad.total()} malformed lines" if bad.total() else ""
  progress(
    f"{label}: cached {num_rows:,} rows in {out_dir} ({seconds:.1f} s, "
    f"{num_rows / max(seconds, 1e-9):,.0f} rows/s{skipped})"
  )
  for path, rec in bad.files.items():
    progress(f"  {path}: {rec['count']} malformed lines skipped ({reasons(rec)})")
