"""`tt`: the table as tensor-train cores (TT-Rec, Yin et al., MLSys'21).

An N x D table is stored as K cores G_k of shape [n_k, r_{k-1}, d_k, r_k] with
prod(n_k) >= N, prod(d_k) = D and r_0 = r_K = 1. Row i, written in mixed radix as
(i_1, ..., i_K) (i_K fastest), is the product of one slice per core:

  row(i) = reshape(G_1[i_1] @ G_2[i_2] @ ... @ G_K[i_K], [D])   (contracting the rank axes)

A 10M x 16 table at rank 32 is ~0.5M floats instead of 160M. The cores are small dense
params owned by this backend (not optax): `update` takes the vjp of the lookup w.r.t. the
core slices the batch touched and applies the table's optimizer to those slices only.

Optimizer semantics on cores (one "row" = one core slice G_k[i], a [r_{k-1}, d_k, r_k] block):
  sgd              G_k[i] -= lr * dL/dG_k[i]  (the exact gradient of the loss w.r.t. the core)
  rowwise_adagrad  one accumulator per core slice: acc_k[i] += mean(g_k[i]**2);
                   G_k[i] -= lr * g_k[i] / (sqrt(acc_k[i]) + eps), g_k[i] summed over the batch
Slices a batch does not touch have a zero gradient, so the sparse update equals the dense
optimizer step on the whole core.

Kernels (`kernel=`), all computing the same rows (benchmarks/tt.py measures them):
  naive   per bag slot: gather one slice per core on the device, contract; the vjp is taken
          w.r.t. the whole cores (a core-sized dense gradient each step). The reference.
  unique  host dedups the batch's rows; one chain of slice products per distinct row; the
          update touches only the distinct slices of each core.
  prefix  TT-Rec's kernel: rows sharing an index prefix (i_1..i_k) share the partial product
          G_1[i_1] @ ... @ G_k[i_k]. The host builds the prefix tree of the batch's distinct
          rows (`prepare`); the device computes each distinct prefix once, level by level
          (the level products below). The default: the fastest measured
          (benchmarks/results/tt_kernels.md, tt_contract.md).

Level products (`contract=`, for unique and prefix): level k multiplies each prefix's
partial product [a, r] by its slice of core k [r, d_k * r_k]. `batched`: one batched matmul
over the P_k prefixes (P_k tiny matmuls; on XLA:CPU its transpose, a contraction over
a <= 4, is slow). `pairs`: one plain matmul of the P_{k-1} distinct parents by the S_k
distinct slices ([P_{k-1} a, r] @ [r, S_k d_k r_k]), then a gather of the P_k pairs used:
P_{k-1} S_k / P_k times the arithmetic, but as one GEMM (and its vjp two GEMMs and a
scatter). `auto` (default) picks per level from the static capacities with the cost model
of `level_product` (constants per platform, fitted to `benchmarks/tt.py --sections=levels`,
which times both on single levels: XLA:CPU's in `CPU_COSTS`, an accelerator's by gpu_check's
calibrate stage into tt_cost.json; `--sections=kernels --contracts=batched,pairs,auto`
compares them on one table); pairs only while its [P_{k-1} a, S_k d_k r_k] product stays
under the model's `pairs_max_floats`. Both are exact: rows and gradients agree up to float
summation order (tests/test_tt.py).

Cache (`cache_rows=C`, TT-Rec's cache of hot uncompressed rows): the host counts accesses over
the first `cache_warmup` batches, then fixes the C most frequent rows as the hot set (LFU over
the warm-up, as TT-Rec). Hot rows are served and trained as plain rows of a float32[C, D] cache
(with their own row-wise optimizer state); the cores do not see them. The cache is filled
from the TT reconstruction of the current cores by the first update that sees the hot set, so
the logical table is continuous. `table(state)` is the TT reconstruction overridden by the
cache; `sync` has nothing to write back (the cache is part of the state).

Shapes are static per bucket: `prepare` pads the distinct-row, prefix and slice counts to
grow-only capacities (1.25x the largest count of the first batch and the `lookahead` batches
after it, rounded to 4 sizes per octave; grown only when a count does not fit), so a jitted
step retraces only the rare times a capacity grows (and once when the cache's hot set is
fixed). `pad=full` pads to the batch size instead: one shape, no retrace,
more padded work (benchmarks/tt.py measures both).

Files, one object per phase, which the front class holds and calls (none reads another's
attributes; docs/architecture.md, "How a backend is composed"): options.py (`TTOptions`),
shape.py (`TTShape`, the frozen layout: factorization, initial cores, reconstruction), cost.py
(contract=auto's cost model), kernels.py (a level's product, capacity rounding), prepare.py
(`Preparer`: the cache's plan and the prefix trees on the input thread), device.py
(`DeviceStep`: lookup / update over the cores and the cache), state.py (`StateKeeper`: init,
shardings, memory, table, checkpoints); backend.py, the front `TT` class.
"""

from __future__ import annotations

from recgnn.backends.tt.backend import TT
from recgnn.backends.tt.cost import (  # noqa: F401  (the package's public names)
  _COST_FILE,
  CPU_COSTS,
  CostModel,
  _read_cost_file,
  cost_model,
  fit_cost_model,
  level_product,
)
from recgnn.backends.tt.kernels import HEADROOM, _round_up, level  # noqa: F401
from recgnn.backends.tt.options import CONTRACTS, KERNELS, PADS, TTOptions  # noqa: F401
from recgnn.backends.tt.shape import (  # noqa: F401
  INITS,
  TTShape,
  balanced_dim_factors,
  balanced_row_factors,
  core_std,
  init_cores,
  load_init_table,
  reconstruct,
  target_variance,
  tt_shape,
  tt_svd,
)

__all__ = ["TT", "TTOptions", "TTShape"]
