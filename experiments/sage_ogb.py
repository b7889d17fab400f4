"""GraphSAGE on an OGB node-property dataset read from --config.data.path (e.g. ogbn-arxiv)."""

from experiments import _options, sage_cora


def get_config(arg=None):
  """arg: optional split scheme folder under split/ (e.g. time); by default the only one."""
  c = sage_cora.get_config()
  c.data.source = "ogb"
  c.data.path = ""  # required: the folder an OGB download unpacks to (holding raw/ and split/)
  c.data.split = _options.parse(arg, {"split": ""}, name="sage_ogb", positional=("split",))["split"]
  # OGB's GraphSAGE baseline for arxiv: 3 layers, hidden 256, dropout 0.5, features.
  c.model.inputs = "features"
  c.model.hidden = 256
  c.model.dropout = 0.5
  c.sampler.fanouts = (15, 10, 5)
  c.sampler.batch_size = 1024
  c.sampler.bulk = 16
  c.sampler.capacities = "auto"
  c.sampler.eval_capacities = "auto"
  c.sampler.eval_fanouts = (15, 10, 5)
  c.sampler.eval_batch_size = 4096
  c.optimizer.learning_rate = 0.003
  c.optimizer.weight_decay = 0.0
  c.train.steps = 5000
  c.train.log_every = 100
  c.train.eval_every = 1000
  c.train.checkpoint_every = 1000
  return c
