"""GraphSAGE link prediction on a feature-less graph (ogbl-ddi's setting): learned node
embeddings alone, the node table dense or as TT cores (TT-Rec / Nimble), side by side.

  python run.py --experiment=linkpred_featureless               # dense node table
  python run.py --experiment=linkpred_featureless:table=tt,rank=8
"""

from experiments import _options, linkpred_planted


def get_config(arg=None):
  o = _options.parse(
    arg, {"table": "dense", "rank": 8}, {"table": ("dense", "tt")}, name="linkpred_featureless"
  )
  c = linkpred_planted.get_config()
  c.data.synthetic = linkpred_planted.synthetic(10_000, 40_000, 0)
  c.model.inputs = "embeddings"
  c.model.decoder = "mlp"  # OGB's ddi example: an MLP on the Hadamard product
  c.embeddings.dim = 64
  c.embeddings.optimizer = {"name": "rowwise_adagrad", "learning_rate": 0.1}
  table = "dense" if o["table"] == "dense" else f"tt(rank={o['rank']})"
  c.embeddings.plan = ((".*", table),)
  return c
