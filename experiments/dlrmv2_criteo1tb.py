"""DLRM-DCNv2, the MLPerf Training recommendation benchmark (v3.0+), on Criteo 1TB multi-hot.

The MLPerf configuration (torchrec_dlrm reference): 26 tables of MLPerf's sizes, at most 40M
rows (multihot.MLPERF_ROWS; here hashed into them), dim 128, multi-hot sizes 3,2,1,2,6,1,1,1,
1,7,3,8,1,6,9,5,1,1,1,12,100,27,10,3,1,1 made from the one-hot ids by MLPerf's recipe
(recgnn/data/multihot.py), bottom MLP 512-256-128, three low-rank (512) cross layers, top MLP
1024-1024-512-256-1, Adagrad (dense and row-wise sparse), day_0 .. day_22 train, day_23's
halves test / valid.

  python run.py --experiment=dlrmv2_criteo1tb                     # synthetic default
  python run.py --experiment=dlrmv2_criteo1tb:interaction=dot     # the same data, DLRM's dot
  python run.py --experiment=dlrmv2_criteo1tb:path=/data/criteo1tb   # day_0 .. day_23 there
  python run.py --experiment=dlrmv2_criteo1tb:distribution=pareto

Options after ':' (comma-separated key=value): path (a folder holding day_N files, or one
file; several files: --config.data.path=a,b,...), interaction (dcn | dot), distribution
(uniform | pareto). With a path every size is MLPerf's; without, the synthetic default keeps the
structure at a size that trains in minutes on 2 CPU cores: the embedded synthetic Criteo-format
data (labels from a planted model, so the run prints its test AUC beside the oracle AUC),
1M rows, Kaggle cardinalities x 0.002 (frequency ids), the same 26 multi-hot sizes and recipe,
dim 16, bottom 64-32-16, 3 low-rank (rank 32) cross layers, top 128-64-1. interaction=dot swaps
the cross network for DLRM's dot interaction on the same batches (the bottom MLP already ends at
the embedding dim), so the two AUCs compare.
"""

from __future__ import annotations

import glob
import os
import re

from experiments import _options, dlrm_kaggle
from recgnn.data import multihot

DEFAULTS = {"path": "", "interaction": "dcn", "distribution": "uniform"}
CHOICES = {"interaction": ("dcn", "dot"), "distribution": multihot.DISTRIBUTIONS}


def parse_arg(arg: str | None) -> dict[str, str]:
  """'interaction=dot,path=/x' -> DEFAULTS updated (experiments/_options.parse); unknown keys
  or values name the valid ones."""
  return _options.parse(
    arg,
    DEFAULTS,
    CHOICES,
    name="dlrmv2_criteo1tb",
    usage="key=value options: path, interaction, distribution",
  )


def day_files(path: str) -> str:
  """A folder of day_N files -> 'day_0,day_1,...' in day order; a file -> itself."""
  if not os.path.isdir(path):
    if not os.path.isfile(path):
      raise FileNotFoundError(f"dlrmv2_criteo1tb: {path!r} is neither a folder nor a file")
    return path
  days = {}
  for p in glob.glob(os.path.join(path, "day_*")):
    m = re.fullmatch(r"day_(\d+)", os.path.basename(p))
    if m:
      days[int(m.group(1))] = p
  if len(days) < 2:
    raise FileNotFoundError(f"dlrmv2_criteo1tb: {path} holds {len(days)} day_N files; need >= 2")
  return ",".join(days[d] for d in sorted(days))


def get_config(arg=None):
  o = parse_arg(arg)
  c = dlrm_kaggle.get_config()
  c.data.multi_hot.sizes = multihot.MLPERF_MULTI_HOT_SIZES
  c.data.multi_hot.distribution = o["distribution"]
  c.model.interaction = o["interaction"]
  c.embeddings.optimizer.name = "rowwise_adagrad"
  c.optimizer.name = "adagrad"
  if o["path"]:  # MLPerf's sizes
    c.data.path = day_files(o["path"])
    c.data.split = "last_file"
    # Hashed into MLPerf's table sizes (ids FIRST_ID + value % rows; the reader keeps ids 0 and
    # 1 for empty and unknown values). MLPerf's preprocessing maps values to contiguous ids
    # instead (no collisions in the small tables): --config.data.categorical=frequency does,
    # after a counting pass over every day.
    c.data.categorical = "hash"
    c.data.hash_sizes = tuple(r + 2 for r in multihot.MLPERF_ROWS)
    c.embeddings.dim = 128
    c.model.bottom = (512, 256, 128)
    c.model.top = (1024, 1024, 512, 256, 1)
    c.model.cross_layers = 3
    c.model.low_rank = 512
    c.embeddings.optimizer.learning_rate = 0.005
    c.optimizer.learning_rate = 0.005
    c.train.batch_size = 65536
    c.train.eval_batch_size = 65536
  else:  # the synthetic default: the same structure, small
    c.data.synthetic.rows = 1_000_000
    c.data.synthetic.scale = 0.002
    c.embeddings.dim = 16
    c.model.bottom = (64, 32, 16)
    c.model.top = (128, 64, 1)
    c.model.cross_layers = 3
    c.model.low_rank = 32
    c.embeddings.optimizer.learning_rate = 0.05
    c.optimizer.learning_rate = 0.02
    c.train.batch_size = 1024
    c.train.eval_batch_size = 8192
    c.train.log_every = 200
  return c
