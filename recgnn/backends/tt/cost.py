"""The cost model of `tt(contract=auto)`: which level product (batched or pairs) is cheaper
on this platform, from constants fitted per platform (tt_cost.json beside this file)."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Sequence

import jax
import numpy as np

# The `contract=auto` cost model. Per level with w = a * r * d_k * r_k multiply-adds per product:
#   batched ~ batched_fixed_ns + P_k * (batched_ns + w * batched_ns_per_mac)   (tiny matmuls)
#   pairs   ~ pairs_fixed_ns + P_{k-1} * S_k * w * pairs_ns_per_mac            (one GEMM)
# Its constants are a platform's: fitted to forward + vjp times of single levels
# (`benchmarks/tt.py --sections=levels`) on XLA:CPU (the fixed terms 0: per-product overhead
# dominates there) and, per accelerator, by gpu_check's calibrate stage (a kernel
# launch is a fixed cost on a GPU). They live in tt_cost.json beside this file, per platform.
_COST_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tt_cost.json")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CostModel:
  """contract=auto's constants for one platform (nanoseconds; see the formula above).

  pairs_max_floats: the largest pair table [P_{k-1} a, S_k d_k r_k] pairs may build (beyond
  it memory traffic dominates and the batched product is taken regardless).
  source: where the numbers come from (platform, command, date).
  """

  batched_fixed_ns: float = 0.0
  batched_ns: float
  batched_ns_per_mac: float
  pairs_fixed_ns: float = 0.0
  pairs_ns_per_mac: float
  pairs_max_floats: int = 2 << 20
  source: str = ""
  platform: str = "cpu"


# Fitted by hand to XLA:CPU's timed levels (docs/backends/tt.md; `source` names the run).
CPU_COSTS = CostModel(
  batched_ns=1500.0,
  batched_ns_per_mac=0.3,
  pairs_ns_per_mac=0.1,
  pairs_max_floats=2 << 20,
  source="XLA:CPU, 2 cores, jax 0.10.2: benchmarks/tt.py --sections=levels (tt_levels.md)",
)


def _read_cost_file(path: str = _COST_FILE) -> dict:
  if not os.path.exists(path):  # (an install without the package data: CPU's model)
    return {}
  with open(path) as f:
    return {k: v for k, v in json.load(f).items() if not k.startswith("_")}


@functools.cache
def cost_model(backend: str | None = None, device_kind: str | None = None) -> CostModel:
  """The cost model of a platform: tt_cost.json's "BACKEND:DEVICE KIND" entry, else its
  "BACKEND" entry, else `CPU_COSTS` (default: jax's default backend and its first device).
  A platform never calibrated gets the CPU's constants: still a correct product, maybe not
  the faster one."""
  if backend is None:
    backend = jax.default_backend()
    device_kind = jax.devices()[0].device_kind if device_kind is None else device_kind
  table = _read_cost_file()
  fields = {f.name for f in dataclasses.fields(CostModel)}
  for key in (f"{backend}:{device_kind}", backend):
    if key in table:
      return CostModel(**{k: v for k, v in table[key].items() if k in fields}, platform=key)
  return CPU_COSTS


def level_product(
  p_prev: int, a: int, r: int, s: int, d: int, r1: int, p: int, costs: CostModel | None = None
) -> str:
  """'pairs' or 'batched': the cheaper product for one level by the cost model above (this
  platform's `cost_model()` unless `costs` is given).

  p_prev parents [a, r] each, s slices [r, d * r1] each, p products wanted.
  """
  c = cost_model() if costs is None else costs
  w = a * r * d * r1
  if p_prev * a * s * d * r1 > c.pairs_max_floats:
    return "batched"
  pairs = c.pairs_fixed_ns + p_prev * s * w * c.pairs_ns_per_mac
  batched = c.batched_fixed_ns + p * (c.batched_ns + w * c.batched_ns_per_mac)
  return "pairs" if pairs < batched else "batched"


def fit_cost_model(levels: Sequence[dict], *, source: str, platform: str) -> CostModel:
  """The constants of the cost model fitted to timed levels (`benchmarks/tt.py
  --sections=levels` rows: p_prev, a, r, d, r1, p, slices, batched_ms, pairs_ms).

  Each product's time is linear in its constants; they are fitted by non-negative least
  squares on relative error (a level of 0.05 ms weighs as much as one of 5 ms: the choice
  is a ratio). pairs_max_floats is not fitted (the levels do not reach it): XLA:CPU's.
  """
  import scipy.optimize  # (only here: calibration)

  rows_b, rows_p = [], []
  for x in levels:
    w = x["a"] * x["r"] * x["d"] * x["r1"]
    tb, tp = 1e6 * x["batched_ms"], 1e6 * x["pairs_ms"]
    rows_b.append(np.array([1.0, x["p"], x["p"] * w]) / tb)
    rows_p.append(np.array([1.0, x["p_prev"] * x["slices"] * w]) / tp)
  if len(rows_b) < 3:
    raise ValueError(f"fit_cost_model: {len(rows_b)} timed levels; need at least 3")
  # Columns scaled to unit norm first: their magnitudes differ by ~10 orders.
  coef = []
  for rows in (np.array(rows_b), np.array(rows_p)):
    scale = np.linalg.norm(rows, axis=0)
    scale[scale == 0] = 1.0
    c, _ = scipy.optimize.nnls(rows / scale, np.ones(len(rows)))
    coef.append(c / scale)
  (bf, bn, bm), (pf, pm) = coef
  return CostModel(
    batched_fixed_ns=float(bf),
    batched_ns=float(bn),
    batched_ns_per_mac=float(bm),
    pairs_fixed_ns=float(pf),
    pairs_ns_per_mac=float(pm),
    pairs_max_floats=CPU_COSTS.pairs_max_floats,
    source=source,
    platform=platform,
  )
