"""R-GCN + DistMult on a synthetic KG with planted communities (recgnn.data.kg.planted):
a graph whose METIS partitions have small 1-hop halos, unlike FB15k-237's.

  --experiment=rgcn_planted              whole graph
  --experiment=rgcn_planted:8            8 self-sufficient METIS partitions, one per step
  --experiment=rgcn_planted:8,parallel   8 partitions per step, one per device of the mesh

The model and training settings are rgcn_fb15k237's; 8 communities, each a hypercube of
1,024 entities (8,192 in all), 16 relations (x -> x XOR mask), 0.2 % of facts across
communities; 58,981 training facts (+ reciprocals).
"""

import ml_collections

from experiments import rgcn_fb15k237, rgcn_fb15k237_partitioned


def get_config(arg=None):
  """arg: "" (whole graph), "P" or "P,parallel" (as rgcn_fb15k237_partitioned)."""
  rgcn_fb15k237_partitioned.parse_arg(arg, name="rgcn_planted")  # (refused here, not below)
  c = rgcn_fb15k237_partitioned.get_config(arg) if arg else rgcn_fb15k237.get_config()
  if not arg:
    c.mesh = ml_collections.ConfigDict({"data": 0, "model": 1})
  c.data.source = "planted"
  c.data.planted = ml_collections.ConfigDict(
    {
      "communities": 8,
      "bits": 10,
      "num_relations": 16,
      "valid": 0.05,
      "test": 0.05,
      "cross": 0.002,
      "seed": 0,
    }
  )
  c.train.epochs = 5
  c.train.steps = 0
  c.train.eval_every = 0
  return c
