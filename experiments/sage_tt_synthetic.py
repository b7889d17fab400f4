"""Nimble (Yin et al., KDD'22) on the 1M-node synthetic graph: GraphSAGE on learnable node
embeddings only, the node table as TT cores, node ids reordered by hierarchical partitioning.

sage_synthetic's graph, sampler and model; the changes are the node table's plan, the node
order and the init. The argument after ':' picks them (defaults in DEFAULTS):

  python run.py --experiment=sage_tt_synthetic                     # TT rank 8, partition order
  python run.py --experiment=sage_tt_synthetic:order=random         # the control
  python run.py --experiment=sage_tt_synthetic:init=eigen           # Nimble's eigen init
  python run.py --experiment=sage_tt_synthetic:table=dense          # the full table

  order  none | partition | rcm | random          (data.node_order; recgnn/graphs/reorder.py)
  init   sampled_gaussian | orthogonal | eigen   (eigen: the task writes the adjacency
         eigenvectors to embeddings.node_init_path; tt(init=tt_svd) compresses them)
  table  tt | dense;  rank, cores: of the TT table

get_config prints the node table's floats and compression against the full table (from the
specs, nothing allocated).
"""

from __future__ import annotations

from experiments import _options, sage_synthetic
from recgnn import planner
from recgnn.embeddings import base

DEFAULTS = {"order": "partition", "init": "sampled_gaussian", "table": "tt", "rank": 8, "cores": 3}
INITS = ("sampled_gaussian", "orthogonal", "eigen")


def parse_arg(arg: str | None, name: str = "sage_tt_synthetic") -> dict:
  return _options.parse(arg, DEFAULTS, {"init": INITS, "table": ("tt", "dense")}, name=name)


def node_plan(c, options: dict, name: str) -> None:
  """Set c.embeddings.plan / node_init(_path) and c.data.node_order from `options`."""
  c.data.node_order = options["order"]
  c.data.partition_levels = None
  c.embeddings.node_init = ""
  c.embeddings.node_init_path = ""
  if options["table"] == "dense":
    c.embeddings.plan = ((".*", "dense"),)
    return
  tt = f"rank={options['rank']}, cores={options['cores']}"
  if options["init"] == "eigen":
    path = f"~/.cache/recgnn/node_init/{name}-{options['order']}-d{c.embeddings.dim}.npy"
    c.embeddings.node_init = "eigen"
    c.embeddings.node_init_path = path
    tt += f", init=tt_svd, init_path='{path}'"
  elif options["init"] != "sampled_gaussian":
    tt += f", init={options['init']}"
  c.embeddings.plan = ((".*", f"tt({tt})"),)


def compression(num_rows: int, dim: int, plan) -> dict:
  """Floats of the node table under `plan` vs the full table (nothing allocated)."""
  spec = base.TableSpec(name="node", num_rows=num_rows, dim=dim)
  name, opts = planner.parse_backend(plan[0][1])
  opts = {k: v for k, v in opts.items() if k not in ("init", "init_path")}  # no file read
  b = planner.make_backend(name + "(" + ", ".join(f"{k}={v}" for k, v in opts.items()) + ")", spec)
  floats = b.num_params()["node"]
  return {"floats": floats, "full_floats": num_rows * dim, "ratio": num_rows * dim / floats}


def get_config(arg=None):
  options = parse_arg(arg)
  c = sage_synthetic.get_config()
  node_plan(c, options, "sage_tt_synthetic")
  c.data.cache_dir = "~/.cache/recgnn"
  rep = compression(c.data.synthetic.num_nodes, c.embeddings.dim, c.embeddings.plan)
  print(
    f"node table: {rep['floats']:,} floats vs {rep['full_floats']:,} full: "
    f"{rep['ratio']:,.0f}x smaller"
  )
  return c
