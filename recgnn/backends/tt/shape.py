"""TT shapes and initial cores: the factorization of an N x D table into K cores, the cores'
initializers (matched to the dense initializer's variance, or TT-SVD of a given table) and the
dense reconstruction (tests and export).

Core k: float32[n_k, r_{k-1}, d_k, r_k], prod(n_k) >= N, prod(d_k) = D, r_0 = r_K = 1.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from recgnn.data import file_check
from recgnn.embeddings import base

INITS = ("sampled_gaussian", "uniform", "orthogonal", "tt_svd")


def balanced_row_factors(num_rows: int, cores: int) -> tuple[int, ...]:
  """K factors n_k, as equal as possible, with prod(n_k) >= num_rows (smallest first).

  10131227, 3 -> (217, 217, 216): each factor is the ceil of the K-th root of what is left.
  """
  if cores < 1:
    raise ValueError(f"tt: cores must be >= 1, got {cores}")
  out, left = [], num_rows
  for k in range(cores, 0, -1):
    n = max(1, math.ceil(left ** (1.0 / k) - 1e-9))
    while n > 1 and (n - 1) ** k >= left:  # guard against float roots rounding up
      n -= 1
    out.append(n)
    left = -(-left // n)
  return tuple(sorted(out))


def balanced_dim_factors(dim: int, cores: int) -> tuple[int, ...]:
  """K factors d_k with prod(d_k) == dim, balanced, largest last.

  Largest last because the lookup contracts left to right: the widest intermediate is
  [d_1...d_{K-1}, r], so the biggest d belongs to the last core. 16, 3 -> (2, 2, 4).
  """
  primes, n, p = [], dim, 2
  while n > 1:
    while n % p == 0:
      primes.append(p)
      n //= p
    p += 1
  out = [1] * cores
  for q in sorted(primes, reverse=True):
    out[int(np.argmin(out))] *= q
  return tuple(sorted(out))


@dataclasses.dataclass(frozen=True, kw_only=True)
class TTShape:
  """The factorization of one table.

  Attributes:
    row_factors: (n_1, ..., n_K), prod >= num_rows.
    dim_factors: (d_1, ..., d_K), prod == dim.
    ranks: (r_0, ..., r_K) with r_0 = r_K = 1.
  """

  row_factors: tuple[int, ...]
  dim_factors: tuple[int, ...]
  ranks: tuple[int, ...]

  @property
  def num_cores(self) -> int:
    return len(self.row_factors)

  def core_shapes(self) -> list[tuple[int, int, int, int]]:
    """[(n_k, r_{k-1}, d_k, r_k)] for k = 1..K."""
    r, n, d = self.ranks, self.row_factors, self.dim_factors
    return [(n[k], r[k], d[k], r[k + 1]) for k in range(self.num_cores)]

  @property
  def num_params(self) -> int:
    return sum(math.prod(s) for s in self.core_shapes())

  @property
  def strides(self) -> tuple[int, ...]:
    """Row-id stride of each core's index: i_k = (row // strides[k]) % n_k."""
    n = self.row_factors
    return tuple(math.prod(n[k + 1 :]) for k in range(len(n)))

  def describe(self) -> str:
    n, d = "x".join(map(str, self.row_factors)), "x".join(map(str, self.dim_factors))
    return f"rows {n}, dim {d}, ranks {self.ranks}"


def tt_shape(
  num_rows: int,
  dim: int,
  rank: int | Sequence[int] = 32,
  cores: int = 3,
  row_factors: Sequence[int] | None = None,
  dim_factors: Sequence[int] | None = None,
) -> TTShape:
  """The TT factorization of a num_rows x dim table (nothing allocated).

  Inner ranks are capped at what the unfolding can use, min(prod_{j<=k} n_j d_j,
  prod_{j>k} n_j d_j): a larger rank adds parameters without adding expressiveness (it
  matters for small tables only).
  """
  n = tuple(row_factors) if row_factors is not None else balanced_row_factors(num_rows, cores)
  d = tuple(dim_factors) if dim_factors is not None else balanced_dim_factors(dim, len(n))
  k = len(n)
  if len(d) != k:
    raise ValueError(f"tt: row_factors {n} and dim_factors {d} need the same number of cores")
  if math.prod(n) < num_rows:
    raise ValueError(f"tt: row_factors {n} cover {math.prod(n)} < {num_rows} rows")
  if math.prod(d) != dim:
    raise ValueError(f"tt: dim_factors {d} multiply to {math.prod(d)}, not dim {dim}")
  inner = [rank] * (k - 1) if isinstance(rank, int) else list(rank)
  if len(inner) != k - 1:
    raise ValueError(f"tt: rank needs {k - 1} inner ranks for {k} cores, got {rank}")
  if any(r < 1 for r in inner):
    raise ValueError(f"tt: ranks must be >= 1, got {rank}")
  sizes = [a * b for a, b in zip(n, d)]
  capped = [
    min(r, math.prod(sizes[: j + 1]), math.prod(sizes[j + 1 :])) for j, r in enumerate(inner)
  ]
  return TTShape(row_factors=n, dim_factors=d, ranks=(1, *capped, 1))


