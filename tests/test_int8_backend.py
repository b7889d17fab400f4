"""A one-file backend outside the package (tests/int8_backend.py: int8 rows, a float32 scale
per row) loaded by `embeddings.modules`: the contract test within its quantization bound,
its default "rows" checkpoint exact, offered to `auto(...)` by itself, and trained by run.py,
stopped, resumed (--resume) and equal to an uninterrupted run."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys

import contract_lib as contract
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import dlrm_kaggle
from recgnn import planner
from recgnn.embeddings import base, registry
from recgnn.planner import auto
from recgnn.train import checkpoint, loop
from tests.trainer_lib import smoke_config, state_leaves

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULE = os.path.join("tests", "int8_backend.py")  # (as a user names it, from the checkout)
MESHES = [(1, 1), (8, 1), (2, 4)]
OPTIMIZERS = [
  base.OptimizerSpec(name="sgd", learning_rate=0.1),
  base.OptimizerSpec(name="rowwise_adagrad", learning_rate=0.1, initial_accumulator=0.1),
]
# Tolerance against dense, per row of a lookup (an example's pooled row) or of the final table:
# within REL of that row's largest |value| m. One quantization puts a row within scale / 2 <=
# m / 128 of its values (scale = 2^(e-7), m in [2^(e-1), 2^e)); each step requantizes every row
# it touches, and the gradients, which read the lookups, carry the difference on. Measured on
# the contract's batches (6 steps of lr 0.1, bags of 3, one to 8 devices): at most 0.032 of m
# (row-wise Adagrad, step 4), 0.024 with SGD; a stale row or a dropped update is off by ~lr *
# |g|, 10-20% of m here, so REL = 0.06 still catches it.
REL = 0.06


def assert_close_per_row(got: np.ndarray, want: np.ndarray, what: str) -> None:
  """|got - want| <= REL * (each row's largest |want|) elementwise, rows on axis 0."""
  bound = REL * np.abs(want).max(axis=-1, keepdims=True)
  worst = (np.abs(got - want) / np.maximum(bound, 1e-30)).max()
  assert worst <= 1.0, f"int8: {what} differs from dense by {worst:.2f}x the bound (REL={REL})"


@pytest.fixture(scope="module")
def int8():
  """The backend loaded as the trainer loads it (`planner.load_modules`), registered for
  this module's tests only (a later auto plan in this process must not see it)."""
  cwd = os.getcwd()
  os.chdir(ROOT)
  try:
    (name,) = planner.load_modules(MODULE)
  finally:
    os.chdir(cwd)
  mod = sys.modules[name]
  registry.REGISTRY["int8"] = mod.Int8
  yield mod
  registry.REGISTRY.pop("int8", None)


def _spec(opt, pooling="sum"):
  return base.TableSpec(name="t", num_rows=1000, dim=8, optimizer=opt, pooling=pooling)


def test_quantize_is_within_half_a_step_and_idempotent(int8):
  rows = np.random.default_rng(0).standard_normal((64, 16)).astype(np.float32)
  rows[3] = 0.0  # a zero row
  codes, scale = int8.quantize(jnp.asarray(rows))
  back = np.asarray(int8.dequantize(codes, scale))
  s = np.asarray(scale)[:, None]
  assert np.all(
    np.abs(back - rows) <= s / 2 + (np.abs(rows) == np.abs(rows).max(1, keepdims=True)) * s
  )
  again_codes, again_scale = int8.quantize(jnp.asarray(back))
  np.testing.assert_array_equal(np.asarray(again_codes), np.asarray(codes))
  np.testing.assert_array_equal(np.asarray(again_scale), np.asarray(scale))


@functools.cache
def _reference(opt_name: str, pooling: str = "sum") -> contract.Trace:
  (opt,) = (o for o in OPTIMIZERS if o.name == opt_name)
  return contract.run("dense", _spec(opt, pooling), _batches(pooling))


def _batches(pooling: str = "sum") -> list[np.ndarray]:
  if pooling == "mean":
    return contract.zipf_ids(seed=2, num_batches=4, batch=32, bag=4, num_rows=1000)
  return contract.zipf_ids(seed=1, num_batches=6, batch=64, bag=3, num_rows=1000)


def _check(int8_trace: contract.Trace, ref: contract.Trace) -> None:
  for step, (a, b) in enumerate(zip(int8_trace.lookups, ref.lookups, strict=True)):
    assert_close_per_row(a, b, f"lookup at step {step}")
  assert_close_per_row(int8_trace.table, ref.table, "final table")


@pytest.mark.parametrize("mesh_shape", MESHES, ids=lambda m: f"{m[0]}x{m[1]}")
@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: o.name)
def test_int8_matches_dense_within_its_bound(int8, opt, mesh_shape):
  """The contract test's run (the trainer's prepare driver and run-ahead, jitted lookup and
  donated update on the mesh, every step's lookups and the final table) against
  single-device dense within REL per row, and bit-identical to int8 on one device (every
  replica applies the same update)."""
  got = contract.run("int8", _spec(opt), _batches(), mesh=contract.mesh_or_skip(*mesh_shape))
  _check(got, _reference(opt.name))
  if mesh_shape != (1, 1):
    one = contract.run("int8", _spec(opt), _batches())
    for a, b in zip(got.lookups, one.lookups, strict=True):
      np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(got.table, one.table)


