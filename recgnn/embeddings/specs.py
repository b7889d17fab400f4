"""Table specs, their row-wise optimizers, and the deterministic initial values every backend
starts from.

An embedding table is not a Flax param. Autodiff through a gather builds a table-sized
cotangent (a 10M x 16 table costs ~90x more per step that way, docs/architecture.md), so every
backend owns its tables' state and applies a sparse row-wise optimizer (`OptimizerSpec.apply`)
to the rows a batch touched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np

PAD = -1  # id value that marks an empty slot of a multi-hot bag
# Batches the trainer's input thread prepares ahead of the step: prepare(k + PREFETCH) may run
# before update(k), and backends must give the same results under that interleaving.
PREFETCH = 2
INIT_CHUNK = 1 << 16  # rows per deterministic init chunk (see `init_rows`)
# Row arrays are allocated (and checkpointed) with their row count rounded up to a multiple of
# ROW_ALIGN, so one saved shape splits evenly over any MODEL axis size that divides ROW_ALIGN:
# a checkpoint written on one mesh restores on another without gathering a table anywhere.
# The padding rows are never addressed by an id.
ROW_ALIGN = 1024


def aligned_rows(num_rows: int) -> int:
  """num_rows rounded up to a multiple of ROW_ALIGN."""
  return -(-num_rows // ROW_ALIGN) * ROW_ALIGN


OPTIMIZERS = ("sgd", "rowwise_adagrad")
INITIALIZERS = ("uniform", "normal", "zeros")
POOLINGS = ("sum", "mean")

# ----------------------------------------------------------------------------- specs


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerSpec:
  """Sparse row-wise optimizer applied to the rows a batch touched.

  Attributes:
    name: `sgd` (w -= lr * g; duplicates of a row within a batch add up, as with a dense
      gradient) or `rowwise_adagrad` (FBGEMM / TorchRec semantics: one accumulator per row,
      acc += mean(g_row**2); w -= lr * g_row / (sqrt(acc) + eps), g_row summed over the
      batch's occurrences of that row).
    learning_rate: step size.
    eps: Adagrad's epsilon.
    initial_accumulator: Adagrad's initial accumulator value.
  """

  name: str = "sgd"
  learning_rate: float = 0.1
  eps: float = 1e-8
  initial_accumulator: float = 0.0

  def __post_init__(self):
    if self.name not in OPTIMIZERS:
      raise ValueError(f"Unknown optimizer {self.name!r}; available: {', '.join(OPTIMIZERS)}")
    if self.learning_rate <= 0:
      raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")

  @property
  def needs_unique(self) -> bool:
    """Whether the update needs each touched row once (per-row state) or tolerates repeats."""
    return self.name != "sgd"

  def slot_names(self) -> tuple[str, ...]:
    """Per-row optimizer state arrays, each float32[rows]."""
    return ("accum",) if self.name == "rowwise_adagrad" else ()

  def init_slots(self, num_rows: int, **put) -> dict[str, jax.Array]:
    """Fresh per-row optimizer state for `num_rows` rows. `put`: kwargs for jnp.full."""
    return {
      s: jnp.full((num_rows,), self.initial_accumulator, jnp.float32, **put)
      for s in self.slot_names()
    }

  def apply(
    self, rows: jax.Array, slots: dict[str, jax.Array], grads: jax.Array, mean_square=None
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """One optimizer step on gathered rows.

    Args:
      rows: float32[U, D], the current values of U distinct rows (for sgd U may repeat).
      slots: per-row optimizer state, each float32[U].
      grads: float32[U, D], the summed gradient of each row.
      mean_square: grads -> float32[U], each row's mean squared gradient for row-wise
        Adagrad (default: the mean over D). A row split by columns over devices passes the
        mean over all of its columns (a sum across the devices).
    Returns:
      (new rows float32[U, D], new slots).
    """
    lr = self.learning_rate
    if self.name == "sgd":
      return rows - lr * grads, slots
    sq = jnp.mean(grads * grads, axis=-1) if mean_square is None else mean_square(grads)
    accum = slots["accum"] + sq
    rows = rows - lr * grads / (jnp.sqrt(accum)[:, None] + self.eps)
    return rows, {"accum": accum}


@dataclasses.dataclass(frozen=True, kw_only=True)
class TableSpec:
  """One embedding table.

  Attributes:
    name: table name, matched by the plan's regexes (DLRM: C1..C26).
    num_rows: rows (categorical cardinality).
    dim: embedding width.
    optimizer: the sparse row-wise optimizer of this table.
    initializer: `uniform` U(-1/sqrt(num_rows), 1/sqrt(num_rows)) as in the DLRM reference,
      `normal` N(0, 1/dim), or `zeros`.
    pooling: how a multi-hot bag is reduced: `sum` or `mean` over its non-padded ids.
    raw_ids: the table's ids are raw keys (a CTR schema's vocab="raw"), not rows: num_rows is
      the id space, which only a backend that maps ids to rows of its own takes
      (`Capabilities.maps_ids`: dynamic); the plan refuses any other. (Not in repr: the
      auto planner's cost cache keys by it.)
  """

  name: str
  num_rows: int
  dim: int
  optimizer: OptimizerSpec = OptimizerSpec()
  initializer: str = "uniform"
  pooling: str = "sum"
  raw_ids: bool = dataclasses.field(default=False, repr=False)

  def __post_init__(self):
    if self.num_rows <= 0 or self.dim <= 0:
      raise ValueError(f"Table {self.name!r}: num_rows and dim must be > 0")
    if self.initializer not in INITIALIZERS:
      raise ValueError(
        f"Table {self.name!r}: unknown initializer {self.initializer!r}; "
        f"available: {', '.join(INITIALIZERS)}"
      )
    if self.pooling not in POOLINGS:
      raise ValueError(
        f"Table {self.name!r}: unknown pooling {self.pooling!r}; available: {', '.join(POOLINGS)}"
      )

  @property
  def row_bytes(self) -> int:
    """Bytes of one row plus its optimizer state."""
    return 4 * self.dim + 4 * len(self.optimizer.slot_names())

  def distinct_rows(self, ids_shape: tuple[int, ...]) -> int:
    """The most distinct rows a batch of ids shaped `ids_shape` ([B, L]) can touch: B x L,
    at most the table's rows (what a device cache must hold for such a batch)."""
    return min(math.prod(ids_shape), self.num_rows)

  @property
  def table_bytes(self) -> int:
    return self.num_rows * self.row_bytes


@dataclasses.dataclass(frozen=True)
class MemoryReport:
  """What a backend will allocate for one table, computed before allocating."""

  device_bytes: int  # on EACH device of the mesh (the most any one device holds)
  host_bytes: int  # host memory in all
  placement: str  # human-readable, e.g. "device", "host + 200000-row device cache"
  disk_bytes: int = 0  # on local disk (offload's SSD level: its row files)


# ----------------------------------------------------------------------------- init


def init_rows(key: jax.Array, spec: TableSpec, start: int, stop: int) -> np.ndarray:
  """Initial values of rows [start, stop) of a table, float32[stop - start, D].

  Deterministic per INIT_CHUNK-row chunk (chunk c draws from fold_in(key, c)), so every
  backend, whatever it keeps where, starts from the same table, and a host-resident table of
  any size can be initialised a chunk at a time without materialising it on a device.
  """
  if not 0 <= start <= stop <= spec.num_rows:
    raise ValueError(f"rows [{start}, {stop}) out of range for {spec.num_rows} rows")
  out = np.empty((stop - start, spec.dim), np.float32)
  c0, c1 = start // INIT_CHUNK, -(-stop // INIT_CHUNK)
  for c in range(c0, c1):
    lo, hi = max(start, c * INIT_CHUNK), min(stop, (c + 1) * INIT_CHUNK)
    rows = _chunk_rows(hi - c * INIT_CHUNK)
    block = np.asarray(_init_chunk(key, c, _scale(spec), spec.dim, spec.initializer, rows))
    out[lo - start : hi - start] = block[lo - c * INIT_CHUNK : hi - c * INIT_CHUNK]
  return out


_shapes_only = False


@contextlib.contextmanager
def shapes_only():
  """Inside it, `init_table` gives zeros: for `jax.eval_shape` of an initial state, whose
  table values cannot be computed on the host from a traced key and change no shape (the
  trainer's `build(allocate=False)`)."""
  global _shapes_only
  old, _shapes_only = _shapes_only, True
  try:
    yield
  finally:
    _shapes_only = old


def init_table(key: jax.Array, spec: TableSpec) -> np.ndarray:
  """The whole initial table, float32[N, D] on the host (see `init_rows`); zeros inside
  `shapes_only()`."""
  if _shapes_only:
    return np.zeros((spec.num_rows, spec.dim), np.float32)
  return init_rows(key, spec, 0, spec.num_rows)


def _scale(spec: TableSpec) -> np.float32:
  """The initializer's scale in float32, as jax rounds it: the uniform bound 1 / sqrt(N), the
  normal's divisor sqrt(D)."""
  if spec.initializer == "normal":
    return np.float32(np.sqrt(spec.dim))
  return np.float32(1.0 / np.sqrt(spec.num_rows))


def _chunk_rows(needed: int) -> int:
  """Rows to draw of a chunk whose first `needed` rows are used: the next power of two (at
  least 256, at most INIT_CHUNK) where jax's threefry is partitionable (the default since jax
  0.5), whose draw of shape [n, D] is the first n rows of the [INIT_CHUNK, D] one (element
  (i, j)'s bits depend on its index only): a 6-row table draws 256 rows, not 65,536, the same
  values. The whole chunk otherwise."""
  if not jax.config.jax_threefry_partitionable:
    return INIT_CHUNK
  return min(INIT_CHUNK, max(256, 1 << (needed - 1).bit_length()))


# The scale is an argument, not a static one: a static row count would compile this once per
# table size (26 compiles at every dlrm_kaggle start); this compiles once per (dim,
# initializer, power-of-two rows).
@functools.partial(jax.jit, static_argnums=(3, 4, 5))
def _init_chunk(key, chunk, scale, dim, initializer, rows=INIT_CHUNK):
  k = jax.random.fold_in(key, chunk)
  shape = (rows, dim)
  if initializer == "uniform":
    return jax.random.uniform(k, shape, jnp.float32, -scale, scale)
  if initializer == "normal":
    return jax.random.normal(k, shape, jnp.float32) / scale
  return jnp.zeros(shape, jnp.float32)


def table_key(key: jax.Array, name: str) -> jax.Array:
  """A table's init key: depends on its name only, so a table starts from the same values
  whatever backend, group or position in the plan it has."""
  return jax.random.fold_in(key, zlib.crc32(name.encode()) & 0x7FFFFFFF)
