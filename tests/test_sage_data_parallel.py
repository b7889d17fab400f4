"""Data-parallel GraphSAGE (recgnn/tasks/node_data_parallel.py): every device samples and
trains its own mini-batches; the step takes seed ids only; the bytes between devices are the
dense-gradient all-reduce, flat in the graph's nodes; 8 devices train Cora as well as 1."""

import functools
import json
import shutil

import jax
import numpy as np
import pytest

from experiments import sage_cora
from recgnn import comms, planner, sharding
from recgnn.embeddings import OptimizerSpec, TableSpec
from recgnn.tasks import node_classification as nc
from recgnn.tasks import node_data_parallel as dp
from recgnn.train import loop, setup
from tests.test_graphsage import small_config
from tests.trainer_lib import state_leaves


def synthetic_config(inputs: str, num_nodes: int = 3000):
  c = small_config(inputs, 0)
  c.data.synthetic.num_nodes = num_nodes
  c.data.synthetic.num_edges = 10 * num_nodes
  # The worst case: frontier sizes that do not depend on the graph (below its nodes).
  c.sampler.capacities = "worst"
  return c


def data_parallel(config, devices: int, k: int, seed: int = 0) -> dp.DataParallelSage:
  return dp.DataParallelSage.from_config(config, devices, k=k, seed=seed)


@pytest.mark.parametrize("inputs", ["features", "embeddings"])
def test_step_arguments_are_seed_ids_only(inputs):
  """The jitted step's arguments: the state and the graph (device-resident, placed once), and
  per call one int32[n, k, b] array of seed ids; its outputs: the state and scalars. Nothing
  crosses the host link inside it."""
  run = data_parallel(synthetic_config(inputs), 8, k=2)
  lowered = run.lowered()
  state_info, graph_info, seeds_info = lowered.args_info[0]
  assert seeds_info.shape == (8, 2, 16) and seeds_info.dtype == np.int32
  shapes = lambda tree: [x.shape for x in jax.tree.leaves(tree)]  # noqa: E731
  assert shapes(state_info) == shapes(run.state)
  assert shapes(graph_info) == shapes(run.graph)
  n = run.task.graph.num_nodes
  # The graph arrays are whole-graph sized (CSR, features, labels), not sample sized.
  assert {s[0] for s in shapes(graph_info)} <= {n, n + 1, run.task.graph.adj.nnz}
  new_state, metrics = lowered.out_info
  assert all(x.shape == (2,) for x in jax.tree.leaves(metrics))  # per step of the call
  assert comms.host_link_of(lowered).bytes == 0
  graph = jax.tree.leaves(run.graph)
  before = int(run.state.step)
  out = run.train(4)
  assert int(run.state.step) == before + 4 and out["sampled_edges"] > 0
  assert all(a is b for a, b in zip(graph, jax.tree.leaves(run.graph)))  # never put again


def test_loss_is_the_global_batch_mean():
  """The shard_map loss on 8 devices = the weighted mean of the devices' task losses over
  their own mini-batches, and its params gradient = that of the mean (the all-reduce)."""
  run = data_parallel(synthetic_config("features"), 8, k=1)
  key = jax.random.key(3)
  seeds = jax.device_put(run.seeds(0), run.seeds_sharding)
  batches, _ = jax.jit(run._sample)(run.graph, seeds, jax.random.split(key, 1))
  batch = jax.tree.map(lambda x: np.asarray(x[0]), batches)
  batch.pop("ids")
  params = run.state.params
  loss_fn = dp.DataParallelLoss(run.task, run.mesh).loss
  # (both sides jitted: op by op, the two took ~300 programs of their own to compile)
  got_fn = jax.value_and_grad(lambda p: loss_fn(p, batch, {}, key), has_aux=True)
  (got, aux), g_got = jax.jit(got_fn)(params)

  def reference(p):
    sums, weights = [], []
    for d in range(8):
      part = jax.tree.map(lambda x, d=d: np.split(x, 8)[d], batch)
      loss, _ = run.task.loss(p, part, {}, jax.random.fold_in(key, d))
      w = part["weight"].sum()
      sums.append(loss * max(w, 1.0))
      weights.append(w)
    return sum(sums) / max(sum(weights), 1.0)

  want, g_want = jax.jit(jax.value_and_grad(reference))(params)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(g_got), jax.tree.leaves(g_want)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  assert 0.0 <= float(aux["accuracy"]) <= 1.0


