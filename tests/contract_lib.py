"""The backend contract as reusable checks: every backend runs these against `dense`.

Used by tests/test_contract.py (a new backend adds its plan string there), test_offload.py and
test_tt.py. The checks drive a backend exactly as the trainer does (the trainer's own
prepare driver, `recgnn.train.inputs`: look-ahead window and run-ahead; jitted lookup and
update with the state donated, on a mesh; sync at the end) and compare with the reference.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from recgnn import planner, sharding
from recgnn.embeddings import base, host_tier
from recgnn.train import inputs

PREFETCH = base.PREFETCH

# Backends that apply the same sparse updates agree bit for bit on XLA:CPU, whose scatter-add
# sums a row's duplicate ids in index order. XLA:GPU's sums them with atomics (or, under
# --xla_gpu_deterministic_ops, a sort-based scatter whose association follows the buffer's
# indices), so backends that scatter into different buffers (dense: the table; offload: its
# cache slots; hot_cold: hot shard and host rows) round differently once a row has been
# updated. Bound: a row touched k times per step sums k float32 terms; reordering changes the
# sum by at most (k - 1) * 2^-24 * sum|terms|: for the contract's Zipf batches (k <= ~25,
# terms O(1), lr 0.1, 6 steps) under ~4e-5 on the hottest row, ~1e-6 typically. A backend
# that serves a stale row or drops an update is off by lr * |g| ~ 0.1: still caught.
UPDATED_TOL_ACCELERATOR = {"rtol": 1e-5, "atol": 2e-5}


def updated_tolerance() -> dict:
  """Tolerance for results after an update: exact ({}) on CPU, UPDATED_TOL_ACCELERATOR on
  a GPU / TPU (see above). Lookups before any update stay exact everywhere."""
  return {} if jax.default_backend() == "cpu" else dict(UPDATED_TOL_ACCELERATOR)


def mesh_or_skip(data: int, model: int):
  """sharding.make_mesh(data, model), or skip the test where the platform has fewer devices
  (one GPU: the 8x1 and 2x4 meshes; on CPU tests/conftest.py simulates 8)."""
  need, have = data * model, jax.device_count()
  if need > have:
    pytest.skip(
      f"mesh {data}x{model} needs {need} devices; {have} {jax.default_backend()} device(s) here"
    )
  return sharding.make_mesh(data, model)


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
  # What `rng.choice(num_rows, size, p=p)` draws (numpy's own steps: the cdf, then uniforms
  # searched in it), the same ids from the same generator, with the cdf and the checks of p
  # done once, not per batch: O(num_rows) per call was most of a test's time at 100k+ rows
  # (26 tables x 350 batches: ~60 s; now ~1 s). tests/test_offload_tiers.py checks the two agree.
  cdf = p.cumsum()
  cdf /= cdf[-1]
  out = []
  for _ in range(num_batches):
    ids = perm[cdf.searchsorted(rng.random((batch, bag)), side="right")].astype(np.int32)
    if bag > 1 and pad_fraction > 0:
      # Pad a suffix of each bag (multi-hot bags have variable length); keep slot 0.
      lengths = rng.integers(1, bag + 1, size=batch)
      lengths = np.where(rng.random(batch) < pad_fraction, lengths, bag)
      ids[np.arange(bag)[None, :] >= lengths[:, None]] = base.PAD
    out.append(ids)
  return out


@dataclasses.dataclass
class Trace:
  """What a backend produced over a run: each step's pooled lookups, and the final table."""

  lookups: list[np.ndarray]  # f32[B, D] per step
  table: np.ndarray
  backend: base.Backend
  state: object


@functools.lru_cache(maxsize=64)
def _target(step: int, shape: tuple[int, ...]) -> np.ndarray:
  return np.random.default_rng(1000 + step).standard_normal(shape, dtype=np.float32)


def planned_only(group: base.Backend, prepared) -> None:
  """For tests that only plan (prepare a stream, never run its steps): hand a host tier
  (`Capabilities.writes_host`: offload, hot_cold) what the step of this train batch would
  return, zeros of its shapes (`planned_to_host`), so later prepares find every write-back
  they wait for. The host tables' values are then meaningless."""
  if group.capabilities.writes_host:
    group.after_update(None, group.planned_to_host(prepared))


