"""hot_cold's rows read ahead of the step (issue 42; was issue 24's next-batch prefetch): every
batch's cold rows are read from the host tables by its own prepare, on the input thread, up to
PREFETCH batches before its step runs; every cold row a step touches is written back by the
host writer after the step. A row cold in batch k and again in k + 1 (or leaving the hot set
at k's migration and cold in k + 1) is read for k + 1 before step k ran: the device ring of
recent write-backs supplies it (`host_tier.Recent`).

  - exact: bit-equal to dense on 1x1, 8x1 and 2x4 over Zipf streams whose consecutive
    batches share cold rows, with the trainer's run-ahead (base.PREFETCH = 2), with
    migrations (rows leaving the hot set, rows joining it after being cold in the same
    batch) and eval passes inside, and across a checkpoint resumed on another mesh;
  - the test can fail: a ring never written, rows leaving the hot set never written into it,
    or loads that ignore it break exactness or are refused.
The step itself (no host work, no table): tests/test_host_tier.py.
"""

import contract_lib as contract
import jax
import numpy as np
import pytest
from test_hot_cold import (
  ADAGRAD,
  SGD,
  SPLIT_BATCH,
  _assert_same,
  _batches,
  _run_group,
  _specs,
  dense_ref,
)
from test_hot_cold_tiers import restored

import recgnn.backends.hot_cold as hot_cold
from recgnn import planner, sharding
from recgnn.backends.hot_cold import HotColdOptions, host_side
from recgnn.embeddings import base, host_tier

TEXT = "hot_cold(budget=0.3, profile_batches=3, reprofile=5)"
MESHES = [(1, 1), (8, 1), (2, 4)]


def _mesh_id(m):
  return f"{m[0]}x{m[1]}"


def test_the_trainers_run_ahead_is_at_least_two():
  """The cases below need the input thread ahead of the step by 2 or more batches (the
  driver, `test_hot_cold._run_group`, runs `inputs.run_ahead(.., base.PREFETCH)`)."""
  assert base.PREFETCH >= 2 and hot_cold.RING_BATCHES == base.PREFETCH


# 2x4 in the default run; 1x1 and 8x1 under `-m long` (the suite's 10 minutes).
READ_AHEAD = [pytest.param(m, marks=() if m == (2, 4) else pytest.mark.long) for m in MESHES]


@pytest.mark.parametrize("mesh_shape", READ_AHEAD, ids=_mesh_id)
def test_read_ahead_matches_dense(mesh_shape):
  """14 batches (two tables, two row layouts), a pick and two re-picks, eval batches inside:
  bit-equal to single-device dense; loads came from the ring (rows an earlier step wrote
  back, read before that step ran), rows migrated, the popular micro-batch ran."""
  specs = _specs(SGD)
  batches = _batches(specs, n=14, batch=SPLIT_BATCH)
  mesh = contract.mesh_or_skip(*mesh_shape)
  ref = dense_ref(SGD, n=14, batch=SPLIT_BATCH, evals=(2, 6, 9))
  got = _run_group(TEXT, specs, batches, mesh, evals=(2, 6, 9))
  _assert_same(got[:2], ref[:2])
  s = got[2].stats()
  assert s["ring_rows_per_step"] > 0 and s["migrated_rows_per_step"] > 0
  assert s["micro_popular_size"] > 0


def test_read_ahead_matches_dense_adagrad_mean():
  """Row-wise Adagrad (its accumulators travel with the rows, through the ring too) and mean
  pooling."""
  specs = _specs(ADAGRAD, "mean")
  batches = _batches(specs, n=12)
  ref = _run_group("dense", specs, batches, planner.default_mesh(), evals=(4,))
  got = _run_group(TEXT, specs, batches, sharding.make_mesh(1, 1), evals=(4,))
  _assert_same(got[:2], ref[:2])
  assert got[2].stats()["ring_rows_per_step"] > 0


def test_prefetch_and_host_memory_are_unknown_options():
  """Every batch's cold rows are read ahead and live in host RAM, so neither `prefetch` nor
  `host_memory` is an option: either is refused as unknown, the valid options listed."""
  specs = _specs(SGD)
  mesh = sharding.make_mesh(1, 1)
  for extra in ("prefetch=True", "prefetch=False", "host_memory='pinned_host'"):
    with pytest.raises(ValueError, match=r"unknown option .*valid options: .*budget"):
      planner.make_group(TEXT[:-1] + f", {extra})", specs, mesh)
  with pytest.raises(ValueError, match=r"unknown option prefetch; valid options: .*cold_list"):
    HotColdOptions.parse({"prefetch": True})
  with pytest.raises(ValueError, match=r"unknown option host_memory; valid options"):
    HotColdOptions.parse({"host_memory": "pinned_host"})


