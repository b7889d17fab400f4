"""Node classification with GraphSAGE over bulk-sampled mini-batches.

Config (the experiment's ConfigDict; see experiments/sage_*.py):
  data.source          planetoid | synthetic | ogb | tfds (the TFDS planetoid build of data.name,
                       or with data.path the ogb_node build of that OGB folder; array_record
                       under data.tfds_dir, default ~/.cache/recgnn/tfds)
  data.name            planetoid graph name (cora)
  data.path            ogb: the unpacked dataset folder; planetoid: root (None = bundled)
  data.split           ogb: split scheme folder (None = the only one)
  data.synthetic       synthetic: fields of `recgnn.graphs.synthetic.SyntheticSpec`
  data.node_order      none (default) | partition | rcm | random (recgnn/graphs/reorder.py):
                       node ids are relabelled when the graph loads; the permutation is
                       cached under data.cache_dir (the same ids on every run and resume) and
                       `graph.original_ids` / predict's "node" map results back
  data.partition_levels  partition: parts per level (None = reorder.default_levels)
  embeddings.node_init  "" | eigen: write the graph's adjacency eigenvectors, float32[N, dim]
                       in the relabelled ids, to embeddings.node_init_path (.npy) when the task
                       is built; a plan `tt(init=tt_svd, init_path=<that file>)` compresses
                       them into the TT cores (Nimble's eigen init). The file is the whole
                       interface: the task never sees a backend
  model.inputs         features | embeddings | both (learnable node embeddings: table `node`)
  model.hidden, model.dropout (L2: the trainer's optimizer.weight_decay), model.dtype
                       (float32 | bfloat16: the layers' compute dtype; params float32)
  sampler.kind         node (GraphSAGE fanouts) | ladies (layer-wise)
  sampler.where        host (numpy / scipy, default) | device (jitted JAX over the CSR in
                       device memory; recgnn/graphs/device_sampling.py, split_sampling.py
                       with split_devices): the same law
  sampler.split_devices  device: 0 (default) keeps the graph on one device; N > 1 splits the
                       adjacency's rows over the first N devices (shard_map with explicit
                       collectives per hop) and gives the same sample as N = 0 (node; ladies:
                       the same nodes and edges, weights to an ulp)
  sampler.split_exchange  reduce_scatter (default: exact) | all_to_all (node only: rows
                       requested from their owners; sampler.split_capacity = x an even
                       share per device pair, None = all rows: exact; overflow counted as
                       dropped)
  sampler.data_parallel  false (default): the trainer samples each mini-batch on the host (or
                       with sampler.where=device, on one device) and every device gets the
                       whole subgraph; true: data-parallel, every device of the mesh samples
                       and trains its own ceil(batch_size / n) seeds on its replica of the
                       graph (`recgnn.tasks.node_data_parallel`): the train batches are seed
                       ids only, the node table's backend must prepare on the device
                       (dense); the graph replicated, or with split_devices = the mesh's
                       devices, its rows split over them (each hop's reads exchanged:
                       split_exchange; node-wise only)
  sampler.steps_per_call  data_parallel: k, train steps per call of the trainer's step (default
                       1): every device samples its next k mini-batches in one bulk call and
                       the step scans k optimizer steps over them (no host round trip between
                       them; a train batch holds the k steps' seeds). The same mini-batches
                       and parameters as k = 1, bit for bit; the loop counts k steps per call,
                       so train.steps, log_every, checkpoint_every, eval_every, stop_after and
                       profile steps must be multiples of k (refused otherwise)
  sampler.fanouts      node: per layer, seeds outward (-1 = all neighbours)
  sampler.layer_sizes  ladies: nodes drawn per layer
  sampler.batch_size   seeds per mini-batch
  sampler.bulk         k, mini-batches sampled per sparse product
  sampler.capacities   auto (estimated from a trial sample) | worst | frontier sizes per layer
                       ("100,150"; node only: LADIES' frontiers are exact, its sizes refused)
  sampler.eval_capacities  the same for eval batches (default worst)
  sampler.eval_fanouts node: eval fanouts (None = fanouts)
  sampler.eval_batch_size
  embeddings.dim, embeddings.optimizer (name, learning_rate), embeddings.initializer
  embeddings.split_ids auto (default: when a plan rule names `sharded`) | true | false: the
                       node ids split over the mesh (each device fetches its share through
                       the backend) or replicated (every device looks up every id)
  seed                 shuffling, sampling (train batches are a function of seed and step)

Batches: the model's inputs are the rows of the deepest sampled frontier (n_L nodes, padded
with -1), so a learnable-embedding batch is `ids["node"] = int32[n_L', 1]`: one bag per
frontier node, pooled by the trainer to float32[n_L', D]. n_L' is n_L rounded up to a
multiple of the mesh's devices (-1 ids: zero rows, dropped before the model) when the node
ids are split (embeddings.split_ids): they are then the one batch-major part of a batch, each
device fetches n_L' / n of the rows through the table's backend (dense, tt, offload,
hot_cold or sharded), and XLA gathers them for the subgraph, which every device gets whole
(`batch_spec`: every other leaf replicated). `frontier` = int32[n_L] is the frontier's node
ids. The n_L rows are not the seeds: the seeds are frontier 0, and `labels` / `weight` are
float32[batch_size] for them.
"""

