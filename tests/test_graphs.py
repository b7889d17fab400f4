"""Graph store: Planetoid Cora (bundled), the OGB raw layout, the synthetic generator."""

import collections
import gzip
import hashlib
import io
import os
import pickle

import numpy as np
import pytest
import scipy.sparse as sp

from recgnn.data import ogb, planetoid
from recgnn.graphs import store, synthetic

CORA = os.path.join(planetoid.BUNDLED, "cora")

# From /work/shared/data/README.md: the bundled bytes must be the source's.
CORA_SHA256 = {
  "ind.cora.allx": "9419ba2f26f5c35243db64aba110e0f35a04851609e0dc5433450676ca6b8543",
  "ind.cora.ally": "2b998f5cc7fedc86e7f97ca2498f47a1ffc1462c29e2d578b23bf3f62b6e7d71",
  "ind.cora.graph": "58f13302f39dde8852dad6fe6d15b89b077b6d7f837626bce671ef80344b383d",
  "ind.cora.test.index": "297ce89af2b51a6a194181c7dbe1796c6a1cf9cd9349a88383b1b1e227867875",
  "ind.cora.tx": "b9afbaa4a400df991f6f02ef677e1e44da55ffc04801fd02f9e673987829226a",
  "ind.cora.ty": "41f5ac76596a1699cc33f53084a2419e92961c42bb75f36fc38e616d348532ad",
  "ind.cora.x": "23cfa55d91c6f624233f5eb7b6e3f141f1bd2b2ae39608a63cf5d084bb27baab",
  "ind.cora.y": "94465c14eb53e04ca262198dcbb2521ee8af60fb3f3d546cd6ca24a511b0e7d1",
  "planetoid_LICENSE.txt": "8eeeea48c8b4bc197ad1d7ab01143ac43d52053e560b175bca7ca722c4047234",
}


@pytest.fixture(scope="module")
def cora():
  return planetoid.load("cora")


def test_bundled_cora_is_unchanged():
  for name, digest in CORA_SHA256.items():
    with open(os.path.join(CORA, name), "rb") as f:
      assert hashlib.sha256(f.read()).hexdigest() == digest, name


def test_cora_matches_published_statistics(cora):
  # PyG's Planetoid('Cora'): 2708 nodes, 10556 directed edges, 1433 features, 7 classes.
  assert cora.num_nodes == 2708 and cora.num_edges == 10556
  assert cora.num_features == 1433 and cora.num_classes == 7
  assert (cora.adj != cora.adj.T).nnz == 0
  assert cora.adj.diagonal().sum() == 0
  sizes = {k: v.size for k, v in cora.splits.items()}
  assert sizes == {"train": 140, "valid": 500, "test": 1000}
  np.testing.assert_array_equal(np.bincount(cora.labels[cora.splits["train"]]), [20] * 7)
  # The first labels of PyG's Cora data.y.
  np.testing.assert_array_equal(cora.labels[:10], [3, 4, 4, 0, 3, 2, 0, 3, 3, 2])
  np.testing.assert_allclose(cora.features.sum(1), 1.0, rtol=1e-5)
  assert np.bincount(cora.labels).tolist() == [351, 217, 418, 818, 426, 298, 180]


def test_cora_test_rows_follow_test_index():
  """Row i of tx belongs to node test.index[i] (Kipf's reordering)."""
  raw = planetoid.load("cora", normalize_features=False)
  tx = planetoid._as_csr(planetoid.restricted_load(os.path.join(CORA, "ind.cora.tx"))).toarray()
  ty = np.asarray(planetoid.restricted_load(os.path.join(CORA, "ind.cora.ty")))
  with open(os.path.join(CORA, "ind.cora.test.index")) as f:
    index = np.array([int(x) for x in f])
  assert not np.array_equal(index, np.sort(index))  # the reordering is not a no-op
  np.testing.assert_array_equal(raw.features[index], tx)
  np.testing.assert_array_equal(raw.labels[index], ty.argmax(1))
  np.testing.assert_array_equal(raw.splits["test"], np.sort(index))


def test_restricted_unpickler_refuses_other_types(tmp_path):
  class Evil:
    def __reduce__(self):
      return (os.system, ("echo pwned",))

  path = tmp_path / "ind.evil.x"
  path.write_bytes(pickle.dumps(Evil(), protocol=2))
  with pytest.raises(pickle.UnpicklingError, match="posix.system|os.system|restricted"):
    planetoid.restricted_load(str(path))
  # Ordinary types it does admit still load.
  ok = tmp_path / "ok"
  ok.write_bytes(pickle.dumps(collections.defaultdict(list, {0: [1, 2]}), protocol=2))
  assert planetoid.restricted_load(str(ok)) == {0: [1, 2]}


def test_csr_from_edges_matches_scipy():
  rng = np.random.default_rng(0)
  src, dst = rng.integers(0, 50, 400), rng.integers(0, 50, 400)
  adj = store.csr_from_edges(src, dst, 50, undirected=True)
  ref = sp.coo_matrix((np.ones(800), (np.r_[dst, src], np.r_[src, dst])), shape=(50, 50)).tocsr()
  ref.setdiag(0)
  ref.eliminate_zeros()
  ref.data[:] = 1
  assert (adj != ref).nnz == 0
  assert adj.has_sorted_indices and np.all(adj.data == 1)
  directed = store.csr_from_edges(np.array([0, 0]), np.array([1, 1]), 3, undirected=False)
  assert directed.nnz == 1 and directed[1, 0] == 1  # row 1 aggregates from 0


