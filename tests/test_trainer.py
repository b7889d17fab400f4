"""The trainer end to end on a tiny synthetic Criteo dataset: resume, SIGTERM, plans, CLI."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
import sklearn.metrics

import run as run_lib
from recgnn import metrics, planner, sharding
from recgnn.train import loop
from tests.trainer_lib import (
  skip_unless_deterministic,
  skip_unless_devices,
  smoke_config,
  state_leaves,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def cache_dir(ctr_cache):
  return ctr_cache  # (conftest: one per process)


def _config(cache_dir, **train):
  """The smoke run on 4 of the synthetic data's tables (trainer_lib.FEW_TABLES: the large
  tables the plans below name and a tiny one): no property here needs Criteo's 26, which
  cost ~3x the init, tracing and execution (test_results_and_scalars_written keeps 26: the
  oracle AUC is the Criteo reader's)."""
  return smoke_config(cache_dir, tables=4, **{"checkpoint_every": 6, **train})


_leaves = state_leaves


def test_resume_gives_identical_parameters(cache_dir, tmp_path):
  skip_unless_deterministic()
  config = _config(cache_dir)
  full = loop.train(config, str(tmp_path / "full"))
  # Interrupted after 5 steps (not on a checkpoint boundary), then resumed to the end.
  part = loop.train(config, str(tmp_path / "part"), stop_after=5)
  assert part.metrics["step"] == 5
  resumed = loop.train(config, str(tmp_path / "part"), resume=True)
  assert resumed.metrics["step"] == config.train.steps
  a, b = _leaves(full.state), _leaves(resumed.state)
  assert len(a) == len(b)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x, y)
  assert resumed.metrics["test/auc"] == full.metrics["test/auc"]
  # And the resumed steps changed the model (the comparison above is not vacuous): the state
  # at the interruption has other params and tables than the end's.
  stopped, end = (_leaves(r.state.replace(step=0, opt_state=())) for r in (part, full))
  assert any(not np.array_equal(x, y) for x, y in zip(stopped, end))


def test_results_and_scalars_written(cache_dir, tmp_path):
  config = smoke_config(cache_dir, checkpoint_every=6)  # (26 tables: the oracle AUC)
  res = loop.train(config, str(tmp_path))
  saved = json.loads((tmp_path / "results.json").read_text())
  assert saved["test/auc"] == pytest.approx(res.metrics["test/auc"])
  assert 0.0 < saved["test/oracle_auc"] <= 1.0
  lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [x["step"] for x in lines if "loss" in x] == [4, 8, 12]
  assert os.listdir(tmp_path / "tensorboard")


def test_memory_budget_refuses_before_allocating(cache_dir, tmp_path):
  config = _config(cache_dir)
  with pytest.raises(planner.PlanDoesNotFit, match="budget"):
    loop.train(config, str(tmp_path), device_memory_budget=1000)
  assert not os.path.exists(tmp_path / "checkpoints" / "0")


def test_unknown_backend_in_plan_lists_available(cache_dir, tmp_path):
  config = _config(cache_dir)
  config.embeddings.plan = [(".*", "dense2")]
  with pytest.raises(ValueError, match="available: .*dense"):
    loop.train(config, str(tmp_path))


def test_profile_trace_written(cache_dir, tmp_path):
  config = _config(cache_dir, steps=6, checkpoint_every=0)
  loop.train(config, str(tmp_path), profile_steps=(2, 4))
  found = [f for _, _, fs in os.walk(tmp_path / "profile") for f in fs]
  assert any(f.endswith(".xplane.pb") for f in found), found


def test_auc_matches_sklearn():
  rng = np.random.default_rng(0)
  y = rng.random(5000) < 0.3
  s = np.round(rng.random(5000) + 0.4 * y, 2)  # rounding makes ties
  w = (rng.random(5000) < 0.9).astype(np.float32)
  assert metrics.auc(y, s) == pytest.approx(sklearn.metrics.roc_auc_score(y, s), abs=1e-12)
  keep = w > 0
  assert metrics.auc(y, s, w) == pytest.approx(
    sklearn.metrics.roc_auc_score(y[keep], s[keep]), abs=1e-12
  )
  p = np.clip(s / 1.5, 0.01, 0.99)
  assert metrics.logloss(y, p) == pytest.approx(sklearn.metrics.log_loss(y, p), rel=1e-9)


