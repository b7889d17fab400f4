"""train.steps_per_call = k for CTR (issue 43): k batches stacked into one transfer and one
lax.scan over their optimizer steps, bit-identical to k calls of one step, on every mesh,
for dense / tt / sharded and the host tiers offload / hot_cold, across a stop and resume."""

import json
import os

import numpy as np
import pytest

from recgnn.embeddings import host_tier
from recgnn.train import loop
from tests.trainer_lib import (
  skip_unless_deterministic,
  skip_unless_devices,
  smoke_config,
  state_leaves,
)


@pytest.fixture(scope="module")
def cache_dir(ctr_cache):
  return ctr_cache  # (conftest: one per process)


def _config(cache_dir, k, mesh=(1, 1), plan=None, steps=8, tables=4):
  """The smoke run at k steps per call, on 4 of the synthetic data's tables by default
  (trainer_lib.FEW_TABLES: the large ones the plans below name, C3 / C4 / C16, and a tiny
  one): equality of k calls of one step and one of k holds table by table, and 26 tables
  cost ~3x the init, tracing and execution. tables=None: Criteo's 26."""
  c = smoke_config(cache_dir, steps=steps, log_every=4, mesh=mesh, plan=plan, tables=tables)
  c.train.steps_per_call = k
  return c


def _logged(workdir):
  """metrics.jsonl's train lines: step and loss. (Not the backends' counters: tt's
  capacity figures count what `prepare` has seen, and the input thread runs further ahead
  of a call of 4 batches than of one, so by step 4 it may have prepared the eval batches.)"""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(x) for x in f]
  return [{"step": r["step"], "loss": r["loss"]} for r in rows if "loss" in r]


def _without_rings(state):
  """A host tier's device ring of recent write-backs is sized by the steps per call (a call
  of k must hold its own write-backs): a buffer of rows also on the host, not the model.
  (Under a dynamic table, in its inner backend's state.)"""

  def strip(e):
    if not isinstance(e, dict):
      return e
    return {n: strip(v) if n == "inner" else v for n, v in e.items() if n != "ring"}

  return state.replace(emb={k: strip(e) for k, e in state.emb.items()})


def _same(a, b):
  la, lb = state_leaves(_without_rings(a.state)), state_leaves(_without_rings(b.state))
  assert len(la) == len(lb)
  for x, y in zip(la, lb):
    np.testing.assert_array_equal(x, y)
  for key, g in a.plan.groups.items():  # the logical tables (a host tier's host rows too)
    ta, tb = g.tables(a.state.emb[key]), b.plan.groups[key].tables(b.state.emb[key])
    for n in ta:
      np.testing.assert_array_equal(ta[n], tb[n], err_msg=n)


PLANS = {
  "dense": ((".*", "dense"),),
  # The dedup in the step (a GPU's default): the ids stacked as read, padding mapped per step.
  "dense_dedup_device": ((".*", "dense(dedup=device)"),),
  "rows": (("C(3|4|10|16|21)", "dense(shard=rows)"), (".*", "dense")),
  "tt": (("C(3|4)", "tt(rank=4)"), (".*", "dense")),
  "sharded": ((".*", "sharded"),),
  # Caches of a few batches' rows: every step evicts, and rows come back within a call.
  "offload": ((".*", "offload(cache_rows=320, policy=lru, lookahead=2)"),),
  "offload_lookahead": ((".*", "offload(cache_fraction=0.2, min_cache_rows=300, lookahead=4)"),),
  # The hot set picked after 4 batches (a call's): the split changes on a call boundary. Two
  # tables in the group, half their rows hot: examples popular enough to split on 8 devices
  # (32 examples each) too.
  "hot_cold": (("C(3|4)", "hot_cold(budget=0.5, profile_batches=4)"), (".*", "dense")),
  # Raw ids into 64 rows (a batch's distinct ids are more): rows evicted and reset every step,
  # two tables in one fused dense array, the reset lists of a call padded to one length.
  "dynamic": (("C(3|4)", "dynamic(capacity=64, evict=lru)"), (".*", "dense")),
  # The same over offload with a cache smaller than the capacity: reused rows reset in their
  # cache slot or in the rows a step loads (`OffloadGroup.place_resets`), within a call.
  "dynamic_offload": (
    ("C(3|4)", "dynamic(capacity=384, evict=lru, inner='offload(cache_rows=300, lookahead=2)')"),
    (".*", "dense"),
  ),
}


