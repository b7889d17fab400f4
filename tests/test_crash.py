"""Runs that survive crashes: kill -9 mid-save, a full disk, corrupted checkpoints, NaN losses,
and a fresh run refused over another run's checkpoints. Each resumed run is checked against an
uninterrupted one, leaf for leaf."""

import ast
import errno
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

from recgnn.train import checkpoint, loop
from tests.trainer_lib import FEW_TABLES, smoke_config, state_leaves

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KILL_STEP = 8  # the save that is interrupted; checkpoint 4 is the last complete one


def _config(cache_dir, plan=None):
  """The smoke run on 4 of the synthetic data's tables (what a crash does to a checkpoint
  does not depend on their number; 26 cost ~3x the init, tracing and execution)."""
  return smoke_config(cache_dir, checkpoint_every=4, tables=4, plan=plan)


# A dynamic table evicting every step: its id maps are one more item of the checkpoint.
DYNAMIC_PLAN = (("C3", "dynamic(capacity=64, evict=lru)"), (".*", "dense"))


_leaves = state_leaves


def _assert_same(a, b):
  x, y = _leaves(a.state), _leaves(b.state)
  assert len(x) == len(y)
  for u, v in zip(x, y):
    np.testing.assert_array_equal(u, v)
  assert a.metrics["test/auc"] == b.metrics["test/auc"]


def _finalize_hook(action):
  """Orbax's commit (rename of `<step>.orbax-checkpoint-tmp-*` to `<step>`), wrapped so that
  `action()` runs instead while checkpoint KILL_STEP is being committed: every file written,
  the checkpoint not yet complete."""
  from orbax.checkpoint._src.path import atomicity

  original = atomicity.AtomicRenameTemporaryPath.finalize

  async def finalize(self, *args, **kwargs):
    if os.path.basename(str(self.get())).startswith(f"{KILL_STEP}."):
      action()
    return await original(self, *args, **kwargs)

  return atomicity.AtomicRenameTemporaryPath, "finalize", finalize


@pytest.fixture(scope="module")
def cache_dir(ctr_cache):
  return ctr_cache  # (conftest: one per process)


@pytest.fixture(scope="module")
def full_run(cache_dir, tmp_path_factory):
  return loop.train(_config(cache_dir), str(tmp_path_factory.mktemp("full")))


def test_fresh_run_over_checkpoints_is_refused(cache_dir, tmp_path):
  wd = tmp_path / "wd"
  (wd / "checkpoints" / "4").mkdir(parents=True)
  with pytest.raises(checkpoint.WorkdirHasCheckpoints, match=r"--resume.*fresh --workdir"):
    loop.train(_config(cache_dir), str(wd))
  # The CLI says the same, before it overwrites the earlier run's config.json.
  (wd / "config.json").write_text("earlier run")
  out = subprocess.run(
    [sys.executable, "run.py", "--experiment=smoke", f"--workdir={wd}"],
    cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True,
  )  # fmt: skip
  assert out.returncode != 0
  assert "--resume" in out.stderr and "fresh --workdir" in out.stderr, out.stderr[-2000:]
  assert "Traceback" not in out.stderr
  assert (wd / "config.json").read_text() == "earlier run"


def test_sigkill_during_save_then_resume_is_identical(cache_dir, full_run, tmp_path):
  _killed_then_resumed(cache_dir, full_run, tmp_path)


@pytest.mark.long
def test_sigkill_during_save_with_a_dynamic_table_loses_nothing(cache_dir, tmp_path):
  full = loop.train(_config(cache_dir, DYNAMIC_PLAN), str(tmp_path / "full"))
  _killed_then_resumed(cache_dir, full, tmp_path, DYNAMIC_PLAN)


def _killed_then_resumed(cache_dir, full_run, tmp_path, plan=None):
  """A run killed (SIGKILL) while checkpoint KILL_STEP is committed, resumed from the one
  before: identical to `full_run`."""
  wd = str(tmp_path / "wd")
  proc = subprocess.run(
    [sys.executable, os.path.abspath(__file__), "kill", wd, cache_dir, repr(plan)],
    cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT},
    capture_output=True, text=True,
    timeout=600,
  )  # fmt: skip
  assert proc.returncode == -signal.SIGKILL, proc.stdout[-2000:] + proc.stderr[-2000:]
  names = os.listdir(os.path.join(wd, "checkpoints"))
  assert any(n.startswith(f"{KILL_STEP}.orbax-checkpoint-tmp") for n in names), names
  assert checkpoint.committed_steps(wd) == [4]
  resumed = loop.train(_config(cache_dir, plan), wd, resume=True)
  _assert_same(full_run, resumed)
  assert not any(checkpoint.TMP_MARK in n for n in os.listdir(os.path.join(wd, "checkpoints")))


