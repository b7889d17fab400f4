"""Data-parallel GraphSAGE on the mesh: every device samples and trains its own mini-batches.

Node classification in the trainer by default samples a mini-batch, packs it on the host and
gives every device the whole subgraph: the mesh adds no training throughput. Here, with n
devices (every device of the mesh: the batch axis `sharding.BATCH`), every device samples
and trains its own mini-batches. One jitted call takes only seed ids, int32[n, k, b] (device
d's seeds of the next k steps, b = ceil(B / n) of the global batch B each, -1 = padding),
besides the state and the graph (placed once), and runs:

  sample   (`DeviceSamples.sample_nodes`) device d samples its k mini-batches in one bulk
           call of the device sampler, over its replica of the graph (no communication) or
           over the graph's rows split over the devices (each hop's reads exchanged): their
           node ids, [k, n * X] arrays split over the devices on axis 1, which never leave them
  k steps  (lax.scan, the trainer's own step, `recgnn.train.step.make_train_step`) per step:
           its batch built on each device from its sampled ids (`DeviceSamples.build`,
           `node_batch.make_batch`: features gathered there, one step's at a time,
           so a call holds one step's frontier features per device, not k steps'),
           the rows of each device's sampled nodes through the embedding plan
           (`device_prepared`: the ids stay batch-split, so a replicated `dense` table is
           read where it is), the loss as one shard_map (`DataParallelLoss`: each device the
           task's loss over its own mini-batch, psum'd into the weighted mean over the global
           batch), so the dense gradients are all-reduced by the psum's transpose and the
           table's update gets each device's d loss / d rows

The trainer runs it with sampler.data_parallel=true (`DeviceSamples.trainer_step`, through
`Task.train_step` / `Task.step_inputs`), k = sampler.steps_per_call steps per call (default
1; the loop counts k steps per call); `DataParallelSage` runs it outside the trainer. Step
s's mini-batches are drawn with step s's key whichever call samples them, so k steps per
call train bit-identically to k calls of one step (tested).

Bytes between devices per step (read from the compiled step: `step_bytes`): the dense
gradient all-reduce, the loss / metric sums, with a learnable replicated table its update's
gather of (ids, d loss / d rows), O(sampled nodes), and with the split graph each hop's
exchange, O(k b n_l f_l); none grows with the graph.

Limits: node tables whose backend plans on the host (`Capabilities.plans_globally`: tt,
offload, hot_cold) or routes ids (sharded) need ids before the step and are refused: the
ids here exist only on the device (`device_prepared`). The split graph is node-wise only and
splits over every device of the mesh; features and labels stay replicated. Eval runs the
task's eval batches (host-sampled, deterministic with eval fanouts -1), replicated.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from recgnn import comms, planner, sharding
from recgnn.embeddings import base as emb_base
from recgnn.embeddings.group import TableGroup
from recgnn.tasks import node_batch
from recgnn.train import setup
from recgnn.train import step as step_lib
from recgnn.train import train_state as state_lib
from recgnn.train.task import Task

P = sharding.P
BATCH = sharding.BATCH
# fold_in tag of the sampling keys (the step's dropout keys are fold_in(key, step)).
SAMPLING = 0x5A4D


def device_prepared(plan: planner.Plan, ids: dict[str, jax.Array]) -> dict:
  """Inside jit: the prepared arrays of the default `TableBackend.prepare` from device ids
  ({table: int32[R, L]}, -1 = padding, batch-split): the id map to the backend's padding
  row, and `count` for mean pooling. The row-wise Adagrad dedup the host prepare would add
  is done by the update on the device (`kernels.sparse_sgd_or_adagrad`)."""
  out = {}
  for key, group in plan.groups.items():
    out[key] = {}
    for name, member in group.members.items():
      x = ids[name]
      p = {"rows": {"ids": jnp.where(x < 0, member.pad_id, x).astype(jnp.int32)}}
      if member.spec.pooling == "mean":
        p["count"] = jnp.sum(x >= 0, axis=1, dtype=jnp.int32)
      out[key][name] = p
  return out


def check_plan(plan: planner.Plan) -> None:
  """Refuse groups whose ids must be prepared on the host (see the module docstring)."""
  for key, group in plan.groups.items():
    ok = isinstance(group, TableGroup) and not (
      group.capabilities.plans_globally or group.capabilities.needs_split_ids
    )
    ok = ok and all(m.prepares_by_default() for m in group.members.values())
    if not ok:
      raise ValueError(
        f"data-parallel GraphSAGE samples node ids on the device; backend {key!r} prepares "
        "ids on the host (a cache plan, prefix trees or routing). Use a dense node table "
        "(('node', 'dense') or 'dense(shard=rows)') or the trainer's replicated subgraphs."
      )


class DataParallelLoss:
  """The task's loss as one shard_map over the mesh: `loss(params, batch, embeddings, key)`
  (the `Task.loss` signature, so `make_train_step` runs it) with every batch leaf and
  embedding batch-split (device d holds its own mini-batch: [X, ...] of [n * X, ...]).

  Device d computes the task's weighted mean over its seeds (dropout key fold_in(key, d));
  the devices' sums are psum'd into the weighted mean over the global batch, whose
  gradient w.r.t. the replicated params is the all-reduce of the devices' gradients."""

  def __init__(self, task: Task, mesh: jax.sharding.Mesh):
    self.task, self.mesh = task, mesh

  def loss(self, params, batch, embeddings, key):
    @functools.partial(
      jax.shard_map,
      mesh=self.mesh,
      in_specs=(P(), P(BATCH), P(BATCH), P()),
      out_specs=P(),
    )
    def local(params, batch, embeddings, key):
      key = jax.random.fold_in(key, jax.lax.axis_index(BATCH))
      loss, aux = self.task.loss(params, batch, embeddings, key)
      # The task's loss is sum(ce * w) / max(W, 1): times max(W, 1) it is the sum again.
      w = jnp.sum(batch["weight"])
      scale = jnp.maximum(w, 1.0)
      total_w = jnp.maximum(jax.lax.psum(w, BATCH), 1.0)
      mean = jax.lax.psum(loss * scale, BATCH) / total_w
      return mean, {k: jax.lax.psum(v * scale, BATCH) / total_w for k, v in aux.items()}

    return local(params, batch, embeddings, key)


