"""The CTR datasets as TFDS builders (see `tfds_builders` for the catalog and the API): the
Kaggle and Terabyte Criteo logs and any-schema CTR data, their examples made by this package's
readers (`criteo.open_criteo`, `ctr_reader.open_ctr`) from the memmap caches they convert to,
rows in file order so row i of a split is row i of the memmap split."""

from __future__ import annotations

import concurrent.futures
import glob
import os
import re

import numpy as np
import tensorflow_datasets as tfds

from recgnn.data import criteo, ctr_reader, ctr_schema

_CHUNK = 1 << 16  # rows read from a memmap at a time while writing examples


# ----------------------------------------------------------------------------- Criteo


def _refuse_raw(schema: ctr_schema.Schema) -> None:
  """The TFDS records hold int32 ids: raw 64-bit ids are read from the memmap cache only."""
  raw = [c.name for c in schema.categorical if c.raw]
  if raw:
    raise ValueError(
      f"TFDS builds hold int32 ids; columns {raw} are vocab='raw' (64-bit ids): read them "
      "from the memmap cache (data.source=memmap) or use vocab='frequency' or 'hash'"
    )


def criteo_config(reader: criteo.ReaderConfig | None = None) -> tfds.core.BuilderConfig:
  """A BuilderConfig named after the reader settings that change the ids (its own folder)."""
  reader = reader or criteo.ReaderConfig()
  _refuse_raw(criteo.schema(reader))
  key = reader.cache_key()
  if key["categorical"] == "frequency":
    name = f"frequency_min{key['min_count']}"
  else:
    sizes = key["hash_sizes"]
    name = f"hash_{sizes[0]}" if len(set(sizes)) == 1 else "hash_" + "_".join(map(str, sizes))
  config = tfds.core.BuilderConfig(name=name, description=f"ids: {key}")
  # Not a dataclass field of BuilderConfig: the reader travels beside it.
  object.__setattr__(config, "reader", reader)
  return config


def _criteo_features(num_dense: int = criteo.NUM_DENSE, num_slots: int = criteo.NUM_SPARSE):
  # BYTES encoding: every record has the same length and layout (no varints in the arrays),
  # which lets pipeline.TfdsCriteo decode a whole batch of records with one numpy view.
  raw = tfds.features.Encoding.BYTES
  return tfds.features.FeaturesDict(
    {
      "label": tfds.features.Scalar(np.int8),
      "dense": tfds.features.Tensor(shape=(num_dense,), dtype=np.float32, encoding=raw),
      "sparse": tfds.features.Tensor(shape=(num_slots,), dtype=np.int32, encoding=raw),
    }
  )


def _criteo_rows(ds: criteo.CriteoDataset, start: int, stop: int):
  """Examples of rows [start, stop) of a memmapped dataset, keyed by their split position
  (keys in order and TFDS shuffling off: file order is kept)."""
  for lo in range(start, stop, _CHUNK):
    hi = min(lo + _CHUNK, stop)
    labels = np.asarray(ds.labels[lo:hi])
    dense = np.asarray(ds.dense[lo:hi])
    sparse = np.asarray(ds.sparse[lo:hi])
    for i in range(hi - lo):
      yield lo - start + i, {"label": labels[i], "dense": dense[i], "sparse": sparse[i]}


