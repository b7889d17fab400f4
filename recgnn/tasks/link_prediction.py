"""Knowledge-graph link prediction: KGE decoders, an optional R-GCN encoder, partitions.

Config (see experiments/kge_fb15k237.py, rgcn_fb15k237*.py):
  data.path             folder with train/valid/test triples ("" = bundled FB15k-237)
  data.source           files (read data.path) | tfds (its array_record build, under
                        data.tfds_dir, default ~/.cache/recgnn/tfds) | planted (a synthetic
                        KG with planted communities, data.planted = kg.planted's arguments)
  data.reciprocal       add inverse relations (tail prediction only, Lacroix et al. 2018)
  data.max_bad_lines    malformed lines tolerated per file
  model.decoder         distmult | complex | rotate | transe
  model.encoder         none | rgcn
  model.gamma, model.p  margin of rotate / transe; transe's norm (1 or 2)
  model.dropout         on the decoder's entity inputs
  model.regularizer     none | n3 | l2, weight model.reg_weight (on the batch's h, r, t)
  model.rgcn            num_bases, num_layers, dropout, edge_dropout
  train.scoring         1vsall (every candidate entity scored; small graphs) |
                        sampled (negatives.num negatives per edge; large graphs)
  train.group_queries   1vsall without encoder: score each distinct (anchor, relation) query
                        once per epoch with all its true answers as labels. The loss is the
                        1vsall loss of those triples summed exactly (CE_t = lse - s_t), at 3.6x
                        fewer score rows on FB15k-237 (149,689 queries for 544,230 triples).
                        Refused with sampled scoring or an encoder
  negatives.*           sampled scoring only (refused under 1vsall, which draws none):
  negatives.kind        uniform | type (entities seen with the relation) | partition ("" =
                        uniform, or partition when partitioned)
  negatives.num         negatives per edge (0 = 256)
  negatives.shared      encoder only: one set of negatives.num rows for the whole batch
                        (scored with one matmul, LibKGE's "batch" negatives); else per edge
  batch_size            edges per step
  eval.batch_size       queries per eval batch (one side: head or tail)
  partition.num_parts   0 = whole graph; P > 0 trains self-sufficient partitions
  partition.method      metis | random
  partition.pad         none: each partition's batches have its own row / edge counts (one
                        compiled step per partition) | max: every partition padded to the
                        largest (one compiled step, the largest partition's cost every step)
  partition.candidates  1vsall on a partition: all (core + halo rows) | core
  partition.only        -1 = train every partition; p = train partition p alone (one worker
                        of a partition-parallel run; tests)
  partition.parallel    0 = one partition per step (serial); G > 0 = G partitions per step,
                        their batches stacked on a leading axis split over the devices of the
                        mesh (G / devices per device; -1 = G = the mesh's device count), each
                        padded to the largest partition (one compiled step). Partition p trains
                        in slot p % G (round robin when there are more partitions than slots);
                        the loss is the edge-weighted mean over the G batches, so the gradient
                        of the dense params is their data-parallel average (an all-reduce) and
                        the entity table's update gathers every device's (rows, grads)
  embeddings.dim / optimizer / initializer / plan: the entity table `entity`

How entity rows reach the task: batch["ids"]["entity"] is int32[M, 1], the M entity rows a
step needs (bags of one, -1 = padding); the trainer looks them up through the plan and passes
f32[M, D]. Triples index those rows (`h`, `t`, `neg` are row indices, not entity ids):
  sampled, no encoder:  rows = per edge [h, t, neg_1..neg_K], batch-major (M = B (2 + K))
  1vsall, no encoder:   rows = every entity (M = N); replicated, not batch-major
                        grouped queries: `h`, `rel`, `cnt` (answers per query) f32[B] and the
                        labels as (query row, entity) pairs `lab_q` / `lab_e` int32[C]
  encoder:              rows = the encoded graph's nodes: every entity, or a partition's core
                        + halo padded to the largest partition; replicated, like the graph
                        leaves src / dst / erel / enorm (int32 / f32[E_max]).
Partition-parallel (partition.parallel = G): every leaf of a train batch has a leading axis of G
partitions (ids: int32[G * max_nodes, 1], partition g's core + halo rows at [g * max_nodes, ...))
and is split over the devices, so a device looks up only its own partitions' rows and runs
the encoder on their subgraphs alone (the loss in shard_map; tests/test_kg.py poisons every
other row of each device's table copy with NaN). Per step a device sends its rows' gradients
to the others (the replicated table's sparse update, G * max_nodes x (D + 1) values in all)
and the dense params' gradient (an all-reduce). Eval batches carry every entity's row split
over the devices (padded to a multiple of the device count), gathered once for scoring.
On a mesh (`batch_spec`): the per-query / per-edge leaves (h, rel, t, weight, cnt, per-edge
neg; eval: anchor, rel, target, side, weight) are split over the devices, so their batch
sizes must divide by the device count; rows, label / filter pairs, t_cnt and the graph are
replicated.
Eval: every entity's row (encoded when there is an encoder) scores each query against all N
entities, with the other true answers of the query (the filter, train + valid + test) set
to -inf: `filt_q` / `filt_e` int32[C] (query row in the batch, entity) pairs, padded with
query row B. Rank = 1 + #higher + #tied / 2 (ties count half, the "mean" tie rule).
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from recgnn import sharding
from recgnn.data import kg as kg_lib
from recgnn.embeddings import OptimizerSpec, TableSpec
from recgnn.graphs import kg_partition
from recgnn.models import kge, rgcn
from recgnn.tasks import base

TABLE = "entity"
SCORINGS = ("1vsall", "sampled")
NEGATIVES = ("uniform", "type", "partition")
ENCODERS = ("none", "rgcn")
REGULARIZERS = ("none", "n3", "l2")
DEFAULT_NEGATIVES = 256  # negatives.num=0 under sampled scoring


def _check(name: str, value, valid) -> None:
  if value not in valid:
    raise ValueError(f"Unknown {name} {value!r}; available: {', '.join(valid)}")


def ranks_from_scores(scores: np.ndarray, target: np.ndarray, filt: list[np.ndarray]):
  """Reference filtered ranks (numpy): scores f32[B, N], target int[B], filt[i] the true
  answers of query i (the target among them or not). Rank = 1 + #higher + #tied / 2."""
  out = np.zeros(len(target), np.float64)
  for i, (s, y) in enumerate(zip(scores, target)):
    s = s.astype(np.float64).copy()
    other = np.setdiff1d(filt[i], [y])
    s[other] = -np.inf
    out[i] = 1 + np.sum(s > s[y]) + (np.sum(s == s[y]) - 1) / 2
  return out


