"""rgcn_fb15k237 trained on self-sufficient METIS partitions, negatives from the partition."""

from experiments import rgcn_fb15k237


def get_config(arg=None):
  """arg: the number of partitions (default 4)."""
  c = rgcn_fb15k237.get_config()
  c.partition.num_parts = int(arg or 4)
  c.partition.method = "metis"  # metis (pymetis) | random
  c.partition.only = -1
  c.negatives.kind = "partition"
  return c