def test_average_ranks_are_scipys():
  """metrics.average_ranks (numpy, for the trainer's start-up) = scipy.stats.rankdata."""
  import scipy.stats

  rng = np.random.default_rng(1)
  for x in (np.round(rng.random(3000), 2), rng.random(100), np.zeros(7), np.array([2.0])):
    np.testing.assert_array_equal(metrics.average_ranks(x), scipy.stats.rankdata(x))
  assert np.isnan(metrics.average_ranks(np.array([1.0, np.nan]))).all()


def test_unknown_experiment_lists_valid_ones():
  with pytest.raises(SystemExit, match="Available: .*dlrm_kaggle.*smoke"):
    run_lib.load_config("dlrm_kagle")


def test_unknown_override_key_fails_with_keys():
  config = run_lib.load_config("smoke")
  with pytest.raises(SystemExit, match="Did you mean steps"):
    run_lib._check_overrides(config, ["--config.train.stepz=3"])
  run_lib._check_overrides(config, ["--config.train.steps=3"])  # valid: no error


def test_cli_list_and_sigterm_checkpoint(cache_dir, tmp_path):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  out = subprocess.run(
    [sys.executable, "run.py", "--list"], cwd=ROOT, env=env, capture_output=True, text=True
  )
  assert out.returncode == 0 and "dlrm_kaggle" in out.stdout and "smoke" in out.stdout
  workdir = str(tmp_path / "wd")
  few = _config(cache_dir)  # (its 4 tables: the data file and schema, on the command line)
  cmd = [
    sys.executable, "run.py", "--experiment=smoke", f"--workdir={workdir}",
    f"--config.data.cache_dir={cache_dir}", "--config.data.synthetic.rows=20000",
    f"--config.data.path={few.data.path}", f"--config.data.schema={few.data.schema}",
    "--config.train.steps=100000", "--config.train.log_every=5",
    "--config.train.checkpoint_every=0",
  ]  # fmt: skip
  proc = subprocess.Popen(
    cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
  )
  deadline = time.time() + 240
  for line in proc.stdout:
    if line.startswith("step") or time.time() > deadline:
      break
  proc.send_signal(signal.SIGTERM)
  rest = proc.communicate(timeout=120)[0]
  assert "SIGTERM" in rest, rest[-2000:]
  steps = [int(d) for d in os.listdir(os.path.join(workdir, "checkpoints")) if d.isdigit()]
  assert steps and max(steps) >= 5


# ----------------------------------------------------------------------------- mesh


def _on_mesh(config, data, model, plan=None):
  skip_unless_devices(data * model, f"mesh {data}x{model}")
  config = config.copy_and_resolve_references()
  config.mesh = {"data": data, "model": model}
  if plan is not None:
    config.embeddings.plan = plan
  return config


def _tables(result):
  out = {}
  for key, group in result.plan.groups.items():
    out.update(group.tables(result.state.emb[key]))
  return out


@pytest.fixture(scope="module")
def one_device_run(cache_dir, tmp_path_factory):
  """The uninterrupted reference: 12 steps on one device, every table dense."""
  config = _on_mesh(_config(cache_dir, checkpoint_every=0), 1, 1)
  return loop.train(config, str(tmp_path_factory.mktemp("ref")))


