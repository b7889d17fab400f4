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
builder's metadata (`info.metadata`). The CTR builders are `tfds_ctr`'s, the graph builders
and the readers of a graph build `tfds_graphs`'; their names are importable from here.

A build is verified before it is used: when one is written, every file of its folder is
recorded (bytes + the SHA-256 of its first 64 KiB, `file_check`) in MANIFEST inside it; a
later `build` checks them first, and a build that does not match (a shard cut short, a
damaged dataset_info.json, a build without the record) is built again from its source, or,
where the source is gone, refused naming the file and the fix. Never read as data.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

import tensorflow_datasets as tfds
from absl import logging

from recgnn.data import file_check
from recgnn.data.tfds_ctr import (  # noqa: F401 (the builders' names, importable from here)
  CriteoKaggle,
  CriteoTerabyte,
  Ctr,
  criteo_config,
  ctr_config,
  day_files,
)
from recgnn.data.tfds_graphs import (  # noqa: F401 (likewise)
  GRAPH_SPLITS,
  VERSION,
  Fb15k237,
  OgbNode,
  Planetoid,
  data_sources,
  load_graph,
  load_kg,
  ogb_config,
  ogb_config_for,
)
from recgnn.graphs import store

BUILDERS = {
  "criteo_kaggle": CriteoKaggle,
  "criteo_terabyte": CriteoTerabyte,
  "ctr": Ctr,
  "fb15k237": Fb15k237,
  "planetoid": Planetoid,
  "ogb_node": OgbNode,
}
MANIFEST = "recgnn_files.json"  # inside a build's folder: its files' bytes and head checksums


def build(
  name: str, data_dir: str, *, manual_dir: str | None = None, config: Any = None
) -> tfds.core.DatasetBuilder:
  """Prepare (once: an existing build is reused once its files check out) and return the
  builder `name`. A damaged build is built again; if that fails (its source is gone), the
  damaged build is put back and refused naming the file and the fix."""
  if name not in BUILDERS:
    raise ValueError(f"Unknown TFDS builder {name!r}; available: {', '.join(BUILDERS)}")
  folder = variant_dir(name, data_dir, config)
  why = build_problem(folder) if os.path.isdir(folder) else None
  if why is None:
    return _prepare(name, data_dir, manual_dir, config)  # new, or whole (TFDS reuses it)
  logging.warning("TFDS build %s is damaged (%s): building it again", folder, why)
  aside = f"{folder}.damaged-{os.getpid()}"
  os.replace(folder, aside)
  try:
    builder = _prepare(name, data_dir, manual_dir, config)
  except Exception as e:
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(aside, folder)
    raise ValueError(
      f"TFDS build {folder} is damaged: {why}. Building it again failed ({type(e).__name__}: "
      f"{e}). Fix: give the build its source again (manual_dir / --config.data.path), or "
      f"delete {folder} and build it from a source you have."
    ) from e
  shutil.rmtree(aside, ignore_errors=True)
  return builder


def variant_dir(name: str, data_dir: str, config: Any = None) -> str:
  """The folder of the build of (name, config) under data_dir, found without reading it: a
  builder over an empty folder says where its build goes (the real builder's constructor
  reads dataset_info.json, and a damaged one would stop it before it could be checked)."""
  with tempfile.TemporaryDirectory() as empty:
    probe = BUILDERS[name](config=config, data_dir=empty, file_format="array_record")
    return os.path.join(data_dir, os.path.relpath(str(probe.data_path), empty))


def build_problem(folder: str) -> str | None:
  """None if every file MANIFEST records in the build `folder` is whole, else what is not."""
  manifest = file_check.read_manifest(os.path.join(folder, MANIFEST))
  if manifest is None:
    return f"{os.path.join(folder, MANIFEST)} is missing or unreadable"
  return file_check.check_files(folder, manifest)


def _prepare(name: str, data_dir: str, manual_dir: str | None, config: Any):
  """download_and_prepare (a no-op on an existing build); a new build's files recorded."""
  builder = BUILDERS[name](config=config, data_dir=data_dir, file_format="array_record")
  folder = str(builder.data_path)
  fresh = not os.path.isdir(folder)
  download_dir = os.path.join(data_dir, "downloads")
  download_config = tfds.download.DownloadConfig(manual_dir=manual_dir) if manual_dir else None
  builder.download_and_prepare(download_dir=download_dir, download_config=download_config)
  # The parsed memmaps were only the source of the examples: the build holds every row, so
  # they would double the disk a Terabyte build needs.
  shutil.rmtree(os.path.join(download_dir, "criteo_parse"), ignore_errors=True)
  shutil.rmtree(os.path.join(download_dir, "ctr_parse"), ignore_errors=True)
  if fresh:  # recorded last: a build interrupted before this is built again
    names = sorted(
      f for f in os.listdir(folder) if f != MANIFEST and os.path.isfile(os.path.join(folder, f))
    )
    manifest = {"builder": name, "files": file_check.file_records(folder, names)}
    file_check.write_manifest(os.path.join(folder, MANIFEST), manifest)
  return builder


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
