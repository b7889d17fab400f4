"""The link-prediction task's front: the Task contract, each method handed to the part that
owns it. The parts, built once in the constructor, read only what they are handed:

  LinkPredictionOptions  options.py  the config read and checked once (frozen)
  KGData                 data.py     the KG, training triples, filter, message graph,
                                     partitions, negatives' type index, grouped queries
  BatchMaker             batches.py  train / eval batches and their specs (host side)
  Losses                 losses.py   params, losses, predictions, metrics (jit-able)
"""

from __future__ import annotations

import jax
import ml_collections

from recgnn.embeddings import OptimizerSpec, TableSpec
from recgnn.graphs import kg_partition
from recgnn.tasks.link_prediction import batches as batches_lib
from recgnn.tasks.link_prediction import sources
from recgnn.tasks.link_prediction.batches import BatchMaker
from recgnn.tasks.link_prediction.data import KGData
from recgnn.tasks.link_prediction.losses import Losses
from recgnn.tasks.link_prediction.options import TABLE, LinkPredictionOptions
from recgnn.train.task import Task


class LinkPrediction(Task):
  """Link prediction on a knowledge graph with a KGE decoder and optional R-GCN encoder."""

  example_unit = "edges"

  def __init__(self, config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh):
    super().__init__(config, mesh)
    kg = sources.load_kg(config.data)
    self.options = LinkPredictionOptions.from_config(config, mesh)
    self.data = KGData.build(kg, self.options)
    self.batches = BatchMaker(self.options, self.data)
    self.losses = Losses(self.options, kg, mesh)
    self.shard_batch = self.options.shard_batch

  # ------------------------------------------------------------------ the contract
  def tables(self) -> list[TableSpec]:
    emb = self.config.embeddings
    return [
      TableSpec(
        name=TABLE,
        num_rows=self.kg.num_entities,
        dim=self.options.dim,
        optimizer=OptimizerSpec(**dict(emb.optimizer)),
        initializer=emb.get("initializer", "uniform"),
        pooling="sum",
      )
    ]

  def train_batches(self, start_step: int = 0):
    return self.batches.train_batches(start_step)

  def eval_batches(self, split: str):
    return iter(self.batches.eval_batches(split))

  def example_batch(self):
    # The encoder's params do not depend on the graph's size; any train batch has every leaf.
    return next(self.batches.train_batches(0))

  def steps_per_epoch(self) -> int:
    return self.batches.steps_per_epoch()

  def num_examples(self, batch) -> int:
    return batches_lib.num_examples(batch)

  def batch_spec(self, batch):
    if self.batches.splits_whole(batch):
      return super().batch_spec(batch)
    return self.batches.leaf_specs(batch)

  def init_params(self, key, batch, embeddings):
    return self.losses.init_params(key, batch, embeddings)

  def loss(self, params, batch, embeddings, key):
    return self.losses.loss(params, batch, embeddings, key)

  def predict(self, params, batch, embeddings):
    return self.losses.predict(params, batch, embeddings)

  def metrics(self, outputs):
    return self.losses.metrics(outputs)

  def describe(self) -> str:
    o, d = self.options, self.data
    lines = [d.kg.describe()]
    enc = (
      "no encoder"
      if o.encoder == "none"
      else (
        f"R-GCN encoder ({o.rgcn_layers} layer(s), {o.rgcn_bases} bases) over "
        f"{len(d.graph['edges']):,} edges"
      )
    )
    lines.append(
      f"decoder {o.decoder}, dim {o.dim}, {enc}; scoring {o.scoring}"
      + (f", {o.num_neg} {o.neg_kind} negatives per edge" if o.scoring == "sampled" else "")
    )
    if d.partitions:
      lines.append(
        kg_partition.describe(d.partitions, d.kg.num_entities, len(d.graph["edges"]))
        + f"\n  partitioned in {d.partition_seconds:.1f} s ({o.partition_method})"
      )
    if o.parallel:
      lines.append(
        f"  {o.parallel} partitions per step over {o.devices} device(s), each padded to "
        f"{d.max_nodes:,} rows / {d.max_edges:,} edges; {self.steps_per_epoch()} steps "
        "per epoch (the slot with the most batches)"
      )
    return "\n".join(lines)

  # ------------------------------------------------------------------ the parts' public names
  # (what tests, benchmarks and notebooks read off the task)
  def partition_batch(self, p, triples, rng, pad=None):
    """`BatchMaker.partition_batch`: one training batch of partition p."""
    return self.batches.partition_batch(p, triples, rng, pad)

  def parallel_schedule(self, epoch: int):
    return self.batches.parallel_schedule(epoch)

  def parallel_batch(self, epoch: int, within: int):
    return self.batches.parallel_batch(epoch, within)

  kg = property(lambda self: self.data.kg)
  train_triples = property(lambda self: self.data.train_triples)
  filter = property(lambda self: self.data.filter)
  graph = property(lambda self: self.data.graph)
  partitions = property(lambda self: self.data.partitions)
  partition_seconds = property(lambda self: self.data.partition_seconds)
  max_nodes = property(lambda self: self.data.max_nodes)
  max_edges = property(lambda self: self.data.max_edges)
  relations = property(lambda self: self.losses.relations)
  encoder = property(lambda self: self.losses.encoder)
  seed = property(lambda self: self.options.seed)
  decoder = property(lambda self: self.options.decoder)
  dim = property(lambda self: self.options.dim)
  encoder_kind = property(lambda self: self.options.encoder)
  scoring = property(lambda self: self.options.scoring)
  regularizer = property(lambda self: self.options.regularizer)
  batch_size = property(lambda self: self.options.batch_size)
  eval_batch_size = property(lambda self: self.options.eval_batch_size)
  num_parts = property(lambda self: self.options.num_parts)
  neg_kind = property(lambda self: self.options.neg_kind)
  num_neg = property(lambda self: self.options.num_neg)
  shared_neg = property(lambda self: self.options.shared_neg)
  grouped = property(lambda self: self.options.grouped)
  parallel = property(lambda self: self.options.parallel)
  devices = property(lambda self: self.options.devices)


TASK = LinkPrediction