@pytest.mark.parametrize("inputs", ["features", "embeddings"])
def test_bytes_between_devices_flat_in_nodes(inputs):
  """From the compiled step: with features, only the all-reduce of the dense gradients (and
  of the loss / metric sums, a few scalars); with a learnable table, plus its update's
  gather of the sampled rows' (ids, gradients). The same bytes for 10x the nodes."""
  small, big = (data_parallel(synthetic_config(inputs, n), 8, k=1) for n in (3000, 30_000))
  a, b = small.step_bytes(), big.step_bytes()
  assert a == b, (a, b)
  param_bytes = sum(x.size * 4 for x in jax.tree.leaves(small.state.params))
  reduce = a["by_op"]["all-reduce"]["operand_bytes"]
  assert param_bytes <= reduce <= param_bytes + 64  # the gradients and a few scalar sums
  if inputs == "features":
    assert set(a["by_op"]) == {"all-reduce"}
  else:  # (ids, d loss / d rows) of every device's sampled nodes: O(sampled nodes)
    rows = small.sampler.sizes[-1]
    assert a["total_operand_bytes"] - reduce <= rows * 8 * (1 + 16) * 4


def cora_accuracy(devices: int, seed: int) -> float:
  c = sage_cora.get_config()
  c.seed = seed
  run = data_parallel(c, devices, k=8, seed=seed)
  run.train(c.train.steps)
  return run.evaluate("test")["accuracy"]


@pytest.mark.long  # (pytest -m long: ~5 CPU minutes, too long for CI's 30 on 2 cores)
@pytest.mark.timeout(2400)  # 10 runs of 200 steps: ~5 CPU minutes, far longer under load
def test_cora_8_devices_match_1_device():
  """8 simulated devices, data-parallel (each samples and trains 18 of the 140 seeds per
  step), reach 1 device's Cora test accuracy within 0.01 (mean of 5 seeds, 200 steps).
  Runs whose frontier capacities (auto, per seed) agree compile once (the module's
  compilation cache)."""
  seeds = range(5)
  one = [cora_accuracy(1, s) for s in seeds]
  eight = [cora_accuracy(8, s) for s in seeds]
  print(f"Cora test accuracy, 1 device: {one}; 8 devices: {eight}")  # (pytest -s)
  one, eight = np.mean(one), np.mean(eight)
  assert abs(eight - one) <= 0.01, (one, eight)
  assert one > 0.75


@pytest.mark.parametrize("text", ["dense", "dense(shard=rows)", "offload(cache_rows=1024)", "tt"])
def test_backends_that_prepare_on_the_host_are_refused(text):
  """Node ids exist only on the device: a backend whose prepare plans on the host (a cache,
  prefix trees) cannot serve them and is refused, naming it."""
  opt = OptimizerSpec(name="rowwise_adagrad", learning_rate=0.1)
  spec = TableSpec(name="node", num_rows=4096, dim=8, optimizer=opt)
  plan = planner.resolve_plan([(".*", text)], [spec], sharding.make_mesh(1, 1), log=False)
  if text.startswith("dense"):
    dp.check_plan(plan)
  else:
    with pytest.raises(ValueError, match="prepares ids on the host"):
      dp.check_plan(plan)


def trainer_config(inputs: str, steps: int):
  c = synthetic_config(inputs)
  c.sampler.data_parallel = True
  c.train.steps = steps
  c.train.log_every = 2
  c.train.final_eval_splits = ("test",)
  return c


@pytest.fixture(scope="module")
def one_step_runs(tmp_path_factory):
  """The one-step-per-call data-parallel trainer run the two trainer tests below compare
  with (each copies the checkpoint it resumes): 8 steps whole, and stopped after 4."""
  tmp = tmp_path_factory.mktemp("one_step_runs")
  c = trainer_config("embeddings", 8)
  c.train.log_every = 4
  full = loop.train(c, str(tmp / "full"))
  assert loop.train(c, str(tmp / "part"), stop_after=4).metrics["step"] == 4
  return c, full, tmp / "full", tmp / "part"