def test_int8_mean_pooling_on_mesh(int8):
  spec = _spec(OPTIMIZERS[1], pooling="mean")
  got = contract.run("int8", spec, _batches("mean"), mesh=contract.mesh_or_skip(2, 4))
  _check(got, _reference(OPTIMIZERS[1].name, "mean"))


def test_int8_checkpoints_exactly_through_the_default_rows_form(int8):
  """export (the default: dequantized rows, dense's logical form) -> import_ on another mesh
  gives the same codes, scales and slots bit for bit; dense restores the same table."""
  spec = _spec(OPTIMIZERS[1])
  batches = contract.zipf_ids(seed=3, num_batches=3, batch=32, bag=3, num_rows=1000)
  got = contract.run("int8", spec, batches, mesh=contract.mesh_or_skip(2, 4))
  logical = jax.device_get(got.backend.export(got.state))
  assert logical["t"]["rows"].shape == (base.aligned_rows(1000), 8)
  for text, shape in (("int8", (8, 1)), ("dense", (1, 1))):
    b = planner.make_backend(text, spec, contract.mesh_or_skip(*shape))
    placed = jax.tree.map(lambda x, t: jax.device_put(x, t.sharding), logical, b.logical_target())
    state = b.import_(placed)
    np.testing.assert_array_equal(b.tables(state)["t"], got.table, err_msg=text)
    if text == "int8":
      for k, v in jax.device_get(got.state["t"]).items():
        np.testing.assert_array_equal(np.asarray(state["t"][k]), v, err_msg=k)


def test_int8_offers_itself_to_auto(int8):
  """`auto(...)` asks every registered backend (`auto_candidates`): int8 is among each
  table's candidates, in the plan report and its JSON, and at a budget dense cannot meet it
  is what fits (16 bytes a row against dense's 36)."""
  specs = [base.TableSpec(name=f"t{i}", num_rows=4000, dim=8) for i in range(3)]
  mesh = planner.default_mesh()
  opts = auto.AutoOptions(budget=0.5)
  assert "int8" in auto.candidates(specs[0], opts, mesh)

  def cost(text, spec):
    return (1.0 if text == "dense" else 1.2 if text == "int8" else 2.0), 0.0

  choice = auto.choose(specs, opts, mesh, base.Layout(), [], cost=cost)
  assert all("int8" in c for c in choice.candidates.values())
  assert "int8 (3)" in choice.report()
  assert all("int8" in c for c in choice.as_dict()["candidates"].values())
  assert {c.text for c in choice.chosen.values()} == {"int8"}


def test_load_modules_refuses_a_missing_file_and_a_clash(tmp_path):
  with pytest.raises(ValueError, match="no file"):
    planner.load_modules(str(tmp_path / "absent.py"))
  other = tmp_path / "contract_lib.py"  # (a stem another module of that name holds)
  other.write_text("")
  with pytest.raises(ValueError, match="already imported"):
    planner.load_modules(f" {other} ,")


