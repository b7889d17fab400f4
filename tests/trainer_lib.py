"""The small trainer configurations the end-to-end tests share (one copy), and a counter of
the programs a block compiles."""

from __future__ import annotations

import contextlib
import json
import os

import jax
import numpy as np
import pytest

from experiments import smoke
from recgnn.train import loop

# The tables of `smoke_config(tables=n)`, first n: three of the synthetic data's large tables
# that the tests' plans name (C3, C4, C16: 1,659 / 443 / 1,044 rows) and a tiny one (C1, 6
# rows, padded to ROW_ALIGN like Criteo's 21 tiny tables), then more large ones.
FEW_TABLES = ("C3", "C4", "C16", "C1", "C21", "C12", "C10", "C24")


@contextlib.contextmanager
def xla_compiles():
  """Yields a list that gets the seconds of each XLA compile in the block (a hit of the
  persistent cache counts: jax reports it as a compile; a program this process already has
  does not)."""
  seen: list[float] = []

  def listen(event, seconds, **_):
    if event == "/jax/core/compile/backend_compile_duration":
      seen.append(seconds)

  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    yield seen
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)


def smoke_config(
  cache_dir, *, rows=20_000, mesh=None, plan=None, data=None, tables=None, **train
):  # fmt: skip
  """`smoke` on the synthetic default (`rows` rows; None: the experiment's), 12 steps, one
  final test eval, no checkpoints unless `checkpoint_every` is given; `mesh` (data, model),
  `plan` rules, `data` / `train` overrides. `tables`: None, Criteo's 26 tables; n (or names),
  the same synthetic file read through a custom schema with only FEW_TABLES[:n] (or the named
  columns) as tables: a fraction of the 26 tables' init, trace, lowering and execution, for
  tests whose property does not need Criteo's 26 (no oracle AUC: that is the Criteo reader's)."""
  c = smoke.get_config()
  c.data.cache_dir = cache_dir
  if rows is not None:
    c.data.synthetic.rows = rows
  if tables is not None:
    _few_tables(c, FEW_TABLES[:tables] if isinstance(tables, int) else tuple(tables))
  for k, v in (data or {}).items():
    c.data[k] = v
  defaults = {"steps": 12, "log_every": 4, "eval_every": 0, "checkpoint_every": 0,
              "final_eval_splits": ("test",)}  # fmt: skip
  for k, v in {**defaults, **train}.items():
    c.train[k] = v
  if mesh is not None:
    c.mesh = {"data": mesh[0], "model": mesh[1]}
  if plan is not None:
    c.embeddings.plan = plan
  return c


def _few_tables(c, names) -> None:
  """`c` reads its synthetic TSV (generated here, once per cache) through a schema whose
  tables are `names`, with the Criteo reader's ids (hex values, frequency vocabulary)."""
  from recgnn.data import criteo, criteo_synthetic

  syn = c.data.synthetic
  tsv = criteo_synthetic.default_synthetic_dataset(
    c.data.cache_dir, num_rows=syn.rows, scale=syn.scale, seed=syn.seed, progress=None
  ).tsv_path
  c.data.path = tsv
  c.data.schema = json.dumps({  # (inline JSON: the config's schema field is a string)
    "name": f"smoke{len(names)}", "label": "label", "dense": list(criteo.DENSE_NAMES),
    "columns": ["label", *criteo.DENSE_NAMES, *criteo.TABLE_NAMES], "format": "tsv",
    "categorical": [{"name": n, "kind": "hex", "min_count": c.data.min_count} for n in names],
  })  # fmt: skip


def xla_flags(devices: int) -> str:
  """This run's XLA_FLAGS (conftest's: the backend's optimisation level too) with `devices`
  simulated CPU devices, for a process a test starts: its programs are built as the test's
  own, which it is compared with."""
  keep = [f for f in os.environ.get("XLA_FLAGS", "").split()
          if not f.startswith("--xla_force_host_platform_device_count")]  # fmt: skip
  return " ".join([*keep, f"--xla_force_host_platform_device_count={devices}"])


def make_task(cls, config):
  """`cls(config, mesh)`: a task built outside the trainer, on the trainer's mesh."""
  return cls(config, loop.config_mesh(config))


def state_leaves(state) -> list[np.ndarray]:
  """Every array of a TrainState on the host (its PRNG key as raw data), for comparisons."""
  state = state.replace(key=jax.random.key_data(state.key))
  return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(state))]


def skip_unless_devices(n: int, what: str = "") -> None:
  """Skip the test where the platform has fewer than n devices (one GPU; tests/conftest.py
  simulates 8 on CPU)."""
  have = jax.device_count()
  if have < n:
    pytest.skip(f"{what or 'test'} needs {n} devices; {have} {jax.default_backend()} device(s)")


def skip_unless_deterministic() -> None:
  """Bit-identical reruns on a GPU need XLA's deterministic ops: its scatter-adds sum
  duplicate ids with atomics, in a run-dependent order. tools/gpu_check.sh sets
  XLA_FLAGS=--xla_gpu_deterministic_ops=true for its test stages; without it, skip."""
  if jax.default_backend() == "gpu" and "--xla_gpu_deterministic_ops=true" not in os.environ.get(
    "XLA_FLAGS", ""
  ):
    pytest.skip("bit-identical reruns on a GPU need XLA_FLAGS=--xla_gpu_deterministic_ops=true")


def flip_byte(path: str, at: int) -> None:
  """Damage a file in place: one bit of byte `at` flipped (same size, other contents)."""
  with open(path, "r+b") as f:
    f.seek(at)
    b = f.read(1)[0]
    f.seek(at)
    f.write(bytes([b ^ 1]))


@contextlib.contextmanager
def eval_predictions():
  """Yields a dict that gets {split: the task's `predictions` of that split's last eval pass}
  for the trainer runs in the block (node classification: the dataset's node ids and their
  predicted classes), read where the trainer reduces the pass to its metrics."""
  from recgnn.train import periodic

  seen: dict[str, dict] = {}
  real = periodic.Evals.end

  def end(self, split, step):
    seen[split] = self.task.predictions(jax.device_get(self.outputs))
    real(self, split, step)

  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(periodic.Evals, "end", end)
    yield seen


def assert_accuracy_from_raw_labels(metrics: dict, seen: dict, labels, nodes) -> None:
  """The run's test accuracy is the fraction of the split's labelled nodes (`nodes`, the
  dataset's ids; `labels` float[n] read from the raw files, NaN unlabelled) whose predicted
  class is their label: each such node predicted once, nothing else counted."""
  pred = seen["test"]
  want_nodes = np.sort([n for n in nodes if not np.isnan(labels[n])])
  np.testing.assert_array_equal(pred["node"], want_nodes)
  right = pred["pred"] == labels[pred["node"]].astype(np.int64)
  assert metrics["test/accuracy"] == pytest.approx(float(np.mean(right)), abs=1e-6), metrics
