"""Raw ids from a CTR file (a schema column's vocab="raw"): converted with no counting pass
and trained through dynamic tables; a raw table under a backend that would read its ids as
rows is refused, naming the fix. (The AUC against the dictionary run needs more than a smoke
run's steps: benchmarks/dynamic_raw_criteo.py.)"""

from __future__ import annotations

import json

import pytest

from recgnn import planner
from recgnn.data import ctr_cache as cache_module
from recgnn.data import ctr_schema
from recgnn.embeddings import base
from recgnn.train import loop
from tests.trainer_lib import smoke_config

RAW = (".*", "dynamic(capacity=65536, evict=none)")


def _raw_config(cache_dir):
  """The smoke run on 4 tables, each column of its schema vocab="raw", each table dynamic."""
  c = smoke_config(cache_dir, tables=4, steps=4, log_every=2)
  schema = json.loads(c.data.schema)
  for col in schema["categorical"]:
    col.pop("min_count", None)
    col["vocab"] = "raw"
  schema["name"] += "_raw"
  c.data.schema = json.dumps(schema)
  c.embeddings.plan = (RAW,)
  return c


def test_raw_ids_convert_without_counting_and_train(ctr_cache, monkeypatch, tmp_path):
  def no_counting(*a, **k):
    raise AssertionError("a counting pass ran")

  config = _raw_config(ctr_cache)  # (the synthetic TSV under it: made and counted once)
  monkeypatch.setattr(cache_module, "Counter", no_counting)
  result = loop.train(config, str(tmp_path / "wd"))
  (group,) = result.plan.groups.values()
  assert group.name == "dynamic"
  assert all(s.raw_ids and s.num_rows == ctr_schema.RAW_ROWS for s in group.specs.values())
  assert sum(m.counters()["admitted"] for m in group.maps.values()) > 0


def test_a_raw_table_under_another_backend_is_refused():
  opt = base.OptimizerSpec(name="sgd", learning_rate=0.1)
  specs = [base.TableSpec(name=n, num_rows=ctr_schema.RAW_ROWS, dim=4, optimizer=opt,
                          raw_ids=True) for n in ("C3", "C4")]  # fmt: skip
  with pytest.raises(ValueError, match=r"tables C3, C4 hold raw ids .*dynamic\(capacity="):
    planner.resolve_plan([(".*", "dense")], specs, log=False)
  plan = planner.resolve_plan([(".*", "dynamic(capacity=8)")], specs, log=False)
  assert plan.groups["dynamic"].memory()["C3"].device_bytes < 1 << 20
