"""DLRM, reference Kaggle config (dim 16, MLPs 13-512-256-64-16 / 367-512-256-1), every table dense.

With no --config.data.path, trains on the embedded synthetic Criteo-format dataset (planted
model, known oracle AUC). With --config.data.path=/path/to/train.txt, on the real Kaggle data
(converted once to a binary cache under data.cache_dir; the reference 7-day split).

`--experiment=dlrm_kaggle:big`: large batches for GPUs, as NVIDIA's DLRM recipes train
(batch 65536): train and eval batch 65536, bf16 compute (`model.dtype`), Adam at the default
1e-3 without warmup (`optimizer.warmup_steps` = 0), the embeddings' row-wise Adagrad at 0.1
(twice the default), `train.feed="auto"` (the data on the accelerator when it fits) and
`train.steps_per_call=1`: a step of 65536 examples is long enough on a GPU that the host's
O(1) work per call hides behind it; k > 1 would only add k batches of staging and make
logs / evals multiples of k. On the synthetic default (52 steps an epoch) one epoch reaches
test AUC 0.7848 (oracle 0.8011; batch 2048, one epoch: 0.7958); the default rates: 0.7822;
Adam at 6e-3 (x sqrt(32)) after an 8-step warmup with Adagrad at 0.05 / 0.1 / 0.2 / 0.3:
0.7820 / 0.7836 / 0.7677 / 0.7538. A second epoch overfits, as at batch 2048
(benchmarks/results/big_batch_auc.md).
"""

import ml_collections

from experiments import _options
from recgnn.data import criteo

BIG_BATCH = 65536
BIG_LR = 1e-3  # Adam, the dense params
BIG_WARMUP_STEPS = 0  # the dense params' linear warmup (8 with Adam at 6e-3: 0.0012 less AUC)
BIG_EMB_LR = 0.1  # row-wise Adagrad, the embeddings