def _resume(config, checkpointed, workdir):
  """`loop.train(config, resume=True)` in a copy of the stopped run's workdir."""
  shutil.copytree(checkpointed, workdir)
  return loop.train(config, str(workdir), resume=True)


def test_trainer_trains_data_parallel_and_resumes_bit_identically(tmp_path, one_step_runs):
  """sampler.data_parallel=true through the ordinary trainer (`loop.train`) on 8 devices:
  the same state as `DataParallelSage` one step per call (one mechanism), its step's
  arguments the state, the batch's seed ids and the graph placed once (nothing else crosses
  the host link), and a run stopped after 4 steps and resumed from its checkpoint ends
  bit-identical to the uninterrupted one (sampling keys from the saved key and step)."""
  c, full, full_dir, part = one_step_runs
  assert full.metrics["step"] == 8 and 0.0 <= full.metrics["test/accuracy"] <= 1.0
  with open(full_dir / "results.json") as f:
    assert json.load(f)["step"] == 8
  with open(full_dir / "metrics.jsonl") as f:
    logged = [json.loads(line) for line in f]
  assert [r["step"] for r in logged if "loss" in r] == [4, 8]
  assert all(r["sampled_edges"] > 0 for r in logged if "loss" in r)

  reference = data_parallel(c, 8, k=1, seed=c.seed)
  reference.train(8)
  assert _equal(state_leaves(full.state), state_leaves(reference.state))

  resumed = _resume(c, part, tmp_path / "part")
  assert resumed.metrics["step"] == 8
  assert _equal(state_leaves(full.state), state_leaves(resumed.state))
  assert resumed.metrics["test/accuracy"] == full.metrics["test/accuracy"]


def _equal(a, b) -> bool:
  return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


def _logged(workdir) -> list[dict]:
  with open(workdir / "metrics.jsonl") as f:
    rows = [json.loads(line) for line in f]
  # (The timing, and the program's bytes: a scan's body is read once from the HLO, so a
  # 4-step call's collectives read as one step's plus its own few scalars.)
  skip = lambda k: k == "samples_per_second" or k.startswith("link/")  # noqa: E731
  return [{k: v for k, v in r.items() if not skip(k)} for r in rows if "loss" in r]


def test_trainer_k_steps_per_call_are_k_calls_of_one_step(tmp_path, one_step_runs):
  """sampler.steps_per_call=4: each train batch holds 4 steps' seeds, one call samples the 4
  steps' mini-batches of every device in bulk and scans 4 optimizer steps. Step s's batches
  are drawn with step s's key whichever call samples them, so the run ends bit-identical to
  the one-step-per-call run, and logs the same per-step means at the same steps. A 4-step run
  stopped after one call and resumed ends bit-identical too, and so does a one-step run's
  checkpoint resumed 4 steps per call (the step counts line up)."""
  one, a, one_dir, one_part = one_step_runs
  four = trainer_config("embeddings", 8)
  four.train.log_every = 4
  four.sampler.steps_per_call = 4
  b = loop.train(four, str(tmp_path / "four"))
  assert a.metrics["step"] == b.metrics["step"] == 8 and int(b.state.step) == 8
  assert _equal(state_leaves(a.state), state_leaves(b.state))
  assert _logged(one_dir) == _logged(tmp_path / "four")
  assert [r["step"] for r in _logged(tmp_path / "four")] == [4, 8]
  assert b.metrics["test/accuracy"] == a.metrics["test/accuracy"]

  wd = str(tmp_path / "part")
  assert loop.train(four, wd, stop_after=4).metrics["step"] == 4
  resumed = loop.train(four, wd, resume=True)
  assert resumed.metrics["step"] == 8
  assert _equal(state_leaves(b.state), state_leaves(resumed.state))

  resumed = _resume(four, one_part, tmp_path / "from_one")  # a one-step run's checkpoint
  assert resumed.metrics["step"] == 8
  assert _equal(state_leaves(b.state), state_leaves(resumed.state))


