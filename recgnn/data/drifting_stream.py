"""A drifting click stream with raw ids: ids are born and die over days, popularity is a
power law among the ids alive, and labels come from a planted per-id model whose true
probabilities are returned too (the oracle: the best AUC any model can reach).

Day d's live ids are those born on days (d - life, d]; `born` new ids a day. Each id gets a
popularity rank at birth (uniform in 1 .. born x life, so the live set keeps a Zipf-like
profile) and an effect w_id ~ N(0, effect^2); an example of id i is a click with
probability sigmoid(bias + w_i). Raw ids are 62-bit values (no dictionary, no modulo), so a
fixed table must hash them or count them first; a dynamic table maps them as they come.

`stream(...)` yields (day, ids int64[B], labels f32[B], probs f32[B]) for `batches` batches a
day; deterministic in `seed`.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np


def stream(
  seed: int,
  *,
  days: int = 8,
  batches: int = 20,
  batch: int = 2048,
  born: int = 20_000,
  life: int = 3,
  exponent: float = 1.05,
  effect: float = 1.5,
  bias: float = -1.0,
) -> Iterator[tuple[int, np.ndarray, np.ndarray, np.ndarray]]:
  rng = np.random.default_rng(seed)
  total = born * (days + life)
  raw = rng.integers(1 << 40, 1 << 62, size=total, dtype=np.int64)
  rank = rng.integers(1, born * life + 1, size=total)
  w = rng.normal(0.0, effect, size=total)
  for day in range(days):
    # Ids [0, life x born) are born before day 0, so day 0 starts with a full live set.
    hi = (day + life) * born
    lo = hi - life * born
    weight = 1.0 / rank[lo:hi] ** exponent
    cdf = np.cumsum(weight)
    cdf /= cdf[-1]
    for _ in range(batches):
      i = lo + np.minimum(cdf.searchsorted(rng.random(batch), side="right"), hi - lo - 1)
      p = 1.0 / (1.0 + np.exp(-(bias + w[i])))
      labels = (rng.random(batch) < p).astype(np.float32)
      yield day, raw[i], labels, p.astype(np.float32)


def distinct_ids(seed: int, **kw) -> int:
  """How many distinct ids a stream with these arguments shows (one pass)."""
  seen: set[int] = set()
  for _, ids, _, _ in stream(seed, **kw):
    seen.update(ids.tolist())
  return len(seen)
