"""Feature-less Cora: GraphSAGE on learnable node embeddings only (the bag-of-words features
ignored), the node table as TT cores over reordered node ids (Nimble, KDD'22), or full.

sage_cora's graph, split, sampler and model with model.inputs=embeddings; the argument after
':' takes sage_tt_synthetic's options (order, init, table, rank, cores):

  python run.py --experiment=sage_tt_cora                          # TT rank 8, partition order
  python run.py --experiment=sage_tt_cora:table=dense              # the full 2708 x 64 table
  python run.py --experiment=sage_tt_cora:order=random,init=eigen
"""

from __future__ import annotations

from experiments import sage_cora, sage_tt_synthetic


def get_config(arg=None):
  options = sage_tt_synthetic.parse_arg(arg, "sage_tt_cora")
  c = sage_cora.get_config()
  c.model.inputs = "embeddings"
  c.model.dropout = 0.5
  c.embeddings.dim = 64
  c.embeddings.optimizer = {"name": "rowwise_adagrad", "learning_rate": 0.1}
  c.data.cache_dir = "~/.cache/recgnn"
  sage_tt_synthetic.node_plan(c, options, "sage_tt_cora")
  c.train.steps = 300
  rep = sage_tt_synthetic.compression(2708, c.embeddings.dim, c.embeddings.plan)
  print(
    f"node table: {rep['floats']:,} floats vs {rep['full_floats']:,} full: "
    f"{rep['ratio']:,.1f}x smaller"
  )
  return c
