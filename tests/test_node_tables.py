"""Node classification's node table through every embedding backend, on 1 device and on a
mesh: the sampled frontier's ids are the batch-major part of a batch (each device fetches its
share through the backend), the subgraph is replicated.

Driven exactly as the trainer drives a step (the trainer's `setup.build`; `Run.feed`:
`inputs.prepare_stream` + run-ahead, the packed per-device transfer; the jitted step with
donated state), on the same task batches for every backend and mesh, against `dense` (the
contract's EXACT / ROUNDING split: offload and hot_cold bit for bit on the same mesh,
row-sharded to float summation order).
"""

import jax
import ml_collections
import numpy as np
import pytest

from experiments import sage_synthetic
from recgnn import sharding
from recgnn.embeddings import base
from recgnn.tasks import node_classification as nc
from recgnn.train import setup
from recgnn.train import train_state as state_lib
from tests.trainer_lib import make_task

OFFLOAD = "offload(cache_rows=700, policy=lru, lookahead=2)"  # < the 1,200 rows: evicts
HOT_COLD = "hot_cold(budget=0.1, profile_batches=2, reprofile=3)"
TT = "tt(rank=4, cores=2)"
STEPS = 9  # three distinct batches, three times: the loss must fall
TOL = dict(rtol=2e-5, atol=2e-6)  # float summation order (gradient all-reduce, row shards)


def _config(kind: str = "node") -> ml_collections.ConfigDict:
  c = sage_synthetic.get_config()
  c.data.synthetic.num_nodes = 1200
  c.data.synthetic.num_edges = 9000
  c.data.synthetic.num_classes = 4
  c.data.synthetic.split = (0.3, 0.1, 0.3)
  c.model.hidden = 16
  c.sampler.kind = kind
  c.sampler.fanouts = c.sampler.eval_fanouts = (4, 3)
  c.sampler.layer_sizes = (96, 96)
  c.sampler.batch_size = 48
  c.sampler.eval_batch_size = 96
  c.sampler.bulk = 3
  c.embeddings.dim = 8
  # The node ids split 8 ways for every backend (the frontier padded to a multiple of 8):
  # batches shared by the 1 x 1, 1 x 8 and 8 x 1 runs below.
  c.mesh = ml_collections.ConfigDict({"data": 0, "model": 8})
  c.embeddings.split_ids = "true"
  return c


@pytest.fixture(scope="module")
def task():
  return make_task(nc.TASK, _config())


@pytest.fixture(scope="module")
def sgd_task():
  c = _config()
  c.embeddings.optimizer = ml_collections.ConfigDict({"name": "sgd", "learning_rate": 0.1})
  return make_task(nc.TASK, c)


@pytest.fixture(scope="module")
def batches(task):
  it = task.train_batches(0)
  distinct = [next(it) for _ in range(3)]
  evals = list(task.eval_batches("test"))[:1]
  return [distinct[i % 3] for i in range(STEPS)], evals


def run(task, batches, plan_text: str, mesh_shape):
  """Losses per step, final node table (logical rows), dense params and eval logits."""
  train, evals = batches
  config = task.config.copy_and_resolve_references()
  config.embeddings.plan = [(".*", plan_text)]
  mesh = sharding.make_mesh(*mesh_shape)
  r = setup.build(config, mesh=mesh, task=task, example=train[0], key=jax.random.key(0))
  state = r.state
  stream = [("train", None, b) for b in train] + [("eval", "test", b) for b in evals]
  losses, logits = [], []
  for item, on_device in r.feed(stream, depth=base.PREFETCH):
    if item.kind == "train":
      state, m = r.train_step(state, *on_device)
      losses.append(float(m["loss"]))
    else:
      logits.append(np.asarray(r.eval_step(state, *on_device)["logits"]))
  key = r.plan.table_group[nc.TABLE]
  table = np.asarray(r.plan.groups[key].tables(r.sync(state).emb[key])[nc.TABLE])
  return {
    "loss": np.asarray(losses),
    "table": table,
    "params": jax.device_get(state.params),
    "logits": np.concatenate(logits),
  }


