"""train.input_workers (issue 43): the input's host half (read, prepare, pack) in a forked
worker process, its batches through shared-memory slots. Bit-identical to the input thread
(training, evals, k steps per call, a stop and resume), its failures raised with the worker's
traceback or exit code (never a hang), the plans it cannot serve refused or left on the thread,
nothing left in /dev/shm."""

import glob
import json
import os
import signal

import numpy as np
import pytest

from recgnn.train import input_worker, loop
from recgnn.train.input_worker import InputWorker, InputWorkerError
from recgnn.train.packing import Item
from tests.trainer_lib import (
  skip_unless_deterministic,
  skip_unless_devices,
  smoke_config,
  state_leaves,
)


@pytest.fixture(scope="module")
def cache_dir(ctr_cache):
  return ctr_cache  # (conftest: one per process)


def _config(cache_dir, workers, mesh=(1, 1), k=1, plan=None, **train):
  """The smoke run on 4 of the synthetic data's tables (the worker's slots carry every
  table's prepared arrays alike; 26 cost ~3x the init, tracing and execution)."""
  c = smoke_config(cache_dir, mesh=mesh, plan=plan, tables=4, **{"eval_every": 8, **train})
  c.train.input_workers = workers
  c.train.steps_per_call = k
  return c


def _logged(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [
      {k: v for k, v in json.loads(x).items() if k in ("step", "loss") or "/" in k}
      for x in f
      if "samples_per_second" not in x or "loss" in x
    ]


def _same(a, b):
  la, lb = state_leaves(a.state), state_leaves(b.state)
  assert len(la) == len(lb)
  for x, y in zip(la, lb):
    np.testing.assert_array_equal(x, y)


def _ring_files():
  """This process's slot files (named by the training process's pid: another worker's runs,
  at the same time, make their own)."""
  name = f"recgnn-input-{os.getpid()}-*"
  return glob.glob(os.path.join(input_worker.SHM_DIR or "/nonexistent", name))


@pytest.mark.parametrize(
  "mesh,k", [((1, 1), 1), ((8, 1), 1), ((1, 1), 4)], ids=["1x1", "8x1", "1x1-k4"]
)
def test_worker_is_bit_identical_to_the_thread(cache_dir, tmp_path, mesh, k):
  """Train, a mid-run eval (larger batches: a slot grows) and the final eval: the same state,
  the same logged losses and eval metrics; the worker's CPU reported; no file left."""
  skip_unless_deterministic()
  skip_unless_devices(mesh[0] * mesh[1], f"mesh {mesh[0]}x{mesh[1]}")
  before = set(_ring_files())
  thread = loop.train(_config(cache_dir, 0, mesh, k), str(tmp_path / "thread"))
  worker = loop.train(_config(cache_dir, 1, mesh, k), str(tmp_path / "worker"))
  assert "input_worker_cpu_seconds" not in thread.metrics
  assert worker.metrics["input_worker_cpu_seconds"] > 0
  _same(thread, worker)
  assert _logged(tmp_path / "thread") == _logged(tmp_path / "worker")
  assert worker.metrics["test/auc"] == thread.metrics["test/auc"]
  assert set(_ring_files()) <= before  # (no file of these runs left)


def test_worker_stop_and_resume_is_the_uninterrupted_run(cache_dir, tmp_path):
  """A worker run stopped after 4 steps and resumed (a worker again, forked at the resumed
  position) ends as the thread's uninterrupted run."""
  skip_unless_deterministic()
  full = loop.train(_config(cache_dir, 0), str(tmp_path / "full"))
  wd = str(tmp_path / "part")
  assert loop.train(_config(cache_dir, 1), wd, stop_after=4).metrics["step"] == 4
  resumed = loop.train(_config(cache_dir, 1), wd, resume=True)
  assert resumed.metrics["step"] == 12
  _same(full, resumed)
  assert resumed.metrics["test/auc"] == full.metrics["test/auc"]


def test_an_exception_in_the_worker_is_raised_with_its_traceback(cache_dir, tmp_path, monkeypatch):
  """A batch the worker cannot read: the run fails with the worker's own traceback, at once."""
  from recgnn.tasks import ctr

  real = ctr.CTR.train_batches

  def failing(self, start_step=0):
    for i, b in enumerate(real(self, start_step)):
      if i == 5 and os.getpid() != parent:
        raise OSError("disk gone under batch 5")
      yield b

  parent = os.getpid()
  monkeypatch.setattr(ctr.CTR, "train_batches", failing)
  with pytest.raises(InputWorkerError, match=r"(?s)traceback.*OSError: disk gone under batch 5"):
    loop.train(_config(cache_dir, 1), str(tmp_path / "a"))


def _produce_then(action):
  """A worker's produce(): two items, then `action` in the child."""

  class P:
    busy_seconds, batches = 0.0, 0

    def __iter__(self):
      for i in range(2):
        buf = np.full((1, 8), i, np.int32)
        from recgnn.train import inputs

        layout = inputs.PackLayout(None, ())
        yield Item("train", None, 8, (([buf], []), layout))
      action()

  return lambda: P()


def test_a_worker_killed_is_reported_with_its_exit_code():
  """A child that dies without a word (SIGKILL, a crash): the receiver says so within
  POLL_S, naming the signal; the items before it arrive intact."""
  w = InputWorker(_produce_then(lambda: os.kill(os.getpid(), signal.SIGKILL)), slots=4)
  got = []
  try:
    with pytest.raises(InputWorkerError, match=r"died with exit code -9"):
      for item in w:
        got.append(int(item.prepared[0][0][0][0, 0]))
        item.release()
  finally:
    w.close()
  assert got == [0, 1]
  assert not glob.glob(w._prefix + "-*")


def test_plans_a_worker_cannot_serve_are_refused_or_left_on_the_thread(
  cache_dir, tmp_path, monkeypatch
):
  """offload (its planner mirrors the device cache; its host tables have one writer): refused
  with train.input_workers=1, on the thread (the log line says why) with auto; dense: a worker
  with auto where the host has MIN_CPUS, else the thread (saying so)."""
  from recgnn.train import setup

  offload = ((".*", "offload(cache_rows=2048)"),)
  with pytest.raises(ValueError, match=r"input_workers=1, but .*offload.*stateless_prepare"):
    loop.train(_config(cache_dir, 1, plan=offload, steps=4), str(tmp_path / "a"))
  with pytest.raises(ValueError, match=r"input_workers=3: valid are"):
    loop.train(_config(cache_dir, 3, steps=4), str(tmp_path / "b"))
  monkeypatch.setattr(input_worker, "available_cpus", lambda: input_worker.MIN_CPUS)
  for plan, want in ((offload, 0), (None, 1)):
    run = setup.build(_config(cache_dir, -1, plan=plan), allocate=False)
    n, why = input_worker.workers_for(-1, run.task, run.plan)
    assert n == want, why
    assert ("thread" in why and "offload" in why) if want == 0 else "worker process" in why
  monkeypatch.setattr(input_worker, "available_cpus", lambda: 2)
  n, why = input_worker.workers_for(-1, run.task, run.plan)
  assert n == 0 and "2 CPU(s)" in why, why
  assert input_worker.workers_for(1, run.task, run.plan)[0] == 1


def test_a_worker_whose_parent_dies_leaves_no_file(tmp_path):
  """The training process killed while the worker's slots hold batches it never received:
  the worker finds its parent gone and removes the ring's files. The parent dies only once
  the child's slot file exists (it prints how many), so the test cannot pass on a child that
  never made one; each side waits on its condition with a generous bound, no fixed sleep."""
  import subprocess
  import sys
  import time

  if input_worker.SHM_DIR is None:
    pytest.skip("no /dev/shm")
  script = tmp_path / "parent.py"
  script.write_text(
    "import glob, os, time\n"
    "from recgnn.train.input_worker import InputWorker, SHM_DIR\n"
    "from tests.test_input_worker import _produce_then\n"
    "w = InputWorker(_produce_then(lambda: time.sleep(60)), slots=1)\n"
    "mine = os.path.join(SHM_DIR, f'recgnn-input-{os.getpid()}-*')\n"
    "deadline = time.monotonic() + 60\n"  # (the child fills its slot, a file never opened)
    "while not glob.glob(mine) and time.monotonic() < deadline:\n"
    "  time.sleep(0.02)\n"
    "print('slot files', len(glob.glob(mine)), flush=True)\n"
    "os._exit(0)\n"
  )
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.Popen(
    [sys.executable, str(script)], cwd=root, env={**os.environ, "PYTHONPATH": root},
    stdout=subprocess.PIPE, text=True,
  )  # fmt: skip
  out, _ = proc.communicate(timeout=120)
  assert proc.returncode == 0
  assert int(out.split("slot files")[-1]) >= 1, "no slot file made before the parent died"
  pattern = os.path.join(input_worker.SHM_DIR, f"recgnn-input-{proc.pid}-*")
  deadline = time.monotonic() + 30
  while glob.glob(pattern) and time.monotonic() < deadline:
    time.sleep(0.05)
  assert not glob.glob(pattern)
