"""The device feed's streamed mode (data larger than the devices' budget, or train.order=window):
the window order itself (every used row once a pass, a function of the step); the same batches
and params as the host feed in that order, across a pass boundary, with k = 1 and k = 8 (a call
crossing the short last window: three slots), and across a stop and --resume; the feed's own
uploaded bytes per sample (the record's plus its order's 4); when auto / device stream or
refuse."""

import numpy as np
import pytest

from recgnn.data.window_order import WindowOrder
from recgnn.tasks.ctr import CTR
from recgnn.train import device_feed, loop, setup
from tests.test_device_feed import DENSE, _batch_equal, _config, _same_state
from tests.trainer_lib import (
  make_task,
  skip_unless_deterministic,
  skip_unless_devices,
  smoke_config,
)


@pytest.fixture(scope="module")
def cache_dir(ctr_cache):
  return ctr_cache


def _window(c, chunk_rows, window_chunks):
  c.train.order = "window"
  c.train.feed_chunk_rows = chunk_rows
  c.train.feed_window_chunks = window_chunks
  return c


@pytest.mark.parametrize("seed", [None, 3])
def test_window_order_reads_every_used_row_once_a_pass(seed):
  """2,571 rows from row 40, batches of 256 (2,560 used), chunks of 512 (5), windows of 2:
  windows of 4, 4 and 2 batches; every used row once a pass, a batch's rows sorted and within
  its window's chunks; passes differ; the same step gives the same rows."""
  o = WindowOrder(2571, 40, 256, 600, 2, seed)
  assert (o.chunk_rows, o.num_chunks, o.windows, o.window_batches, o.last_batches) == (
    512, 5, 3, 4, 2,
  )  # fmt: skip
  passes = []
  for e in range(2):
    rows = np.stack([o.batch_rows(e * o.batches + b) for b in range(o.batches)])
    assert np.array_equal(np.sort(rows.ravel()), np.arange(40, 40 + 2560))
    assert np.all(np.diff(rows, axis=1) > 0)
    for b, batch in enumerate(rows):
      _, w, _ = o.locate(e * o.batches + b)
      spans = [o.chunk(c) for c in o.window_chunk_ids(e, w)]
      assert all(any(lo <= r < hi for lo, hi in spans) for r in batch)
    passes.append(rows)
  assert (seed is None) == np.array_equal(passes[0], passes[1])
  again = WindowOrder(2571, 40, 256, 600, 2, seed)
  assert np.array_equal(again.batch_rows(13), passes[1][3])


def test_host_feed_reads_the_window_order(cache_dir):
  """train.order=window: the task's train batches are those of the order's rows, from any
  start step."""
  c = _window(_config(cache_dir, "host", DENSE), 512, 2)
  task = make_task(CTR, c)
  order = task.window_order()
  batches = task.train_batches(7)
  for step in range(7, 7 + 12):
    want = task.data.gather(order.batch_rows(step))
    _batch_equal(next(batches), want, f"step {step}")


TT = (("C(3|4)", "tt(rank=4)"), (".*", "dense(dedup=device)"))
# (the default run keeps a multi-device k = 8 case and tt; the others are `long`: the
# resident feed's tests cover those meshes, and the suite's 10 minutes cold are a budget)
LONG = pytest.mark.long
CASES = [
  pytest.param("dense", DENSE, (1, 1), 1, 512, marks=LONG, id="dense-1x1-k1"),
  pytest.param("dense", DENSE, (1, 1), 8, 1024, marks=LONG, id="dense-1x1-k8"),
  pytest.param("dense", DENSE, (2, 4), 8, 1024, id="dense-2x4-k8"),
  pytest.param("dense", DENSE, (8, 1), 1, 512, marks=LONG, id="dense-8x1-k1"),
  pytest.param("tt", TT, (1, 1), 1, 512, id="tt-1x1-k1"),
]


@pytest.mark.parametrize("name,plan,mesh,k,chunk", CASES)
def test_streamed_trains_as_the_host_feed(cache_dir, tmp_path, name, plan, mesh, k, chunk):
  """16 steps (a pass is 10 batches; windows of 4, 4, 2 at k = 1; of 8 and 2 at k = 8: a call
  reads the short window and the next pass's first), an eval after step 8 and at the end:
  params and AUC bit for bit as the host feed's in the window order; tt's ids read on the
  host from the same order."""
  skip_unless_deterministic()
  skip_unless_devices(mesh[0] * mesh[1], f"mesh {mesh[0]}x{mesh[1]}")

  def config(feed):
    return _window(_config(cache_dir, feed, plan, mesh, k, 16, eval_every=8), chunk, 2)

  host = loop.train(config("host"), str(tmp_path / "h"))
  run = setup.build(config("device"))
  assert run.device_feed.orders.slots == (2 if k == 1 else 3)
  assert "streamed in windows of 2 chunks" in run.feed_how
  run.device_feed.close()
  dev = loop.train(config("device"), str(tmp_path / "d"))
  _same_state(host, dev)
  assert dev.metrics["test/auc"] == host.metrics["test/auc"]
  assert dev.metrics["valid/auc"] == host.metrics["valid/auc"]


def test_streamed_resumes_exactly(cache_dir, tmp_path):
  """Stopped after 6 steps (inside the second window) and resumed: as the uninterrupted run."""
  skip_unless_deterministic()
  c = _window(_config(cache_dir, "device", DENSE, k=2, steps=16), 512, 2)
  full = loop.train(c, str(tmp_path / "full"))
  wd = str(tmp_path / "chain")
  assert loop.train(c, wd, stop_after=6).metrics["step"] == 6
  end = loop.train(c, wd, resume=True)
  _same_state(full, end)
  assert end.metrics["test/auc"] == full.metrics["test/auc"]


