"""The one-hot batch read of a converted CTR dataset (data/batch_gather.py, compiled, no GIL)
gives exactly the arrays of the numpy path (fancy-index reads + ctr_dataset.padded_batch):
shuffled rows, padding rows, every table's ids; also when a batch's positions are split over
threads (`recgnn.hostpool`)."""

import numpy as np
import pytest

from recgnn import hostpool
from recgnn.data import batch_gather, ctr_dataset
from recgnn.data import criteo_synthetic as cs


@pytest.fixture(scope="module")
def dataset(ctr_cache):
  config = cs.SyntheticConfig(num_rows=20_000, scale=1e-3, seed=0, calibration_rows=5_000)
  return cs.default_synthetic_dataset(ctr_cache, config=config, progress=None).dataset


@pytest.mark.skipif(not batch_gather.AVAILABLE, reason="numba not installed")
@pytest.mark.parametrize("n", [512, 300, 0, -512])
def test_compiled_read_equals_numpy(dataset, n):
  """n < 0: |n| rows in order (an eval batch, train.shuffle=False), also the kernel's."""
  if n < 0:
    n = -n
    rows = np.arange(1000, 1000 + n, dtype=np.int64)
  else:
    rows = np.sort(np.random.default_rng(n).permutation(dataset.num_rows)[:n]).astype(np.int64)
  got = dataset.gather(rows, 512)
  want = ctr_dataset.padded_batch(
    512, dataset.dense[rows], dataset.labels[rows], dataset.sparse[rows], dataset.table_names
  )
  assert got.keys() == want.keys() and got["ids"].keys() == want["ids"].keys()
  for k in ("dense", "label", "weight"):
    assert got[k].dtype == want[k].dtype
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)
  for name in want["ids"]:
    assert got["ids"][name].shape == want["ids"][name].shape == (512, 1)
    np.testing.assert_array_equal(got["ids"][name], want["ids"][name], err_msg=name)
  assert got["weight"].sum() == n
  for name in want["ids"]:  # (each table's ids contiguous, whatever the [T, B] array's stride)
    assert got["ids"][name].flags.c_contiguous, name


@pytest.fixture(params=[1, 2, 3])
def threads(request, monkeypatch):
  """`hostpool` forced to 1, 2 and 3 threads, a chunk of any size paying for a thread."""
  monkeypatch.setattr(batch_gather, "MIN_ROWS_PER_CHUNK", 1)
  old = hostpool.set_threads(request.param)
  yield request.param
  hostpool.set_threads(old)


@pytest.mark.skipif(not batch_gather.AVAILABLE, reason="numba not installed")
@pytest.mark.parametrize(
  "n,b,order",
  [
    (512, 512, "sorted"),
    (301, 512, "sorted"),
    (7, 9, "shuffled"),
    (2, 8, "sorted"),
    (0, 4, "sorted"),
  ],
)
def test_threaded_read_equals_one_call(dataset, threads, n, b, order):
  """A batch's positions cut over threads (`hostpool`) give the arrays of one kernel call:
  every chunk boundary, uneven chunks, fewer rows than threads, padding after the rows."""
  rng = np.random.default_rng(n)
  rows = rng.permutation(dataset.num_rows)[:n].astype(np.int64)
  if order == "sorted":
    rows = np.sort(rows)
  if n >= 2:  # (not contiguous: gather's slice path would not read through the kernel)
    rows[1] = (rows[0] + 2) % dataset.num_rows
  got = dataset.gather(rows, b)
  want = ctr_dataset.padded_batch(
    b, dataset.dense[rows], dataset.labels[rows], dataset.sparse[rows], dataset.table_names
  )
  for k in ("dense", "label", "weight"):
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)
  for name in want["ids"]:
    np.testing.assert_array_equal(got["ids"][name], want["ids"][name], err_msg=name)
  # The positions were really cut (n rows, one per chunk at most): as `hostpool.chunks` says.
  assert len(hostpool.chunks(n, batch_gather.MIN_ROWS_PER_CHUNK)) - 1 == max(1, min(threads, n))
