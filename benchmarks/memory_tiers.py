"""Memory tiers (offload, hot_cold) against dense and a host-only table: what each DLRM train
step moves over the host link and what that would cost on a GPU.

Every configuration is the trainer's own step (`recgnn.train.setup.build`) of the reference
Kaggle DLRM (26 tables, dim 16, the MLPs of benchmarks/dlrm_throughput.py) over tables of
`--rows` rows, on Zipf batches (`--zipf`) prepared in stream order with the look-ahead window,
as the trainer's input thread does. Per configuration:

  cpu ms / step      measured here (median of the timed steps; host and device memory are the
                     same RAM on this CPU, so this says nothing about the host link)
  host link          bytes per step between host and device memory, from the step's HLO
                     (recgnn.comms.host_link_of), each way
  gpu ms / step      recgnn.step_model's prediction on an H100 (datasheet figures): serial (no
                     overlap) and overlapped (the slowest part bounds the step), from the
                     compiled step's flops and bytes, the host link and the collectives
  vs dense           predicted overlapped GPU time / dense's

The host-only table is `hot_cold(hot_rows=1)`: every row is read from host memory each step.
offload runs with `exchange=bucket` and hot_cold with `cold_list=bucket` (lists sized by the
real misses; the defaults move a batch's worth of rows whatever the hit rate, printed too).

  python benchmarks/memory_tiers.py                 # ~5 minutes; results/memory_tiers.{json,md,png}
  python benchmarks/memory_tiers.py --quick         # smaller tables and fewer steps (a smoke run)
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import common  # noqa: E402  (benchmarks/common.py)
import dlrm_throughput as dt  # noqa: E402
import peers_dlrm  # noqa: E402

from recgnn import comms, hostmem, sharding, step_model  # noqa: E402
from recgnn.train import setup as train_setup  # noqa: E402


def plans(fractions: list[float]) -> list[tuple[str, str]]:
  """(label, plan string) of every configuration."""
  out = [("dense", "dense"), ("host only", "hot_cold(hot_rows=1, profile_batches=4, split=False)")]
  for f in fractions:
    out.append((f"offload {f:g}", f"offload(cache_fraction={f}, lookahead=1, exchange=bucket)"))
    out.append((f"offload {f:g} fixed", f"offload(cache_fraction={f}, lookahead=1)"))
  for f in fractions:
    out.append((f"hot_cold {f:g}", f"hot_cold(budget={f}, profile_batches=4, cold_list=bucket)"))
  return out


def measure(label: str, text: str, cfg, host: list[dict], args, cpu: step_model.Profile) -> dict:
  config = dt.recgnn_config(cfg)
  config.embeddings.plan = [(".*", text)]
  mesh = sharding.make_mesh(1, 1)
  task = dt.BenchCTR(config, cfg, mesh)
  run = train_setup.build(config, mesh=mesh, task=task, example=host[0])
  state = run.state
  stream = [("train", None, host[k % len(host)]) for k in range(args.warmup + args.steps)]
  times, last = [], None
  for k, (_, packed) in enumerate(run.feed(stream)):
    t0 = time.perf_counter()
    state, metrics = run.train_step(state, *packed)
    jax.block_until_ready(metrics)
    if k >= args.warmup:
      times.append(time.perf_counter() - t0)
    last = packed
  # The steady step's program (the last batch's shapes): its host link and predicted cost.
  lowered = run.train_step.lower(state, *last)
  link = comms.host_link_of(lowered)
  cost = step_model.step_cost(lowered)
  gpu = step_model.predict(cost, step_model.H100)
  here = step_model.predict(cost, cpu)
  stats = {n: g.stats() for n, g in run.plan.groups.items() if hasattr(g, "stats")}
  out = {
    "label": label,
    "plan": text,
    "cpu_ms_per_step": 1e3 * statistics.median(times),
    "cpu_ms_predicted": 1e3 * here.overlapped_s,
    "host_to_device_bytes": link.to_device_bytes,
    "device_to_host_bytes": link.to_host_bytes,
    "gpu_serial_ms": 1e3 * gpu.serial_s,
    "gpu_overlapped_ms": 1e3 * gpu.overlapped_s,
    "gpu_parts_ms": {k: 1e3 * v for k, v in gpu.as_dict().items() if k.endswith("_s")},
    "cost": cost.as_dict(),
    "backend_stats": stats,
  }
  print(
    f"{label:>20}: cpu {out['cpu_ms_per_step']:.1f} ms, host link "
    f"{link.to_device_bytes / 1e6:.2f} MB in / {link.to_host_bytes / 1e6:.2f} MB out, "
    f"H100 {out['gpu_serial_ms']:.3f} ms serial / {out['gpu_overlapped_ms']:.3f} ms overlapped",
    flush=True,
  )
  return out


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
      f"{r['gpu_serial_ms']:.3f}",
      f"{r['gpu_overlapped_ms']:.3f}",
      f"{r['gpu_overlapped_ms'] / dense[r['zipf']]:.2f}",
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
        common.md_table(
          [
            "config",
            "zipf",
            "cpu ms / step",
            "host->device MB",
            "device->host MB",
            "H100 ms serial",
            "H100 ms overlapped",
            "overlapped / dense",
          ],
          rows,
        ),  # fmt: skip
        "",
        "Host-link bytes are per step over the whole step (both exchanges of offload; the cold "
        "rows and their write-back of hot_cold), read off the compiled program, so they are the "
        "GPU's too. The GPU figures are predictions, not measurements (no GPU here).",
      ]
    )
    + "\n"
  )


def plot(payload: dict, path: pathlib.Path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(1, 2, figsize=(11, 4))
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
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--rows", type=int, default=200_000, help="rows per table")
  p.add_argument("--batch", type=int, default=2048)
  p.add_argument("--zipf", type=float, nargs="+", default=[1.05], help="id skew exponent(s)")
  p.add_argument("--fractions", type=float, nargs="+", default=[0.01, 0.05, 0.2])
  p.add_argument("--steps", type=int, default=20)
  p.add_argument("--warmup", type=int, default=10, help="steps before timing (hot_cold profiles)")
  p.add_argument("--batches", type=int, default=16, help="distinct batches cycled over")
  p.add_argument("--name", default="memory_tiers")
  p.add_argument("--quick", action="store_true")
  args = p.parse_args(argv)
  if args.quick:
    args.rows, args.steps, args.warmup, args.batches = 20_000, 5, 6, 8
  hostmem.keep_freed_memory()
  cpu = step_model.measure_cpu()
  cfg = peers_dlrm.DlrmConfig(num_rows=args.rows)
  payload = {
    "machine": common.machine_info(),
    "args": vars(args),
    "h100": vars(step_model.H100),
    "cpu_profile": vars(cpu),
    "rows": [],
  }
  for z in args.zipf:
    batches = peers_dlrm.make_batches(cfg, args.batch, args.batches, z, seed=0)
    host = [dt.to_recgnn_batch(b, dt.table_names(cfg)) for b in batches]
    for label, text in plans(args.fractions):
      payload["rows"].append({**measure(label, text, cfg, host, args, cpu), "zipf": z})
  payload["load_avg_at_end"] = list(__import__("os").getloadavg())
  common.write_results(args.name, payload, markdown(payload))
  try:
    plot(payload, common.RESULTS / f"{args.name}.png")
    print(f"wrote {common.RESULTS / args.name}.png")
  except ImportError as e:
    print(f"no plot ({e}): pip install matplotlib")


if __name__ == "__main__":
  main()
