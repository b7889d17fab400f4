"""GraphSAGE link prediction (recgnn/tasks/sage_link) beside PyG and classic heuristics.

Questions:
  1. Cora, PyG's RandomLinkSplit defaults, 3 seeds: is recgnn's test ROC-AUC within 0.01 of
     PyG's with the same encoder (2 SAGE-mean layers, 128 -> 64), decoder (dot), negatives
     (one uniform pair per positive), fanouts, batch, optimizer and steps on the same split?
     And training edges per second of both on this CPU (PyG: LinkNeighborLoader + SAGEConv).
  2. A planted-link power-law graph (experiments/linkpred_planted): is GraphSAGE's test
     Hits@20 above common neighbours' and Adamic-Adar's, scored here on the same split and
     message graph?
  3. A feature-less graph (experiments/linkpred_featureless): learned node embeddings, dense
     vs tt: test Hits@20 and the node table's bytes side by side.

  python benchmarks/linkpred.py                   # all three (PyG from .peers-venv, if there)
  python benchmarks/linkpred.py --cora_steps=100 --seeds=0 --skip=planted,featureless

Writes benchmarks/results/linkpred.{json,md}. PyG runs in the peers venv
(benchmarks/peers/install.sh) as a subprocess (benchmarks/peers/linkpred_pyg.py); DGL is not
installed there.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile

import harness
import numpy as np  # noqa: E402

import run  # noqa: E402
from experiments import sage_tt_synthetic  # noqa: E402
from recgnn import metrics  # noqa: E402
from recgnn.data import link_loading  # noqa: E402
from recgnn.tasks.sage_link import scores  # noqa: E402
from recgnn.train import loop  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
PEERS_PYTHON = ROOT / ".peers-venv" / "bin" / "python"


def config(name: str, overrides: dict):
  c = run.load_config(name)
  flags = [f"--config.{k}={v}" for k, v in {"mesh.data": 1, "mesh.model": 1, **overrides}.items()]
  return run.apply_overrides(c, flags)


def train(c, workdir: str) -> dict:
  """One trainer run: its final metrics and its steady training edges/s (the last log's)."""
  res = loop.train(c, workdir).metrics
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rates = [json.loads(x)["samples_per_second"] for x in f if "samples_per_second" in x]
  return {**res, "edges_per_second": rates[-1]}


def pyg(split_file: str, steps: int, seed: int) -> dict | str:
  """PyG's run on the saved split, or why it did not run."""
  if not PEERS_PYTHON.exists():
    return f"no {PEERS_PYTHON} (bash benchmarks/peers/install.sh in it)"
  cmd = [str(PEERS_PYTHON), str(ROOT / "benchmarks/peers/linkpred_pyg.py"), split_file,
         "--steps", str(steps), "--seed", str(seed)]  # fmt: skip
  proc = subprocess.run(cmd, capture_output=True, text=True)
  if proc.returncode:
    return "PyG failed: " + " | ".join((proc.stdout + proc.stderr).strip().splitlines()[-3:])
  return json.loads(proc.stdout.strip().splitlines()[-1])


def cora(args, tmp: str) -> tuple[list, list]:
  """Per seed: recgnn with its exclusion of the batch's edges, recgnn without it (PyG's
  LinkNeighborLoader does not exclude them: the like-for-like pair), and PyG."""
  rows, raw = [], []
  for seed in args.seeds:
    steps, path = args.cora_steps, os.path.join(tmp, f"cora{seed}.npz")
    runs = {}
    for exclude in (True, False):
      c = config("linkpred_cora", {"seed": seed, "data.split_seed": seed, "train.steps": steps,
                                   "train.eval_every": 0, "train.log_every": steps // 4,
                                   "sampler.exclude": exclude})  # fmt: skip
      if exclude:
        split = link_loading.load_link_split(c.data)
        np.savez(path, x=split.features, train=split.train, valid=split.valid, test=split.test,
                 valid_neg=split.valid_neg, test_neg=split.test_neg)  # fmt: skip
      runs[exclude] = train(c, os.path.join(tmp, f"cora{seed}_{exclude}"))
    peer = pyg(path, steps, seed)
    raw.append({"seed": seed, "recgnn": runs[True], "recgnn_no_exclusion": runs[False],
                "pyg": peer})  # fmt: skip
    ok = isinstance(peer, dict)
    same = runs[False]
    rows.append([
      seed, f"{runs[True]['test/roc_auc']:.4f}", f"{same['test/roc_auc']:.4f}",
      f"{peer['test_roc_auc']:.4f}" if ok else peer,
      f"{same['test/roc_auc'] - peer['test_roc_auc']:+.4f}" if ok else "",
      f"{runs[True]['test/hits@20']:.3f} / {same['test/hits@20']:.3f} / "
      + (f"{peer['test_hits@20']:.3f}" if ok else "-"),
      f"{same['edges_per_second']:,.0f}", f"{peer['edges_per_second']:,.0f}" if ok else "",
    ])  # fmt: skip
    print(rows[-1], flush=True)
  return rows, raw


def heuristic_scores(adj, pairs: np.ndarray) -> dict[str, np.ndarray]:
  """Common neighbours and Adamic-Adar of pairs int[P, 2] over a CSR adjacency."""
  deg = np.asarray(adj.sum(axis=1)).ravel()
  inv_log = np.where(deg > 1, 1.0 / np.log(np.maximum(deg, 2)), 0.0)
  a, b = adj[pairs[:, 0]], adj[pairs[:, 1]]
  both = a.multiply(b)
  return {
    "common neighbours": np.asarray(both.sum(axis=1)).ravel(),
    "Adamic-Adar": np.asarray(both @ inv_log).ravel(),
  }


def planted(args, tmp: str) -> tuple[list, dict]:
  c = config("linkpred_planted", {"train.steps": args.steps, "train.eval_every": 0,
                                  "train.log_every": args.steps // 4})  # fmt: skip
  ours = train(c, os.path.join(tmp, "planted"))
  split = link_loading.load_link_split(c.data)
  adj = split.message_adj("test")
  rows = [["GraphSAGE (features, dot)", f"{ours['test/hits@20']:.4f}",
           f"{ours['test/roc_auc']:.4f}"]]  # fmt: skip
  raw = {"graphsage": ours}
  for name, s in heuristic_scores(adj, np.concatenate([split.test, split.test_neg])).items():
    pos, neg = s[: len(split.test)], s[len(split.test) :]
    labels = np.r_[np.ones(pos.size), np.zeros(neg.size)]
    hits, auc = scores.hits_at(pos, neg, 20), metrics.auc(labels, np.r_[pos, neg])
    rows.append([name, f"{hits:.4f}", f"{auc:.4f}"])
    raw[name] = {"hits@20": hits, "roc_auc": auc}
  return rows, raw


def featureless(args, tmp: str) -> tuple[list, dict]:
  rows, raw = [], {}
  for table in ("dense", "tt"):
    c = config(f"linkpred_featureless:table={table}", {"train.steps": args.steps,
               "train.eval_every": 0, "train.log_every": args.steps // 4})  # fmt: skip
    res = train(c, os.path.join(tmp, f"featureless_{table}"))
    n = c.data.synthetic.num_nodes
    floats = sage_tt_synthetic.compression(n, c.embeddings.dim, c.embeddings.plan)["floats"]
    raw[table] = {**res, "table_bytes": 4 * floats}
    rows.append([c.embeddings.plan[0][1], f"{res['test/hits@20']:.4f}",
                 f"{res['test/roc_auc']:.4f}", f"{4 * floats:,}"])  # fmt: skip
  return rows, raw


def main() -> None:
  p = harness.flags.parser(__doc__)
  p.add_argument("--seeds", default="0,1,2")
  p.add_argument("--cora_steps", type=int, default=200)
  p.add_argument("--steps", type=int, default=300, help="planted / featureless runs' steps")
  p.add_argument("--skip", default="", help="comma-separated: cora, planted, featureless")
  p.add_argument("--quick", action="store_true", help="one seed, 20 / 30 steps (a smoke run)")
  args = p.parse_args()
  if args.quick:
    args.seeds, args.cora_steps, args.steps = "0", 20, 30
  args.seeds = [int(s) for s in args.seeds.split(",")]
  skip = set(filter(None, args.skip.split(",")))
  payload = harness.record(args)
  md = [f"`python benchmarks/linkpred.py {' '.join(sys.argv[1:])}`; load at start "
        f"{payload['machine'].get('load_avg_at_start', '?')}\n"]  # fmt: skip
  with tempfile.TemporaryDirectory() as tmp:
    if "cora" not in skip:
      rows, payload["cora"] = cora(args, tmp)
      md += ["## Cora, random link split (PyG defaults), test split\n", harness.md_table(
        ["seed", "recgnn ROC-AUC (exclusion)", "recgnn ROC-AUC (none, as PyG)", "PyG ROC-AUC",
         "recgnn (none) - PyG", "Hits@20 excl. / none / PyG", "recgnn edges/s (none)",
         "PyG edges/s"], rows), ""]  # fmt: skip
    if "planted" not in skip:
      rows, payload["planted"] = planted(args, tmp)
      md += ["## Planted-link power-law graph, test split\n",
             harness.md_table(["scorer", "Hits@20", "ROC-AUC"], rows), ""]  # fmt: skip
    if "featureless" not in skip:
      rows, payload["featureless"] = featureless(args, tmp)
      md += ["## Feature-less graph, learned node embeddings, test split\n", harness.md_table(
        ["node table", "Hits@20", "ROC-AUC", "table bytes (params)"], rows), ""]  # fmt: skip
  md.append(f"load at end {harness.load():.1f} (1-minute average)")
  harness.write_results("linkpred_quick" if args.quick else "linkpred", payload, "\n".join(md))


if __name__ == "__main__":
  main()
