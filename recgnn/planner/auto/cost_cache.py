"""The JSON cost cache (`CostCache`): measured figures kept across runs, keyed by what sets
them (`MEASURE_VERSION`, `MODEL_VERSION`, the ids, mesh and software)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence

import jax
import numpy as np

from recgnn.embeddings.specs import TableSpec

# Part of every cost cache key: raised whenever `measure` changes what it times, so figures
# timed the old way are not reused.
MEASURE_VERSION = 2


# Part of the model part's key: raised whenever `recgnn.train.model_timing.model_step_seconds`
# changes what it times.
MODEL_VERSION = 1


def _digest(arrays: Sequence[np.ndarray]) -> str:
  h = hashlib.sha256()
  for b in arrays:
    a = np.ascontiguousarray(b)
    h.update(str((a.dtype.str, a.shape)).encode())
    h.update(a.tobytes())
  return h.hexdigest()


def _where(mesh) -> tuple:
  """(mesh shape, platform, device kind, jax version): the part of a key naming where it ran."""
  dev = mesh.devices.flat[0]
  return (
    tuple(mesh.devices.shape),
    dev.platform,
    getattr(dev, "device_kind", ""),
    jax.__version__,
  )


class CostCache:
  """Measured (step s, prepare s) of candidates, and the model part's seconds (`model_key`),
  kept in a JSON file across runs: a second run with the same tables, ids, mesh and software
  (every part of the key) reuses the first run's figures instead of timing again, and so also
  makes the same choice and the same prediction. The file is rewritten whole (a temporary
  file renamed over it), so a killed run leaves it readable."""

  def __init__(self, path: str):
    self.path = os.path.expanduser(path)
    self.hits = self.misses = 0
    try:
      with open(self.path) as f:
        self.entries: dict[str, list[float]] = json.load(f)
    except FileNotFoundError:
      self.entries = {}
    except ValueError as e:
      raise ValueError(f"auto: cost cache {self.path} is not readable JSON ({e}); remove it") from e

  @staticmethod
  def key(text, spec: TableSpec, ids: Sequence[np.ndarray], mesh, layout, measure_rows) -> str:
    """A candidate's key: its text, table, ids, mesh, layout and software (in the order
    keys have always had, so that existing cache files stay valid)."""
    shape, *software = _where(mesh)
    parts = (
      MEASURE_VERSION,
      " ".join(text.split()),
      repr(spec),
      min(spec.num_rows, measure_rows),
      _digest(ids),
      shape,
      repr(layout),
      *software,
    )
    return hashlib.sha256(repr(parts).encode()).hexdigest()

  @staticmethod
  def model_key(what: str, batches: Sequence, mesh) -> str:
    """The model part's key (`cached_model_seconds`): `what` (the task, its model and
    optimizer config, the tables' dims: what sets the cost of the step's shared part, never
    the plan), every array of `batches` (their batch size, shapes and values), mesh and
    software."""
    leaves = [np.asarray(x) for b in batches for x in jax.tree.leaves(b)]
    parts = (MODEL_VERSION, "model part", what, _digest(leaves), *_where(mesh))
    return hashlib.sha256(repr(parts).encode()).hexdigest()

  def get(self, key: str) -> tuple[float, float] | None:
    v = self.entries.get(key)
    if v is None:
      self.misses += 1
      return None
    self.hits += 1
    return float(v[0]), float(v[1])

  def put(self, key: str, value: tuple[float, float]) -> None:
    self.entries[key] = [float(value[0]), float(value[1])]
    os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
    tmp = f"{self.path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
      json.dump(self.entries, f)
    os.replace(tmp, self.path)


def cached_model_seconds(cache: CostCache | None, key: str, measure: Callable[[], float]) -> float:
  """The model part's seconds (`PlanChoice.model_s`), or a finalist's whole step
  (`PlanChoice.whole_step_s`), through `cache` under `key` (`CostCache.model_key`): timed
  once, then the same figure for every run of the experiment.
  Timed in each run's own process it moved from run to run more than any plan's tables did
  (two runs of dlrm_kaggle predicted 36% and 46% high from it alone, the same plans within
  13% in the next round), and it is in every plan's prediction."""
  hit = cache.get(key) if cache else None
  if hit is not None:
    return hit[0]
  out = float(measure())
  if cache:
    cache.put(key, (out, 0.0))
  return out
