"""rgcn_fb15k237 trained on self-sufficient METIS partitions, candidates from the partition.

--experiment=rgcn_fb15k237_partitioned:4            4 partitions, one per step (serial)
--experiment=rgcn_fb15k237_partitioned:4,parallel   4 partitions per step, one per device
    of the mesh (--config.mesh.data=4; on CPU simulate devices with
    XLA_FLAGS=--xla_force_host_platform_device_count=4): each device encodes and scores
    its own partition + halo, the dense gradients averaged over the devices
"""

import ml_collections

from experiments import _options, rgcn_fb15k237

DEFAULTS = {"parts": 4, "parallel": False}


def parse_arg(arg: str | None, name: str = "rgcn_fb15k237_partitioned") -> dict:
  """'P' (the number of partitions, default 4), optionally ',parallel'."""
  return _options.parse(arg, DEFAULTS, name=name, positional=("parts",), usage="P or P,parallel")


def get_config(arg=None):
  """arg: "P" (the number of partitions, default 4), optionally ",parallel"."""
  options = parse_arg(arg)
  c = rgcn_fb15k237.get_config()
  c.partition.num_parts = options["parts"]
  c.partition.method = "metis"  # metis (pymetis) | random
  c.partition.only = -1
  # FB15k-237's hubs put ~all entities in every 1-hop halo (benchmarks/results/kg_rgcn.md);
  # unpadded, each partition's step costs its own edges (one compiled step per partition).
  c.partition.pad = "none"
  # 0: one partition per step; -1: one per device of the mesh, trained in parallel (every
  # partition padded to the largest: one compiled step); G: G per step, G / devices each.
  c.partition.parallel = -1 if options["parallel"] else 0
  c.mesh = ml_collections.ConfigDict({"data": 0, "model": 1})
  return c