def _rules(plan):
  """A plan's rules: a PLANS name, or the rules themselves."""
  return PLANS[plan] if isinstance(plan, str) else plan


# Steps of the runs the resume tests compare with (their uninterrupted run is the k-step
# case's own 12-step run, trained once for both tests); the other cases run 8.
RESUME_STEPS = 12


@pytest.fixture(scope="module")
def trained(cache_dir, tmp_path_factory):
  """trained(plan, mesh, k, steps) -> (loop.train's result, workdir): each run once per
  module, shared by the tests that compare with it (a build traces and lowers the trainer's
  programs again: most of a case's time). Its results are only read."""
  runs = {}
  root = tmp_path_factory.mktemp("runs")

  def get(plan, mesh, k, steps):
    key = (plan, mesh, k, steps)
    if key not in runs:
      wd = str(root / f"run{len(runs)}")
      runs[key] = loop.train(_config(cache_dir, k, mesh, _rules(plan), steps=steps), wd), wd
    return runs[key]

  return get


CASES = [
  ("dense", (1, 1)),
  ("dense_dedup_device", (8, 1)),  # (the host's dedup on several devices: "rows", 2x4)
  ("rows", (2, 4)),
  ("tt", (1, 1)),
  ("tt", (8, 1)),
  ("tt", (2, 4)),
  ("sharded", (8, 1)),
  ("sharded", (2, 4)),
  ("offload", (1, 1)),
  ("offload_lookahead", (1, 1)),
  # The host tiers on 2x4 in the default run (it splits over both axes); 1x1 / 8x1 under
  # `-m long` (the suite's 10 minutes; test_hot_cold / test_offload cover those meshes).
  pytest.param("offload", (8, 1), marks=pytest.mark.long),
  pytest.param("offload", (2, 4), marks=pytest.mark.slow),
  pytest.param("hot_cold", (1, 1), marks=pytest.mark.long),  # (~3 min: 4 programs)
  pytest.param("hot_cold", (8, 1), marks=pytest.mark.long),
  pytest.param("hot_cold", (2, 4), marks=pytest.mark.slow),
  pytest.param("dynamic", (1, 1), marks=pytest.mark.long),
  pytest.param("dynamic_offload", (1, 1), marks=pytest.mark.long),
]


def _steps(plan, mesh):
  """The resume tests' plans on one device run as long as their chains."""
  return RESUME_STEPS if mesh == (1, 1) and plan in ("dense", "offload") else 8


@pytest.mark.parametrize(
  "plan,mesh", CASES, ids=lambda x: x if isinstance(x, str) else f"{x[0]}x{x[1]}"
)
def test_k_steps_per_call_are_k_calls_of_one_step(trained, plan, mesh):
  """4 steps per call end bit-identical to one step per call (state, logged per-step
  means at the same steps, test AUC). The host tiers' runs evict and write back every
  step, and load rows back from the device ring of recent write-backs: rows a step of the
  same call wrote back, prepared before the call ran."""
  skip_unless_deterministic()
  skip_unless_devices(mesh[0] * mesh[1], f"mesh {mesh[0]}x{mesh[1]}")
  steps = _steps(plan, mesh)
  one, one_wd = trained(plan, mesh, 1, steps)
  four, four_wd = trained(plan, mesh, 4, steps)
  assert one.metrics["step"] == four.metrics["step"] == steps and int(four.state.step) == steps
  _same(one, four)
  assert _logged(one_wd) == _logged(four_wd)
  assert [r["step"] for r in _logged(four_wd)] == list(range(4, steps + 1, 4))
  assert four.metrics["test/auc"] == one.metrics["test/auc"]
  if plan.startswith(("offload", "hot_cold")):
    rows = _rows(four_wd)
    assert sum(v for r in rows for k, v in r.items() if k.endswith("d2h_rows_per_step")) > 0
    assert sum(r.get("ring_rows_per_step", 0) for r in rows) > 0, "no row came from the ring"
  if plan == "hot_cold":
    assert sum(r.get("micro_popular_size", 0) for r in _rows(four_wd)) > 0
  if plan.startswith("dynamic"):  # (rows evicted, so reused and reset, within the calls)
    evicted = sum(v for r in _rows(four_wd) for k, v in r.items() if k.endswith("_evicted"))
    assert evicted > 0


def _rows(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(x) for x in f]


