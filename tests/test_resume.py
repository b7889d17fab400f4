"""Resuming with another configuration is refused, naming every differing key with both
values, and leaves every checkpoint in place (resumable with the right configuration); only
damaged files are quarantined (tests/test_crash.py). --resume without a checkpoint is refused,
--resume_if_present starts fresh. One run per workdir: a lock naming its holder."""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from recgnn.tasks import ctr
from recgnn.train import checkpoint, loop, workdir_lock
from tests.trainer_lib import FEW_TABLES, smoke_config, state_leaves, xla_compiles

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def cache_dir(ctr_cache):
  return ctr_cache  # (conftest: one per process)


TABLES = FEW_TABLES[:4]  # (C3, C4, C16 and a tiny one: what the changes below touch)


def _config(cache_dir, **train):
  """The smoke run on 4 of the synthetic data's tables: a refusal names each differing table
  (or the tables that differ alike) whatever their number, and 26 cost ~3x the init,
  tracing and execution of every run here."""
  return smoke_config(cache_dir, tables=len(TABLES), **{"checkpoint_every": 2, **train})


@pytest.fixture(scope="module")
def saved(cache_dir, tmp_path_factory):
  """A run stopped after 4 of 12 steps: checkpoints 2 and 4."""
  wd = str(tmp_path_factory.mktemp("saved") / "wd")
  loop.train(_config(cache_dir), wd, stop_after=4)
  assert checkpoint.committed_steps(wd) == [2, 4]
  return wd


def _copy(saved, tmp_path) -> str:
  wd = str(tmp_path / "wd")
  shutil.copytree(saved, wd)
  return wd


def _more_rows(monkeypatch):
  original = ctr.CTR.tables

  def tables(self):
    return [
      s.__class__(**{**s.__dict__, "num_rows": s.num_rows + 5}) if s.name == "C3" else s
      for s in original(self)
    ]

  monkeypatch.setattr(ctr.CTR, "tables", tables)


def _change(config, what, monkeypatch):
  if what == "mlp_width":
    config.model.bottom = (64, 8)
  elif what == "embedding_dim":
    config.embeddings.dim, config.model.bottom = 16, (32, 16)
  elif what == "table_rows":
    _more_rows(monkeypatch)
  elif what == "dense_optimizer":
    config.optimizer.name = "sgd"
  elif what == "table_optimizer":
    config.embeddings.optimizer.name = "sgd"
  elif what == "backend_format":
    config.embeddings.plan = (("C16", "tt(rank=4)"), (".*", "dense"))
  return config


# what -> (patterns the refusal must contain), each naming the key and both values
EXPECTED = {
  "mlp_width": [
    "config model.bottom: checkpoint [32, 8], this run [64, 8]",
    "params/params/bottom/Dense_0/kernel: checkpoint (13, 32), this run (13, 64)",
  ],
  "embedding_dim": [
    "config embeddings.dim: checkpoint 8, this run 16; model.bottom: checkpoint [32, 8], this "
    "run [32, 16]",
    "tables " + ", ".join(TABLES) + " dim: checkpoint 8, this run 16",
  ],
  "table_rows": [r"table C3 rows: checkpoint (\d+), this run (\d+)\. The checkpoints"],
  "dense_optimizer": [
    "config optimizer.name: checkpoint adam, this run sgd",
    "opt_state/0/mu/params/bottom/Dense_0/kernel: checkpoint (13, 32), this run absent",
  ],
  "table_optimizer": [
    "config embeddings.optimizer.name: checkpoint rowwise_adagrad, this run sgd",
    "tables " + ", ".join(TABLES[:-1]) + ", ",
    f"{TABLES[-1]} optimizer slots: checkpoint ['accum'], this run [] (sgd)",
  ],
  "backend_format": [
    "table C16 format: checkpoint 'rows' (dense), this run 'tt",
    "Row backends (dense, dense(shard=rows), offload) restore from one another",
  ],
}


@pytest.mark.parametrize("what", sorted(EXPECTED))
def test_resume_with_another_config_is_refused_and_keeps_the_checkpoints(
  cache_dir, saved, tmp_path, monkeypatch, what
):
  wd = _copy(saved, tmp_path)
  before = {s: checkpoint.file_checksums(os.path.join(wd, "checkpoints", str(s))) for s in (2, 4)}
  config = _change(_config(cache_dir), what, monkeypatch)
  with pytest.raises(checkpoint.IncompatibleCheckpoint) as e:
    loop.train(config, wd, resume=True)
  msg = str(e.value)
  assert msg.startswith(f"Checkpoint 4 in {os.path.join(wd, 'checkpoints')} was saved by another")
  for pattern in EXPECTED[what]:
    if what == "table_rows":  # (the synthetic data's rows: 5 more in this run)
      m = re.search(pattern, msg)
      assert m and int(m.group(2)) == int(m.group(1)) + 5, msg
    else:
      assert pattern in msg, msg
  assert "checkpoints are untouched" in msg and os.path.join(wd, "config.json") in msg
  assert e.value.during_setup  # one line on the command line
  # Every checkpoint where it was, byte for byte; nothing quarantined; the saving run's
  # config.json not overwritten.
  assert checkpoint.committed_steps(wd) == [2, 4]
  assert not os.path.exists(os.path.join(wd, "checkpoints", "corrupt"))
  after = {s: checkpoint.file_checksums(os.path.join(wd, "checkpoints", str(s))) for s in (2, 4)}
  assert after == before
  with open(os.path.join(wd, "config.json")) as f:
    assert '"bottom": [\n      32,\n      8\n    ]' in f.read()
  # And the right config resumes it, to the same state as an uninterrupted run.
  monkeypatch.undo()
  resumed = loop.train(_config(cache_dir), wd, resume=True)
  assert resumed.metrics["step"] == 12
  full = _full_run(cache_dir, tmp_path)
  for x, y in zip(state_leaves(full.state), state_leaves(resumed.state)):
    np.testing.assert_array_equal(x, y)