def target_variance(spec: base.TableSpec) -> float:
  """Variance of one entry of the table's dense initializer (base.TableSpec.initializer)."""
  if spec.initializer == "uniform":
    return 1.0 / (3.0 * spec.num_rows)  # U(-a, a) has variance a**2 / 3, a = 1/sqrt(N)
  if spec.initializer == "normal":
    return 1.0 / spec.dim
  raise ValueError(
    f"tt (table {spec.name!r}): cannot start from initializer {spec.initializer!r}: all-zero "
    "cores have zero gradients and never train. Use initializer='uniform' or 'normal'."
  )


def core_std(shape: TTShape, variance: float) -> float:
  """Std of each core entry so that a reconstructed entry has the target `variance`.

  An entry is a sum over prod(r_1..r_{K-1}) products of K independent zero-mean entries,
  one per core: Var = prod(r_k) * s**(2K). Equal std in every core solves it.
  """
  paths = math.prod(shape.ranks[1:-1])
  return (variance / paths) ** (1.0 / (2 * shape.num_cores))


def tt_svd(table: np.ndarray, shape: TTShape) -> list[np.ndarray]:
  """TT-SVD (Oseledets 2011): cores of `shape` approximating a dense float[N, D] table.

  The table, zero-padded to prod(n_k) rows, is the tensor T[i_1, d_1, ..., i_K, d_K] that
  `reconstruct` produces (row digits and column digits interleaved, most significant first);
  core k is the leading r_k left singular vectors of the k-th sequential unfolding, so at
  full ranks the reconstruction is exact and at lower ranks it is the TT-SVD truncation
  (quasi-optimal: error <= sqrt(K - 1) x the best rank-r TT's). If an unfolding has fewer
  than r_k nonzero singular values the extra rank columns are left at zero (the caller adds
  noise). The cores are rescaled to equal Frobenius norms (the product is unchanged), so no
  core starts orders of magnitude smaller than the others.
  Returns float32 cores [n_k, r_{k-1}, d_k, r_k].
  """
  n, d, ranks = shape.row_factors, shape.dim_factors, shape.ranks
  k_cores = len(n)
  rows, dim = table.shape
  if dim != math.prod(d) or rows > math.prod(n):
    raise ValueError(f"tt_svd: table {table.shape} does not fit {shape.describe()}")
  full = np.zeros((math.prod(n), dim), np.float64)
  full[:rows] = table
  t = full.reshape(*n, *d)
  t = t.transpose([a for k in range(k_cores) for a in (k, k_cores + k)])
  cores, mat, r_prev = [], t, 1
  for k in range(k_cores - 1):
    mat = mat.reshape(r_prev * n[k] * d[k], -1)
    u, sv, vt = np.linalg.svd(mat, full_matrices=False)
    r = ranks[k + 1]
    rr = min(r, sv.size)
    core = np.zeros((r_prev * n[k] * d[k], r))
    core[:, :rr] = u[:, :rr]
    rest = np.zeros((r, vt.shape[1]))
    rest[:rr] = sv[:rr, None] * vt[:rr]
    cores.append(core.reshape(r_prev, n[k], d[k], r).transpose(1, 0, 2, 3))
    mat, r_prev = rest, r
  cores.append(mat.reshape(r_prev, n[-1], d[-1], 1).transpose(1, 0, 2, 3))
  norms = np.array([np.linalg.norm(c) for c in cores])
  if np.all(norms > 0):
    g = np.exp(np.mean(np.log(norms)))
    cores = [c * (g / nk) for c, nk in zip(cores, norms)]
  return [c.astype(np.float32) for c in cores]


def load_init_table(path: str, spec: base.TableSpec) -> np.ndarray:
  """The dense float32[N, D] table that `init=tt_svd` compresses, from a .npy file: checked
  against its manifest where one was written beside it (the task's eigen init), and refused
  naming the file when it cannot be read whole (never compressed from a damaged file)."""
  import os

  path = os.path.expanduser(path)
  fix = "write it again (for node tables the task writes it: embeddings.node_init)"
  manifest = file_check.read_manifest(path + file_check.SIDECAR)
  bad = None
  if manifest is not None:
    bad = file_check.check_files(os.path.dirname(os.path.abspath(path)), manifest,
                                 [os.path.basename(path)])  # fmt: skip
  if bad is None:
    try:
      table = np.load(path, mmap_mode="r")
    except (OSError, ValueError) as e:  # truncated: "mmap length is greater than file size"
      bad = f"{path} is not a whole .npy array ({e})"
  if bad is not None:
    raise ValueError(f"tt (table {spec.name!r}): init_path {path}: {bad}; {fix}")
  if table.shape != (spec.num_rows, spec.dim):
    raise ValueError(
      f"tt (table {spec.name!r}): init_path {path} holds {table.shape}, need "
      f"({spec.num_rows}, {spec.dim}); rewrite it for this table (for node tables the task "
      "writes it: embeddings.node_init)"
    )
  return np.asarray(table, np.float32)