def _resume_chain(cache_dir, rules, workdir):
  """A run of RESUME_STEPS stopped twice: 4 steps at one step per call, resumed at 4 per
  call (a one-step run's checkpoint) and stopped after one call, resumed at 4 per call
  again (a k-step run's checkpoint, stopped on a call boundary) to the end."""
  one = _config(cache_dir, 1, plan=rules, steps=RESUME_STEPS)
  four = _config(cache_dir, 4, plan=rules, steps=RESUME_STEPS)
  assert loop.train(one, workdir, stop_after=4).metrics["step"] == 4
  assert loop.train(four, workdir, resume=True, stop_after=4).metrics["step"] == 8
  end = loop.train(four, workdir, resume=True)
  assert end.metrics["step"] == RESUME_STEPS
  return end


def test_k_steps_per_call_resume_exactly(cache_dir, trained, tmp_path):
  """A one-step run's checkpoint resumed at 4 steps per call, and a 4-step-per-call run
  stopped after one call and resumed, end as the uninterrupted 4-step-per-call run."""
  skip_unless_deterministic()
  full, _ = trained("dense", (1, 1), 4, RESUME_STEPS)
  _same(full, _resume_chain(cache_dir, PLANS["dense"], str(tmp_path / "chain")))


@pytest.mark.slow
def test_k_steps_per_call_offload_ssd_level(cache_dir, tmp_path):
  """offload's SSD level (row files behind a host cache of half the rows) at 4 steps per
  call: bit-identical to one step per call."""
  skip_unless_deterministic()

  def plan(d):
    return ((".*", f"offload(cache_rows=320, policy=lru, host_cache=0.5, storage='ssd:{d}')"),)

  one = loop.train(_config(cache_dir, 1, plan=plan(tmp_path / "r1")), str(tmp_path / "one"))
  four = loop.train(_config(cache_dir, 4, plan=plan(tmp_path / "r4")), str(tmp_path / "four"))
  _same(one, four)
  assert four.metrics["test/auc"] == one.metrics["test/auc"]


HOST_RESUME = {
  "offload": "offload",  # (PLANS': its uninterrupted run is the k-step case's)
  # (the split off: a resumed run sizes its popular micro-batch again from its first batch,
  # which changes float summation order, not values; tests/test_hot_cold.py resumes it)
  "hot_cold": ((".*", "hot_cold(budget=0.2, profile_batches=4, split=False)"),),
}


def _same_model(a, b):
  """The same params, optimizer state, step and logical tables (a host tier's resumed
  cache or hot arrays hold the same rows, placed afresh)."""
  for x, y in zip(state_leaves(a.state.replace(emb={})), state_leaves(b.state.replace(emb={}))):
    np.testing.assert_array_equal(x, y)
  for key, g in a.plan.groups.items():
    ta, tb = g.tables(a.state.emb[key]), b.plan.groups[key].tables(b.state.emb[key])
    for n in ta:
      np.testing.assert_array_equal(ta[n], tb[n], err_msg=n)


@pytest.mark.slow
@pytest.mark.parametrize(
  "plan",
  # hot_cold's under -m long (the suite's 10 minutes; tests/test_hot_cold*.py resume it)
  [pytest.param(p, marks=pytest.mark.long) if p == "hot_cold" else p for p in sorted(HOST_RESUME)],
)
def test_k_steps_per_call_host_tiers_resume_exactly(cache_dir, trained, tmp_path, plan):
  """offload / hot_cold: a one-step run's checkpoint resumed at 4 steps per call, stopped
  after one call and resumed again, ends as the uninterrupted 4-step-per-call run."""
  skip_unless_deterministic()
  full, _ = trained(HOST_RESUME[plan], (1, 1), 4, RESUME_STEPS)
  _same_model(full, _resume_chain(cache_dir, _rules(HOST_RESUME[plan]), str(tmp_path / "chain")))


def test_a_call_never_reads_its_own_write_backs_from_the_host():
  """A row written back by a step of the call being prepared and no longer in the ring:
  refused, with the numbers, not read stale from the host nor waited for forever (the
  call's write-backs reach the host only after the call). Rings are sized for a call."""
  recent = host_tier.Recent(100, steps_per_call=4)
  recent.resize(8)
  recent.assign(np.arange(8))  # step 0 writes back rows 0..7
  recent.end_step()
  recent.assign(np.arange(8, 16))  # step 1 overwrites every ring slot
  recent.end_step()
  src, need = recent.sources(np.array([3]))  # step 2 loads row 3: not held, step 0's
  assert src[0] == host_tier.ABSENT and need == 1
  with pytest.raises(RuntimeError, match=r"step 2 \(of a call of 4 steps from step 0\).*step 0"):
    recent.check_in_call(need, "offload (tables t)")
  for _ in range(2):
    recent.end_step()
  recent.check_in_call(need, "t")  # step 4: a new call; step 0's write-back is handed over
  assert host_tier.call_ring_steps(1, 2) == 2 and host_tier.call_ring_steps(8, 2, 2) == 14


