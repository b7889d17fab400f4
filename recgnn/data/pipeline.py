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
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grain
import numpy as np

from recgnn.data import criteo

Batch = dict[str, Any]


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
    self.splits = {s: (0, len(src)) for s, src in self.sources.items()}
    self.num_threads = num_threads
    self.prefetch = prefetch
    self.path = str(builder.data_dir)
    self.reused_cache = True
    self._perm_cache = {}
    n = sum(len(s) for s in self.sources.values())
    self.manifest = {"num_rows": n, "num_bad_lines": int(meta.get("num_bad_lines", 0))}

  @property
  def num_rows(self) -> int:
    return int(self.manifest["num_rows"])

  def describe(self) -> str:
    sizes = ", ".join(f"{s} {self.split_size(s):,}" for s in criteo.SPLIT_NAMES)
    return (
      f"Criteo-format data via TFDS {self.builder.name}/{self.builder.builder_config.name} "
      f"(array_record, grain, {self.num_threads} read threads): {self.num_rows:,} rows "
      f"({sizes}), {sum(self.cardinalities):,} embedding rows in 26 tables, "
      f"{self.manifest['num_bad_lines']} malformed lines skipped; {self.path}"
    )

  def read(self, split: str, rows: np.ndarray, batch_size: int | None = None) -> Batch:
    """The batch of split positions `rows` (padded to `batch_size`, weight 0), as
    CriteoDataset.gather: {"dense", "label", "weight", "ids": {"C1": int32[B, 1], ...}}."""
    n = rows.shape[0]
    b = n if batch_size is None else batch_size
    examples = self.sources[split].__getitems__(rows.tolist()) if n else []
    out_dense = np.zeros((b, criteo.NUM_DENSE), np.float32)
    out_label = np.zeros(b, np.float32)
    weight = np.zeros(b, np.float32)
    ids = np.full((b, criteo.NUM_SPARSE), criteo.MISSING_ID, np.int32)
    if n:
      out_dense[:n] = np.stack([e["dense"] for e in examples])
      out_label[:n] = [e["label"] for e in examples]
      ids[:n] = np.stack([e["sparse"] for e in examples])
      weight[:n] = 1.0
    ids = ids.T
    return {
      "dense": out_dense,
      "label": out_label,
      "weight": weight,
      "ids": {name: ids[t][:, None] for t, name in enumerate(criteo.TABLE_NAMES)},
    }

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
    """Batch `step` of `split`: the rows CriteoDataset.batch_rows names; with `shard`
    (index, count), only this process's contiguous 1 / count of them."""
    rows = self.batch_rows(
      split, step, batch_size, shuffle_seed=shuffle_seed, drop_remainder=drop_remainder
    )
    index, count = shard
    if batch_size % count:
      raise ValueError(f"batch_size {batch_size} does not split over {count} processes")
    per = batch_size // count
    return self.read(split, rows[index * per : (index + 1) * per], per)

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
