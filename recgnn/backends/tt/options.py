"""`tt(...)`'s plan-string options: one frozen dataclass, parsed by `base.BackendOptions.parse`
(an option it cannot honour is refused with the reason)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from recgnn.backends.tt.shape import INITS
from recgnn.embeddings import base

KERNELS = ("naive", "unique", "prefix")
CONTRACTS = ("auto", "batched", "pairs")
PADS = ("grow", "full")


@dataclasses.dataclass(frozen=True)
class TTOptions(base.BackendOptions):
  """`tt(...)`'s options, e.g. `tt(rank=16, cores=3, init=sampled_gaussian, cache_rows=10000,
  kernel=prefix)`.

  Attributes:
    rank: inner TT rank (int, or a tuple of K-1 ranks).
    cores: number of cores K (balanced factorization of rows and dim); 3 when not given.
      With `row_factors` it must agree with them (they fix the count).
    row_factors: explicit factorization of the rows (a tuple) instead of the balanced one.
    dim_factors: explicit factorization of the dim (a tuple) instead of the balanced one.
    init: sampled_gaussian | uniform | orthogonal | tt_svd; all match the variance of the
      table's dense initializer (`target_variance`). tt_svd compresses the dense
      float32[N, D] table in `init_path` (a .npy file) by TT-SVD: how a graph-derived init
      (Nimble's "eigen": adjacency eigenvectors) reaches the backend. The file is the
      interface: a task writes it (node_classification: embeddings.node_init=eigen), the
      backend reads it at init; neither imports the other.
    init_path: the .npy file of init=tt_svd (~ expanded); only with it.
    kernel: prefix | unique | naive (module docstring).
    contract: auto | batched | pairs: how a level multiplies prefixes by slices (module
      docstring); results are equal up to float summation order. Not with kernel=naive.
    cache_rows: rows of the uncompressed hot-row cache (0 = none).
    cache_warmup: batches counted before the hot set is fixed (50 when not given); only
      with a cache.
    pad: grow | full; see the module docstring.
    lookahead: pad=grow sizes its capacities from this many upcoming batches as well as the
      first one (the trainer passes them), so they rarely grow later; 16 when not given, 0:
      from the first batch alone. Not with pad=full (one shape: nothing to size).
  """

  backend: ClassVar[str] = "tt"

  rank: int | tuple[int, ...] = 32
  cores: int | None = None
  row_factors: tuple[int, ...] | None = None
  dim_factors: tuple[int, ...] | None = None
  init: str = "sampled_gaussian"
  init_path: str = ""
  kernel: str = "prefix"
  contract: str = "auto"
  cache_rows: int = 0
  cache_warmup: int | None = None
  pad: str = "grow"
  lookahead: int | None = None

  def __post_init__(self):
    cores, row_factors = self.cores, self.row_factors
    if cores is not None and row_factors is not None and cores != len(row_factors):
      raise ValueError(
        f"tt: cores={cores} but row_factors={tuple(row_factors)} give {len(row_factors)} cores; "
        "the factors fix the core count: drop cores="
      )
    if self.cache_warmup is not None and not self.cache_rows:
      raise ValueError(
        f"tt: cache_warmup={self.cache_warmup} counts batches before the hot-row cache is "
        "filled, but there is no cache (cache_rows=0): drop cache_warmup or give cache_rows=ROWS"
      )
    if self.init not in INITS:
      raise ValueError(f"tt: unknown init {self.init!r}; available: {', '.join(INITS)}")
    if self.kernel not in KERNELS:
      raise ValueError(f"tt: unknown kernel {self.kernel!r}; available: {', '.join(KERNELS)}")
    if self.contract not in CONTRACTS:
      raise ValueError(f"tt: unknown contract {self.contract!r}; available: {', '.join(CONTRACTS)}")
    if self.contract != "auto" and self.kernel == "naive":
      raise ValueError(
        f"tt: contract={self.contract} needs kernel=prefix or unique (naive has no tree)"
      )
    if self.pad not in PADS:
      raise ValueError(f"tt: unknown pad {self.pad!r}; available: {', '.join(PADS)}")
    if self.cache_rows < 0 or self.warmup < 1:
      raise ValueError(
        f"tt: need cache_rows >= 0 and cache_warmup >= 1, got {self.cache_rows}, {self.warmup}"
      )
    if (self.init == "tt_svd") != bool(self.init_path):
      raise ValueError("tt: init=tt_svd and init_path=FILE.npy go together")
    if self.lookahead is not None and self.pad == "full":
      raise ValueError("tt: lookahead sizes pad=grow's capacities; pad=full has none to size")
    if self.lookahead is not None and self.lookahead < 0:
      raise ValueError(f"tt: lookahead must be >= 0, got {self.lookahead}")

  @property
  def warmup(self) -> int:
    """`cache_warmup` or its default."""
    return 50 if self.cache_warmup is None else self.cache_warmup
