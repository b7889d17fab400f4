"""grain input pipelines over TFDS array_record sources (no TensorFlow).

`TfdsCriteo` has the interface of `criteo.CriteoDataset` (the memmap path) and the same batch
order: batch `step` of a split holds the rows `CriteoDataset.batch_rows` names (a permutation
drawn from (seed, epoch), sorted within the batch), read through `tfds.data_source` instead
of a memmap. Batches are a grain pipeline,

  MapDataset.range(steps) -> map(step -> rows -> source.__getitems__ -> padded batch)
    -> to_iter_dataset(ReadOptions(num_threads, prefetch))

so the order is a function of (seed, step) alone, `num_threads` batches are read at once, and
the iterator's state (`get_state()`: {"next_index": step}) says where a run is: the trainer
saves it in the checkpoint and a resumed run restores it with `set_state`, continuing
mid-epoch. `shard=(index, count)` gives process `index` of `count` its contiguous slice of
every global batch (the rows of its devices, as the mesh lays the batch out).

Decoding: TFDS decodes one record at a time in Python (slow for CTR batches). The
criteo builders store the arrays as raw bytes, so every record of a build has the same
length and layout; `RecordLayout` finds where each feature's bytes sit in the first record
(a minimal tf.train.Example parse) and a batch is then read as raw records
(array_record, C++) and decoded with one numpy view. Every record of every batch is checked
to have the first record's length and the same bytes outside the payloads (field tags, keys,
lengths); a batch that fails the check goes through TFDS's own decoder instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grain
import numpy as np

from recgnn.data import criteo

Batch = dict[str, Any]


def _varint(buf: bytes, i: int) -> tuple[int, int]:
  """(value, next position) of the protobuf varint at buf[i]."""
  value = shift = 0
  while True:
    b = buf[i]
    value |= (b & 0x7F) << shift
    i += 1
    if b < 0x80:
      return value, i
    shift += 7


def _fields(buf: bytes, lo: int, hi: int):
  """(field number, wire type, payload start, payload end) of a message in buf[lo:hi]."""
  i = lo
  while i < hi:
    tag, i = _varint(buf, i)
    field, wire = tag >> 3, tag & 7
    if wire == 2:
      n, i = _varint(buf, i)
      yield field, wire, i, i + n
      i += n
    elif wire == 0:
      _, j = _varint(buf, i)
      yield field, wire, i, j
      i = j
    elif wire == 5:
      yield field, wire, i, i + 4
      i += 4
    elif wire == 1:
      yield field, wire, i, i + 8
      i += 8
    else:
      raise ValueError(f"unsupported protobuf wire type {wire}")


class RecordLayout:
  """Where each feature's payload sits in a serialized tf.train.Example, taken from one
  record: {key: (start, stop, kind)}, kind "bytes" (a BytesList value), "varint" (an
  Int64List value) or "float" (a FloatList). `matches` checks other records against it."""

  def __init__(self, record: bytes):
    self.length = len(record)
    self.payload: dict[str, tuple[int, int, str]] = {}
    for f, _, lo, hi in _fields(record, 0, len(record)):
      if f != 1:  # Example.features
        continue
      for f2, _, elo, ehi in _fields(record, lo, hi):  # Features.feature map entries
        if f2 != 1:
          continue
        key, value = None, None
        for f3, _, a, b in _fields(record, elo, ehi):
          if f3 == 1:
            key = record[a:b].decode()
          elif f3 == 2:
            value = (a, b)
        for kind_field, _, a, b in _fields(record, *value):  # Feature: oneof kind
          kind = {1: "bytes", 2: "float", 3: "varint"}[kind_field]
          for _, _, c, d in _fields(record, a, b):  # the list's one (packed) value
            self.payload[key] = (c, d, kind)
    fixed = np.ones(self.length, bool)
    for a, b, _ in self.payload.values():
      fixed[a:b] = False
    self.fixed = np.flatnonzero(fixed)
    self.fixed_bytes = np.frombuffer(record, np.uint8)[self.fixed]

  def view(self, records: list[bytes]) -> np.ndarray | None:
    """uint8[n, length] of records laid out like the first one, else None."""
    if any(len(r) != self.length for r in records):
      return None
    arr = np.frombuffer(b"".join(records), np.uint8).reshape(len(records), self.length)
    if not np.array_equal(
      arr[:, self.fixed], np.broadcast_to(self.fixed_bytes, (len(records), self.fixed.size))
    ):
      return None
    return arr

  def column(self, arr: np.ndarray, key: str, dtype) -> np.ndarray:
    a, b, _ = self.payload[key]
    return np.ascontiguousarray(arr[:, a:b]).view(dtype)


class TfdsCriteo(criteo.CriteoDataset):
  """Criteo-format data read from a TFDS criteo_kaggle / criteo_terabyte build.

  Attributes (as CriteoDataset): splits {name: (0, n)} (each split is its own source, so
  rows are split positions), cardinalities, manifest-like counts in `metadata`.
  """

  table_names = criteo.TABLE_NAMES

  def __init__(self, builder, *, num_threads: int = 8, prefetch: int = 16):
    from recgnn.data import tfds_builders

    self.builder = builder
    self.sources = tfds_builders.data_sources(builder)
    meta = builder.info.metadata
    self.metadata = dict(meta)
    self.cardinalities = tuple(int(c) for c in meta["cardinalities"])
    # A `ctr` (any schema) build names its tables and bags; the Criteo builds are Criteo's.
    self.table_names = tuple(meta.get("table_names", criteo.TABLE_NAMES))
    self.bag_lengths = tuple(meta.get("bag_lengths", (1,) * len(self.table_names)))
    self.num_dense = int(meta.get("num_dense", criteo.NUM_DENSE))
    self.splits = {s: (0, len(src)) for s, src in self.sources.items()}
    self.num_threads = num_threads
    self.prefetch = prefetch
    self.path = str(builder.data_dir)
    self.reused_cache = True
    self._perm_cache = {}
    n = sum(len(s) for s in self.sources.values())
    self.manifest = {"num_rows": n, "num_bad_lines": int(meta.get("num_bad_lines", 0))}
    self.fast_batches = 0  # batches decoded by RecordLayout (the rest: TFDS's decoder)
    self._raw, self._layout = {}, {}
    version = tuple(int(x) for x in str(builder.info.version).split("."))
    if version >= (1, 1, 0):  # raw-bytes arrays: fixed-size records
      from array_record.python import array_record_data_source as ards

      for split, info in builder.info.splits.items():
        if info.num_examples:
          raw = ards.ArrayRecordDataSource([str(p) for p in info.filepaths])
          self._raw[split], self._layout[split] = raw, RecordLayout(raw[0])

  @property
  def num_rows(self) -> int:
    return int(self.manifest["num_rows"])

  def describe(self) -> str:
    sizes = ", ".join(f"{s} {self.split_size(s):,}" for s in criteo.SPLIT_NAMES)
    return (
      f"Criteo-format data via TFDS {self.builder.name}/{self.builder.builder_config.name} "
      f"(array_record, grain, {self.num_threads} read threads): {self.num_rows:,} rows "
      f"({sizes}), {sum(self.cardinalities):,} embedding rows in {len(self.table_names)} tables, "
      f"{self.manifest['num_bad_lines']} malformed lines skipped; {self.path}"
    )

  def read(self, split: str, rows: np.ndarray, batch_size: int | None = None) -> Batch:
    """The batch of split positions `rows` (padded to `batch_size`, weight 0), as
    CriteoDataset.gather: {"dense", "label", "weight", "ids": {table: int32[B, L_t]}}."""
    n = rows.shape[0]
    b = n if batch_size is None else batch_size
    arr = None
    if n and split in self._raw:
      layout = self._layout[split]
      arr = layout.view(self._raw[split].__getitems__(rows.tolist()))
    if arr is not None:
      label = layout.column(arr, "label", np.uint8)[:, 0]
      if label.max() > 1:  # not a one-byte varint 0 / 1: let TFDS decode it
        arr = None
    if arr is not None:
      self.fast_batches += 1
      dense, sparse = layout.column(arr, "dense", "<f4"), layout.column(arr, "sparse", "<i4")
    elif n:
      examples = self.sources[split].__getitems__(rows.tolist())
      dense = np.stack([e["dense"] for e in examples])
      label = [e["label"] for e in examples]
      sparse = np.stack([e["sparse"] for e in examples])
    else:
      dense, label = np.zeros((0, self.num_dense)), np.zeros(0)
      sparse = np.zeros((0, sum(self.bag_lengths)), np.int32)
    return criteo.padded_batch(b, dense, label, sparse, self.table_names, self.bag_lengths)

  def pipeline(
    self,
    split: str,
    batch_size: int,
    *,
    shuffle_seed: int | None = None,
    drop_remainder: bool = True,
    num_epochs: int | None = 1,
    shard: tuple[int, int] = (0, 1),
  ) -> grain.IterDataset:
    """The grain dataset of batches 0, 1, ... (endless with num_epochs=None)."""
    per_pass = self.num_batches(split, batch_size, drop_remainder)
    total = (1 << 62) if num_epochs is None else num_epochs * per_pass
    ds = grain.MapDataset.range(0, total).map(
      lambda step: self.batch(
        split, int(step), batch_size, shuffle_seed=shuffle_seed,
        drop_remainder=drop_remainder, shard=shard,
      )
    )  # fmt: skip
    # grain uses at most prefetch_buffer_size threads.
    prefetch = max(self.prefetch, self.num_threads)
    return ds.to_iter_dataset(
      grain.ReadOptions(num_threads=self.num_threads, prefetch_buffer_size=prefetch)
    )

  def batches(
    self,
    split: str,
    batch_size: int,
    *,
    start_step: int = 0,
    shuffle_seed: int | None = None,
    drop_remainder: bool = True,
    num_epochs: int | None = 1,
    state: dict | None = None,
    shard: tuple[int, int] = (0, 1),
  ) -> Iterator[Batch]:
    """Batches from `state` (a grain iterator state from a checkpoint) or `start_step`."""
    it = iter(
      self.pipeline(
        split, batch_size, shuffle_seed=shuffle_seed, drop_remainder=drop_remainder,
        num_epochs=num_epochs, shard=shard,
      )
    )  # fmt: skip
    it.set_state(state if state is not None else state_at(start_step))
    return it


def state_at(step: int) -> dict:
  """The grain iterator state of a batch pipeline about to yield batch `step` (what
  `get_state()` returns after `step` batches; checked in tests/test_data_tfds.py)."""
  return {"next_index": int(step)}