def test_full_disk_during_save_keeps_the_previous_checkpoint(
  cache_dir, full_run, tmp_path, monkeypatch
):
  def no_space():
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

  wd = str(tmp_path / "wd")
  monkeypatch.setattr(*_finalize_hook(no_space))
  full = r"disk is full.*checkpoint 4 is intact"
  with pytest.raises(checkpoint.CheckpointWriteError, match=full):
    loop.train(_config(cache_dir), wd)
  monkeypatch.undo()
  assert checkpoint.committed_steps(wd) == [4]
  assert not any(checkpoint.TMP_MARK in n for n in os.listdir(os.path.join(wd, "checkpoints")))
  resumed = loop.train(_config(cache_dir), wd, resume=True)
  _assert_same(full_run, resumed)


def _largest_file(directory):
  files = [os.path.join(r, f) for r, _, fs in os.walk(directory) for f in fs]
  return max(files, key=os.path.getsize)


@pytest.fixture(scope="module")
def stopped_at_8(cache_dir, tmp_path_factory):
  """A run stopped after 8 steps: checkpoints 4 and 8 (copied by each test that damages one)."""
  wd = str(tmp_path_factory.mktemp("stopped") / "wd")
  loop.train(_config(cache_dir), wd, stop_after=8)
  return wd


@pytest.mark.parametrize("damage", ["flip", "truncate_unchecked"])
def test_corrupted_checkpoint_is_refused_and_the_previous_used(
  cache_dir, full_run, stopped_at_8, tmp_path, capsys, damage
):
  wd = str(tmp_path / "wd")
  shutil.copytree(stopped_at_8, wd)
  assert checkpoint.committed_steps(wd) == [4, 8]
  step_dir = os.path.join(wd, "checkpoints", "8")
  victim = _largest_file(os.path.join(step_dir, "state"))
  with open(victim, "rb") as f:
    data = bytearray(f.read())
  if damage == "flip":  # silent bit rot: only the checksums see it
    data[len(data) // 2] ^= 0xFF
  else:  # a truncated copy of a checkpoint saved before checksums existed: Orbax fails to read
    os.remove(os.path.join(step_dir, checkpoint.CHECKSUMS))
    data = data[: len(data) // 3]
  with open(victim, "wb") as f:
    f.write(bytes(data))
  capsys.readouterr()
  resumed = loop.train(_config(cache_dir), wd, resume=True)
  out = capsys.readouterr().out
  assert f"Refusing corrupted checkpoint 8 in {step_dir}" in out, out
  assert "Resumed from checkpoint at step 4" in out
  assert os.listdir(os.path.join(wd, "checkpoints", "corrupt"))  # kept for inspection
  _assert_same(full_run, resumed)


def test_non_finite_loss_stops_with_step_and_tables(cache_dir, tmp_path, monkeypatch):
  from recgnn.tasks import ctr

  original = ctr.CTR.train_batches

  def poisoned(self, start_step=0):
    for i, batch in enumerate(original(self, start_step), start=start_step):
      if i == 5:  # the batch of step 6
        batch = {**batch, "dense": np.full_like(batch["dense"], np.inf)}
      yield batch

  monkeypatch.setattr(ctr.CTR, "train_batches", poisoned)
  wd = str(tmp_path / "wd")
  what = rf"at step 6;.*tables with non-finite values: {FEW_TABLES[0]} "
  with pytest.raises(loop.NonFiniteLoss, match=what) as e:
    loop.train(_config(cache_dir), wd)
  assert "checkpoint 4" in str(e.value) and "dense params: " in str(e.value)
  assert checkpoint.committed_steps(wd) == [4]  # nothing saved after the NaN
  monkeypatch.undo()
  resumed = loop.train(_config(cache_dir), wd, resume=True, stop_after=1)
  assert all(np.isfinite(x).all() for x in _leaves(resumed.state) if x.dtype.kind == "f")


if __name__ == "__main__":  # the killed run of test_sigkill_during_save_then_resume_is_identical
  _, what, workdir, cache, plan = sys.argv
  assert what == "kill"
  target, name, hook = _finalize_hook(lambda: os.kill(os.getpid(), signal.SIGKILL))
  setattr(target, name, hook)
  loop.train(_config(cache, ast.literal_eval(plan)), workdir)
  sys.exit("not killed")
