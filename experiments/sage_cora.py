"""GraphSAGE-mean on Cora: node features, the standard Planetoid split, fanouts [25, 10]."""

import ml_collections

from experiments import _options


def get_config(arg=None):
  _options.parse(arg, {}, name="sage_cora")  # no options: an ARG would be ignored
  c = ml_collections.ConfigDict()
  c.task = "node_classification"
  c.seed = 0

  c.data = ml_collections.ConfigDict()
  c.data.source = "planetoid"
  c.data.name = "cora"
  c.data.path = ""  # "" = the bundled third_party/cora

  c.model = ml_collections.ConfigDict()
  c.model.inputs = "features"  # features | embeddings | both
  c.model.hidden = 64
  c.model.dropout = 0.5
  c.model.dtype = "float32"  # the layers' compute dtype: float32 | bfloat16 (params float32)

  c.sampler = ml_collections.ConfigDict()
  c.sampler.kind = "node"  # node (GraphSAGE) | ladies
  c.sampler.where = "host"  # host (numpy / scipy) | device (jitted JAX, the same law)
  c.sampler.split_devices = 0  # device, node: > 1 splits the adjacency's rows over devices
  c.sampler.split_exchange = "reduce_scatter"  # | all_to_all (requests to the rows' owners)
  c.sampler.split_capacity = 0.0  # all_to_all: x an even share per device pair; 0 = exact
  # true: every device of the mesh samples and trains its own seeds (graph replicated).
  c.sampler.data_parallel = False
  # data_parallel: train steps per call (each device samples its next k mini-batches in one
  # bulk call, the step scans k optimizer steps over them; the same result as 1).
  c.sampler.steps_per_call = 1
  c.sampler.fanouts = (25, 10)
  c.sampler.layer_sizes = (512, 512)  # ladies only
  c.sampler.batch_size = 140  # the whole training set per step
  c.sampler.bulk = 8  # mini-batches per sparse product
  c.sampler.capacities = "auto"  # auto | worst | (n_1, ..., n_L)
  c.sampler.eval_capacities = "worst"  # every frontier fits: nothing dropped in eval
  c.sampler.eval_fanouts = (-1, -1)  # every neighbour: deterministic eval
  c.sampler.eval_batch_size = 500

  # Unused unless model.inputs includes embeddings.
  c.embeddings = ml_collections.ConfigDict()
  c.embeddings.dim = 64
  c.embeddings.initializer = "normal"
  c.embeddings.optimizer = ml_collections.ConfigDict({"name": "sgd", "learning_rate": 0.1})
  c.embeddings.plan = ((".*", "dense"),)
  c.embeddings.cost_cache = ""  # plan=auto / --plan_report: measured costs kept here
  # Modules imported before the plan is resolved (comma-separated file paths or module
  # names): a backend in its own file registers itself and the plan may name it. "" = none.
  c.embeddings.modules = ""
  # auto: the node ids split over the mesh only for a plan that needs it (sharded); true:
  # for every backend (each device fetches its share); false: every device looks up all.
  c.embeddings.split_ids = "auto"

  # Adam with L2 5e-4, as the published GCN / GraphSAGE Cora setups.
  c.optimizer = ml_collections.ConfigDict(
    {"name": "adam", "learning_rate": 0.01, "weight_decay": 5e-4, "warmup_steps": 0}
  )

  c.train = ml_collections.ConfigDict()
  c.train.steps = 200
  c.train.log_every = 50
  c.train.eval_every = 50
  c.train.eval_split = "valid"
  c.train.final_eval_splits = ("valid", "test")
  c.train.checkpoint_every = 0
  c.train.keep_checkpoints = 1

  c.device_memory_budget = ""
  return c
