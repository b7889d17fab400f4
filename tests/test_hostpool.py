"""recgnn.hostpool: a GIL-free kernel over chunks on a per-process pool: its cuts, its errors,
its thread count. (The threaded one-hot read: tests/test_batch_gather.py.)"""

import threading

import numpy as np
import pytest

from recgnn import hostpool


@pytest.fixture
def threads(request, monkeypatch):
  """`hostpool` forced to request.param threads, any chunk paying for a thread."""
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


def test_chunks_respect_the_minimum_and_the_most():
  old = hostpool.set_threads(8)
  try:
    assert hostpool.chunks(100, 30) == [0, 34, 67, 100]  # 3 chunks of >= 30
    assert hostpool.chunks(29, 30) == [0, 29]
    assert hostpool.chunks(100, 1, most=2) == [0, 50, 100]
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
