"""The drifting click stream (`drifting_stream`) as a CTR file, read three ways at equal memory.

One TSV per (stream settings, capacity C), written once under the cache folder: columns
label, x (a dense feature that carries nothing), item (the raw 62-bit id, in decimal) and
day0 (the id when it is one of the first day's C - FIRST_ID most frequent ids, else empty).
The days are laid end to end and `days` is 7, so the Kaggle split
(`ctr_dataset.kaggle_split`: the first 6/7 train, the last seventh's halves test, then valid)
cuts at day boundaries: train on days 0-5 in stream order, test on the first half of day 6.

How the ids reach the table (`IDS`), each at C rows of memory:
  dynamic    `item` as raw keys (vocab "raw"): a `dynamic(capacity=C)` table admits and
             evicts them as they come.
  hash       `item` hashed into the table (vocab "hash", hash_size C): the hashing trick,
             FIRST_ID + key % (C - FIRST_ID); ids sharing a row collide.
  first_day  `day0` counted (vocab "frequency"): a fixed dictionary built on the first day;
             every id it lacks reads the one row of empty fields (MISSING_ID).

The planted model's true probabilities give the oracle AUC of the test and valid halves.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from typing import Any

import numpy as np

from recgnn import metrics
from recgnn.data import ctr_dataset, ctr_reader, ctr_schema, drifting_stream, file_check

IDS = ("dynamic", "hash", "first_day")
DAYS = 7  # the Kaggle split's days: train 0-5, test / valid day 6


@dataclasses.dataclass(frozen=True)
class Stream:
  """`drifting_stream.stream`'s arguments (its docstring says what each one does)."""

  seed: int = 0
  batches: int = 20
  batch: int = 2048
  born: int = 20_000
  life: int = 3
  exponent: float = 1.05
  effect: float = 1.5
  bias: float = -1.0

  def kwargs(self) -> dict[str, Any]:
    out = dataclasses.asdict(self)
    del out["seed"]
    return {**out, "days": DAYS}

  def rows_per_day(self) -> int:
    return self.batches * self.batch


@functools.cache
def distinct_ids(stream: Stream) -> int:
  """How many distinct ids the stream shows over all its days (capacities are fractions
  of it)."""
  return drifting_stream.distinct_ids(stream.seed, **stream.kwargs())


def capacity_rows(stream: Stream, fraction: float) -> int:
  """The table rows that are `fraction` of the stream's distinct ids (at least FIRST_ID + 1,
  the hashing trick's smallest table)."""
  if not 0 < fraction <= 4:
    raise ValueError(f"capacity={fraction}: give a fraction of the distinct ids in (0, 4]")
  return max(ctr_schema.FIRST_ID + 1, round(fraction * distinct_ids(stream)))


def _draw(stream: Stream) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(ids int64[N], labels int8[N], probs f32[N]) of the whole stream, in order."""
  parts = list(drifting_stream.stream(stream.seed, **stream.kwargs()))
  ids = np.concatenate([p[1] for p in parts])
  labels = np.concatenate([p[2] for p in parts]).astype(np.int8)
  probs = np.concatenate([p[3] for p in parts])
  return ids, labels, probs


def first_day(ids: np.ndarray, per_day: int, capacity: int) -> np.ndarray:
  """The first day's capacity - FIRST_ID most frequent ids (ties: the smaller id): the
  fixed dictionary's keys, int64[<= capacity - FIRST_ID], sorted."""
  keys, counts = np.unique(ids[:per_day], return_counts=True)
  keep = np.lexsort((keys, -counts))[: capacity - ctr_schema.FIRST_ID]
  return np.sort(keys[keep])


def hash_collisions(ids: np.ndarray, capacity: int) -> float:
  """The share of the stream's distinct ids that share their hashed row with another id."""
  keys = np.unique(ids)
  rows = keys % (capacity - ctr_schema.FIRST_ID)
  _, inverse, counts = np.unique(rows, return_inverse=True, return_counts=True)
  return float(np.mean(counts[inverse] > 1))


