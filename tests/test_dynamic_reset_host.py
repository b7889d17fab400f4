"""A dynamic table's reused rows reset when the rows live in a host tier: `offload` (a device
cache over host rows, optionally the SSD level below them) and `hot_cold` (hot rows on the
devices, cold rows in host RAM), against the same table on `dense`.

The stream has far more distinct ids than the capacity, so rows are evicted and reused every
step; with row-wise Adagrad a reset that missed the values or the optimizer state shows in the
lookups. Each backend has two paths (`place_resets`): a reused row the device holds when the
step starts (offload: a cache slot; hot_cold: a hot slot), reset in the step's state, and one
the step brings from the host (offload's "now" loads; hot_cold's cold list), reset in the
prepared batch. Each case counts the resets of each path, so a stream that stopped taking one
fails rather than passing without it."""

from __future__ import annotations

import contract_lib
import numpy as np
import pytest

from recgnn import planner
from recgnn.embeddings import base, host_tier

OPT = base.OptimizerSpec(name="rowwise_adagrad", learning_rate=0.1, initial_accumulator=0.1)
CAPACITY = 64
REFERENCE = "dense(fuse=False)"


def _stream(batches=7, batch=16, bag=2, distinct=600):
  """Zipf batches over `distinct` raw 62-bit ids (~10x the capacity): new ids every step."""
  ids = contract_lib.zipf_ids(11, batches, batch, bag, distinct, exponent=0.8)
  raw_of = np.random.default_rng(12).integers(1 << 40, 1 << 62, size=distinct)
  return [np.where(x >= 0, raw_of[np.maximum(x, 0)], -1).astype(np.int64) for x in ids]


def _dynamic(inner: str) -> str:
  return f"dynamic(capacity={CAPACITY}, evict=lru, inner={inner!r})"


def _held(group, slots: np.ndarray) -> int:
  """Of a step's placed resets, how many the device held when the step started (the rest:
  padding, or brought from the host in the step)."""
  inner = group.inner
  if hasattr(inner, "geometry"):  # hot_cold: a hot slot (Ha: none)
    return int((slots < inner.geometry.alloc["t"]).sum())
  return int((slots != host_tier.ABSENT).sum())  # offload: a cache slot


_REFERENCE: dict = {}


def _reference(mesh_shape) -> contract_lib.Trace:
  """dynamic(dense) on `_stream` (one run per mesh, shared by the cases)."""
  if mesh_shape not in _REFERENCE:
    spec = base.TableSpec(name="t", num_rows=CAPACITY, dim=8, optimizer=OPT)
    mesh = contract_lib.mesh_or_skip(*mesh_shape)
    _REFERENCE[mesh_shape] = contract_lib.run(_dynamic(REFERENCE), spec, _stream(), mesh=mesh)
  return _REFERENCE[mesh_shape]


def _matches_dense(inner: str, mesh_shape=(1, 1)) -> tuple[int, int]:
  """dynamic(inner) and dynamic(dense) trained on `_stream`: every step's lookups and the
  final table equal. -> (resets the device held, resets in all)."""
  mesh = contract_lib.mesh_or_skip(*mesh_shape)
  spec = base.TableSpec(name="t", num_rows=CAPACITY, dim=8, optimizer=OPT)
  raw = _stream()
  group = planner.make_backend(_dynamic(inner), spec, mesh)
  held = []

  def count(step, state):
    del state
    if step.kind == "train":
      held.append(_held(group, step.prepared["reset"]["t"]["slots"]))

  ref = _reference(mesh_shape)
  got = contract_lib.run(_dynamic(inner), spec, raw, group=group, check=count)
  # Bit-identical on CPU; after the first update an accelerator's summation order may differ
  # between dense's table and the tier's arrays (`contract_lib.updated_tolerance`).
  upd = contract_lib.updated_tolerance()
  later = {"atol": upd.get("atol", 0.0), "rtol": upd.get("rtol", 0.0)}
  for step, (a, b) in enumerate(zip(got.lookups, ref.lookups, strict=True)):
    tol = {"atol": 0.0, "rtol": 0.0} if step == 0 else later
    np.testing.assert_allclose(a, b, **tol, err_msg=f"{inner}: lookup differs at step {step}")
  np.testing.assert_allclose(got.table, ref.table, **later, err_msg=f"{inner}: final table")
  total = got.backend.maps["t"].counters()["resets"]
  assert total == ref.backend.maps["t"].counters()["resets"] > 0
  return sum(held), total


# (inner, mesh): the 1x1 cases run by default (a few seconds each), 2x4 and the SSD level
# under -m long.
SMALL_CACHE = "offload(cache_rows=40, policy=lru, lookahead=2)"
HOT_COLD = "hot_cold(budget=0.25, profile_batches=2)"


@pytest.mark.parametrize(
  "mesh_shape", [(1, 1), pytest.param((2, 4), marks=pytest.mark.long)], ids=["1x1", "2x4"]
)
def test_offload_resets_cached_and_loaded_rows(mesh_shape):
  """A cache smaller than the table: some reused rows are in the cache when their step
  starts (reset in their slot), others arrive from the host in that step (reset in the
  batch's loaded rows)."""
  held, total = _matches_dense(SMALL_CACHE, mesh_shape)
  assert 0 < held < total


@pytest.mark.parametrize(
  "mesh_shape", [(1, 1), pytest.param((2, 4), marks=pytest.mark.long)], ids=["1x1", "2x4"]
)
def test_hot_cold_resets_hot_and_cold_rows(mesh_shape):
  held, total = _matches_dense(HOT_COLD, mesh_shape)
  assert 0 < held < total


@pytest.mark.long
def test_offload_ssd_level_resets(tmp_path):
  """The SSD level below the host rows (a host cache of a quarter of them): a reused row
  the step loads comes through it, and is reset in the batch all the same."""
  ssd = f"host_cache=0.25, storage='ssd:{tmp_path}'"
  held, total = _matches_dense(f"{SMALL_CACHE[:-1]}, {ssd})")
  assert 0 < held < total
