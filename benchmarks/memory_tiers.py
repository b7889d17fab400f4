"""Memory tiers (offload, hot_cold) against dense and a host-only table: what each DLRM train
step moves over the host link and what that would cost on a GPU.

Question: how many bytes cross the host link per step for each memory tier, and what step does
recgnn.step_model predict for it on an H100?

Every configuration is the trainer's own step (`recgnn.train.setup.build`) of the reference
Kaggle DLRM (26 tables, dim 16, the MLPs of benchmarks/dlrm_throughput.py) over tables of
`--rows` rows, on a stream of Zipf batches (`--zipf`; the same hot rows in every batch, a new
batch per step) prepared in stream order with the look-ahead window, as the trainer's input
thread does. `--warmup` steps first (hot_cold profiles, the caches fill, the bucketed lists
shrink from their cap to the misses' size), then `--steps` timed steps. Per configuration:

  cpu ms / step      measured here (median of the timed steps that did not compile a new
                     program; host and device memory are the same RAM on this CPU, so this
                     says nothing about the host link)
  host link          bytes per step between host and device memory of the program each
                     timed step ran, each way, mean: its batch's transfer with the host
                     tier's rows, and the rows it returns for the host writer
                     (recgnn.train.traffic.step_io; nothing crosses inside the step)
  gpu ms / step      recgnn.step_model's prediction on an H100 (datasheet figures): serial (no
                     overlap) and overlapped (the slowest part bounds the step), from the
                     compiled step's flops, the bytes its device kernels touch (host
                     computations apart, as host time), the host link and the collectives;
                     mean over the timed steps' programs
  vs dense           predicted overlapped GPU time / dense's

and the check issue 24 asks for: the predicted H100 step of offload at a 5% cache within
1.3x of dense's (overlapped; serial printed beside it).

The host-only table is `hot_cold(hot_rows=1)`: every row is read from host memory each step.
offload runs with `exchange=bucket` and hot_cold with `cold_list=bucket` (lists sized by the
real misses); `--fixed` adds offload's padded `fixed` exchange (a batch's worth of rows
whatever the hit rate) beside each.

  python benchmarks/memory_tiers.py           # ~15-20 min quiet; results/memory_tiers.{json,md,png}
  python benchmarks/memory_tiers.py --quick   # fewer steps: a smoke run, written
                                              # as results/memory_tiers_quick.* (not the results)
"""

from __future__ import annotations

import os
import pathlib
import statistics
import time

import harness
import jax
import numpy as np
from harness import dlrm_task
from peers import dlrm as peers_dlrm

from recgnn import hostmem, sharding, step_model
from recgnn.backends.offload import cache_plan
from recgnn.train import setup as train_setup
from recgnn.train import traffic


def plans(
  fractions: list[float], fixed: bool = False, profile: int = 4, batch: int = 0
) -> list[tuple[str, str]]:
  """(label, plan string) of every configuration (fixed: offload's padded `fixed` exchange
  beside each bucketed one; profile: hot_cold's profile_batches; batch: the train batch, a
  floor under offload's cache rows: its cache must hold a batch's distinct rows)."""
  out = [("dense", "dense"), ("host only", "hot_cold(hot_rows=1, profile_batches=4, split=False)")]
  for f in fractions:
    cache = f"cache_fraction={f}, min_cache_rows={batch}, lookahead=1"
    out.append((f"offload {f:g}", f"offload({cache}, exchange=bucket)"))
    if fixed:
      out.append((f"offload {f:g} fixed", f"offload({cache}, exchange=fixed)"))
  for f in fractions:
    text = f"hot_cold(budget={f}, profile_batches={profile}, cold_list=bucket)"
    out.append((f"hot_cold {f:g}", text))
  return out


def _mean(xs) -> float:
  return float(np.mean(xs)) if xs else float("nan")


