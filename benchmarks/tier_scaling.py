"""Is a memory tier's train step flat in its table's rows? step(10M rows) / step(1M rows).

Issue 42: on the one GPU measured, the host tiers copied every host table whole inside the
step (O(rows) per step), which XLA:CPU's program never showed. Their rows now move with the
batch (read on the input thread) and back after the step (a host writer), so nothing in the
step, nor on the input side, nor in the writer, should grow with the table. This measures it
on the trainer's own step (`recgnn.train.setup.build` of the reference Kaggle DLRM, `--tables`
tables, batch `--batch`) at two table sizes, the SAME accesses at both (Zipf ranks over
`--hot` rows, mapped to rows spread over the whole table by a fixed random choice: the same
number of distinct rows per batch, the same hit rates; only the table grows), with caches
and hot sets of fixed row counts. dense's own ratio is the day's machine (caches, TLB): the
claim is each tier's ratio within 1.1x of dense's, in the same run.

Per configuration and size (steps of all configurations interleaved round by round, built
once each, after `--warmup` steps):
  step ms         the jitted step, call to its state ready (median over the timed steps)
  input ms        prepare + pack of a batch on the calling thread (the trainer runs it on
                  its input thread: the host tiers' reads of the rows they load are here)
  writer ms       the host tiers' writer thread per step: the evicted rows' copy to the host
                  and their scatter into the tables (not its wait for the step)

  python benchmarks/tier_scaling.py                   # results/tier_scaling.{json,md}
  python benchmarks/tier_scaling.py --quick           # a smoke run (tier_scaling_quick.*)
"""

from __future__ import annotations

import os
import statistics
import time

import harness
import jax
import numpy as np
from harness import dlrm_task
from peers import dlrm as peers_dlrm

from recgnn import hostmem, sharding
from recgnn.train import setup as train_setup

PLANS = {
  "dense": "dense",
  "offload": "offload(cache_rows={cache}, lookahead=1)",
  "hot_cold": "hot_cold(hot_rows={cache}, profile_batches=8, split=False)",
}


def batches(cfg, rows: int, args, seed: int = 0) -> list[dict]:
  """The stream: Zipf ranks over `args.hot` rows (the same draws at every table size), each
  rank a fixed row of the table (chosen once, spread over all `rows`)."""
  rng = np.random.default_rng(seed)
  small = peers_dlrm.DlrmConfig(num_rows=args.hot, num_tables=args.tables)
  n = args.warmup + args.steps * args.rounds
  out = peers_dlrm.make_batches(small, args.batch, n, args.zipf, seed=seed, same_hot_rows=True)
  spread = [np.sort(rng.choice(rows, args.hot, replace=False)) for _ in range(args.tables)]
  names = dlrm_task.table_names(cfg.num_tables)
  host = []
  for b in out:
    x = dlrm_task.to_batch(b, names)
    x["ids"] = {n: spread[i][ids].astype(np.int32) for i, (n, ids) in enumerate(x["ids"].items())}
    host.append(x)
  return host


class Config:
  """One (backend, table size): its built run, its stream and its timings."""

  def __init__(self, label: str, text: str, rows: int, args):
    self.label, self.rows, self.text = label, rows, text
    self.cfg = peers_dlrm.DlrmConfig(num_rows=rows, num_tables=args.tables)
    config = dlrm_task.config_of(self.cfg)
    config.embeddings.plan = [(".*", text)]
    mesh = sharding.make_mesh(1, 1)
    self.host = batches(self.cfg, rows, args)
    t0 = time.perf_counter()
    task = dlrm_task.task_of(config, self.cfg, mesh)
    task.batches = self.host  # (a host tier's buffers sized by a train batch of these)
    self.run = train_setup.build(config, mesh=mesh, task=task, example=self.host[0])
    self.state = self.run.state
    self.build_s = time.perf_counter() - t0
    stream = [("train", None, b) for b in self.host]
    self.items = iter(self.run.feed(stream))
    self.step_s, self.input_s, self.writer_s = [], [], []

  def writer_seconds(self) -> float:
    groups = self.run.plan.groups.values()
    return sum(g.host_write_seconds() for g in groups if hasattr(g, "host_write_seconds"))

  def steps(self, n: int, timed: bool) -> None:
    w0 = self.writer_seconds()
    for _ in range(n):
      t0 = time.perf_counter()
      _, packed = next(self.items)
      jax.block_until_ready(packed)
      t1 = time.perf_counter()
      self.state, metrics = self.run.train_step(self.state, *packed)
      jax.block_until_ready(self.state)
      t2 = time.perf_counter()
      if timed:
        self.input_s.append(t1 - t0)
        self.step_s.append(t2 - t1)
    if timed:
      self.writer_s.append((self.writer_seconds() - w0) / n)

  def row(self) -> dict:
    med = lambda xs: 1e3 * statistics.median(xs) if xs else float("nan")  # noqa: E731
    return {
      "label": self.label,
      "plan": self.text,
      "rows": self.rows,
      "step_ms": med(self.step_s),
      "step_ms_min": 1e3 * min(self.step_s),
      "step_ms_max": 1e3 * max(self.step_s),
      "input_ms": med(self.input_s),
      "writer_ms": med(self.writer_s),
      "build_s": self.build_s,
      "stats": {k: v for g in self.run.plan.groups.values() for k, v in g.stats().items()},
    }


