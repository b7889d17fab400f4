"""train.steps_per_call = k for CTR (issue 43): k batches stacked into one transfer and one
lax.scan over their optimizer steps, bit-identical to k calls of one step, on every mesh,
for dense / tt / sharded, across a stop and resume; host tiers refused."""

import json
import os

import numpy as np
import pytest

from recgnn.train import loop
from tests.trainer_lib import (
  skip_unless_deterministic,
  skip_unless_devices,
  smoke_config,
  state_leaves,
)


@pytest.fixture(scope="module")
def cache_dir(ctr_cache):
  return ctr_cache  # (conftest: one per process)


def _config(cache_dir, k, mesh=(1, 1), plan=None, steps=8):
  c = smoke_config(cache_dir, steps=steps, log_every=4, mesh=mesh, plan=plan)
  c.train.steps_per_call = k
  return c


def _logged(workdir):
  """metrics.jsonl's train lines: step and loss. (Not the backends' counters: tt's
  capacity figures count what `prepare` has seen, and the input thread runs further ahead
  of a call of 4 batches than of one, so by step 4 it may have prepared the eval batches.)"""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(x) for x in f]
  return [{"step": r["step"], "loss": r["loss"]} for r in rows if "loss" in r]


def _same(a, b):
  la, lb = state_leaves(a.state), state_leaves(b.state)
  assert len(la) == len(lb)
  for x, y in zip(la, lb):
    np.testing.assert_array_equal(x, y)


PLANS = {
  "dense": ((".*", "dense"),),
  "rows": (("C(3|4|10|16|21)", "dense(shard=rows)"), (".*", "dense")),
  "tt": (("C(3|4)", "tt(rank=4)"), (".*", "dense")),
  "sharded": ((".*", "sharded"),),
}


@pytest.mark.parametrize(
  "plan,mesh",
  [
    ("dense", (1, 1)),
    ("dense", (8, 1)),
    ("rows", (2, 4)),
    ("tt", (1, 1)),
    ("tt", (8, 1)),
    ("tt", (2, 4)),
    ("sharded", (8, 1)),
    ("sharded", (2, 4)),
  ],
  ids=lambda x: x if isinstance(x, str) else f"{x[0]}x{x[1]}",
)
def test_k_steps_per_call_are_k_calls_of_one_step(cache_dir, tmp_path, plan, mesh):
  """4 steps per call end bit-identical to one step per call (state, logged per-step
  means at the same steps, test AUC)."""
  skip_unless_deterministic()
  skip_unless_devices(mesh[0] * mesh[1], f"mesh {mesh[0]}x{mesh[1]}")
  one = loop.train(_config(cache_dir, 1, mesh, PLANS[plan]), str(tmp_path / "one"))
  four = loop.train(_config(cache_dir, 4, mesh, PLANS[plan]), str(tmp_path / "four"))
  assert one.metrics["step"] == four.metrics["step"] == 8 and int(four.state.step) == 8
  _same(one, four)
  assert _logged(tmp_path / "one") == _logged(tmp_path / "four")
  assert [r["step"] for r in _logged(tmp_path / "four")] == [4, 8]
  assert four.metrics["test/auc"] == one.metrics["test/auc"]


def test_k_steps_per_call_resume_exactly(cache_dir, tmp_path):
  """A 4-step-per-call run stopped after one call and resumed ends as the uninterrupted one;
  so does a one-step run's checkpoint resumed 4 steps per call."""
  skip_unless_deterministic()
  four = _config(cache_dir, 4, steps=12)
  full = loop.train(four, str(tmp_path / "full"))
  wd = str(tmp_path / "part")
  assert loop.train(four, wd, stop_after=4).metrics["step"] == 4
  resumed = loop.train(four, wd, resume=True)
  assert resumed.metrics["step"] == 12
  _same(full, resumed)
  wd = str(tmp_path / "from_one")
  assert loop.train(_config(cache_dir, 1, steps=12), wd, stop_after=8).metrics["step"] == 8
  _same(full, loop.train(four, wd, resume=True))


def test_k_steps_per_call_refused_where_not_built(cache_dir, tmp_path):
  c = _config(cache_dir, 4, plan=((".*", "offload(cache_rows=2048)"),))
  with pytest.raises(ValueError, match=r"steps_per_call=4 with host-tier .*one step per call"):
    loop.train(c, str(tmp_path / "a"))
  c = _config(cache_dir, 4)
  c.train.log_every = 6
  with pytest.raises(ValueError, match=r"train.log_every=6 must be multiple\(s\) of 4"):
    loop.train(c, str(tmp_path / "b"))
  c = _config(cache_dir, 0)
  with pytest.raises(ValueError, match=r"train.steps_per_call=0"):
    loop.train(c, str(tmp_path / "c"))
