"""The backend contract as reusable checks: every backend runs these against `dense`.

Used by tests/test_contract.py; a new backend adds its plan string there. The checks drive a
backend exactly as the trainer does (prepare in order with a look-ahead window, jitted lookup,
jitted update with the state donated, sync at the end) and compare with the reference.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from recgnn.embeddings import base

PREFETCH = base.PREFETCH


def zipf_ids(
  seed: int,
  num_batches: int,
  batch: int,
  bag: int,
  num_rows: int,
  exponent: float = 1.05,
  pad_fraction: float = 0.2,
) -> list[np.ndarray]:
  """Batches of ids int32[batch, bag] with Zipf popularity and PAD in some slots.

  Row r is drawn with probability ~ 1 / (rank(r) + 1)**exponent under a fixed random
  permutation, so hot rows are scattered over the table (as hashed categoricals are).
  """
  rng = np.random.default_rng(seed)
  p = 1.0 / np.arange(1, num_rows + 1) ** exponent
  p /= p.sum()
  perm = rng.permutation(num_rows)
  out = []
  for _ in range(num_batches):
    ids = perm[rng.choice(num_rows, size=(batch, bag), p=p)].astype(np.int32)
    if bag > 1 and pad_fraction > 0:
      # Pad a suffix of each bag (multi-hot bags have variable length); keep slot 0.
      lengths = rng.integers(1, bag + 1, size=batch)
      lengths = np.where(rng.random(batch) < pad_fraction, lengths, bag)
      ids[np.arange(bag)[None, :] >= lengths[:, None]] = base.PAD
    out.append(ids)
  return out


@dataclasses.dataclass
class Trace:
  """What a backend produced over a run: each step's lookups, and the final table."""

  lookups: list[np.ndarray]
  table: np.ndarray
  backend: base.Backend
  state: object


def grads_for(step: int, rows: jax.Array) -> jax.Array:
  """d/d rows of sum(rows * T_step) + 0.5 * sum(rows**2): depends on the rows' values, so
  a backend that serves a stale row produces a different gradient and fails the check."""
  t = jax.random.normal(jax.random.key(1000 + step), rows.shape, jnp.float32)
  return t + rows


def run(
  backend_text: str,
  spec: base.TableSpec,
  batches: Sequence[np.ndarray],
  key: jax.Array | None = None,
  mesh=None,
  prefetch: int = PREFETCH,
) -> Trace:
  """Train one table for len(batches) steps the way the trainer does, including the input
  thread running `prefetch` batches ahead (prepare of batch k + prefetch before update k)."""
  backend = base.make_backend(backend_text, spec)
  key = jax.random.key(0) if key is None else key
  state = backend.init(key, mesh)
  lookup = jax.jit(backend.lookup)
  update = jax.jit(backend.update, donate_argnums=0)
  grads = jax.jit(grads_for, static_argnums=0)
  lookups = []
  # The trainer's input thread prepares up to PREFETCH batches ahead of the step, so
  # prepare(k + PREFETCH) may run before update(k): replay exactly that interleaving.
  queue = collections.deque()
  ahead = 0
  for step in range(len(batches)):
    while ahead < len(batches) and ahead <= step + prefetch:
      upcoming = list(batches[ahead + 1 : ahead + 1 + backend.lookahead])
      queue.append(backend.prepare(batches[ahead], upcoming))
      ahead += 1
    prepared = queue.popleft()
    rows = lookup(state, prepared)
    lookups.append(np.asarray(rows))
    state = update(state, prepared, grads(step, rows))
  state = backend.sync(state)
  return Trace(lookups, backend.table(state), backend, state)


def assert_padding_is_zero(trace: Trace, batches: Sequence[np.ndarray]) -> None:
  """Padded bag slots must look up as zero rows (so pooling can ignore them)."""
  for ids, rows in zip(batches, trace.lookups):
    pad = ids < 0
    if pad.any():
      np.testing.assert_array_equal(rows[pad], 0.0)


def assert_lookups_equal_table(trace_rows: np.ndarray, table: np.ndarray, ids: np.ndarray, **tol):
  """rows[b, l] == table[ids[b, l]] for every non-padded slot."""
  valid = ids >= 0
  np.testing.assert_allclose(trace_rows[valid], table[ids[valid]], **tol)


def assert_matches_dense(
  backend_text: str,
  spec: base.TableSpec,
  batches: Sequence[np.ndarray],
  *,
  atol: float = 0.0,
  rtol: float = 0.0,
  mesh=None,
) -> Trace:
  """The backend's lookups at every step and its final table equal the dense backend's.

  atol = rtol = 0 demands bit-identical results (offload, hot_cold, sharded without codec).
  """
  ref = run("dense", spec, batches)
  got = run(backend_text, spec, batches, mesh=mesh)
  for step, (a, b) in enumerate(zip(got.lookups, ref.lookups)):
    np.testing.assert_allclose(
      a, b, atol=atol, rtol=rtol, err_msg=f"{backend_text}: lookup differs at step {step}"
    )
  np.testing.assert_allclose(
    got.table, ref.table, atol=atol, rtol=rtol, err_msg=f"{backend_text}: final table differs"
  )
  assert_padding_is_zero(got, batches)
  return got


def update_temp_bytes(backend: base.Backend, state, prepared, grads) -> int:
  """Scratch memory XLA allocates for one update (from the compiled executable)."""
  compiled = jax.jit(backend.update, donate_argnums=0).lower(state, prepared, grads).compile()
  analysis = compiled.memory_analysis()
  return int(analysis.temp_size_in_bytes)


def assert_update_is_sparse(backend_text: str, spec: base.TableSpec, batch: np.ndarray) -> int:
  """An update's scratch memory must not scale with the table: it is compared against a
  table-sized buffer (a dense gradient would need num_rows * dim * 4 bytes)."""
  backend = base.make_backend(backend_text, spec)
  state = backend.init(jax.random.key(0))
  prepared = backend.prepare(batch, [])
  grads = jnp.ones(batch.shape + (spec.dim,), jnp.float32)
  temp = update_temp_bytes(backend, state, prepared, grads)
  table_bytes = spec.num_rows * spec.dim * 4
  assert temp < table_bytes / 4, (
    f"{backend_text}: update needs {temp} scratch bytes for a {table_bytes}-byte table: "
    "it materialises something table-sized"
  )
  return temp
