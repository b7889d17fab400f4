"""The link-prediction task's options: its config read and checked once into the frozen
`LinkPredictionOptions` that every part of the task reads (see the package docstring for the
config), and the option values and checks they share."""

from __future__ import annotations

import dataclasses

from recgnn.models import kge

TABLE = "entity"
SCORINGS = ("1vsall", "sampled")
NEGATIVES = ("uniform", "type", "partition")
ENCODERS = ("none", "rgcn")
REGULARIZERS = ("none", "n3", "l2")
DEFAULT_NEGATIVES = 256  # negatives.num=0 under sampled scoring


def check_choice(name: str, value, valid) -> None:
  if value not in valid:
    raise ValueError(f"Unknown {name} {value!r}; available: {', '.join(valid)}")


def negative_options(neg, scoring: str, encoder: str, num_parts: int) -> tuple[str, int, bool]:
  """config.negatives -> (kind, num, shared). Only sampled scoring draws negatives: under
  1vsall every candidate row is scored, so a negatives option set there would be ignored and
  is refused instead. Unset: kind "" (uniform; partition when partitioned), num 0 (256)."""
  kind, num, shared = neg.get("kind", ""), int(neg.get("num", 0)), bool(neg.get("shared", False))
  if scoring != "sampled":
    given = [f"{k}={v!r}" for k, v in (("kind", kind), ("num", num), ("shared", shared)) if v]
    if given:
      raise ValueError(
        f"negatives.{', negatives.'.join(given)}: train.scoring={scoring} scores every "
        "candidate entity and draws no negatives; leave negatives unset (kind='', num=0, "
        "shared=False) or set --config.train.scoring=sampled"
      )
    return "", 0, False
  kind = kind or ("partition" if num_parts else "uniform")
  check_choice("negatives.kind", kind, NEGATIVES)
  if kind == "partition" and not num_parts:
    raise ValueError("negatives.kind=partition needs --config.partition.num_parts > 0")
  if num_parts and kind != "partition":
    raise ValueError(
      "partitioned training draws negatives from the partition: "
      "set --config.negatives.kind=partition"
    )
  if shared and (kind == "type" or encoder == "none"):
    raise ValueError(
      "negatives.shared needs an encoder (model.encoder=rgcn) and uniform or partition "
      "negatives; set --config.negatives.shared=False"
    )
  return kind, num or DEFAULT_NEGATIVES, shared


