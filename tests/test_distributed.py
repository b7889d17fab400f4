"""Many processes over jax.distributed on localhost (gloo): 2 processes x 4 CPU devices."""

import os
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from recgnn.train import checkpoint, loop

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = [pytest.mark.slow]
# The many-process tests (deadlines, heartbeats) run alone on the machine (conftest's
# `serial` lock); the one-process checks below them need no such quiet.
many_processes = pytest.mark.serial


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _launch(workdir, cache_dir, port, extra=()):
  from tests.trainer_lib import xla_flags

  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(4)}
  few = _config(cache_dir, 1)  # (its 4 tables: the data file and schema, on the command line)
  procs = []
  for pid in range(2):
    cmd = [
      sys.executable, "run.py", "--experiment=smoke", f"--workdir={workdir}",
      f"--config.data.cache_dir={cache_dir}", "--config.data.synthetic.rows=20000",
      f"--config.data.path={few.data.path}", f"--config.data.schema={few.data.schema}",
      f"--coordinator_address=127.0.0.1:{port}",
      "--num_processes=2", f"--process_id={pid}", *extra,
    ]  # fmt: skip
    procs.append(
      subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
      )  # fmt: skip
    )
  return procs


# Three tables model-parallel over MODEL, the rest replicated dense with row-wise Adagrad.
PLAN = (("C(1|2|3)$", "sharded"), (".*", "dense"))
# 4 of Criteo's tables (tests/trainer_lib.py: each process builds a fraction of the 26 tables'
# steps): the plan's three and one dense.
TABLES = ("C1", "C2", "C3", "C4")


def _config(cache_dir, steps, plan=PLAN):
  from tests.trainer_lib import smoke_config

  # No eval: the reference is compared by its state, and an eval step is one more compile.
  c = smoke_config(
    cache_dir, steps=steps, mesh=(2, 4), plan=plan, tables=TABLES, final_eval_splits=()
  )
  c.train.order_shards = 2  # (each process's slice of a batch from its own rows)
  return c


STEPS = 12


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, ctr_cache):
  """The two-process runs' reference: the same run in this process, on its 8 devices."""
  return loop.train(_config(ctr_cache, STEPS), str(tmp_path_factory.mktemp("one")))


# host: each process reads and prepares only its half of every batch (sharded, and dense with
# row-wise Adagrad: its dedup on device); device: each holds only its own shard's rows on its
# devices, which gather its half of every batch there.
FEEDS = {
  "host": (["--config.train.process_input=local", "--config.train.feed=host"],
           "only its 1/2 of every batch (this one: slice 0"),
  "device": (["--config.train.feed=device"], "device feed: the data on the devices"),
}  # fmt: skip


# (not `serial`: no deadline of its own here; the processes only run slower beside a worker)
@pytest.mark.parametrize("feed", sorted(FEEDS))
def test_two_processes_match_one_process_with_8_devices(tmp_path, ctr_cache, one_process, feed):
  # The worker's CTR data cache (conftest): the smoke data the trainer tests converted,
  # not generated again by both processes and this one.
  cache = ctr_cache
  # One final eval (test): it shows metrics gathered over both processes; valid would be
  # the same code path once more.
  extra = [f"--config.train.steps={STEPS}", "--config.train.checkpoint_every=0",
           "--config.mesh.data=2", "--config.mesh.model=4", f"--config.embeddings.plan={PLAN}",
           "--config.train.order_shards=2", *FEEDS[feed][0],
           "--config.train.final_eval_splits=('test',)"]  # fmt: skip
  procs = _launch(str(tmp_path / "mp"), cache, _free_port(), extra)
  outs = [p.communicate(timeout=600)[0] for p in procs]
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out[-3000:]
  assert "test/auc" in outs[0] and "process 0 of 2" in outs[0]
  # On a 2x4 mesh spanning both processes, still equal to one process reading everything.
  # (Only process 0 logs.)
  assert FEEDS[feed][1] in outs[0], outs[0][-3000:]
  assert not os.path.exists(tmp_path / "mp" / "results.json.1")
  ref = one_process
  restored = checkpoint.Checkpointer(str(tmp_path / "mp")).restore(ref.state, ref.plan)
  assert int(restored.step) == STEPS
  a = jax.tree.leaves(jax.device_get(ref.state.params))
  b = jax.tree.leaves(jax.device_get(restored.params))
  for x, y in zip(a, b):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)
  for key, group in ref.plan.groups.items():
    ta, tb = group.tables(ref.state.emb[key]), group.tables(restored.emb[key])
    for n in ta:
      np.testing.assert_allclose(ta[n], tb[n], rtol=1e-5, atol=1e-7, err_msg=n)


