"""End to end in the trainer: dlrm_kaggle vs cdlrm_kaggle (offload), ttrec_kaggle (tt) and
hotline_kaggle (hot_cold) on the same synthetic data, and where the input thread's time goes.

Question: what does each backend's plan cost per step in the trainer, end to end, against all-
dense `dlrm_kaggle`; and is this tree slower than an earlier commit (--against)?

Three measurements, one process, one command (defaults: ~5 minutes on a quiet machine):

  trainer      `recgnn.train.loop.train` of each experiment for `--steps` steps, interleaved:
               round r runs every experiment before round r + 1 runs any (the machine is
               shared: load changes hit them all). Samples/s per `--log_every`-step interval
               from metrics.jsonl, the first interval of each run dropped (it holds the
               compile), and any other in which the step compiled a new program (bucketed
               lists' lengths; `link/programs` in metrics.jsonl); time per step = batch /
               samples/s; ratio to dlrm_kaggle's median, and issue 24's check: cdlrm_kaggle
               and hotline_kaggle within 1.2x.
               The input thread's busy seconds per step (results["input_thread_seconds"]).
  breakdown    the input thread's work per batch, per experiment, outside the trainer on the
               same batches: each embedding group's `prepare` (dense: dedup; offload: cache
               planning; tt: the prefix tree; hot_cold: the popular split), `inputs.pack`
               (one buffer per dtype) and `inputs.put` (the transfer). Wall and CPU time.
  planning     cdlrm_kaggle's offload group: batches/s of `prepare` with the compiled planner
               (recgnn.backends.offload.planner) on 1, 2 and all cores, and the numpy planner;
               CPU time per batch.

  python benchmarks/end_to_end.py                 # writes results/end_to_end.{json,md}
  python benchmarks/end_to_end.py --quick         # ~2 minutes, a smoke run (not for figures)
  python benchmarks/end_to_end.py --against=COMMIT --sections=trainer
      # this tree against COMMIT: every trainer run a separate `run.py` process of its own
      # tree (COMMIT's from git), interleaved per round (experiment by experiment, the two
      # trees in alternating order); samples/s min / median / max per tree and the ratio of
      # medians. Writes results/end_to_end_against.{json,md}.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import statistics
import tempfile
import time

import harness
import jax
import numpy as np

from recgnn.backends.offload import planner as hostplan
from recgnn.train import inputs, loop
from recgnn.train import setup as train_setup
from recgnn.train import train_state as state_lib

EXPERIMENTS = ("dlrm_kaggle", "cdlrm_kaggle", "ttrec_kaggle", "hotline_kaggle")
REFERENCE = "dlrm_kaggle"
# Issue 24's must-show: the memory tiers' experiments within 1.2x of dlrm_kaggle's time per
# step, in one run (interleaved rounds, same machine state).
MUST_SHOW = ("cdlrm_kaggle", "hotline_kaggle")
TARGET_RATIO = 1.2


def config_of(name: str, args):
  c = importlib.import_module(f"experiments.{name}").get_config()
  c.train.steps = args.steps
  c.train.log_every = args.log_every
  c.train.checkpoint_every = 0
  c.train.eval_every = 0
  c.train.final_eval_splits = ()
  return c


def steady_intervals(lines: list[dict]) -> tuple[list[float], list[float], int]:
  """metrics.jsonl lines -> (samples/s of every logged interval, of the steady ones, programs
  of the step compiled). Steady: not the first interval (the compile), nor one in which the
  trainer compiled a new program of the step (`link/programs` grew: e.g. a bucketed
  exchange list's new length); all but the first where every interval compiled."""
  logged = [x for x in lines if x.get("samples_per_second") is not None]
  rates = [x["samples_per_second"] for x in logged]
  programs = [x.get("link/programs", 1) for x in logged]  # (absent before the trainer logged it)
  steady = [r for i, r in enumerate(rates) if i > 0 and programs[i] == programs[i - 1]]
  return rates, steady or rates[1:], int(programs[-1]) if programs else 0


def run_trainer(name: str, args) -> dict:
  config = config_of(name, args)
  workdir = tempfile.mkdtemp(prefix=f"e2e_{name}_")
  load = os.getloadavg()
  cpu0, t0 = time.process_time(), time.perf_counter()
  try:
    res = loop.train(config, workdir)
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      lines = [json.loads(x) for x in f]
  finally:
    shutil.rmtree(workdir, ignore_errors=True)
  rates, steady, programs = steady_intervals(lines)
  batch = config.train.batch_size
  return {
    "experiment": name,
    "batch": batch,
    "load_avg_before": load,
    "wall_s": time.perf_counter() - t0,
    "cpu_s": time.process_time() - cpu0,
    "samples_per_s_intervals": rates,
    "steady_intervals": steady,
    "programs": programs,
    "samples_per_s_median": statistics.median(steady),
    "ms_per_step_median": 1e3 * batch / statistics.median(steady),
    "input_thread_ms_per_step": 1e3 * res.metrics["input_thread_seconds"] / args.steps,
  }


def run_trainer_process(name: str, args, root: str, own: bool = True) -> dict:
  """One trainer run of `name` as its own process: `root`'s run.py (this tree's or an
  --against commit's), the settings of `config_of` as flags; samples/s from metrics.jsonl.
  NAME@FEED sets train.feed in this tree's runs (`own`); an earlier commit's run, which may
  predate the option, runs its own feed (the host's)."""
  name, _, feed = name.partition("@")
  workdir = tempfile.mkdtemp(prefix=f"e2e_{name}_")
  flags = harness.trainer_flags(args.steps, args.log_every)
  if feed and own:
    flags["train.feed"] = feed
  load = os.getloadavg()[0]
  try:
    steady = harness.trainer_process(root, name, workdir, flags)
  finally:
    shutil.rmtree(workdir, ignore_errors=True)
  return {"samples_per_s": statistics.median(steady), "intervals": steady, "load_before": load}


def against(names: list[str], args) -> dict:
  """This tree vs args.against, each trainer run its own process, interleaved."""
  with tempfile.TemporaryDirectory(prefix="e2e_against_") as tmp:
    trees, sha = harness.trees(args.against, tmp)
    # Each experiment's two trees one after the other, their order alternating by round.
    order = lambda r: [(n, t) for n in names for t in harness.alternated(list(trees), r)]  # noqa: E731
    by_pair = harness.rounds(
      args.rounds,
      order,
      lambda c, r: run_trainer_process(c[0], args, trees[c[1]], own=c[1] == "this"),
      lambda c, res: f"{res['samples_per_s']:,.0f} samples/s",
    )
  runs = {n: {t: by_pair[(n, t)] for t in trees} for n in names}
  summary = {}
  for n in names:
    dist = {t: harness.distribution([x["samples_per_s"] for x in xs]) for t, xs in runs[n].items()}
    this, other = dist["this"]["median"], dist[sha[:10]]["median"]
    summary[n] = {"samples_per_s": dist, "ratio_this_over_against": this / other}
  return {"commit": sha, "runs": runs, "summary": summary}


def markdown_against(payload: dict) -> str:
  m, a = payload["machine"], payload["against"]
  short = a["commit"][:10]
  rows = []
  for n, s in a["summary"].items():
    d = s["samples_per_s"]
    cells = [f"{d[t]['min']:,.0f} / {d[t]['median']:,.0f} / {d[t]['max']:,.0f}" for t in d]
    rows.append([n, *cells, f"{s['ratio_this_over_against']:.3f}"])
  loads = [x["load_before"] for r in a["runs"].values() for xs in r.values() for x in xs]
  return (
    "\n".join(
      [
        "# End to end in the trainer: this tree against an earlier commit",
        "",
        f"`{m['command']}` on {m['cpus']} CPUs, jax {m['jax']}, {m['date_utc']}. Every run is its "
        f"own `run.py` process ({payload['args']['steps']} steps, samples/s = median of the logged "
        f"intervals after the first); {payload['args']['rounds']} rounds, the two trees "
        f"alternating first. Load before the runs: {min(loads):.1f} - {max(loads):.1f}.",
        "",
        harness.md_table(
          [
            "experiment",
            "this tree: samples/s min / median / max",
            f"{short}: min / median / max",
            "median this / median against",
          ],
          rows,
        ),  # fmt: skip
      ]
    )
    + "\n"
  )


# ----------------------------------------------------------------------------- host side


def setup(name: str, num_batches: int):
  """(plan with initialised groups, feeder, batches) of an experiment: the trainer's
  (`setup.build`)."""
  run = train_setup.build(importlib.import_module(f"experiments.{name}").get_config())
  it = run.task.train_batches(0)
  return run.plan, run.feeder, [next(it) for _ in range(num_batches)]


def breakdown(name: str, args) -> dict:
  """ms per batch (wall and CPU) of each group's prepare, pack and put, in stream order."""
  plan, feeder, batches = setup(name, args.host_batches + 4)
  acc: dict[str, list[float]] = {}

  def timed(key, fn, *a, **kw):
    w, c = time.perf_counter(), time.process_time()
    out = fn(*a, **kw)
    acc.setdefault(key, []).append(1e3 * (time.perf_counter() - w))
    acc.setdefault(key + " cpu", []).append(1e3 * (time.process_time() - c))
    return out

  with harness.prepare_without_steps():  # (no step runs: nothing written back would come)
    for k in range(args.host_batches):
      breakdown_batch(plan, feeder, batches, k, timed)
  skip = 3  # the first batches: admissions on demand, numba's first call
  return {k: float(np.median(v[skip:])) for k, v in acc.items()}


def breakdown_batch(plan, feeder, batches: list, k: int, timed) -> None:
  """Batch k's prepare of every group, pack and put, each through `timed(key, fn, ...)`."""
  window = plan.lookahead
  batch = batches[k]
  upcoming = [b["ids"] for b in batches[k + 1 : k + 1 + window]]
  prepared = {}
  for key, g in plan.groups.items():
    ids = {t: batch["ids"][t] for t in g.specs}
    ahead = [{t: u[t] for t in g.specs} for u in upcoming[: g.lookahead]]
    prepared[key] = timed(f"prepare[{g.name}]", g.prepare, ids, ahead, train=True)
  b = state_lib.device_batch(batch)
  specs = feeder.specs(prepared, b)
  bufs, _ = timed("pack", inputs.pack, (prepared, b), specs, plan.mesh.size)
  jax.block_until_ready(timed("put", inputs.put, bufs, plan.mesh))


def planning(args) -> dict:
  """cdlrm_kaggle's offload group: prepare batches/s per planner and core count."""
  cores = sorted({1, 2, os.cpu_count() or 1})
  modes = [("numpy", None)] + [("compiled", k) for k in cores]
  out = {}
  for _ in range(args.plan_reps):
    for mode, k in modes:
      n, w, c, fast = plan_stream_timed(args, numpy=mode == "numpy", threads=k or 1)
      key = mode if k is None else f"{mode}, {k} core{'s' if k > 1 else ''}"
      r = out.setdefault(key, {"cores": k or 1, "batches_per_s": [], "cpu_ms_per_batch": []})
      r["batches_per_s"].append(n / w)
      r["cpu_ms_per_batch"].append(1e3 * c / n)
      r["fast_batches"] = fast
  for r in out.values():
    r["batches_per_s_median"] = statistics.median(r["batches_per_s"])
    r["per_core"] = r["batches_per_s_median"] / r["cores"]
    r["cpu_ms_median"] = statistics.median(r["cpu_ms_per_batch"])
  return out


def plan_stream_timed(args, numpy: bool, threads: int) -> tuple[int, float, float, int]:
  """cdlrm_kaggle's prepare over a fresh stream (the first 3 batches untimed): (batches,
  wall s, CPU s, the group's kernel batches). No step runs, so the reads of rows written
  back do not wait for their steps (`harness.prepare_without_steps`: they never come)."""
  plan, _, batches = setup("cdlrm_kaggle", args.host_batches + 12)
  (group,) = plan.groups.values()
  enabled, old = hostplan.enabled, hostplan.threads()
  hostplan.enabled = (lambda: False) if numpy else enabled
  hostplan.set_threads(threads)
  try:
    with harness.prepare_without_steps():
      items = inputs.prepare_stream(plan, (("train", None, b) for b in batches))
      for _ in range(3):  # first batches: admissions on demand (the numpy planner)
        next(items)
      n = 0
      w, c = time.perf_counter(), time.process_time()
      for _ in items:
        n += 1
      w, c = time.perf_counter() - w, time.process_time() - c
  finally:
    hostplan.enabled = enabled
    hostplan.set_threads(old)
  return n, w, c, getattr(group, "fast_batches", 0)


# ----------------------------------------------------------------------------- report


def must_show(trainer: dict) -> list[str]:
  """Per experiment: its time per step / dlrm_kaggle's in this run; for MUST_SHOW's, the
  check against TARGET_RATIO."""
  out = []
  for n, r in trainer.items():
    if n == REFERENCE:
      continue
    line = f"{n}: {r['ratio']:.2f}x {REFERENCE}'s time per step"
    if n in MUST_SHOW:
      ok = "yes" if r["ratio"] <= TARGET_RATIO else "NO"
      line = f"must-show (issue 24): {line}, within {TARGET_RATIO}x: {ok}"
    out.append(line)
  return out


def markdown(payload: dict) -> str:
  m = payload["machine"]
  start = ", ".join(f"{x:.1f}" for x in m["load_avg_at_start"])
  end = ", ".join(f"{x:.1f}" for x in payload["load_avg_at_end"])
  lines = [
    "# End to end in the trainer (benchmarks/end_to_end.py)",
    "",
    f"`{m['command']}` on {m['cpus']} CPUs, jax {m['jax']} ({m['jax_backend']}), "
    f"{m['date_utc']}; load average at start {start}, at end {end}.",
    "",
    f"## Trainer: {payload['args']['steps']} steps per run, {payload['args']['rounds']} "
    "interleaved rounds",
    "",
    "Median over the steady intervals of all rounds (the first interval of each run, with "
    "the compile, dropped, and any in which the step compiled a new program: programs / "
    "intervals dropped); ratio = time per step / dlrm_kaggle's; input thread = its busy "
    "time per step (prepare + pack + transfer).",
    "",
    "| experiment | samples/s | ms / step | ratio to dlrm | ratio per round | input thread "
    "ms / step | programs / intervals dropped | load before each run |",
    "|---|---|---|---|---|---|---|---|",
  ]
  for name, r in payload["trainer"].items():
    lines.append(
      f"| {name} | {r['samples_per_s']:,.0f} | {r['ms_per_step']:.1f} | {r['ratio']:.2f} | "
      + ", ".join(f"{x:.2f}" for x in r["ratio_per_round"])
      + f" | {r['input_thread_ms_per_step']:.1f} | "
      + ", ".join(
        f"{p} / {d}" for p, d in zip(r.get("programs", []), r.get("intervals_dropped", []))
      )
      + " | "
      + ", ".join(f"{x:.1f}" for x in r["load_before"])
      + " |"
    )
  lines.append("")
  lines += [f"- {x}" for x in must_show(payload["trainer"])]
  if "breakdown" in payload:  # (sections run: --sections)
    lines += [
      "",
      "## Input thread per batch (ms, median; outside the trainer, same batches)",
      "",
      "| experiment | part | wall ms | CPU ms |",
      "|---|---|---|---|",
    ]
    for name, parts in payload["breakdown"].items():
      for k, v in parts.items():
        if k.endswith(" cpu"):
          continue
        lines.append(f"| {name} | {k} | {v:.2f} | {parts[k + ' cpu']:.2f} |")
  if "planning" in payload:
    lines += [
      "",
      "## Planning throughput: cdlrm_kaggle's offload group (26 tables, batch 2048)",
      "",
      "`prepare` of every table of the group per batch, in stream order with the look-ahead "
      "window (medians of the repetitions).",
      "",
      "| planner | cores | batches/s (wall) | per core | x 1 core | CPU ms / batch | "
      "batches per CPU-second | kernel batches |",
      "|---|---|---|---|---|---|---|---|",
    ]
    one = payload["planning"].get("compiled, 1 core", {}).get("batches_per_s_median")
    for k, r in payload["planning"].items():
      scale = f"{r['batches_per_s_median'] / one:.2f}" if one and k.startswith("compiled") else ""
      lines.append(
        f"| {k} | {r['cores']} | {r['batches_per_s_median']:,.0f} | {r['per_core']:,.0f} | "
        f"{scale} | {r['cpu_ms_median']:.2f} | {1e3 / r['cpu_ms_median']:,.0f} | "
        f"{r['fast_batches']} |"
      )
    lines += [
      "",
      "Wall batches/s depend on the load (a loaded 2-core machine gives a process a fraction of "
      "a core); CPU ms per batch (all threads) does not: batches per CPU-second is the "
      "throughput of one free core, what a GPU host's spare cores each add.",
    ]
  return "\n".join(lines) + "\n"


def main():
  ap = harness.flags.parser(__doc__)
  ap.add_argument("--experiments", default=",".join(EXPERIMENTS))
  ap.add_argument("--steps", type=int, default=300)
  ap.add_argument("--log_every", type=int, default=50)
  ap.add_argument("--rounds", type=int, default=2)
  ap.add_argument("--host_batches", type=int, default=60)
  ap.add_argument("--plan_reps", type=int, default=3)
  ap.add_argument("--sections", default="planning,breakdown,trainer")
  ap.add_argument("--name", default="end_to_end")
  ap.add_argument("--quick", action="store_true")
  ap.add_argument(
    "--against",
    default="",
    metavar="COMMIT",
    help="trainer section only: this tree's runs against COMMIT's, each run its own process",
  )
  args = ap.parse_args()
  if args.quick:
    args.steps, args.log_every, args.rounds, args.host_batches, args.plan_reps = 100, 25, 1, 20, 1
  names = [n for n in args.experiments.split(",") if n]
  sections = set(args.sections.split(","))
  payload = {"machine": harness.machine_info(), "args": vars(args), "hostplan": {
    "compiled": hostplan.enabled(), "threads": hostplan.threads()}}  # fmt: skip
  if args.against:
    if sections != {"trainer"}:
      ap.error("--against times the trainer only: add --sections=trainer")
    payload["against"] = against(names, args)
    payload["load_avg_at_end"] = os.getloadavg()
    name = args.name if args.name != "end_to_end" else "end_to_end_against"
    harness.write_results(name, payload, markdown_against(payload))
    return
  if "planning" in sections:
    payload["planning"] = planning(args)
    print(json.dumps(payload["planning"], indent=1), flush=True)
  if "breakdown" in sections:
    payload["breakdown"] = {n: breakdown(n, args) for n in names}
    print(json.dumps(payload["breakdown"], indent=1), flush=True)
  if "trainer" in sections:
    runs = []
    for r in range(args.rounds):
      for n in names:
        print(f"round {r}: {n} (load {os.getloadavg()[0]:.1f})", flush=True)
        runs.append(dict(run_trainer(n, args), round=r))
    payload["runs"] = runs
    ref = {x["round"]: x["ms_per_step_median"] for x in runs if x["experiment"] == REFERENCE}
    ref_steady = [v for x in runs if x["experiment"] == REFERENCE for v in x["steady_intervals"]]
    trainer = {}
    for n in names:
      mine = [x for x in runs if x["experiment"] == n]
      sps = statistics.median(v for x in mine for v in x["steady_intervals"])
      trainer[n] = {
        "samples_per_s": sps,
        "ms_per_step": 1e3 * mine[0]["batch"] / sps,
        "ratio": statistics.median(ref_steady) / sps if ref_steady else float("nan"),
        "ratio_per_round": [x["ms_per_step_median"] / ref[x["round"]] for x in mine if ref],
        "input_thread_ms_per_step": statistics.median(x["input_thread_ms_per_step"] for x in mine),
        "load_before": [x["load_avg_before"][0] for x in mine],
        "programs": [x["programs"] for x in mine],
        "intervals_dropped": [
          len(x["samples_per_s_intervals"]) - len(x["steady_intervals"]) for x in mine
        ],
      }
    payload["trainer"] = trainer
    for n, t in trainer.items():
      print(
        f"{n}: {t['samples_per_s']:,.0f} samples/s, {t['ms_per_step']:.1f} ms/step, "
        f"{t['ratio']:.2f}x {REFERENCE}, input thread {t['input_thread_ms_per_step']:.1f} ms/step",
        flush=True,
      )
    if REFERENCE in trainer:
      for line in must_show(trainer):
        print(line, flush=True)
  payload["load_avg_at_end"] = os.getloadavg()
  if "trainer" in sections:
    harness.write_results(args.name, payload, markdown(payload))
  else:
    print(json.dumps(payload, indent=1, default=str))


if __name__ == "__main__":
  main()
