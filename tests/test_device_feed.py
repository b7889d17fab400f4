"""The device feed (train.feed=device): the data placed on the devices once, each step
gathering its batch there. The same batches as the host feed, value for value; the same
params after N steps for dense, sharded and tt (the host-prepared groups' ids read on the
host) on 1x1, 8x1 and 2x4, k = 1 and k = 8 steps per call across a pass boundary, and across
a stop and --resume; what the host does per call; refusals."""

import jax
import numpy as np
import pytest

from recgnn import sharding
from recgnn.data import ctr_rows
from recgnn.tasks.ctr import CTR
from recgnn.train import loop, setup
from tests.trainer_lib import (
  make_task,
  skip_unless_deterministic,
  skip_unless_devices,
  smoke_config,
  state_leaves,
)


@pytest.fixture(scope="module")
def cache_dir(ctr_cache):
  return ctr_cache  # (conftest: one per process)


def _config(cache_dir, feed, plan, mesh=(1, 1), k=1, steps=8, rows=3_000, **train):
  """The smoke run on 4 tables of a small synthetic file (2,571 train rows: 10 batches of
  256 a pass, so 16 steps cross a pass boundary, inside a call of 8)."""
  c = smoke_config(
    cache_dir, rows=rows, mesh=mesh, plan=plan, tables=4, steps=steps, log_every=k, **train
  )
  c.train.steps_per_call = k
  c.train.feed = feed
  c.train.eval_batch_size = 1000  # (the last eval batch padded)
  return c


def _batch_equal(a, b, what):
  assert set(a) == set(b), what
  for key in ("dense", "label", "weight"):
    np.testing.assert_array_equal(np.asarray(a[key]), b[key], err_msg=f"{what}: {key}")
  for t in b["ids"]:
    np.testing.assert_array_equal(np.asarray(a["ids"][t]), b["ids"][t], err_msg=f"{what}: {t}")


