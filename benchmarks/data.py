"""Training-batch read speed (rows/s): the memmap cache vs TFDS array_record + grain, one run.

Question: which training-batch reader is faster here, the memmap cache or TFDS array_record +
grain?

Writes a synthetic Criteo-format train.txt (`recgnn.data.criteo_synthetic`, `--rows` lines)
once under `--workdir`, converts it both ways (the memmap .npy cache; the TFDS criteo_kaggle
build, which `tfds.data_source` reads without TensorFlow), then reads the same shuffled
training batches (`--batch_size`, seed 0, identical by construction: tests/test_data_tfds.py)
from each path, alternating the paths `--reps` times so both see the same machine load:

  memmap          CriteoDataset.batches: a permutation slice, sorted, fancy-indexed memmaps
  tfds_grain_T    TfdsCriteo.batches: a grain pipeline over steps, T threads each reading a
                  batch of raw records (ArrayRecordDataSource.__getitems__) and decoding
                  them with one numpy view (pipeline.RecordLayout)

Reports the median rows/s per path, the ratio to memmap measured within the run, the CPU
rows/s (rows / CPU seconds of this process: what the code costs when it has the cores to
itself) and the 1-minute load average beside them. The machine is shared: compare ratios.

  python benchmarks/data.py                # 200k rows, 3 repetitions
  python benchmarks/data.py --quick        # 50k rows, 1 repetition
Writes benchmarks/results/data.{json,md}.
"""

from __future__ import annotations

import os
import pathlib
import statistics
import time

import harness
import numpy as np

from recgnn.data import criteo, pipeline, tfds_builders
from recgnn.data import criteo_synthetic as cs

RESULTS = harness.RESULTS
TARGET_ROWS_PER_S = 300_000


def measure(it, steps: int) -> dict:
  """Rows/s (wall and this process's CPU) of `steps` batches from iterator `it`."""
  next(it)  # the first batch pays for start-up (threads, permutation): not a rate
  rows = 0
  c0, t0 = time.process_time(), time.perf_counter()
  for _ in range(steps):
    rows += int(np.sum(next(it)["weight"] > 0))
  wall, cpu = time.perf_counter() - t0, time.process_time() - c0
  return {"rows": rows, "seconds": wall, "rows_per_s": rows / wall, "cpu_rows_per_s": rows / cpu}


def main():
  ap = harness.flags.parser(__doc__)
  ap.add_argument("--rows", type=int, default=200_000)
  ap.add_argument("--batch_size", type=int, default=2048)
  ap.add_argument("--steps", type=int, default=40, help="batches timed per repetition")
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--threads", default="1,4", help="grain read threads to try (comma list)")
  ap.add_argument("--workdir", default="/tmp/recgnn_data_bench")
  ap.add_argument("--quick", action="store_true")
  ap.add_argument("--out", default=str(RESULTS / "data"))
  args = ap.parse_args()
  if args.quick:
    args.rows, args.reps, args.steps = 50_000, 1, 10
  info = harness.machine_info()
  manual = os.path.join(args.workdir, f"manual_{args.rows}")
  os.makedirs(manual, exist_ok=True)
  tsv = os.path.join(manual, "train.txt")
  if not os.path.exists(tsv):
    cs.generate_tsv(tsv, cs.SyntheticConfig(num_rows=args.rows, scale=0.01), progress=None)
  t0 = time.perf_counter()
  mm = criteo.open_criteo(tsv, os.path.join(args.workdir, "cache"), progress=None)
  t_mm = time.perf_counter() - t0
  t0 = time.perf_counter()
  builder = tfds_builders.build(
    "criteo_kaggle", os.path.join(args.workdir, "tfds"), manual_dir=manual
  )
  t_tfds = time.perf_counter() - t0
  threads = [int(t) for t in args.threads.split(",")]
  paths = {"memmap": lambda: mm}
  for t in threads:
    paths[f"tfds_grain_{t}"] = lambda t=t: pipeline.TfdsCriteo(builder, num_threads=t)
  runs: dict[str, list] = {k: [] for k in paths}
  loads = []
  for rep in range(args.reps):
    for name, make in paths.items():
      ds = make()
      it = ds.batches("train", args.batch_size, shuffle_seed=0, num_epochs=None, start_step=rep)
      runs[name].append(measure(it, args.steps))
      if hasattr(it, "close"):  # grain's prefetch threads would run on into the next timing
        it.close()
      del it, ds
      loads.append(os.getloadavg()[0])
      print(f"rep {rep} {name:<16} {runs[name][-1]['rows_per_s']:>12,.0f} rows/s", flush=True)
  med = {k: statistics.median(r["rows_per_s"] for r in v) for k, v in runs.items()}
  cpu = {k: statistics.median(r["cpu_rows_per_s"] for r in v) for k, v in runs.items()}
  fastest = max(med, key=med.get)
  payload = {
    "machine": info,
    "rows": args.rows,
    "batch_size": args.batch_size,
    "steps_per_rep": args.steps,
    "reps": args.reps,
    "prepare_seconds": {"memmap_cache": t_mm, "tfds_build": t_tfds},
    "median_rows_per_s": med,
    "median_cpu_rows_per_s": cpu,
    "ratio_to_memmap": {k: v / med["memmap"] for k, v in med.items()},
    "load_avg_1m_during": loads,
    "fastest": fastest,
    "target_rows_per_s": TARGET_ROWS_PER_S,
    "runs": runs,
  }
  lines = [
    f"# Training-batch reads: memmap vs TFDS + grain ({args.rows:,} rows, batch "
    f"{args.batch_size}, median of {args.reps})",
    "",
    f"{info['date_utc']}, {info['cpus']} CPUs, load average {info['load_avg_at_start'][0]:.1f} at "
    f"start, {min(loads):.1f}-{max(loads):.1f} during. `{info['command']}`",
    "",
    harness.md_table(
      ["path", "rows/s (wall)", "x memmap", "rows/s per CPU second"],
      [[k, f"{med[k]:,.0f}", f"{med[k] / med['memmap']:.3f}", f"{cpu[k]:,.0f}"] for k in med],
    ),
  ]
  lines += [
    "",
    f"Preparation: memmap cache {t_mm:.1f} s, TFDS build {t_tfds:.1f} s (0 when reused).",
    f"Fastest: {fastest}; target {TARGET_ROWS_PER_S:,} rows/s.",
  ]
  out = pathlib.Path(args.out)
  harness.write_results(out.name, payload, "\n".join(lines) + "\n", out.parent)


if __name__ == "__main__":
  main()