def measure(label: str, text: str, cfg, host: list[dict], args, cpu: step_model.Profile) -> dict:
  config = dlrm_task.config_of(cfg)
  config.embeddings.plan = [(".*", text)]
  mesh = sharding.make_mesh(1, 1)
  task = dlrm_task.task_of(config, cfg, mesh)
  task.batches = host  # (a host tier's buffers sized by a train batch of these)
  run = train_setup.build(config, mesh=mesh, task=task, example=host[0])
  state = run.state
  stream = [("train", None, host[k % len(host)]) for k in range(args.warmup + args.steps)]
  # The cost of the program each step ran (bucketed lists give a few programs): read once
  # per program, after the step's timing. Every step is shown, so a program new to `costs` is
  # one the step compiled: such timed steps are left out of the CPU time (and counted).
  # (a host tier's rows move with the batch and back after the step: `traffic.step_io`)
  costs = traffic.PerProgram(lambda lo: step_model.step_cost(lo, io=traffic.step_io(lo)))
  times, all_times, ran, compiled = [], [], [], 0
  groups = [g for g in run.plan.groups.values() if hasattr(g, "stats")]
  for k, (_, packed) in enumerate(run.feed(stream)):
    if k == args.warmup:  # the backends' counters from here: the timed steps' rows
      for g in groups:  # (counted as prepared, a few batches ahead: the same steady state)
        g.stats()
    t0 = time.perf_counter()
    state, metrics = run.train_step(state, *packed)
    jax.block_until_ready(metrics)
    seconds = time.perf_counter() - t0
    before = costs.programs
    cost = costs.observe(run.train_step, state, packed)
    if k >= args.warmup:
      ran.append(cost)
      all_times.append(seconds)
      if costs.programs > before:
        compiled += 1
      else:
        times.append(seconds)
  gpu = [step_model.predict(c, step_model.H100) for c in ran]
  here = [step_model.predict(c, cpu) for c in ran]
  stats = {n: g.stats() for n, g in run.plan.groups.items() if hasattr(g, "stats")}
  parts = ("compute_s", "memory_s", "host_s", "host_link_s", "collective_s", "launch_s")
  out = {
    "label": label,
    "plan": text,
    # (every timed step compiled: their median, compiles and all; see timed_steps_compiling)
    "cpu_ms_per_step": 1e3 * statistics.median(times or all_times),
    "timed_steps_compiling": compiled,
    "cpu_ms_predicted": 1e3 * _mean([p.overlapped_s for p in here]),
    # Means over the timed steps of each step's program's figures.
    "host_to_device_bytes": _mean([c.host_to_device_bytes for c in ran]),
    "device_to_host_bytes": _mean([c.device_to_host_bytes for c in ran]),
    "gpu_serial_ms": 1e3 * _mean([p.serial_s for p in gpu]),
    "gpu_overlapped_ms": 1e3 * _mean([p.overlapped_s for p in gpu]),
    "gpu_parts_ms": {k: 1e3 * _mean([getattr(p, k) for p in gpu]) for k in parts},
    "programs_timed": len({id(c) for c in ran}),
    "programs": costs.programs,
    "cost": {k: _mean([c.as_dict()[k] for c in ran]) for k in ran[0].as_dict()},
    "backend_stats": stats,
    # What the host link must carry per timed step: the rows read / written back (cold ids
    # of hot_cold, misses and evictions of offload) x their row bytes; the bytes above / these.
    **_needed(stats),
  }
  for d in ("host_to_device", "device_to_host"):
    need = out[f"needed_{d}_bytes"]
    out[f"{d}_over_needed"] = out[f"{d}_bytes"] / need if need else None
  print(
    f"{label:>20}: cpu {out['cpu_ms_per_step']:.1f} ms, host link "
    f"{out['host_to_device_bytes'] / 1e6:.3f} MB in / {out['device_to_host_bytes'] / 1e6:.3f} MB "
    f"out, H100 {out['gpu_serial_ms']:.3f} ms serial / {out['gpu_overlapped_ms']:.3f} ms "
    f"overlapped ({out['programs_timed']} program(s) over the timed steps, {compiled} of them "
    f"compiling; {costs.programs} over the run)",
    flush=True,
  )
  return out