def grads_for(step: int, pooled: jax.Array) -> jax.Array:
  """d/d pooled of sum(pooled * T_step) + 0.5 * sum(pooled**2): depends on the values, so
  a backend that serves a stale row produces a different gradient and fails the check.

  T_step comes from numpy, not jax.random: jax.random.normal computed on a batch split over
  8 devices differs by an ulp from the same call on one device (XLA:CPU from jax 0.12 takes
  another code path for erf_inv on the smaller shards), which made every 8-device run
  "differ" from single-device dense through the reference gradient, not the backend."""
  return pooled + _target(step, tuple(pooled.shape))


def put_prepared(group: base.Backend, prepared, mesh):
  """Place a group's prepared pytree as its `prepared_spec` says (batch-major leaves split
  over the mesh), as the trainer's packed transfer does."""
  specs = group.prepared_spec(prepared)
  return jax.tree.map(
    lambda x, s: jax.device_put(x, sharding.named(mesh, s)),
    prepared,
    specs,
    is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec),
  )


@dataclasses.dataclass
class Step:
  """One item of a run, as the hooks of `run` see it."""

  kind: str  # "train" | "eval"
  step: int  # train steps done before this item (an eval item's is the next train step's)
  ids: np.ndarray  # int[B, L] of the table
  prepared: object  # the group's prepared pytree, numpy, as `prepare` returned it
  pooled: np.ndarray  # f32[B, D], this item's lookup


def run(
  backend_text: str,
  spec: base.TableSpec,
  batches: Sequence[np.ndarray],
  key: jax.Array | None = None,
  mesh=None,
  prefetch: int = PREFETCH,
  evals: dict[int, np.ndarray] | None = None,
  *,
  group: base.Backend | None = None,
  state=None,
  start: int = 0,
  stop: int | None = None,
  check: Callable[[Step, object], None] | None = None,
  after: Callable[[Step, object], object] | None = None,
) -> Trace:
  """Train one table for len(batches) steps the way the trainer does: every `prepare` in
  stream order through the trainer's own driver (inputs.prepare_stream + run_ahead: the
  input thread `prefetch` batches ahead, prepare(k + prefetch) before update(k)).

  evals: {step: ids} eval batches (lookup only) inserted before train step `step`; their
  pooled lookups are returned in `Trace.lookups` in stream order too.
  group, state: drive this backend (made by `planner.make_backend(backend_text, spec, mesh)`)
    from this state (e.g. restored from a checkpoint) instead of a fresh one from `key`.
  start, stop: run train steps [start, stop) of `batches` (a fresh input pipeline started at
    `start`; batches prepared beyond `stop` are dropped, as when the trainer stops). The
    final sync still runs.
  check(step, state): after each item's lookup, before its update (state as the lookup saw
    it; a check must not donate it).
  after(step, state) -> new state or None: after each item (its update done); may sync
    (return the synced state), checkpoint, or prepare extra batches.
  """
  stop = len(batches) if stop is None else stop
  if group is None:
    mesh = planner.default_mesh() if mesh is None else mesh
    group = planner.make_backend(backend_text, spec, mesh)
  mesh = group.mesh
  plan = planner.Plan({group.name: group}, {spec.name: group.name}, mesh)
  if state is None:
    state = group.init(jax.random.key(0) if key is None else key)
  lookup = jax.jit(group.lookup)
  update = jax.jit(group.update, donate_argnums=0)
  grads = jax.jit(grads_for, static_argnums=0)
  evals = evals or {}
  stream = []
  for step in range(start, len(batches)):
    if step in evals:
      stream.append(("eval", "valid", {"ids": {spec.name: evals[step]}}))
    stream.append(("train", None, {"ids": {spec.name: batches[step]}}))
  lookups = []
  step = start
  for item in inputs.run_ahead(inputs.prepare_stream(plan, stream), prefetch):
    if step >= stop:
      break  # the run-ahead has prepared batches beyond `stop`: dropped
    host = item.prepared[group.name]
    prepared = put_prepared(group, host, mesh)
    pooled, residuals = lookup(state, prepared)
    info = Step(item.kind, step, item.batch["ids"][spec.name], host, np.asarray(pooled[spec.name]))
    lookups.append(info.pooled)
    if check is not None:
      check(info, state)
    if item.kind == "train":
      state = update(state, prepared, residuals, {spec.name: grads(step, pooled[spec.name])})
      state = group.after_update(state)  # (a host tier's rows to its writer)
      step += 1
    if after is not None:
      new = after(info, state)
      state = state if new is None else new
  state = group.sync(state)
  return Trace(lookups, group.tables(state)[spec.name], group, state)


