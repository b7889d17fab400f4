"""Criteo-format files in raw-id mode (`data.categorical=raw`: no counting pass, every table a
`dynamic(...)` one, ids the files' 32-bit values themselves) against the dictionary mode
(`frequency`: a counting pass, then dense tables): time to the first training step, and test
AUC after the same steps, over seeds and both initializers.

Question: what does skipping the dictionary pass save before the first step, and does the
raw path train to the dictionary run's AUC where the capacity holds every id?

A synthetic Criteo-format TSV (`recgnn.data.criteo_synthetic`, `--rows` lines, cardinalities
Kaggle's x `--scale`; generated once under `--dir`, never committed) is read by the Criteo
reader into a fresh cache per mode. Time to first step: `loop.train(steps=1)` from a cold
cache (conversion, build, compile, one step; no eval). Then, for each initializer and seed
(`config.seed`: the tables' and the model's initial values and the train order), both modes
train `--steps` steps of the smoke DLRM at batch 2048 from their caches and evaluate the test
split; the paired difference is raw - dictionary at the same initializer and seed.

Raw capacity, per table, as a user sizing each table would: the dictionary table's rows (the
column's distinct values + its missing and unknown ids), so every id has a row (nothing
evicted) and `uniform`'s U(+-1/sqrt(rows)) has the same scale in both modes (a dynamic
table's rows are its capacity; TorchRec's managed-collision tables also take the scale from
their size). `--capacity N` gives every table N rows instead (the shared-capacity run).

  python benchmarks/dynamic_raw_criteo.py --rows 10_000_000       # ~20 minutes here
  python benchmarks/dynamic_raw_criteo.py --quick                 # 300,000 rows, 100 steps
Writes benchmarks/results/dynamic_raw_criteo.{json,md} (or --out).
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import time

import harness

from experiments import smoke
from recgnn.data import criteo, criteo_synthetic
from recgnn.train import loop

MODES = ("frequency", "raw")


def _config(args, tsv: str, mode: str, cache: str, steps: int, init: str, seed: int, rules):
  c = smoke.get_config()
  c.seed = seed
  c.data.path = tsv
  c.data.cache_dir = cache
  c.data.categorical = mode
  c.train.batch_size = 2048
  c.train.steps = steps
  c.train.log_every = max(1, steps)
  c.train.eval_every = 0
  c.train.checkpoint_every = 0
  c.train.final_eval_splits = ("test",) if steps > 1 else ()
  c.embeddings.initializer = init
  if mode == "raw":
    c.embeddings.plan = rules
  return c


def raw_rules(rows: dict[str, int], capacity: int) -> tuple:
  """The raw run's plan: each table dynamic with `capacity` rows, or (0) its dictionary
  table's rows; tables of one capacity share a group."""
  by_cap: dict[int, list[str]] = {}
  for name, n in rows.items():
    by_cap.setdefault(capacity or n, []).append(name)
  return tuple(
    ("|".join(names), f"dynamic(capacity={cap}, evict=none)") for cap, names in by_cap.items()
  )


def first_step(args, tsv: str, mode: str, rules) -> tuple[float, dict[str, int]]:
  """(seconds from a cold cache to the first step done, conversion included; the rows of
  each table's spec)."""
  cache, wd = (os.path.join(args.dir, f"{k}-{mode}") for k in ("cache", "wd1"))
  for d in (cache, wd):
    shutil.rmtree(d, ignore_errors=True)
  t0 = time.perf_counter()
  done = loop.train(_config(args, tsv, mode, cache, 1, args.initializers[0], 0, rules), wd)
  seconds = time.perf_counter() - t0
  return seconds, {n: s.num_rows for g in done.plan.groups.values() for n, s in g.specs.items()}


def train_once(args, tsv: str, mode: str, init: str, seed: int, rules) -> dict:
  cache, wd = os.path.join(args.dir, f"cache-{mode}"), os.path.join(args.dir, f"wd-{mode}")
  shutil.rmtree(wd, ignore_errors=True)
  t0 = time.perf_counter()
  trained = loop.train(_config(args, tsv, mode, cache, args.steps, init, seed, rules), wd)
  out = {"mode": mode, "initializer": init, "seed": seed, "train_s": time.perf_counter() - t0,
         "test_auc": trained.metrics["test/auc"]}  # fmt: skip
  if mode == "raw":
    maps = [m for g in trained.plan.groups.values() for m in g.maps.values()]
    out["evicted"] = sum(m.counters()["evicted"] for m in maps)
    out["rejected"] = sum(m.counters()["rejected"] for m in maps)
  print(f"  {out}", flush=True)
  return out


def spread(values) -> dict:
  return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def summary(runs: list[dict], init: str) -> dict:
  """AUC spreads of both modes and of the paired (same seed) differences at `init`."""
  auc = {m: {r["seed"]: r["test_auc"] for r in runs if r["mode"] == m and r["initializer"] == init}
         for m in MODES}  # fmt: skip
  diffs = [auc["raw"][s] - auc["frequency"][s] for s in sorted(auc["raw"])]
  within = all(abs(d) <= 0.002 for d in diffs)
  return {"frequency": spread(list(auc["frequency"].values())),
          "raw": spread(list(auc["raw"].values())), "diff": spread(diffs), "diffs": diffs,
          "within_0.002": within}  # fmt: skip


