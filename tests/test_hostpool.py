"""recgnn.hostpool: a GIL-free kernel over chunks on a per-process pool. Its cuts, its errors,
the stacked dedup split over tables (exactly one kernel call's arrays), and a forked child
that chunks after its parent made the pool (the input worker's case)."""

import multiprocessing
import threading
import warnings

import numpy as np
import pytest

from recgnn import hostpool
from recgnn.embeddings import kernels


@pytest.fixture
def threads(request, monkeypatch):
  """`hostpool` forced to request.param threads, any chunk paying for a thread."""
  monkeypatch.setattr(kernels.StackedDedup, "MIN_IDS_PER_CHUNK", 1)
  old = hostpool.set_threads(request.param)
  yield request.param
  hostpool.set_threads(old)


@pytest.mark.parametrize("threads", [1, 2, 3, 8], indirect=True)
@pytest.mark.parametrize("n", [0, 1, 2, 7, 64])
def test_chunks_cover_the_work_once_on_several_threads(threads, n):
  cuts = hostpool.chunks(n, 1)
  assert cuts[0] == 0 and cuts[-1] == n and len(cuts) - 1 == max(1, min(threads, n))
  sizes = np.diff(cuts)
  assert sizes.max() - sizes.min() <= 1 and (n == 0 or sizes.min() >= 1)
  seen = np.zeros(n, np.int64)
  names = set()
  barrier = threading.Barrier(len(cuts) - 1, timeout=30)

  def fn(lo, hi):
    seen[lo:hi] += 1
    names.add(threading.current_thread().name)
    barrier.wait()  # every chunk in flight at once (or this times out)

  hostpool.run(fn, cuts)
  assert (seen == 1).all() and len(names) == len(cuts) - 1


def test_chunks_respect_the_minimum():
  old = hostpool.set_threads(8)
  try:
    assert hostpool.chunks(100, 30) == [0, 34, 67, 100]  # 3 chunks of >= 30
    assert hostpool.chunks(29, 30) == [0, 29]
    assert hostpool.chunks(5, 1) == [0, 1, 2, 3, 4, 5]
  finally:
    hostpool.set_threads(old)


def test_an_error_in_any_chunk_is_raised_after_every_chunk_ended():
  old = hostpool.set_threads(3)
  done = []

  def fn(lo, hi):
    if lo == 1:
      raise ValueError("chunk 1")
    done.append(lo)

  try:
    with pytest.raises(ValueError, match="chunk 1"):
      hostpool.run(fn, [0, 1, 2, 3])
    assert sorted(done) == [0, 2]
  finally:
    hostpool.set_threads(old)


def test_threads_from_the_environment(monkeypatch):
  old = hostpool.set_threads(None)
  try:
    monkeypatch.setenv(hostpool.ENV, "3")
    hostpool.set_threads(None)
    assert hostpool.threads() == 3
    monkeypatch.setenv(hostpool.ENV, "0")  # auto: the CPUs this process may use, capped
    hostpool.set_threads(None)
    assert 1 <= hostpool.threads() <= hostpool.MAX_DEFAULT_THREADS
    monkeypatch.setenv(hostpool.ENV, "two")
    hostpool.set_threads(None)
    with pytest.raises(ValueError, match="RECGNN_HOST_THREADS"):
      hostpool.threads()
  finally:
    monkeypatch.delenv(hostpool.ENV)
    hostpool.set_threads(old)


def _ids(seed, tables, b, bag, rows):
  """int32[T, B, L] with repeats (few distinct rows per table) and padding (-1)."""
  rng = np.random.default_rng(seed)
  ids = np.stack([rng.integers(0, r, (b, bag)) for r in rows]).astype(np.int32)
  ids[rng.random(ids.shape) < 0.2] = -1
  return ids


def _one_call(fillers, ids):
  """StackedDedup's arrays by one kernel call over every table (the path before threads)."""
  d = kernels.StackedDedup(fillers)
  t = ids.shape[0]
  flat = np.ascontiguousarray(ids.reshape(t, -1))
  mark = np.empty(int(np.sum(d.fillers + 1)), np.int32)
  out = [np.empty(flat.shape, np.int32) for _ in range(3)]
  d.kernel(flat, d.fillers, d.offsets, mark, *out)
  return out[0].reshape(ids.shape), out[1], out[2].reshape(ids.shape)


@pytest.mark.parametrize("threads", [1, 2, 3], indirect=True)
@pytest.mark.parametrize(
  "tables,b,bag", [(11, 64, 1), (5, 16, 3), (2, 8, 1), (1, 32, 1), (4, 0, 1)]
)
def test_threaded_stacked_dedup_equals_one_call(threads, tables, b, bag):
  if kernels.stacked_dedup_kernel() is None:
    pytest.skip("numba not installed")
  rows = [3 + 5 * i for i in range(tables)]  # few rows: every table repeats ids
  fillers = [r + (i % 2) for i, r in enumerate(rows)]  # (padded rows beyond some tables)
  dedup = kernels.StackedDedup(fillers)
  for seed in range(3):  # (the shared scratch is never cleared: batches after batches)
    ids = _ids(seed, tables, b, bag, rows)
    got, want = dedup(ids), _one_call(fillers, ids)
    for g, w, name in zip(got, want, ("mapped", "unique", "inverse")):
      assert g.dtype == w.dtype and g.shape == w.shape, name
      np.testing.assert_array_equal(g, w, err_msg=name)
    mapped, unique, inverse = got
    for t in range(tables):  # and they are a dedup: each id found at its inverse
      np.testing.assert_array_equal(unique[t][inverse[t].ravel()], mapped[t].ravel())
  assert len(hostpool.chunks(tables, 1)) - 1 == min(threads, tables)


def _child(conn, fillers, ids):
  """In a forked child: the stacked dedup over 2 threads (the parent's pool has none here)."""
  conn.send([np.asarray(x) for x in kernels.StackedDedup(fillers)(ids)])
  conn.close()


@pytest.mark.parametrize("threads", [2], indirect=True)
def test_a_forked_child_chunks_after_its_parent_did(threads):
  if kernels.stacked_dedup_kernel() is None:
    pytest.skip("numba not installed")
  rows = [50] * 6
  ids = _ids(0, 6, 128, 1, rows)
  want = kernels.StackedDedup(rows)(ids)  # the parent's pool now exists, with its threads
  assert any(t.name.startswith("recgnn host") for t in threading.enumerate())
  ctx = multiprocessing.get_context("fork")
  parent, child = ctx.Pipe()
  with warnings.catch_warnings():  # (Python 3.12 warns at a fork of a threaded process)
    warnings.simplefilter("ignore", DeprecationWarning)
    warnings.filterwarnings("ignore", message=r".*fork\(\).*", category=RuntimeWarning)  # (JAX)
    proc = ctx.Process(target=_child, args=(child, rows, ids))
    proc.start()
  try:
    # The child's result, or nothing: its chunks sent to threads that did not fork never run.
    assert parent.poll(30), "the forked child's chunked call did not finish"
    got = parent.recv()
  finally:
    proc.join(10)
    if proc.exitcode is None:
      proc.kill()
  assert proc.exitcode == 0
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g, w)
