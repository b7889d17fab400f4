"""plan=auto against hand-written plans at the same memory budget (issue 28).

For each budget (a fraction of the all-dense plan's bytes per device): the hand-written plans
that fit it (all dense; the largest tables moved to offload / hot_cold at 20%, 5%, 1% of their
rows until the plan fits), and the `auto(budget=...)` rule, each trained by `run.py` in its
own process, interleaved over rounds (every plan once per round, the order rotated). Per plan:
its bytes per device, the median samples/s of each run's logged intervals after the first (the
compile), ms per step min / median / max over the rounds; for auto, what it chose and the
embedding step it predicted (auto_plan.json of each run). The must-show: auto's median no worse
than the best hand-written plan's that fits the same budget.

  python benchmarks/auto_plan.py                     # dlrm_kaggle, budgets 1, 0.25, 0.05, 0.01
  python benchmarks/auto_plan.py --quick             # 2 budgets, fewer steps, one round
  --experiment=E --budgets=1,0.1 --steps=200 --rounds=3 --mesh=1x1
Writes benchmarks/results/auto_plan[_quick].{json,md}.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common  # noqa: E402
from recgnn.embeddings import auto_plan, base  # noqa: E402
from recgnn.train import setup  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FRACTIONS = (0.2, 0.05, 0.01)


def plan_text(rules) -> str:
  return "(" + "".join(f"({p!r}, {t!r}), " for p, t in rules) + ")"


def hand_written(
  specs, dense_bytes: dict[str, int], budget: int, mesh, batch: int
) -> dict[str, list]:
  """{name: rules} of the hand-written plans that fit `budget` bytes per device: all dense,
  and for each host tier and fraction the largest tables moved to it, one by one, until the
  plan fits (a table whose share would hold fewer rows than a batch's ids stays dense: its
  cache could not hold one batch)."""
  plans = {}
  if sum(dense_bytes.values()) <= budget:
    plans["all dense"] = [(".*", "dense")]
  by_size = sorted(specs, key=lambda s: -dense_bytes[s.name])
  for kind, opt in (("offload", "cache_fraction"), ("hot_cold", "budget")):
    for f in FRACTIONS:
      text = f"{kind}({opt}={f})"
      used = dict(dense_bytes)
      moved = []
      for s in by_size:
        if sum(used.values()) <= budget:
          break
        if f * s.num_rows < batch:
          continue
        used[s.name] = auto_plan.memory_of(text, s, mesh, base.Layout())[0]
        moved.append(s.name)
      if moved and sum(used.values()) <= budget:
        pattern = "|".join(moved)
        plans[f"{kind} {f:g} on {len(moved)} largest"] = [(pattern, text), (".*", "dense")]
  return plans


def run_plan(args, rules, workdir: str) -> dict:
  flags = {
    "train.steps": args.steps,
    "train.log_every": args.log_every,
    "train.checkpoint_every": 0,
    "train.eval_every": 0,
    "train.final_eval_splits": "()",
    "embeddings.plan": plan_text(rules),
    "mesh.data": args.mesh[0],
    "mesh.model": args.mesh[1],
  }
  load = os.getloadavg()[0]
  t0 = time.perf_counter()
  steady = common.trainer_process(ROOT, args.experiment, workdir, flags)
  out = {"samples_per_s": statistics.median(steady), "load_before": load,
         "wall_s": time.perf_counter() - t0}  # fmt: skip
  choice = os.path.join(workdir, "auto_plan.json")
  if os.path.exists(choice):
    with open(choice) as f:
      out["auto_plan"] = json.load(f)
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--experiment", default="dlrm_kaggle")
  p.add_argument("--budgets", default="1,0.25,0.05,0.01")
  p.add_argument("--steps", type=int, default=200)
  p.add_argument("--log_every", type=int, default=40)
  p.add_argument("--rounds", type=int, default=2)
  p.add_argument("--mesh", default="1x1", help="DATAxMODEL")
  p.add_argument("--quick", action="store_true")
  p.add_argument("--name", default="")
  args = p.parse_args(argv)
  if args.quick:
    args.budgets, args.steps, args.log_every, args.rounds = "1,0.05", 60, 20, 1
  args.mesh = tuple(int(x) for x in args.mesh.split("x"))
  budgets = [float(b) for b in args.budgets.split(",")]

  config = importlib.import_module(f"experiments.{args.experiment}").get_config()
  config.mesh = {"data": args.mesh[0], "model": args.mesh[1]}
  mesh = setup.config_mesh(config)
  task = setup.load_task(config, mesh)
  specs = task.tables()
  dense = {s.name: auto_plan.memory_of("dense", s, mesh, base.Layout())[0] for s in specs}
  total = sum(dense.values())
  print(f"{args.experiment}: {len(specs)} tables, all dense {total / 2**20:,.1f} MiB per device")

  contestants = []  # (budget, name, rules)
  for b in budgets:
    limit = int(total * b)
    for name, rules in hand_written(specs, dense, limit, mesh, config.train.batch_size).items():
      contestants.append((b, name, rules))
    contestants.append((b, "auto", [(".*", f"auto(budget={b})")]))
  runs: dict[tuple[float, str], list[dict]] = {(b, n): [] for b, n, _ in contestants}
  tmp = tempfile.mkdtemp(prefix="auto_plan_")
  try:
    for r in range(args.rounds):
      k = r % len(contestants)
      for b, name, rules in contestants[k:] + contestants[:k]:
        workdir = os.path.join(tmp, f"{r}_{b}_{len(runs[(b, name)])}_{name.replace(' ', '_')}")
        res = run_plan(args, rules, workdir)
        shutil.rmtree(workdir, ignore_errors=True)
        runs[(b, name)].append(res)
        print(f"round {r + 1} budget {b:g} {name}: {res['samples_per_s']:,.0f} samples/s, "
              f"load {res['load_before']:.1f}", flush=True)  # fmt: skip
  finally:
    shutil.rmtree(tmp, ignore_errors=True)

  batch = config.train.batch_size
  rows, checks = [], []
  for b in budgets:
    best_hand = None
    for (bb, name), rs in runs.items():
      if bb != b:
        continue
      ms = sorted(1e3 * batch / x["samples_per_s"] for x in rs)
      med = statistics.median(ms)
      if name != "auto" and (best_hand is None or med < best_hand[1]):
        best_hand = (name, med)
      chosen = ""
      if name == "auto":
        picks = [x["auto_plan"]["chosen"] for x in rs if "auto_plan" in x]
        kinds = {}
        for v in picks[-1].values() if picks else []:
          kinds[v["text"]] = kinds.get(v["text"], 0) + 1
        chosen = ", ".join(f"{n} x {t}" for t, n in sorted(kinds.items(), key=lambda kv: -kv[1]))
      rows.append((f"{b:g}", name, f"{ms[0]:.1f} / {med:.1f} / {ms[-1]:.1f}", chosen))
    auto_med = statistics.median(1e3 * batch / x["samples_per_s"] for x in runs[(b, "auto")])
    if best_hand is not None:
      checks.append(
        f"budget {b:g}: auto {auto_med:.1f} ms vs best hand-written ({best_hand[0]}) "
        f"{best_hand[1]:.1f} ms: {auto_med / best_hand[1]:.2f}x "
        + ("(no worse)" if auto_med <= best_hand[1] else "(WORSE)")
      )
  m = common.machine_info()
  loads = [x["load_before"] for rs in runs.values() for x in rs]
  md = "\n".join([
    "# plan=auto against hand-written plans at the same budget",
    "",
    f"{args.experiment}, mesh {args.mesh[0]}x{args.mesh[1]}, {args.steps} steps per run, "
    f"{args.rounds} round(s) interleaved; all dense {total / 2**20:,.1f} MiB per device; ms per "
    f"step from the median samples/s of each run's intervals after the first. {m['cpus']} "
    f"CPUs, load {min(loads):.1f}-{max(loads):.1f}, {m['date_utc']}, jax {m['jax']}. "
    f"`{m['command']}`.",
    "",
    common.md_table(("budget", "plan", "ms / step min / median / max", "auto chose"), rows),
    "",
    *[f"- {c}" for c in checks],
  ])  # fmt: skip
  payload = {"config": vars(args), "machine": m, "all_dense_bytes": total, "checks": checks,
             "runs": {f"{b:g}|{n}": rs for (b, n), rs in runs.items()}}  # fmt: skip
  common.write_results(args.name or ("auto_plan" + "_quick" * args.quick), payload, md)


if __name__ == "__main__":
  main()