def _uptime() -> str:
  return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def parse():
  p = harness.flags.parser(__doc__)
  p.add_argument("--rows", type=int, default=10_000_000)
  p.add_argument("--scale", type=float, default=0.001)
  p.add_argument("--steps", type=int, default=1000)
  p.add_argument("--seeds", type=int, default=3)
  p.add_argument("--dir", default="/tmp/recgnn_dynamic_raw")
  p.add_argument("--out", default="dynamic_raw_criteo")
  p.add_argument(
    "--initializers", default="uniform,normal",
    help="uniform: U(+-1/sqrt(rows)), rows a dynamic table's capacity, a dictionary table's "
    "cardinality; normal: N(0, 1/dim) in both modes",
  )  # fmt: skip
  p.add_argument("--capacity", type=int, default=0, help="0: per table (see above)")
  p.add_argument("--quick", action="store_true", help="300,000 rows, 100 steps, 1 seed")
  args = p.parse_args()
  if args.quick:
    args.rows, args.steps, args.seeds, args.out = 300_000, 100, 1, "dynamic_raw_quick"
  args.initializers = tuple(args.initializers.split(","))
  return args


def measure(args, tsv: str) -> dict:
  """Time to first step per mode, then every (initializer, seed) in both modes."""
  first = {}
  first["frequency"], rows = first_step(args, tsv, "frequency", ())
  rows = {n: rows[n] for n in criteo.TABLE_NAMES}
  rules = raw_rules(rows, args.capacity)
  first["raw"], _ = first_step(args, tsv, "raw", rules)
  print(f"  time to first step: {first}", flush=True)
  runs = [
    train_once(args, tsv, mode, init, seed, rules)
    for init in args.initializers
    for seed in range(args.seeds)
    for mode in MODES
  ]
  return {"first_step_s": first, "runs": runs, "dictionary_rows": rows, "rules": rules}


def markdown(args, payload, info, up) -> str:
  m, r = payload["machine"], payload["result"]
  first = r["first_step_s"]
  lines = [
    "# Criteo-format data: raw-id mode (dynamic tables) against the dictionary", "",
    f"Command: `python benchmarks/dynamic_raw_criteo.py {' '.join(payload['argv'])}`; "
    f"{args.rows:,} synthetic rows (cardinality scale {args.scale}), smoke DLRM at batch 2048, "
    f"{args.steps} steps, seeds 0..{args.seeds - 1}; raw capacity "
    f"{args.capacity or 'per table: the dictionary table rows'} (largest "
    f"{max(r['dictionary_rows'].values()):,}; {len(r['rules'])} dynamic groups); evicted "
    f"{sum(x.get('evicted', 0) for x in r['runs'])}; oracle test AUC {info.get('oracle_auc')}; "
    f"{m.get('cpu_model')}, {m.get('cpus')} CPUs.", "",
    f"`uptime` before: `{up[0]}`; after: `{up[1]}`.", "",
    f"Time to first step (cold cache, conversion included): dictionary {first['frequency']:.1f}"
    f" s, raw {first['raw']:.1f} s.", "",
  ]  # fmt: skip
  rows = []
  for init in args.initializers:
    s = r["summary"][init]
    fmt = lambda d: f"{d['min']:.4f} / {d['median']:.4f} / {d['max']:.4f}"  # noqa: E731
    diff = s["diff"]
    rows.append([init, fmt(s["frequency"]), fmt(s["raw"]),
                 f"{diff['min']:+.4f} / {diff['median']:+.4f} / {diff['max']:+.4f}",
                 ", ".join(f"{d:+.4f}" for d in s["diffs"]),
                 "yes" if s["within_0.002"] else "no"])  # fmt: skip
  header = ["initializer", "dictionary AUC min / median / max", "raw AUC min / median / max",
            "raw - dictionary (paired) min / median / max", "per seed",
            "every seed within 0.002"]  # fmt: skip
  lines += [harness.md_table(header, rows), ""]
  train = [[x["mode"], x["initializer"], x["seed"], f"{x['test_auc']:.4f}", f"{x['train_s']:.1f}"]
           for x in r["runs"]]  # fmt: skip
  lines += [harness.md_table(["mode", "initializer", "seed", "test AUC", "run (s)"], train), ""]
  return "\n".join(lines)


def main():
  args = parse()
  up = [_uptime()]
  payload = harness.record(args)
  os.makedirs(args.dir, exist_ok=True)
  cfg = criteo_synthetic.SyntheticConfig(num_rows=args.rows, scale=args.scale, seed=0)
  tsv = os.path.join(args.dir, f"train-{args.rows}-{args.scale}.txt")
  if criteo_synthetic.load_info(tsv) is None:
    criteo_synthetic.generate_tsv(tsv, cfg)
  info = criteo_synthetic.load_info(tsv)
  result = measure(args, tsv)
  result["summary"] = {i: summary(result["runs"], i) for i in args.initializers}
  up.append(_uptime())
  payload.update(result=result, oracle_auc=info.get("oracle_auc"), uptime=up)
  payload["machine"]["load_avg_at_end"] = os.getloadavg()
  harness.write_results(args.out, payload, markdown(args, payload, info, up))


if __name__ == "__main__":
  main()
