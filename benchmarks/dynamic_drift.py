"""Dynamic tables on a drifting stream, through the trainer: test AUC at equal memory.

The stream (recgnn/data/drifting_ctr.py, experiments/dynamic_drift.py): 7 days of 20 batches
of 2048, 20,000 ids born a day and each alive 3 days, Zipf popularity among the live ids,
labels from a planted per-id model (the oracle AUC is the true probabilities'). The trainer
(the DLRM of the experiment, one table of C rows, row-wise Adagrad) trains once over days
0-5 in stream order and is tested on day 6. C is 1/2 and 1/8 of the stream's distinct ids,
and the ids reach the C rows as
  dynamic lru   `dynamic(capacity=C, evict=lru)` on the raw ids (immediate admission)
  dynamic lfu   the same, evict=lfu
  dynamic lru, admit count(2)   admitted at an id's 2nd occurrence (before: the zero row)
  hashing       the hashing trick into C rows (the schema's vocab="hash")
  first day     a dictionary of the first day's most frequent ids (the rest: one shared row)
with the hashing trick's collision rate beside them (the share of distinct ids whose row
holds another id too). `--seeds` seeds: each seed is its own stream and model init, so the
paired difference per seed is the comparison.

  python benchmarks/dynamic_drift.py --quick     # 1 seed, capacity 1/2 (~1 minute)
  python benchmarks/dynamic_drift.py             # 3 seeds (~4 minutes)
Writes benchmarks/results/dynamic_drift.{json,md}.
"""

from __future__ import annotations

import os
import tempfile

import harness
import numpy as np

import run  # noqa: E402
from recgnn.data import drifting_ctr  # noqa: E402
from recgnn.train import loop  # noqa: E402

VARIANTS = {
  "dynamic lru": "ids=dynamic,evict=lru",
  "dynamic lfu": "ids=dynamic,evict=lfu",
  "dynamic lru, admit count(2)": "ids=dynamic,evict=lru,admit=count,k=2",
  "hashing": "ids=hash",
  "first day": "ids=first_day",
}
SHARES = {"1/2": 0.5, "1/8": 0.125}


def one(variant: str, share: str, seed: int, tmp: str) -> dict:
  """One trainer run: its final metrics and the data's info (capacity, collision rate)."""
  arg = f"{VARIANTS[variant]},capacity={SHARES[share]},seed={seed}"
  c = run.load_config(f"dynamic_drift:{arg}")
  cache = os.path.join(tmp, "cache")
  c = run.apply_overrides(
    c, ["--config.mesh.data=1", "--config.mesh.model=1", f"--config.data.cache_dir={cache}"]
  )
  res = loop.train(c, os.path.join(tmp, f"{variant}-{share}-{seed}".replace(" ", "_"))).metrics
  stream = drifting_ctr.Stream(seed=seed)
  _, info = drifting_ctr.write(os.path.join(cache, "drifting"), stream, c.data.drifting.capacity)
  row = {
    **{"variant": variant, "share": share, "seed": seed, "capacity": info["capacity"]},
    **{"distinct": info["distinct_ids"], "collision": info["hash_collision_rate"]},
    **{"test_auc": res["test/auc"], "oracle_auc": res["test/oracle_auc"]},
  }
  print(f"  seed {seed} C={share} {variant:>28}: test AUC {row['test_auc']:.4f} "
        f"(oracle {row['oracle_auc']:.4f})", flush=True)  # fmt: skip
  return row


def spread(values) -> str:
  v = np.asarray(values)
  return f"{np.median(v):.4f} ({v.min():.4f}-{v.max():.4f})"


def markdown(payload) -> str:
  rows, m = payload["runs"], payload["machine"]
  table = []
  for share in payload["args"]["shares"]:
    rs = [r for r in rows if r["share"] == share]
    by = {v: {r["seed"]: r["test_auc"] for r in rs if r["variant"] == v} for v in VARIANTS}
    seeds = sorted(by["hashing"])
    diff = [by["dynamic lru"][s] - by["hashing"][s] for s in seeds]
    capacity = sorted({r["capacity"] for r in rs})
    table.append([share, ", ".join(f"{x:,}" for x in capacity),
                  *(spread(list(by[v].values())) for v in VARIANTS),
                  f"{np.median(diff):+.4f} ({min(diff):+.4f} to {max(diff):+.4f}; "
                  f"{sum(d > 0 for d in diff)}/{len(diff)} seeds)",
                  f"{np.mean([r['collision'] for r in rs]):.1%}",
                  spread([r["oracle_auc"] for r in rs if r["variant"] == "hashing"])])  # fmt: skip
  return "\n".join([
    "# Dynamic tables on a drifting stream, through the trainer", "",
    f"Command: `python benchmarks/dynamic_drift.py {' '.join(payload['argv'])}`; load "
    f"{m.get('load_avg_at_start')} at start, {m.get('load_avg_at_end')} at end; "
    f"{m.get('cpu_model')}, {m.get('cpus')} CPUs.", "",
    "experiments/dynamic_drift.py: 7 days x 20 batches of 2048, 20,000 ids born a day, each "
    "alive 3 days; one pass over days 0-5 in stream order, test AUC on day 6's first half. "
    "Test AUC median (min-max) over seeds; C = capacity rows, equal for every variant.", "",
    harness.md_table(["C / distinct ids", "C", *VARIANTS, "dynamic lru - hashing (paired)",
                      "hashing's collision rate", "oracle AUC"], table), "",
    "The collision rate is the share of the stream's distinct ids whose hashed row holds "
    "another id too. The first-day dictionary knows none of day 6's ids (each lives 3 days): "
    "they all read its one shared row.", "",
  ])  # fmt: skip


def main():
  p = harness.flags.parser(__doc__)
  p.add_argument("--quick", action="store_true")
  p.add_argument("--seeds", type=int, default=3)
  args = p.parse_args()
  args.shares = ["1/2"] if args.quick else list(SHARES)
  if args.quick:
    args.seeds = 1
  payload = harness.record(args)
  with tempfile.TemporaryDirectory() as tmp:
    payload["runs"] = [
      one(v, share, seed, tmp)
      for seed in range(args.seeds) for share in args.shares for v in VARIANTS
    ]  # fmt: skip
  payload["machine"]["load_avg_at_end"] = os.getloadavg()
  harness.write_results("dynamic_drift", payload, markdown(payload))


if __name__ == "__main__":
  main()
