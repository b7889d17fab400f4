"""Evicted rows reused by `dynamic(...)` over `sharded` and over `tt`.

sharded resets a reused row inside the step where its storage holds it (row-wise: the owner
shard's local row; table-wise: the owner's offset; column-wise: each shard's column block), so
a stream that evicts and reuses rows every step trains exactly as over dense, optimizer state
included (rowwise Adagrad: a reused row's accumulator must start again). tt cannot reset one
row (its rows share core slices): with `reset=none` a reused row keeps what the evicted id
left, and with the default `reset=rows` it is refused naming `reset=none`."""

from __future__ import annotations

import contract_lib
import jax
import numpy as np
import pytest

from recgnn import planner
from recgnn.backends.dynamic import resets as dynamic_resets
from recgnn.embeddings import base

OPT = base.OptimizerSpec(name="rowwise_adagrad", learning_rate=0.1, initial_accumulator=0.1)
CAPACITY = 16
DENSE = f"dynamic(capacity={CAPACITY}, evict=lru, inner='dense(fuse=False)')"


def _churn(batches=6, batch=16, bag=2, distinct=200):
  """Raw 62-bit ids, `distinct` values over `batches` x `batch` x `bag` slots (some PAD):
  far more than CAPACITY, so rows are evicted and reused every step."""
  rng = np.random.default_rng(7)
  keys = rng.integers(1 << 40, 1 << 62, size=distinct)
  out = []
  for _ in range(batches):
    x = keys[rng.integers(0, distinct, size=(batch, bag))]
    out.append(np.where(rng.random((batch, bag)) < 0.1, -1, x).astype(np.int64))
  return out


def _assert_same_run(got, ref, text):
  for step, (a, b) in enumerate(zip(got.lookups, ref.lookups, strict=True)):
    np.testing.assert_array_equal(a, b, err_msg=f"{text}: lookup differs at step {step}")
  np.testing.assert_array_equal(got.table, ref.table, err_msg=f"{text}: final table")


@pytest.mark.parametrize("mesh_shape", [(1, 1), (2, 4)])
def test_sharded_row_wise_under_evictions_equals_dense(mesh_shape):
  """Every step's lookups and the final table of a churning stream equal dense's, bit for
  bit (the same sparse arithmetic on the same rows; XLA:CPU)."""
  mesh = contract_lib.mesh_or_skip(*mesh_shape)
  raw = _churn()
  spec = base.TableSpec(name="t", num_rows=CAPACITY, dim=8, optimizer=OPT)
  text = f"dynamic(capacity={CAPACITY}, evict=lru, inner='sharded(kind=row)')"
  ref = contract_lib.run(DENSE, spec, raw, mesh=mesh)
  got = contract_lib.run(text, spec, raw, mesh=mesh)
  tol = contract_lib.updated_tolerance()
  if tol:  # (an accelerator's scatter-add order: contract_lib.UPDATED_TOL_ACCELERATOR)
    for a, b in zip(got.lookups + [got.table], ref.lookups + [ref.table], strict=True):
      np.testing.assert_allclose(a, b, **tol)
  else:
    _assert_same_run(got, ref, text)
  counters = got.backend.maps["t"].counters()
  assert counters["evicted"] >= 4 * len(raw), counters  # (reused throughout, not once)


def test_sharded_update_with_resets_is_sparse():
  """An update that resets 256 rows of a full 16384-row table on 2x4 allocates no
  table-sized scratch (the reset is a scatter of the R rows, O(R * D))."""
  mesh = contract_lib.mesh_or_skip(2, 4)
  capacity = 1 << 14
  spec = base.TableSpec(name="t", num_rows=capacity, dim=16, optimizer=OPT)
  text = f"dynamic(capacity={capacity}, evict=lru, inner='sharded(kind=row)')"
  group = planner.make_backend(text, spec, mesh)
  state = group.init(jax.random.key(0))
  group.prepare({"t": (np.arange(capacity, dtype=np.int64) + (1 << 40)).reshape(-1, 16)})
  host = group.prepare({"t": (np.arange(256, dtype=np.int64) + (1 << 45)).reshape(256, 1)})
  assert (host["reset"]["t"]["slots"] < capacity).sum() == 256
  prepared = contract_lib.put_prepared(group, host, mesh)
  grads = {"t": np.ones((256, 16), np.float32)}
  temp = contract_lib.update_temp_bytes(group, state, prepared, grads)
  assert temp < capacity * 16 * 4 / 8, f"{temp} scratch bytes: something table-sized"


