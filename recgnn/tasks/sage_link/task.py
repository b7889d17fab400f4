"""The GraphSAGE link-prediction task (the package docstring holds its config)."""

from __future__ import annotations

from collections.abc import Iterator

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging

from recgnn import hostmem, sharding
from recgnn.data.link_loading import load_link_split
from recgnn.embeddings import TableSpec
from recgnn.graphs import ladies, sampling
from recgnn.models import dlrm, sage_link
from recgnn.tasks import node_sampler_config
from recgnn.tasks.node_batch import check_inputs, model_inputs, node_tables
from recgnn.tasks.node_sampler_config import SAMPLERS
from recgnn.tasks.sage_link import batches as B
from recgnn.tasks.sage_link import scores
from recgnn.train.task import Batch, Task

#: eval.inference: sampled (each eval batch's endpoints' neighbourhoods, eval_fanouts) | full
#: (every node's representation layer by layer over the whole message graph, in chunks of
#: eval.chunk edges, then the split's pairs scored: one eval batch per split).
INFERENCE = ("sampled", "full")


class SageLink(Task):
  """GraphSAGE link prediction on a homogeneous graph: features and / or learned node
  embeddings (table `node`, through any backend of the plan)."""

  # One sampled subgraph per step: every device gets it whole (`batch_spec`); the node ids
  # split over the mesh only where embeddings.split_ids says so (as node classification) or
  # under sampler.data_parallel (a part per device; set in __init__).
  shard_batch = True
  # The loss is the positives' mean plus the negatives' mean, not one mean over examples.
  loss_is_per_example_mean = False
  example_unit = "edges"
  steps_per_call_key = "sampler.steps_per_call"

  def __init__(self, config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh):
    super().__init__(config, mesh)
    hostmem.keep_freed_memory()  # bulk samples: large short-lived buffers (recgnn.hostmem)
    self.split = load_link_split(config.data)
    self.num_nodes = self.split.num_nodes
    self.inputs = check_inputs(config.model.inputs, self.split.name, self.split.features)
    s = config.sampler
    if s.kind not in SAMPLERS:
      raise ValueError(f"Unknown sampler.kind {s.kind!r}; available: {', '.join(SAMPLERS)}")
    data_parallel = s.get("data_parallel", False)
    if not isinstance(data_parallel, bool):
      raise ValueError(f"sampler.data_parallel={data_parallel!r}: use true or false")
    # Data-parallel: each step's pairs in one part per device, each part its own sampled
    # subgraph, trained on its device (the loss vmapped over the parts, split over the mesh).
    self.parts = mesh.size if data_parallel else 1
    # k steps per call: the trainer stacks k host-sampled batches into one transfer and its
    # step scans the k optimizer steps over them (Task.batches_per_call).
    self.steps_per_call = self.batches_per_call = node_sampler_config.steps_per_call(s)
    self.seed = int(config.get("seed", 0))
    self.batch_size = int(s.batch_size)
    self.bulk = int(s.get("bulk", 1))
    self.exclude = bool(s.get("exclude", True))
    neg = config.negatives
    self.neg_kind, self.neg_num = str(neg.kind), int(neg.num)
    B.negatives_per_batch(self.neg_kind, self.batch_size, self.neg_num)  # checks them
    if self.batch_size % self.parts:
      raise ValueError(
        f"sampler.batch_size={self.batch_size} with sampler.data_parallel on {self.parts} "
        f"devices: use a multiple of {self.parts}"
      )
    self.shard_batch = self.parts > 1 or node_sampler_config.split_ids(config)
    self.id_multiple = mesh.size if self.shard_batch else 1
    # A part's node ids go to its own device whole: no padding to the mesh.
    self.train_id_multiple = 1 if self.parts > 1 else self.id_multiple
    self.train_adj = self.split.message_adj("train")
    self.degree_cdf = B.degree_cdf(self.train_adj)
    self.train_seeds = self._seed_slots(self.batch_size // self.parts)
    self.sampler = self._sampler(
      self.train_adj, s.get("fanouts", None), self.train_seeds, s.capacities, "capacities"
    )
    self.eval_pairs = int(s.get("eval_batch_size", None) or 4 * self.batch_size)
    eval_fanouts = s.get("eval_fanouts", None) or s.get("fanouts", None)
    caps = s.get("eval_capacities", "worst")
    self.eval_samplers = {
      split: self._sampler(self.split.message_adj(split), eval_fanouts, 2 * self.eval_pairs,
                           caps, "eval_capacities")
      for split in ("valid", "test")
    }  # fmt: skip
    self.eval_sets = scores.eval_sets(self.split, config, self.seed)
    self.hits = tuple(int(k) for k in config.eval.get("hits", (20, 50, 100)))
    self.inference = str(config.eval.get("inference", "sampled"))
    if self.inference not in INFERENCE:
      raise ValueError(
        f"Unknown eval.inference {self.inference!r}; available: {', '.join(INFERENCE)}"
      )
    self.chunk = int(config.eval.get("chunk", 65536))
    self.model = sage_link.LinkSAGE(
      sizes=tuple(self.sampler.sizes),
      hidden=int(config.model.hidden),
      out=int(config.model.get("out", 0) or config.model.hidden),
      decoder=str(config.model.get("decoder", "dot")),
      mlp_layers=int(config.model.get("mlp_layers", 3)),
      dropout=float(config.model.dropout),
      dtype=dlrm.compute_dtype(config.model.get("dtype", "float32")),
    )
    self.dropped = 0

  # --------------------------------------------------------------------------- setup

  def _seed_slots(self, positives: int) -> int:
    """Frontier-0 slots of a train batch: the most distinct endpoints its pairs can have."""
    neg_sources = positives * self.neg_num if self.neg_kind == "uniform" else 0
    neg_targets = self.neg_num if self.neg_kind == "shared" else positives * self.neg_num
    return min(2 * positives + neg_sources + neg_targets, self.num_nodes)

  def _sampler(self, adj, fanouts, seeds: int, capacities, option: str):
    s = self.config.sampler
    if capacities == "auto" and s.kind == "node" and option == "capacities":
      # Estimated from four real train batches' seeds (each step's first part): their
      # padding slots stay in every frontier, so a trial of `seeds` distinct nodes (node
      # classification's) underestimates.
      worst = self._sampler(adj, fanouts, seeds, "worst", option)
      firsts = [B.split_pairs(*self.train_pairs(t), self.parts)[0] for t in range(4)]
      trial = np.stack([B.endpoints(np.concatenate(p), seeds) for p in firsts])
      rng = np.random.default_rng([self.seed, 7])
      capacities = ",".join(map(str, sampling.estimate_capacities(worst, trial, rng)))
    return node_sampler_config.make_sampler(
      s, adj, self.mesh, self.seed, fanouts, seeds, capacities, np.unique(self.split.train),
      option,
    )  # fmt: skip

  def tables(self) -> list[TableSpec]:
    return node_tables(self.inputs, self.num_nodes, self.config.embeddings)

  def artifacts(self):
    """The fixed negatives every evaluation scores (and the per-positive ones of MRR): saved
    beside the checkpoints; a resume with other ones is refused."""
    return scores.artifacts(self.eval_sets)

  def describe(self) -> str:
    return "\n".join([
      self.split.describe(),
      f"sampler {self.config.sampler.kind} ({type(self.sampler).__name__}): frontier sizes "
      f"{self.sampler.sizes}, {self.bulk} mini-batches per product; inputs {self.inputs}; "
      f"negatives {self.neg_kind} x {self.neg_num}; batch edges excluded from their own "
      f"message passing: {self.exclude}",
    ])  # fmt: skip

  def steps_per_epoch(self) -> int:
    return -(-len(self.split.train) // self.batch_size)

  def num_examples(self, batch: Batch) -> int:
    return self.batch_size

  def example_batch(self) -> Batch:
    """A train batch under eval.inference=full (its eval batch has no sampled layers to
    build the params from; the params do not depend on the frontier sizes)."""
    if self.inference == "full":
      return next(self.train_batches(0))
    return super().example_batch()

  def final_report(self, results):
    return {"dropped_neighbours": float(self.dropped)}

  # --------------------------------------------------------------------------- batches

  def _count_drops(self, blocks):
    if blocks.dropped and not self.dropped:
      logging.warning(
        "Sampled neighbours dropped for lack of frontier capacity (%d in %d mini-batches); "
        "raise --config.sampler.capacities / eval_capacities or set them to 'worst'.",
        blocks.dropped, blocks.k,
      )  # fmt: skip
    self.dropped += blocks.dropped
    return blocks

  def train_pairs(self, step: int) -> tuple[np.ndarray, np.ndarray]:
    """Train step `step`'s (positives int64[batch_size, 2], negatives int64[M, 2]); -1 rows
    pad an epoch's last batch. A function of the seed and the step alone."""
    epoch, within = divmod(step, self.steps_per_epoch())
    order = np.random.default_rng([self.seed, epoch]).permutation(len(self.split.train))
    take = order[within * self.batch_size : (within + 1) * self.batch_size]
    pos = np.full((self.batch_size, 2), -1, np.int64)
    pos[: take.size] = self.split.train[take]
    # Either direction of an undirected edge, so sources are not always the smaller id.
    flip = np.random.default_rng([self.seed, epoch, within, 3]).random(take.size) < 0.5
    pos[: take.size][flip] = pos[: take.size][flip][:, ::-1]
    rng = np.random.default_rng([self.seed, epoch, within, 2])
    return pos, B.draw_negatives(self.neg_kind, pos, self.neg_num, self.degree_cdf, rng)

  def train_batches(self, start_step: int = 0) -> Iterator[Batch]:
    spe, k, n = self.steps_per_epoch(), self.bulk, self.parts
    step = start_step
    while True:
      epoch, within = divmod(step, spe)
      group = within // k
      first = group * k
      steps = range(epoch * spe + first, epoch * spe + min(first + k, spe))
      pairs = [self.train_pairs(t) for t in steps]
      parts = [B.split_pairs(pos, neg, n) for pos, neg in pairs]
      seeds = np.stack(
        [B.endpoints(np.concatenate(p), self.train_seeds) for ps in parts for p in ps]
      )
      # Seeded per (epoch, group): a resumed run draws exactly the same neighbours.
      rng = np.random.default_rng([self.seed, epoch, group, 1])
      blocks = self._count_drops(self.sampler.sample(seeds, rng))
      for i in range(within - first, len(steps)):
        banned = B.banned_keys(pairs[i][0], self.num_nodes)  # the whole step's positives
        subs = [
          self.train_batch(blocks, i * n + j, seeds[i * n + j], *parts[i][j], banned)
          for j in range(n)
        ]
        yield subs[0] if n == 1 else B.stack_parts(subs)
        step += 1

  def train_batch(self, blocks, i: int, seeds, pos, neg, banned) -> Batch:
    """Mini-batch i of `blocks` as a train batch, the step's positive edges (`banned` keys,
    both directions) out of its message passing unless sampler.exclude is false."""
    nodes, layers = blocks.batch(i)
    if self.exclude:
      layers = B.exclude_edges(nodes, layers, banned, self.num_nodes)
    pairs = np.concatenate([pos, neg])
    label = np.concatenate([np.ones(len(pos)), np.zeros(len(neg))])
    return B.pair_batch(self.inputs, nodes, layers, seeds, pairs, label, self.split.features,
                        id_multiple=self.train_id_multiple)  # fmt: skip

  def eval_batches(self, split: str) -> Iterator[Batch]:
    if self.inference == "full":
      yield scores.full_graph_batch(
        self.split, split, self.eval_sets[split], self.inputs, self.chunk, self.id_multiple
      )
      return
    pairs, kind, query = self.eval_sets[split]
    p, sampler = self.eval_pairs, self.eval_samplers[split]
    n = -(-len(pairs) // p)
    rng = np.random.default_rng([self.seed, 12345])  # the same eval neighbourhoods every time
    for start in range(0, n, self.bulk):
      last = min(n, start + self.bulk)
      chunks = [scores.chunk(pairs, kind, query, c * p, p) for c in range(start, last)]
      seeds = np.stack([B.endpoints(c[0], 2 * p) for c in chunks])
      blocks = self._count_drops(sampler.sample(seeds, rng))
      for i, (c_pairs, c_kind, c_query) in enumerate(chunks):
        nodes, layers = blocks.batch(i)
        batch = B.pair_batch(self.inputs, nodes, layers, seeds[i], c_pairs,
                             (c_kind == B.POSITIVE).astype(np.float32), self.split.features,
                             id_multiple=self.id_multiple)  # fmt: skip
        batch["kind"], batch["query"] = c_kind, c_query
        yield batch

  # --------------------------------------------------------------------------- model

  def batch_spec(self, batch: Batch):
    """A data-parallel train batch's leaves are split over the devices (part d on device
    d); every other batch is one subgraph (and its pairs) that every device gets whole."""
    spec = sharding.BATCH_SPEC if "part" in batch else sharding.REPLICATED
    return jax.tree.map(lambda _: spec, batch)

  def _layers(self, batch) -> list[dict[str, jax.Array]]:
    keys = ("nbr", "mask") if self.config.sampler.kind == "node" else ("src", "dst", "weight")
    n = len(self.sampler.sizes) - 1
    return [{key: batch[f"{key}{d}"] for key in keys} for d in range(n)]

  def _model_for(self, batch) -> sage_link.LinkSAGE:
    """The model for this batch's static frontier sizes (train and eval differ; the params
    are the same)."""
    sampler = self.eval_samplers["valid"] if "kind" in batch else self.sampler
    n0, rows = sampler.sizes[0], batch["frontier"].shape[0]
    num_layers = len(sampler.sizes) - 1
    if self.config.sampler.kind == "node":
      mid = tuple(batch[f"nbr{d}"].shape[0] for d in range(1, num_layers))
    else:
      sizes = ladies.LadiesSampler.frontier_sizes(
        n0, self.config.sampler.layer_sizes, self.num_nodes
      )
      mid = tuple(sizes[1:-1])
    return self.model.clone(sizes=(n0, *mid, rows))

  def _scores(self, params, batch, embeddings, *, train: bool, key=None):
    x = model_inputs(self.inputs, batch, embeddings, xp=jnp)
    rngs = {"dropout": key} if key is not None else None
    return self._model_for(batch).apply(
      {"params": params}, x, self._layers(batch), batch["pair_src"], batch["pair_dst"],
      train=train, rngs=rngs,
    )  # fmt: skip

  def init_params(self, key, batch, embeddings):
    x = model_inputs(self.inputs, batch, embeddings, xp=jnp)
    return self._model_for(batch).init(
      key, x, self._layers(batch), batch["pair_src"], batch["pair_dst"], train=False
    )["params"]

  def loss(self, params, batch, embeddings, key):
    if "part" in batch:  # data-parallel: every part's subgraph on its own device
      n = batch["part"].shape[0]
      parts = {k: v for k, v in batch.items() if k not in ("ids", "part")}
      emb = {t: e.reshape(n, -1, e.shape[-1]) for t, e in embeddings.items()}

      def one(b, e, k):
        return self._scores(params, b, e, train=True, key=k)

      s = jax.vmap(one)(parts, emb, jax.random.split(key, n))
      return scores.pair_loss(s.reshape(-1), parts["label"].reshape(-1),
                              parts["weight"].reshape(-1))  # fmt: skip
    s = self._scores(params, batch, embeddings, train=True, key=key)
    return scores.pair_loss(s, batch["label"], batch["weight"])

  def predict(self, params, batch, embeddings):
    if "msg_src" in batch:  # eval.inference=full
      x = model_inputs(self.inputs, batch, embeddings, xp=jnp)
      graph = {k: batch[k] for k in ("msg_src", "msg_dst", "inv_deg")}
      s = sage_link.full_graph_scores(params, x, graph, batch["pair_src"], batch["pair_dst"],
                                      decoder=self.model.decoder, chunk=self.chunk)  # fmt: skip
    else:
      s = self._scores(params, batch, embeddings, train=False)
    return {"score": s, **{k: batch[k] for k in ("label", "weight", "kind", "query")}}

  def metrics(self, outputs):
    return scores.metrics(outputs, self.hits)


TASK = SageLink