def pooled_reference(table: np.ndarray, ids: np.ndarray, pooling: str = "sum") -> np.ndarray:
  """numpy pooling of a table's rows: ids int[B, L] (PAD = -1) -> f64[B, D]."""
  rows = np.where((ids >= 0)[..., None], table[np.maximum(ids, 0)].astype(np.float64), 0.0)
  out = rows.sum(axis=1)
  if pooling == "mean":
    out /= np.maximum((ids >= 0).sum(axis=1), 1)[:, None]
  return out


def lookups_match_own_tables(result, bags: dict[str, int], batch: int = 16) -> int:
  """Every group of a trained run (`loop.train`'s result): its lookup of fresh bags (`bags`:
  each table's size; a random tail of each bag padded, empty bags among them) equals numpy's
  pooling (the table's own: sum or mean) of the group's own tables (`group.tables`: rows;
  TT's reconstruction from its cores). Returns how many tables were checked."""
  rng = np.random.default_rng(7)
  mesh = result.plan.mesh
  checked = 0
  for key, group in result.plan.groups.items():
    state = result.state.emb[key]
    ids = {}
    for t, spec in group.specs.items():
      x = rng.integers(0, spec.num_rows, (batch, bags[t]), dtype=np.int32)
      kept = rng.integers(0, bags[t] + 1, (batch, 1))  # ids kept at the front of each bag
      ids[t] = np.where(np.arange(bags[t]) < kept, x, -1).astype(np.int32)
    prepared = put_prepared(group, group.prepare(ids, [], train=False), mesh)
    pooled, _ = jax.jit(group.lookup)(state, prepared)
    tables = group.tables(state)
    for t, spec in group.specs.items():
      want = pooled_reference(np.asarray(tables[t]), ids[t], spec.pooling)
      np.testing.assert_allclose(np.asarray(pooled[t]), want, rtol=1e-5, atol=1e-5, err_msg=t)
      checked += 1
  return checked


def assert_lookups_equal_table(pooled: np.ndarray, table: np.ndarray, ids: np.ndarray, **tol):
  """pooled[b] == sum of table[ids[b, l]] over the bag's non-padded slots."""
  np.testing.assert_allclose(pooled, pooled_reference(table, ids), **tol)


def assert_matches_dense(
  backend_text: str,
  spec: base.TableSpec,
  batches: Sequence[np.ndarray],
  *,
  atol: float = 0.0,
  rtol: float = 0.0,
  mesh=None,
  updated_tol: dict | None = None,
  ref: Trace | None = None,
) -> Trace:
  """The backend's pooled lookups at every step and its final table equal single-device
  `dense`'s. atol = rtol = 0 demands bit-identical results (offload, hot_cold, sharded
  without codec). After the first update the looser of (atol, rtol) and `updated_tol`
  applies (default `updated_tolerance()`: nothing on CPU; the summation-order bound on an
  accelerator); the first step's lookups, made before any update, keep (atol, rtol).
  ref: the reference, `run("dense", spec, batches)`, where the caller has it already (tests
  that compare many backends with one reference run it once); None runs it here."""
  ref = run("dense", spec, batches) if ref is None else ref
  got = run(backend_text, spec, batches, mesh=mesh)
  upd = updated_tolerance() if updated_tol is None else updated_tol
  later = {"atol": max(atol, upd.get("atol", 0.0)), "rtol": max(rtol, upd.get("rtol", 0.0))}
  for step, (a, b) in enumerate(zip(got.lookups, ref.lookups)):
    tol = {"atol": atol, "rtol": rtol} if step == 0 else later
    np.testing.assert_allclose(
      a, b, **tol, err_msg=f"{backend_text}: lookup differs at step {step} (tolerance {tol})"
    )
  np.testing.assert_allclose(
    got.table, ref.table, **later, err_msg=f"{backend_text}: final table differs ({later})"
  )
  return got


