"""Nothing waits forever: a stalled device (one device blocked, the others waiting for it
in a collective) ends the run through the trainer's watchdog with every thread's stack and
the step named; SIGTERM during such a step ends the process within its grace period, saving
nothing; a test that hangs in a collective is ended by pytest-timeout with the stacks."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from recgnn.train import watchdog
from tests.trainer_lib import xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT, "XLA_FLAGS": xla_flags(8)}


def _stalled_run(workdir, cache, stall_after, **train):
  """Train `smoke` on 8 devices; from train step `stall_after` + 1 on, device 0 blocks in a
  host callback forever, so the other 7 wait for it in the step's collectives."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.experimental import io_callback

  from recgnn.tasks import ctr
  from recgnn.train import loop
  from tests.trainer_lib import smoke_config

  calls = [0]

  def host(x):
    calls[0] += 1
    if calls[0] > stall_after:
      print(f"stalling device 0 in step {calls[0]}", flush=True)
      threading.Event().wait()
    return np.zeros((), np.float32)

  original = ctr.CTR.loss

  def loss(self, params, batch, embeddings, key):
    value, aux = original(self, params, batch, embeddings, key)
    # A callback runs on one device (0); its result is broadcast to the other devices.
    stall = io_callback(host, jax.ShapeDtypeStruct((), jnp.float32), batch["label"][0])
    return value + 0.0 * stall, aux

  ctr.CTR.loss = loss
  # (4 tables: what a stall does to the step does not need Criteo's 26)
  config = smoke_config(cache, mesh=(8, 1), steps=100_000, log_every=2, tables=4, **train)
  loop.train(config, workdir)


def _launch(tmp_path, cache, stall_after, **train):
  """`cache`: the worker's CTR data cache (conftest's `ctr_cache`): the smoke data the
  other trainer tests of the worker converted, not generated again in each process."""
  args = [f"{k}={v}" for k, v in train.items()]
  cmd = [sys.executable, os.path.abspath(__file__), "stall", str(tmp_path / "wd"),
         cache, str(stall_after), *args]  # fmt: skip
  return subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)  # fmt: skip


def test_watchdog_reports_a_stalled_device(tmp_path, ctr_cache):
  """The bound of a step (20 x the median step, at least 5 s: a smoke step on 8 devices is
  ~0.1 s quiet) holds for every step before the stall at a load of 4 (the other worker
  beside this one), so only the stalled step ends the run."""
  t0 = time.time()
  proc = _launch(tmp_path, ctr_cache, 6, watchdog_factor=20, watchdog_min_s=5, watchdog_first_s=300)
  out, err = proc.communicate(timeout=600)
  assert proc.returncode == watchdog.EXIT_HUNG, out[-3000:] + err[-3000:]
  assert "stalling device 0 in step 7" in out
  # The report: every thread's stack (the main thread waiting for the step), the unit and
  # its bound, the step count.
  assert "Thread 0x" in err and "(most recent call first)" in err, err[-3000:]
  assert "in _train_in" in err and "sharding.py" in err, err[-3000:]
  last = err.strip().splitlines()[-1]
  assert last.startswith("Watchdog: step 8 has not finished after "), last
  assert "20 x the median step" in last and "steps launched: 7" in last, last
  assert time.time() - t0 < 600


def test_sigterm_during_a_hung_step_exits_within_its_grace(tmp_path, ctr_cache):
  # A grace of 2 s (the trainer's default is 120): the process must wait it out (the step
  # never ends), then exit; the test waits for the grace, so it is kept short.
  proc = _launch(tmp_path, ctr_cache, 6, watchdog_factor=0, sigterm_grace_s=2, checkpoint_every=0)
  for line in proc.stdout:  # training runs, then device 0 stalls
    if line.startswith("stalling device 0"):
      break
  time.sleep(1)  # the main thread is waiting for the stalled step
  t0 = time.time()
  proc.send_signal(signal.SIGTERM)
  out, err = proc.communicate(timeout=120)
  took = time.time() - t0
  assert proc.returncode == watchdog.EXIT_SIGTERM, out[-3000:] + err[-3000:]
  assert 1.8 < took < 60, took
  assert "SIGTERM" in err and "exiting without saving" in err and "Thread 0x" in err, err[-3000:]
  assert not os.path.exists(tmp_path / "wd" / "checkpoints" / "7")
  steps = os.listdir(tmp_path / "wd" / "checkpoints") if (tmp_path / "wd").exists() else []
  assert not [s for s in steps if s.isdigit()], steps  # saved nothing


