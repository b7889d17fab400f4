"""R-GCN encoder (basis decomposition) + DistMult decoder on FB15k-237, whole graph."""

from experiments import _options, kge_fb15k237


def get_config(arg=None):
  _options.parse(arg, {}, name="rgcn_fb15k237")  # no options: an ARG would be ignored
  c = kge_fb15k237.get_config("distmult")
  c.model.encoder = "rgcn"
  # One layer: the halo of a partition is then its 1-hop in-neighbourhood.
  c.model.rgcn.num_layers = 1
  c.model.rgcn.num_bases = 4
  c.model.rgcn.dropout = 0.0
  # The target edge is in the message-passing graph; dropping edges keeps the encoder from
  # learning to read the answer off it.
  c.model.rgcn.edge_dropout = 0.5
  c.model.regularizer = "n3"
  c.model.reg_weight = 5e-2
  c.embeddings.dim = 64
  # Edge mini-batches scored 1-vs-all against every encoded row (whole graph: all entities;
  # a partition: its core, so the negatives come from the partition). Sampled negatives
  # (train.scoring=sampled, negatives.num=1024, negatives.shared=True) learned ~5x slower per
  # epoch here: 1,024 shared negatives, batches of 16,384, 3 epochs: test MRR 0.031.
  c.train.scoring = "1vsall"
  c.train.group_queries = False  # (kge's grouping is for an entity table without encoder)
  # Every step pays for the whole-graph encoder, so an epoch costs (edges / batch) passes.
  c.batch_size = 4096
  c.train.epochs = 0
  c.train.steps = 133 * 10  # ~10 epochs of 544,230 edges (train + reciprocal)
  c.train.eval_every = 0
  c.train.log_every = 20
  c.eval.batch_size = 4096
  # Adagrad at lr 0.1 (right for embedding rows) blows up the encoder's dense weights.
  c.optimizer.name = "adam"
  c.optimizer.learning_rate = 1e-2
  return c