def update_temp_bytes(group: base.Backend, state, prepared, grads) -> int:
  """Scratch memory XLA allocates for one update (from the compiled executable), given the
  residuals of this batch's lookup (their shapes: `jax.eval_shape`)."""
  residuals = jax.eval_shape(group.lookup, state, prepared)[1]
  update = jax.jit(group.update, donate_argnums=0)
  compiled = update.lower(state, prepared, residuals, grads).compile()
  analysis = compiled.memory_analysis()
  return int(analysis.temp_size_in_bytes)


def assert_update_is_sparse(backend_text: str, spec: base.TableSpec, batch: np.ndarray) -> int:
  """An update's scratch memory must not scale with the table: it is compared against a
  table-sized buffer (a dense gradient would need num_rows * dim * 4 bytes)."""
  group = planner.make_backend(backend_text, spec)
  state = group.init(jax.random.key(0))
  prepared = group.prepare({spec.name: batch}, [])
  grads = {spec.name: jnp.ones((batch.shape[0], spec.dim), jnp.float32)}
  temp = update_temp_bytes(group, state, prepared, grads)
  table_bytes = spec.num_rows * spec.dim * 4
  assert temp < table_bytes / 4, (
    f"{backend_text}: update needs {temp} scratch bytes for a {table_bytes}-byte table: "
    "it materialises something table-sized"
  )
  return temp


def lowered_step(backend_text: str, spec: base.TableSpec, ids: np.ndarray, mesh=None):
  """`jax.jit(lookup + update).lower(...)` of one table's first train step on `ids` (the
  gradient is the pooled lookup itself), for tests that read the step's HLO. -> (backend,
  lowered)."""
  group = planner.make_backend(backend_text, spec, planner.default_mesh() if mesh is None else mesh)
  state = group.init(jax.random.key(0))
  prepared = jax.device_put(group.prepare({spec.name: ids}, [{spec.name: ids}], train=True))

  def step(state, prepared):
    pooled, res = group.lookup(state, prepared)
    return group.update(state, prepared, res, {spec.name: pooled[spec.name]})

  return group, jax.jit(step).lower(state, prepared)


def host_tier_io(lowered) -> tuple[int, int]:
  """(bytes to the device, to the host) a `lowered_step`'s host tier moves besides the step:
  the rows its prepare read for the batch (the lists' "*_rows" leaves) and the rows its
  update returns for the host writer (TO_HOST). (0, 0) for other backends."""

  def nbytes(tree):
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))

  (state, prepared), _ = lowered.args_info
  lists = prepared.get("lists", ()) if isinstance(prepared, dict) else ()
  into = sum(nbytes(v) for x in lists for k, v in x.items() if k.endswith("_rows"))
  out = lowered.out_info
  back = nbytes(out.get(base.TO_HOST, ())) if isinstance(out, dict) else 0
  return into, back


def break_ring_sources(monkeypatch) -> None:
  """Mutation for the host tiers' ordering tests: the ring of recent write-backs serves no
  load (`host_tier.Recent.sources` says ABSENT for every row), so a load of a row written
  back by a step not yet run is a host read that must wait for that write-back; with one
  thread nobody runs the step, so the wait ends (WAIT_SECONDS, 0.5 s here) in a refusal."""
  real = host_tier.Recent.sources

  def host_only(self, rows):
    src, need = real(self, rows)
    steps = self.last_step[rows]
    return np.full_like(src, host_tier.ABSENT), max(need, int(steps.max(initial=-1)) + 1)

  monkeypatch.setattr(host_tier.Recent, "sources", host_only)
  monkeypatch.setattr(host_tier, "WAIT_SECONDS", 0.5)
