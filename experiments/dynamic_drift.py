"""Raw ids on a drifting click stream: a dynamic table vs the hashing trick at equal memory.

Ids are born and die every day, popularity is a power law, labels come from a planted per-id
model with a known oracle. One table at C rows, its ids mapped three ways
(recgnn/data/drifting_ctr.py); trained in stream order on days 0-5, tested on day 6
(benchmarks/dynamic_drift.py runs the three side by side over seeds).

  python run.py --experiment=dynamic_drift                          # dynamic(capacity=C, lru)
  python run.py --experiment=dynamic_drift:ids=hash,capacity=0.125  # the hashing trick, C/8
  python run.py --experiment=dynamic_drift:ids=first_day,seed=2     # a first-day dictionary

Options: ids (dynamic | hash | first_day), capacity (C as a fraction of the stream's distinct
ids), seed (the stream's and the model's), evict and admit (dynamic's policy; admit=count
admits at the k-th occurrence).
"""

import dataclasses

import ml_collections

from experiments import _options, dlrm_kaggle
from recgnn.backends.dynamic import id_map
from recgnn.data import drifting_ctr

DEFAULTS = {"ids": "dynamic", "capacity": 0.5, "seed": 0, "evict": "lru", "admit": "always", "k": 1}
CHOICES = {"ids": drifting_ctr.IDS, "evict": id_map.EVICTIONS, "admit": id_map.ADMISSIONS}


def get_config(arg=None):
  o = _options.parse(arg, DEFAULTS, CHOICES, name="dynamic_drift")
  policy = {k: o[k] for k in ("evict", "admit", "k") if o[k] != DEFAULTS[k]}
  if o["ids"] != "dynamic" and policy:
    raise ValueError(
      f"dynamic_drift:{arg}: {', '.join(policy)} set the dynamic table's policy, and "
      f"ids={o['ids']} has no dynamic table; drop them or use ids=dynamic"
    )
  c = dlrm_kaggle.get_config()
  c.seed = o["seed"]
  stream = drifting_ctr.Stream(seed=o["seed"])
  rows = drifting_ctr.capacity_rows(stream, o["capacity"])
  c.data.drifting = ml_collections.ConfigDict(
    {**dataclasses.asdict(stream), "capacity": rows, "ids": o["ids"]}
  )
  c.model.bottom = (16,)
  c.model.top = (64, 1)
  c.embeddings.dim = 16
  c.embeddings.optimizer.learning_rate = 0.1
  if o["ids"] == "dynamic":
    admit = "" if (o["admit"], o["k"]) == ("always", 1) else f", admit={o['admit']}, k={o['k']}"
    c.embeddings.plan = ((".*", f"dynamic(capacity={rows}, evict={o['evict']}{admit})"),)
  else:
    c.embeddings.plan = ((".*", "dense"),)
  c.train.batch_size = stream.batch
  c.train.eval_batch_size = stream.batch
  c.train.shuffle = False  # stream order: each day after the one before
  c.train.steps = (drifting_ctr.DAYS - 1) * stream.batches  # one pass over days 0-5
  c.train.log_every = stream.batches
  c.train.eval_every = 0
  c.train.checkpoint_every = 0
  return c
