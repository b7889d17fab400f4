"""Raw ids from a CTR file (a schema column's vocab="raw", the Criteo reader's
categorical="raw"): 64-bit keys kept whole from the file to the dynamic map (int64 in
raw_ids.npy, no fold), converted with no counting pass and trained through dynamic tables
under both feeds; a cache of the earlier 31-bit fold is refused or rebuilt, never misread; a
raw table under a backend that would read its ids as rows is refused, naming the fix. (The
AUC against the dictionary run needs more than a smoke run's steps:
benchmarks/dynamic_raw_criteo.py.)"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from recgnn import planner
from recgnn.data import criteo, ctr_dataset, ctr_reader, ctr_rows, ctr_schema
from recgnn.data import ctr_cache as cache_module
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


@pytest.mark.parametrize("feed", ["host", "device"])
def test_raw_ids_convert_without_counting_and_train(ctr_cache, monkeypatch, tmp_path, feed):
  def no_counting(*a, **k):
    raise AssertionError("a counting pass ran")

  config = _raw_config(ctr_cache)  # (the synthetic TSV under it: made and counted once)
  config.train.feed = feed  # (device: the raw tables' ids read on the host, `host_ids`)
  monkeypatch.setattr(cache_module, "Counter", no_counting)
  # (host: with the plan report too, which times the plan as written on raw ids)
  result = loop.train(config, str(tmp_path / "wd"), plan_report=feed == "host")
  (group,) = result.plan.groups.values()
  assert group.name == "dynamic"
  assert all(s.raw_ids and s.num_rows == ctr_schema.RAW_ID_SPACE for s in group.specs.values())
  assert sum(m.counters()["admitted"] for m in group.maps.values()) > 0
  # The map holds the file's 32-bit hex values themselves: about half are >= 2^31.
  keys = np.concatenate([group.rows_of(n) for n in group.maps])
  assert keys.max() >= 2**31 and keys.max() < 2**32


# Keys that differ only in bits >= 31: the 31-bit fold (key % (2^31 - 3)) merged the first
# and third, a cut to 32 bits the first two; the last has bit 63 set (a negative int64).
WIDE = (5, 5 + 2**32, 5 + 2**62 - 3 * 2**31, 5 + 2**63)


def _wide_csv(tmp_path) -> tuple[str, ctr_schema.Schema]:
  """A CSV of an "int" raw column with WIDE's keys, -1 (the key 2^64 - 1: PAD's bits) and
  an empty field, and a "string" raw column."""
  values = [*map(str, WIDE), "-1", ""]
  path = str(tmp_path / "wide.csv")
  with open(path, "w") as f:
    f.write("click,x,u,s\n")
    for i, v in enumerate(values * 2):
      f.write(f"{i % 2},1.5,{v},site{i % 3}\n")
  schema = ctr_schema.Schema.from_dict({
    "name": "wide", "label": "click", "dense": ["x"], "format": "csv", "header": True,
    "categorical": [{"name": "u", "kind": "int", "vocab": "raw"},
                    {"name": "s", "kind": "string", "vocab": "raw"}],
  })  # fmt: skip
  return path, schema


def test_raw_keys_above_bit_31_stay_distinct_to_the_dynamic_map(tmp_path):
  path, schema = _wide_csv(tmp_path)
  ds = ctr_reader.open_ctr(path, str(tmp_path / "c"), schema, progress=None)
  assert ds.raw_tables == ("u", "s") and ds.sparse.shape == (ds.num_rows, 0)
  batch = ds.gather(np.arange(ds.num_rows))
  u, s = batch["ids"]["u"][:, 0], batch["ids"]["s"][:, 0]
  assert u.dtype == s.dtype == np.int64
  want = [*(np.uint64(k).view(np.int64) for k in WIDE), ctr_schema.RAW_RESERVED,
          ctr_schema.RAW_MISSING]  # fmt: skip
  np.testing.assert_array_equal(u, want * 2)
  full = [
    np.uint64(ctr_schema.string_key(f"site{i % 3}".encode())).view(np.int64) for i in range(12)
  ]
  np.testing.assert_array_equal(s, full)  # the whole 64-bit hash
  opt = base.OptimizerSpec(name="sgd", learning_rate=0.1)
  specs = [base.TableSpec(name=n, num_rows=ctr_schema.RAW_ID_SPACE, dim=4, optimizer=opt,
                          raw_ids=True) for n in ("u", "s")]  # fmt: skip
  group = planner.resolve_plan([(".*", "dynamic(capacity=16)")], specs, log=False).groups["dynamic"]
  group.prepare(batch["ids"], train=True)
  held = group.rows_of("u")
  assert sorted(held[held != -1]) == sorted(want)  # six ids, six rows


def _criteo_tsv(path: str, rng) -> np.ndarray:
  """A Criteo TSV whose hex fields include 0, 2^31 - 1, 2^31, 2^32 - 1 and empty ones ->
  the raw ids expected, int64[n, 26] (RAW_MISSING where empty)."""
  n = 12
  keys = rng.integers(0, 2**32, size=(n, 26), dtype=np.uint64)
  keys[:4, 0] = [0, 2**31 - 1, 2**31, 2**32 - 1]
  empty = rng.random((n, 26)) < 0.1
  with open(path, "w") as f:
    for i in range(n):
      hexes = ["" if empty[i, t] else f"{int(keys[i, t]):08x}" for t in range(26)]
      f.write("\t".join([str(i % 2), *["3"] * 13, *hexes]) + "\n")
  return np.where(empty, ctr_schema.RAW_MISSING, keys.astype(np.int64))


def test_criteo_raw_mode_keeps_exact_32_bit_keys_and_refuses_a_folded_cache(tmp_path):
  tsv = str(tmp_path / "day.txt")
  want = _criteo_tsv(tsv, np.random.default_rng(0))
  reader = criteo.ReaderConfig(categorical="raw")
  ds = criteo.open_criteo(tsv, str(tmp_path / "c"), reader=reader, progress=None)
  np.testing.assert_array_equal(ds.raw_ids, want)
  assert ds.raw_ids.dtype == np.int64 and ds.sparse.shape == (len(want), 0)
  # The device feed's arrays hold no raw id (and nothing int64): they are read on the host.
  rows = ctr_rows.CTRRows(ds, 4, 4, seed=None)
  assert all(a.dtype != np.int64 for a in rows.arrays().values())
  ids = rows.host_ids(np.arange(3), ("C1", "C26"), batch_size=4)
  np.testing.assert_array_equal(ids["C1"][:3, 0], want[:3, 0])
  assert ids["C26"].dtype == np.int64 and ids["C1"][3, 0] == ctr_schema.RAW_MISSING
  # A cache of the 31-bit fold (its reader key without "ids", no raw_ids.npy): refused when
  # opened as it is, converted again by the reader.
  mpath = os.path.join(ds.path, "manifest.json")
  with open(mpath) as f:
    manifest = json.load(f)
  manifest["reader"] = {"categorical": "raw"}
  manifest.pop("raw_tables")
  with open(mpath, "w") as f:
    json.dump(manifest, f)
  with pytest.raises(ValueError, match="folded to 31 bits.*Delete the directory"):
    ctr_dataset.CTRDataset(ds.path)
  again = criteo.open_criteo(tsv, str(tmp_path / "c"), reader=reader, progress=None)
  assert not again.reused_cache
  np.testing.assert_array_equal(again.raw_ids, want)


def test_a_raw_table_under_another_backend_is_refused():
  opt = base.OptimizerSpec(name="sgd", learning_rate=0.1)
  specs = [base.TableSpec(name=n, num_rows=ctr_schema.RAW_ID_SPACE, dim=4, optimizer=opt,
                          raw_ids=True) for n in ("C3", "C4")]  # fmt: skip
  with pytest.raises(ValueError, match=r"tables C3, C4 hold raw ids .*dynamic\(capacity="):
    planner.resolve_plan([(".*", "dense")], specs, log=False)
  plan = planner.resolve_plan([(".*", "dynamic(capacity=8)")], specs, log=False)
  assert plan.groups["dynamic"].memory()["C3"].device_bytes < 1 << 20
  # The plan table names them raw (not their 2^64 rows) and counts no all-dense form of them.
  text = planner.format_plan(plan)
  assert "C3" in text and "raw ids" in text and "all-dense" not in text