def _needed(stats: dict) -> dict:
  """Bytes per step the rows a step must move take (no padding, no indices), from the
  backends' counters: hot_cold's cold rows (read, then written back), offload's misses
  (host -> device) and dirty evictions (device -> host)."""
  h2d = d2h = 0.0
  for s in stats.values():
    if "h2d_bytes_per_step" in s:  # hot_cold
      h2d += s["h2d_bytes_per_step"]
      d2h += s["d2h_bytes_per_step"]
    h2d += sum(v for k, v in s.items() if k.endswith("/h2d_bytes_per_step"))  # offload
    d2h += sum(v for k, v in s.items() if k.endswith("/d2h_bytes_per_step"))
  return {"needed_host_to_device_bytes": h2d, "needed_device_to_host_bytes": d2h}


def _hot_fill(row: dict) -> float | None:
  """A hot_cold row's hot rows / its hot arrays' capacity at the end of its run."""
  fills = [s["hot_fill"] for s in row["backend_stats"].values() if "hot_fill" in s]
  return fills[0] if fills else None


def _without_launches(row: dict) -> float:
  """A row's overlapped H100 prediction without the per-kernel launch term."""
  p = row["gpu_parts_ms"]
  return max(p["compute_s"], p["memory_s"], p["host_s"], p["host_link_s"], p["collective_s"])


def must_show(payload: dict) -> list[str]:
  """Issue 24's check, per id skew: offload at a 5% cache predicted within 1.3x of dense's
  H100 step (overlapped: the link hidden behind the step, what the memory tiers build;
  serial beside it)."""
  lines = []
  for r in payload["rows"]:  # host-link bytes within 1.25x of the rows' own bytes
    got = [r.get(f"{d}_over_needed") for d in ("host_to_device", "device_to_host")]
    if any(g is not None for g in got):
      worst = max(g for g in got if g is not None)
      lines.append(
        f"must-show ({r['label']}, zipf {r['zipf']:g}): host-link bytes / the rows' bytes: "
        + " / ".join("-" if g is None else f"{g:.2f}x" for g in got)
        + f" (host->device / device->host); within 1.25x: {'yes' if worst <= 1.25 else 'NO'}"
      )
  for z in sorted({r["zipf"] for r in payload["rows"]}):
    rows = {r["label"]: r for r in payload["rows"] if r["zipf"] == z}
    if "dense" not in rows or "offload 0.05" not in rows:
      continue
    d, o = rows["dense"], rows["offload 0.05"]
    over = o["gpu_overlapped_ms"] / d["gpu_overlapped_ms"]
    serial = o["gpu_serial_ms"] / d["gpu_serial_ms"]
    bare = _without_launches(o) / _without_launches(d)
    verdict = "yes" if over <= 1.3 else "NO"
    lines.append(
      f"must-show (zipf {z:g}): predicted H100 step of offload at a 5% cache / dense's: "
      f"{over:.2f}x overlapped ({serial:.2f}x serial); within 1.3x: {verdict}. Without the "
      f"launch term (device kernels {o['cost']['kernels']:.0f} vs {d['cost']['kernels']:.0f}, "
      f"as XLA:CPU fuses them, x {1e6 * step_model.H100.launch_s:g} us): {bare:.2f}x overlapped"
    )
  return lines


def _ratios(r: dict) -> str:
  got = [r.get(f"{d}_over_needed") for d in ("host_to_device", "device_to_host")]
  return " / ".join("-" if g is None else f"{g:.2f}" for g in got)