def _run_py(wd, cache_dir, *extra):
  few = smoke_config(cache_dir, tables=4)  # (its data file and schema, on the command line)
  cmd = [
    sys.executable, "run.py", "--experiment=dlrm_kaggle", f"--workdir={wd}",
    f"--config.embeddings.modules={MODULE}", "--config.embeddings.plan=int8",
    f"--config.data.cache_dir={cache_dir}", "--config.data.synthetic.rows=20000",
    f"--config.data.path={few.data.path}", f"--config.data.schema={few.data.schema}",
    "--config.model.bottom=(32,16)", "--config.model.top=(32,1)",
    "--config.train.batch_size=256", "--config.train.eval_batch_size=4096",
    "--config.train.log_every=4", "--config.train.checkpoint_every=4", *extra,
  ]  # fmt: skip
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
  out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
  return out


def _config(cache_dir, steps):
  """The run.py runs' config (dlrm_kaggle and the same overrides), in process."""
  few = smoke_config(cache_dir, tables=4)
  c = dlrm_kaggle.get_config()
  c.data.cache_dir, c.data.synthetic.rows = cache_dir, 20_000
  c.data.path, c.data.schema = few.data.path, few.data.schema
  c.model.bottom, c.model.top = (32, 16), (32, 1)
  c.train.batch_size, c.train.eval_batch_size = 256, 4096
  c.train.log_every, c.train.checkpoint_every, c.train.steps = 4, 4, steps
  c.embeddings.modules, c.embeddings.plan = os.path.join(ROOT, MODULE), ("int8",)
  return c


@pytest.mark.slow
def test_run_py_trains_checkpoints_and_resumes_int8_exactly(int8, ctr_cache, tmp_path):
  """run.py loads the file (`embeddings.modules`), trains plan=int8 4 steps and checkpoints;
  `--resume` trains on to 8; its checkpoint 8 equals an uninterrupted run's state bit for
  bit (the tables through the default rows form: codes, scales and slots)."""
  wd = str(tmp_path / "wd")
  first = _run_py(wd, ctr_cache, "--config.train.steps=4")
  assert "int8" in first.stdout + first.stderr  # (the plan's table names it)
  assert checkpoint.committed_steps(wd) == [4]
  _run_py(wd, ctr_cache, "--config.train.steps=8", "--resume")
  assert checkpoint.committed_steps(wd) == [4, 8]
  full = loop.train(_config(ctr_cache, 8), str(tmp_path / "full"))
  assert full.plan.backend_of("C3").name == "int8"
  resumed = loop.train(_config(ctr_cache, 8), wd, resume=True)  # (checkpoint 8, no step)
  for x, y in zip(state_leaves(full.state), state_leaves(resumed.state)):
    np.testing.assert_array_equal(x, y)
  shutil.rmtree(wd)


@pytest.mark.slow
def test_the_trainers_auto_plan_weighs_int8(int8, ctr_cache):
  """setup.build with `embeddings.modules` naming the file and an auto rule over the two
  largest tables (dense or int8 only, at a budget dense cannot meet): int8 is among each
  table's candidates in the plan report and in auto_plan.json's figures, and placed."""
  lines = []
  c = smoke_config(ctr_cache, mesh=(1, 1), tables=4)
  c.embeddings.modules = os.path.join(ROOT, MODULE)
  c.embeddings.plan = (
    ("C3|C16", "auto(budget=0.6, kinds=('dense',), batches=2, finalists=1)"),
    (".*", "dense"),
  )
  run = loop.setup.build(c, allocate=False, log=lines.append)
  report = run.auto_plan.report()
  assert "candidates (tables offered each): dense (2), int8 (2)" in report, report
  assert run.auto_plan.as_dict()["candidates"] == {t: ["dense", "int8"] for t in ("C3", "C16")}
  assert run.plan.backend_of("C3").name == "int8"
  assert any("int8" in line for line in lines)  # (the logged plan)
