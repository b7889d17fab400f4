"""The link-prediction task's batches (host side): the four train batch modes (edges of the
whole graph; grouped 1vsall queries; one partition per step; G partitions per step, stacked)
and the eval batches with their filters, made by `BatchMaker` from the options and the data
it is handed (it reads no task). Layouts in the package docstring."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from recgnn import sharding
from recgnn.data import kg as kg_lib
from recgnn.tasks.link_prediction.data import KGData
from recgnn.tasks.link_prediction.options import TABLE, LinkPredictionOptions, check_choice
from recgnn.train.task import Batch


def pad_rows(x: np.ndarray, n: int, fill=0) -> np.ndarray:
  """x padded with `fill` to n rows along axis 0."""
  out = np.full((n, *x.shape[1:]), fill, x.dtype)
  out[: len(x)] = x
  return out


def graph_leaves(edges: np.ndarray, norm: np.ndarray, cap: int) -> dict[str, np.ndarray]:
  """A message graph's src / dst / erel (int32[cap]) and enorm (f32[cap]), zero-padded."""
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


class BatchMaker:
  """The task's train and eval batches (host side, numpy), deterministic given the options'
  seed and the step, from the options and the data alone. Holds one cache: each eval split's
  batches, built on first use."""

  def __init__(self, options: LinkPredictionOptions, data: KGData):
    self.options = options
    self.data = data
    # Static label capacity of grouped batches: the B largest answer sets together (any
    # batch fits).
    self.label_cap = (
      int(np.sort(data.queries.count)[::-1][: options.batch_size].sum()) if options.grouped else 0
    )
    self._eval_cache: dict[str, list[Batch]] = {}

  def _grouped_batch(self, sel: np.ndarray) -> Batch:
    B, q = self.options.batch_size, self.data.queries
    cnt = q.count[sel]
    lab_q = np.repeat(np.arange(len(sel), dtype=np.int32), cnt)
    lab_e = np.concatenate([q.answers[s : s + c] for s, c in zip(q.start[sel], cnt)])
    return {
      "h": pad_rows(q.anchor[sel], B),
      "rel": pad_rows(q.rel[sel], B),
      "cnt": pad_rows(cnt.astype(np.float32), B),
      "weight": pad_rows(np.ones(len(sel), np.float32), B),
      "lab_q": pad_rows(lab_q, self.label_cap, fill=B),
      "lab_e": pad_rows(lab_e, self.label_cap, fill=0),
      # Answers per entity: the regularizer's tail term reads every row once, weighted,
      # instead of gathering (and scatter-adding the gradient of) label_cap rows.
      "t_cnt": np.bincount(lab_e, minlength=self.data.kg.num_entities).astype(np.float32),
      "ids": {TABLE: np.arange(self.data.kg.num_entities, dtype=np.int32)[:, None]},
    }

  def _negatives(self, rng, rel: np.ndarray, pool_size: int | None = None) -> np.ndarray:
    """int32[B, K] negative entities (or rows of a partition's core)."""
    B, K = rel.shape[0], self.options.num_neg
    if self.options.neg_kind == "type":
      types = self.data.types
      lo = types.offsets[rel]
      cnt = types.offsets[rel + 1] - lo
      u = rng.random((B, K))
      return types.tails[lo[:, None] + (u * cnt[:, None]).astype(np.int64)]
    n = pool_size if pool_size is not None else self.data.kg.num_entities
    return rng.integers(0, n, (B, K), dtype=np.int32)

  # Leaves with one row per query / edge of the batch: split over the devices. The rest (label
  # and filter pairs, answer counts per entity, candidate masks, graph edges) index the whole
  # batch or every row, so every device gets them whole.
  BATCH_MAJOR = frozenset(("h", "rel", "t", "weight", "cnt", "neg", "anchor", "target", "side"))

  def splits_whole(self, batch: Batch) -> bool:
    """Whether every leaf of `batch` is split over the devices (the contract's default spec
    under shard_batch): batch-major rows, or a partition-parallel train batch."""
    o = self.options
    return o.shard_batch and not (o.parallel and "anchor" in batch)

  def leaf_specs(self, batch: Batch) -> dict:
    """A spec per leaf where the batch mixes split and whole leaves (`BATCH_MAJOR`); a
    shared `neg` (int32[K], one set for the batch) is whole."""
    shared_neg = "neg" in batch and np.ndim(batch["neg"]) == 1
    return {
      k: sharding.BATCH_SPEC
      if k in self.BATCH_MAJOR and not (k == "neg" and shared_neg)
      else sharding.REPLICATED
      for k in batch
    }

  def steps_per_epoch(self) -> int:
    o, d = self.options, self.data
    if o.grouped:
      return -(-len(d.queries.anchor) // o.batch_size)
    if o.parallel:
      return max(len(s) for s in self.slot_batches())
    if d.partitions:
      return sum(
        -(-len(d.partitions[p].triples) // o.batch_size) for p in self._trained_partitions()
      )
    return -(-len(d.train_triples) // o.batch_size)

  def _whole_graph(self) -> dict[str, np.ndarray]:
    g = self.data.graph
    return graph_leaves(g["edges"], g["norm"], len(g["edges"]))

  def _edge_batch(self, rng, triples: np.ndarray, rows_pool: int | None):
    """h / rel / t / weight (+ neg) of B triples whose h, t already index the step's rows."""
    o = self.options
    B = o.batch_size
    n = len(triples)
    batch = {
      "h": pad_rows(triples[:, 0], B),
      "rel": pad_rows(triples[:, 1], B),
      "t": pad_rows(triples[:, 2], B),
      "weight": pad_rows(np.ones(n, np.float32), B),
    }
    if o.scoring == "sampled" and o.shared_neg:
      n = rows_pool if rows_pool is not None else self.data.kg.num_entities
      batch["neg"] = rng.integers(0, n, o.num_neg, dtype=np.int32)
    elif o.scoring == "sampled":
      batch["neg"] = self._negatives(rng, batch["rel"], rows_pool)
    return batch

  def train_batches(self, start_step: int = 0) -> Iterator[Batch]:
    o, d = self.options, self.data
    if o.parallel:
      yield from self._parallel_batches(start_step)
      return
    if d.partitions:
      yield from self._partition_batches(start_step)
      return
    spe, B, N = self.steps_per_epoch(), o.batch_size, d.kg.num_entities
    all_rows = np.arange(N, dtype=np.int32)[:, None]
    step = start_step
    while True:
      epoch, within = divmod(step, spe)
      if o.grouped:
        perm = np.random.default_rng([o.seed, epoch]).permutation(len(d.queries.anchor))
        yield self._grouped_batch(perm[within * B : (within + 1) * B])
        step += 1
        continue
      perm = np.random.default_rng([o.seed, epoch]).permutation(len(d.train_triples))
      tr = d.train_triples[perm[within * B : (within + 1) * B]]
      rng = np.random.default_rng([o.seed, epoch, within, 1])
      batch = self._edge_batch(rng, tr, None)
      if o.encoder != "none" or o.scoring == "1vsall":
        batch["ids"] = {TABLE: all_rows}  # rows are entity ids
        if o.encoder != "none":
          batch.update(self._whole_graph())
      else:
        # Rows per edge: [h, t, neg...]; h / t / neg become row indices.
        K = o.num_neg
        ents = np.concatenate([batch["h"][:, None], batch["t"][:, None], batch["neg"]], 1)
        ents[batch["weight"] == 0] = -1
        batch["ids"] = {TABLE: ents.reshape(-1, 1).astype(np.int32)}
        base_row = np.arange(B, dtype=np.int32) * (2 + K)
        batch["h"], batch["t"] = base_row, base_row + 1
        batch["neg"] = base_row[:, None] + 2 + np.arange(K, dtype=np.int32)[None]
      yield batch
      step += 1

  def _trained_partitions(self) -> list[int]:
    only, parts = self.options.partition_only, self.data.partitions
    if only >= len(parts):
      raise ValueError(
        f"partition.only={only}, but there are {len(parts)} partitions (0..."
        f"{len(parts) - 1}; -1 = all)"
      )
    return [only] if only >= 0 else list(range(len(parts)))

  def partition_schedule(self, epoch: int) -> list[tuple[int, int]]:
    """(partition, batch index) of every step of an epoch, interleaved at random."""
    order = [
      (p, i)
      for p in self._trained_partitions()
      for i in range(-(-len(self.data.partitions[p].triples) // self.options.batch_size))
    ]
    perm = np.random.default_rng([self.options.seed, epoch, 2]).permutation(len(order))
    return [order[i] for i in perm]

  def partition_batch(self, p: int, triples: np.ndarray, rng, pad: str | None = None):
    """One training batch of partition p: its core + halo rows and its subgraph only.
    pad: none | max (partition.pad by default)."""
    o, d = self.options, self.data
    part = d.partitions[p]
    batch = self._edge_batch(rng, triples, part.num_core)
    pad = pad or o.partition_pad
    check_choice("partition.pad", pad, ("none", "max"))
    rows = d.max_nodes if pad == "max" else len(part.nodes)
    nodes = np.full(rows, -1, np.int32)
    nodes[: len(part.nodes)] = part.nodes
    batch["ids"] = {TABLE: nodes[:, None]}
    norm = d.graph["norm"][part.edge_index]
    cap = d.max_edges if pad == "max" else len(part.edges)
    batch.update(graph_leaves(part.edges, norm, cap))
    if o.scoring == "1vsall":
      # Candidates: every row of the partition (core + halo: the halo rows' encodings are
      # partial, but they are the partition's own), or its core only.
      n = part.num_core if o.partition_candidates == "core" else len(part.nodes)
      batch["cand_mask"] = (np.arange(rows) < n).astype(np.float32)
    return batch

  def _partition_batches(self, start_step: int):
    o = self.options
    spe, B = self.steps_per_epoch(), o.batch_size
    step = start_step
    while True:
      epoch, within = divmod(step, spe)
      sched = self.partition_schedule(epoch)
      p, i = sched[within]
      part = self.data.partitions[p]
      perm = np.random.default_rng([o.seed, epoch, p]).permutation(len(part.triples))
      tr = part.triples[perm[i * B : (i + 1) * B]]
      rng = np.random.default_rng([o.seed, epoch, within, 1])
      yield self.partition_batch(p, tr, rng)
      step += 1

  def slot_batches(self) -> list[list[tuple[int, int]]]:
    """Per slot g of a partition-parallel step: the (partition, batch index) pairs of its
    partitions p (p % G == g), in partition order."""
    G, B = self.options.parallel, self.options.batch_size
    slots: list[list[tuple[int, int]]] = [[] for _ in range(G)]
    for p, part in enumerate(self.data.partitions):
      slots[p % G] += [(p, i) for i in range(-(-len(part.triples) // B))]
    return slots

  def parallel_schedule(self, epoch: int) -> list[list[tuple[int, int] | None]]:
    """Per step of an epoch, per slot: (partition, batch index), or None where the slot has
    run out of batches (a slot with fewer edges idles: an all-padding batch of weight 0).
    Each slot's batches in a random order of its own."""
    slots = self.slot_batches()
    steps = max(len(s) for s in slots)
    out = []
    for g, sl in enumerate(slots):
      perm = np.random.default_rng([self.options.seed, epoch, 2, g]).permutation(len(sl))
      out.append([sl[i] for i in perm] + [None] * (steps - len(sl)))
    return [list(x) for x in zip(*out)]

  def parallel_batch(self, epoch: int, within: int) -> Batch:
    """Step `within` of `epoch`: G partition batches (each padded to the largest partition)
    stacked on a leading axis; ids concatenated: int32[G * max_nodes, 1]."""
    o, parts = self.options, self.data.partitions
    B = o.batch_size
    sched = self.parallel_schedule(epoch)[within]
    batches = []
    for g, item in enumerate(sched):
      rng = np.random.default_rng([o.seed, epoch, within, 1, g])
      if item is None:  # idle slot: its first partition, no edges
        p = g
        tr = parts[p].triples[:0]
      else:
        p, i = item
        part = parts[p]
        perm = np.random.default_rng([o.seed, epoch, p]).permutation(len(part.triples))
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

  def eval_batches(self, split: str) -> list[Batch]:
    """The batches of `split` (built once, then cached): B queries of one side each."""
    if split in self._eval_cache:
      return self._eval_cache[split]
    o, d = self.options, self.data
    q = kg_lib.queries(d.kg, split)
    B, N = o.eval_batch_size, d.kg.num_entities
    batches = []
    # One side per batch: a model without reciprocal relations scores head queries with its
    # head-side scorer.
    for side in (0, 1):
      idx = np.flatnonzero(q["side"] == side)
      for s in range(0, len(idx), B):
        sel = idx[s : s + B]
        filt = d.filter.lookup(q["anchor"][sel], q["rel"][sel])
        fq, fe = [], []
        for i, (f, y) in enumerate(zip(filt, q["target"][sel])):
          f = f[f != y]
          fq.append(np.full(f.size, i, np.int32))
          fe.append(f)
        batches.append(
          {
            "anchor": pad_rows(q["anchor"][sel], B),
            "rel": pad_rows(q["rel"][sel], B),
            "target": pad_rows(q["target"][sel], B),
            "side": pad_rows(q["side"][sel], B),
            "weight": pad_rows(np.ones(len(sel), np.float32), B),
            "filt_q": np.concatenate(fq),
            "filt_e": np.concatenate(fe),
          }
        )
    # One static filter capacity per split (the largest batch's), padded with row B.
    cap = max(len(b["filt_q"]) for b in batches)
    cap = -(-cap // 4096) * 4096
    all_rows = np.arange(N, dtype=np.int32)[:, None]
    if o.parallel:  # rows split over the devices: pad to a multiple of their count
      all_rows = pad_rows(all_rows, -(-N // o.devices) * o.devices, fill=-1)
    for b in batches:
      b["filt_q"] = pad_rows(b["filt_q"], cap, fill=B)
      b["filt_e"] = pad_rows(b["filt_e"], cap, fill=0)
      b["ids"] = {TABLE: all_rows}
      if o.encoder != "none":
        b.update(self._whole_graph())
    self._eval_cache[split] = batches
    return batches


def num_examples(batch: Batch) -> int:
  """Train: the batch's edges (triples); eval: its queries."""
  if "anchor" in batch:
    return len(batch["weight"])
  if "cnt" in batch:
    return int(batch["cnt"].sum())
  return int(np.sum(batch["weight"] > 0))
