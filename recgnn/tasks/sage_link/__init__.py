"""GraphSAGE link prediction on homogeneous graphs (drug interactions, collaboration,
citation, user-item graphs), on node features, learned node embeddings (table `node`,
through any backend of the plan: dense, tt, offload, hot_cold, sharded), or both.

Config (see experiments/linkpred_*.py):
  data.*              recgnn/data/link_loading.py: source ogbl (an OGB linkproppred folder,
                      its split .npz) or any node-graph source split at random (PyG's
                      RandomLinkSplit defaults: data.val 0.05, data.test 0.1, data.split_seed;
                      one fixed negative per held-out edge); data.features false drops features
  model.inputs        features | embeddings | both
  model.hidden, model.out (0 = hidden), model.dropout, model.dtype: the GraphSAGE encoder
  model.decoder       dot | mlp (MLP on the Hadamard product; model.mlp_layers)
  sampler.*           node classification's (recgnn/tasks/node_classification.py): kind node |
                      ladies, where host | device, fanouts, layer_sizes, bulk (mini-batches per
                      sparse product), capacities, eval_fanouts (-1 = all: exact full-graph
                      representations of the scored endpoints), eval_capacities;
                      batch_size = positive edges per step, eval_batch_size = pairs per eval
                      batch; exclude (default true): the batch's positive edges, both
                      directions, out of the batch's message passing; steps_per_call = k:
                      k host-sampled batches per call of the trainer's step, one transfer, a
                      scan over their k optimizer steps (the same result as k = 1);
                      data_parallel: each step's pairs in one part per device (batch_size a
                      multiple of the mesh's devices), each part's subgraph sampled on its
                      own (on the host) and trained on its device, every step's positives out
                      of every part's message passing
  negatives.kind      uniform (both endpoints uniform) | shared (negatives.num targets per
                      batch, paired with every positive's source) | degree (the positive's
                      source, a target ~ degree^0.75); negatives.num per positive (shared:
                      per batch)
  eval.hits           K of Hits@K (default 20, 50, 100) against the split's fixed negatives
  eval.mrr_negatives  K > 0: MRR of each positive among K seeded negative targets of its own
  eval.inference      sampled (eval_fanouts around each eval batch's endpoints) | full (one
                      batch per split: every node layer by layer over the whole message graph,
                      eval.chunk edges at a time, then every pair scored)
  embeddings.*, optimizer, train.*: as node classification

What a step sees: the split's train edges are its message graph (valid / test edges never;
the test evaluation's graph adds the valid edges under PyG's split, not OGB's), minus the
batch's own positives. Metrics: roc_auc, hits@K, mrr (recgnn/tasks/sage_link/scores.py).
"""

from recgnn.tasks.sage_link.task import TASK, SageLink

__all__ = ["TASK", "SageLink"]
