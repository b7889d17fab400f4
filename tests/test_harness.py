"""The benchmark harness (benchmarks/harness/): the environment set before jax, the results
files, the rounds of separate processes and the shared DLRM task."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from benchmarks import harness
from benchmarks.harness import dlrm_task
from recgnn import planner, sharding
from recgnn.embeddings import base
from recgnn.train import step as step_lib
from recgnn.train import train_state as state_lib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _script(code: str, xla_flags: str = "") -> subprocess.CompletedProcess:
  """`code` run as a benchmark would be: benchmarks/ on sys.path, a fresh process."""
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags)
  pre = f"import sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); "
  return subprocess.run(
    [sys.executable, "-c", pre + code], env=env, capture_output=True, text=True, timeout=300
  )


def test_simulated_devices_before_jax_starts_and_refused_after():
  ok = _script(
    "import harness; n = harness.simulated_devices(4); import jax; print(n, jax.device_count())"
  )
  assert ok.returncode == 0, ok.stderr
  assert ok.stdout.split() == ["4", "4"]
  # The caller's XLA_FLAGS win: a count already set is kept.
  kept = _script(
    "import harness; print(harness.simulated_devices(4))",
    xla_flags="--xla_force_host_platform_device_count=2",
  )
  assert kept.stdout.split() == ["2"], kept.stderr
  late = _script("import harness, jax; jax.devices(); harness.simulated_devices(4)")
  assert late.returncode != 0 and "before the first jax computation" in late.stderr, late.stderr


def test_the_tree_is_first_on_the_path():
  out = _script("import harness, recgnn; print(recgnn.__file__)")
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip().startswith(str(ROOT / "recgnn")), out.stdout


def test_write_results_records_the_machine_and_both_loads(tmp_path):
  payload = harness.record({"steps": 3}, argv=["--steps=3"])
  payload["value"] = np.float32(1.5)  # not JSON: written as its str
  md = harness.md_table(["a", "b"], [[1, 2]])
  path = harness.write_results("x", payload, md, tmp_path, show=False)
  got = json.loads(path.with_suffix(".json").read_text())
  assert got["argv"] == ["--steps=3"] and got["args"] == {"steps": 3}
  assert len(got["machine"]["load_avg_at_start"]) == len(got["machine"]["load_avg_at_end"]) == 3
  assert got["value"] == "1.5"
  assert path.with_suffix(".md").read_text() == "| a | b |\n|---|---:|\n| 1 | 2 |"


def test_rounds_run_every_contestant_once_per_round_in_the_given_order():
  seen = []

  def run(c, r):
    seen.append((r, c))
    return {"v": r}

  runs = harness.rounds(3, lambda r: harness.rotated(["a", "b", "c"], r), run)
  assert seen == [(0, "a"), (0, "b"), (0, "c"), (1, "b"), (1, "c"), (1, "a"), (2, "c")] + [
    (2, "a"),
    (2, "b"),
  ]
  assert [x["v"] for x in runs["a"]] == [0, 1, 2] and all("load_before" in x for x in runs["a"])
  assert harness.alternated(["x", "y"], 1) == ["y", "x"]
  assert harness.distribution([3, 1, 2]) == {"min": 1, "median": 2, "max": 3}


def test_run_checked_stops_with_the_failed_childs_last_lines():
  cmd = [sys.executable, "-c", "print('first'); print('last'); raise SystemExit(5)"]
  with pytest.raises(SystemExit, match="child failed \\(exit 5\\):\nfirst\nlast"):
    harness.run_checked(cmd, what="child")


def test_dlrm_task_trains_the_given_tables_with_the_trainers_step():
  """GivenTables is the CTR task's model and loss over the tables it is given: the trainer's
  own step over them lowers the loss on a repeated batch."""
  import optax

  specs = [base.TableSpec(name=n, num_rows=50, dim=8) for n in ("a", "b")]
  mesh = sharding.make_mesh(1, 1)
  task = dlrm_task.dlrm(specs, mesh, bottom=(16, 8), top=(16, 1))
  assert task.tables() == specs and task.steps_per_epoch() is None
  group = planner.make_group("dense", specs, mesh)
  plan = planner.Plan({group.name: group}, {s.name: group.name for s in specs}, mesh)
  rng = np.random.default_rng(0)
  batch = {
    "dense": rng.random((32, 13), np.float32),
    "label": (rng.random(32) < 0.5).astype(np.float32),
    "weight": np.ones(32, np.float32),
  }
  ids = {s.name: rng.integers(0, 50, (32, 1)).astype(np.int32) for s in specs}
  tx = optax.sgd(0.5)
  state = state_lib.init_state(task, plan, tx, jax.random.key(0), {**batch, "ids": ids})
  step = jax.jit(step_lib.make_train_step(task, plan, tx))
  prepared = {group.name: group.prepare(ids, [], train=True)}
  losses = []
  for _ in range(5):
    state, metrics = step(state, prepared, batch)[:2]
    losses.append(float(metrics["loss"]))
  assert losses[-1] < losses[0], losses
  with pytest.raises(NotImplementedError, match="no dataset"):
    task.train_batches()