class _CriteoBase(tfds.core.GeneratorBasedBuilder):
  VERSION = tfds.core.Version("1.1.0")
  RELEASE_NOTES = {"1.1.0": "dense / sparse stored as raw bytes (fixed-size records)"}

  def __init__(self, *, config=None, **kwargs):
    super().__init__(config=config or criteo_config(), **kwargs)

  @property
  def reader(self) -> criteo.ReaderConfig:
    return getattr(self.builder_config, "reader", None) or criteo.ReaderConfig()

  def _info(self):
    return tfds.core.DatasetInfo(
      builder=self,
      description=criteo.__doc__.split("\n\n")[0],
      features=_criteo_features(),
      homepage="https://ailab.criteo.com/ressources/",
      metadata=tfds.core.MetadataDict(),
      disable_shuffling=True,  # row i of a split = row i of the memmap split
    )

  def _record(self, ds_list, splits):
    manifests = [d.manifest for d in ds_list]
    self.info.metadata.update(
      {
        "reader": self.reader.cache_key(),
        "cardinalities": [int(c) for c in ds_list[0].cardinalities],
        "num_bad_lines": int(sum(m["num_bad_lines"] for m in manifests)),
        "bad_lines": {k: v for m in manifests for k, v in m["bad_lines"].items()},
        "split_rows": {s: int(b - a) for s, (a, b) in splits.items()},
      }
    )


class CriteoKaggle(_CriteoBase):
  """Criteo Display Advertising Challenge (Kaggle) train.txt, DLRM reference splits."""

  MANUAL_DOWNLOAD_INSTRUCTIONS = (
    "Download the Kaggle Criteo `train.txt` yourself (Criteo's terms forbid redistribution) "
    "and put it in the manual directory (--config.data.path)."
  )

  def _split_generators(self, dl_manager):
    path = os.path.join(dl_manager.manual_dir, "train.txt")
    if not os.path.isfile(path):
      raise FileNotFoundError(f"{path} not found. {self.MANUAL_DOWNLOAD_INSTRUCTIONS}")
    # The memmap reader parses (vectorized, bounded memory); the examples are its rows.
    ds = criteo.open_criteo(
      path, os.path.join(dl_manager.download_dir, "criteo_parse"), reader=self.reader,
      split="kaggle", progress=None,
    )  # fmt: skip
    self._record([ds], ds.splits)
    return {s: _criteo_rows(ds, a, b) for s, (a, b) in ds.splits.items()}

  def _generate_examples(self, **kwargs):  # the generators come from _split_generators
    raise NotImplementedError


def day_files(folder: str) -> list[str]:
  days = {}
  for p in glob.glob(os.path.join(folder, "day_*")):
    m = re.fullmatch(r"day_(\d+)", os.path.basename(p))
    if m:
      days[int(m.group(1))] = p
  return [days[d] for d in sorted(days)]


def _convert_day(args) -> str:
  path, cache, reader = args
  criteo.open_criteo(path, cache, reader=reader, split="kaggle", progress=None)
  return path


class CriteoTerabyte(_CriteoBase):
  """Criteo 1TB click logs day_0 .. day_23, hash ids, MLPerf split (last day test / valid)."""

  MANUAL_DOWNLOAD_INSTRUCTIONS = (
    "Download the Criteo Terabyte day_0 .. day_23 files yourself (uncompressed) and put "
    "them in the manual directory."
  )
  num_workers = os.cpu_count() or 1  # processes converting days (one day per worker)

  def __init__(self, *, config=None, **kwargs):
    config = config or criteo_config(criteo.ReaderConfig(categorical="hash"))
    reader = getattr(config, "reader", None)
    if reader is not None and reader.categorical != "hash":
      raise ValueError(
        "criteo_terabyte builds with hash ids (days are converted independently, so there "
        "is no global frequency count): pass criteo_config(ReaderConfig(categorical='hash'))"
      )
    super().__init__(config=config, **kwargs)

  def _split_generators(self, dl_manager):
    paths = day_files(dl_manager.manual_dir)
    if len(paths) < 2:
      raise FileNotFoundError(
        f"{dl_manager.manual_dir} holds {len(paths)} day_N files; need at least 2. "
        f"{self.MANUAL_DOWNLOAD_INSTRUCTIONS}"
      )
    cache = os.path.join(dl_manager.download_dir, "criteo_parse")
    workers = max(1, min(self.num_workers, len(paths)))
    jobs = [(p, cache, self.reader) for p in paths]
    if workers == 1:
      for j in jobs:
        _convert_day(j)
    else:
      ctx = __import__("multiprocessing").get_context("spawn")
      with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        list(pool.map(_convert_day, jobs))
    days = [
      criteo.open_criteo(p, cache, reader=self.reader, split="kaggle", progress=None) for p in paths
    ]
    rows = [d.num_rows for d in days]
    splits = criteo.last_file_split(rows)
    self._record(days, splits)
    return {s: self._rows(days, a, b) for s, (a, b) in splits.items()}

  @staticmethod
  def _rows(days, start, stop):
    """Rows [start, stop) of the days laid end to end, one day's memmap at a time."""
    offset = 0
    for d in days:
      lo, hi = max(start, offset), min(stop, offset + d.num_rows)
      if lo < hi:
        for k, ex in _criteo_rows(d, lo - offset, hi - offset):
          yield lo - start + k, ex
      offset += d.num_rows

  def _generate_examples(self, **kwargs):
    raise NotImplementedError


