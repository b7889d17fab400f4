"""Any tabular CTR data with a declared schema: TSV / CSV (with or without a header) and Parquet.

`open_ctr(paths, cache_dir, schema)` converts the files once into the memmap cache
(`ctr_cache`: streaming, bounded memory, `num_workers` processes, malformed lines counted by
reason with line numbers, the error budget) and opens it as a `ctr_dataset.CTRDataset`.
A changed source or schema converts again; otherwise the cache is reused.

Text: one record per line (no newlines inside quoted fields), read in blocks of whole lines
(`block_bytes`). TSV fields are split on the delimiter as they are; CSV lines holding a quote
go through Python's csv module (strict quoting: a broken quote makes the line malformed). With
a header, line 1 names the columns (and line numbers count it); without, `schema.columns` does.
Parquet: one row group per task (memory bounded by the row group), columns by name; a
multi-hot column is a list column or a string with the separator; "line" numbers are row
numbers from 1. Malformed reasons: columns (field count), quoting, label (not 0 / 1), dense
(not a finite number), categorical (not a value of the column's kind), bag_length (a bag over
`bag` with overflow="error").

The formats (how records become parsed blocks) are `ctr_formats`'; reading text in blocks
of whole lines is `text_blocks`'. Criteo's TSV (schema "criteo") goes through
`criteo.open_criteo`, whose vectorized parser is ~20x faster than this per-line one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable, Sequence

from recgnn.data import ctr_cache, ctr_dataset
from recgnn.data.ctr_cache import Budget
from recgnn.data.ctr_formats import ParquetFormat, TextFormat
from recgnn.data.ctr_schema import Schema


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReadOptions:
  """How files are read (nothing here changes the cached arrays).

  Attributes:
    max_bad_lines, max_bad_fraction: the error budget per file, max(max_bad_lines,
      max_bad_fraction * lines read so far), checked after every block.
    block_bytes: text bytes parsed per task.
    num_workers: processes parsing tasks (0: in this process; spawned, so the calling script
      needs the `if __name__ == "__main__":` guard).
  """

  max_bad_lines: int = 100
  max_bad_fraction: float = 0.0
  block_bytes: int = 4 << 20
  num_workers: int = 0


# ----------------------------------------------------------------------------- open


def make_format(schema: Schema, options: ReadOptions):
  if schema.format == "parquet":
    return ParquetFormat(schema)
  return TextFormat(schema, options.block_bytes)


def cache_dir_for(cache_dir: str, paths: Sequence[str], schema: Schema) -> str:
  key = json.dumps({"paths": [os.path.abspath(p) for p in paths], "schema": schema.cache_key()})
  return os.path.join(cache_dir, "ctr-" + hashlib.sha1(key.encode()).hexdigest()[:16])


def open_ctr(
  paths: str | Sequence[str],
  cache_dir: str,
  schema: Schema,
  *,
  options: ReadOptions | None = None,
  split: str = "kaggle",
  progress: Callable[[str], None] | None = print,
) -> ctr_dataset.CTRDataset:
  """Open CTR files described by `schema`, converting them to the cache the first time.

  Args:
    paths: the files, read in this order (their rows laid end to end).
    cache_dir: where converted datasets live (one subdirectory per sources + schema).
    schema: the columns and how they become ids.
    options: the error budget, block size and workers.
    split: "kaggle" or "last_file" (see ctr_dataset).
    progress: where progress lines go (None: silent).
  Raises:
    MalformedDataError: more malformed lines than the budget.
    ValueError: a schema column the file does not have (the message lists the file's).
  """
  paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
  paths = [os.fspath(p) for p in paths]
  options = options or ReadOptions()
  for p in paths:
    if not os.path.isfile(p):
      raise FileNotFoundError(f"CTR data file {p!r} not found")
  if split not in ctr_dataset.SPLITS:
    raise ValueError(f"Unknown split {split!r}; available: {', '.join(ctr_dataset.SPLITS)}")
  out = cache_dir_for(cache_dir, paths, schema)
  key = schema.cache_key()
  budget = Budget(options.max_bad_lines, options.max_bad_fraction)
  why = ctr_cache.cache_valid(out, paths, key)
  if why is not None:
    if progress is not None:
      progress(f"{schema.name}: converting {', '.join(paths)} -> {out} ({why})")
    ctr_cache.convert(
      paths, out, make_format(schema, options), schema.categorical,
      num_dense=len(schema.dense), key=key, bad=ctr_cache.BadLines(budget),
      num_workers=options.num_workers, progress=progress, label=schema.name,
      extra={"schema": schema.to_dict(), "schema_name": schema.name},
    )  # fmt: skip
  dataset = ctr_dataset.CTRDataset(out, split, reused_cache=why is None)
  # The cached counts are re-checked so a smaller budget than at conversion time still bites.
  ctr_cache.BadLines(budget).recheck(
    dataset.manifest["bad_lines"], paths, dataset.manifest["file_rows"]
  )
  return dataset


def read_schema_config(data) -> tuple[Schema, ReadOptions]:
  """(schema, read options) from config.data (data.schema: name, JSON path or dict)."""
  from recgnn.data import ctr_schema

  schema = ctr_schema.load(data.schema)
  options = ReadOptions(
    max_bad_lines=int(data.get("max_bad_lines", 100)),
    max_bad_fraction=float(data.get("max_bad_fraction", 0.0)),
    num_workers=int(data.get("num_workers", 0)),
  )
  return schema, options