from __future__ import annotations

from collections.abc import Iterator

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging

from recgnn import hostmem, sharding
from recgnn.data.graph_loading import load_graph, write_eigen_init
from recgnn.embeddings import TableSpec
from recgnn.graphs import ladies, sampling
from recgnn.models import dlrm, graphsage
from recgnn.tasks import node_data_parallel, node_sampler_config
from recgnn.tasks.node_batch import TABLE, check_inputs, make_batch, model_inputs, node_tables
from recgnn.tasks.node_sampler_config import SAMPLERS
from recgnn.train.task import Batch, Task


class NodeClassification(Task):
  """GraphSAGE node classification on features and / or learnable node embeddings."""

  # A sampled mini-batch is one subgraph, not independent examples: every device gets the
  # subgraph whole (`batch_spec`). The node ids are split over the mesh when
  # embeddings.split_ids says so (see `_split_ids`): a node table is then fetched through its
  # backend like any batch-major lookup (`sharded` routes each device's ids to their owners;
  # `offload` / `hot_cold` serve them from their caches); otherwise every device looks up all
  # of them (no collective in the step).
  shard_batch = True

  def __init__(self, config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh):
    super().__init__(config, mesh)
    # Bulk samples allocate large short-lived buffers; see recgnn.hostmem.
    hostmem.keep_freed_memory()
    self.load_info: dict = {}
    self.graph = load_graph(config.data, self.load_info)
    node_init = config.embeddings.get("node_init", "") or ""
    if node_init not in ("", "eigen"):
      raise ValueError(f"Unknown embeddings.node_init {node_init!r}; available: '', eigen")
    if node_init == "eigen":
      if not config.embeddings.get("node_init_path", ""):
        raise ValueError("embeddings.node_init=eigen needs embeddings.node_init_path=FILE.npy")
      write_eigen_init(self.graph, int(config.embeddings.dim), config.embeddings.node_init_path)
    self.inputs = check_inputs(config.model.inputs, self.graph.name, self.graph.features)
    s = config.sampler
    if s.kind not in SAMPLERS:
      raise ValueError(f"Unknown sampler.kind {s.kind!r}; available: {', '.join(SAMPLERS)}")
    self.batch_size = int(s.batch_size)
    self.bulk = int(s.get("bulk", 1))
    self.seed = int(config.get("seed", 0))
    self.shard_batch = node_sampler_config.split_ids(config)
    # Node-id bags per batch: a multiple of the mesh's devices (each fetches an equal share).
    self.id_multiple = mesh.size if self.shard_batch else 1
    self.train_nodes = self._labelled("train")
    self.dropped = 0
    self.device_samples = None
    data_parallel = s.get("data_parallel", False)
    if not isinstance(data_parallel, bool):
      raise ValueError(f"sampler.data_parallel={data_parallel!r}: use true or false")
    if data_parallel:
      self.device_samples = node_data_parallel.DeviceSamples(self, mesh)
      self.steps_per_call = node_sampler_config.steps_per_call(s)
      # Train batches are sampled per device (b seeds each): no sampler of the whole batch.
      self.sampler = self.device_samples.sampler
    else:
      if node_sampler_config.steps_per_call(s) != 1:
        raise ValueError(
          f"sampler.steps_per_call={s.steps_per_call}: k steps per call sample on the device "
          "(every device its own mini-batches); set sampler.data_parallel=true, or "
          "sampler.steps_per_call=1 (host-sampled batches are one step each; sampler.bulk "
          "sets how many are sampled per product)"
        )
      self.sampler = self.make_sampler(
        s.get("fanouts", None), self.batch_size, s.capacities, self.train_nodes, "capacities"
      )
    eval_fanouts = s.get("eval_fanouts", None) or s.get("fanouts", None)
    self.eval_batch_size = int(s.get("eval_batch_size", None) or self.batch_size)
    eval_nodes = np.concatenate([self._labelled("valid"), self._labelled("test")])
    eval_caps = s.get("eval_capacities", "worst")
    self.eval_sampler = self.make_sampler(
      eval_fanouts, self.eval_batch_size, eval_caps, eval_nodes, "eval_capacities"
    )
    self.model = graphsage.GraphSAGE(
      sizes=tuple(self.sampler.sizes),
      hidden=int(config.model.hidden),
      num_classes=self.graph.num_classes,
      dropout=float(config.model.dropout),
      # model.dtype: the layers' compute dtype (params, tables and the loss stay float32)
      dtype=dlrm.compute_dtype(config.model.get("dtype", "float32")),
    )

  # --------------------------------------------------------------------------- setup

  steps_per_call_key = "sampler.steps_per_call"

  def _labelled(self, split: str) -> np.ndarray:
    ids = self.graph.splits[split]
    return ids[self.graph.labels[ids] >= 0]

  def make_sampler(
    self,
    fanouts,
    batch_size: int,
    capacities,
    trial_nodes: np.ndarray,
    option: str,
    where: str | None = None,
    split_mesh: jax.sharding.Mesh | None = None,
  ):
    """`node_sampler_config.make_sampler` over this task's graph, mesh and seed."""
    return node_sampler_config.make_sampler(
      self.config.sampler, self.graph.adj, self.mesh, self.seed, fanouts, batch_size,
      capacities, trial_nodes, option, where=where, split_mesh=split_mesh,
    )  # fmt: skip

  def tables(self) -> list[TableSpec]:
    return node_tables(self.inputs, self.graph.num_nodes, self.config.embeddings)

  def artifacts(self):
    """The node permutation of a relabelled graph (node j is the dataset's node perm[j]),
    saved beside the checkpoints so predictions map back to the original ids."""
    if self.graph.original_ids is None:
      return {}
    return {"node_permutation": self.graph.original_ids}

  def describe(self) -> str:
    lines = [self.graph.describe()]
    if "node_order_file" in self.load_info:
      lines.append(
        f"node order {self.config.data.node_order}: node j is the dataset's node perm[j], "
        f"perm = {self.load_info['node_order_file']} (predictions map back through it)"
      )
    lines.append(
      f"sampler {self.config.sampler.kind} on the "
      f"{self.config.sampler.get('where', 'host') or 'host'} ({type(self.sampler).__name__}): "
      f"frontier sizes {self.sampler.sizes}, {self.bulk} mini-batches per product; "
      f"inputs: {self.inputs}"
    )
    if self.device_samples is not None:
      d = self.device_samples
      lines.append(
        f"data-parallel: each of {d.devices} devices samples and trains {d.per_device} seeds "
        f"per step on its replica of the graph (frontier sizes {d.sampler.sizes}), "
        f"{self.steps_per_call} step(s) per call"
      )
    lines.append(f"chance accuracy (majority class of test): {self.chance_accuracy():.4f}")
    return "\n".join(lines)

  def chance_accuracy(self) -> float:
    test = self._labelled("test")
    return float(np.bincount(self.graph.labels[test]).max() / max(test.size, 1))

  # --------------------------------------------------------------------------- batches

  def _make_batch(self, nodes: np.ndarray, layers, seeds: np.ndarray) -> Batch:
    return make_batch(
      self.inputs,
      nodes,
      layers,
      seeds,
      self.graph.features,
      self.graph.labels,
      id_multiple=self.id_multiple,
    )

  def _count_drops(self, blocks: sampling.Blocks) -> sampling.Blocks:
    if blocks.dropped and not self.dropped:
      logging.warning(
        "Sampled neighbours dropped for lack of frontier capacity (%d in %d mini-batches); "
        "raise --config.sampler.capacities / eval_capacities or set them to 'worst'.",
        blocks.dropped,
        blocks.k,
      )
    self.dropped += blocks.dropped
    return blocks

  def final_report(self, results):
    return {"chance_accuracy": self.chance_accuracy(), "dropped_neighbours": float(self.dropped)}

  def _steps_per_epoch(self) -> int:
    return -(-self.train_nodes.size // self.batch_size)

  def _epoch_order(self, epoch: int) -> np.ndarray:
    """The train nodes in epoch `epoch`'s order (a function of the seed and the epoch)."""
    return np.random.default_rng([self.seed, epoch]).permutation(self.train_nodes)

  def train_seeds(self, step: int) -> np.ndarray:
    """int64[batch_size]: the seeds of train step `step` (-1 = padding at an epoch's end),
    the seeds `train_batches` gives that step."""
    epoch, within = divmod(step, self._steps_per_epoch())
    flat = self._epoch_order(epoch)[within * self.batch_size : (within + 1) * self.batch_size]
    return np.pad(flat.astype(np.int64), (0, self.batch_size - flat.size), constant_values=-1)

  def train_batches(self, start_step: int = 0) -> Iterator[Batch]:
    if self.device_samples is not None:
      yield from self._seed_batches(start_step)
      return
    spe, k, bsz = self._steps_per_epoch(), self.bulk, self.batch_size
    step = start_step
    while True:
      epoch, within = divmod(step, spe)
      group = within // k
      perm = self._epoch_order(epoch)
      first = group * k
      count = min(k, spe - first)
      seeds = np.full((count, bsz), -1, np.int64)
      flat = perm[first * bsz : (first + count) * bsz]
      seeds.reshape(-1)[: flat.size] = flat
      # Seeded per (epoch, group): a resumed run draws exactly the same neighbours.
      rng = np.random.default_rng([self.seed, epoch, group, 1])
      blocks = self._count_drops(self.sampler.sample(seeds, rng))
      for i in range(within - first, count):
        nodes, layers = blocks.batch(i)
        yield self._make_batch(nodes, layers, seeds[i])
        step += 1

  def _seed_batches(self, step: int) -> Iterator[Batch]:
    """Data-parallel train batches, one per call of k = steps_per_call steps: {"seeds":
    int32[n * k * b] (`DeviceSamples.seeds` of steps step .. step + k - 1 flattened: device
    d's slice [d k b, (d + 1) k b) is its [k, b] seeds, from each step's `train_seeds`, -1
    padded), "weight": float32[n * k * b], "ids": {TABLE: int32[n * k * b, 0]} with a node
    table}: the node ids are sampled on the device, so their bags here are empty (the plan's
    prepare has nothing to do)."""
    d, k = self.device_samples, self.steps_per_call
    if step % k:
      raise ValueError(f"train_batches({step}): not a call boundary of {k} steps per call")
    while True:
      seeds = d.seeds(step, k).reshape(-1)
      ids = {TABLE: np.zeros((seeds.size, 0), np.int32)} if self.inputs != "features" else {}
      yield {"ids": ids, "seeds": seeds, "weight": (seeds >= 0).astype(np.float32)}
      step += k

  def step_inputs(self):
    """Data-parallel: the graph every device samples from (CSR, features, labels), placed on
    every device once (`DeviceSamples.graph_arrays`)."""
    return {} if self.device_samples is None else self.device_samples.graph_arrays()

  def train_step(self, plan, tx):
    """Data-parallel: every device samples and trains its own seeds
    (`DeviceSamples.trainer_step`); else the trainer's shared step."""
    if self.device_samples is None:
      return None
    return self.device_samples.trainer_step(plan, tx)

  def eval_batches(self, split: str):
    ids = self._labelled(split)
    bsz, k = self.eval_batch_size, self.bulk
    n = -(-ids.size // bsz)
    seeds = np.full((n, bsz), -1, np.int64)
    seeds.reshape(-1)[: ids.size] = ids
    rng = np.random.default_rng([self.seed, 12345])  # the same eval neighbourhoods every time
    for start in range(0, n, k):
      blocks = self._count_drops(self.eval_sampler.sample(seeds[start : start + k], rng))
      for i in range(blocks.k):
        nodes, layers = blocks.batch(i)
        yield self._make_batch(nodes, layers, seeds[start + i])

  # --------------------------------------------------------------------------- model

  def batch_spec(self, batch: Batch):
    """Every leaf but the node ids (`ids`, split by shard_batch = embeddings.split_ids) is
    the subgraph's: every device gets it whole. A data-parallel train batch (seeds) is split
    over the devices: each gets its own seeds."""
    spec = sharding.BATCH_SPEC if "seeds" in batch else sharding.REPLICATED
    return jax.tree.map(lambda _: spec, batch)

  def _inputs(self, batch, embeddings) -> jax.Array:
    return model_inputs(self.inputs, batch, embeddings, xp=jnp)

  def _layers(self, batch) -> list[dict[str, jax.Array]]:
    keys = ("nbr", "mask") if self.config.sampler.kind == "node" else ("src", "dst", "weight")
    n = len(self.sampler.sizes) - 1
    return [{key: batch[f"{key}{d}"] for key in keys} for d in range(n)]

  def _model_for(self, batch, embeddings) -> graphsage.GraphSAGE:
    """The model for this batch's static frontier sizes (train and eval samplers may differ;
    the params are the same)."""
    n0 = batch["labels"].shape[0]
    rows = batch["frontier"].shape[0]
    num_layers = len(self.sampler.sizes) - 1
    if self.config.sampler.kind == "node":
      mid = tuple(batch[f"nbr{d}"].shape[0] for d in range(1, num_layers))
    else:
      mid = tuple(
        ladies.LadiesSampler.frontier_sizes(
          n0, self.config.sampler.layer_sizes, self.graph.num_nodes
        )[1:-1]
      )
    return self.model.clone(sizes=(n0, *mid, rows))

  def init_params(self, key, batch, embeddings):
    x = self._inputs(batch, embeddings)
    model = self._model_for(batch, embeddings)
    return model.init(key, x, self._layers(batch), train=False)["params"]

  def loss(self, params, batch, embeddings, key):
    logits = self._model_for(batch, embeddings).apply(
      {"params": params},
      self._inputs(batch, embeddings),
      self._layers(batch),
      train=True,
      rngs={"dropout": key},
    )
    w = batch["weight"]
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
    denom = jnp.maximum(w.sum(), 1.0)
    loss = jnp.sum(ce * w) / denom
    acc = jnp.sum((jnp.argmax(logits, -1) == batch["labels"]) * w) / denom
    return loss, {"accuracy": acc}

  def predict(self, params, batch, embeddings):
    logits = self._model_for(batch, embeddings).apply(
      {"params": params}, self._inputs(batch, embeddings), self._layers(batch), train=False
    )
    return {
      "pred": jnp.argmax(logits, -1).astype(jnp.int32),
      "logits": logits,
      "node": batch["node"],
      "labels": batch["labels"],
      "weight": batch["weight"],
    }

  def original_ids(self, nodes: np.ndarray) -> np.ndarray:
    """The dataset's ids of `nodes` (ids of the possibly relabelled graph; -1 stays -1)."""
    nodes = np.asarray(nodes)
    if self.graph.original_ids is None:
      return nodes.astype(np.int64)
    return np.where(nodes >= 0, self.graph.original_ids[np.maximum(nodes, 0)], -1)

  def predictions(self, outputs) -> dict[str, np.ndarray]:
    """Eval outputs keyed by the dataset's node ids: {"node": int64[n] original ids (sorted),
    "pred": int32[n], "logits": float32[n, C]}; padding dropped."""
    node = self.original_ids(np.concatenate([np.asarray(o["node"]) for o in outputs]))
    pred = np.concatenate([np.asarray(o["pred"]) for o in outputs])
    logits = np.concatenate([np.asarray(o["logits"]) for o in outputs])
    keep = node >= 0
    order = np.argsort(node[keep], kind="stable")
    return {"node": node[keep][order], "pred": pred[keep][order], "logits": logits[keep][order]}

  def metrics(self, outputs):
    pred = np.concatenate([np.asarray(o["pred"]) for o in outputs])
    labels = np.concatenate([np.asarray(o["labels"]) for o in outputs])
    w = np.concatenate([np.asarray(o["weight"]) for o in outputs])
    return {"accuracy": float(np.sum((pred == labels) * w) / max(w.sum(), 1.0))}


TASK = NodeClassification
