"""The link-prediction task's batches (host side): the four train batch modes (edges of the
whole graph; grouped 1vsall queries; one partition per step; G partitions per step, stacked)
and the eval batches with their filters. Layouts in the package docstring."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from recgnn import sharding
from recgnn.data import kg as kg_lib
from recgnn.tasks.link_prediction.options import TABLE, check_choice
from recgnn.train.task import Batch


class Batches:
  """Mixin of `LinkPrediction` (task.py): batch construction over the state its __init__ sets
  (kg, train_triples, filter, graph, partitions, parallel, scoring, negatives, seed)."""

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

  def _grouped_batch(self, sel: np.ndarray) -> Batch:
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

  # Leaves with one row per query / edge of the batch: split over the devices. The rest (label
  # and filter pairs, answer counts per entity, candidate masks, graph edges) index the whole
  # batch or every row, so every device gets them whole.
  BATCH_MAJOR = frozenset(("h", "rel", "t", "weight", "cnt", "neg", "anchor", "target", "side"))

  def batch_spec(self, batch: Batch):
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

  def train_batches(self, start_step: int = 0) -> Iterator[Batch]:
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
    check_choice("partition.pad", pad, ("none", "max"))
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

  def parallel_batch(self, epoch: int, within: int) -> Batch:
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

  def _eval_batches_list(self, split: str) -> list[Batch]:
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

  def example_batch(self) -> Batch:
    # The encoder's params do not depend on the graph's size; any train batch has every leaf.
    return next(self.train_batches(0))

  def num_examples(self, batch) -> int:
    """Train: the batch's edges (triples); eval: its queries."""
    if "anchor" in batch:
      return len(batch["weight"])
    if "cnt" in batch:
      return int(batch["cnt"].sum())
    return int(np.sum(batch["weight"] > 0))