@pytest.mark.parametrize("bags", ["one_hot", "multi_hot", "shards"])
def test_gathered_batches_are_the_host_feeds(cache_dir, tmp_path, bags):
  """CTRRows.gather of a pass's order / an eval cursor equals the task's own train / eval
  batches (shuffled, two passes; the last eval batch padded), one-hot, with bags, and in
  train.order_shards=4's order."""
  c = _config(cache_dir, "device", ((".*", "dense"),), rows=3_000)
  if bags == "multi_hot":
    _multi_hot_schema(c, tmp_path)
  if bags == "shards":
    c.train.order_shards = 4
  task = make_task(CTR, c)
  rows = task.device_rows()
  assert isinstance(rows, ctr_rows.CTRRows) and rows.train_batches == task.steps_per_epoch()
  if bags == "shards":  # (each quarter of a batch from its quarter of the train rows)
    start, stop = rows.split_range("train")
    part = rows.train_order(1).reshape(rows.train_batches, 4, -1)
    assert all(((part[:, s] - start) // ((stop - start) // 4) == s).all() for s in range(4))
  data = jax.tree.map(np.asarray, rows.arrays())
  gather = jax.jit(rows.gather)
  host = task.train_batches(0)
  for step in range(rows.train_batches + 3):  # into the second pass
    e, b = divmod(step, rows.train_batches)
    order = rows.train_order(e)[b]
    got = gather(data, order, np.ones(order.shape, bool))
    _batch_equal(got, next(host), f"train batch {step}")
  for i, ((lo, hi), want) in enumerate(zip(rows.eval_cursors("test"), task.eval_batches("test"))):
    first = lo + np.arange(rows.eval_batch_size)
    got = gather(data, np.minimum(first, hi - 1).astype(np.int32), first < hi)
    _batch_equal(got, want, f"eval batch {i}")
  assert len(rows.eval_cursors("test")) == len(list(task.eval_batches("test")))


def _multi_hot_schema(c, tmp_path):
  import json

  rng = np.random.default_rng(0)
  path = tmp_path / "clicks.tsv"
  lines = ["y\tx1\tad\ttags"]
  for _ in range(3000):
    tags = ",".join(f"t{int(rng.integers(0, 30))}" for _ in range(int(rng.integers(0, 4))))
    lines.append(
      f"{int(rng.random() < 0.3)}\t{rng.normal():.3f}\tad{int(rng.zipf(1.5)) % 50}\t{tags}"
    )
  path.write_text("\n".join(lines) + "\n")
  c.data.path = str(path)
  c.data.schema = json.dumps({
    "label": "y", "dense": ["x1"], "header": True, "dense_transform": "none",
    "categorical": ["ad", {"name": "tags", "bag": 3, "separator": ",", "pooling": "mean"}],
  })  # fmt: skip


def _same_state(a, b):
  la, lb = state_leaves(a.state), state_leaves(b.state)
  assert len(la) == len(lb)
  for x, y in zip(la, lb):
    np.testing.assert_array_equal(x, y)


# dense with its dedup in the step under either feed (the device feed's ids never reach the
# host, so dense dedups in the step there; the host feed's default on CPU is the host's).
DENSE = ((".*", "dense(dedup=device)"),)
ROWS = (("C3", "dense(shard=rows, dedup=device)"), (".*", "dense(dedup=device)"))
TT = (("C(3|4)", "tt(rank=4)"), (".*", "dense(dedup=device)"))
CASES = [
  pytest.param("dense", DENSE, (1, 1), 1, id="dense-1x1-k1"),
  pytest.param("dense", DENSE, (2, 4), 8, id="dense-2x4-k8"),
  pytest.param("rows", ROWS, (8, 1), 1, id="rows-8x1-k1", marks=pytest.mark.long),
  pytest.param("sharded", ((".*", "sharded"),), (8, 1), 8, id="sharded-8x1-k8"),
  pytest.param("tt", TT, (1, 1), 8, id="tt-1x1-k8"),
  pytest.param("tt", TT, (2, 4), 1, id="tt-2x4-k1"),
]


@pytest.mark.parametrize("name,plan,mesh,k", CASES)
def test_device_feed_trains_as_the_host_feed(cache_dir, tmp_path, name, plan, mesh, k):
  """16 steps (a pass is 10: a call of 8 crosses it), an eval at the end: params, tables and
  metrics bit for bit as the host feed's."""
  skip_unless_deterministic()
  skip_unless_devices(mesh[0] * mesh[1], f"mesh {mesh[0]}x{mesh[1]}")
  host = loop.train(_config(cache_dir, "host", plan, mesh, k, 16), str(tmp_path / "host"))
  dev = loop.train(_config(cache_dir, "device", plan, mesh, k, 16), str(tmp_path / "dev"))
  _same_state(host, dev)
  assert dev.metrics["test/auc"] == host.metrics["test/auc"]
  assert dev.metrics["link/host_to_device_bytes"] < host.metrics["link/host_to_device_bytes"]
  if name in ("dense", "sharded", "rows"):  # (the cursors alone: 8 bytes a step)
    assert dev.metrics["link/host_to_device_bytes"] <= 8 * mesh[0] * mesh[1] * k


def test_device_feed_resumes_exactly(cache_dir, tmp_path):
  """Stopped after 8 steps (a pass is 10) and resumed at k = 4: as the uninterrupted run."""
  skip_unless_deterministic()
  full = loop.train(_config(cache_dir, "device", DENSE, k=4, steps=16), str(tmp_path / "full"))
  wd = str(tmp_path / "chain")
  c = _config(cache_dir, "device", DENSE, k=4, steps=16)
  assert loop.train(c, wd, stop_after=8).metrics["step"] == 8
  end = loop.train(c, wd, resume=True)
  _same_state(full, end)
  assert end.metrics["test/auc"] == full.metrics["test/auc"]


def test_feed_choice_and_refusals(cache_dir, tmp_path):
  """auto: the host feed on CPU devices; device with a tier: its ids read on the host;
  several of the data's copies past the budget refused before allocating; an input worker
  (which the device feed has no use for) refused; bad names."""
  c = _config(cache_dir, "auto", DENSE)
  run = setup.build(c)
  assert run.device_feed is None and "CPU devices" in run.feed_how
  c = _config(cache_dir, "device", (("C3", "offload(cache_rows=320)"), (".*", "dense")))
  run = setup.build(c)
  assert run.device_feed is not None and run.device_feed.host_tables == ("C3",)
  assert "read and prepared on the host" in run.feed_how
  with pytest.raises(ValueError, match="input_workers=1 with the device feed"):
    c = _config(cache_dir, "device", DENSE)
    c.train.input_workers = 1
    loop.train(c, str(tmp_path / "w1"))
  with pytest.raises(ValueError, match="valid: auto, device, host"):
    setup.build(_config(cache_dir, "gpu", DENSE))
  with pytest.raises(setup.planner.PlanDoesNotFit, match="train.feed=device: the data"):
    setup.build(_config(cache_dir, "device", DENSE), device_memory_budget=200_000)
  c = _config(cache_dir, "device", DENSE)
  c.data.multi_hot = {"sizes": (1, 2, 3, 1), "distribution": "uniform"}
  with pytest.raises(ValueError, match="read on the host"):
    setup.build(c)


def test_host_work_per_call_does_not_grow_with_the_batch(cache_dir):
  """The main thread's Python calls per call of the train step (`get`: take the next
  cursors, make the passes they read resident): the same at batch 64 and 1024, and at
  k = 1 and 8 steps per call."""
  import sys
  import time

  counts = {}
  for batch, k in ((64, 1), (1024, 1), (64, 8)):
    c = _config(cache_dir, "device", DENSE, k=k, steps=8, batch_size=batch, rows=20_000)
    run = setup.build(c)
    feed = run.device_feed.input(run.task, 0, 16, 0, "valid", ())
    items = [feed.get()]  # (the first call places the pass's order: once a pass)
    time.sleep(0.5)  # (the input thread ahead: `get` then never waits)
    calls = _Calls()
    sys.setprofile(calls)  # (this thread only)
    try:
      items += [feed.get() for _ in range(16 // k - 1)]
    finally:
      sys.setprofile(None)
    assert feed.get() is None
    feed.close()
    run.device_feed.close()
    assert [i.kind for i in items] == ["train"] * (16 // k)
    counts[(batch, k)] = calls.n / (16 // k - 1)
  # (about 10 calls: a queue's get, its room's put, `ensure`'s checks; one more or less
  # where the profile starts and stops)
  assert max(counts.values()) - min(counts.values()) <= 2 and max(counts.values()) < 20, counts


class _Calls:
  """A profile function counting the Python and C calls it sees."""

  n = 0

  def __call__(self, frame, event, arg):
    del frame, arg
    self.n += event in ("call", "c_call")


def test_each_process_holds_the_rows_its_devices_read(cache_dir):
  """`feed_rows.PerProcess` for 2 processes of 8 devices, both built here: every train
  position of process p maps into p's copy onto the row the order names; every eval row of
  each split is read exactly once, by one process, the padding marked invalid."""
  from recgnn.train import feed_rows

  skip_unless_devices(8, "8 devices")
  c = _config(cache_dir, "device", DENSE, mesh=(8, 1))
  c.train.order_shards, c.train.eval_batch_size = 4, 96
  rows = make_task(CTR, c).device_rows()
  mesh = sharding.make_mesh(8, 1)
  full = {k: np.asarray(v) for k, v in rows.arrays().items()}
  procs = [feed_rows.PerProcess(rows, mesh, p, 2) for p in range(2)]
  local = [p.process_arrays(i) for i, p in enumerate(procs)]
  half = rows.batch_size // 2
  for step in (0, 7, rows.train_batches + 1):
    e, b = divmod(step, rows.train_batches)
    order = rows.train_order(e)[b]
    for p in range(2):
      mine = np.asarray(procs[p].train_rows(order))[p * half : (p + 1) * half]
      want = order[p * half : (p + 1) * half]
      for k in full:
        np.testing.assert_array_equal(local[p][k][mine], full[k][want], err_msg=f"{step} {k}")
  e_half = rows.eval_batch_size // 2
  for split in ("valid", "test"):
    seen = []
    for cursor, _ in procs[0].eval_cursors(split):
      for p in range(2):
        r, v = (np.asarray(x) for x in procs[p].eval_rows(np.asarray(cursor, np.int32)))
        r, v = r[p * e_half : (p + 1) * e_half], v[p * e_half : (p + 1) * e_half]
        seen.append(local[p]["dense"][r[v]])
    lo, hi = rows.split_range(split)
    got = np.concatenate(seen)
    assert len(got) == hi - lo
    assert sorted(map(tuple, got)) == sorted(map(tuple, full["dense"][lo:hi]))
