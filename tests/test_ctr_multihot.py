"""Multi-hot CTR end to end: MLPerf's one-hot -> multi-hot recipe, the CTR task's bags and
pooling, DCNv2 / dot through every backend on the 2x4 mesh, and your own multi-hot TSV by
schema."""

import json

import numpy as np
import pytest

from recgnn.data import multihot
from recgnn.train import loop
from tests import contract_lib
from tests.trainer_lib import skip_unless_devices, smoke_config


@pytest.fixture(scope="module")
def cache_dir(ctr_cache):
  return ctr_cache  # (conftest: one per process)


def test_recipe_keeps_the_id_first_and_is_a_fixed_function():
  r = multihot.MultiHotRecipe()
  ids = np.array([0, 5, 5, 39059, 17], np.int32)
  a = r.expand(1, ids[:, None], 39060)  # table C2: bags of 2
  assert a.shape == (5, 2) and a.dtype == np.int32
  np.testing.assert_array_equal(a[:, 0], ids)
  np.testing.assert_array_equal(a[1], a[2])  # the same id, the same bag
  assert (a >= 0).all() and (a < 39060).all()
  np.testing.assert_array_equal(r.expand(1, ids, 39060), a)  # [B] or [B, 1]
  assert r.expand(2, ids, 17295).shape == (5, 1)  # size 1: one-hot stays
  big = r.expand(20, np.arange(2000), 10_000)  # C21: 100 ids
  assert big.shape == (2000, 100)
  u = big[:, 1:].ravel()
  assert abs(u.mean() / 10_000 - 0.5) < 0.01  # uniform over the rows
  other = multihot.MultiHotRecipe(seed=1).expand(20, np.arange(2000), 10_000)
  assert (other[:, 1:] != big[:, 1:]).mean() > 0.99
  p = multihot.MultiHotRecipe(distribution="pareto").expand(20, np.arange(2000), 10_000)[:, 1:]
  assert (p >= 0).all() and (p < 10_000).all()
  assert np.median(p) < 100  # Pareto(0.25): most ids small
  with pytest.raises(ValueError, match="available: uniform, pareto"):
    multihot.MultiHotRecipe(distribution="zipf")


# The trainer runs' tables: 4 of Criteo's (tests/trainer_lib.py: a fraction of the 26 tables'
# build) with MLPerf's bag sizes for those tables: one-hot (C3), the largest bag (C21: 100),
# one in between (C16: 5), and C1 (3) for the plans' other group.
TABLES = ("C3", "C21", "C16", "C1")
SIZES = tuple(multihot.MLPERF_MULTI_HOT_SIZES[int(n[1:]) - 1] for n in TABLES)  # (1, 100, 5, 3)


def _multihot_config(cache_dir, interaction, mesh=None, plan=None):
  c = smoke_config(cache_dir, mesh=mesh, plan=plan, tables=TABLES, steps=2, log_every=2)
  c.data.multi_hot = {"sizes": SIZES, "distribution": "uniform"}
  c.model.interaction = interaction
  c.model.cross_layers = 2
  c.model.low_rank = 8
  return c


def test_task_batches_carry_the_bags(cache_dir):
  """MLPerf's 26 sizes on Criteo's 26 tables (the synthetic default, the Criteo reader)."""
  c = smoke_config(cache_dir, steps=2, log_every=2)
  c.data.multi_hot = {"sizes": multihot.MLPERF_MULTI_HOT_SIZES, "distribution": "uniform"}
  c.model.interaction = "dcn"
  task = loop.load_task(c, loop.config_mesh(c))
  assert task.bag_lengths == multihot.MLPERF_MULTI_HOT_SIZES
  b = next(iter(task.train_batches()))
  for name, size in zip(task.names, multihot.MLPERF_MULTI_HOT_SIZES):
    assert b["ids"][name].shape == (256, size) and b["ids"][name].dtype == np.int32
  assert all(s.pooling == "sum" for s in task.tables())


def _trained_tables(result) -> dict[str, np.ndarray]:
  """{table: its trained rows} over every group of a run (TT's: its reconstruction)."""
  out = {}
  for key, group in result.plan.groups.items():
    out.update({t: np.asarray(v) for t, v in group.tables(result.state.emb[key]).items()})
  return out


@pytest.fixture(scope="module")
def dense_2x4(cache_dir, tmp_path_factory):
  """The all-dense run on 2x4 the backends' runs are compared with: its trained tables."""
  skip_unless_devices(8, "mesh 2x4")
  c = _multihot_config(cache_dir, "dcn", mesh=(2, 4), plan=((".*", "dense"),))
  return _trained_tables(loop.train(c, str(tmp_path_factory.mktemp("dense_2x4"))))