def rank_metrics(ranks: np.ndarray, side: np.ndarray | None = None) -> dict[str, float]:
  ranks = np.asarray(ranks, np.float64)
  res = {"mrr": float(np.mean(1 / ranks))}
  for k in (1, 3, 10):
    res[f"hits@{k}"] = float(np.mean(ranks <= k))
  if side is not None:
    for s, name in ((0, "tail"), (1, "head")):
      sel = side == s
      if sel.any():
        res[f"mrr_{name}"] = float(np.mean(1 / ranks[sel]))
  return res


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
  _check("negatives.kind", kind, NEGATIVES)
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


class LinkPrediction(base.Task):
  """Link prediction on a knowledge graph with a KGE decoder and optional R-GCN encoder."""

  example_unit = "edges"

  def __init__(self, config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh):
    super().__init__(config, mesh)
    d, m = config.data, config.model
    source = d.get("source", "files")
    if source == "files":
      self.kg = kg_lib.load(
        d.get("path", "") or None,
        reciprocal=bool(d.get("reciprocal", True)),
        max_bad_lines=int(d.get("max_bad_lines", 100)),
      )
    elif source == "tfds":
      # The fb15k237 array_record build (of data.path's triples, or the bundled ones), built
      # once under data.tfds_dir; the same ids and names as the files.
      from recgnn.data import tfds_builders

      data_dir = os.path.expanduser(d.get("tfds_dir", "") or "~/.cache/recgnn/tfds")
      builder = tfds_builders.build("fb15k237", data_dir, manual_dir=d.get("path", "") or None)
      self.kg = tfds_builders.load_kg(builder, reciprocal=bool(d.get("reciprocal", True)))
    elif source == "planted":
      # A synthetic KG with planted communities (small partition halos; kg_lib.planted).
      self.kg = kg_lib.planted(
        **dict(d.get("planted", {})), reciprocal=bool(d.get("reciprocal", True))
      )
    else:
      raise ValueError(f"Unknown data.source {source!r}; available: files, tfds, planted")
    self.seed = int(config.get("seed", 0))
    self.decoder = m.decoder
    self.dim = int(config.embeddings.dim)
    kge.check_decoder(self.decoder, self.dim)
    self.encoder_kind = m.get("encoder", "none")
    _check("model.encoder", self.encoder_kind, ENCODERS)
    self.scoring = config.train.get("scoring", "1vsall")
    _check("train.scoring", self.scoring, SCORINGS)
    self.regularizer = m.get("regularizer", "none")
    _check("model.regularizer", self.regularizer, REGULARIZERS)
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
      self.graph = self._message_graph()
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

  # --------------------------------------------------------------------------- data

  def _message_graph(self) -> dict[str, np.ndarray]:
    """The encoder's edges: every training triple and its reverse (under the reciprocal
    relation id), with whole-graph norms 1 / c_dst, c_dst = in-degree of dst over all
    relations (model.rgcn.norm = degree), or c_{dst, rel} per relation (= relation,
    Schlichtkrull et al.'s choice; on FB15k-237 a hub then sums one mean per relation type,
    up to hundreds, and DistMult scores blow up)."""
    t = self.kg.splits["train"]
    R = self.kg.num_base_relations
    edges = np.concatenate([t, np.stack([t[:, 2], t[:, 1] + R, t[:, 0]], 1)]).astype(np.int32)
    mode = self.config.model.rgcn.get("norm", "degree")
    _check("model.rgcn.norm", mode, ("degree", "relation"))
    key = edges[:, 2].astype(np.int64)
    if mode == "relation":
      key = key * (2 * R) + edges[:, 1]
    _, inv, cnt = np.unique(key, return_inverse=True, return_counts=True)
    norm = (1.0 / cnt[inv]).astype(np.float32)
    return {"edges": edges, "norm": norm}

  def _group_queries(self):
    """Distinct (anchor, relation) training queries and their answers, CSR."""
    t = self.train_triples
    key = t[:, 0].astype(np.int64) * self.kg.num_relations + t[:, 1]
    order = np.argsort(key, kind="stable")
    key, ans = key[order], t[order, 2]
    uniq, start, cnt = np.unique(key, return_index=True, return_counts=True)
    self.q_anchor = (uniq // self.kg.num_relations).astype(np.int32)
    self.q_rel = (uniq % self.kg.num_relations).astype(np.int32)
    self.q_start, self.q_count = start, cnt
    self.q_answers = ans.astype(np.int32)
    # Static label capacity: the B largest answer sets together (any batch fits).
    self.label_cap = int(np.sort(cnt)[::-1][: self.batch_size].sum())

  def _grouped_batch(self, sel: np.ndarray) -> base.Batch:
    B = self.batch_size
    cnt = self.q_count[sel]
    lab_q = np.repeat(np.arange(len(sel), dtype=np.int32), cnt)
    lab_e = np.concatenate([self.q_answers[s : s + c] for s, c in zip(self.q_start[sel], cnt)])
    return {
      "h": self._pad(self.q_anchor[sel], B),
      "rel": self._pad(self.q_rel[sel], B),
      "cnt": self._pad(cnt.astype(np.float32), B),
      "weight": self._pad(np.ones(len(sel), np.float32), B),
      "lab_q": self._pad(lab_q, self.label_cap, fill=B),
      "lab_e": self._pad(lab_e, self.label_cap, fill=0),
      # Answers per entity: the regularizer's tail term reads every row once, weighted,
      # instead of gathering (and scatter-adding the gradient of) label_cap rows.
      "t_cnt": np.bincount(lab_e, minlength=self.kg.num_entities).astype(np.float32),
      "ids": {TABLE: np.arange(self.kg.num_entities, dtype=np.int32)[:, None]},
    }

  def _type_index(self):
    """Per relation, the entities seen as its tail in train (type-constrained negatives)."""
    t = self.train_triples
    order = np.lexsort((t[:, 2], t[:, 1]))
    rel, tail = t[order, 1], t[order, 2]
    pair = rel.astype(np.int64) * self.kg.num_entities + tail
    keep = np.ones(pair.size, bool)
    keep[1:] = pair[1:] != pair[:-1]
    rel, tail = rel[keep], tail[keep]
    counts = np.bincount(rel, minlength=self.kg.num_relations)
    self.type_offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    self.type_tails = tail.astype(np.int32)

  def _negatives(self, rng, rel: np.ndarray, pool_size: int | None = None) -> np.ndarray:
    """int32[B, K] negative entities (or rows of a partition's core)."""
    B, K = rel.shape[0], self.num_neg
    if self.neg_kind == "type":
      lo = self.type_offsets[rel]
      cnt = self.type_offsets[rel + 1] - lo
      u = rng.random((B, K))
      return self.type_tails[lo[:, None] + (u * cnt[:, None]).astype(np.int64)]
    n = pool_size if pool_size is not None else self.kg.num_entities
    return rng.integers(0, n, (B, K), dtype=np.int32)

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

  # Leaves with one row per query / edge of the batch: split over the devices. The rest (label
  # and filter pairs, answer counts per entity, candidate masks, graph edges) index the whole
  # batch or every row, so every device gets them whole.
  BATCH_MAJOR = frozenset(("h", "rel", "t", "weight", "cnt", "neg", "anchor", "target", "side"))

  def batch_spec(self, batch: base.Batch):
    if self.shard_batch and not (self.parallel and "anchor" in batch):
      return super().batch_spec(batch)  # partition-parallel train batches: all split
    shared_neg = "neg" in batch and np.ndim(batch["neg"]) == 1
    return {
      k: sharding.BATCH_SPEC
      if k in self.BATCH_MAJOR and not (k == "neg" and shared_neg)
      else sharding.REPLICATED
      for k in batch
    }

  def steps_per_epoch(self) -> int:
    if self.grouped:
      return -(-len(self.q_anchor) // self.batch_size)
    if self.parallel:
      return max(len(s) for s in self._slot_batches())
    if self.partitions:
      return sum(
        -(-len(self.partitions[p].triples) // self.batch_size) for p in self._trained_partitions()
      )
    return -(-len(self.train_triples) // self.batch_size)

  def _graph_leaves(self, edges: np.ndarray, norm: np.ndarray, cap: int) -> dict[str, np.ndarray]:
    e = len(edges)
    out = {
      "src": np.zeros(cap, np.int32),
      "dst": np.zeros(cap, np.int32),
      "erel": np.zeros(cap, np.int32),
      "enorm": np.zeros(cap, np.float32),
    }
    out["src"][:e], out["erel"][:e], out["dst"][:e] = edges[:, 0], edges[:, 1], edges[:, 2]
    out["enorm"][:e] = norm
    return out

  def _pad(self, x: np.ndarray, n: int, fill=0) -> np.ndarray:
    out = np.full((n, *x.shape[1:]), fill, x.dtype)
    out[: len(x)] = x
    return out

  def _edge_batch(self, rng, triples: np.ndarray, rows_pool: int | None):
    """h / rel / t / weight (+ neg) of B triples whose h, t already index the step's rows."""
    B = self.batch_size
    n = len(triples)
    batch = {
      "h": self._pad(triples[:, 0], B),
      "rel": self._pad(triples[:, 1], B),
      "t": self._pad(triples[:, 2], B),
      "weight": self._pad(np.ones(n, np.float32), B),
    }
    if self.scoring == "sampled" and self.shared_neg:
      n = rows_pool if rows_pool is not None else self.kg.num_entities
      batch["neg"] = rng.integers(0, n, self.num_neg, dtype=np.int32)
    elif self.scoring == "sampled":
      batch["neg"] = self._negatives(rng, batch["rel"], rows_pool)
    return batch

  def train_batches(self, start_step: int = 0) -> Iterator[base.Batch]:
    if self.parallel:
      yield from self._parallel_batches(start_step)
      return
    if self.partitions:
      yield from self._partition_batches(start_step)
      return
    spe, B, N = self.steps_per_epoch(), self.batch_size, self.kg.num_entities
    all_rows = np.arange(N, dtype=np.int32)[:, None]
    step = start_step
    while True:
      epoch, within = divmod(step, spe)
      if self.grouped:
        perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.q_anchor))
        yield self._grouped_batch(perm[within * B : (within + 1) * B])
        step += 1
        continue
      perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.train_triples))
      tr = self.train_triples[perm[within * B : (within + 1) * B]]
      rng = np.random.default_rng([self.seed, epoch, within, 1])
      batch = self._edge_batch(rng, tr, None)
      if self.encoder is not None or self.scoring == "1vsall":
        batch["ids"] = {TABLE: all_rows}  # rows are entity ids
        if self.encoder is not None:
          batch.update(
            self._graph_leaves(self.graph["edges"], self.graph["norm"], len(self.graph["edges"]))
          )
      else:
        # Rows per edge: [h, t, neg...]; h / t / neg become row indices.
        K = self.num_neg
        ents = np.concatenate([batch["h"][:, None], batch["t"][:, None], batch["neg"]], 1)
        ents[batch["weight"] == 0] = -1
        batch["ids"] = {TABLE: ents.reshape(-1, 1).astype(np.int32)}
        base_row = np.arange(B, dtype=np.int32) * (2 + K)
        batch["h"], batch["t"] = base_row, base_row + 1
        batch["neg"] = base_row[:, None] + 2 + np.arange(K, dtype=np.int32)[None]
      yield batch
      step += 1

  def _trained_partitions(self) -> list[int]:
    only = int(self.config.partition.get("only", -1))
    if only >= len(self.partitions):
      raise ValueError(
        f"partition.only={only}, but there are {len(self.partitions)} partitions (0..."
        f"{len(self.partitions) - 1}; -1 = all)"
      )
    return [only] if only >= 0 else list(range(len(self.partitions)))

  def _partition_schedule(self, epoch: int) -> list[tuple[int, int]]:
    """(partition, batch index) of every step of an epoch, interleaved at random."""
    order = [
      (p, i)
      for p in self._trained_partitions()
      for i in range(-(-len(self.partitions[p].triples) // self.batch_size))
    ]
    perm = np.random.default_rng([self.seed, epoch, 2]).permutation(len(order))
    return [order[i] for i in perm]

  def partition_batch(self, p: int, triples: np.ndarray, rng, pad: str | None = None):
    """One training batch of partition p: its core + halo rows and its subgraph only."""
    part = self.partitions[p]
    batch = self._edge_batch(rng, triples, part.num_core)
    pad = pad or self.config.partition.get("pad", "none")
    _check("partition.pad", pad, ("none", "max"))
    rows = self.max_nodes if pad == "max" else len(part.nodes)
    nodes = np.full(rows, -1, np.int32)
    nodes[: len(part.nodes)] = part.nodes
    batch["ids"] = {TABLE: nodes[:, None]}
    norm = self.graph["norm"][part.edge_index]
    cap = self.max_edges if pad == "max" else len(part.edges)
    batch.update(self._graph_leaves(part.edges, norm, cap))
    if self.scoring == "1vsall":
      # Candidates: every row of the partition (core + halo: the halo rows' encodings are
      # partial, but they are the partition's own), or its core only.
      n = (
        part.num_core
        if self.config.partition.get("candidates", "all") == "core"
        else len(part.nodes)
      )
      batch["cand_mask"] = (np.arange(rows) < n).astype(np.float32)
    return batch

  def _partition_batches(self, start_step: int):
    spe, B = self.steps_per_epoch(), self.batch_size
    step = start_step
    while True:
      epoch, within = divmod(step, spe)
      sched = self._partition_schedule(epoch)
      p, i = sched[within]
      part = self.partitions[p]
      perm = np.random.default_rng([self.seed, epoch, p]).permutation(len(part.triples))
      tr = part.triples[perm[i * B : (i + 1) * B]]
      rng = np.random.default_rng([self.seed, epoch, within, 1])
      yield self.partition_batch(p, tr, rng)
      step += 1

  def _slot_batches(self) -> list[list[tuple[int, int]]]:
    """Per slot g of a partition-parallel step: the (partition, batch index) pairs of its
    partitions p (p % G == g), in partition order."""
    G, B = self.parallel, self.batch_size
    slots: list[list[tuple[int, int]]] = [[] for _ in range(G)]
    for p, part in enumerate(self.partitions):
      slots[p % G] += [(p, i) for i in range(-(-len(part.triples) // B))]
    return slots

  def parallel_schedule(self, epoch: int) -> list[list[tuple[int, int] | None]]:
    """Per step of an epoch, per slot: (partition, batch index), or None where the slot has
    run out of batches (a slot with fewer edges idles: an all-padding batch of weight 0).
    Each slot's batches in a random order of its own."""
    slots = self._slot_batches()
    steps = max(len(s) for s in slots)
    out = []
    for g, sl in enumerate(slots):
      perm = np.random.default_rng([self.seed, epoch, 2, g]).permutation(len(sl))
      out.append([sl[i] for i in perm] + [None] * (steps - len(sl)))
    return [list(x) for x in zip(*out)]

  def parallel_batch(self, epoch: int, within: int) -> base.Batch:
    """Step `within` of `epoch`: G partition batches (each padded to the largest partition)
    stacked on a leading axis; ids concatenated: int32[G * max_nodes, 1]."""
    B = self.batch_size
    sched = self.parallel_schedule(epoch)[within]
    batches = []
    for g, item in enumerate(sched):
      rng = np.random.default_rng([self.seed, epoch, within, 1, g])
      if item is None:  # idle slot: its first partition, no edges
        p = g
        tr = self.partitions[p].triples[:0]
      else:
        p, i = item
        part = self.partitions[p]
        perm = np.random.default_rng([self.seed, epoch, p]).permutation(len(part.triples))
        tr = part.triples[perm[i * B : (i + 1) * B]]
      batches.append(self.partition_batch(p, tr, rng, pad="max"))
    out = {k: np.stack([b[k] for b in batches]) for k in batches[0] if k != "ids"}
    out["ids"] = {TABLE: np.concatenate([b["ids"][TABLE] for b in batches])}
    return out

  def _parallel_batches(self, start_step: int):
    spe = self.steps_per_epoch()
    step = start_step
    while True:
      epoch, within = divmod(step, spe)
      yield self.parallel_batch(epoch, within)
      step += 1

  # --------------------------------------------------------------------------- eval data

  def _eval_batches_list(self, split: str) -> list[base.Batch]:
    if split in self._eval_cache:
      return self._eval_cache[split]
    q = kg_lib.queries(self.kg, split)
    B, N = self.eval_batch_size, self.kg.num_entities
    batches = []
    # One side per batch: a model without reciprocal relations scores head queries with its
    # head-side scorer.
    for side in (0, 1):
      idx = np.flatnonzero(q["side"] == side)
      for s in range(0, len(idx), B):
        sel = idx[s : s + B]
        filt = self.filter.lookup(q["anchor"][sel], q["rel"][sel])
        fq, fe = [], []
        for i, (f, y) in enumerate(zip(filt, q["target"][sel])):
          f = f[f != y]
          fq.append(np.full(f.size, i, np.int32))
          fe.append(f)
        batches.append(
          {
            "anchor": self._pad(q["anchor"][sel], B),
            "rel": self._pad(q["rel"][sel], B),
            "target": self._pad(q["target"][sel], B),
            "side": self._pad(q["side"][sel], B),
            "weight": self._pad(np.ones(len(sel), np.float32), B),
            "filt_q": np.concatenate(fq),
            "filt_e": np.concatenate(fe),
          }
        )
    # One static filter capacity per split (the largest batch's), padded with row B.
    cap = max(len(b["filt_q"]) for b in batches)
    cap = -(-cap // 4096) * 4096
    all_rows = np.arange(N, dtype=np.int32)[:, None]
    if self.parallel:  # rows split over the devices: pad to a multiple of their count
      all_rows = self._pad(all_rows, -(-N // self.devices) * self.devices, fill=-1)
    for b in batches:
      b["filt_q"] = self._pad(b["filt_q"], cap, fill=B)
      b["filt_e"] = self._pad(b["filt_e"], cap, fill=0)
      b["ids"] = {TABLE: all_rows}
      if self.encoder is not None:
        b.update(
          self._graph_leaves(self.graph["edges"], self.graph["norm"], len(self.graph["edges"]))
        )
    self._eval_cache[split] = batches
    return batches

  def eval_batches(self, split: str):
    return iter(self._eval_batches_list(split))

  def example_batch(self) -> base.Batch:
    # The encoder's params do not depend on the graph's size; any train batch has every leaf.
    return next(self.train_batches(0))

  def num_examples(self, batch) -> int:
    """Train: the batch's edges (triples); eval: its queries."""
    if "anchor" in batch:
      return len(batch["weight"])
    if "cnt" in batch:
      return int(batch["cnt"].sum())
    return int(np.sum(batch["weight"] > 0))

  # --------------------------------------------------------------------------- model

  def _encode(self, params, batch, rows, train: bool, key=None):
    if self.encoder is None:
      return rows
    graph = {"src": batch["src"], "dst": batch["dst"], "rel": batch["erel"], "norm": batch["enorm"]}
    rngs = {"dropout": key} if train else {}
    return self.encoder.apply({"params": params["encoder"]}, rows, graph, train, rngs=rngs)

  def _rel(self, params, rel):
    return self.relations.apply({"params": params["relations"]}, rel)

  @staticmethod
  def _stacked(batch) -> bool:
    """A partition-parallel train batch: every leaf has a leading axis of partitions."""
    return "h" in batch and np.ndim(batch["h"]) == 2

  def init_params(self, key, batch, embeddings):
    if self._stacked(batch):  # the params do not depend on the graph: init on slot 0
      rows = embeddings[TABLE][: embeddings[TABLE].shape[0] // batch["h"].shape[0]]
      return self.init_params(key, jax.tree.map(lambda x: x[0], batch), {TABLE: rows})
    k1, k2 = jax.random.split(key)
    rel = jnp.asarray(batch["rel"])
    params = {"relations": self.relations.init(k1, rel)["params"]}
    if self.encoder is not None:
      graph = {
        "src": batch["src"],
        "dst": batch["dst"],
        "rel": batch["erel"],
        "norm": batch["enorm"],
      }
      params["encoder"] = self.encoder.init(k2, embeddings[TABLE], graph, False)["params"]
    return params

  def _gamma_p(self):
    m = self.config.model
    return float(m.get("gamma", 0.0)), int(m.get("p", 1))

  def loss(self, params, batch, embeddings, key):
    if self._stacked(batch):
      return self._parallel_loss(params, batch, embeddings[TABLE], key)
    k_enc, k_drop = jax.random.split(key)
    rows = self._encode(params, batch, embeddings[TABLE], True, k_enc)
    if "cnt" in batch:
      return self._grouped_loss(params, batch, rows, k_drop)
    h = jnp.take(rows, batch["h"], axis=0)
    t = jnp.take(rows, batch["t"], axis=0)
    r = self._rel(params, batch["rel"])
    rate = float(self.config.model.get("dropout", 0.0))
    hd = h
    if rate > 0:
      keep = jax.random.bernoulli(k_drop, 1 - rate, h.shape)
      hd = jnp.where(keep, h / (1 - rate), 0.0)
    gamma, p = self._gamma_p()
    if self.scoring == "1vsall":
      scores = kge.score_all(self.decoder, hd, r, rows, "tail", gamma, p)  # [B, M]
      if "cand_mask" in batch:
        scores = jnp.where(batch["cand_mask"][None] > 0, scores, -1e30)
      ce = optax.softmax_cross_entropy_with_integer_labels(scores, batch["t"])
    else:
      neg = jnp.take(rows, batch["neg"], axis=0)  # [B, K, D], or [K, D] shared
      pos = kge.score(self.decoder, hd, r, t, gamma, p)
      if batch["neg"].ndim == 1:
        negs = kge.score_all(self.decoder, hd, r, neg, "tail", gamma, p)
      else:
        negs = kge.score(self.decoder, hd[:, None], r[:, None], neg, gamma, p)
      logits = jnp.concatenate([pos[:, None], negs], 1)
      ce = -jax.nn.log_softmax(logits, axis=-1)[:, 0]
    w = batch["weight"]
    denom = jnp.maximum(w.sum(), 1.0)
    loss = jnp.sum(ce * w) / denom
    aux = {"ce": loss}
    lam = float(self.config.model.get("reg_weight", 0.0))
    if self.regularizer != "none" and lam > 0:
      wv = w[:, None]
      if self.regularizer == "n3":
        pairs = self.decoder in ("complex", "rotate")
        reg = kge.n3(h * wv, r * wv, t * wv, complex_pairs=pairs) / denom
      else:
        reg = (jnp.sum((h * wv) ** 2) + jnp.sum((r * wv) ** 2) + jnp.sum((t * wv) ** 2)) / denom
      loss = loss + lam * reg
      aux["reg"] = reg
    return loss, aux

  def _parallel_loss(self, params, batch, rows, key):
    """G partition batches at once, combined as the edge-weighted mean over all G batches:
    sum_g (W_g / W) loss_g with W_g its edges (a task loss divides by max(W_g, 1), undone
    here), which is the loss of the G batches' edges taken together. In shard_map over the
    mesh: each device runs the ordinary one-partition loss on its G / devices partitions
    (a vmap over the partition axis instead costs 1.6x on this CPU: XLA's batched gathers
    and scatters), and the sums meet outside (the gradient of the replicated params is then
    summed over the devices by shard_map's transpose). Partition g's dropout key:
    fold_in(key, g)."""
    G = batch["h"].shape[0]
    rows = rows.reshape(G, rows.shape[0] // G, rows.shape[1])
    keys = jax.vmap(lambda g: jax.random.fold_in(key, g))(jnp.arange(G))
    split = sharding.P(sharding.BATCH)

    @functools.partial(
      jax.shard_map,
      mesh=self.mesh,
      in_specs=(sharding.REPLICATED, split, split, split),
      out_specs=split,
      check_vma=False,  # no collective inside; replicated params' cotangents psummed
    )
    def local(params, batch, rows, keys):
      out = []
      for j in range(rows.shape[0]):
        b = jax.tree.map(lambda x, j=j: x[j], batch)
        loss, aux = self.loss(params, b, {TABLE: rows[j]}, keys[j])
        w = jnp.sum(b["weight"])
        c = jnp.maximum(w, 1.0)
        out.append((loss * c, jax.tree.map(lambda a, c=c: a * c, aux), w))
      return jax.tree.map(lambda *x: jnp.stack(x), *out)

    loss, aux, w = local(params, batch, rows, keys)
    total = jnp.maximum(jnp.sum(w), 1.0)
    return jnp.sum(loss) / total, jax.tree.map(lambda a: jnp.sum(a) / total, aux)

  def _dropout(self, x, key):
    rate = float(self.config.model.get("dropout", 0.0))
    if rate <= 0:
      return x
    keep = jax.random.bernoulli(key, 1 - rate, x.shape)
    return jnp.where(keep, x / (1 - rate), 0.0)

  def _grouped_loss(self, params, batch, rows, key):
    """Sum over the batch's triples of CE_t = logsumexp(scores) - score_t, / #triples."""
    h = jnp.take(rows, batch["h"], axis=0)
    r = self._rel(params, batch["rel"])
    gamma, p = self._gamma_p()
    scores = kge.score_all(self.decoder, self._dropout(h, key), r, rows, "tail", gamma, p)
    cnt = batch["cnt"]
    lse = jax.nn.logsumexp(scores, axis=1)
    valid = batch["lab_q"] < scores.shape[0]
    pos = scores.at[batch["lab_q"], batch["lab_e"]].get(mode="fill", fill_value=0.0)
    total = jnp.maximum(cnt.sum(), 1.0)
    loss = (jnp.sum(cnt * lse) - jnp.sum(jnp.where(valid, pos, 0.0))) / total
    aux = {"ce": loss}
    lam = float(self.config.model.get("reg_weight", 0.0))
    if self.regularizer != "none" and lam > 0:
      # Each triple's h, r and t count once: h and r weighted by the answers per query, every
      # entity row by how often it is an answer in the batch (t_cnt). Gathering the label_cap
      # answer rows instead cost 2/3 of the step (its gradient a [label_cap, D] scatter-add).
      c = cnt[:, None]
      tc = batch["t_cnt"][:, None]
      if self.regularizer == "n3":
        pairs = self.decoder in ("complex", "rotate")
        third = 1 / 3  # |c^(1/3) x|^3 = c |x|^3, complex moduli too
        reg = kge.n3(h * c**third, r * c**third, rows * tc**third, complex_pairs=pairs) / total
      else:
        reg = (jnp.sum(c * h**2) + jnp.sum(c * r**2) + jnp.sum(tc * rows**2)) / total
      loss = loss + lam * reg
      aux["reg"] = reg
    return loss, aux

  def predict(self, params, batch, embeddings):
    rows = embeddings[TABLE]
    if self.parallel:
      # Rows come split over the devices (ids are batch-major in these runs): gather them
      # once (N x D floats) so that the whole-graph encoder runs on replicated rows rather
      # than XLA partitioning its gathers. The padding rows are no candidates.
      rows = sharding.replicate(rows, self.mesh)
    rows = self._encode(params, batch, rows, False)[: self.kg.num_entities]
    q = jnp.take(rows, batch["anchor"], axis=0)
    gamma, p = self._gamma_p()
    if self.kg.reciprocal:
      scores = kge.score_all(
        self.decoder, q, self._rel(params, batch["rel"]), rows, "tail", gamma, p
      )
    else:
      R = self.kg.num_base_relations
      base_rel = jnp.where(batch["side"] == 1, batch["rel"] - R, batch["rel"])
      r = self._rel(params, base_rel)
      tail = kge.score_all(self.decoder, q, r, rows, "tail", gamma, p)
      head = kge.score_all(self.decoder, q, r, rows, "head", gamma, p)
      scores = jnp.where(batch["side"][:, None] == 1, head, tail)
    B = scores.shape[0]
    target = jnp.take_along_axis(scores, batch["target"][:, None], axis=1)
    scores = scores.at[batch["filt_q"], batch["filt_e"]].set(-jnp.inf, mode="drop")
    higher = jnp.sum(scores > target, axis=1).astype(jnp.float32)
    tied = jnp.sum(scores == target, axis=1).astype(jnp.float32) - 1.0
    del B
    return {"rank": 1.0 + higher + tied / 2, "side": batch["side"], "weight": batch["weight"]}

  def metrics(self, outputs):
    rank = np.concatenate([np.asarray(o["rank"]) for o in outputs])
    side = np.concatenate([np.asarray(o["side"]) for o in outputs])
    w = np.concatenate([np.asarray(o["weight"]) for o in outputs])
    keep = w > 0
    return rank_metrics(rank[keep], side[keep])


TASK = LinkPrediction