# Dynamic tables (capacity below a batch's distinct ids: admissions, evictions and
# rejections every step; the reused rows reset in a dense and in a row-sharded inner table)
# beside the sharded and dense ones.
DYNAMIC_PLAN = (
  ("C3", "dynamic(capacity=64, evict=lru)"),
  ("C4", "dynamic(capacity=64, evict=lru, inner='sharded(kind=row)')"),
  ("C(1|2)$", "sharded"),
  (".*", "dense"),
)


@many_processes
@pytest.mark.long
def test_dynamic_tables_decide_the_same_in_every_process(tmp_path, ctr_cache):
  """2 processes x 4 devices against 1 x 8: the same maps (each process maps the whole
  batch in stream order) and the same tables."""
  steps = 8
  extra = [f"--config.train.steps={steps}", "--config.train.checkpoint_every=0",
           "--config.mesh.data=2", "--config.mesh.model=4",
           f"--config.embeddings.plan={DYNAMIC_PLAN}", "--config.train.order_shards=2",
           "--config.train.final_eval_splits=()"]  # fmt: skip
  procs = _launch(str(tmp_path / "mp"), ctr_cache, _free_port(), extra)
  outs = [p.communicate(timeout=600)[0] for p in procs]
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out[-3000:]
  ref = loop.train(_config(ctr_cache, steps, DYNAMIC_PLAN), str(tmp_path / "one"))
  groups = [g for g in ref.plan.groups.values() if g.name == "dynamic"]
  assert sorted(n for g in groups for n in g.maps) == ["C3", "C4"]
  mine = {n: m.arrays() for g in groups for n, m in g.maps.items()}
  assert all(m.counters()["evicted"] > 0 for g in groups for m in g.maps.values())
  restored = checkpoint.Checkpointer(str(tmp_path / "mp")).restore(ref.state, ref.plan)
  for g in groups:  # (the restore put process 0's saved maps in the groups)
    for n, m in g.maps.items():
      for k, v in m.arrays().items():
        np.testing.assert_array_equal(v, mine[n][k], err_msg=f"{n} map {k}")
  for key, g in ref.plan.groups.items():
    ta, tb = g.tables(ref.state.emb[key]), g.tables(restored.emb[key])
    for n in ta:
      np.testing.assert_allclose(ta[n], tb[n], rtol=1e-5, atol=1e-7, err_msg=n)


@many_processes
def test_killing_one_process_ends_the_other_with_a_clear_error(tmp_path, ctr_cache):
  # --heartbeat_timeout=5: the survivor notices sooner (the default 30 s made the test wait
  # ~21 s after the kill, 10 s ~10 s); the heartbeats come from a C++ thread of each process,
  # not held back by the GIL, and the test runs alone (serial).
  extra = ["--config.mesh.data=8", "--config.train.steps=100000", "--config.train.log_every=2",
           "--config.train.eval_every=0", "--config.train.checkpoint_every=0",
           "--heartbeat_timeout=5"]  # fmt: skip
  procs = _launch(str(tmp_path / "mp"), ctr_cache, _free_port(), extra)
  deadline = time.time() + 300
  for line in procs[0].stdout:  # wait until training runs
    if line.startswith("step") or time.time() > deadline:
      break
  procs[1].send_signal(signal.SIGKILL)
  t0 = time.time()
  try:
    out = procs[0].communicate(timeout=180)[0]
  except subprocess.TimeoutExpired:
    procs[0].kill()
    pytest.fail("the surviving process hung for 180 s after its peer died")
  assert procs[0].returncode != 0
  assert time.time() - t0 < 180
  assert "another task died" in out or "unhealthy" in out or "Gloo" in out, out[-3000:]


