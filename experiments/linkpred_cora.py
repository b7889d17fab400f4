"""GraphSAGE link prediction on Cora: node features, PyG's RandomLinkSplit defaults, dot
decoder, one uniform negative per positive, ROC-AUC / Hits@K against the split's negatives.

  python run.py --experiment=linkpred_cora
  python run.py --experiment=linkpred_cora:decoder=mlp,negatives=degree
"""

import ml_collections

from experiments import _options

DECODERS = ("dot", "mlp")
NEGATIVES = ("uniform", "shared", "degree")


def get_config(arg=None):
  o = _options.parse(
    arg,
    {"decoder": "dot", "negatives": "uniform", "inputs": "features"},
    {"decoder": DECODERS, "negatives": NEGATIVES, "inputs": ("features", "embeddings", "both")},
    name="linkpred_cora",
  )
  c = ml_collections.ConfigDict()
  c.task = "sage_link"
  c.seed = 0

  c.data = ml_collections.ConfigDict()
  c.data.source = "planetoid"
  c.data.name = "cora"
  c.data.path = ""  # "" = the bundled third_party/cora
  c.data.val = 0.05  # PyG RandomLinkSplit's defaults in examples/link_pred.py
  c.data.test = 0.1
  c.data.split_seed = 0
  c.data.features = True

  c.model = ml_collections.ConfigDict()
  c.model.inputs = o["inputs"]  # features | embeddings | both
  c.model.hidden = 128  # PyG's link_pred.py: 128 hidden, 64 out
  c.model.out = 64
  c.model.decoder = o["decoder"]  # dot | mlp (MLP on the Hadamard product)
  c.model.mlp_layers = 3
  c.model.dropout = 0.0
  c.model.dtype = "float32"

  c.sampler = ml_collections.ConfigDict()
  c.sampler.kind = "node"  # node (GraphSAGE) | ladies
  c.sampler.where = "host"  # host | device (the same law)
  c.sampler.split_devices = 0
  c.sampler.data_parallel = False  # (refused: the link task samples on the input thread)
  c.sampler.steps_per_call = 1
  c.sampler.fanouts = (25, 10)
  c.sampler.layer_sizes = (512, 512)  # ladies only
  c.sampler.batch_size = 512  # positive edges per step
  c.sampler.bulk = 4  # mini-batches per sparse product
  c.sampler.capacities = "auto"  # estimated from four train batches (a margin of 1.25)
  c.sampler.eval_capacities = "worst"
  c.sampler.eval_fanouts = (-1, -1)  # every neighbour: exact representations in eval
  c.sampler.eval_batch_size = 1024  # pairs per eval batch
  c.sampler.exclude = True  # the batch's positive edges out of its message passing

  c.negatives = ml_collections.ConfigDict()
  c.negatives.kind = o["negatives"]  # uniform | shared | degree
  c.negatives.num = 1  # per positive (shared: per batch)

  c.eval = ml_collections.ConfigDict()
  c.eval.hits = (20, 50, 100)
  c.eval.mrr_negatives = 0  # K > 0: MRR among K seeded negatives per positive
  # sampled: each eval batch's endpoints' neighbourhoods (eval_fanouts); full: every node's
  # representation layer by layer over the whole graph, eval.chunk edges at a time.
  c.eval.inference = "sampled"
  c.eval.chunk = 65536

  # Unused unless model.inputs includes embeddings.
  c.embeddings = ml_collections.ConfigDict()
  c.embeddings.dim = 64
  c.embeddings.initializer = "normal"
  c.embeddings.optimizer = ml_collections.ConfigDict(
    {"name": "rowwise_adagrad", "learning_rate": 0.1}
  )
  c.embeddings.plan = ((".*", "dense"),)
  c.embeddings.cost_cache = ""
  c.embeddings.modules = ""
  c.embeddings.split_ids = "auto"

  c.optimizer = ml_collections.ConfigDict(
    {"name": "adam", "learning_rate": 0.01, "weight_decay": 0.0, "warmup_steps": 0}
  )

  c.train = ml_collections.ConfigDict()
  c.train.steps = 400
  c.train.log_every = 50
  c.train.eval_every = 100
  c.train.eval_split = "valid"
  c.train.final_eval_splits = ("valid", "test")
  c.train.checkpoint_every = 0
  c.train.keep_checkpoints = 1

  c.device_memory_budget = ""
  return c
