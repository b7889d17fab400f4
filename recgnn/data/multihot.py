"""MLPerf's synthetic multi-hot Criteo: each one-hot id expanded to its table's bag size.

The MLPerf Training DLRM-DCNv2 reference (torchrec_dlrm `multi_hot.py`,
`materialize_synthetic_multihot_dataset.py`) turns Criteo 1TB's one id per table into a bag
of `sizes[t]` ids through a fixed per-table lookup: id i of table t becomes

  [i, r_t(i, 1), ..., r_t(i, L_t - 1)]

where the r are drawn once per (table, id, slot): "uniform" over [0, rows_t), or "pareto"
(numpy's `pareto(a=0.25)`, i.e. Lomax: (1 - u)^(-1/a) - 1, truncated to int32, mod rows_t:
heavy on small ids). The reference stores the lookup as a rows_t x (L_t - 1) table drawn from
np.random.seed(0); that is 16 GB for a 40M-row table of 100-id bags, so here r_t(i, k) is a
counter-based hash of (seed, t, i, k) (splitmix64) instead: the same kind of fixed random
function, computed per batch, no memory. The numbers differ from the reference's table; the
distribution and the structure (the original id first, a fixed bag per id) are the same.

Bags hold exactly L_t ids (duplicates possible, as in the reference): no PAD.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

# MLPerf DLRM-DCNv2 (v3.0+): ids per table and the row caps (num_embeddings_per_feature).
MLPERF_MULTI_HOT_SIZES = (
  3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1,
)  # fmt: skip
MLPERF_ROWS = (
  40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10, 2209,
  11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36,
)  # fmt: skip
DISTRIBUTIONS = ("uniform", "pareto")

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(z: np.ndarray) -> np.ndarray:
  """splitmix64's finalizer: uint64 -> uint64, a bijection that scrambles every bit."""
  z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
  z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
  return z ^ (z >> np.uint64(31))


@dataclasses.dataclass(frozen=True, kw_only=True)
class MultiHotRecipe:
  """How one-hot ids become bags.

  Attributes:
    sizes: bag length per table (1: the table stays one-hot).
    distribution: "uniform" or "pareto".
    seed: the fixed random function's seed.
    pareto_a: the Pareto shape (MLPerf: 0.25).
  """

  sizes: tuple[int, ...] = MLPERF_MULTI_HOT_SIZES
  distribution: str = "uniform"
  seed: int = 0
  pareto_a: float = 0.25

  def __post_init__(self):
    if self.distribution not in DISTRIBUTIONS:
      raise ValueError(
        f"Unknown multi-hot distribution {self.distribution!r}; available: "
        f"{', '.join(DISTRIBUTIONS)}"
      )
    if any(s < 1 for s in self.sizes):
      raise ValueError(f"multi-hot sizes must be >= 1, got {self.sizes}")

  def expand(self, table: int, ids: np.ndarray, num_rows: int) -> np.ndarray:
    """int[B] or int[B, 1] one-hot ids of table `table` (< num_rows) -> int32[B, L_t]."""
    ids = np.asarray(ids).reshape(-1)
    size = self.sizes[table]
    out = np.empty((ids.shape[0], size), np.int32)
    out[:, 0] = ids
    if size == 1:
      return out
    k = np.arange(1, size, dtype=np.uint64)
    with np.errstate(over="ignore"):
      key = _mix(np.uint64(self.seed) * _GOLDEN + np.uint64(table + 1))
      z = _mix(key ^ (ids.astype(np.uint64)[:, None] * _GOLDEN + k))
    u = (z >> np.uint64(11)).astype(np.float64) * 2.0**-53  # [0, 1)
    if self.distribution == "uniform":
      r = np.minimum((u * num_rows).astype(np.int64), num_rows - 1)
    else:
      lomax = np.minimum((1.0 - u) ** (-1.0 / self.pareto_a) - 1.0, np.iinfo(np.int32).max)
      r = lomax.astype(np.int64) % num_rows
    out[:, 1:] = r
    return out


class MultiHotDataset:
  """A one-hot CTR dataset whose batches carry the recipe's bags: ids[t] int32[B, L_t].

  Everything but the batches is the wrapped dataset's (splits, sizes, describe, ...).
  """

  def __init__(self, base, recipe: MultiHotRecipe):
    names = list(base.table_names)
    if len(recipe.sizes) != len(names):
      raise ValueError(
        f"multi-hot sizes name {len(recipe.sizes)} tables; the data has {len(names)} "
        f"({', '.join(names)})"
      )
    if any(b != 1 for b in getattr(base, "bag_lengths", (1,) * len(names))):
      raise ValueError("the multi-hot recipe expands one-hot data; this data has bags already")
    raw = list(getattr(base, "raw_tables", ()))
    if raw:  # (its ids are rows of a table of known size; a raw id is a 64-bit key)
      raise ValueError(
        f"the multi-hot recipe draws ids below each table's rows; tables {raw} hold raw 64-bit "
        "ids (vocab='raw'): read them with categorical='frequency' or 'hash'"
      )
    self.base = base
    self.recipe = recipe
    self.bag_lengths = tuple(recipe.sizes)

  def __getattr__(self, name: str) -> Any:
    return getattr(self.base, name)

  def expand(self, batch: dict[str, Any]) -> dict[str, Any]:
    ids = {
      n: self.recipe.expand(t, batch["ids"][n], int(self.base.cardinalities[t]))
      for t, n in enumerate(self.base.table_names)
    }
    return {**batch, "ids": ids}

  def gather(self, *args, **kwargs):
    return self.expand(self.base.gather(*args, **kwargs))

  def batch(self, *args, **kwargs):
    return self.expand(self.base.batch(*args, **kwargs))

  def batches(self, *args, **kwargs) -> Iterator[dict[str, Any]]:
    return (self.expand(b) for b in self.base.batches(*args, **kwargs))

  def describe(self) -> str:
    r = self.recipe
    return (
      f"{self.base.describe()}\nMulti-hot by MLPerf's recipe ({r.distribution}, seed {r.seed}): "
      f"bags of {', '.join(map(str, r.sizes))} ids ({sum(r.sizes)} per example)"
    )


def sizes_from(spec: str | Sequence[int]) -> tuple[int, ...]:
  """'mlperf' or a sequence of ints -> bag sizes."""
  if isinstance(spec, str):
    if spec != "mlperf":
      raise ValueError(f"Unknown multi-hot sizes {spec!r}; give 'mlperf' or a list of ints")
    return MLPERF_MULTI_HOT_SIZES
  return tuple(int(s) for s in spec)