def init_cores(
  key: jax.Array,
  shape: TTShape,
  variance: float,
  init: str,
  target: np.ndarray | None = None,
) -> list[jax.Array]:
  """Cores whose reconstructed entries have mean 0 and the target variance.

  sampled_gaussian (TT-Rec): every core entry ~ N(0, s^2), s from `core_std`.
  uniform: U(-sqrt(3) s, sqrt(3) s) (same variance).
  orthogonal: each slice, unfolded to [r_{k-1} d_k, r_k], a random orthogonal matrix (Haar,
    by QR of a Gaussian) scaled so its entries have variance s^2: an orthogonal m x n matrix
    has entry variance 1 / max(m, n). Sign symmetry keeps cross terms at zero mean, so the
    reconstructed variance is the same as for independent entries.
  tt_svd: the TT-SVD (`tt_svd`) of `target`, a dense float[N, D] table (e.g. a graph's
    adjacency eigenvectors: Nimble's "eigen" init), scaled so the reconstruction's mean square
    is `variance`; rank columns the target cannot fill get sampled-Gaussian noise at 1% of s
    (all-zero columns would have zero gradients and never train).
  """
  if init not in INITS:
    raise ValueError(f"tt: unknown init {init!r}; available: {', '.join(INITS)}")
  s = core_std(shape, variance)
  if init != "tt_svd":
    return list(_random_cores(key, shape, s, init))
  if target is None:
    raise ValueError("tt: init=tt_svd needs a target table (the init_path option)")
  keys = jax.random.split(key, shape.num_cores)
  cores = tt_svd(np.asarray(target, np.float64), shape)
  # Scale the truncated reconstruction (not the target: truncation drops energy) to the
  # target variance, equally over the K cores.
  ms = float(jnp.mean(reconstruct([jnp.asarray(c) for c in cores], target.shape[0]) ** 2))
  scale = (variance / ms) ** (1.0 / (2 * shape.num_cores)) if ms > 0 else 0.0
  cores = [c * np.float32(scale) for c in cores]
  return [
    jnp.asarray(c) + 0.01 * s * jax.random.normal(keys[k], c.shape, jnp.float32) * (c == 0)
    for k, c in enumerate(cores)
  ]


# Jitted: one program per shape and init. Op by op, each core's draw, scale and reshape would be
# a program of its own (many compiles at a table's first init: on a GPU, a kernel build each).
@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _random_cores(key: jax.Array, shape: TTShape, s: float, init: str) -> list[jax.Array]:
  keys = jax.random.split(key, shape.num_cores)
  cores = []
  for k, (n, r0, d, r1) in enumerate(shape.core_shapes()):
    if init == "sampled_gaussian":
      g = s * jax.random.normal(keys[k], (n, r0, d, r1), jnp.float32)
    elif init == "uniform":
      a = math.sqrt(3.0) * s
      g = jax.random.uniform(keys[k], (n, r0, d, r1), jnp.float32, -a, a)
    else:  # orthogonal
      m, c = r0 * d, r1
      q = jax.random.orthogonal(keys[k], max(m, c), shape=(n,))[:, :m, :c]
      g = (s * math.sqrt(max(m, c)) * q).reshape(n, r0, d, r1).astype(jnp.float32)
    cores.append(g)
  return cores


def reconstruct(cores: Sequence[jax.Array], num_rows: int) -> jax.Array:
  """The dense table float32[num_rows, D] from the cores (O(N): tests and export only).
  One program per shapes (op by op, each contraction and reshape compiled alone)."""
  return _reconstruct(list(cores), num_rows)


@functools.partial(jax.jit, static_argnums=1)
def _reconstruct(cores: list[jax.Array], num_rows: int) -> jax.Array:
  out = cores[0][:, 0]  # [n_1, d_1, r_1]
  for g in cores[1:]:
    # [P, a, r] x [n, r, b, s] -> [P, n, a, b, s] -> [P * n, a * b, s]
    out = jnp.einsum("par,nrbs->pnabs", out, g)
    p, n, a, b, s = out.shape
    out = out.reshape(p * n, a * b, s)
  return out[:num_rows, :, 0]