# ----------------------------------------------------------------------------- any schema
def ctr_config(
  schema: ctr_schema.Schema,
  paths: str | list[str],
  *,
  options: ctr_reader.ReadOptions | None = None,
  split: str = "kaggle",
) -> tfds.core.BuilderConfig:
  """The `ctr` builder's config: the schema, files and split (its own folder per schema +
  files, named by their hash, as the memmap cache)."""
  _refuse_raw(schema)
  paths = [paths] if isinstance(paths, str) else list(paths)
  folder = os.path.basename(ctr_reader.cache_dir_for("", paths, schema))
  config = tfds.core.BuilderConfig(
    name=f"{schema.name}_{split}_{folder[4:]}", description=f"{schema.name}: {', '.join(paths)}"
  )
  # Not dataclass fields of BuilderConfig: they travel beside it (as criteo_config's reader).
  object.__setattr__(config, "schema", schema)
  object.__setattr__(config, "paths", paths)
  object.__setattr__(config, "options", options or ctr_reader.ReadOptions())
  object.__setattr__(config, "split", split)
  return config


class Ctr(tfds.core.GeneratorBasedBuilder):
  """Any tabular CTR data with a declared schema (ctr_schema), converted by ctr_reader."""

  VERSION = tfds.core.Version("1.1.0")  # raw-bytes arrays, as the Criteo builds

  def __init__(self, *, config=None, **kwargs):
    if config is None or not hasattr(config, "schema"):
      raise ValueError("the ctr builder needs config=ctr_config(schema, paths)")
    super().__init__(config=config, **kwargs)

  def _info(self):
    c = self.builder_config
    return tfds.core.DatasetInfo(
      builder=self,
      description=f"CTR data by schema {c.schema.name!r}",
      features=_criteo_features(len(c.schema.dense), c.schema.num_slots),
      metadata=tfds.core.MetadataDict(),
      disable_shuffling=True,  # row i of a split = row i of the memmap split
    )

  def _split_generators(self, dl_manager):
    c = self.builder_config
    ds = ctr_reader.open_ctr(
      c.paths, os.path.join(dl_manager.download_dir, "ctr_parse"), c.schema, options=c.options,
      split=c.split, progress=None,
    )  # fmt: skip
    m = ds.manifest
    self.info.metadata.update(
      {"schema": c.schema.to_dict(), "cardinalities": [int(x) for x in ds.cardinalities],
       "table_names": list(ds.table_names), "bag_lengths": list(ds.bag_lengths),
       "num_dense": len(c.schema.dense), "num_bad_lines": int(m["num_bad_lines"]),
       "bad_lines": m["bad_lines"],
       "split_rows": {s: int(b - a) for s, (a, b) in ds.splits.items()}}
    )  # fmt: skip
    return {s: _criteo_rows(ds, a, b) for s, (a, b) in ds.splits.items()}

  def _generate_examples(self, **kwargs):
    raise NotImplementedError