def test_trainer_refuses_steps_off_the_call_boundaries(tmp_path):
  """With 4 steps per call the loop acts only between calls: a log / checkpoint / eval /
  stop step, a total or a resumed step that is not a multiple of 4 is refused at setup,
  naming the values; k > 1 without data_parallel (host-sampled batches) is refused too."""
  c = trainer_config("features", 8)
  c.sampler.steps_per_call = 4
  c.train.log_every = 2
  c.train.checkpoint_every = 6
  with pytest.raises(ValueError, match=r"train.log_every=2, train.checkpoint_every=6 must"):
    loop.train(c, str(tmp_path / "a"))
  c.train.log_every, c.train.checkpoint_every = 4, 0
  with pytest.raises(ValueError, match=r"stop_after=3 must be multiple\(s\) of 4"):
    loop.train(c, str(tmp_path / "b"), stop_after=3)
  wd = str(tmp_path / "c")
  one = trainer_config("features", 8)
  loop.train(one, wd, stop_after=2)  # a one-step run's checkpoint at step 2
  with pytest.raises(ValueError, match=r"resumed step=2 must be"):
    loop.train(c, wd, resume=True)
  c = trainer_config("features", 8)
  c.sampler.data_parallel = False
  c.sampler.steps_per_call = 2
  with pytest.raises(ValueError, match="steps_per_call=2.*data_parallel=true"):
    setup.build(c)


