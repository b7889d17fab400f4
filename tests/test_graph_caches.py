"""The graph caches the project writes and reads back (data/graph_loading.py: the node-order
permutation, the eigenvector init file) are verified before use (`data/file_check.py`): a
file cut short or with a flipped byte is computed again from the graph, never read as data;
a node order written before the manifests is kept only when it is a whole permutation."""

import os

import ml_collections
import numpy as np
import pytest

from recgnn.data import file_check, graph_loading
from recgnn.graphs import synthetic
from tests.trainer_lib import flip_byte


def _data(cache_dir: str) -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(
    {
      "source": "synthetic",
      "node_order": "random",
      "cache_dir": cache_dir,
      "synthetic": {"num_nodes": 600, "num_edges": 3000, "num_classes": 3, "seed": 1},
    }
  )


def _load(cache_dir: str):
  info: dict = {}
  graph = graph_loading.load_graph(_data(cache_dir), info)
  return graph, info["node_order_file"]


def test_a_damaged_node_order_is_computed_again(tmp_path, caplog):
  graph, path = _load(str(tmp_path))
  perm = np.load(path)
  key = file_check.read_manifest(path + file_check.SIDECAR)["key"]
  assert file_check.sidecar_problem(path, key) is None
  size = os.path.getsize(path)
  with open(path, "r+b") as f:  # half its bytes: np.load would fail, or read half
    f.truncate(size // 2)
  assert f"{path} has {size // 2:,} bytes" in file_check.sidecar_problem(path, key)
  again, _ = _load(str(tmp_path))
  assert os.path.getsize(path) == size and file_check.sidecar_problem(path, key) is None
  np.testing.assert_array_equal(again.original_ids, perm)
  assert "computing it again" in caplog.text
  flip_byte(path, size - 3)  # same size, another permutation's bytes: read silently before
  assert "first bytes differ" in file_check.sidecar_problem(path, key)
  third, _ = _load(str(tmp_path))
  np.testing.assert_array_equal(third.original_ids, perm)
  np.testing.assert_array_equal(np.load(path), perm)


def test_a_node_order_without_its_manifest_is_kept_only_when_whole(tmp_path):
  """A cache written before the manifests: a whole permutation is kept as it is (a partition
  order computed again may differ from a checkpoint's) and recorded; a damaged one is
  computed again."""
  _, path = _load(str(tmp_path))
  perm = np.load(path)
  os.remove(path + file_check.SIDECAR)
  stamp = os.stat(path).st_mtime_ns
  graph, _ = _load(str(tmp_path))
  np.testing.assert_array_equal(graph.original_ids, perm)
  assert os.stat(path).st_mtime_ns == stamp and os.path.exists(path + file_check.SIDECAR)
  os.remove(path + file_check.SIDECAR)
  np.save(path, np.concatenate([perm[:-1], perm[:1]]))  # a repeated node: not a permutation
  graph, _ = _load(str(tmp_path))
  np.testing.assert_array_equal(graph.original_ids, perm)
  np.testing.assert_array_equal(np.load(path), perm)


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_damaged_eigen_init_is_computed_again(tmp_path, damage):
  graph = synthetic.generate(synthetic.SyntheticSpec(num_nodes=300, num_edges=2000, seed=2))
  path = str(tmp_path / "eigen.npy")
  graph_loading.write_eigen_init(graph, 4, path)
  want = np.load(path)
  stamp = os.stat(path).st_mtime_ns
  assert graph_loading.write_eigen_init(graph, 4, path) == path
  assert os.stat(path).st_mtime_ns == stamp  # whole: reused
  size = os.path.getsize(path)
  if damage == "truncate":
    with open(path, "r+b") as f:
      f.truncate(size - 40)
  else:
    flip_byte(path, 200)
  graph_loading.write_eigen_init(graph, 4, path)
  assert os.path.getsize(path) == size
  np.testing.assert_allclose(np.load(path), want, atol=1e-5)
  key = file_check.read_manifest(path + file_check.SIDECAR)["key"]
  assert file_check.sidecar_problem(path, key) is None
