"""The one-hot batch read of a converted CTR dataset (data/batch_gather.py, compiled, no GIL)
gives exactly the arrays of the numpy path (fancy-index reads + ctr_dataset.padded_batch):
shuffled rows, padding rows, every table's ids."""

import numpy as np
import pytest

from recgnn.data import batch_gather, ctr_dataset
from recgnn.data import criteo_synthetic as cs


@pytest.fixture(scope="module")
def dataset(ctr_cache):
  config = cs.SyntheticConfig(num_rows=20_000, scale=1e-3, seed=0, calibration_rows=5_000)
  return cs.default_synthetic_dataset(ctr_cache, config=config, progress=None).dataset


@pytest.mark.skipif(not batch_gather.AVAILABLE, reason="numba not installed")
@pytest.mark.parametrize("n", [512, 300, 0])
def test_compiled_read_equals_numpy(dataset, n):
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
