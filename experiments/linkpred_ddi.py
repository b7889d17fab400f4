"""GraphSAGE link prediction on ogbl-ddi as OGB's examples/linkproppred/ddi/gnn.py: learned
node embeddings (no features), 2-layer SAGE, hidden 256, dropout 0.5, MLP on the Hadamard
product, one uniform negative per positive, batch 64k, lr 0.005, Hits@20 against the split's
negatives. Needs the unpacked dataset (its split .pt files converted to .npz: docs/linkpred.md):

  python run.py --experiment=linkpred_ddi --config.data.path=/data/ogbl_ddi
"""

from experiments import _options, linkpred_cora


def get_config(arg=None):
  _options.parse(arg, {}, name="linkpred_ddi")  # no options: an ARG would be ignored
  c = linkpred_cora.get_config()
  c.data.source = "ogbl"
  c.data.path = ""  # required: --config.data.path=<unpacked ogbl_ddi folder>
  c.data.split = ""
  c.model.inputs = "embeddings"
  c.model.hidden = 256
  c.model.out = 256
  c.model.decoder = "mlp"
  c.model.dropout = 0.5
  c.embeddings.dim = 256
  c.embeddings.optimizer = {"name": "rowwise_adagrad", "learning_rate": 0.05}  # (no table Adam)
  c.optimizer.learning_rate = 0.005
  c.sampler.fanouts = (25, 10)
  c.sampler.eval_fanouts = (25, 10)
  c.sampler.capacities = "auto"
  c.sampler.batch_size = 64 * 1024
  c.sampler.eval_batch_size = 64 * 1024
  c.sampler.bulk = 1
  c.eval.hits = (10, 20, 30)
  c.train.steps = 2000
  c.train.eval_every = 500
  return c
