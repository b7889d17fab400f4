"""GraphSAGE's node table on every backend: the same run (experiments/sage_node_table: the
synthetic graph, learnable node embeddings only, one seed), per backend and mesh; test
accuracy, and the final node table and dense params against dense's on the same mesh (max
|difference|, 0 = bit for bit) and against 1-device dense.

Question: does GraphSAGE's node table train to the same result on every backend and mesh?

  python benchmarks/node_tables.py                                  # defaults below
  python benchmarks/node_tables.py --nodes=20000 --steps=100 --cache=0.9 --meshes=1x1,1x8

Writes benchmarks/results/node_tables.{json,md}. Meshes are simulated CPU devices here.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import tempfile
import time

import harness

harness.simulated_devices(8)  # before jax starts

import jax  # noqa: E402
import numpy as np  # noqa: E402

from experiments import sage_node_table  # noqa: E402
from recgnn.tasks import node_classification as nc  # noqa: E402
from recgnn.train import loop  # noqa: E402

RESULTS = harness.RESULTS


def direct(c) -> tuple[dict, object, object]:
  """The trainer's own run (`setup.build`: task, plan, feeder, the jitted packed train / eval
  steps, the initial state), fed from this thread in stream order without the trainer's input
  thread: (metrics, state, plan)."""
  from recgnn.train import input_thread, setup

  run = setup.build(c)
  task, state = run.task, run.state
  stream = input_thread.stream(task, 0, c.train.steps, 0, "valid", ("valid", "test"))
  outputs: list = []
  metrics: dict = {}
  for item, on_device in run.feed(list(stream)):
    if item.kind == "eval_end":
      res = task.metrics(jax.device_get(outputs))
      metrics.update({f"{item.split}/{k}": v for k, v in res.items()})
      outputs = []
    elif item.kind == "train":
      state, _ = run.train_step(state, *on_device)
    else:
      outputs.append(run.eval_step(state, *on_device))
  return metrics, run.sync(state), run.plan


def train(args, table: str, mesh: tuple[int, int]) -> dict:
  arg = f"table={table},nodes={args.nodes},cache={args.cache},budget={args.budget}"
  c = sage_node_table.get_config(arg)
  c.mesh.data, c.mesh.model = mesh
  c.embeddings.split_ids = args.split_ids
  c.seed = args.seed
  c.train.steps = args.steps
  c.train.log_every = args.steps
  t0 = time.perf_counter()
  if args.driver == "trainer":
    with tempfile.TemporaryDirectory() as wd:
      res = loop.train(c, wd)
    metrics, state, plan = res.metrics, res.state, res.plan
  else:
    metrics, state, plan = direct(c)
  seconds = time.perf_counter() - t0
  key = plan.table_group[nc.TABLE]
  group = plan.groups[key]
  return {
    "table": table,
    "plan": c.embeddings.plan[0][1],
    "mesh": f"{mesh[0]}x{mesh[1]}",
    "test_accuracy": metrics["test/accuracy"],
    "valid_accuracy": metrics["valid/accuracy"],
    "seconds": seconds,
    "_node_table": np.asarray(group.tables(state.emb[key])[nc.TABLE]),
    "_params": [np.asarray(x) for x in jax.tree.leaves(jax.device_get(state.params))],
  }


def max_diff(a: dict, b: dict) -> tuple[float, float]:
  table = float(np.max(np.abs(a["_node_table"] - b["_node_table"])))
  params = max(float(np.max(np.abs(x - y))) for x, y in zip(a["_params"], b["_params"]))
  return table, params


def main(argv=None):
  p = harness.flags.parser(__doc__)
  p.add_argument("--nodes", type=int, default=20_000)
  p.add_argument("--steps", type=int, default=100)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument(
    "--cache", type=float, default=0.9, help="offload cache, x table rows (>= a batch's rows)"
  )
  p.add_argument("--budget", type=float, default=0.05, help="hot_cold hot rows, x table rows")
  p.add_argument("--tables", default="dense,offload,hot_cold,sharded,tt")
  p.add_argument(
    "--split_ids", default="true", help="embeddings.split_ids: true (ids split over the mesh "
    "for every backend) | auto (only for sharded) | false"
  )  # fmt: skip
  p.add_argument("--meshes", default="1x1,1x8")
  p.add_argument("--out", default=str(RESULTS / "node_tables"))
  p.add_argument(
    "--driver", default="trainer", choices=("trainer", "direct"),
    help="trainer: recgnn.train.loop.train; direct: its steps fed from the main thread "
    "(no input thread; see `direct`)",
  )  # fmt: skip
  p.add_argument("--render", default="", help="rewrite the .md of this results .json only")
  p.add_argument(
    "--quick",
    action="store_true",
    help="smoke run, not figures: 10 steps, 1x1, three backends",
  )
  args = p.parse_args(argv)
  if args.quick:
    args.steps, args.meshes, args.tables = 10, "1x1", "dense,offload,tt"
  if args.render:
    path = pathlib.Path(args.render)
    path.with_suffix(".md").write_text(render(json.loads(path.read_text())))
    return
  meshes = [tuple(int(x) for x in m.split("x")) for m in args.meshes.split(",")]
  tables = args.tables.split(",")
  if tables[0] != "dense":
    raise SystemExit("--tables must start with dense (the reference)")
  rows = []
  for mesh in meshes:
    for table in tables:
      r = train(args, table, mesh)
      rows.append(r)
      print(
        f"{r['mesh']} {r['plan']}: test accuracy {r['test_accuracy']:.4f} ({r['seconds']:.0f} s)"
      )
      write(args, meshes, rows)  # after every run: a later run that hangs loses nothing
  print(pathlib.Path(args.out).with_suffix(".md").read_text())


def write(args, meshes, rows) -> None:
  one = (
    next(r for r in rows if r["mesh"] == "1x1" and r["table"] == "dense")
    if (1, 1) in meshes
    else None
  )
  for r in rows:
    ref = next(x for x in rows if x["mesh"] == r["mesh"] and x["table"] == "dense")
    r["table_max_diff_vs_dense_same_mesh"], r["params_max_diff_vs_dense_same_mesh"] = max_diff(
      r, ref
    )
    if one is not None:
      r["table_max_diff_vs_dense_1x1"], r["params_max_diff_vs_dense_1x1"] = max_diff(r, one)
  clean = [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]
  load = os.getloadavg()
  payload = {
    "args": vars(args),
    "load_avg": load,
    "devices": f"{jax.device_count()} {jax.devices()[0].device_kind}",
    "runs": clean,
  }
  out = pathlib.Path(args.out)
  harness.write_results(out.name, payload, render(payload), out.parent, show=False)


def render(payload: dict) -> str:
  """The markdown of a results JSON (also: --render=FILE.json rewrites FILE.md)."""
  args = argparse.Namespace(**payload["args"])
  load, clean = payload["load_avg"], payload["runs"]
  planned = len(args.meshes.split(",")) * len(args.tables.split(","))
  lines = [
    f"# GraphSAGE node table per backend ({args.nodes:,}-node synthetic graph, learnable node "
    f"embeddings only, {args.steps} steps, seed {args.seed})",
    "",
    f"`python benchmarks/node_tables.py --nodes={args.nodes} --steps={args.steps} "
    f"--meshes={args.meshes} --tables={args.tables} --split_ids={args.split_ids} "
    f"--cache={args.cache} --driver={args.driver}`; {payload['devices']} (simulated on CPU); "
    f"load average {load[0]:.1f}. Max |difference| of the final node table and dense params "
    "against dense on the same mesh (0: bit for bit) and against 1x1 dense (tt is another "
    "parametrisation of the table: its differences are not rounding). Runs finished: "
    f"{len(clean)} of {planned}"
    + (
      " (the results are written after each run; a run that never finished, e.g. hung in "
      "an XLA:CPU collective of simulated devices, has no row)."
      if len(clean) < planned
      else "."
    ),
    "",
    "| mesh | node table | test acc | valid acc | table diff (same mesh) | params diff (same mesh) "
    "| table diff (1x1 dense) | seconds |",
    "|---|---|---|---|---|---|---|---|",
  ]
  for r in clean:
    lines.append(
      f"| {r['mesh']} | `{r['plan']}` | {r['test_accuracy']:.4f} | {r['valid_accuracy']:.4f} "
      f"| {r['table_max_diff_vs_dense_same_mesh']:.3g} "
      f"| {r['params_max_diff_vs_dense_same_mesh']:.3g} "
      f"| {r.get('table_max_diff_vs_dense_1x1', float('nan')):.3g} | {r['seconds']:.0f} |"
    )
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  main()
