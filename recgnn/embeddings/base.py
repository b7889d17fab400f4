"""Embedding tables: specs, row-wise optimizers, the backend contract and the per-table plan.

An embedding table is not a Flax param. Autodiff through a gather builds a table-sized
cotangent (a 10M x 16 table costs ~90x more per step that way, DESIGN.md), so every backend
owns its table's state and applies a sparse row-wise optimizer to the rows a batch touched.

The contract, for one table (`Backend`):

  prepare(ids, upcoming)       host, off the step's path: int[B, L] ids (-1 = padding) ->
                               a pytree of numpy arrays (dedup, slot remapping, prefetch plans)
  lookup(state, prepared)      jit-able: -> float32[B, L, D]; padded positions are 0
  update(state, prepared, g)   jit-able: g = d loss / d lookup, float32[B, L, D] -> new state;
                               sparse (cost O(B * L * D), never O(rows)), state donated
  sync(state)                  write caches back; afterwards `state` alone describes the table.
                               Batches already prepared (the input thread runs up to
                               PREFETCH batches ahead of the step) must stay valid
  state_sharding(mesh)         shardings of `state` for jit and checkpoints (None: default)
  memory()                     bytes on device / host, known before anything is allocated
  table(state)                 the logical float32[N, D] table (tests, export; O(N), never
                               called by the trainer)

Backends are chosen per table by a plan: regex rules over table names, first match wins:
  [("C(3|4|10)", "tt(rank=32)"), (".*", "dense")]
The backend string's name is the module name in `recgnn.embeddings`, so adding a backend is
one new file exporting `BACKEND = TheClass`.
"""

from __future__ import annotations

import abc
import ast
import dataclasses
import functools
import importlib
import pkgutil
import re
from collections.abc import Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

PyTree = Any
PAD = -1  # id value that marks an empty slot of a multi-hot bag
# Batches the trainer's input thread prepares ahead of the step: prepare(k + PREFETCH) may run
# before update(k), and backends must give the same results under that interleaving.
PREFETCH = 2
INIT_CHUNK = 1 << 16  # rows per deterministic init chunk (see `init_rows`)