HUNG_TEST = """
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback
from jax.sharding import NamedSharding, PartitionSpec as P


mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))


def stall(x):
  threading.Event().wait()  # device 0 never arrives
  return np.zeros((), np.float32)


@jax.jit
def f(x):
  return x.sum() + io_callback(stall, jax.ShapeDtypeStruct((), jnp.float32), x[0])


# Compiled at collection, before the test's timer starts: the test reaches its hang at once,
# however long an 8-device compile takes on a loaded machine.
x = jax.device_put(np.arange(8.0), NamedSharding(mesh, P("d")))
compiled = f.lower(x).compile()


def test_hung_collective():
  compiled(x).block_until_ready()
"""


def test_a_hung_collective_is_reported_by_pytest_timeout(tmp_path):
  """pytest-timeout (the `timeout` option in pyproject.toml) with the thread method: a test
  blocked in C++ (no Python signal handler would run) is ended with every thread's stack.
  (A timeout of 3 s: jax imported and the hanging program compiled at collection, before the
  timer starts, so the test is in its hang at once; the test waits the timeout out.)"""
  pytest.importorskip("pytest_timeout")
  (tmp_path / "test_hung.py").write_text(textwrap.dedent(HUNG_TEST))
  cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path),
         f"--rootdir={tmp_path}", "-o", "timeout=3", "-o", "timeout_method=thread"]  # fmt: skip
  t0 = time.time()
  out = subprocess.run(cmd, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
  text = out.stdout + out.stderr
  assert out.returncode != 0
  assert time.time() - t0 < 200
  assert "Timeout" in text and "Stack of" in text, text[-3000:]
  assert "test_hung_collective" in text and "block_until_ready" in text, text[-3000:]


@pytest.mark.serial  # bounds from sleeps of 0.1 s: a loaded machine stretches them
def test_bounds_follow_the_median_and_the_first_unit_is_generous():
  fired = []
  dog = watchdog.Watchdog(factor=4, min_s=0.2, first_s=30, exit=fired.append, log=lambda m: None)
  try:
    assert dog.bound("step") == 30  # the first step compiles
    for _ in range(3):
      with dog.unit("step", "a step"):
        time.sleep(0.1)
    assert 0.4 <= dog.bound("step") < 0.8  # 4 x ~0.1 s
    with dog.unit("step", "step 4"):
      time.sleep(2.0)
    assert fired == [watchdog.EXIT_HUNG]
  finally:
    dog.close()


def test_the_bounds_defaults_are_set_in_one_place():
  """run.py's config defaults, a bare `Watchdog` and `Watchdog.from_config` of a config
  without the keys all take `watchdog.CONFIG_DEFAULTS`; a key given wins."""
  import ml_collections

  import run

  config = run.with_defaults(ml_collections.ConfigDict({"train": {"watchdog_min_s": 7.0}}))
  assert dict(config.train).items() >= {**watchdog.CONFIG_DEFAULTS, "watchdog_min_s": 7.0}.items()
  for dog in (watchdog.Watchdog(log=lambda m: None), watchdog.Watchdog.from_config({})):
    try:
      got = (dog.factor, dog.min_s, dog.first_s, dog.grace_s)
      assert got == tuple(watchdog.CONFIG_DEFAULTS.values())
    finally:
      dog.close()
  dog = watchdog.Watchdog.from_config(config.train, log=lambda m: None)
  assert dog.min_s == 7.0 and dog.factor == watchdog.CONFIG_DEFAULTS["watchdog_factor"]
  dog.close()


if __name__ == "__main__":  # the stalled runs above
  _, what, workdir, cache, stall_after, *rest = sys.argv
  assert what == "stall"
  train = {k: float(v) for k, v in (a.split("=") for a in rest)}
  if "checkpoint_every" in train:
    train["checkpoint_every"] = int(train["checkpoint_every"])
  _stalled_run(workdir, cache, int(stall_after), **train)
  sys.exit("not stalled")
