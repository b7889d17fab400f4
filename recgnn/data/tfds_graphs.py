"""The graph datasets as TFDS builders (see `tfds_builders` for the catalog and the API):
Planetoid and OGB node-property graphs (one example per node) and FB15k-237's triples, made by
this package's loaders, and the readers that put a build back together (`load_graph`,
`load_kg`: the same objects the loaders return)."""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

import numpy as np
import tensorflow_datasets as tfds

from recgnn.data import kg, ogb, planetoid
from recgnn.graphs import store

VERSION = tfds.core.Version("1.0.0")


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


# ----------------------------------------------------------------------------- readers


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