@pytest.mark.parametrize(
  "backend",
  [
    "dense",
    "dense(shard=rows)",
    "tt(rank=4)",
    "offload(cache_rows=2048, lookahead=1)",
    "hot_cold(budget=0.3, profile_batches=1)",
    "sharded",
  ],
)
def test_multihot_trains_through_every_backend_on_2x4(cache_dir, tmp_path, backend, dense_2x4):
  """MLPerf-sized bags (1 to 100 ids) on the 2x4 mesh, a few DCNv2 steps: every exact backend's
  trained tables equal all-dense's (tt's are compressed: its own reconstruction instead), and
  each group's lookup of bags up to 100 ids equals numpy's pooling of its trained tables."""
  assert SIZES == (1, 100, 5, 3)
  plan = (("C(3|16|21)", backend), (".*", "dense"))  # bags of 1, 5 and 100 in `backend`
  result = loop.train(_multihot_config(cache_dir, "dcn", mesh=(2, 4), plan=plan), str(tmp_path))
  assert np.isfinite(result.metrics["test/logloss"])
  assert 0.0 <= result.metrics["test/auc"] <= 1.0
  got = _trained_tables(result)
  for t in TABLES:
    if not backend.startswith("tt"):  # (tt trains another model: even C1 differs)
      np.testing.assert_allclose(got[t], dense_2x4[t], rtol=1e-5, atol=1e-6, err_msg=t)
  assert contract_lib.lookups_match_own_tables(result, dict(zip(TABLES, SIZES))) == len(TABLES)


def test_dot_and_mean_pooling_on_one_device(cache_dir, tmp_path):
  """Mean pooling through the trainer, and each lookup of bags of up to 100 ids against
  numpy's mean of the trained rows (the contract's tests compare dense with dense there)."""
  c = _multihot_config(cache_dir, "dot")
  c.embeddings.pooling = "mean"
  task = loop.load_task(c, loop.config_mesh(c))
  assert all(s.pooling == "mean" for s in task.tables())
  result = loop.train(c, str(tmp_path))
  assert np.isfinite(result.metrics["test/logloss"])
  assert contract_lib.lookups_match_own_tables(result, dict(zip(TABLES, SIZES))) == len(TABLES)


def test_own_multihot_tsv_by_schema(cache_dir, tmp_path):
  """data.schema: a TSV with a header, one-hot and multi-hot columns, trains with DCNv2."""
  rng = np.random.default_rng(0)
  path = tmp_path / "clicks.tsv"
  lines = ["y\tx1\tx2\tad\ttags"]
  for _ in range(3000):
    ad = int(rng.zipf(1.5)) % 50
    tags = [int(rng.integers(0, 30)) for _ in range(int(rng.integers(0, 4)))]
    p = 1 / (1 + np.exp(-(ad % 3 - 1 + 0.5 * (7 in tags))))
    lines.append(
      f"{int(rng.random() < p)}\t{rng.normal():.3f}\t{int(rng.integers(0, 9))}\tad{ad}\t"
      + ",".join(f"t{t}" for t in tags)
    )
  path.write_text("\n".join(lines) + "\n")
  c = smoke_config(cache_dir, steps=6, log_every=3, batch_size=128, eval_batch_size=512)
  c.data.path = str(path)
  c.data.schema = json.dumps({  # inline JSON: data.schema is a string field
    "label": "y", "dense": ["x1", "x2"], "header": True, "dense_transform": "none",
    "categorical": ["ad", {"name": "tags", "bag": 3, "separator": ",", "pooling": "mean"}],
  })  # fmt: skip
  c.model.interaction = "dcn"
  task = loop.load_task(c, loop.config_mesh(c))
  assert task.names == ["ad", "tags"] and task.bag_lengths == (1, 3)
  assert [s.pooling for s in task.tables()] == ["sum", "mean"]
  result = loop.train(c, str(tmp_path / "wd"))
  assert np.isfinite(result.metrics["test/logloss"])
  bags = {"ad": 1, "tags": 3}  # tags: a mean of 0 to 3 ids
  assert contract_lib.lookups_match_own_tables(result, bags) == 2


def test_dlrmv2_experiment_config(tmp_path):
  from experiments import dlrmv2_criteo1tb as exp

  c = exp.get_config()
  assert c.model.interaction == "dcn" and c.model.low_rank == 32 and not c.data.path
  assert tuple(c.data.multi_hot.sizes) == multihot.MLPERF_MULTI_HOT_SIZES
  assert exp.get_config("interaction=dot").model.interaction == "dot"
  for d in (0, 1, 23):
    (tmp_path / f"day_{d}").write_text("")
  real = exp.get_config(f"path={tmp_path},distribution=pareto")
  assert real.data.path.split(",") == [str(tmp_path / f"day_{d}") for d in (0, 1, 23)]
  assert real.data.split == "last_file" and real.embeddings.dim == 128
  assert tuple(real.model.top) == (1024, 1024, 512, 256, 1) and real.model.low_rank == 512
  with pytest.raises(ValueError, match="options: path, interaction, distribution"):
    exp.get_config("interactoin=dot")
  with pytest.raises(ValueError, match="available: dcn, dot"):
    exp.get_config("interaction=dcnv2")
