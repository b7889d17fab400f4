"""The drifting stream as a CTR file (recgnn/data/drifting_ctr.py): the three ways its ids
reach a table of C rows, the split at day boundaries, and the figures reported beside the
AUCs (first-day dictionary, the hashing trick's collision rate). Tiny streams: the trainer
runs of experiments/dynamic_drift.py are benchmarks/dynamic_drift.py's."""

from __future__ import annotations

import collections
import dataclasses

import ml_collections
import numpy as np
import pytest

from recgnn.data import ctr_schema, drifting_ctr, drifting_stream

STREAM = drifting_ctr.Stream(seed=3, batches=2, batch=64, born=300)


def _data(tmp_path, ids: str, capacity: int):
  return ml_collections.ConfigDict(
    {
      "cache_dir": str(tmp_path),
      "drifting": {**dataclasses.asdict(STREAM), "capacity": capacity, "ids": ids},
    }
  )


def test_first_day_dictionary_is_the_first_days_most_frequent_ids():
  rng = np.random.default_rng(0)
  ids = rng.zipf(1.3, 500).astype(np.int64) + (1 << 40)
  got = drifting_ctr.first_day(ids, 300, capacity=12)
  counts = collections.Counter(ids[:300].tolist())
  want = sorted(sorted(counts, key=lambda k: (-counts[k], k))[:10])
  np.testing.assert_array_equal(got, want)


def test_hash_collision_rate_counts_ids_sharing_a_row():
  ids = np.array([5, 5, 7, 15, 9, 1 << 50], np.int64)  # rows % 8: 5, 7, 7, 1, 0
  by_row = collections.defaultdict(set)
  for k in set(ids.tolist()):
    by_row[k % 8].add(k)
  want = sum(len(s) for s in by_row.values() if len(s) > 1) / len(set(ids.tolist()))
  assert drifting_ctr.hash_collisions(ids, 8 + ctr_schema.FIRST_ID) == pytest.approx(want)
  assert want == pytest.approx(2 / 5)


@pytest.mark.parametrize("ids", drifting_ctr.IDS)
def test_each_way_gives_a_table_of_at_most_capacity_rows(ids, tmp_path):
  capacity = 150
  dataset, oracle = drifting_ctr.open_drifting(_data(tmp_path, ids, capacity))
  per_day = STREAM.rows_per_day()
  assert dataset.num_rows == drifting_ctr.DAYS * per_day
  assert dataset.splits["train"] == (0, (drifting_ctr.DAYS - 1) * per_day)  # days 0-5
  assert dataset.splits["test"][0] == (drifting_ctr.DAYS - 1) * per_day  # day 6 only
  assert 0.5 < oracle["oracle_auc_test"] < 1
  (rows,) = dataset.cardinalities
  if ids == "dynamic":  # the raw 62-bit keys themselves, in stream order: no fold, no modulo
    keys = np.concatenate([b[1] for b in drifting_stream.stream(STREAM.seed, **STREAM.kwargs())])
    np.testing.assert_array_equal(np.asarray(dataset.raw_ids[:, 0]), keys)
    return
  column = np.asarray(dataset.sparse[:, 0])
  if ids == "hash":
    assert rows == capacity and column.max() < capacity
  elif ids == "first_day":
    day0 = column[:per_day]
    assert rows <= capacity and np.all(column[per_day:][~np.isin(column[per_day:], day0)] == 0)


def test_the_experiment_refuses_a_policy_without_a_dynamic_table():
  """evict / admit / k shape only the dynamic table: with ids=hash or first_day they are
  refused, not ignored; k without admit=count|bloom is refused by the plan's options."""
  import run
  from recgnn import planner
  from recgnn.embeddings import base

  with pytest.raises(ValueError, match="evict set the dynamic table's policy, and ids=hash"):
    run.load_config("dynamic_drift:ids=hash,evict=lfu")
  text = run.load_config("dynamic_drift:k=3").embeddings.plan[0][1]
  opt = base.OptimizerSpec(name="sgd", learning_rate=0.1)
  with pytest.raises(ValueError, match="k=3 needs admit=count"):
    planner.make_backend(text, base.TableSpec(name="item", num_rows=8, dim=4, optimizer=opt))
