"""sage_synthetic (GraphSAGE on learnable node embeddings only) with the node table on any
backend: the sampled frontier's node ids are split over the mesh and fetched through it.

  python run.py --experiment=sage_node_table:table=offload              # 1M nodes, host table
  python run.py --experiment=sage_node_table:table=sharded --config.mesh.model=8
  python run.py --experiment=sage_node_table:table=hot_cold,nodes=100_000

  table  dense | offload | hot_cold | sharded | tt   (the plan strings are in PLANS)
  nodes  the synthetic graph's nodes (edges 10 per node; sage_synthetic: 1,000,000)
  cache  offload: device cache rows as a fraction of the table (default 0.25)
  budget hot_cold: the hot rows as a fraction of the table (default 0.05)
  kind   sharded: row | table | column (default row: the rows split over MODEL)

The node ids are split over the mesh for `sharded` (embeddings.split_ids=auto);
`--config.embeddings.split_ids=true` splits them for every backend (each device fetches its
share through the backend), false replicates them (every device looks up every id).

The same seed gives the same batches for every table: `benchmarks/node_tables.py` trains
each and compares accuracy and the final tables with dense's.
"""

from __future__ import annotations

import ml_collections

from experiments import _options, sage_synthetic

DEFAULTS = {"table": "dense", "nodes": 1_000_000, "cache": 0.25, "budget": 0.05, "kind": "row"}
TABLES = ("dense", "offload", "hot_cold", "sharded", "tt")


def plan_string(options: dict, num_rows: int) -> str:
  """The node table's plan string for `options` (a table of `num_rows` rows)."""
  table = options["table"]
  if table == "offload":
    return f"offload(cache_rows={max(1, int(options['cache'] * num_rows))}, policy=lru)"
  if table == "hot_cold":
    return f"hot_cold(budget={options['budget']})"
  if table == "sharded":
    return f"sharded(kind={options['kind']})"
  if table == "tt":
    return "tt(rank=8, cores=3)"
  return "dense"


def parse_arg(arg: str | None) -> dict:
  return _options.parse(arg, DEFAULTS, {"table": TABLES}, name="sage_node_table")


def get_config(arg=None):
  options = parse_arg(arg)
  c = sage_synthetic.get_config()
  nodes = int(options["nodes"])
  c.data.synthetic.num_nodes = nodes
  c.data.synthetic.num_edges = 10 * nodes
  c.embeddings.plan = ((".*", plan_string(options, nodes)),)
  # The node ids are split over every device of the mesh (`--config.mesh.model=8`: a
  # row-sharded table over 8 devices).
  c.mesh = ml_collections.ConfigDict({"data": 0, "model": 1})
  return c
