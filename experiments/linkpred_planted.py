"""GraphSAGE link prediction on a synthetic power-law graph with planted links: edges drawn
within planted communities (a degree-corrected SBM, recgnn/graphs/synthetic.py), node
features = community centroid + noise; Hits@20 against the split's fixed negatives.

  python run.py --experiment=linkpred_planted
  (benchmarks/linkpred.py scores common neighbours and Adamic-Adar on the same split)
"""

import ml_collections

from experiments import _options, linkpred_cora


def synthetic(num_nodes: int, num_edges: int, num_features: int) -> ml_collections.ConfigDict:
  """The planted graph's recgnn.graphs.synthetic.SyntheticSpec fields."""
  return ml_collections.ConfigDict(
    {
      "num_nodes": num_nodes,
      "num_edges": num_edges,
      "num_classes": 300,  # planted communities: few random negative pairs fall inside one
      "homophily": 0.9,
      "power_law_exponent": 2.5,
      "max_weight_ratio": 100.0,
      "num_features": num_features,
      "feature_noise": 1.0,
      "split": (1.0, 0.0, 0.0),  # (node splits: unused by the link task)
      "seed": 0,
    }
  )


def get_config(arg=None):
  _options.parse(arg, {}, name="linkpred_planted")  # no options: an ARG would be ignored
  c = linkpred_cora.get_config()
  c.data.source = "synthetic"
  c.data.synthetic = synthetic(10_000, 40_000, 32)  # mean degree 4: few triangles
  c.data.cache_dir = ""
  c.model.hidden = 64
  c.model.out = 64
  c.sampler.fanouts = (10, 5)
  c.sampler.eval_fanouts = (10, 5)  # (power-law hubs: every neighbour would pad to the largest)
  c.sampler.capacities = "auto"
  c.sampler.batch_size = 1024
  c.sampler.eval_batch_size = 2048
  c.train.steps = 300
  return c