OPTIMIZERS = ("sgd", "rowwise_adagrad")
INITIALIZERS = ("uniform", "normal", "zeros")
POOLINGS = ("sum", "mean")
_NOT_BACKENDS = frozenset({"base", "codecs", "testing", "plan"})


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
    self, rows: jax.Array, slots: dict[str, jax.Array], grads: jax.Array
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """One optimizer step on gathered rows.

    Args:
      rows: float32[U, D], the current values of U distinct rows (for sgd U may repeat).
      slots: per-row optimizer state, each float32[U].
      grads: float32[U, D], the summed gradient of each row.
    Returns:
      (new rows float32[U, D], new slots).
    """
    lr = self.learning_rate
    if self.name == "sgd":
      return rows - lr * grads, slots
    accum = slots["accum"] + jnp.mean(grads * grads, axis=-1)
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
  """

  name: str
  num_rows: int
  dim: int
  optimizer: OptimizerSpec = OptimizerSpec()
  initializer: str = "uniform"
  pooling: str = "sum"

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

  @property
  def table_bytes(self) -> int:
    return self.num_rows * self.row_bytes


@dataclasses.dataclass(frozen=True)
class MemoryReport:
  """What a backend will allocate for one table, computed before allocating."""

  device_bytes: int
  host_bytes: int
  placement: str  # human-readable, e.g. "device", "host + 200000-row device cache"


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
    block = np.asarray(_init_chunk(key, c, spec.dim, spec.num_rows, spec.initializer))
    lo, hi = max(start, c * INIT_CHUNK), min(stop, (c + 1) * INIT_CHUNK)
    out[lo - start : hi - start] = block[lo - c * INIT_CHUNK : hi - c * INIT_CHUNK]
  return out


def init_table(key: jax.Array, spec: TableSpec) -> np.ndarray:
  """The whole initial table, float32[N, D] on the host (see `init_rows`)."""
  return init_rows(key, spec, 0, spec.num_rows)


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _init_chunk(key, chunk, dim, num_rows, initializer):
  k = jax.random.fold_in(key, chunk)
  shape = (INIT_CHUNK, dim)
  if initializer == "uniform":
    bound = 1.0 / np.sqrt(num_rows)
    return jax.random.uniform(k, shape, jnp.float32, -bound, bound)
  if initializer == "normal":
    return jax.random.normal(k, shape, jnp.float32) / np.sqrt(dim)
  return jnp.zeros(shape, jnp.float32)


# ----------------------------------------------------------------------------- bags


def dedup(ids: np.ndarray, num_rows: int) -> tuple[np.ndarray, np.ndarray]:
  """Host-side dedup of a batch's ids, fixed-shape for jit.

  Args:
    ids: int[B, L], PAD for empty slots.
    num_rows: the table's rows; used as the out-of-range filler.
  Returns:
    unique: int32[B * L], the distinct ids then `num_rows` (dropped by scatters).
    inverse: int32[B, L], position of each id in `unique` (padding -> a filler slot).
  """
  flat = ids.reshape(-1)
  flat = np.where(flat < 0, num_rows, flat)
  uniq, inverse = np.unique(flat, return_inverse=True)
  unique = np.full(flat.shape[0], num_rows, np.int32)
  unique[: uniq.shape[0]] = uniq
  return unique, inverse.reshape(ids.shape).astype(np.int32)


def pool(rows: jax.Array, ids: jax.Array, mode: str) -> jax.Array:
  """Reduce bags: rows float32[B, L, D] (0 at padding), ids int[B, L] -> float32[B, D]."""
  summed = jnp.sum(rows, axis=1)
  if mode == "sum":
    return summed
  count = jnp.sum(ids >= 0, axis=1, keepdims=True).astype(rows.dtype)
  return summed / jnp.maximum(count, 1.0)


def segment_rows(grads: jax.Array, inverse: jax.Array, num_unique: int) -> jax.Array:
  """Sum grads float32[B, L, D] per distinct row: -> float32[num_unique, D]."""
  d = grads.shape[-1]
  return jax.ops.segment_sum(grads.reshape(-1, d), inverse.reshape(-1), num_segments=num_unique)


# ----------------------------------------------------------------------------- contract


class Backend(abc.ABC):
  """Storage and update rule of one embedding table. See the module docstring.

  Subclasses set `name`, accept their plan-string options as keyword arguments, and export
  themselves from their module as `BACKEND`.
  """

  name: ClassVar[str] = ""
  #: How many upcoming batches `prepare` wants to see (cDLRM's look-ahead window).
  lookahead: int = 0

  def __init__(self, spec: TableSpec, **options):
    if options:
      raise ValueError(
        f"Backend {self.name!r} (table {spec.name!r}) takes no options; got {sorted(options)}"
      )
    self.spec = spec

  def __repr__(self):
    return f"{type(self).__name__}({self.spec.name}, {self.describe()})"

  def describe(self) -> str:
    """The backend and its options, as a plan string."""
    return self.name

  @abc.abstractmethod
  def init(self, key: jax.Array, mesh: jax.sharding.Mesh | None = None) -> PyTree:
    """Allocate and initialise the state (placement decided here)."""

  def prepare(
    self, ids: np.ndarray, upcoming: Sequence[np.ndarray] = (), *, train: bool = True
  ) -> PyTree:
    """Host-side work for one batch: ids int[B, L] (PAD = -1) -> pytree of numpy arrays.

    `upcoming` holds the ids of up to `lookahead` following batches. Called once per batch,
    in order, on the input thread; stateful backends (caches) may keep host state here.
    `train=False` marks an eval batch: only `lookup` will run on it, never `update`.
    """
    del upcoming, train
    ids = np.asarray(ids)
    out = {"ids": np.where(ids < 0, self.spec.num_rows, ids).astype(np.int32)}
    if self.spec.optimizer.needs_unique:
      out["unique"], out["inverse"] = dedup(ids, self.spec.num_rows)
    return out

  @abc.abstractmethod
  def lookup(self, state: PyTree, prepared: PyTree) -> jax.Array:
    """-> float32[B, L, D]; rows of padded positions are 0. Jit-able."""

  @abc.abstractmethod
  def update(self, state: PyTree, prepared: PyTree, grads: jax.Array) -> PyTree:
    """Apply the optimizer to touched rows: grads float32[B, L, D]. Jit-able, sparse."""

  def sync(self, state: PyTree) -> PyTree:
    """Write caches back so that `state` alone describes the table. Host side."""
    return state

  def state_sharding(self, mesh: jax.sharding.Mesh | None) -> PyTree | None:
    """Shardings of the state (a pytree matching `init`'s), or None for the default."""
    del mesh
    return None

  def num_params(self) -> int:
    """Trainable floats of the table (rows x dim; fewer for compressed backends)."""
    return self.spec.num_rows * self.spec.dim

  @abc.abstractmethod
  def memory(self) -> MemoryReport:
    """Bytes this table will occupy, without allocating."""

  @abc.abstractmethod
  def table(self, state: PyTree) -> np.ndarray:
    """The logical table float32[N, D] (tests and export only; O(N))."""

  def restore(self, state: PyTree) -> PyTree:
    """Called with a state read from a checkpoint (after `sync` was applied before saving).

    Backends with host-side bookkeeping (cache maps) reset it here. Returns the state to use.
    """
    return state

  def stats(self) -> dict[str, float]:
    """Counters since the last call (hit rate, bytes moved, ...), logged with the metrics."""
    return {}


def sparse_sgd_or_adagrad(
  spec: TableSpec,
  table: jax.Array,
  slots: dict[str, jax.Array],
  prepared: PyTree,
  grads: jax.Array,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The row-wise update shared by backends that keep rows in an indexable array.

  Args:
    table: float32[R, D] (a full table or a cache; R rows).
    slots: per-row optimizer state, float32[R] each.
    prepared: {"ids": int32[B, L] in [0, R], R = padding} and, when the optimizer needs it,
      {"unique": int32[B*L], "inverse": int32[B, L]} (see `dedup`).
    grads: float32[B, L, D].
  Returns:
    the new (table, slots), touching only the batch's rows.
  """
  opt = spec.optimizer
  if not opt.needs_unique:
    # Scatter-add sums a row's duplicates, which is exactly SGD on the summed gradient.
    ids = prepared["ids"].reshape(-1)
    g = grads.reshape(-1, grads.shape[-1])
    return table.at[ids].add(-opt.learning_rate * g, mode="drop"), slots
  unique = prepared["unique"]
  g = segment_rows(grads, prepared["inverse"], unique.shape[0])
  rows = table.at[unique].get(mode="fill", fill_value=0.0)
  old = {k: v.at[unique].get(mode="fill", fill_value=0.0) for k, v in slots.items()}
  rows, new = opt.apply(rows, old, g)
  table = table.at[unique].set(rows, mode="drop")
  slots = {k: slots[k].at[unique].set(new[k], mode="drop") for k in slots}
  return table, slots


# ----------------------------------------------------------------------------- plan


_BACKEND_RE = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(?:\((.*)\))?\s*$", re.S)


def available_backends() -> list[str]:
  """Backend names: the modules of this package that export BACKEND."""
  import recgnn.embeddings as pkg

  return sorted(m.name for m in pkgutil.iter_modules(pkg.__path__) if m.name not in _NOT_BACKENDS)


def parse_backend(text: str) -> tuple[str, dict[str, Any]]:
  """'tt(rank=32, policy=lru)' -> ('tt', {'rank': 32, 'policy': 'lru'}).

  Option values are Python literals; bare words are strings. `_` separators allowed in ints.
  """
  m = _BACKEND_RE.match(text)
  if not m:
    raise ValueError(f"Cannot parse backend {text!r}; expected NAME or NAME(key=value, ...)")
  name, args = m.group(1), (m.group(2) or "").strip()
  options: dict[str, Any] = {}
  if args:
    try:
      call = ast.parse(f"f({args})", mode="eval").body
    except SyntaxError as e:
      raise ValueError(f"Cannot parse options of backend {text!r}: {e.msg}") from None
    if call.args:
      raise ValueError(f"Backend {text!r}: options must be key=value")
    for kw in call.keywords:
      v = kw.value
      options[kw.arg] = v.id if isinstance(v, ast.Name) else ast.literal_eval(v)
  return name, options


def make_backend(text: str, spec: TableSpec) -> Backend:
  """Instantiate the backend named by a plan string for one table."""
  name, options = parse_backend(text)
  names = available_backends()
  if name not in names:
    raise ValueError(f"Unknown backend {name!r}; available: {', '.join(names)}")
  module = importlib.import_module(f"recgnn.embeddings.{name}")
  try:
    return module.BACKEND(spec, **options)
  except TypeError as e:
    raise ValueError(f"Bad options for backend {text!r} (table {spec.name!r}): {e}") from None


def resolve_plan(
  rules: Sequence[tuple[str, str]], specs: Sequence[TableSpec], log: bool = True
) -> dict[str, Backend]:
  """Pick each table's backend: the first rule whose regex fully matches its name."""
  compiled = []
  for pattern, text in rules:
    try:
      compiled.append((re.compile(pattern), text))
    except re.error as e:
      raise ValueError(f"Bad plan regex {pattern!r}: {e}") from None
  backends = {}
  for spec in specs:
    for rx, text in compiled:
      if rx.fullmatch(spec.name):
        backends[spec.name] = make_backend(text, spec)
        break
    else:
      raise ValueError(
        f"No plan rule matches table {spec.name!r}; rules: {[p for p, _ in rules]}. "
        "End the plan with ('.*', 'dense') to give every table a default."
      )
  if log:
    logging.info("Embedding plan:\n%s", format_plan(backends))
  return backends


def format_plan(backends: dict[str, Backend]) -> str:
  """A table of each table's backend, size and placement."""
  lines = [f"{'table':<12} {'rows':>12} {'dim':>4} {'backend':<36} {'device':>10} {'host':>10}"]
  dev = host = 0
  for name, b in backends.items():
    m = b.memory()
    dev, host = dev + m.device_bytes, host + m.host_bytes
    lines.append(
      f"{name:<12} {b.spec.num_rows:>12,} {b.spec.dim:>4} {b.describe():<36} "
      f"{_mib(m.device_bytes):>10} {_mib(m.host_bytes):>10}"
    )
  lines.append(f"{'total':<12} {'':>12} {'':>4} {'':<36} {_mib(dev):>10} {_mib(host):>10}")
  params = sum(b.num_params() for b in backends.values())
  dense = sum(b.spec.num_rows * b.spec.dim for b in backends.values())
  if params:
    lines.append(
      f"embedding parameters: {params:,} ({dense / params:,.1f}x fewer than all-dense {dense:,})"
    )
  return "\n".join(lines)


def _mib(n: int) -> str:
  return f"{n / 2**20:,.1f}M"


class PlanDoesNotFit(ValueError):
  """The plan needs more device memory than the budget allows."""


def check_memory(backends: dict[str, Backend], device_budget_bytes: int | None) -> int:
  """Refuse, before allocating, a plan whose device bytes exceed the budget.

  Returns the plan's device bytes.
  """
  total = sum(b.memory().device_bytes for b in backends.values())
  if device_budget_bytes is not None and total > device_budget_bytes:
    worst = sorted(backends.values(), key=lambda b: -b.memory().device_bytes)[:5]
    raise PlanDoesNotFit(
      f"Embedding plan needs {_mib(total)} of device memory, budget is "
      f"{_mib(device_budget_bytes)}. Largest tables: "
      + ", ".join(f"{b.spec.name} {_mib(b.memory().device_bytes)} ({b.describe()})" for b in worst)
      + ". Move large tables to a host-memory backend in config.embeddings.plan, e.g. "
      "('C(3|4|10)', 'offload(cache_rows=100_000)') or 'tt(rank=32)'."
    )
  return total