# (row-wise: the churning stream above, on 1x1 and 2x4)
@pytest.mark.parametrize("kind", ["table", "column"])
def test_sharded_reset_rows_sets_what_dense_sets(kind):
  """reset_rows after an update (the optimizer slots off their initial value) on three
  tables over MODEL = 2 (table-wise: two tables share one shard, the second at an offset):
  the same tables and slots as dense's, rows past the table (a's row 40 would be c's row 0
  on their shard) and the padding slot dropped."""
  mesh = contract_lib.mesh_or_skip(4, 2)
  names = ("a", "b", "c")
  specs = [base.TableSpec(name=n, num_rows=40, dim=8, optimizer=OPT) for n in names]
  rng = np.random.default_rng(0)
  pad = dynamic_resets.RESET_PAD
  resets = {
    n: {"slots": np.array(slots, np.int32), "rows": rng.normal(size=(6, 8)).astype(np.float32)}
    for n, slots in (("a", [3, 39, 0, 21, 40, pad]), ("c", [3, 39, 5, 21, 40, pad]))
  }
  out = []
  for text in (f"sharded(kind={kind})", "dense(fuse=False)"):
    group = planner.make_group(text, specs, mesh)
    ids = {n: np.arange(16).reshape(16, 1) + 20 for n in names}
    prepared = contract_lib.put_prepared(group, group.prepare(ids), mesh)
    state = group.init(jax.random.key(0))
    _, residuals = jax.jit(group.lookup)(state, prepared)
    grads = {n: np.ones((16, 8), np.float32) for n in names}
    state = jax.jit(group.update)(state, prepared, residuals, grads)
    state = jax.jit(group.reset_rows)(state, resets)
    out.append((group.tables(state), jax.device_get(group.export(state))))
  (got, got_logical), (ref, ref_logical) = out
  for n in names:
    np.testing.assert_array_equal(got[n], ref[n], err_msg=f"table {n}")
    np.testing.assert_array_equal(got_logical[n]["accum"][:40], ref_logical[n]["accum"][:40])
  np.testing.assert_array_equal(got["a"][[3, 39, 0, 21]], resets["a"]["rows"][:4])
  assert (got_logical["c"]["accum"][[3, 39, 5, 21]] == OPT.initial_accumulator).all()
  assert (got_logical["b"]["accum"][20:36] > OPT.initial_accumulator).all()  # (not reset)


def test_tt_reuses_rows_as_they_are_with_reset_none():
  """tt with evict=lru, reset=none: the same map decisions as over dense, nothing reset (a
  reused row reads the cores' reconstruction as the evicted id left it, not a fresh draw),
  and the cores train."""
  rng = np.random.default_rng(3)
  raw = [(rng.integers(0, 120, size=(16, 1)) + (1 << 50)).astype(np.int64) for _ in range(5)]
  spec = base.TableSpec(name="t", num_rows=CAPACITY, dim=8, optimizer=OPT)
  dense_resets = []
  text = f"dynamic(capacity={CAPACITY}, evict=lru, reset=none, inner='tt(rank=4)')"

  def record(step, state):
    del state
    rows = step.prepared["inner"]["t"]["rows"]["ids"].reshape(-1)
    dense_resets.append((rows, step.prepared["reset"]["t"]))

  reused = []

  def check(step, state):
    assert step.prepared["reset"]["t"]["slots"].shape == (0,)  # (no reset list at all)
    rows, reset = dense_resets[step.step]
    table = tt_group.tables(state)["t"]
    for slot, fresh in zip(reset["slots"], reset["rows"], strict=True):
      if slot < CAPACITY:
        where = np.flatnonzero(rows == slot)
        want = np.broadcast_to(table[slot], (where.size, 8))
        np.testing.assert_allclose(step.pooled[where], want, rtol=1e-5, atol=1e-6)
        assert not np.allclose(step.pooled[where[0]], fresh)
        reused.append(slot)

  ref = contract_lib.run(DENSE, spec, raw, check=record)
  tt_group = planner.make_backend(text, spec, planner.default_mesh())
  start = tt_group.tables(tt_group.init(jax.random.key(0)))["t"]
  got = contract_lib.run(text, spec, raw, group=tt_group, check=check)
  assert len(reused) > 10
  np.testing.assert_array_equal(got.backend.rows_of("t"), ref.backend.rows_of("t"))
  # ("rejected" apart: it also counts the look-ahead's read-only maps, which tt asks for)
  mine, dense = (x.backend.maps["t"].counters() for x in (got, ref))
  assert {k: v for k, v in mine.items() if k != "rejected"} == {
    k: v for k, v in dense.items() if k != "rejected"
  }
  assert dense["evicted"] > 10
  assert np.abs(got.table - start).max() > 1e-3  # (the cores trained)


def test_tt_with_reset_rows_is_refused_naming_reset_none():
  spec = base.TableSpec(name="t", num_rows=64, dim=8, optimizer=OPT)
  with pytest.raises(ValueError, match=r"core slices shared.*reset=none"):
    planner.make_backend("dynamic(capacity=64, evict=lru, inner='tt(rank=4)')", spec)
  planner.make_backend("dynamic(capacity=64, evict=none, inner='tt(rank=4)')", spec)
  with pytest.raises(ValueError, match="reset must be one of rows, none; got 'fresh'"):
    planner.make_backend("dynamic(capacity=64, reset=fresh)", spec)


def test_reset_policy_is_in_the_checkpoint_format():
  """A resume with another reset policy is refused (the trainer compares the formats:
  tests/test_dynamic_resume.py); under evict=none it changes nothing, so it is left out."""
  spec = base.TableSpec(name="t", num_rows=64, dim=8, optimizer=OPT)

  def fmt(options):
    return planner.make_backend(f"dynamic(capacity=64, {options})", spec).logical_format("t")

  assert (
    fmt("evict=lru, reset=none") == "dynamic(capacity=64, admit=always, evict=lru, reset=none)+rows"
  )
  assert fmt("evict=lru") == "dynamic(capacity=64, admit=always, evict=lru)+rows"
  assert fmt("evict=none, reset=none") == fmt("evict=none")