@pytest.mark.parametrize("graph,k", [("replicated", 1), ("split", 1), ("split", 4)])
def test_trainer_step_arguments_are_seeds_and_the_placed_graph(graph, k):
  """The trainer's jitted data-parallel step (`setup.build`): its per-call arguments are the
  packed batch (seed ids and their weights: 2 x 4 bytes per seed, of k steps with k steps
  per call) besides the state and the graph, which the run placed once (`Run.step_inputs`:
  replicated, or its rows split over the 8 devices); 0 bytes over the host link. One call
  runs k steps and returns each step's metrics."""
  c = trainer_config("features", 2)
  if graph == "split":
    c = split_config("features")
    c.sampler.data_parallel = True
    c.train.steps = 2
  c.sampler.steps_per_call = k
  run = setup.build(c)
  indptr = run.step_inputs["sampler"][0]
  n = run.task.graph.num_nodes
  if graph == "split":  # device d holds rows [d R, (d + 1) R) of the CSR
    assert indptr.sharding.spec == sharding.BATCH_SPEC and indptr.shape == (8, -(-n // 8) + 1)
  else:
    assert indptr.sharding.is_fully_replicated and indptr.shape == (n + 1,)
  batch = next(run.task.train_batches(0))
  assert set(batch) == {"ids", "seeds", "weight"} and batch["ids"] == {}
  assert batch["seeds"].shape == (8 * k * run.task.device_samples.per_device,)
  buffers, layout = run.packed(run.prepare(batch), batch)
  assert sum(b.nbytes for b in jax.tree.leaves(buffers)) == 2 * 4 * batch["seeds"].size
  lowered = run.train_step.lower(run.state, buffers, layout)
  assert comms.host_link_of(lowered).bytes == 0
  placed = jax.tree.leaves(run.step_inputs)
  assert {x.shape for x in placed} >= {(run.task.graph.num_nodes, 16)}  # the features
  state, metrics = run.train_step(run.state, buffers, layout)
  assert int(state.step) == k and metrics["loss"].shape == (k,)
  assert np.all(np.asarray(metrics["sampled_edges"]) > 0)


def test_trainer_refuses_what_data_parallel_cannot_honour():
  """A node table on a backend that prepares ids on the host, or a graph split over some of
  the mesh's devices, is an error at setup naming the fix."""
  c = trainer_config("embeddings", 2)
  c.embeddings.plan = ((".*", "offload(cache_rows=512)"),)
  with pytest.raises(ValueError, match="prepares ids on the host"):
    setup.build(c)
  c = trainer_config("features", 2)
  c.sampler.split_devices = 4  # not every device of the 8
  c.sampler.where = "device"
  with pytest.raises(ValueError, match="split_devices"):
    setup.build(c)


def split_config(inputs: str, num_nodes: int = 3000, exchange: str = "reduce_scatter"):
  c = synthetic_config(inputs, num_nodes)
  c.sampler.where = "device"
  c.sampler.split_devices = 8
  c.sampler.split_exchange = exchange
  # The eval sampler splits the graph too (the task's eval batches, host-side): keep it
  # small, it only gives the example batch here.
  c.sampler.eval_capacities = "worst"
  c.sampler.eval_fanouts = (2, 2)
  c.sampler.eval_batch_size = 64
  return c


@pytest.mark.parametrize("exchange", ["reduce_scatter", "all_to_all"])
def test_split_graph_gives_the_replicated_sample(exchange):
  """The graph's rows split over the 8 devices (each hop's reads exchanged): every device's
  mini-batches are exactly those it samples from its own replica (same seeds, same keys),
  and each step's are the one-device sampler's for all devices' seeds of that step with
  that step's key."""
  mesh = sharding.make_mesh(8, 1)
  c = split_config("features", exchange=exchange)
  replicated = dp.DeviceSamples(nc.NodeClassification(synthetic_config("features"), mesh), mesh)
  split = dp.DeviceSamples(nc.NodeClassification(c, mesh), mesh)
  assert split.split and not replicated.split
  assert split.sampler.sizes == replicated.sampler.sizes
  k, b = 2, replicated.per_device
  rng = np.random.default_rng(0)
  seeds = rng.choice(replicated.task.train_nodes, 8 * k * b, replace=False).astype(np.int32)
  seeds = seeds.reshape(8, k, b)
  seeds[3, 1, 5:] = -1  # padding
  put = functools.partial(jax.device_put, device=sharding.named(mesh, sharding.BATCH_SPEC))
  keys = jax.random.split(jax.random.key(7), k)  # one per step
  outs = []
  for s in (replicated, split):
    graph = setup.place_inputs(s.graph_arrays(), mesh)
    outs.append(jax.device_get(jax.jit(s.sample)(graph, put(seeds), keys)))
  (a, sa), (b_, sb) = outs
  assert jax.tree.structure(a) == jax.tree.structure(b_)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b_)):
    np.testing.assert_array_equal(x, y)
  np.testing.assert_array_equal(sa["sampled_edges"], sb["sampled_edges"])
  assert sa["sampled_edges"].shape == (k,) and np.all(sa["sampled_edges"] > 0)
  assert sa["dropped"] == sb["dropped"] == 0
  # One device, step i's batches of every device in one call with step i's key: device d's
  # is batch d.
  frontier = np.asarray(a["frontier"])  # [k, 8 * n_L]
  for i in range(k):
    nodes, *_ = replicated.sampler.sample_device(seeds[:, i], keys[i])
    np.testing.assert_array_equal(frontier[i], np.asarray(nodes).reshape(-1))


def test_split_graph_bytes_are_the_hops_exchange_flat_in_nodes():
  """From the compiled step with the split graph: the dense gradients' all-reduce (as
  replicated) plus exactly each hop's exchange (the sampler's own hops compiled alone: an
  all_gather of the frontier, a reduce_scatter of the neighbours), the same at 10x the
  nodes."""
  small, big = (data_parallel(split_config("features", n), 8, k=1) for n in (3000, 30_000))
  a, b = small.step_bytes(), big.step_bytes()
  assert a == b, (a, b)
  hops = small.sampler.hop_bytes(8)  # 8 batches: one per device
  assert len(hops) == 2 and all(h["total_operand_bytes"] > 0 for h in hops)
  for op in ("all-gather", "reduce-scatter"):
    assert a["by_op"][op]["operand_bytes"] == sum(h["by_op"][op]["operand_bytes"] for h in hops)
  param_bytes = sum(x.size * 4 for x in jax.tree.leaves(small.state.params))
  assert set(a["by_op"]) == {"all-reduce", "all-gather", "reduce-scatter"}
  assert param_bytes <= a["by_op"]["all-reduce"]["operand_bytes"] <= param_bytes + 64