class DeviceSamples:
  """Every device's mini-batches, sampled and built on the device: the one mechanism of
  `DataParallelSage` and of the trainer's data-parallel node classification
  (`NodeClassification.train_step`), k steps per call.

  n = mesh.size devices, b = ceil(B / n) seeds each of the task's global batch B; the
  sampler is the task's law on the device (`where="device"`) for b seeds, over

    the graph replicated (sampler.split_devices = 0): each device samples from its own copy,
      no communication;
    the graph split (sampler.split_devices = n, node-wise): the adjacency's rows split over
      the n devices (`split_sampling.SplitNeighborSampler` on this mesh, 1 / n of the edges
      each), every hop's neighbour reads exchanged between the devices (sampler.
      split_exchange: reduce_scatter or all_to_all), each device keeping its own batches.

  Device d's batch of step s draws with fold_in(step s's key, d) (`device_sampling.
  batch_keys`): in both, step s's batches are exactly the sample one device draws for every
  device's seeds of step s with step s's key (tested), however many steps one call samples."""

  def __init__(self, task: Task, mesh: jax.sharding.Mesh):
    self.task, self.mesh = task, mesh
    self.devices = mesh.size
    self.per_device = -(-task.batch_size // self.devices)
    s = task.config.sampler
    split = int(s.get("split_devices", 0) or 0)
    if split > 1 and (split != self.devices or s.kind != "node"):
      raise ValueError(
        f"data-parallel GraphSAGE splits the graph over every device of the mesh, node-wise: "
        f"sampler.split_devices={split} with sampler.kind={s.kind!r} on {self.devices} devices; "
        f"set sampler.split_devices={self.devices} (sampler.kind=node) or 0 (replicated)"
      )
    self.split = split > 1
    self.sampler = task.make_sampler(
      s.get("fanouts", None),
      self.per_device,
      s.capacities,
      task.train_nodes,
      "capacities",
      where="device",
      split_mesh=mesh if self.split else None,
    )

  def graph_arrays(self) -> dict:
    """What the devices hold of the graph: the sampler's arrays (CSR: numpy, replicated; or
    split, device arrays placed by the sampler), the node features (float32[N, F], without
    features: none) and labels int32[N] (both replicated)."""
    g = self.task.graph
    arrays = self.sampler.arrays
    if not self.split:
      arrays = tuple(np.asarray(a) for a in arrays)
    out = {"sampler": tuple(arrays), "labels": np.asarray(g.labels, np.int32)}
    if self.task.inputs != "embeddings":
      out["features"] = np.asarray(g.features, np.float32)
    return out

  def seeds(self, step: int, k: int) -> np.ndarray:
    """int32[n, k, b]: device d's seeds of steps step .. step + k - 1 (each step's global
    batch, `task.train_seeds`, -1 padded to n b and split into n slices of b)."""
    n, b = self.devices, self.per_device
    out = np.full((k, n * b), -1, np.int32)
    for i in range(k):
      seeds = self.task.train_seeds(step + i)
      out[i, : seeds.size] = seeds
    return out.reshape(k, n, b).transpose(1, 0, 2)

  def sample_nodes(self, graph, seeds, keys):
    """The bulk sampling of k steps: seeds int32[n, k, b] (split over the devices on axis
    0), keys key[k] (step i's sampling key; device d's batch of step i draws with
    fold_in(keys[i], d), so a step's batches do not depend on how many steps its call
    samples) -> (sample: every device's k mini-batches' sampled ids, {"nodes": int32[k, n *
    n_L], "layers": the sampler's layer arrays [k, n * n_l, ...], "seeds": int32[k, n * b]},
    all split over the devices on axis 1; stats: {"sampled_edges": int32[k] per step,
    "dropped": int32[] neighbours dropped in the call}, over all devices)."""
    n, k, b = seeds.shape
    # keys[d, i] = fold_in(keys[i], d): the key of device d's batch of step i.
    per_device = jax.vmap(lambda d: jax.vmap(lambda key: jax.random.fold_in(key, d))(keys))(
      jnp.arange(n, dtype=jnp.int32)
    )
    if self.split:
      # [n k, b] split on axis 0: device d holds its own k batches, d k .. d k + k - 1, and
      # every batch's key (replicated: each hop draws the uniforms of the rows it serves).
      nodes, layers, edges, dropped = self.sampler.sample_arrays(
        *graph["sampler"], seeds.reshape(n * k, b), per_device.reshape(n * k)
      )

      # Device d's [k, ...] arrays as its slice of [k, n * ...] (axis 1): no data moves.
      @functools.partial(
        jax.shard_map, mesh=self.mesh, in_specs=P(BATCH), out_specs=P(None, BATCH), check_vma=False
      )
      def steps_major(nodes, layers, seeds):
        return {"nodes": nodes, "layers": layers, "seeds": seeds[0]}

      sample = steps_major(nodes, layers, seeds)
      edges = jnp.sum(edges.reshape(n, k, -1), axis=(0, 2), dtype=jnp.int32)
      return sample, {"sampled_edges": edges, "dropped": dropped.astype(jnp.int32)}

    @functools.partial(
      jax.shard_map,
      mesh=self.mesh,
      in_specs=(P(), P(BATCH), P(BATCH)),
      out_specs=(P(None, BATCH), P(BATCH), P(BATCH)),
      # The sampler's loops mix per-device and replicated values; nothing here is
      # differentiated or reduced across devices.
      check_vma=False,
    )
    def local(arrays, seeds, keys):
      seeds, keys = seeds[0], keys[0]  # [k, b], key[k]
      nodes, layers, edges, dropped = self.sampler.sample_arrays(*arrays, seeds, keys)
      edges = jnp.sum(edges, axis=1, dtype=jnp.int32)[None]  # [1, k]
      sample = {"nodes": nodes, "layers": layers, "seeds": seeds}
      return sample, edges, dropped.astype(jnp.int32)[None]

    sample, edges, dropped = local(graph["sampler"], seeds, per_device)
    return sample, {"sampled_edges": jnp.sum(edges, axis=0), "dropped": jnp.sum(dropped)}

  def build(self, graph, sample):
    """Batches from sampled ids, on the device: `sample_nodes`' sample ([j, n * X] split
    over the devices on axis 1, any j) -> the model's batches (`node_batch.
    make_batch`: features and labels gathered from each device's replica), [j, n * X] split
    on axis 1."""
    rest = {name: v for name, v in graph.items() if name != "sampler"}
    make = functools.partial(node_batch.make_batch, self.task.inputs, xp=jnp)

    @functools.partial(
      jax.shard_map,
      mesh=self.mesh,
      in_specs=(P(), P(None, BATCH)),
      out_specs=P(None, BATCH),
      check_vma=False,
    )
    def local(rest, sample):
      return jax.vmap(
        lambda x, lay, s: make(x, lay, s, features=rest.get("features"), labels=rest["labels"])
      )(sample["nodes"], sample["layers"], sample["seeds"])

    return local(rest, sample)

  def sample(self, graph, seeds, keys):
    """`sample_nodes` then `build`: every device's k mini-batches, sampled and built on the
    device: (batch leaves [k, n * X] split on axis 1, stats as `sample_nodes`)."""
    sample, stats = self.sample_nodes(graph, seeds, keys)
    return self.build(graph, sample), stats

  def make_step(self, plan: planner.Plan, tx):
    """-> step(state, graph, seeds int32[n, k, b]) -> (state, metrics [k] per step): k train
    steps, the k mini-batches of every device sampled in one bulk call (`sample_nodes`; step
    s's sampling key fold_in(fold_in(state.key, SAMPLING), s), whichever call samples it: k
    steps per call train exactly as k calls of one step), then a lax.scan of the trainer's
    step, each building its own batch from the sampled ids (`build`: the features gathered
    there, not k steps' at once, which would hold k x the frontier's features per device)
    with the loss as one shard_map (`DataParallelLoss`) and the node ids prepared on the
    device. metrics: the task's loss and aux per step, sampled_edges per step, and the
    call's dropped neighbours counted at its last step (the sampler counts them per call)."""
    check_plan(plan)
    train = step_lib.make_train_step(DataParallelLoss(self.task, self.mesh), plan, tx)

    def step(state, graph, seeds):
      k = seeds.shape[1]
      base = jax.random.fold_in(state.key, SAMPLING)
      keys = jax.vmap(lambda i: jax.random.fold_in(base, state.step + i))(
        jnp.arange(k, dtype=state.step.dtype)
      )
      samples, stats = self.sample_nodes(graph, seeds, keys)

      def one(state, sample):
        one_step = jax.tree.map(lambda x: x[None], sample)
        batch = jax.tree.map(lambda x: x[0], self.build(graph, one_step))
        prepared = device_prepared(plan, batch.pop("ids"))
        state, metrics, _ = train(state, prepared, batch)  # (no host tier: `check_plan`)
        return state, metrics

      state, metrics = jax.lax.scan(one, state, samples)
      metrics["sampled_edges"] = stats["sampled_edges"]
      metrics["dropped"] = jnp.zeros(k, jnp.int32).at[-1].set(stats["dropped"])
      return state, metrics

    return step

  def trainer_step(self, plan: planner.Plan, tx):
    """The trainer's step (`Task.train_step`): (state, prepared, batch, graph) -> (state,
    metrics [k]), k = sampler.steps_per_call steps per call. batch["seeds"] int32[n * k * b]
    split over the devices: device d's slice is its seeds of the call's k steps, [k, b]
    (`seeds`, flattened); `prepared` holds nothing (the batch's node-id bags have width 0:
    the ids exist only on the device)."""
    step = self.make_step(plan, tx)
    n, b = self.devices, self.per_device

    def train(state, prepared, batch, graph):
      del prepared
      return step(state, graph, batch["seeds"].reshape(n, -1, b))

    return train


class DataParallelSage:
  """Data-parallel GraphSAGE training of a `NodeClassification` task (see the module),
  k steps per call, outside the trainer (benchmarks, tests; the trainer runs the same
  `DeviceSamples.make_step` with sampler.data_parallel=true, k = sampler.steps_per_call).

  Args:
    task: the node task (its graph, model, loss, eval batches; built on `mesh`).
    mesh: every device trains (n = mesh.size); the global batch is sampler.batch_size.
    k: steps per call: each device samples its next k mini-batches in one bulk call and the
      step consumes them in a scan (no host round trip between them).
    key: the run's key (params, tables, sampling and dropout keys).
  """

  def __init__(self, task: Task, mesh: jax.sharding.Mesh, *, k: int, key):
    self.task, self.mesh, self.k = task, mesh, int(k)
    self.samples = DeviceSamples(task, mesh)
    self.devices, self.per_device = self.samples.devices, self.samples.per_device
    self.sampler = self.samples.sampler
    cfg = task.config
    rules = planner.rules_of(cfg.embeddings.plan)
    self.plan = planner.resolve_plan(rules, task.tables(), mesh, emb_base.Layout(), log=False)
    check_plan(self.plan)
    self.tx = state_lib.make_optimizer(cfg.optimizer)
    self.state = state_lib.init_state(task, self.plan, self.tx, key, task.example_batch())
    self.state_sharding = state_lib.state_sharding(self.plan, self.state)
    repl = sharding.named(mesh, P())
    self.graph = setup.place_inputs(self.graph_arrays(), mesh)
    self.seeds_sharding = sharding.named(mesh, P(BATCH))
    graph_sharding = jax.tree.map(lambda x: x.sharding, self.graph)
    self._jitted = jax.jit(
      self.samples.make_step(self.plan, self.tx),
      donate_argnums=0,
      in_shardings=(self.state_sharding, graph_sharding, self.seeds_sharding),
      out_shardings=(self.state_sharding, repl),
    )
    # Simulated CPU devices: one multi-device call in flight (sharding.OneInFlight).
    self.step = sharding.OneInFlight(self._jitted, mesh)
    self._eval = sharding.OneInFlight(
      jax.jit(self._eval_step, in_shardings=(self.state_sharding, repl), out_shardings=repl),
      mesh,
    )

  @classmethod
  def from_config(cls, config, devices: int, *, k: int, seed: int = 0) -> DataParallelSage:
    """The node task of `config` on a devices x 1 mesh of the first `devices` devices."""
    mesh = sharding.make_mesh(devices, 1)
    task = setup.load_task(config, mesh)
    return cls(task, mesh, k=k, key=jax.random.key(seed))

  def graph_arrays(self) -> dict[str, np.ndarray]:
    """What every device holds of the graph (`DeviceSamples.graph_arrays`)."""
    return self.samples.graph_arrays()

  def seeds(self, step: int) -> np.ndarray:
    """int32[n, k, b]: device d's seeds of steps step .. step + k - 1 (`DeviceSamples.seeds`,
    as the trainer's batches hold them)."""
    return self.samples.seeds(step, self.k)

  def _sample(self, graph, seeds, keys):
    return self.samples.sample(graph, seeds, keys)

  def _eval_step(self, state, batch):
    batch = dict(batch)
    prepared = device_prepared(self.plan, batch.pop("ids"))
    return step_lib.make_eval_step(self.task, self.plan)(state, prepared, batch)

  def lowered(self, step: int = 0):
    """The step lowered for the seeds of `step` (its arguments: the state, the graph, the
    seeds)."""
    return self._jitted.lower(self.state, self.graph, self.seeds(step))

  def step_bytes(self) -> dict:
    """Bytes between devices of one call, from the compiled step's HLO (`comms.summary`)."""
    return comms.compiled_summary(self.lowered().compile())

  def train(self, steps: int, log_every: int = 0, log=print) -> dict:
    """Run `steps` train steps (rounded up to calls of k) from the state's step; -> the last
    call's metrics (host floats): sampled_edges and dropped its totals, the others the mean
    over its k steps."""
    step = int(self.state.step)
    metrics = {}
    for call in range(-(-steps // self.k)):
      seeds = jax.device_put(self.seeds(step), self.seeds_sharding)
      self.state, metrics = self.step(self.state, self.graph, seeds)
      step += self.k
      if log_every and (call + 1) % max(log_every // self.k, 1) == 0:
        log(f"step {step}: " + ", ".join(f"{k} {np.mean(v):.4g}" for k, v in metrics.items()))
    totals = ("sampled_edges", "dropped")
    return {
      k: float(np.sum(v) if k in totals else np.mean(v)) for k, v in jax.device_get(metrics).items()
    }

  def evaluate(self, split: str) -> dict[str, float]:
    """The task's metrics on `split` with the current params and tables."""
    outputs = []
    for batch in self.task.eval_batches(split):
      outputs.append(jax.device_get(self._eval(self.state, batch)))
    return self.task.metrics(outputs)