def assert_same(got, ref, what, **tol):
  for k in ("loss", "table", "logits"):
    np.testing.assert_allclose(got[k], ref[k], err_msg=f"{what}: {k}", **tol)
  for a, b in zip(jax.tree.leaves(got["params"]), jax.tree.leaves(ref["params"])):
    np.testing.assert_allclose(a, b, err_msg=f"{what}: params", **tol)


def test_batches_split_the_node_ids_and_replicate_the_subgraph(task, batches):
  b = batches[0][0]
  ids = b["ids"][nc.TABLE]
  n = b["frontier"].shape[0]
  assert ids.shape == (-(-n // 8) * 8, 1) and np.all(ids[n:] == -1)
  np.testing.assert_array_equal(ids[:n, 0], b["frontier"])
  assert task.shard_batch
  # By default only a plan that needs them split (sharded) splits them.
  c = _config()
  c.embeddings.split_ids = "auto"
  assert not make_task(nc.TASK, c).shard_batch
  c.embeddings.plan = ((".*", "sharded(kind=row)"),)
  assert make_task(nc.TASK, c).shard_batch
  specs = task.batch_spec(state_lib.device_batch(b))
  assert all(
    s == sharding.REPLICATED
    for s in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, sharding.P))
  )


@pytest.fixture(scope="module")
def sgd_mesh_dense(sgd_task, batches):
  return run(sgd_task, batches, "dense", (1, 8))


def test_offload_and_sharded_on_a_mesh(sgd_task, batches, sgd_mesh_dense):
  """1 x 8, the node ids split 8 ways: offload = dense on the same mesh bit for bit, sharded
  (row-wise over the 8 devices) to float summation order; SGD (row-wise Adagrad and the
  1-device references: the slow test below)."""
  assert_same(run(sgd_task, batches, OFFLOAD, (1, 8)), sgd_mesh_dense, "offload 1x8")
  row = run(sgd_task, batches, "sharded(kind=row)", (1, 8))
  assert_same(row, sgd_mesh_dense, "sharded 1x8", **TOL)


@pytest.mark.slow
def test_hot_cold_on_a_mesh(sgd_task, batches, sgd_mesh_dense):
  """hot_cold (popular rows split over the 8 devices, the rest on the host) = dense bit for
  bit on 1 x 8 (the test alone takes as long as the rest of the module)."""
  assert_same(run(sgd_task, batches, HOT_COLD, (1, 8)), sgd_mesh_dense, "hot_cold 1x8")


@pytest.mark.long  # (the suite's 10 minutes: the meshes above keep offload, sharded, hot_cold)
def test_every_backend_with_rowwise_adagrad(task, batches):
  """sage_synthetic's row-wise Adagrad, 1 x 1 and meshes: offload = dense bit for bit;
  hot_cold to 1 ulp (inside the fused train step XLA rounds its row update differently from
  dense's on some rows; with SGD, and in the contract test's separately jitted update, it is
  exact); table-wise sharded on 8 x 1 exact; TT on 2 x 4 = TT on 1 x 1 to float order; and
  the loss falls over the 9 steps for dense, row-sharded and TT."""
  ref = run(task, batches, "dense", (1, 1))
  assert_same(run(task, batches, OFFLOAD, (1, 1)), ref, "offload 1x1")
  assert_same(run(task, batches, HOT_COLD, (1, 1)), ref, "hot_cold 1x1", rtol=0, atol=3e-7)
  mesh_dense = run(task, batches, "dense", (8, 1))
  assert_same(mesh_dense, ref, "dense 8x1", **TOL)
  assert_same(run(task, batches, OFFLOAD, (8, 1)), mesh_dense, "offload 8x1")
  assert_same(run(task, batches, "sharded(kind=table)", (8, 1)), mesh_dense, "table 8x1")
  row = run(task, batches, "sharded(kind=row)", (2, 4))
  assert_same(row, ref, "sharded(kind=row) 2x4", **TOL)
  tt_one = run(task, batches, TT, (1, 1))
  assert_same(run(task, batches, TT, (2, 4)), tt_one, "tt 2x4", **TOL)
  for r in (ref, row, tt_one):
    assert r["loss"][-3:].mean() < r["loss"][:3].mean() - 0.02, r["loss"]
