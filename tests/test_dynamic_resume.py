"""A dynamic table through the trainer: its id maps, counters and ages saved with the table
and resumed exactly (the run stopped at a checkpoint and resumed ends bit-identical to the run
that never stopped, evictions happening throughout); a resume with another capacity is
refused naming both values; the map's bytes are in the plan's host memory; the run logs its
admissions, evictions, rejected lookups and occupancy."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from recgnn.train import loop
from tests.trainer_lib import smoke_config, state_leaves

PLAN = (("C3", "dynamic(capacity=64, evict=lru)"), (".*", "dense"))


@pytest.fixture(scope="module")
def cache_dir(ctr_cache):
  return ctr_cache


def _config(cache_dir, plan=PLAN, mesh=None):
  return smoke_config(
    cache_dir, tables=4, plan=plan, mesh=mesh, checkpoint_every=4, keep_checkpoints=3
  )


@pytest.fixture(scope="module")
def full(cache_dir, tmp_path_factory):
  wd = str(tmp_path_factory.mktemp("full"))
  return wd, loop.train(_config(cache_dir), wd)


def test_resume_is_exact_and_a_changed_capacity_or_policy_is_refused(cache_dir, full, tmp_path):
  # The uninterrupted run's checkpoint 4 (saved while the input thread had mapped batches
  # beyond step 4: the maps saved must be those after step 4), the later ones removed.
  wd = str(tmp_path / "wd")
  shutil.copytree(full[0], wd)
  for step in ("8", "12"):
    shutil.rmtree(os.path.join(wd, "checkpoints", step))
  resumed = loop.train(_config(cache_dir), wd, resume=True)
  a, b = state_leaves(full[1].state), state_leaves(resumed.state)
  assert len(a) == len(b)
  for x, y in zip(a, b, strict=True):
    np.testing.assert_array_equal(x, y)
  assert full[1].metrics["test/auc"] == resumed.metrics["test/auc"]
  other = (("C3", "dynamic(capacity=32, evict=lru)"), (".*", "dense"))
  with pytest.raises(
    ValueError, match=r"C3 format: checkpoint 'dynamic\(capacity=64.*this run 'dynamic\(capacity=32"
  ):
    loop.train(_config(cache_dir, other), wd, resume=True)
  lfu = (("C3", "dynamic(capacity=64, evict=lfu)"), (".*", "dense"))
  with pytest.raises(
    ValueError, match=r"evict=lru\)\+rows'.*this run 'dynamic\(capacity=64, admit=always, evict=lfu"
  ):
    loop.train(_config(cache_dir, lfu), wd, resume=True)


def test_counters_are_logged_and_evictions_happened(full):
  wd, result = full
  scalars = {}
  with open(os.path.join(wd, "metrics.jsonl")) as f:  # (what the TensorBoard scalars hold)
    for line in f:
      scalars.update(json.loads(line))
  logged = {k: v for k, v in {**scalars, **result.metrics}.items() if "dynamic_" in k}
  assert any(k.endswith("C3/dynamic_evicted") for k in logged), sorted(logged)
  assert sum(v for k, v in logged.items() if k.endswith("dynamic_evicted")) > 0
  assert any(k.endswith("C3/dynamic_occupancy") and v == 1.0 for k, v in logged.items())


def _maps(result) -> dict:
  (group,) = [g for g in result.plan.groups.values() if g.name == "dynamic"]
  return {n: m.arrays() for n, m in group.maps.items()}


@pytest.mark.long
def test_resume_on_another_mesh_makes_the_same_decisions(cache_dir, full, tmp_path):
  """Checkpoint 4 of the 1-device run resumed on a 2x4 mesh: the maps restored as saved, so
  after the last step they are the uninterrupted run's, array for array (the tables' values
  differ by summation order across meshes; the ids' decisions do not)."""
  wd = str(tmp_path / "wd")
  shutil.copytree(full[0], wd)
  for step in ("8", "12"):
    shutil.rmtree(os.path.join(wd, "checkpoints", step))
  resumed = loop.train(_config(cache_dir, mesh=(2, 4)), wd, resume=True)
  got, want = _maps(resumed), _maps(full[1])
  assert want["C3"]["scalars"][0] == 12  # (the maps after step 12: nothing mapped beyond)
  for n, arrays in want.items():
    for k, v in arrays.items():
      np.testing.assert_array_equal(got[n][k], v, err_msg=f"{n} {k}")
