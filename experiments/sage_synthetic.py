"""GraphSAGE on a 1M-node power-law graph with planted communities; node embeddings only."""

import ml_collections

from experiments import _options, sage_cora


def get_config(arg=None):
  _options.parse(arg, {}, name="sage_synthetic")  # no options: an ARG would be ignored
  c = sage_cora.get_config()
  c.data.source = "synthetic"
  c.data.synthetic = ml_collections.ConfigDict(
    {
      "num_nodes": 1_000_000,
      "num_edges": 10_000_000,
      "num_classes": 10,
      "homophily": 0.8,
      "power_law_exponent": 2.5,
      "max_weight_ratio": 1000.0,
      "num_features": 0,
      "feature_noise": 1.0,
      "split": (0.1, 0.01, 0.05),
      "seed": 0,
    }
  )
  c.model.inputs = "embeddings"
  c.model.hidden = 64
  c.model.dropout = 0.0

  c.sampler.fanouts = (10, 5)
  c.sampler.batch_size = 1024
  c.sampler.bulk = 16
  c.sampler.capacities = "auto"
  c.sampler.eval_capacities = "auto"
  c.sampler.eval_fanouts = (10, 5)
  c.sampler.eval_batch_size = 2048

  # The node table: 1M x 32, row-wise Adagrad (sparse; only the rows a batch touched).
  c.embeddings.dim = 32
  c.embeddings.initializer = "normal"
  c.embeddings.optimizer = ml_collections.ConfigDict(
    {"name": "rowwise_adagrad", "learning_rate": 0.1}
  )
  c.embeddings.plan = ((".*", "dense"),)

  c.optimizer = ml_collections.ConfigDict(
    {"name": "adam", "learning_rate": 0.005, "weight_decay": 0.0, "warmup_steps": 0}
  )
  c.train.steps = 300
  c.train.log_every = 50
  c.train.eval_every = 0
  c.train.checkpoint_every = 0
  return c
