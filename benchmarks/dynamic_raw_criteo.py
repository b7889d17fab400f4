"""Criteo-format files in raw-id mode (`data.categorical=raw`: no counting pass, every table a
`dynamic(...)` one) against the dictionary mode (`frequency`: a counting pass, then dense
tables): time to the first training step, and test AUC after the same steps.

Question: what does skipping the dictionary pass save before the first step, and does the
raw path train to the dictionary run's AUC where the capacity holds every id?

A synthetic Criteo-format TSV (`recgnn.data.criteo_synthetic`, `--rows` lines, cardinalities
Kaggle's x `--scale`; generated once under `--dir`, never committed) is read by the Criteo
reader into a fresh cache per mode. Time to first step: `loop.train(steps=1)` from a cold
cache (conversion, build, compile, one step; no eval). Then both modes train `--steps`
steps of the smoke DLRM at batch 2048 from their caches and evaluate the test split. Raw
mode's capacity: the next power of two above the dictionary run's largest table (every id
has a row: nothing evicted).

  python benchmarks/dynamic_raw_criteo.py --rows 10_000_000       # ~15 minutes here
  python benchmarks/dynamic_raw_criteo.py --rows 300_000 --steps 100 --out dynamic_raw_quick
Writes benchmarks/results/dynamic_raw_criteo.{json,md} (or --out).
"""

from __future__ import annotations

import os
import shutil
import time

import harness

from experiments import smoke
from recgnn.data import criteo_synthetic
from recgnn.train import loop


def _config(args, tsv: str, mode: str, cache: str, steps: int, capacity: int = 0):
  c = smoke.get_config()
  c.data.path = tsv
  c.data.cache_dir = cache
  c.data.categorical = mode
  c.train.batch_size = 2048
  c.train.steps = steps
  c.train.log_every = max(1, steps)
  c.train.eval_every = 0
  c.train.checkpoint_every = 0
  c.train.final_eval_splits = ("test",) if steps > 1 else ()
  c.embeddings.initializer = args.initializer
  if mode == "raw":
    c.embeddings.plan = ((".*", f"dynamic(capacity={capacity}, evict=none)"),)
  return c


def run_mode(args, tsv: str, mode: str, capacity: int = 0) -> dict:
  cache, wd1, wd = (os.path.join(args.dir, f"{k}-{mode}") for k in ("cache", "wd1", "wd"))
  for d in (cache, wd1, wd):
    shutil.rmtree(d, ignore_errors=True)
  t0 = time.perf_counter()
  loop.train(_config(args, tsv, mode, cache, 1, capacity), wd1)
  first_step_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  trained = loop.train(_config(args, tsv, mode, cache, args.steps, capacity), wd)
  out = {"mode": mode, "first_step_s": first_step_s, "train_s": time.perf_counter() - t0,
         "test_auc": trained.metrics["test/auc"], "capacity": capacity}  # fmt: skip
  if mode == "raw":
    (group,) = trained.plan.groups.values()
    out["evicted"] = sum(m.counters()["evicted"] for m in group.maps.values())
    out["admitted"] = sum(m.counters()["admitted"] for m in group.maps.values())
  else:
    out["largest_table"] = max(
      s.num_rows for g in trained.plan.groups.values() for s in g.specs.values()
    )
  print(f"  {mode}: {out}", flush=True)
  return out


def main():
  p = harness.flags.parser(__doc__)
  p.add_argument("--rows", type=int, default=10_000_000)
  p.add_argument("--scale", type=float, default=0.001)
  p.add_argument("--steps", type=int, default=1000)
  p.add_argument("--dir", default="/tmp/recgnn_dynamic_raw")
  p.add_argument("--out", default="dynamic_raw_criteo")
  p.add_argument(
    "--initializer",
    default="uniform",
    help="uniform: U(+-1/sqrt(rows)), rows a dynamic table's capacity, a dictionary table's "
    "cardinality; normal: N(0, 1/dim) in both modes",
  )
  p.add_argument("--quick", action="store_true", help="300,000 rows, 100 steps (a smoke run)")
  args = p.parse_args()
  if args.quick:
    args.rows, args.steps, args.out = 300_000, 100, "dynamic_raw_quick"
  payload = harness.record(args)
  os.makedirs(args.dir, exist_ok=True)
  cfg = criteo_synthetic.SyntheticConfig(num_rows=args.rows, scale=args.scale, seed=0)
  tsv = os.path.join(args.dir, f"train-{args.rows}-{args.scale}.txt")
  if criteo_synthetic.load_info(tsv) is None:
    criteo_synthetic.generate_tsv(tsv, cfg)
  info = criteo_synthetic.load_info(tsv)
  dictionary = run_mode(args, tsv, "frequency")
  capacity = 1 << (dictionary["largest_table"] - 1).bit_length()
  raw = run_mode(args, tsv, "raw", capacity)
  payload.update(dictionary=dictionary, raw=raw, oracle_auc=info.get("oracle_auc"))
  payload["machine"]["load_avg_at_end"] = os.getloadavg()
  m = payload["machine"]
  rows = [
    [r["mode"], f"{r['first_step_s']:.1f}", f"{r['test_auc']:.4f}", f"{r['train_s']:.1f}"]
    for r in (dictionary, raw)
  ]
  md = "\n".join([
    "# Criteo-format data: raw-id mode (dynamic tables) against the dictionary", "",
    f"Command: `python benchmarks/dynamic_raw_criteo.py {' '.join(payload['argv'])}`; "
    f"{args.rows:,} synthetic rows (cardinality scale {args.scale}), smoke DLRM at batch 2048, "
    f"{args.steps} steps, initializer {args.initializer}; raw capacity {capacity:,} per "
    "table (dictionary's largest table "
    f"{dictionary['largest_table']:,} rows; evicted {raw.get('evicted')}); oracle test AUC "
    f"{info.get('oracle_auc')}; load {m.get('load_avg_at_start')} at start, "
    f"{m.get('load_avg_at_end')} at end; {m.get('cpu_model')}, {m.get('cpus')} CPUs.", "",
    harness.md_table(["mode", "time to first step (s)", "test AUC", "training (s)"], rows), "",
    f"AUC difference (raw - dictionary): {raw['test_auc'] - dictionary['test_auc']:+.4f}.", "",
  ])  # fmt: skip
  harness.write_results(args.out, payload, md)


if __name__ == "__main__":
  main()
