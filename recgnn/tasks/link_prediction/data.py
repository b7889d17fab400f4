"""The link-prediction task's data, built once from the KG and the options: the training
triples, the filter index of eval, the encoder's message graph and its partitions, and the
indexes the batches draw from (type-constrained negatives, grouped queries). Read-only after
`KGData.build`."""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from recgnn.data import kg as kg_lib
from recgnn.graphs import kg_partition
from recgnn.tasks.link_prediction import sources
from recgnn.tasks.link_prediction.options import LinkPredictionOptions


@dataclasses.dataclass(frozen=True)
class TypeIndex:
  """Per relation r, the entities seen as its tail in train (type-constrained negatives):
  tails[offsets[r] : offsets[r + 1]], int64[R + 1] / int32[T]."""

  offsets: np.ndarray
  tails: np.ndarray

  @classmethod
  def build(cls, train_triples: np.ndarray, num_entities: int, num_relations: int) -> TypeIndex:
    t = train_triples
    order = np.lexsort((t[:, 2], t[:, 1]))
    rel, tail = t[order, 1], t[order, 2]
    pair = rel.astype(np.int64) * num_entities + tail
    keep = np.ones(pair.size, bool)
    keep[1:] = pair[1:] != pair[:-1]
    rel, tail = rel[keep], tail[keep]
    counts = np.bincount(rel, minlength=num_relations)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return cls(offsets, tail.astype(np.int32))


@dataclasses.dataclass(frozen=True)
class QueryGroups:
  """The distinct (anchor, relation) training queries, int32[Q] each, and their answers in
  CSR: answers[start[q] : start[q] + count[q]] (int32[T], T = the training triples)."""

  anchor: np.ndarray
  rel: np.ndarray
  start: np.ndarray
  count: np.ndarray
  answers: np.ndarray

  @classmethod
  def build(cls, train_triples: np.ndarray, num_relations: int) -> QueryGroups:
    t = train_triples
    key = t[:, 0].astype(np.int64) * num_relations + t[:, 1]
    order = np.argsort(key, kind="stable")
    key, ans = key[order], t[order, 2]
    uniq, start, cnt = np.unique(key, return_index=True, return_counts=True)
    return cls(
      anchor=(uniq // num_relations).astype(np.int32),
      rel=(uniq % num_relations).astype(np.int32),
      start=start,
      count=cnt,
      answers=ans.astype(np.int32),
    )


@dataclasses.dataclass(frozen=True)
class KGData:
  """What the batches are made of.

  Attributes:
    kg: the knowledge graph (entities, relations, splits).
    train_triples: int32[T, 3] (with the reciprocal ones when kg.reciprocal).
    filter: the true answers of every query over train + valid + test (eval's filter).
    graph: the encoder's message graph {"edges": int32[E, 3], "norm": f32[E]}, or None.
    partitions: the graph's self-sufficient partitions (`kg_partition.build`), or None;
      partition_seconds the time they took; max_nodes / max_edges the largest one's rows /
      edges (what `partition.pad=max` and partition-parallel batches pad to).
    types: `TypeIndex` under negatives.kind=type, else None.
    queries: `QueryGroups` under train.group_queries, else None.
  """

  kg: kg_lib.KG
  train_triples: np.ndarray
  filter: kg_lib.FilterIndex
  graph: dict[str, np.ndarray] | None = None
  partitions: list[kg_partition.Partition] | None = None
  partition_seconds: float = 0.0
  max_nodes: int = 0
  max_edges: int = 0
  types: TypeIndex | None = None
  queries: QueryGroups | None = None

  @classmethod
  def build(cls, kg: kg_lib.KG, o: LinkPredictionOptions) -> KGData:
    train_triples = kg.training_triples()
    parts = {}
    graph = None
    if o.encoder == "rgcn":
      graph = sources.message_graph(kg, o.rgcn_norm)
      if o.num_parts:
        t0 = time.perf_counter()
        N = kg.num_entities
        assign = kg_partition.assign(N, kg.splits["train"], o.num_parts, o.partition_method, o.seed)
        partitions = kg_partition.build(N, train_triples, graph["edges"], assign, o.rgcn_layers)
        parts = {
          "partitions": partitions,
          "partition_seconds": time.perf_counter() - t0,
          "max_nodes": max(len(p.nodes) for p in partitions),
          "max_edges": max(len(p.edges) for p in partitions),
        }
    return cls(
      kg=kg,
      train_triples=train_triples,
      filter=kg_lib.FilterIndex(kg),
      graph=graph,
      types=(
        TypeIndex.build(train_triples, kg.num_entities, kg.num_relations)
        if o.neg_kind == "type"
        else None
      ),
      queries=QueryGroups.build(train_triples, kg.num_relations) if o.grouped else None,
      **parts,
    )