@dataclasses.dataclass(frozen=True)
class LinkPredictionOptions:
  """The task's config, read and checked once (`from_config`); every part reads it from here.

  Attributes (config keys in the package docstring):
    decoder, dim: model.decoder, embeddings.dim (checked together: complex / rotate need an
      even dim).
    encoder: model.encoder, none | rgcn; rgcn_*: model.rgcn's (read under rgcn only).
    scoring: train.scoring; regularizer, reg_weight, dropout, gamma, p, relation_init: model.*.
    batch_size, eval_batch_size, seed.
    num_parts: partition.num_parts (0 = whole graph); partition_method / pad / candidates /
      only: the rest of config.partition (pad is checked per batch, where a caller may
      override it).
    neg_kind, num_neg, shared_neg: `negative_options`.
    grouped: train.group_queries.
    parallel: G, the partitions per step (0 = serial); devices: the mesh's device count.
  """

  decoder: str
  dim: int
  encoder: str
  scoring: str
  regularizer: str
  reg_weight: float
  dropout: float
  gamma: float
  p: int
  relation_init: float
  batch_size: int
  eval_batch_size: int
  seed: int
  num_parts: int
  neg_kind: str
  num_neg: int
  shared_neg: bool
  grouped: bool
  parallel: int
  devices: int
  partition_method: str = ""
  partition_pad: str = "none"
  partition_candidates: str = "all"
  partition_only: int = -1
  rgcn_bases: int = 0
  rgcn_layers: int = 0
  rgcn_dropout: float = 0.0
  rgcn_edge_dropout: float = 0.0
  rgcn_norm: str = "degree"

  @classmethod
  def from_config(cls, config, mesh) -> LinkPredictionOptions:
    """Every choice checked, in the order a user meets them (the task's constructor did the
    same checks in this order; the partition.parallel and group_queries refusals now come
    before the graph is partitioned rather than after)."""
    m, part = config.model, config.partition
    seed = int(config.get("seed", 0))
    decoder, dim = m.decoder, int(config.embeddings.dim)
    kge.check_decoder(decoder, dim)
    encoder = m.get("encoder", "none")
    check_choice("model.encoder", encoder, ENCODERS)
    scoring = config.train.get("scoring", "1vsall")
    check_choice("train.scoring", scoring, SCORINGS)
    regularizer = m.get("regularizer", "none")
    check_choice("model.regularizer", regularizer, REGULARIZERS)
    batch_size, eval_batch_size = int(config.batch_size), int(config.eval.batch_size)
    num_parts = int(part.get("num_parts", 0))
    if num_parts and encoder == "none":
      raise ValueError(
        "partition.num_parts > 0 partitions the encoder's graph: set --config.model.encoder=rgcn"
      )
    neg_kind, num_neg, shared_neg = negative_options(config.negatives, scoring, encoder, num_parts)
    rgcn = {}
    if encoder == "rgcn":
      r = m.rgcn
      rgcn = {
        "rgcn_bases": int(r.num_bases),
        "rgcn_layers": int(r.num_layers),
        "rgcn_dropout": float(r.dropout),
        "rgcn_edge_dropout": float(r.edge_dropout),
        "rgcn_norm": r.get("norm", "degree"),
      }
      check_choice("model.rgcn.norm", rgcn["rgcn_norm"], ("degree", "relation"))
    only = int(part.get("only", -1))
    parallel = _parallel_slots(int(part.get("parallel", 0)), num_parts, only, mesh.size)
    grouped = bool(config.train.get("group_queries", False))
    if grouped and (scoring != "1vsall" or encoder != "none"):
      # Grouping merges the triples of one (anchor, relation) query into one 1vsall score row
      # over a fixed entity table: sampled scoring has no such row, and an encoder's batches
      # carry the message graph that grouped batches do not (its cost is the encoder pass,
      # which grouping does not shrink).
      raise ValueError(
        "train.group_queries=True groups 1vsall queries over the entity table and needs "
        "train.scoring=1vsall and model.encoder=none (here scoring "
        f"{scoring}, encoder {encoder}): set --config.train.group_queries=False"
      )
    return cls(
      decoder=decoder,
      dim=dim,
      encoder=encoder,
      scoring=scoring,
      regularizer=regularizer,
      reg_weight=float(m.get("reg_weight", 0.0)),
      dropout=float(m.get("dropout", 0.0)),
      gamma=float(m.get("gamma", 0.0)),
      p=int(m.get("p", 1)),
      relation_init=float(m.get("relation_init", 1e-3)),
      batch_size=batch_size,
      eval_batch_size=eval_batch_size,
      seed=seed,
      num_parts=num_parts,
      neg_kind=neg_kind,
      num_neg=num_neg,
      shared_neg=shared_neg,
      grouped=grouped,
      parallel=parallel,
      devices=mesh.size,
      # read where the old constructor read it: only when it partitions
      partition_method=part.method if num_parts and encoder == "rgcn" else "",
      partition_pad=part.get("pad", "none"),
      partition_candidates=part.get("candidates", "all"),
      partition_only=only,
      **rgcn,
    )

  @property
  def shard_batch(self) -> bool:
    """Whether the step's entity rows (`ids`) are batch-major: only sampled scoring without
    an encoder has per-edge rows; otherwise every step reads all entities or one (sub)graph,
    which every device needs whole. Partition-parallel: each device reads the rows of its own
    partitions only. (The queries / edges themselves are batch-major in every mode.)"""
    return (self.scoring == "sampled" and self.encoder == "none") or bool(self.parallel)


def _parallel_slots(g: int, num_parts: int, only: int, devices: int) -> int:
  """partition.parallel -> G, the partitions trained per step (0 = serial)."""
  if not g:
    return 0
  if not num_parts:
    raise ValueError("partition.parallel needs --config.partition.num_parts > 0")
  if only >= 0:
    raise ValueError("partition.parallel trains every partition: set partition.only=-1")
  if g < 0:
    g = devices
  if g % devices:
    raise ValueError(
      f"partition.parallel={g} partitions per step do not split over the {devices} devices "
      f"of the mesh; use a multiple of {devices} (or -1: one per device)"
    )
  if g > num_parts:
    raise ValueError(
      f"partition.parallel={g} slots but only {num_parts} partitions: set "
      f"partition.num_parts >= {g} (or fewer devices: --config.mesh.data)"
    )
  return g
