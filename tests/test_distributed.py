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
pytestmark = pytest.mark.slow


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _launch(workdir, cache_dir, port, extra=()):
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}  # fmt: skip
  procs = []
  for pid in range(2):
    cmd = [
      sys.executable, "run.py", "--experiment=smoke", f"--workdir={workdir}",
      f"--config.data.cache_dir={cache_dir}", "--config.data.synthetic.rows=20000",
      "--config.mesh.data=8", f"--coordinator_address=127.0.0.1:{port}",
      "--num_processes=2", f"--process_id={pid}", *extra,
    ]  # fmt: skip
    procs.append(
      subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True)  # fmt: skip
    )
  return procs


def _config(cache_dir, steps):
  from experiments import smoke

  c = smoke.get_config()
  c.data.cache_dir = cache_dir
  c.data.synthetic.rows = 20_000
  c.train.steps = steps
  c.mesh = {"data": 8, "model": 1}
  return c


def test_two_processes_match_one_process_with_8_devices(tmp_path):
  cache = str(tmp_path / "cache")
  steps = 12
  extra = [f"--config.train.steps={steps}", "--config.train.checkpoint_every=0"]
  procs = _launch(str(tmp_path / "mp"), cache, _free_port(), extra)
  outs = [p.communicate(timeout=600)[0] for p in procs]
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out[-3000:]
  assert "test/auc" in outs[0] and "process 0 of 2" in outs[0]
  assert not os.path.exists(tmp_path / "mp" / "results.json.1")
  # The same run in this process, on its 8 devices.
  ref = loop.train(_config(cache, steps), str(tmp_path / "one"))
  restored = checkpoint.Checkpointer(str(tmp_path / "mp")).restore(ref.state, ref.plan)
  assert int(restored.step) == steps
  a = jax.tree.leaves(jax.device_get(ref.state.params))
  b = jax.tree.leaves(jax.device_get(restored.params))
  for x, y in zip(a, b):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)
  for key, group in ref.plan.groups.items():
    ta, tb = group.tables(ref.state.emb[key]), group.tables(restored.emb[key])
    for n in ta:
      np.testing.assert_allclose(ta[n], tb[n], rtol=1e-5, atol=1e-7, err_msg=n)


def test_killing_one_process_ends_the_other_with_a_clear_error(tmp_path):
  extra = ["--config.train.steps=100000", "--config.train.log_every=2",
           "--config.train.eval_every=0", "--config.train.checkpoint_every=0"]  # fmt: skip
  procs = _launch(str(tmp_path / "mp"), str(tmp_path / "cache"), _free_port(), extra)
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
