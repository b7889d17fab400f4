"""A converted CTR dataset: memmapped arrays, the reference splits, and batches.

Splits (`split=`):
  "kaggle":    rows cut into 7 contiguous day-chunks (the first `N % 7` one row longer);
               days 0-5 train, day 6 split in two by np.array_split: first half test,
               second half valid (as DLRM's `getCriteoAdData`).
  "last_file": all files but the last train; the last file's first half test, second half
               valid (as DLRM / MLPerf for Terabyte's day_23).

Batches: {"dense": float32[B, D], "label": float32[B], "weight": float32[B],
"ids": {table: int32[B, L_t]}}; a one-hot table has L_t = 1, a multi-hot one its bag length
with PAD (-1) after the bag's ids. A raw table's (a vocab="raw" column, `raw_tables`) are
int64[B, L_t]: 64-bit keys from raw_ids.npy, mapped to rows on the host by its dynamic
backend (never put on a device: jax without x64 would cut them to 32 bits).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from recgnn.data import batch_gather, ctr_cache
from recgnn.data.ctr_schema import MISSING_ID, PAD, RAW_MISSING
from recgnn.data.file_check import read_manifest

KAGGLE_DAYS = 7
#: Columns between consecutive tables' ids in a gathered batch's [T, B] array, past the batch
#: (`CriteoDataset._gather_one_hot`: 64 bytes, one cache line).
IDS_PAD = 16
SPLITS = ("kaggle", "last_file")
SPLIT_NAMES = ("train", "valid", "test")
# Criteo's layout: the default of caches whose manifest names no tables (written before
# the generic reader).
CRITEO_TABLES = tuple(f"C{i}" for i in range(1, 27))

Batch = dict[str, Any]


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


class CTRDataset:
  """A converted dataset: memmapped arrays, split row ranges, table sizes, batches.

  Attributes:
    labels: int8[N]; dense: float32[N, D]; sparse: int32[N, S] (read-only memmaps), S the
      sum of the bag lengths of `id_tables`: table t's ids are columns [o_t, o_t + L_t).
    raw_ids: int64[N, S_r] (a read-only memmap) the ids of `raw_tables` likewise, or None.
    table_names, bag_lengths: the tables in order and their ids per example.
    id_tables, raw_tables: the tables whose ids are in `sparse` / in `raw_ids`, in order.
    splits: {"train" | "valid" | "test": (start, stop)}, contiguous row ranges.
    cardinalities: rows of each table C1..C26 (ids are < this).
    manifest: the cache manifest (counts, sources, malformed lines).
    reused_cache: whether opening reused an existing cache (no parsing).
    path: the cache directory.
  """

  table_names = CRITEO_TABLES
  bag_lengths = (1,) * 26

  def __init__(self, path: str, split: str = "kaggle", reused_cache: bool = False):
    if split not in SPLITS:
      raise ValueError(f"Unknown split {split!r}; available: {', '.join(SPLITS)}")
    manifest = read_manifest(os.path.join(path, "manifest.json"))
    if manifest is None:
      raise ValueError(
        f"CTR cache {path}: {os.path.join(path, 'manifest.json')} is missing or damaged. "
        "Delete the directory and open the dataset again: it is rebuilt from its source files."
      )
    self.manifest = manifest
    bad = ctr_cache.check_files(path, self.manifest)
    if bad is not None:  # (never read a damaged array as data)
      raise ValueError(
        f"CTR cache {path} is damaged: {bad}. Delete the directory and open the dataset "
        "again: it is rebuilt from its source files."
      )
    self.path = path
    self.reused_cache = reused_cache
    self.labels = np.load(os.path.join(path, "labels.npy"), mmap_mode="r")
    self.dense = np.load(os.path.join(path, "dense.npy"), mmap_mode="r")
    self.sparse = np.load(os.path.join(path, "sparse.npy"), mmap_mode="r")
    self.cardinalities = tuple(self.manifest["cardinalities"])
    self.table_names = tuple(self.manifest.get("table_names", CRITEO_TABLES))
    self.bag_lengths = tuple(self.manifest.get("bag_lengths", (1,) * len(self.table_names)))
    self.raw_tables = raw_tables(path, self.manifest)
    self.id_tables = tuple(t for t in self.table_names if t not in self.raw_tables)
    self.raw_ids = None
    if self.raw_tables:
      self.raw_ids = np.load(os.path.join(path, ctr_cache.RAW_ARRAY), mmap_mode="r")
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

  def bags_of(self, tables: Sequence[str]) -> tuple[int, ...]:
    """The bag lengths of `tables`."""
    bag = dict(zip(self.table_names, self.bag_lengths))
    return tuple(bag[t] for t in tables)

  def describe(self) -> str:
    sizes = ", ".join(f"{s} {self.split_size(s):,}" for s in SPLIT_NAMES)
    ctr = self.manifest["positives"] / max(self.num_rows, 1)
    card = dict(zip(self.table_names, self.cardinalities))
    rows = sum(card[t] for t in self.id_tables)
    tables = f"{len(self.table_names)} tables"
    if self.raw_tables:
      tables += f" ({len(self.raw_tables)} of raw 64-bit ids, sized by their dynamic tables)"
    return (
      f"{self.manifest.get('schema_name', 'Criteo-format')} data: {self.num_rows:,} rows "
      f"({sizes}), CTR {ctr:.3f}, {rows:,} embedding rows in "
      f"{tables}{_bags(self.bag_lengths, self.manifest)}, "
      f"{self.manifest['num_bad_lines']} malformed lines skipped; cache {self.path}"
    )

  def num_batches(self, split: str, batch_size: int, drop_remainder: bool = True) -> int:
    """Batches in one pass over `split`."""
    n = self.split_size(split)
    return n // batch_size if drop_remainder else -(-n // batch_size)

  def permutation(self, split: str, seed: int, epoch: int) -> np.ndarray:
    """Pass `epoch`'s order of `split`'s positions under `shuffle_seed=seed`: int[n], drawn
    from (seed, epoch) alone (the last pass's is kept)."""
    key = (split, seed, epoch)
    if key not in self._perm_cache:
      rng = np.random.default_rng([seed, epoch])
      n = self.split_size(split)
      dtype = np.int32 if n < 2**31 else np.int64
      self._perm_cache.clear()  # one epoch at a time: a permutation is 4 bytes per row
      self._perm_cache[key] = rng.permutation(n).astype(dtype)
    return self._perm_cache[key]

  def shard_permutations(self, split: str, seed: int | None, epoch: int, shards: int):
    """Pass `epoch`'s order of `split`'s positions in `shards` contiguous shards of
    m = n // shards positions: int[shards, m], row s shard s's positions (s * m + a
    permutation of [0, m) drawn from (seed, epoch, s); seed None: in order). One shard is
    `permutation`'s order (the last n - shards * m positions are never read)."""
    n = self.split_size(split)
    if shards == 1:
      if seed is None:
        return np.arange(n)[None]
      return self.permutation(split, seed, epoch)[None]
    m = n // shards
    if seed is None:
      return np.arange(shards * m).reshape(shards, m)
    key = (split, seed, epoch, shards)
    if key not in self._perm_cache:
      dtype = np.int32 if n < 2**31 else np.int64
      perms = [
        np.random.default_rng([seed, epoch, s]).permutation(m) + s * m for s in range(shards)
      ]
      self._perm_cache.clear()  # one epoch at a time (4 bytes per row)
      self._perm_cache[key] = np.stack(perms).astype(dtype)
    return self._perm_cache[key]

  def batch_rows(
    self,
    split: str,
    step: int,
    batch_size: int,
    *,
    shuffle_seed: int | None = None,
    drop_remainder: bool = True,
    shards: int = 1,
  ) -> np.ndarray:
    """Row indices (into the whole dataset) of batch `step`, int64[<= batch_size].

    Pass e = step // num_batches covers the split once; with `shuffle_seed` in the order of
    a permutation drawn from (shuffle_seed, e), else in file order. Depends on nothing but the
    arguments, so a run resumed at `step` sees the batches an uninterrupted one would.
    shards > 1 (train.order_shards): the split in that many contiguous shards, each permuted
    on its own (`shard_permutations`); batch k is shard 0's k-th batch_size / shards
    positions, then shard 1's, ...: with P processes (shards a multiple of P) each process's
    slice of every batch comes from its own shards' rows, which are all it needs to hold.
    """
    start, _ = self._range(split)
    per_pass = self.num_batches(split, batch_size, drop_remainder)
    if per_pass == 0:
      raise ValueError(
        f"split {split!r} has {self.split_size(split)} rows, fewer than batch_size={batch_size}"
        " with drop_remainder=True; use a smaller batch or drop_remainder=False"
      )
    epoch, k = divmod(step, per_pass)
    if shards > 1:
      per = batch_size // shards
      perms = self.shard_permutations(split, shuffle_seed, epoch, shards)[
        :, k * per : (k + 1) * per
      ]
      return start + np.sort(perms, axis=1).reshape(-1).astype(np.int64)
    lo, hi = k * batch_size, min((k + 1) * batch_size, self.split_size(split))
    if shuffle_seed is None:
      return np.arange(start + lo, start + hi, dtype=np.int64)
    # Sorted within the batch: the memmap reads then go forward through the file.
    return start + np.sort(self.permutation(split, shuffle_seed, epoch)[lo:hi]).astype(np.int64)

  def gather(self, rows: np.ndarray, batch_size: int | None = None) -> Batch:
    """The batch of the given rows, padded to `batch_size` rows with weight 0.

    Returns:
      {"dense": float32[B, D], "label": float32[B], "weight": float32[B],
       "ids": {table: int32[B, L_t]}} (a raw table's int64[B, L_t], `raw_batch`). Padding
      rows are zeros, with ids MISSING_ID (a valid id, so no backend needs special handling;
      RAW_MISSING for a raw table; PAD after it in a bag) and weight 0.
    """
    n = rows.shape[0]
    b = n if batch_size is None else batch_size
    if n > b:
      raise ValueError(f"{n} rows do not fit a batch of {b}")
    bags = self.bags_of(self.id_tables)
    if all(x == 1 for x in bags) and batch_gather.AVAILABLE:  # (every train and eval batch)
      batch = self._gather_one_hot(np.asarray(rows, np.int64), b)
    else:
      if n and np.all(np.diff(rows) == 1):  # contiguous: slices, no fancy-index gather
        sl = slice(int(rows[0]), int(rows[0]) + n)
        label, dense, sparse = self.labels[sl], self.dense[sl], self.sparse[sl]
      else:
        label, dense, sparse = self.labels[rows], self.dense[rows], self.sparse[rows]
      batch = padded_batch(b, dense, label, sparse, self.id_tables, bags)
    if self.raw_tables:
      raw = raw_batch(self.raw_ids, rows, b, self.raw_tables, self.bags_of(self.raw_tables))
      batch["ids"] = {t: raw[t] if t in raw else batch["ids"][t] for t in self.table_names}
    return batch

  def _gather_one_hot(self, rows: np.ndarray, batch_size: int) -> Batch:
    """`gather` of one-hot rows (the tables of `sparse`) in one compiled pass without the GIL
    (`batch_gather`): the same arrays as `padded_batch` of numpy's reads. Also for rows in
    order (an eval batch, train.shuffle=False): this kernel is faster than numpy's transpose
    of the slices' ids (docs/running.md)."""
    out_dense = np.zeros((batch_size, self.dense.shape[1]), np.float32)
    label = np.zeros(batch_size, np.float32)
    weight = np.zeros(batch_size, np.float32)
    # Each table's ids a row of one array, the rows IDS_PAD apart more than the batch: at a
    # power-of-two batch the kernel's 26 write streams, batch x 4 bytes apart, all fall in the
    # same cache sets and evict one another (docs/running.md). Each table's [B, 1] stays
    # contiguous.
    ids = np.full((len(self.id_tables), batch_size + IDS_PAD), MISSING_ID, np.int32)
    ids = ids[:, :batch_size]
    batch_gather.gather_one_hot(
      np.asarray(self.labels), np.asarray(self.dense), np.asarray(self.sparse), rows,
      label, out_dense, weight, ids,
    )  # fmt: skip
    out_ids = {name: ids[t][:, None] for t, name in enumerate(self.id_tables)}
    return {"dense": out_dense, "label": label, "weight": weight, "ids": out_ids}

  def batch(
    self,
    split: str,
    step: int,
    batch_size: int,
    *,
    shuffle_seed: int | None = None,
    drop_remainder: bool = True,
    shard: tuple[int, int] = (0, 1),
    shards: int = 1,
  ) -> Batch:
    """Batch `step` of `split` (see `batch_rows`, its `shards`, and `gather`); always
    `batch_size` rows. With `shard=(index, count)`: only process `index`'s contiguous
    1 / count of them (batch_size / count rows; the other processes' rows are never read)."""
    rows = self.batch_rows(
      split, step, batch_size, shuffle_seed=shuffle_seed, drop_remainder=drop_remainder,
      shards=shards,
    )  # fmt: skip
    return self.read(split, *process_rows(rows, batch_size, shard))

  def read(self, split: str, rows: np.ndarray, batch_size: int | None = None) -> Batch:
    """The batch of `batch_rows`'s rows of `split` (here rows of the whole dataset, so
    `gather`; pipeline.TfdsCriteo reads split positions from its sources)."""
    del split
    return self.gather(rows, batch_size)

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
    shards: int = 1,
  ) -> Iterator[Batch]:
    """Batches `start_step`, `start_step + 1`, ... of `split` (`shard`, `shards`: see
    `batch`).

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
        shard=shard, shards=shards,
      )  # fmt: skip
      step += 1


def padded_batch(
  batch_size: int,
  dense,
  label,
  sparse,
  table_names: Sequence[str] = CRITEO_TABLES,
  bag_lengths: Sequence[int] | None = None,
) -> Batch:
  """n rows (dense float[n, D], label [n], sparse int[n, S]) as a batch of `batch_size`
  rows: {"dense": float32[B, D], "label": float32[B], "weight": float32[B], "ids": {table:
  int32[B, L_t]}} (bag_lengths None: all 1). Padding rows are zeros with weight 0 and ids
  MISSING_ID (a valid id, so no backend needs special handling), PAD after it in a bag."""
  n = len(label)
  bags = tuple(bag_lengths or (1,) * len(table_names))
  out_dense = np.zeros((batch_size, np.shape(dense)[1]), np.float32)
  out_dense[:n] = dense
  out_label = np.zeros(batch_size, np.float32)
  out_label[:n] = label
  weight = np.zeros(batch_size, np.float32)
  weight[:n] = 1.0
  if all(b == 1 for b in bags):  # one-hot: one transposed copy, a view per table
    ids = np.full((len(bags), batch_size), MISSING_ID, np.int32)
    ids[:, :n] = np.asarray(sparse).T
    out_ids = {name: ids[t][:, None] for t, name in enumerate(table_names)}
  else:
    o = np.concatenate([[0], np.cumsum(bags)])
    sparse = np.asarray(sparse)
    out_ids = {}
    for t, name in enumerate(table_names):
      a = np.full((batch_size, bags[t]), PAD, np.int32)
      a[:, 0] = MISSING_ID
      a[:n] = sparse[:, o[t] : o[t + 1]]
      out_ids[name] = a
  return {"dense": out_dense, "label": out_label, "weight": weight, "ids": out_ids}


def raw_batch(raw_ids, rows, batch_size: int, tables: Sequence[str], bags: Sequence[int]) -> dict:
  """The raw tables' ids of `rows` (raw_ids.npy's rows, any order): {table: int64[B, L_t]},
  padded to `batch_size` rows as `padded_batch` pads (RAW_MISSING first, PAD after it)."""
  rows = np.asarray(rows, np.int64)
  n = len(rows)
  if n and np.all(np.diff(rows) == 1):  # (contiguous: a slice)
    keys = np.asarray(raw_ids[int(rows[0]) : int(rows[0]) + n])
  else:
    keys = np.asarray(raw_ids[rows])
  out, o = {}, 0
  for t, bag in zip(tables, bags):
    a = np.full((batch_size, bag), PAD, np.int64)
    a[:, 0] = RAW_MISSING
    a[:n] = keys[:, o : o + bag]
    out[t], o = a, o + bag
  return out


def raw_tables(path: str, manifest: dict) -> tuple[str, ...]:
  """The tables of a cache whose ids are raw 64-bit keys (raw_ids.npy); a cache whose reader
  settings say raw but that has no raw_ids.npy (raw keys folded to 31 bits into sparse.npy)
  is refused, never read as rows."""
  raw = tuple(manifest.get("raw_tables", ()))
  reader = manifest.get("reader") or {}
  said = reader.get("categorical") == "raw" or any(
    c.get("vocab") == "raw" for c in reader.get("categorical", ()) if isinstance(c, dict)
  )
  if said and not raw:
    raise ValueError(
      f"CTR cache {path} holds raw ids folded to 31 bits (an older format; raw ids are now "
      "64-bit, in raw_ids.npy). Delete the directory and open the dataset again: it is "
      "rebuilt from its source files."
    )
  return raw


def _bags(bags: Sequence[int], manifest: dict) -> str:
  multi = sum(b > 1 for b in bags)
  if not multi:
    return ""
  fill = manifest.get("bag_fill")
  used = (
    f", {sum(f * b for f, b in zip(fill, bags)) / sum(bags):.0%} of the padded id slots used"
    if fill
    else ""
  )
  return f" ({multi} multi-hot, bags up to {max(bags)}{used})"


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
