"""rgcn_fb15k237 trained on self-sufficient METIS partitions, negatives from the partition."""

from experiments import rgcn_fb15k237


def get_config(arg=None):
  """arg: the number of partitions (default 4)."""
  c = rgcn_fb15k237.get_config()
  c.partition.num_parts = int(arg or 4)
  c.partition.method = "metis"  # metis (pymetis) | random
  c.partition.only = -1
  # FB15k-237's hubs put ~all entities in every 1-hop halo (benchmarks/results/kg_rgcn.md);
  # unpadded, each partition's step costs its own edges (one compiled step per partition).
  c.partition.pad = "none"
  c.negatives.kind = "partition"
  return c