@pytest.mark.parametrize(
  "mesh,plan",
  [
    ((8, 1), ((".*", "dense"),)),
    ((2, 4), (("C(3|4|10|16|21)", "dense(shard=rows)"), (".*", "dense"))),
    ((2, 4), ((".*", "sharded"),)),
  ],
  ids=["8x1-dense", "2x4-rows", "2x4-sharded"],
)
def test_mesh_matches_one_device(cache_dir, tmp_path, one_device_run, mesh, plan):
  """The batch split over 8 devices (and tables replicated or row-sharded) gives the params,
  tables and test AUC of the 1-device run, to float tolerance (sums over the batch are
  reduced across devices in another order)."""
  skip_unless_devices(mesh[0] * mesh[1], f"mesh {mesh[0]}x{mesh[1]}")
  config = _config(cache_dir, checkpoint_every=0)
  one = one_device_run  # (the same config on 1x1: one run for every test that compares)
  many = loop.train(_on_mesh(config, *mesh, plan=plan), str(tmp_path / "many"))
  a = jax.tree.leaves(jax.device_get(one.state.params))
  b = jax.tree.leaves(jax.device_get(many.state.params))
  for x, y in zip(a, b):
    np.testing.assert_allclose(x, y, rtol=2e-4, atol=2e-6)
  ta, tb = _tables(one), _tables(many)
  assert ta.keys() == tb.keys()
  for n in ta:
    np.testing.assert_allclose(ta[n], tb[n], rtol=2e-4, atol=2e-6, err_msg=n)
  assert abs(one.metrics["test/auc"] - many.metrics["test/auc"]) < 1e-3
  # The step really ran on 8 devices.
  assert len(jax.tree.leaves(many.state.params)[0].sharding.device_set) == 8