def test_k_steps_per_call_refused_where_not_built(cache_dir, tmp_path, monkeypatch):
  """A host tier that does not declare Capabilities.stacks_calls is refused with k > 1."""
  import dataclasses

  from recgnn.backends.offload.table import Offload

  off = dataclasses.replace(Offload.capabilities, stacks_calls=False)
  monkeypatch.setattr(Offload, "capabilities", off)
  c = _config(cache_dir, 4, plan=((".*", "offload(cache_rows=2048)"),))
  with pytest.raises(ValueError, match=r"steps_per_call=4 with host-tier .*one step per call"):
    loop.train(c, str(tmp_path / "a"))
  c = _config(cache_dir, 4)
  c.train.log_every = 6
  with pytest.raises(ValueError, match=r"train.log_every=6 must be multiple\(s\) of 4"):
    loop.train(c, str(tmp_path / "b"))
  c = _config(cache_dir, 0)
  with pytest.raises(ValueError, match=r"train.steps_per_call=0"):
    loop.train(c, str(tmp_path / "c"))


def _k_step_program(cache_dir, plan, rows):
  """The trainer's 4-step program of a host-tier plan whose three largest tables have
  `rows` rows (hashed ids; the other 1000), on its first call (the first step runs before
  the scan, where it sizes the rings): lowered for CUDA and CPU, checked for host work and
  table-shaped tensors, compiled for CPU. -> its memory analysis."""
  from test_host_tier import _assert_no_host_work

  from recgnn.embeddings import base
  from recgnn.train import setup

  c = _config(cache_dir, 4, plan=((".*", plan),))
  schema = json.loads(c.data.schema)  # (4 tables, hashed: 3 of `rows` rows, one of 1000)
  for column, n in zip(schema["categorical"], (rows, rows, rows, 1000)):
    column.update(vocab="hash", hash_size=n)
  c.data.schema = json.dumps(schema)
  with base.shapes_only():  # (zero tables: values change no program or size)
    run = setup.build(c)
  big = [s for g in run.plan.groups.values() for s in g.specs.values() if s.num_rows == rows]
  assert len(big) == 3
  train = run.task.train_batches()
  window = [next(train) for _ in range(4 + run.plan.lookahead)]
  prepared = [run.prepare(b, [u["ids"] for u in window[i + 1 :]]) for i, b in enumerate(window[:4])]
  host, layout = run.feeder.pack_call(list(zip(prepared, window[:4])))
  assert host[0][0].shape[0] == 4  # (k batches stacked: [k, devices, n])
  traced = run.train_step.trace(run.state, run.feeder.put(host), layout)
  for platform in ("cuda", "cpu"):
    lowered = traced.lower(lowering_platforms=(platform,))
    _assert_no_host_work(lowered.as_text(), big, f"{plan}'s 4-step program for {platform}")
  assert "while" in lowered.as_text()  # (the scan)
  compiled = lowered.compile()
  for n in (rows, base.aligned_rows(rows)):
    assert f"f32[{n}" not in compiled.as_text()
  return compiled.memory_analysis()


@pytest.mark.slow
@pytest.mark.parametrize(
  "plan", ["offload(cache_rows=2048, policy=lru, lookahead=2)", "hot_cold(hot_rows=2000)"]
)
def test_the_k_step_program_does_not_grow_with_the_tables(cache_dir, plan):
  """The trainer's 4-step program of a host-tier plan (device tiers of a fixed size) holds
  no host work and no table-sized tensor, lowered for CPU and CUDA, and XLA:CPU's program
  for tables of 200k rows and of 400k needs the same argument and temporary bytes: nothing
  in it is O(rows); it is O(cache + k batches)."""
  small = _k_step_program(cache_dir, plan, 200_003)
  large = _k_step_program(cache_dir, plan, 400_009)
  for what in ("argument_size_in_bytes", "temp_size_in_bytes", "output_size_in_bytes"):
    assert getattr(small, what) == getattr(large, what), what
