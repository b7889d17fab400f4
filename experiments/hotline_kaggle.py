"""Hotline on the Kaggle DLRM: the largest tables `hot_cold` under a device budget, dense elsewhere.

dlrm_kaggle's model, data and optimizers; the K largest tables (default 7, TT-Rec's choice:
C3 C4 C12 C16 C21 C24 C26 on the real data, the same names on the synthetic default) form ONE
hot_cold group, so an example is popular when its ids in all K tables are hot (FAE / Hotline).
Their hot rows (5 % of their bytes by default) are split by rows over the devices; the rest
stays in pinned host memory. The small tables are dense: they are hot anyway and would only
make fewer examples popular.

The hot set is profiled over the first 5 % of an epoch's train batches (FAE profiles a 5 %
sample of the input), then migrated to the devices; the epoch's length is the train split's
rows // the batch size, from the data config (`steps_per_epoch`: the synthetic default's rows
or Criteo Kaggle train.txt's, under the Kaggle split); results equal the all-dense run up to
float summation order (tests/test_hot_cold.py; bit for bit for the embedding update itself).

  python run.py --experiment=hotline_kaggle --workdir=/tmp/hotline
  python run.py --experiment=hotline_kaggle:budget=0.01,tables=10 --workdir=/tmp/hotline1

`device_memory_budget` is 'plan+10%': what this plan needs per device (its backends' own
memory report, hot_cold's ring of recent write-backs included) plus 10 %, resolved by the
trainer on the run's mesh, data and batch size and logged in bytes; the all-dense plan
(`dlrm_kaggle` with that --device_memory_budget) is refused before allocating
(tests/test_experiments.py).

Arg (optional, comma-separated): budget=F (share of the K tables' bytes on the devices),
tables=K, profile=F (share of an epoch profiled), reprofile=N (re-pick every N steps),
split=False (no micro-batches). Every batch's cold rows are read by the input thread ahead
of its step (no option).
"""

from __future__ import annotations

from experiments import _options, dlrm_kaggle, ttrec_kaggle
from recgnn import planner
from recgnn.data import ctr_dataset
from recgnn.embeddings import base

DEFAULTS = {
  "budget": 0.05, "tables": 7, "profile": 0.05, "reprofile": 0, "split": True,
}  # fmt: skip
KAGGLE_TRAIN_TXT_ROWS = 45_840_617  # Criteo Kaggle's train.txt (Display Advertising Challenge)


def data_rows(c) -> int:
  """Rows of the whole dataset the config reads: the synthetic generator's
  `data.synthetic.rows`, or with `data.path` (the Kaggle split) Criteo Kaggle's train.txt."""
  if not c.data.path:
    return int(c.data.synthetic.rows)
  if c.data.split != "kaggle":
    raise ValueError(
      f"hotline_kaggle: data.split={c.data.split!r}; the profile window is a share of an "
      "epoch of the Kaggle split (train.txt's 7 day-chunks): use data.split='kaggle'"
    )
  return KAGGLE_TRAIN_TXT_ROWS


def steps_per_epoch(c) -> int:
  """Train batches in one epoch of the config's data: the train split's rows (the Kaggle
  split: the first 6 of 7 day-chunks) // train.batch_size, as the task counts them
  (CtrDataset.num_batches, drop_remainder). Computed in get_config, before command-line
  overrides: a --config.train.batch_size or --config.data.synthetic.rows given there needs
  profile= recomputed (`hot_cold_text(options, steps_per_epoch(config))`)."""
  start, stop = ctr_dataset.kaggle_split(data_rows(c))["train"]
  return max(1, (stop - start) // int(c.train.batch_size))


def parse_arg(arg: str | None) -> dict:
  """'budget=0.01,tables=10' -> DEFAULTS updated."""
  return _options.parse(arg, DEFAULTS, name="hotline_kaggle")


def hot_cold_text(options: dict, epoch_steps: int) -> str:
  """The hot_cold plan string: profile= (a share of an epoch) as batches of `epoch_steps`."""
  profile_batches = max(1, round(options["profile"] * epoch_steps))
  text = f"hot_cold(budget={options['budget']}, profile_batches={profile_batches}"
  if options["reprofile"]:
    text += f", reprofile={options['reprofile']}"
  if not options["split"]:
    text += ", split=False"
  return text + ")"


def make_plan(options: dict, cardinalities, epoch_steps: int) -> list[tuple[str, str]]:
  chosen = ttrec_kaggle.largest(cardinalities, options["tables"])
  rules = [(".*", "dense")]
  if chosen:
    text = hot_cold_text(options, epoch_steps)
    rules.insert(0, (f"C({'|'.join(n[1:] for n in chosen)})", text))
  return rules


def get_config(arg=None):
  options = parse_arg(arg)
  c = dlrm_kaggle.get_config()
  cards = dlrm_kaggle.KAGGLE_CARDINALITIES if c.data.path else ttrec_kaggle._synthetic_sizes(c)
  c.embeddings.plan = tuple(make_plan(options, cards, steps_per_epoch(c)))
  # Fail now, not after the data is loaded, on a bad option.
  planner.make_backend(c.embeddings.plan[0][1], base.TableSpec(name="C3", num_rows=1000, dim=16))
  # The plan's own bytes per device (its backends' memory() and the buffers a train batch
  # sizes: hot_cold's ring), resolved by the trainer on the run's mesh and data, + 10%.
  c.device_memory_budget = "plan+10%"
  return c