def _lines(ids, labels, known, rng) -> str:
  x = rng.random(ids.shape[0])
  day0 = np.where(np.isin(ids, known), ids.astype(str), "")
  return "".join(
    f"{y}\t{v:.3f}\t{i}\t{d}\n" for y, v, i, d in zip(labels.tolist(), x, ids.tolist(), day0)
  )


def _info(ids, labels, probs, stream: Stream, capacity: int, known) -> dict[str, Any]:
  split = ctr_dataset.kaggle_split(ids.shape[0])
  oracle = {s: metrics.auc(labels[a:b], probs[a:b]) for s, (a, b) in split.items() if s != "train"}
  return {
    "stream": dataclasses.asdict(stream),
    "capacity": capacity,
    "rows": int(ids.shape[0]),
    "distinct_ids": int(np.unique(ids).shape[0]),
    "first_day_ids": int(known.shape[0]),
    "hash_collision_rate": hash_collisions(ids, capacity),
    "oracle_auc": oracle,
  }


def write(folder: str, stream: Stream, capacity: int) -> tuple[str, dict[str, Any]]:
  """The TSV of `stream` for tables of `capacity` rows and its info (written once: a file
  whose sidecar records these settings is reused; written to a temporary name and renamed,
  so a crash leaves no half file)."""
  key = {"stream": dataclasses.asdict(stream), "capacity": capacity}
  tag = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
  path = os.path.join(folder, f"drifting-{tag}.tsv")
  info_path = path + ".info.json"
  info = file_check.read_manifest(info_path)
  if info is None or file_check.sidecar_problem(path, key) is not None:
    os.makedirs(folder, exist_ok=True)
    ids, labels, probs = _draw(stream)
    known = first_day(ids, stream.rows_per_day(), capacity)
    rng = np.random.default_rng([stream.seed, 1])
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
      f.write(_lines(ids, labels, known, rng))
    os.replace(tmp, path)
    file_check.write_sidecar(path, key)
    info = _info(ids, labels, probs, stream, capacity, known)
    file_check.write_manifest(info_path, info)
  return path, info


def schema(ids: str, capacity: int) -> ctr_schema.Schema:
  """The file's schema with its one table read as `ids` says (see the module docstring)."""
  if ids not in IDS:
    raise ValueError(f"Unknown drifting ids {ids!r}; available: {', '.join(IDS)}")
  column = {
    "dynamic": {"name": "item", "kind": "int", "vocab": "raw"},
    "hash": {"name": "item", "kind": "int", "vocab": "hash", "hash_size": capacity},
    "first_day": {"name": "day0", "kind": "int", "vocab": "frequency"},
  }[ids]
  return ctr_schema.Schema.from_dict(
    {
      "name": f"drifting_{ids}",
      "label": "label",
      "dense": ["x"],
      "categorical": [column],
      "columns": ["label", "x", "item", "day0"],
      "dense_transform": "none",
    }
  )


def open_drifting(data) -> tuple[ctr_dataset.CTRDataset, dict[str, float]]:
  """config.data with a `drifting` block (Stream's fields, `capacity` rows, `ids`) -> the
  dataset and its oracle figures (the CTR task's report)."""
  d = data.drifting
  stream = Stream(**{f.name: d[f.name] for f in dataclasses.fields(Stream) if f.name in d})
  folder = os.path.join(os.path.expanduser(data.cache_dir), "drifting")
  path, info = write(folder, stream, int(d.capacity))
  dataset = ctr_reader.open_ctr(path, folder, schema(d.ids, int(d.capacity)))
  oracle = {
    "oracle_auc_test": info["oracle_auc"]["test"],
    "oracle_auc_valid": info["oracle_auc"]["valid"],
    "dense_only_auc_test": 0.5,  # x is noise: the dense features alone know nothing
  }
  return dataset, oracle