def markdown(payload: dict) -> str:
  m, a = payload["machine"], payload["args"]
  dense = {r["zipf"]: r["gpu_overlapped_ms"] for r in payload["rows"] if r["label"] == "dense"}
  rows = [
    [
      r["label"],
      f"{r['zipf']:g}",
      f"{r['cpu_ms_per_step']:.1f}",
      f"{r['host_to_device_bytes'] / 1e6:.3f}",
      f"{r['device_to_host_bytes'] / 1e6:.3f}",
      _ratios(r),
      f"{r['gpu_serial_ms']:.3f}",
      f"{r['gpu_overlapped_ms']:.3f}",
      # (no dense row with --only)
      f"{r['gpu_overlapped_ms'] / dense[r['zipf']]:.2f}" if r["zipf"] in dense else "-",
      f"{r['gpu_parts_ms']['memory_s']:.3f} / {r['gpu_parts_ms']['host_s']:.3f} / "
      f"{r['gpu_parts_ms']['host_link_s']:.3f} / {r['gpu_parts_ms']['launch_s']:.3f}",
      f"{r['programs_timed']} / {r['timed_steps_compiling']} / {r['programs']}",
    ]
    for r in payload["rows"]
  ]
  return (
    "\n".join(
      [
        "# Memory tiers: host-link bytes and predicted GPU step time (benchmarks/memory_tiers.py)",
        "",
        f"`{m['command']}` on {m['cpus']} CPUs, jax {m['jax']}, {m['date_utc']}; load "
        f"{m['load_avg_at_start'][0]:.1f} at start, {payload['load_avg_at_end'][0]:.1f} at end. "
        f"DLRM (26 tables x {a['rows']:,} rows, dim 16, reference MLPs), batch {a['batch']}, SGD; "
        f"{a['steps']} timed steps after {a['warmup']}. GPU: recgnn.step_model's H100 profile "
        f"({payload['h100']['source']}); this CPU's measured profile: "
        f"{payload['cpu_profile']['flops_per_s'] / 1e9:.0f} GFLOP/s, "
        f"{payload['cpu_profile']['memory_bytes_per_s'] / 1e9:.1f} GB/s.",
        "",
        harness.md_table(
          [
            "config",
            "zipf",
            "cpu ms / step",
            "host->device MB",
            "device->host MB",
            "/ the rows' bytes (in / out)",
            "H100 ms serial",
            "H100 ms overlapped",
            "overlapped / dense",
            "H100 ms memory / host / link / launches",
            "programs timed / compiling / run",
          ],
          rows,
        ),  # fmt: skip
        "",
        "Host-link bytes are per step over the whole step (both exchanges of offload; the cold "
        "rows and their write-back of hot_cold), read off the compiled program, so they are the "
        "GPU's too; means over the timed steps of the program each ran (programs: distinct ones "
        "over the timed steps / timed steps that compiled one, left out of the CPU time / over "
        "the whole run); beside them, over the rows' own bytes (the rows the timed steps "
        "read and write back, from the backends' counters: no padding, no indices). The GPU "
        "figures are predictions, not measurements (no GPU here): memory "
        "is what the device's kernels touch (gathers and scatters by the rows they touch), host "
        "what the host computations touch, at an assumed host memory bandwidth.",
        "",
        f"hot_cold profiles {a['profile']} batches before picking its hot set (`--profile`): "
        "a hot set holds only rows its profile saw, so a budget larger than those is not "
        "filled (hot rows / capacity: "
        + ", ".join(
          f"{r['label']} {_hot_fill(r):.2f}"
          for r in payload["rows"]
          if r["label"].startswith("hot_cold") and _hot_fill(r) is not None
        )
        + ").",
        "",
        *payload.get("must_show", []),
      ]
    )
    + "\n"
  )


def plot(payload: dict, path: pathlib.Path) -> None:
  with harness.png(path, ncols=2, figsize=(11, 4), dpi=120) as (fig, ax):
    for z in sorted({r["zipf"] for r in payload["rows"]}):
      rows = [r for r in payload["rows"] if r["zipf"] == z]
      labels = [r["label"] for r in rows]
      x = np.arange(len(rows))
      ax[0].bar(x + 0.4 * (z != rows[0]["zipf"]), [r["host_to_device_bytes"] / 1e6 for r in rows],
                0.4, label=f"zipf {z:g}")  # fmt: skip
      ax[1].bar(x, [r["gpu_overlapped_ms"] for r in rows], 0.4, label=f"zipf {z:g} overlapped")
      ax[1].scatter(x, [r["gpu_serial_ms"] for r in rows], marker="_", s=200, color="k")
      for a in ax:
        a.set_xticks(x, labels, rotation=60, ha="right", fontsize=8)
    ax[0].set_ylabel("host -> device MB per step (HLO)")
    ax[1].set_ylabel("predicted H100 ms per step (bars: overlapped, -: serial)")
    ax[0].legend()


