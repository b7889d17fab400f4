"""bf16 compute against float32 on the quick start (issue 43 item 4): test AUC over seeds.

Question: does `model.dtype=bfloat16` (bf16 MLPs and interaction; float32 params, optimizer
and embedding state, float32 loss) train the quick start (`python run.py
--experiment=dlrm_kaggle`: one epoch of the synthetic Criteo-format data) to the float32 run's
test AUC? Issue 43's bar: within 0.002, over 3 seeds. Every run is its own `run.py` process
(seed s float32, then seed s bfloat16, ...), final evals only, no checkpoints.

  python benchmarks/bf16_auc.py                      # results/bf16_auc.{json,md}
  python benchmarks/bf16_auc.py --seeds=0,1,2 --steps=0 --experiment=dlrm_kaggle
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import harness

ROOT = harness.ROOT
TARGET = 0.002  # issue 43: |AUC(bf16) - AUC(f32)| per seed


def run_one(args, seed: int, dtype: str) -> dict:
  workdir = tempfile.mkdtemp(prefix=f"bf16_auc_{dtype}_{seed}_")
  cmd = [sys.executable, str(ROOT / "run.py"), f"--experiment={args.experiment}",
         f"--workdir={workdir}", f"--config.seed={seed}", f"--config.model.dtype={dtype}",
         "--config.train.checkpoint_every=0", "--config.train.eval_every=0"]  # fmt: skip
  if args.steps:
    cmd.append(f"--config.train.steps={args.steps}")
  load = os.getloadavg()[0]
  t0 = time.perf_counter()
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
  try:
    if proc.returncode:
      tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
      raise SystemExit(f"seed {seed} {dtype} failed (exit {proc.returncode}):\n{tail}")
    with open(os.path.join(workdir, "results.json")) as f:
      res = json.load(f)
  finally:
    shutil.rmtree(workdir, ignore_errors=True)
  out = {k: res[k] for k in ("test/auc", "test/logloss", "valid/auc", "step") if k in res}
  out.update(seconds=time.perf_counter() - t0, load_before=load)
  print(f"seed {seed} {dtype}: test AUC {out['test/auc']:.5f} ({out['seconds']:.0f} s, load "
        f"{load:.1f})", flush=True)  # fmt: skip
  return out


def main():
  ap = harness.flags.parser(__doc__)
  ap.add_argument("--experiment", default="dlrm_kaggle")
  ap.add_argument("--seeds", default="0,1,2")
  ap.add_argument("--steps", type=int, default=0, help="0: the experiment's (one epoch)")
  ap.add_argument("--name", default="bf16_auc")
  ap.add_argument("--quick", action="store_true", help="smoke run, not figures: one seed, 20 steps")
  args = ap.parse_args()
  if args.quick:
    args.seeds, args.steps = "0", 20
  seeds = [int(s) for s in args.seeds.split(",")]
  runs = {s: {d: run_one(args, s, d) for d in ("float32", "bfloat16")} for s in seeds}
  diffs = {s: r["bfloat16"]["test/auc"] - r["float32"]["test/auc"] for s, r in runs.items()}
  worst = max(abs(d) for d in diffs.values())
  payload = {"machine": harness.machine_info(), "args": vars(args), "runs": runs,
             "auc_bf16_minus_f32": diffs, "worst_abs": worst,
             "within_target": worst <= TARGET}  # fmt: skip
  rows = [[s, f"{r['float32']['test/auc']:.5f}", f"{r['bfloat16']['test/auc']:.5f}",
           f"{diffs[s]:+.5f}", f"{r['float32']['test/logloss']:.5f}",
           f"{r['bfloat16']['test/logloss']:.5f}"] for s, r in runs.items()]  # fmt: skip
  m = payload["machine"]
  md = "\n".join([
    "# bf16 compute against float32 (benchmarks/bf16_auc.py)",
    "",
    f"`{m['command']}` on {m['cpus']} CPUs, {m['date_utc']}: `run.py --experiment="
    f"{args.experiment}` per seed and dtype, {'the experiment' if not args.steps else args.steps}"
    f"{' steps' if args.steps else chr(39) + 's length'}, final evals only.",
    "",
    harness.md_table(["seed", "f32 test AUC", "bf16 test AUC", "bf16 - f32", "f32 logloss",
                     "bf16 logloss"], rows),  # fmt: skip
    "",
    f"- worst |bf16 - f32| = {worst:.5f} (target <= {TARGET}): "
    f"{'yes' if worst <= TARGET else 'NO'}; mean {statistics.fmean(diffs.values()):+.5f}",
  ]) + "\n"  # fmt: skip
  harness.write_results(args.name, payload, md)


if __name__ == "__main__":
  main()
