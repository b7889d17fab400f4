"""cDLRM on the Kaggle DLRM: every table in host memory behind a device cache of a few % of rows.

The model, data and optimizers are `dlrm_kaggle`'s; only the embedding plan and the device
budget change. Each table gets `offload(cache_fraction=0.03, min_cache_rows=BATCH)`: a cache
of 3% of its rows, but at least one batch of distinct rows (a train batch must fit its
cache; small tables end up wholly cached). The look-ahead policy keeps the rows the next 8
batches need. Results equal the all-dense run bit for bit (tests/test_offload.py), so
`dlrm_kaggle` is the accuracy reference; this run trades step time for device memory.

`device_memory_budget` is set to a fifth of what the dense tables need, so the same tables
run here but are refused with `dlrm_kaggle`'s all-dense plan. (A tenth until the host tier
moved out of the step, issue 42: its device ring of recent write-backs holds PREFETCH batches
of rows, 2.0 MB at this default's 1% of Kaggle's sizes, where the caches hold 1.1 MB: the plan
needs 3.1 MB, a seventh of the dense tables' 22 MB. At Kaggle's sizes the ring is ~10% of the
caches: 2 x 26 x 2048 rows beside ~1.05M.)

  python run.py --experiment=cdlrm_kaggle --workdir=/tmp/cdlrm
  python run.py --experiment=dlrm_kaggle --workdir=/tmp/dlrm \\
      --device_memory_budget=$(python -c "from experiments import cdlrm_kaggle as c; \\
      print(c.get_config().device_memory_budget)")              # -> PlanDoesNotFit

Arg (optional): "policy=lru,fraction=0.05,lookahead=4" to override the plan's options.
Overriding --config.train.batch_size does not update min_cache_rows; pass the arg
"min_rows=N" too if the new batch is larger.
"""

from experiments import _options, dlrm_kaggle

CACHE_FRACTION = 0.03
POLICY = "lookahead"
LOOKAHEAD = 8  # cDLRM's look-ahead window


# min_rows 0: the train batch size (a batch must fit its cache).
DEFAULTS = {"policy": POLICY, "fraction": CACHE_FRACTION, "lookahead": LOOKAHEAD, "min_rows": 0}


def dense_table_bytes(config) -> int:
  """Device bytes the tables of `config` need when all dense (rows x (dim + optimizer))."""
  from recgnn.data import criteo_synthetic

  if config.data.path:  # the real data: the Kaggle counts (min_count=1)
    cards = dlrm_kaggle.KAGGLE_CARDINALITIES
  else:
    s = config.data.synthetic
    cards = criteo_synthetic.SyntheticConfig(num_rows=s.rows, scale=s.scale).cardinalities()
  slots = 1 if config.embeddings.optimizer.name == "rowwise_adagrad" else 0
  return sum(int(c) for c in cards) * 4 * (config.embeddings.dim + slots)


def get_config(arg=None):
  c = dlrm_kaggle.get_config()
  o = _options.parse(arg, DEFAULTS, name="cdlrm_kaggle")
  fraction = o["fraction"]
  min_rows = o["min_rows"] or c.train.batch_size
  c.embeddings.plan = (
    (
      ".*",
      f"offload(cache_fraction={fraction}, min_cache_rows={min_rows}, "
      f"policy={o['policy']}, lookahead={o['lookahead']})",
    ),
  )
  c.device_memory_budget = str(dense_table_bytes(c) // 5)
  return c