def get_config(arg=None):
  options = _options.parse(arg, {"big": False}, name="dlrm_kaggle")
  c = ml_collections.ConfigDict()
  c.task = "ctr"
  c.seed = 0

  c.data = ml_collections.ConfigDict()
  c.data.path = ""  # train.txt, or comma-separated day_N files (then split=last_file)
  # "memmap": the TSV converted once to .npy files read as memmaps (the faster path; see
  # docs/data.md). "tfds": a TFDS array_record build (criteo_kaggle from the folder holding
  # train.txt, criteo_terabyte from day_N files) read through grain; same batches.
  c.data.source = "memmap"
  c.data.tfds_dir = ""  # TFDS data_dir ("" = <cache_dir>/tfds)
  c.data.read_threads = 8  # grain threads reading batches (source=tfds)
  c.data.split = "kaggle"
  c.data.cache_dir = "~/.cache/recgnn"
  c.data.categorical = "frequency"  # or "hash" (then hash_sizes)
  c.data.min_count = 1
  c.data.hash_sizes = (40_000_000,)  # one size for all tables, or 26
  c.data.max_bad_lines = 100
  c.data.max_bad_fraction = 0.0
  # Your own data: a predefined schema name, a JSON file or a dict (recgnn/data/ctr_schema.py)
  # describing data.path's TSV / CSV / Parquet columns; "criteo" is Criteo's TSV.
  c.data.schema = "criteo"
  c.data.num_workers = 0  # processes converting a schema's files (0: this one)
  # MLPerf's one-hot -> multi-hot expansion (recgnn/data/multihot.py); () keeps one-hot.
  c.data.multi_hot = ml_collections.ConfigDict({"sizes": (), "distribution": "uniform", "seed": 0})
  c.data.synthetic = ml_collections.ConfigDict()
  c.data.synthetic.rows = 4_000_000
  c.data.synthetic.scale = 0.01  # Kaggle cardinalities x scale
  c.data.synthetic.seed = 0

  c.model = ml_collections.ConfigDict()
  # A CTR model of recgnn/models/ by name (docs/models.md): "dlrm" (the dot interaction),
  # "dcn" (DCN-v2 cross layers, recgnn/models/dcn.py), "deepfm".
  c.model.name = "dlrm"
  # The older key of model.name, an alias that wins when set: "dot" (dlrm) or "dcn".
  c.model.interaction = ""
  c.model.bottom = (512, 256, 64, 16)
  c.model.top = (512, 256, 1)
  c.model.cross_layers = 3  # dcn
  c.model.low_rank = 512  # dcn: rank of W = U V^T (0: full rank)
  # Compute dtype of the MLPs and interaction: "float32" or "bfloat16" (params, optimizer and
  # embedding state and the loss stay float32).
  c.model.dtype = "float32"

  c.embeddings = ml_collections.ConfigDict()
  c.embeddings.dim = 16
  c.embeddings.initializer = "uniform"
  c.embeddings.pooling = "sum"  # multi-hot bags: "sum" or "mean"
  c.embeddings.optimizer = ml_collections.ConfigDict(
    {"name": "rowwise_adagrad", "learning_rate": 0.05, "eps": 1e-8, "initial_accumulator": 0.0}
  )
  # (regex over table names, backend); first match wins.
  c.embeddings.plan = ((".*", "dense"),)
  # A JSON file keeping the measured costs of plan=auto's candidates (and --plan_report's)
  # across runs: the same tables, ids, mesh and software are timed once. "" = none.
  c.embeddings.cost_cache = ""
  # Modules imported before the plan is resolved (comma-separated file paths or module
  # names): a backend in its own file registers itself and the plan may name it. "" = none.
  c.embeddings.modules = ""

  c.optimizer = ml_collections.ConfigDict(
    {"name": "adam", "learning_rate": 1e-3, "weight_decay": 0.0, "warmup_steps": 0}
  )

  c.train = ml_collections.ConfigDict()
  c.train.batch_size = 2048
  c.train.eval_batch_size = 16384
  c.train.shuffle = True
  # Training length in passes over the train split (1 epoch = 1,674 steps of the synthetic
  # default); train.steps > 0 overrides it.
  c.train.epochs = 1.0
  c.train.steps = 0
  c.train.log_every = 100
  c.train.eval_every = 0  # 0: evaluate only at the end
  c.train.eval_split = "valid"
  c.train.final_eval_splits = ("valid", "test")
  c.train.checkpoint_every = 1000
  # Train steps per call of the jitted step: k batches in one transfer, one lax.scan over
  # their optimizer steps (fewer launches; logs, evals and checkpoints at multiples of k).
  # dense, tt and sharded; offload and hot_cold refuse k > 1 for now.
  c.train.steps_per_call = 1
  c.train.keep_checkpoints = 2
  # Many processes: "auto" = each reads only its slice of every batch when every embedding
  # group's prepare is per example (dense, sharded), else the whole batch; "local" refuses
  # a plan that cannot; "global" always reads the whole batch.
  c.train.process_input = "auto"
  # Where the input's read / prepare / pack runs: -1 = auto (a worker process when the task's
  # reader and every group's prepare allow it, dense, and the host has 4+ CPUs; else a
  # thread), 0 = a thread of the training process, 1 = a worker process (refused where it
  # cannot be). docs/running.md, "The input pipeline".
  c.train.input_workers = -1
  # Where the training data lives: "device" = placed on the devices once, each step gathers
  # its batch there (the host does O(1) per call); "host" = each batch read, prepared and
  # packed on the host; "auto" = device on accelerators when the data fits beside the plan
  # and every embedding group prepares its ids on the device (dense, sharded), else host.
  # docs/device_feed.md.
  c.train.feed = "auto"
  # The train order: "pass" = a permutation of the rows each pass; "window" = a shuffle within
  # windows of feed_window_chunks contiguous chunks of feed_chunk_rows rows (0: 256 MiB of
  # rows), the order the device feed streams data larger than the devices' budget in (it
  # switches to it then); the host feed reads it too. docs/device_feed.md.
  c.train.order = "pass"
  # "pass" in order_shards contiguous shards of the rows, each permuted on its own, every
  # batch an equal part from each: over P processes (a multiple of P) each process's slice
  # of a batch comes from its own shards, so under the device feed it holds only their rows.
  c.train.order_shards = 1
  c.train.feed_chunk_rows = 0
  c.train.feed_window_chunks = 4

  # (data, model) device mesh; data=0: every device not on model. The batch is split over
  # all devices; model-parallel tables (dense(shard=rows)) are split over `model`.
  c.mesh = ml_collections.ConfigDict({"data": 0, "model": 1})

  c.device_memory_budget = ""  # e.g. "2G": refuse plans that need more device memory
  if options["big"]:
    big(c)
  return c


def big(c) -> None:
  """`dlrm_kaggle:big`: the large-batch settings (see the module docstring), in place."""
  c.train.batch_size = BIG_BATCH
  c.train.eval_batch_size = BIG_BATCH
  c.model.dtype = "bfloat16"
  c.optimizer.learning_rate = BIG_LR
  c.optimizer.warmup_steps = BIG_WARMUP_STEPS
  c.embeddings.optimizer.learning_rate = BIG_EMB_LR
  c.train.feed = "auto"
  c.train.steps_per_call = 1
  c.train.log_every = 10
  c.train.checkpoint_every = 100


# Real Kaggle table sizes, for memory plans and compression ratios without the data.
KAGGLE_CARDINALITIES = criteo.KAGGLE_CARDINALITIES