def test_uploaded_bytes_per_sample(cache_dir, tmp_path):
  """Two whole passes streamed on Criteo's 26 tables (label int8 + 13 dense float32 + 26 ids
  int32 = 157 bytes a row): the feed uploads each row once a pass and, per window, its order's
  keys and chunk ranks (a few words): 157 bytes a sample and a fraction, within 1.05x."""
  c = _window(smoke_config(cache_dir, rows=3_000, mesh=(1, 1), plan=DENSE, steps=20), 512, 2)
  c.train.feed, c.train.eval_batch_size, c.train.log_every = "device", 1000, 1
  m = loop.train(c, str(tmp_path / "bytes")).metrics
  assert m["feed/record_bytes"] == 157
  rows = 2 * 2560 * 157  # (two passes of the 2,560 rows used)
  keys = 2 * (3 * (16 + 8) + 2 * 8 + 4)  # (3 windows a pass: keys, a scalar pair, ranks)
  assert m["feed/host_to_device_bytes"] == rows + keys
  assert m["feed/host_to_device_bytes_per_sample"] <= 1.001 * m["feed/record_bytes"]
  assert m["feed/eval_host_to_device_bytes"] > 0


@pytest.mark.parametrize("seed", [None, 5])
def test_orders_made_on_the_devices_are_the_hosts(seed):
  """`_write_order` of each window of two passes (full and short windows) equals the numpy
  order's local indices, offset to its slot."""
  import jax.numpy as jnp

  from recgnn.train import feed_stream

  o = WindowOrder(2571 * 7, 0, 64, 700, 3, seed)
  orders = jnp.zeros((2, o.window_batches, o.batch_size), jnp.int32)
  for g in range(2 * o.windows):
    e, w = divmod(g, o.windows)
    n = o.window_rows_of(e, w)
    orders = feed_stream._write_order(
      orders, o.keys(e, w), o.ranks(e, w), np.int32(g % 2 * 1000), np.int32(g % 2),
      n=n, nb=n // 64, b=64, c=o.chunk_rows,
    )  # fmt: skip
    want = o.window(e, w)[1] + g % 2 * 1000
    np.testing.assert_array_equal(np.asarray(orders[g % 2, : n // 64]), want, err_msg=f"{g}")


def test_auto_and_device_stream_or_refuse(cache_dir):
  """The data past the budget: device and auto stream when a window fits (train order then
  window), device refuses with the figures when not even a window does, or when a call's k
  steps are more than a window's batches."""
  c = _config(cache_dir, "device", DENSE, rows=20_000)
  c.train.feed_chunk_rows, c.train.feed_window_chunks = 512, 2
  c.train.eval_batch_size = 100
  whole = setup.build(c)
  assert whole.device_feed.data is not None  # (fits whole: no streaming)
  need = whole.device_feed.rows.nbytes
  plan_bytes = setup.planner.check_memory(whole.plan, None, None)
  budget = plan_bytes + need // 2
  run = setup.build(c, device_memory_budget=budget)
  assert run.device_feed.data is None and run.device_feed.rows.window is not None
  assert "streamed in windows" in run.feed_how
  with pytest.raises(setup.planner.PlanDoesNotFit, match="even streamed"):
    setup.build(c, device_memory_budget=plan_bytes + 1000)
  c8 = _window(_config(cache_dir, "device", DENSE, k=8), 512, 2)  # (windows of 4 batches)
  with pytest.raises(setup.planner.PlanDoesNotFit, match="steps_per_call=8 is more than a win"):
    setup.build(c8)
  rows = whole.task.device_rows()
  auto = _config(cache_dir, "auto", DENSE, rows=20_000).train
  auto.feed_chunk_rows, auto.feed_window_chunks = 512, 2
  assert device_feed.fits(auto, rows, plan_bytes, budget, whole.mesh) is None
  assert rows.window is not None and rows.window.chunk_rows == 512
  # train.order_shards > 1 is an order of its own: never swapped for the window order
  sharded = whole.task.device_rows()
  sharded.shards = 2
  why = device_feed.fits(auto, sharded, plan_bytes, budget, whole.mesh)
  assert "order_shards=2 is not streamed" in why and sharded.window is None


def test_streamed_host_work_per_call_does_not_grow_with_the_batch(cache_dir):
  """The main thread's Python calls per call of the streamed train step (take the cursors,
  write the finished uploads into their slots, start the next): no more at batch 1024 than at
  64 (windows of 8 batches either way, so as many slot writes a step): about 40 here,
  the resident feed's 10 plus `_pump`'s checks and the amortized slot writes. The bound below
  64 fails a loop over a batch's examples even at the smaller batch; the count itself depends
  on jax's Python (device_put), so it is not pinned, and on when uploads finish (an upload
  done before a call is written into its slot then, else at a later call: a few calls either
  way, where a per-example loop would add ~960 at batch 1024)."""
  import sys
  import time

  from tests.test_device_feed import _Calls

  counts = {}
  for batch in (64, 1024):
    c = _window(_config(cache_dir, "device", DENSE, batch_size=batch, rows=20_000), 4 * batch, 2)
    run = setup.build(c)
    feed = run.device_feed.input(run.task, 0, 24, 0, "valid", ())
    items = [feed.get()]
    time.sleep(0.5)
    calls = _Calls()
    sys.setprofile(calls)
    try:
      items += [feed.get() for _ in range(23)]
    finally:
      sys.setprofile(None)
    feed.close()
    run.device_feed.close()
    assert [i.kind for i in items] == ["train"] * 24
    counts[batch] = calls.n / 23
  assert abs(counts[64] - counts[1024]) <= 8 and max(counts.values()) < 60, counts
