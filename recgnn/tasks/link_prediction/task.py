"""The link-prediction task: its config read and checked, the KG and its derived indexes
built, the entity table declared. Batches (batches.py) and losses (losses.py) are mixins."""

from __future__ import annotations

import time

import jax
import ml_collections

from recgnn.data import kg as kg_lib
from recgnn.embeddings import OptimizerSpec, TableSpec
from recgnn.graphs import kg_partition
from recgnn.models import kge, rgcn
from recgnn.tasks.link_prediction import sources
from recgnn.tasks.link_prediction.batches import Batches
from recgnn.tasks.link_prediction.losses import Losses
from recgnn.tasks.link_prediction.options import (
  ENCODERS,
  REGULARIZERS,
  SCORINGS,
  TABLE,
  check_choice,
  negative_options,
)
from recgnn.train.task import Task


class LinkPrediction(Batches, Losses, Task):
  """Link prediction on a knowledge graph with a KGE decoder and optional R-GCN encoder."""

  example_unit = "edges"

  def __init__(self, config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh):
    super().__init__(config, mesh)
    d, m = config.data, config.model
    self.kg = sources.load_kg(d)
    self.seed = int(config.get("seed", 0))
    self.decoder = m.decoder
    self.dim = int(config.embeddings.dim)
    kge.check_decoder(self.decoder, self.dim)
    self.encoder_kind = m.get("encoder", "none")
    check_choice("model.encoder", self.encoder_kind, ENCODERS)
    self.scoring = config.train.get("scoring", "1vsall")
    check_choice("train.scoring", self.scoring, SCORINGS)
    self.regularizer = m.get("regularizer", "none")
    check_choice("model.regularizer", self.regularizer, REGULARIZERS)
    self.batch_size = int(config.batch_size)
    self.eval_batch_size = int(config.eval.batch_size)
    self.num_parts = int(config.partition.get("num_parts", 0))
    if self.num_parts and self.encoder_kind == "none":
      raise ValueError(
        "partition.num_parts > 0 partitions the encoder's graph: set --config.model.encoder=rgcn"
      )
    self.neg_kind, self.num_neg, self.shared_neg = negative_options(
      config.negatives, self.scoring, self.encoder_kind, self.num_parts
    )
    N = self.kg.num_entities
    self.train_triples = self.kg.training_triples()
    self.filter = kg_lib.FilterIndex(self.kg)
    self.relations = kge.Relations(
      self.kg.num_relations,
      kge.relation_dim(self.decoder, self.dim),
      self.decoder,
      float(m.get("relation_init", 1e-3)),
    )
    self.encoder = None
    self.graph = None
    self.partitions = None
    if self.encoder_kind == "rgcn":
      r = m.rgcn
      self.encoder = rgcn.RGCN(
        num_relations=self.kg.num_relations if self.kg.reciprocal else 2 * self.kg.num_relations,
        dim=self.dim,
        num_bases=int(r.num_bases),
        num_layers=int(r.num_layers),
        dropout=float(r.dropout),
        edge_dropout=float(r.edge_dropout),
      )
      self.graph = sources.message_graph(self.kg, config.model.rgcn.get("norm", "degree"))
      if self.num_parts:
        t0 = time.perf_counter()
        parts = kg_partition.assign(
          N, self.kg.splits["train"], self.num_parts, config.partition.method, self.seed
        )
        self.partitions = kg_partition.build(
          N, self.train_triples, self.graph["edges"], parts, int(r.num_layers)
        )
        self.partition_seconds = time.perf_counter() - t0
        self.max_nodes = max(len(p.nodes) for p in self.partitions)
        self.max_edges = max(len(p.edges) for p in self.partitions)
    self.parallel = self._parallel_slots(config)
    if self.neg_kind == "type":
      self._type_index()
    self.grouped = bool(config.train.get("group_queries", False))
    if self.grouped and (self.scoring != "1vsall" or self.encoder is not None):
      # Grouping merges the triples of one (anchor, relation) query into one 1vsall score row
      # over a fixed entity table: sampled scoring has no such row, and an encoder's batches
      # carry the message graph that grouped batches do not (its cost is the encoder pass,
      # which grouping does not shrink).
      raise ValueError(
        "train.group_queries=True groups 1vsall queries over the entity table and needs "
        "train.scoring=1vsall and model.encoder=none (here scoring "
        f"{self.scoring}, encoder {self.encoder_kind}): set --config.train.group_queries=False"
      )
    if self.grouped:
      self._group_queries()
    self._eval_cache: dict[str, list] = {}
    # Only sampled scoring without an encoder has batch-major rows; otherwise every step reads
    # all entities or one (sub)graph, which every device needs whole (`ids` replicated). The
    # queries / edges themselves are batch-major in every mode (`batch_spec`).
    self.shard_batch = self.scoring == "sampled" and self.encoder is None
    if self.parallel:
      # Each device reads the rows of its own partitions only: ids are batch-major.
      self.shard_batch = True

  def _parallel_slots(self, config) -> int:
    """partition.parallel -> G, the partitions trained per step (0 = serial)."""
    g = int(config.partition.get("parallel", 0))
    if not g:
      return 0
    if not self.num_parts:
      raise ValueError("partition.parallel needs --config.partition.num_parts > 0")
    if int(config.partition.get("only", -1)) >= 0:
      raise ValueError("partition.parallel trains every partition: set partition.only=-1")
    devices = self.mesh.size
    if g < 0:
      g = devices
    if g % devices:
      raise ValueError(
        f"partition.parallel={g} partitions per step do not split over the {devices} devices "
        f"of the mesh; use a multiple of {devices} (or -1: one per device)"
      )
    if g > self.num_parts:
      raise ValueError(
        f"partition.parallel={g} slots but only {self.num_parts} partitions: set "
        f"partition.num_parts >= {g} (or fewer devices: --config.mesh.data)"
      )
    self.devices = devices
    return g

  def tables(self) -> list[TableSpec]:
    emb = self.config.embeddings
    return [
      TableSpec(
        name=TABLE,
        num_rows=self.kg.num_entities,
        dim=self.dim,
        optimizer=OptimizerSpec(**dict(emb.optimizer)),
        initializer=emb.get("initializer", "uniform"),
        pooling="sum",
      )
    ]

  def describe(self) -> str:
    lines = [self.kg.describe()]
    enc = (
      "no encoder"
      if self.encoder is None
      else (
        f"R-GCN encoder ({self.config.model.rgcn.num_layers} layer(s), "
        f"{self.config.model.rgcn.num_bases} bases) over {len(self.graph['edges']):,} edges"
      )
    )
    lines.append(
      f"decoder {self.decoder}, dim {self.dim}, {enc}; scoring {self.scoring}"
      + (
        f", {self.num_neg} {self.neg_kind} negatives per edge" if self.scoring == "sampled" else ""
      )
    )
    if self.partitions:
      lines.append(
        kg_partition.describe(self.partitions, self.kg.num_entities, len(self.graph["edges"]))
        + f"\n  partitioned in {self.partition_seconds:.1f} s ({self.config.partition.method})"
      )
    if self.parallel:
      lines.append(
        f"  {self.parallel} partitions per step over {self.devices} device(s), each padded to "
        f"{self.max_nodes:,} rows / {self.max_edges:,} edges; {self.steps_per_epoch()} steps "
        "per epoch (the slot with the most batches)"
      )
    return "\n".join(lines)


TASK = LinkPrediction
