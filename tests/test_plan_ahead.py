"""The input's planning stage on a thread of its own (recgnn.train.plan_ahead, issue 43): the
same prepared batches and the same training as one thread (offload equal to dense bit for bit),
the planning running ahead of the host reads while the host tier's waits still hold, errors in
order, and which plans use it."""

import threading
import time

import contract_lib as contract
import jax
import numpy as np
import pytest

from recgnn import planner
from recgnn.backends.offload import group as offload_group
from recgnn.embeddings import base
from recgnn.train import inputs, plan_ahead

SGD = base.OptimizerSpec(name="sgd", learning_rate=0.1)
ADAGRAD = base.OptimizerSpec(name="rowwise_adagrad", learning_rate=0.1, initial_accumulator=0.1)
TEXT = "offload(cache_rows=60, policy=lookahead, lookahead=2)"


def _spec(opt, num_rows=1000):
  return base.TableSpec(name="t", num_rows=num_rows, dim=4, optimizer=opt)


@pytest.fixture
def threaded(monkeypatch):
  """The contract driver with the planning thread (its second halves slowed, so the planning
  runs the whole DEPTH ahead of them): records (event, batch) in order."""
  events = []
  real_stage = offload_group.OffloadGroup._stage

  def slow_stage(self, built, caps, train):
    events.append(("finish", threading.current_thread().name))
    time.sleep(0.003)
    return real_stage(self, built, caps, train)

  monkeypatch.setattr(offload_group.OffloadGroup, "_stage", slow_stage)
  monkeypatch.setattr(inputs, "prepare_stream", plan_ahead.prepare_stream)
  return events


@pytest.mark.parametrize("opt", [SGD, ADAGRAD], ids=lambda o: o.name)
def test_offload_with_the_planning_thread_equals_dense(opt, threaded):
  """12 steps, a 6% cache, an eval batch mid-stream, the input 2 batches ahead of the step
  and the planning DEPTH more: lookups and final table equal dense's bit for bit."""
  batches = contract.zipf_ids(5, 12, 32, 2, 1000)
  evals = {5: contract.zipf_ids(9, 1, 16, 2, 1000)[0]}
  ref = contract.run("dense", _spec(opt), batches, evals=evals)
  got = contract.run(TEXT, _spec(opt), batches, evals=evals, prefetch=2)
  assert len(got.lookups) == len(ref.lookups) == 13
  for k, (a, b) in enumerate(zip(got.lookups, ref.lookups)):
    np.testing.assert_array_equal(a, b, err_msg=f"lookup differs at item {k}")
  np.testing.assert_array_equal(got.table, ref.table)
  assert got.backend.stats()["t/d2h_rows_per_step"] > 0, "no write-back: test too easy"
  # The second halves ran on the consuming thread, not the planning one.
  assert threaded and all(name != "input planning" for _, name in threaded)


def test_the_planning_runs_ahead_of_the_host_reads(monkeypatch):
  """The first half of batch k + 1 starts before the second half of batch k ends (the
  overlap the thread is for), and the batches come out in order, each as one thread makes
  them."""
  specs = [base.TableSpec(name=f"t{i}", num_rows=500, dim=4, optimizer=SGD) for i in range(3)]
  tabs = [contract.zipf_ids(i, 10, 32, 1, 500) for i in range(3)]
  stream = [("train", None, {"ids": {f"t{i}": tabs[i][k] for i in range(3)}}) for k in range(10)]

  def run(threaded):
    group = planner.make_group("offload(cache_rows=120, policy=lru, lookahead=1)", specs)
    group.init(jax.random.key(0))
    plan = planner.Plan({"g": group}, {s.name: "g" for s in specs}, group.mesh)
    log = []
    real_ahead, real_stage = group.prepare_ahead, group._stage
    planned_three = threading.Event()  # batches 0, 1 and 2 planned

    def ahead(*a, **kw):
      log.append("plan")
      if log.count("plan") >= 3:
        planned_three.set()
      return real_ahead(*a, **kw)

    def stage(built, caps, train):
      if threaded and "finish" not in log:  # batch 0's second half waits for the planning
        planned_three.wait(30)  # (event-driven: a thread that never runs ahead fails below)
      out = real_stage(built, caps, train)
      log.append("finish")
      return out

    group.prepare_ahead, group._stage = ahead, stage
    make = plan_ahead.prepare_stream if threaded else inputs.prepare_stream
    out = []
    for x in make(plan, stream):
      out.append(x.prepared["g"])
      contract.planned_only(group, x.prepared["g"])  # (as if its step ran)
    return out, log

  want, serial = run(False)
  got, log = run(True)
  assert serial == ["plan", "finish"] * 10
  # batches 1 and 2 planned while batch 0's second half ran (DEPTH = 2 ahead)
  assert log[: log.index("finish")].count("plan") >= 2, log
  assert len(got) == len(want)
  for k, (a, b) in enumerate(zip(want, got)):
    for (path, x), (_, y) in zip(jax.tree.leaves_with_path(a), jax.tree.leaves_with_path(b)):
      np.testing.assert_array_equal(x, y, err_msg=f"batch {k} {jax.tree_util.keystr(path)}")


def test_a_host_read_before_its_write_back_is_still_refused(monkeypatch, threaded):
  """Mutation check through the planning thread: without the ring's sources every load of a
  row written back by a step not yet run is a host read that must wait for that write-back
  (`Writer.wait`); the host reads stay on the consuming thread, ahead of the steps by the
  driver's run-ahead only, so such a read is refused, never served stale."""

  contract.break_ring_sources(monkeypatch)
  batches = contract.zipf_ids(5, 16, 32, 2, 1000)
  with pytest.raises(RuntimeError, match="has not run"):
    contract.run("offload(cache_rows=60, policy=lru, lookahead=1)", _spec(SGD), batches, prefetch=2)


def test_an_error_comes_after_the_batches_before_it():
  specs = [base.TableSpec(name="t", num_rows=100, dim=4, optimizer=SGD)]
  group = planner.make_group("offload(cache_rows=40, policy=lru, lookahead=1)", specs)
  group.init(jax.random.key(0))
  plan = planner.Plan({"g": group}, {"t": "g"}, group.mesh)
  ids = contract.zipf_ids(1, 6, 8, 1, 100)

  def stream():
    for k in range(4):
      yield "train", None, {"ids": {"t": ids[k]}}
    raise ValueError("reader broke")

  got = []
  with pytest.raises(ValueError, match="reader broke"):
    for x in plan_ahead.prepare_stream(plan, stream()):
      got.append(x)
      contract.planned_only(group, x.prepared["g"])
  # (the look-ahead reads one batch past the one it plans: the error surfaces at batch 3)
  assert len(got) >= 2 and all(x.kind == "train" for x in got)


def test_which_plans_plan_on_a_thread():
  specs = [base.TableSpec(name="t", num_rows=100, dim=4, optimizer=SGD)]

  def plan_of(text):
    group = planner.make_group(text, specs)
    return planner.Plan({"g": group}, {"t": "g"}, group.mesh)

  assert plan_ahead.splits(plan_of("offload(cache_rows=40)"))
  assert not plan_ahead.splits(plan_of("dense"))  # (nothing to overlap)
  assert not plan_ahead.splits(plan_of("hot_cold(budget=0.5, profile_batches=1)"))
