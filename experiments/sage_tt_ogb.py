"""Feature-less GraphSAGE on an OGB node-property dataset (--config.data.path, the raw OGB
layout): learnable node embeddings only, the node table as TT cores over reordered node ids
(Nimble, KDD'22), or full. sage_ogb's sampler and model with model.inputs=embeddings; the
argument after ':' takes sage_tt_synthetic's options (order, init, table, rank, cores):

  python run.py --experiment=sage_tt_ogb --config.data.path=/data/ogbn_arxiv
  python run.py --experiment=sage_tt_ogb:table=dense --config.data.path=/data/ogbn_arxiv
"""

from __future__ import annotations

from experiments import sage_ogb, sage_tt_synthetic


def get_config(arg=None):
  options = sage_tt_synthetic.parse_arg(arg, "sage_tt_ogb")
  c = sage_ogb.get_config()
  c.model.inputs = "embeddings"
  c.embeddings.dim = 64
  c.embeddings.optimizer = {"name": "rowwise_adagrad", "learning_rate": 0.1}
  c.data.cache_dir = "~/.cache/recgnn"
  sage_tt_synthetic.node_plan(c, options, "sage_tt_ogb")
  return c