_FULL = {}


def _full_run(cache_dir, tmp_path):
  if "run" not in _FULL:
    _FULL["run"] = loop.train(_config(cache_dir), str(tmp_path / "full"))
  return _FULL["run"]


def test_resume_without_a_checkpoint_is_refused_and_if_present_starts(cache_dir, tmp_path):
  wd = str(tmp_path / "wd")
  with pytest.raises(checkpoint.NoCheckpoint, match=r"no checkpoint in .*--resume_if_present"):
    loop.train(_config(cache_dir), wd, resume=True)
  res = loop.train(_config(cache_dir, steps=2), wd, resume="if_present")
  assert res.metrics["step"] == 2
  # With a checkpoint, "if_present" resumes it.
  res = loop.train(_config(cache_dir, steps=4), wd, resume="if_present")
  assert res.metrics["step"] == 4 and checkpoint.committed_steps(wd)[-1] == 4


def test_a_held_workdir_is_refused_naming_the_holder(cache_dir, tmp_path):
  wd = str(tmp_path / "wd")
  with workdir_lock.WorkdirLock(wd), pytest.raises(workdir_lock.WorkdirLocked) as e:
    loop.train(_config(cache_dir), wd)
  msg = str(e.value)
  assert f"pid {os.getpid()} on host {socket.gethostname()}" in msg and "is running" in msg
  assert e.value.during_setup
  # Released: the same workdir trains.
  assert loop.train(_config(cache_dir, steps=2), wd).metrics["step"] == 2


def test_a_lock_from_another_host_is_refused(tmp_path):
  wd = tmp_path / "wd"
  wd.mkdir()
  (wd / "lock").write_text('{"pid": 1, "host": "elsewhere", "started": "2026-01-01T00:00:00"}')
  with pytest.raises(workdir_lock.WorkdirLocked, match=r"pid 1 on host elsewhere.*delete"):
    workdir_lock.WorkdirLock(str(wd))


def test_two_processes_on_one_workdir(cache_dir, tmp_path):
  """A second run.py on a workdir a live run holds: refused (exit 2, one line naming the
  holder). After the holder is killed (SIGKILL: no cleanup), the next run takes the stale
  lock over and says whose it was."""
  wd = str(tmp_path / "wd")
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  few = _config(cache_dir)  # (its 4 tables: the data file and schema, on the command line)
  base = [sys.executable, "run.py", "--experiment=smoke", f"--workdir={wd}",
          f"--config.data.cache_dir={cache_dir}", "--config.data.synthetic.rows=20000",
          f"--config.data.path={few.data.path}", f"--config.data.schema={few.data.schema}",
          "--config.train.checkpoint_every=0", "--config.train.eval_every=0",
          "--config.train.final_eval_splits=()"]  # fmt: skip
  first = subprocess.Popen(
    [*base, "--config.train.steps=100000", "--config.train.log_every=5"],
    cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
  )  # fmt: skip
  try:
    deadline = time.time() + 300
    for line in first.stdout:
      if line.startswith("step") or time.time() > deadline:
        break
    assert first.poll() is None
    second = subprocess.run([*base, "--config.train.steps=2"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert second.returncode == 2, second.stderr[-3000:]
    err = second.stderr.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in second.stderr, second.stderr[-3000:]
    assert f"pid {first.pid} on host {socket.gethostname()}" in err[0], err
  finally:
    first.send_signal(signal.SIGKILL)
    first.communicate(timeout=60)
  third = subprocess.run([*base, "--config.train.steps=2"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
  assert third.returncode == 0, third.stdout[-3000:] + third.stderr[-3000:]
  assert f"Taking over {os.path.join(wd, 'lock')} from pid {first.pid}" in third.stdout
  assert "that process is gone" in third.stdout


def test_a_save_in_one_process_compiles_no_program_per_replica(tmp_path):
  """Orbax's CPU default (replica-parallel) has each replica of a replicated array write a
  slice of it: in one process, where every replica is local, an eager `slice` program per
  array and replica (96 in the first save of a 4-table smoke run on 2x4). The checkpoint's
  state item writes one replica's shard instead: saving replicated params on 8 devices
  compiles nothing, and they restore as saved."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from recgnn import planner, sharding
  from recgnn.train import train_state as state_lib

  mesh = sharding.make_mesh(8, 1)
  rep = NamedSharding(mesh, P())
  # (shapes no other test saves: a slice program compiled earlier in this process would be
  # reused, not compiled, and not seen here)
  params = {
    "w": jax.device_put(jnp.arange(8 * 13 * 3, dtype=jnp.float32).reshape(8 * 13, 3), rep),
    "b": jax.device_put(jnp.ones((3, 8 * 7), jnp.float32), rep),
  }
  state = state_lib.TrainState(
    step=jax.device_put(jnp.int32(3), rep), params=params, opt_state=(), emb={},
    key=jax.random.key(0),
  )  # fmt: skip
  plan = planner.Plan({}, {}, mesh)
  ckpt = checkpoint.Checkpointer(str(tmp_path))
  with xla_compiles() as compiles:
    ckpt.save(state, 3, plan)
  assert compiles == [], f"{len(compiles)} programs compiled by a save"
  got = checkpoint.Checkpointer(str(tmp_path)).restore(state, plan, log=lambda *_: None)
  for k in params:
    np.testing.assert_array_equal(np.asarray(got.params[k]), np.asarray(params[k]))
  assert int(got.step) == 3