def test_device_blocks_decide_each_process_slice():
  from recgnn.train import inputs

  # 2 processes x 4 devices in mesh order: process 1 holds examples [B/2, B).
  owners = [0, 0, 0, 0, 1, 1, 1, 1]
  assert inputs.device_block(owners, 0, 2) == 0
  assert inputs.device_block(owners, 1, 2) == 1
  # Interleaved devices: a process's examples are not one slice of the batch.
  assert inputs.device_block([0, 1] * 4, 0, 2) is None
  assert inputs.device_block([0, 0, 0, 1, 1, 1, 1, 1], 0, 2) is None


def test_process_local_input_is_refused_with_the_groups_that_plan_over_the_batch(monkeypatch):
  from recgnn import planner, sharding
  from recgnn.embeddings import OptimizerSpec, TableSpec, base
  from recgnn.train import inputs

  opt = OptimizerSpec(name="rowwise_adagrad", learning_rate=0.1)
  specs = [TableSpec(name=n, num_rows=1000, dim=8, optimizer=opt) for n in ("a", "b", "c")]
  mesh = sharding.make_mesh(data=8)

  class Task:
    reads_process_slice, shard_batch = True, True

  monkeypatch.setattr(jax, "process_count", lambda: 2)
  rules = [("a", "tt(rank=4)"), ("b", "offload(cache_rows=256)"), (".*", "dense")]
  layout, shard, why = inputs.choose_layout(Task(), rules, specs, mesh, "auto")
  assert shard is None and "whole batch" in why and not layout.process_local
  with pytest.raises(ValueError, match="process_input=local") as e:
    inputs.choose_layout(Task(), rules, specs, mesh, "local")
  assert "'tt" in str(e.value) and "'offload" in str(e.value) and "dense" not in str(e.value)
  with pytest.raises(ValueError, match="valid: auto, local, global"):
    inputs.choose_layout(Task(), rules, specs, mesh, "mine")
  # dense and sharded prepare per example: only the (single-process) device order refuses.
  rules = [("a", "sharded"), (".*", "dense")]
  with pytest.raises(ValueError) as e:
    inputs.choose_layout(Task(), rules, specs, mesh, "local")
  assert "embedding group" not in str(e.value) and "contiguous block" in str(e.value)
  # A backend that plans over the batch refuses a process-local layout at construction.
  with pytest.raises(ValueError, match="cannot read process-local batches"):
    planner.make_group("tt(rank=4)", specs[:1], mesh, base.Layout(process_local=True))


@pytest.mark.parametrize("shard", ["none", "rows"])
def test_device_dedup_updates_rows_as_the_host_dedup_does(shard):
  """Process-local input moves dense's Adagrad dedup from the host to the device: the
  same tables bit for bit (on 1x1 and, row-sharded, on 2x4)."""
  from recgnn import planner, sharding
  from recgnn.embeddings import OptimizerSpec, TableSpec, base

  opt = OptimizerSpec(name="rowwise_adagrad", learning_rate=0.1)
  spec = TableSpec(name="t", num_rows=300, dim=8, optimizer=opt, pooling="mean")
  mesh = sharding.make_mesh(data=2, model=4) if shard == "rows" else sharding.make_mesh(
    data=1, devices=jax.devices()[:1])  # fmt: skip
  rng = np.random.default_rng(0)
  tables = []
  for local in (False, True):
    layout = base.Layout(process_local=local)
    plan = planner.resolve_plan([(".*", f"dense(shard={shard})")], [spec], mesh, layout, log=False)
    (group,) = plan.groups.values()
    state = group.init(jax.random.key(0))
    rng = np.random.default_rng(0)
    for _ in range(3):
      ids = rng.integers(-1, 40, size=(16, 3))  # many duplicates, some padding
      prepared = group.prepare({"t": ids})
      assert ("unique" in prepared["t"]["rows"]) != local
      grads = {"t": rng.normal(size=(16, 8)).astype(np.float32)}
      residuals = jax.jit(group.lookup)(state, prepared)[1]
      state = jax.jit(group.update)(state, prepared, residuals, grads)
    tables.append(group.tables(state)["t"])
  np.testing.assert_array_equal(tables[0], tables[1])
