"""Does this tree train every experiment to the same bits as an earlier commit?

Question: a refactor (the loop, the contract's surface, the model registry, the step module's
split) must change no output. For every experiment `python run.py --list` names, each tree
(this one and `--against=COMMIT`'s `git archive`) trains `--steps` steps at a small scale
(tests/test_experiments.py's SMALL overrides: one device, the synthetic data small, the plan,
model and batch the experiment's own) in a process of its own, and writes a digest of its
final state: every dense param leaf and every table's logical rows (`group.tables(state)`), in
order. The digests are compared per experiment; an experiment that refuses to start without
data (`--config.data.path`) in both trees counts as the same.

  python benchmarks/bit_identity.py --against=3e6241c        # results/bit_identity.{json,md}
  python benchmarks/bit_identity.py --against=3e6241c --experiments=dlrm_kaggle,smoke
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile

import harness

STEPS = 4


def digest(state, plan) -> dict:
  """{what: sha256 of its bytes} of the dense params (leaf by leaf) and each table's rows."""
  import jax
  import numpy as np

  h = hashlib.sha256()
  for leaf in jax.tree.leaves(jax.device_get(state.params)):
    h.update(np.ascontiguousarray(leaf).tobytes())
  out = {"params": h.hexdigest()}
  for key, group in plan.groups.items():
    for name, rows in sorted(group.tables(state.emb[key]).items()):
      out[f"table/{name}"] = hashlib.sha256(np.ascontiguousarray(rows).tobytes()).hexdigest()
  return out


def _small_config():
  """tests/test_experiments.py's `small_config` from this checkout (an --against archive
  holds no tests/), over the child's tree's run.py and recgnn (first on the path)."""
  import importlib.util

  path = harness.env.ROOT / "tests" / "test_experiments.py"
  spec = importlib.util.spec_from_file_location("bit_identity_small", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.small_config


def child(args) -> None:
  """Train one experiment in this tree; write {"digest": ...} or {"refused": line}."""
  harness.simulated_devices(1)
  import run
  from recgnn.train import loop

  small_config = _small_config()

  config = small_config(args.experiment, args.cache_dir)
  with config.unlocked():
    config.train.steps = args.steps
  with tempfile.TemporaryDirectory() as wd:
    try:
      res = loop.train(config, wd)
    except Exception as e:
      if not run.is_user_error(e) or "--config.data.path" not in str(e):
        raise
      out = {"refused": str(e).splitlines()[0]}
    else:
      out = {"digest": digest(res.state, res.plan), "step": res.metrics["step"]}
  with open(args.child_out, "w") as f:
    json.dump(out, f)


def compare(runs: dict) -> dict:
  """{experiment: "same" | "differs: ..." } from each tree's child output."""
  out = {}
  for name, per in runs.items():
    a, b = per.values()
    if "absent" in b:
      out[name] = "new in this tree (no such experiment at the earlier commit)"
      continue
    if "refused" in a and "refused" in b:
      out[name] = "same (both refuse without data)"
      continue
    da, db = a.get("digest"), b.get("digest")
    if da == db:
      out[name] = f"same ({len(da)} digests: params and {len(da) - 1} tables)"
    else:
      diff = sorted(
        k for k in set(da or {}) | set(db or {}) if (da or {}).get(k) != (db or {}).get(k)
      )
      out[name] = f"differs: {', '.join(diff[:6])}"
  return out


def main():
  ap = harness.flags.parser(__doc__)
  ap.add_argument("--against", required=False, default="", metavar="COMMIT")
  ap.add_argument("--experiments", default="")
  ap.add_argument("--steps", type=int, default=STEPS)
  ap.add_argument("--experiment", default="", help=argparse.SUPPRESS)
  ap.add_argument("--cache-dir", dest="cache_dir", default="", help=argparse.SUPPRESS)
  ap.add_argument("--child-out", dest="child_out", default="", help=argparse.SUPPRESS)
  ap.add_argument(
    "--quick", action="store_true", help="smoke run, not figures: smoke, 2 steps, against HEAD"
  )
  args = ap.parse_args()
  if args.quick:
    args.against, args.experiments, args.steps = args.against or "HEAD", "smoke", 2
  if args.child_out:
    child(args)
    return
  if not args.against:
    ap.error("--against=COMMIT is required")
  import run

  names = [n for n in args.experiments.split(",") if n] or sorted(run.available_experiments())
  runs: dict = {}
  with tempfile.TemporaryDirectory(prefix="bit_identity_") as tmp:
    trees, sha = harness.trees(args.against, tmp)
    for path in trees.values():  # (an archive holds no third_party/: the bundled datasets)
      data = os.path.join(path, "third_party")
      if not os.path.exists(data):
        os.symlink(harness.env.ROOT / "third_party", data)
    cache = os.path.join(tmp, "cache")
    for name in names:
      runs[name] = {}
      for t, path in trees.items():
        if not os.path.exists(os.path.join(path, "experiments", f"{name}.py")):
          runs[name][t] = {"absent": True}
          continue
        out = os.path.join(tmp, f"{name}_{t}.json")
        cmd = [sys.executable, os.path.abspath(__file__), f"--experiment={name}",
               f"--cache-dir={cache}", f"--steps={args.steps}", f"--child-out={out}"]  # fmt: skip
        harness.run_checked(cmd, env_vars={harness.env.TREE_VAR: path}, what=f"{name} @ {t}")
        with open(out) as f:
          runs[name][t] = json.load(f)
      print(f"{name}: {compare({name: runs[name]})[name]}", flush=True)
  verdict = compare(runs)
  payload = {"machine": harness.machine_info(), "args": vars(args), "commit": sha,
             "runs": runs, "verdict": verdict}  # fmt: skip
  rows = [[n, v] for n, v in verdict.items()]
  md = (
    f"# Bit identity against {sha[:10]} (benchmarks/bit_identity.py)\n\n"
    f"`{payload['machine']['command']}`, {payload['machine']['date_utc']}: every experiment "
    f"trained {args.steps} steps at tests/test_experiments.py's small scale (one CPU device) in "
    "each tree, its own process; the digests of the dense params and every table's rows.\n\n"
    + harness.md_table(["experiment", f"this vs {sha[:10]}"], rows, "ll")
    + "\n"
  )
  harness.write_results("bit_identity", payload, md)


if __name__ == "__main__":
  main()