def _write_gz(path, text):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with gzip.open(path, "wt") as f:
    f.write(text)


def _ogb_fixture(root, with_features=True):
  """A tiny dataset in the OGB node-property raw layout."""
  rng = np.random.default_rng(1)
  n = 40
  edges = rng.integers(0, n, (120, 2))
  feats = rng.standard_normal((n, 3)).round(4)
  labels = rng.integers(0, 4, n).astype(float)
  labels[[5, 7]] = np.nan
  _write_gz(f"{root}/raw/edge.csv.gz", "".join(f"{a},{b}\n" for a, b in edges))
  if with_features:
    buf = io.StringIO()
    np.savetxt(buf, feats, delimiter=",", fmt="%.4f")
    _write_gz(f"{root}/raw/node-feat.csv.gz", buf.getvalue())
  _write_gz(
    f"{root}/raw/node-label.csv.gz",
    "".join(("nan" if np.isnan(v) else str(int(v))) + "\n" for v in labels),
  )
  _write_gz(f"{root}/raw/num-node-list.csv.gz", f"{n}\n")
  perm = rng.permutation(n)
  parts = {"train": perm[:20], "valid": perm[20:30], "test": perm[30:]}
  for name, ids in parts.items():
    _write_gz(f"{root}/split/time/{name}.csv.gz", "".join(f"{i}\n" for i in ids))
  return edges, feats, labels, parts


def test_ogb_raw_layout(tmp_path):
  root = str(tmp_path / "ogbn_tiny")
  edges, feats, labels, parts = _ogb_fixture(root)
  g = ogb.load(root)
  assert g.num_nodes == 40 and g.name == "ogbn_tiny"
  ref = store.csr_from_edges(edges[:, 0], edges[:, 1], 40, undirected=True)
  assert (g.adj != ref).nnz == 0
  np.testing.assert_allclose(g.features, feats, atol=1e-6)
  expect = np.where(np.isnan(labels), -1, np.nan_to_num(labels)).astype(int)
  np.testing.assert_array_equal(g.labels, expect)
  assert g.num_classes == int(np.nanmax(labels)) + 1
  for name, ids in parts.items():
    np.testing.assert_array_equal(g.splits[name], ids)
  # Directed: row dst aggregates from src only.
  d = ogb.load(root, undirected=False)
  a, b = edges[edges[:, 0] != edges[:, 1]][0]
  assert d.adj[b, a] == 1


def test_ogb_errors_name_the_fix(tmp_path):
  with pytest.raises(FileNotFoundError, match="config.data.path"):
    ogb.load(str(tmp_path / "missing"))
  root = str(tmp_path / "two")
  _ogb_fixture(root, with_features=False)
  os.makedirs(f"{root}/split/other")
  with pytest.raises(ValueError, match="config.data.split"):
    ogb.load(root)
  g = ogb.load(root, split="time")
  assert g.features is None


def test_synthetic_graph_properties():
  spec = synthetic.SyntheticSpec(
    num_nodes=20_000, num_edges=200_000, num_classes=5, homophily=0.7, num_features=8, seed=3
  )
  g = synthetic.generate(spec)
  assert g.num_nodes == 20_000 and g.num_classes == 5
  assert 0.9 * spec.num_edges <= g.num_edges <= spec.num_edges
  assert (g.adj != g.adj.T).nnz == 0 and g.adj.diagonal().sum() == 0
  deg = g.degrees()
  # Power law: a heavy tail (max far above the mean), most nodes below the mean.
  assert deg.max() > 20 * deg.mean() and np.median(deg) < deg.mean()
  # Planted communities: the fraction of within-community edges is the homophily plus
  # the chance of landing in one's own community when leaving it.
  rows = np.repeat(np.arange(g.num_nodes), deg)
  same = np.mean(g.labels[rows] == g.labels[g.adj.indices])
  assert abs(same - (0.7 + 0.3 / 5)) < 0.03
  assert g.features.shape == (20_000, 8) and g.features.dtype == np.float32
  # Features carry the label: nearest centroid recovers it well above chance.
  cent = np.stack([g.features[g.labels == c].mean(0) for c in range(5)])
  pred = np.argmin(((g.features[:, None] - cent[None]) ** 2).sum(-1), 1)
  assert np.mean(pred == g.labels) > 0.6
  again = synthetic.generate(spec)
  assert (again.adj != g.adj).nnz == 0 and np.array_equal(again.labels, g.labels)
  assert sum(v.size for v in g.splits.values()) == round(0.25 * 20_000)
  assert len(np.intersect1d(g.splits["train"], g.splits["test"])) == 0


def test_synthetic_no_homophily_means_no_signal():
  g = synthetic.generate(
    synthetic.SyntheticSpec(num_nodes=5000, num_edges=50_000, num_classes=4, homophily=0.0)
  )
  rows = np.repeat(np.arange(g.num_nodes), g.degrees())
  assert abs(np.mean(g.labels[rows] == g.labels[g.adj.indices]) - 0.25) < 0.03


def test_spec_errors():
  with pytest.raises(ValueError, match="power_law_exponent"):
    synthetic.SyntheticSpec(power_law_exponent=1.5)
  with pytest.raises(ValueError, match="Unknown Planetoid"):
    planetoid.load("corra")
