"""The datasets as tensorflow-datasets catalog entries: array_record files, no TensorFlow.

Each builder writes array_record shards that `tfds.data_source` (random access, what grain
reads) opens without TensorFlow; `as_dataset` (tf.data) is not used. The examples are made by
this package's own readers, so the TFDS and the direct paths hold the same values:

  criteo_kaggle    manual: <manual_dir>/train.txt. Splits train / valid / test by the DLRM
                   reference (6 day-chunks train; day 7's first half test, second half valid);
                   ids by the config's ReaderConfig ("frequency" by default, as the memmap
                   cache). Rows keep file order (no TFDS shuffling), so row i of a split is row
                   i of the memmap split and the same seed gives the same batches.
                   {"label": int8, "dense": float32[13], "sparse": int32[26]}
  criteo_terabyte  manual: <manual_dir>/day_0 .. day_23 (any >= 2 consecutive days). Hash ids
                   (a vocabulary would need a global count first); each day is parsed in its
                   own process (one day per worker, `num_workers`), streaming in blocks so
                   memory stays bounded (~12 x block_bytes per worker). Splits: every day but
                   the last train, the last day's first half test, second half valid (MLPerf).
  ctr              any schema (ctr_schema; TSV / CSV / Parquet): the files and schema travel in
                   the config, `ctr_config(schema, paths)`; rows and ids exactly as
                   ctr_reader.open_ctr (the same split). {"label": int8, "dense":
                   float32[D], "sparse": int32[S]}, S the sum of the bag lengths (PAD after a
                   bag's ids); table names and bag lengths in the metadata.
  fb15k237         triples {"head", "relation", "tail": int32} by `kg.load` (the bundled
                   FB15k-237, or a manual folder of train / valid / test files); the entity
                   and relation names in the metadata.
  planetoid        configs cora / citeseer / pubmed, by `planetoid.load` (bundled Cora, or a
                   manual folder with <name>/ind.<name>.*).
  ogb_node         the OGB raw layout (manual: the unpacked folder, raw/ and split/).
  Graph builders write one example per node, {"node": int64, "label": int32,
  "features": float32[F], "neighbors": int64[deg]}, in splits train / valid / test / other
  (nodes in no split); `load_graph` puts a store.Graph back together.

Build with `build(name, data_dir, manual_dir=..., config=...)`; `data_sources` opens the
splits. Cardinalities, entity names, bad-line counts and the reader settings are in the
builder's metadata (`info.metadata`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import glob
import os
import re
import shutil
from typing import Any

import numpy as np
import tensorflow_datasets as tfds

from recgnn.data import criteo, ctr_reader, ctr_schema, kg, ogb, planetoid
from recgnn.graphs import store

VERSION = tfds.core.Version("1.0.0")
_CHUNK = 1 << 16  # rows read from a memmap at a time while writing examples


# ----------------------------------------------------------------------------- Criteo


def criteo_config(reader: criteo.ReaderConfig | None = None) -> tfds.core.BuilderConfig:
  """A BuilderConfig named after the reader settings that change the ids (its own folder)."""
  reader = reader or criteo.ReaderConfig()
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


def _day_files(folder: str) -> list[str]:
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
    paths = _day_files(dl_manager.manual_dir)
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


# ----------------------------------------------------------------------------- graphs


def _graph_features(num_features: int | None):
  feats = {
    "node": tfds.features.Scalar(np.int64),
    "label": tfds.features.Scalar(np.int32),
    "neighbors": tfds.features.Tensor(shape=(None,), dtype=np.int64),
  }
  if num_features:
    feats["features"] = tfds.features.Tensor(shape=(num_features,), dtype=np.float32)
  return tfds.features.FeaturesDict(feats)


GRAPH_SPLITS = ("train", "valid", "test", "other")


class _GraphBase(tfds.core.GeneratorBasedBuilder):
  """One example per node; subclasses say how to load the store.Graph."""

  VERSION = VERSION

  def _load(self, manual_dir: str | None) -> store.Graph:
    raise NotImplementedError

  def _num_features(self) -> int | None:
    return None

  def _info(self):
    return tfds.core.DatasetInfo(
      builder=self,
      features=_graph_features(self._num_features()),
      metadata=tfds.core.MetadataDict(),
      disable_shuffling=True,
    )

  def _split_generators(self, dl_manager):
    manual = None
    try:
      manual = str(dl_manager.manual_dir)
    except Exception:  # noqa: BLE001 (no manual dir given: the bundled copy)
      manual = None
    g = self._load(manual)
    if (g.features is None) != (self._num_features() is None) or (
      g.features is not None and g.features.shape[1] != self._num_features()
    ):
      raise ValueError(
        f"{self.name}: the graph has {None if g.features is None else g.features.shape[1]} "
        f"features; the builder config declares {self._num_features()}"
      )
    where = np.full(g.num_nodes, 3, np.int8)
    for i, s in enumerate(GRAPH_SPLITS[:3]):
      where[g.splits[s]] = i
    self.info.metadata.update(
      {"name": g.name, "num_nodes": int(g.num_nodes), "num_classes": int(g.num_classes),
       "split_order": {s: [int(x) for x in g.splits[s]] for s in GRAPH_SPLITS[:3]}}
    )  # fmt: skip
    return {s: self._nodes(g, np.flatnonzero(where == i)) for i, s in enumerate(GRAPH_SPLITS)}

  @staticmethod
  def _nodes(g: store.Graph, nodes: np.ndarray):
    indptr, indices = g.adj.indptr, g.adj.indices
    for v in nodes:
      ex = {
        "node": int(v),
        "label": int(g.labels[v]),
        "neighbors": np.asarray(indices[indptr[v] : indptr[v + 1]], np.int64),
      }
      if g.features is not None:
        ex["features"] = g.features[v]
      yield int(v), ex

  def _generate_examples(self, **kwargs):
    raise NotImplementedError


@dataclasses.dataclass
class _GraphConfig(tfds.core.BuilderConfig):
  num_features: int | None = None


class Planetoid(_GraphBase):
  """Cora / CiteSeer / PubMed with the public split (bundled Cora, or a manual root)."""

  BUILDER_CONFIGS = [
    _GraphConfig(name="cora", num_features=1433),
    _GraphConfig(name="citeseer", num_features=3703),
    _GraphConfig(name="pubmed", num_features=500),
  ]
  MANUAL_DOWNLOAD_INSTRUCTIONS = (
    "Optional for Cora (bundled): a folder holding <name>/ind.<name>.* from kimiyoung/planetoid."
  )

  def _num_features(self):
    return self.builder_config.num_features

  def _load(self, manual_dir):
    name = self.builder_config.name
    root = manual_dir if manual_dir and os.path.isdir(os.path.join(manual_dir, name)) else None
    return planetoid.load(name, root)


class OgbNode(_GraphBase):
  """An OGB node-property dataset from its raw layout (manual: the unpacked folder). The
  config is created for the dataset: `ogb_config(name, num_features)`."""

  MANUAL_DOWNLOAD_INSTRUCTIONS = "The folder an OGB node-property download unpacks to."

  def _num_features(self):
    return self.builder_config.num_features

  def _load(self, manual_dir):
    if not manual_dir:
      raise FileNotFoundError(f"ogb_node needs manual_dir. {self.MANUAL_DOWNLOAD_INSTRUCTIONS}")
    return ogb.load(manual_dir)


def ogb_config(name: str, num_features: int | None) -> _GraphConfig:
  return _GraphConfig(name=re.sub(r"[^a-z0-9_]", "_", name.lower()), num_features=num_features)


class Fb15k237(tfds.core.GeneratorBasedBuilder):
  """FB15k-237 triples (the bundled ConvE release, or a manual folder of the same layout)."""

  VERSION = VERSION
  MANUAL_DOWNLOAD_INSTRUCTIONS = "Optional: a folder holding train.txt, valid.txt, test.txt."

  def _info(self):
    return tfds.core.DatasetInfo(
      builder=self,
      features=tfds.features.FeaturesDict(
        {k: tfds.features.Scalar(np.int32) for k in ("head", "relation", "tail")}
      ),
      metadata=tfds.core.MetadataDict(),
      disable_shuffling=True,
    )

  def _split_generators(self, dl_manager):
    try:
      folder = str(dl_manager.manual_dir)
    except Exception:  # noqa: BLE001
      folder = None
    if folder and not os.path.exists(os.path.join(folder, "train.txt")):
      folder = None
    g = kg.load(folder, reciprocal=False)
    self.info.metadata.update(
      {"entities": g.entities, "relations": g.relations, "unseen": g.unseen,
       "bad_lines": [b.describe() for b in g.bad_lines]}
    )  # fmt: skip
    return {s: self._triples(g.splits[s]) for s in kg.SPLITS}

  @staticmethod
  def _triples(t):
    for i, (h, r, tt) in enumerate(t.tolist()):
      yield i, {"head": h, "relation": r, "tail": tt}

  def _generate_examples(self, **kwargs):
    raise NotImplementedError


# ----------------------------------------------------------------------------- API

BUILDERS = {
  "criteo_kaggle": CriteoKaggle,
  "criteo_terabyte": CriteoTerabyte,
  "ctr": Ctr,
  "fb15k237": Fb15k237,
  "planetoid": Planetoid,
  "ogb_node": OgbNode,
}


def build(
  name: str, data_dir: str, *, manual_dir: str | None = None, config: Any = None
) -> tfds.core.DatasetBuilder:
  """Prepare (once: an existing build is reused) and return the builder `name`."""
  if name not in BUILDERS:
    raise ValueError(f"Unknown TFDS builder {name!r}; available: {', '.join(BUILDERS)}")
  builder = BUILDERS[name](config=config, data_dir=data_dir, file_format="array_record")
  download_dir = os.path.join(data_dir, "downloads")
  download_config = tfds.download.DownloadConfig(manual_dir=manual_dir) if manual_dir else None
  builder.download_and_prepare(download_dir=download_dir, download_config=download_config)
  # The parsed memmaps were only the source of the examples: the build holds every row, so
  # they would double the disk a Terabyte build needs.
  shutil.rmtree(os.path.join(download_dir, "criteo_parse"), ignore_errors=True)
  shutil.rmtree(os.path.join(download_dir, "ctr_parse"), ignore_errors=True)
  return builder


def data_sources(builder) -> dict[str, Any]:
  """Random-access sources of every split (`tfds.data_source`'s objects), no TensorFlow."""
  return dict(builder.as_data_source())


def load_kg(builder, *, reciprocal: bool = True) -> kg.KG:
  """The kg.KG a fb15k237 build holds (the same ids and names `kg.load` gives)."""
  src = data_sources(builder)
  meta = builder.info.metadata
  splits = {}
  for s in kg.SPLITS:
    rows = src[s].__getitems__(list(range(len(src[s])))) if len(src[s]) else []
    splits[s] = np.array([[e["head"], e["relation"], e["tail"]] for e in rows], np.int32).reshape(
      -1, 3
    )
  return kg.KG(
    name=builder.name,
    entities=list(meta["entities"]),
    relations=list(meta["relations"]),
    splits=splits,
    reciprocal=reciprocal,
    unseen=dict(meta.get("unseen", {})),
  )


def ogb_config_for(folder: str) -> _GraphConfig:
  """The ogb_node config of an unpacked OGB folder (its name; the feature width from the
  first line of raw/node-feat.csv.gz, None without features)."""
  import gzip

  feat = os.path.join(folder, "raw", "node-feat.csv.gz")
  width = None
  if os.path.exists(feat):
    with gzip.open(feat, "rb") as f:
      first = f.readline()
    width = first.count(b",") + 1 if first.strip() else None
  return ogb_config(os.path.basename(os.path.normpath(folder)), width)


def load_graph_config(data) -> store.Graph:
  """node_classification's data.source=tfds: the planetoid build of data.name, or (with
  data.path) the ogb_node build of that OGB folder; built once under data.tfds_dir."""
  data_dir = os.path.expanduser(
    data.get("tfds_dir", "") or os.path.join(data.get("cache_dir", "~/.cache/recgnn"), "tfds")
  )
  path = data.get("path", None) or None
  if path and os.path.isdir(os.path.join(path, "raw")):
    return load_graph(build("ogb_node", data_dir, manual_dir=path, config=ogb_config_for(path)))
  name = data.get("name", "cora")
  return load_graph(build("planetoid", data_dir, manual_dir=path, config=name))


def load_graph(builder) -> store.Graph:
  """The store.Graph a graph builder wrote (the same one its loader returned)."""
  src = data_sources(builder)
  meta = builder.info.metadata
  n = int(meta["num_nodes"])
  labels = np.full(n, -1, np.int32)
  neighbors: list = [np.zeros(0, np.int64)] * n
  features = None
  for s in GRAPH_SPLITS:
    rows = src[s].__getitems__(list(range(len(src[s])))) if len(src[s]) else []
    for ex in rows:
      v = int(ex["node"])
      labels[v] = ex["label"]
      neighbors[v] = np.asarray(ex["neighbors"], np.int64)
      if "features" in ex:
        if features is None:
          features = np.zeros((n, ex["features"].shape[0]), np.float32)
        features[v] = ex["features"]
  deg = np.fromiter((x.size for x in neighbors), np.int64, n)
  indptr = np.concatenate([[0], np.cumsum(deg)])
  indices = np.concatenate(neighbors) if n else np.zeros(0, np.int64)
  import scipy.sparse as sp

  adj = sp.csr_matrix((np.ones(indices.size, np.float32), indices, indptr), shape=(n, n))
  return store.Graph(
    name=meta["name"],
    adj=adj,
    labels=labels,
    num_classes=int(meta["num_classes"]),
    splits={s: np.asarray(meta["split_order"][s], np.int64) for s in GRAPH_SPLITS[:3]},
    features=features,
  )