def test_budget_refuses_replicated_then_row_sharded_fits(cache_dir, tmp_path):
  """A plan over the per-device budget is refused before allocating, with the numbers; the
  same tables row-sharded over 8 devices fit the same budget and train."""
  skip_unless_devices(8, "meshes 8x1 and 1x8")
  config = _config(cache_dir, steps=4, checkpoint_every=0)
  replicated = _on_mesh(config, 8, 1)
  task = loop.load_task(replicated, loop.config_mesh(replicated))
  rows_plan = ((".*", "dense(shard=rows)"),)

  def per_device(data, model, plan):
    mesh = sharding.make_mesh(data, model)
    return planner.check_memory(planner.resolve_plan(plan, task.tables(), mesh, log=False), None)

  full, split = per_device(8, 1, ((".*", "dense"),)), per_device(1, 8, rows_plan)
  assert split < full / 4  # (tiny tables pad to base.ROW_ALIGN rows, hence not full / 8)
  budget = (full + split) // 2
  with pytest.raises(planner.PlanDoesNotFit, match=r"per device on mesh 8x1.*budget is"):
    loop.train(replicated, str(tmp_path / "a"), device_memory_budget=budget)
  assert not os.path.exists(tmp_path / "a" / "checkpoints" / "0")
  sharded = _on_mesh(config, 1, 8, plan=rows_plan)
  res = loop.train(sharded, str(tmp_path / "b"), device_memory_budget=budget)
  assert res.metrics["step"] == 4 and np.isfinite(res.metrics["test/auc"])
  big = max(task.tables(), key=lambda s: s.num_rows).name
  table = res.state.emb["dense"][big]["table"]
  assert table.sharding.spec == sharding.P(sharding.MODEL, None)
  assert table.addressable_shards[0].data.shape[0] == -(-table.shape[0] // 8)


def test_batch_that_does_not_divide_over_the_mesh_is_refused(cache_dir, tmp_path):
  config = _on_mesh(_config(cache_dir), 8, 1)
  config.train.batch_size = 100
  with pytest.raises(ValueError, match="train batch size 100 does not divide over the 8"):
    loop.train(config, str(tmp_path))


def test_epochs_set_the_training_length(cache_dir, tmp_path):
  config = _config(cache_dir, steps=0, checkpoint_every=0)
  config.train.epochs = 0.25
  task = loop.load_task(config, loop.config_mesh(config))
  per_epoch = task.steps_per_epoch()
  assert per_epoch == task.data.num_batches("train", config.train.batch_size) > 4
  steps, how = loop.training_length(config.train, task)
  assert steps == round(0.25 * per_epoch) and "0.25 epoch" in how
  config.train.steps = 3  # an explicit step count wins
  assert loop.training_length(config.train, task)[0] == 3
  config.train.steps, config.train.epochs = 0, 0.0
  with pytest.raises(ValueError, match="train.epochs"):
    loop.training_length(config.train, task)


# ----------------------------------------------------------------------------- resharding


@pytest.mark.parametrize(
  "save,resume",
  [
    (((8, 1), "dense"), ((1, 1), "dense")),
    (((1, 1), "dense"), ((1, 8), "dense(shard=rows)")),
    # Offload for the 5 large tables (their caches evict) and the rest back to replicated
    # dense: offloading the 21 tiny ones too only adds compile time (test_offload does it).
    (
      ((2, 4), "dense(shard=rows)"),
      (
        (1, 1),
        (("C(3|4|10|16|21)", "offload(cache_fraction=0.5, min_cache_rows=256)"), (".*", "dense")),
      ),
    ),  # fmt: skip
    (((2, 4), "sharded"), ((1, 8), "sharded(kind=column)")),
  ],
  ids=[
    "8x1->1x1",
    "dense->rows@1x8",
    "rows@2x4->offload+dense@1x1",
    "sharded@2x4->column@1x8",
  ],
)
def test_resume_on_another_mesh_and_backend(cache_dir, tmp_path, one_device_run, save, resume):
  """A run stopped after 5 steps and resumed on another mesh and/or with another backend for
  every table (a backend string, or plan rules) ends with the uninterrupted 1-device run's
  tables and params."""
  (m1, b1), (m2, b2) = save, resume
  skip_unless_devices(max(m1[0] * m1[1], m2[0] * m2[1]), f"meshes {m1} and {m2}")
  config = _config(cache_dir, checkpoint_every=0)
  wd = str(tmp_path / "wd")
  part = loop.train(_on_mesh(config, *m1, plan=((".*", b1),)), wd, stop_after=5)
  assert part.metrics["step"] == 5
  plan = ((".*", b2),) if isinstance(b2, str) else b2
  res = loop.train(_on_mesh(config, *m2, plan=plan), wd, resume=True)
  assert {g.split("(")[0] for g in res.plan.groups} == {r[1].split("(")[0] for r in plan}
  if any(k.startswith("offload") for k in res.plan.groups):  # a cache evicted after restore
    logged = [json.loads(x) for x in (tmp_path / "wd" / "metrics.jsonl").read_text().splitlines()]
    assert any(v > 0 for x in logged for k, v in x.items() if k.endswith("d2h_rows_per_step"))
  assert res.metrics["step"] == config.train.steps
  ref = one_device_run
  for x, y in zip(jax.tree.leaves(jax.device_get(ref.state.params)),
                  jax.tree.leaves(jax.device_get(res.state.params))):  # fmt: skip
    np.testing.assert_allclose(x, y, rtol=2e-4, atol=2e-6)
  ta, tb = _tables(ref), _tables(res)
  for n in ta:
    np.testing.assert_allclose(ta[n], tb[n], rtol=2e-4, atol=2e-6, err_msg=n)


def test_resume_into_an_incompatible_backend_is_refused(cache_dir, tmp_path):
  """A TT table cannot become rows (or rows TT) without a lossy conversion: refused, naming
  the table and both backends."""
  from recgnn.train import checkpoint

  config = _config(cache_dir, checkpoint_every=0)
  wd = str(tmp_path / "wd")
  loop.train(_on_mesh(config, 1, 1, plan=(("C16", "tt(rank=4)"), (".*", "dense"))), wd,
             stop_after=2)  # fmt: skip
  with pytest.raises(checkpoint.IncompatibleCheckpoint, match=r"table C16 format: checkpoint 'tt"):
    loop.train(_on_mesh(config, 1, 1), wd, resume=True)


def test_task_artifacts_saved_and_checked_on_resume(cache_dir, tmp_path, monkeypatch):
  """Task.artifacts (e.g. a node permutation) is saved beside the checkpoints; resuming with
  different artifacts is refused."""
  from recgnn.tasks import ctr
  from recgnn.train import checkpoint

  perm = np.arange(10)[::-1].copy()
  monkeypatch.setattr(ctr.CTR, "artifacts", lambda self: {"perm": perm})
  config = _config(cache_dir, checkpoint_every=0)
  wd = str(tmp_path / "wd")
  loop.train(config, wd, stop_after=2)
  with np.load(os.path.join(wd, "checkpoints", "artifacts.npz")) as saved:
    np.testing.assert_array_equal(saved["perm"], perm)
  loop.train(config, wd, resume=True, stop_after=1)  # same artifacts: fine
  monkeypatch.setattr(ctr.CTR, "artifacts", lambda self: {"perm": perm[::-1].copy()})
  with pytest.raises(checkpoint.IncompatibleCheckpoint, match="artifact 'perm' differs"):
    loop.train(config, wd, resume=True)
  # A damaged artifacts file is refused naming it, never compared as data (issue 44 item 4).
  art = os.path.join(wd, "checkpoints", "artifacts.npz")
  with open(art, "r+b") as f:
    f.truncate(os.path.getsize(art) // 2)
  with pytest.raises(checkpoint.IncompatibleCheckpoint, match=f"{art} is damaged"):
    loop.train(config, wd, resume=True)


def test_sharded_codec_state_resumes_exactly(cache_dir, tmp_path):
  """`sharded` with the adaptive error-bounded codec on 2 x 4: a run stopped after 5 steps
  and resumed (the codec's bounds and EMAs restored from the checkpoint) ends bit-identical
  to the uninterrupted run, codec state included; its bounds really adapted."""
  skip_unless_deterministic()
  config = _on_mesh(
    _config(cache_dir, checkpoint_every=0), 2, 4, plan=((".*", "sharded(codec=eb)"),)
  )
  full = loop.train(config, str(tmp_path / "full"))
  part = loop.train(config, str(tmp_path / "part"), stop_after=5)
  resumed = loop.train(config, str(tmp_path / "part"), resume=True)
  a, b = _leaves(full.state), _leaves(resumed.state)
  assert len(a) == len(b)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x, y)
  group = full.plan.groups["sharded"]
  rep = group.report(full.state.emb["sharded"])
  assert rep["fwd/steps"] == config.train.steps
  bounds = [v for k, v in rep.items() if k.startswith("fwd/bound/")]
  assert len(set(bounds)) > 1  # per table, not one bound
  assert part.metrics["step"] == 5 and "emb/sharded/fwd_bytes_per_step" in full.metrics


def test_builds_with_an_equal_model_share_its_init_program(cache_dir):
  """The dense params' init is the task's hashable `Task.init_fn` jitted as a static argument
  (train_state._shared_init): a second build of an equal model adds no program to that function's
  cache (before, every build traced, lowered and loaded its own), a build of another model
  adds one, and the params are those of the task's own init_params jitted alone."""
  from recgnn.train import setup
  from recgnn.train import train_state as state_lib

  state_lib._shared_init.clear_cache()  # (what earlier tests in this process built)
  config = _config(cache_dir, mesh=(1, 1))
  first = setup.build(config)
  assert state_lib._shared_init._cache_size() == 1
  run = setup.build(config)
  assert state_lib._shared_init._cache_size() == 1
  wider = _config(cache_dir, mesh=(1, 1))
  wider.model.top = (48, 1)
  setup.build(wider)
  assert state_lib._shared_init._cache_size() == 2
  _, k_params, _ = jax.random.split(run.key, 3)
  zeros = {
    n: np.zeros(run.example["ids"][n].shape[:1] + (s.dim,), np.float32)
    for n, s in run.plan.specs.items()
  }
  want = jax.jit(run.task.init_params)(k_params, state_lib.device_batch(run.example), zeros)
  for got in (first.state.params, run.state.params):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