def main(argv=None):
  p = harness.flags.parser(__doc__)
  p.add_argument("--rows", type=int, default=200_000, help="rows per table")
  p.add_argument("--batch", type=int, default=2048)
  p.add_argument("--zipf", type=float, nargs="+", default=[1.05], help="id skew exponent(s)")
  p.add_argument("--fractions", type=float, nargs="+", default=[0.01, 0.05, 0.2])
  p.add_argument("--steps", type=int, default=20, help="timed steps")
  p.add_argument(
    "--warmup",
    type=int,
    default=4 * cache_plan.PATIENCE,
    help="steps before timing: hot_cold profiles, the caches fill, and the bucketed lists, "
    f"which start at their cap and shrink after {cache_plan.PATIENCE} steps below a smaller "
    "bucket, settle to the misses' size (a few shrinks)",
  )
  p.add_argument(
    "--batches", type=int, default=0, help="distinct batches cycled over (0: one per step)"
  )
  p.add_argument("--fixed", action="store_true", help="also offload's padded `fixed` exchange")
  p.add_argument(
    "--only", default=None, help="only the configurations whose label starts with this"
  )
  p.add_argument(
    "--profile",
    type=int,
    default=None,
    help="hot_cold's profile_batches (default: the warm-up less 2 x the lists' patience, so "
    "the lists settle after the migration). A hot set holds only rows its profile saw: a "
    "4-batch profile saw fewer rows than a 5%% budget holds, and 5%% and 20%% moved the same "
    "bytes (stats' hot_fill, in the results)",
  )
  p.add_argument("--name", default=None, help="results/NAME.* (memory_tiers[_quick])")
  p.add_argument("--quick", action="store_true")
  args = p.parse_args(argv)
  if args.quick:  # one shrink of the lists, a few timed steps: a smoke run
    # (the full run's tables: a 1% cache of fewer rows cannot hold a batch's distinct rows)
    args.steps, args.warmup = 5, 2 * cache_plan.PATIENCE + 4
  args.name = args.name or ("memory_tiers_quick" if args.quick else "memory_tiers")
  if args.profile is None:
    args.profile = max(4, args.warmup - 2 * cache_plan.PATIENCE)
  hostmem.keep_freed_memory()
  cpu = step_model.measure_cpu()
  cfg = peers_dlrm.DlrmConfig(num_rows=args.rows)
  payload = {
    "machine": harness.machine_info(),
    "args": vars(args),
    "h100": vars(step_model.H100),
    "cpu_profile": vars(cpu),
    "rows": [],
  }
  for z in args.zipf:
    # One stream: the same hot rows in every batch (a fresh permutation per batch would
    # give caches and hot sets nothing to reuse), a new batch per step unless --batches.
    n = args.batches or args.warmup + args.steps
    batches = peers_dlrm.make_batches(cfg, args.batch, n, z, seed=0, same_hot_rows=True)
    host = [dlrm_task.to_batch(b, dlrm_task.table_names(cfg.num_tables)) for b in batches]
    for label, text in plans(args.fractions, args.fixed, args.profile, args.batch):
      if args.only and not label.startswith(args.only):
        continue
      payload["rows"].append({**measure(label, text, cfg, host, args, cpu), "zipf": z})
  payload["load_avg_at_end"] = list(os.getloadavg())
  payload["must_show"] = must_show(payload)
  for line in payload["must_show"]:
    print(line)
  harness.write_results(args.name, payload, markdown(payload))
  try:
    plot(payload, harness.RESULTS / f"{args.name}.png")
    print(f"wrote {harness.RESULTS / args.name}.png")
  except ImportError as e:
    print(f"no plot ({e}): pip install matplotlib")


if __name__ == "__main__":
  main()