def markdown(payload: dict) -> str:
  rows = payload["rows"]
  sizes = sorted({r["rows"] for r in rows})
  small, big = sizes[0], sizes[-1]
  a = payload["args"]
  lines = [
    f"# Train step vs table rows ({a['tables']} tables of {small:,} and {big:,} rows, batch "
    f"{a['batch']}, Zipf {a['zipf']} over {a['hot']:,} hot rows, cache / hot set "
    f"{a['cache']:,} rows)",
    "",
    f"`python benchmarks/tier_scaling.py {' '.join(payload['argv'])}`; "
    f"load at start {payload['machine']['load_avg_at_start'][0]:.2f}, "
    f"at end {payload['machine']['load_avg_at_end'][0]:.2f}; {a['rounds']} rounds of "
    f"{a['steps']} steps "
    "interleaved, medians (min-max).",
    "",
  ]
  table = []
  for label in PLANS:
    got = {r["rows"]: r for r in rows if r["label"] == label}
    if small not in got or big not in got:
      continue
    s, b = got[small], got[big]
    table.append(
      [
        label,
        f"{s['step_ms']:.2f} ({s['step_ms_min']:.2f}-{s['step_ms_max']:.2f})",
        f"{b['step_ms']:.2f} ({b['step_ms_min']:.2f}-{b['step_ms_max']:.2f})",
        f"{b['step_ms'] / s['step_ms']:.3f}",
        f"{payload['vs_dense'].get(label, float('nan')):.3f}",
        f"{s['input_ms']:.2f} / {b['input_ms']:.2f}",
        f"{s['writer_ms']:.2f} / {b['writer_ms']:.2f}",
      ]
    )
  lines.append(
    harness.md_table(
      [
        "backend",
        f"step ms {small:,}",
        f"step ms {big:,}",
        "ratio",
        "ratio / dense's",
        "input ms",
        "writer ms",
      ],
      table,
    )
  )
  lines += ["", *payload["must_show"], ""]
  return "\n".join(lines)


def main(argv=None):
  p = harness.flags.parser(__doc__)
  harness.flags.add_dlrm(p, tables=2, rows="1000000,10000000", dim=None)
  p.add_argument("--hot", type=int, default=200_000, help="rows the accesses are drawn over")
  p.add_argument("--cache", type=int, default=20_000, help="offload's cache / hot_cold's rows")
  harness.flags.add_rounds(p, warmup=24, steps=10, rounds=3)
  p.add_argument("--backends", default=",".join(PLANS))
  harness.flags.add_output(p, "tier_scaling (--quick: tier_scaling_quick)")
  args = p.parse_args(argv)
  if args.quick:
    args.rows, args.hot, args.cache = "100000,1000000", 50_000, 8_000
    args.warmup, args.steps, args.rounds = 12, 4, 2
  args.name = args.name or ("tier_scaling_quick" if args.quick else "tier_scaling")
  hostmem.keep_freed_memory()
  payload = harness.record(args, argv)
  sizes = [int(x) for x in args.rows.split(",")]
  configs = []
  for label in args.backends.split(","):
    for rows in sizes:
      text = PLANS[label].format(cache=args.cache)
      c = Config(label, text, rows, args)
      print(f"built {label} at {rows:,} rows in {c.build_s:.1f} s", flush=True)
      c.steps(args.warmup, timed=False)
      configs.append(c)
  for r in range(args.rounds):
    for c in configs:
      c.steps(args.steps, timed=True)
    print(f"round {r + 1}/{args.rounds} done", flush=True)
  rows = [c.row() for c in configs]
  small, big = min(sizes), max(sizes)
  ratio = {
    label: next(r["step_ms"] for r in rows if r["label"] == label and r["rows"] == big)
    / next(r["step_ms"] for r in rows if r["label"] == label and r["rows"] == small)
    for label in {r["label"] for r in rows}
  }
  vs_dense = {k: v / ratio["dense"] for k, v in ratio.items()} if "dense" in ratio else {}
  must = []
  for label, v in vs_dense.items():
    if label != "dense":
      ok = "meets" if v <= 1.1 else "MISSES"
      must.append(
        f"{label}: step({big:,}) / step({small:,}) = {ratio[label]:.3f}, {v:.3f}x dense's "
        f"{ratio['dense']:.3f} ({ok} the 1.1x target)"
      )
  payload["machine"]["load_avg_at_end"] = os.getloadavg()
  payload.update(rows=rows, ratio=ratio, vs_dense=vs_dense, must_show=must)
  harness.write_results(args.name, payload, markdown(payload))


if __name__ == "__main__":
  main()
