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

from recgnn.tasks.link_prediction.losses import rank_metrics
from recgnn.tasks.link_prediction.options import TABLE, negative_options
from recgnn.tasks.link_prediction.task import TASK, LinkPrediction

__all__ = [
  "TABLE",
  "TASK",
  "LinkPrediction",
  "negative_options",
  "rank_metrics",
]