@pytest.mark.parametrize(
  "save,resume",
  [pytest.param((2, 4), (8, 1), marks=pytest.mark.long), ((1, 1), (2, 4))],  # (10 minutes)
  ids=str,
)
def test_resume_on_another_mesh(save, resume):
  """Stopped mid-stream (batches prepared ahead of the stopped step, their rows read and
  their ring slots handed out), the logical rows and the hot set checkpointed (`export`
  drains the writer: the host tables hold every cold row), resumed on another mesh with a
  new ring: bit-equal to an uninterrupted dense run."""
  specs = _specs(ADAGRAD)
  batches = _batches(specs, n=12)
  ref = dense_ref(ADAGRAD, n=12)
  first = _run_group(TEXT, specs, batches, contract.mesh_or_skip(*save), stop=7)
  g1, s1 = first[2], first[3]
  assert g1.stats()["ring_rows_per_step"] > 0
  g2, s2 = restored(g1, s1, TEXT, specs, contract.mesh_or_skip(*resume))
  rest = _run_group(TEXT, specs, batches, None, group=g2, state=s2, start=7)
  _assert_same((first[0] + rest[0], rest[1]), ref[:2])
  assert g2.stats()["ring_rows_per_step"] > 0


# ----------------------------------------------------------------------------- mutations


def _exact(monkeypatch=None) -> bool:
  specs = _specs(SGD)
  batches = _batches(specs, n=10, batch=SPLIT_BATCH)
  ref = dense_ref(SGD, n=10, batch=SPLIT_BATCH)
  got = _run_group(TEXT, specs, batches, sharding.make_mesh(1, 1))
  return all(np.array_equal(got[1][n], ref[1][n]) for n in ref[1]) and all(
    np.array_equal(a[n], b[n]) for a, b in zip(got[0], ref[0]) for n in b
  )


def test_a_ring_never_written_breaks_it(monkeypatch):
  """Mutation check: steps that never write their cold rows (and rows leaving the hot set)
  into the ring (every slot ABSENT) serve stale rows to the loads planned from it."""
  real = host_tier.Recent.assign

  def nowhere(self, rows):
    real(self, rows)
    return np.full(rows.shape[0], host_tier.ABSENT, np.int32)

  monkeypatch.setattr(host_tier.Recent, "assign", nowhere)
  assert not _exact()


def test_rows_leaving_the_hot_set_never_in_the_ring_break_it(monkeypatch):
  """Mutation check: only the rows leaving the hot set at a re-pick are not written into the
  ring (their slots handed out all the same): a batch prepared before that step ran reads
  them cold from a slot that does not hold them."""
  real = host_side.HostTier._leaving_slots

  def nowhere(self, recent, rows):
    real(self, recent, rows)
    return np.full(rows.shape[0], host_tier.ABSENT, np.int32)

  monkeypatch.setattr(host_side.HostTier, "_leaving_slots", nowhere)
  assert not _exact()


def test_loads_that_ignore_the_ring_are_refused(monkeypatch):
  """Mutation check: without the ring's sources every such load is a host read of a row
  whose write-back has not happened (its step has not run): refused at once, not read
  stale."""
  real = host_tier.Recent.sources

  def host_only(self, rows):
    src, need = real(self, rows)
    steps = self.last_step[rows]
    return np.full_like(src, host_tier.ABSENT), max(need, int(steps.max(initial=-1)) + 1)

  monkeypatch.setattr(host_tier.Recent, "sources", host_only)
  monkeypatch.setattr(host_tier, "WAIT_SECONDS", 0.5)  # (one thread: nobody runs the step)
  with pytest.raises(RuntimeError, match="has not run"):
    _exact()


def test_a_skipped_step_is_refused(monkeypatch):
  """A prepared train batch skipped (its step never run), the input two batches ahead: the
  next step's version check counts it stale and sync refuses the state, or a later prepare
  finds a write-back it needs was never handed over; never a silently stale row."""
  specs = _specs(SGD)
  group = planner.make_group(TEXT, specs, planner.default_mesh())
  state = group.init(jax.random.key(0))
  batches = _batches(specs, n=9)
  lookup, update = jax.jit(group.lookup), jax.jit(group.update)

  def run(state, p, k):
    put = contract.put_prepared(group, p, group.mesh)
    pooled, res = lookup(state, put)
    out = update(state, put, res, {n: contract.grads_for(k, v) for n, v in pooled.items()})
    return group.after_update(out)

  monkeypatch.setattr(host_tier, "WAIT_SECONDS", 0.5)  # (one thread: nobody runs the step)
  prepared = [group.prepare(batches[k]) for k in range(2)]
  with pytest.raises(RuntimeError, match="another hot / cold layout|has not run"):
    for k in range(7):
      prepared.append(group.prepare(batches[k + 2]))
      if k != 5:  # batch 5 skipped
        state = run(state, prepared[k], k)
    group.sync(state)
