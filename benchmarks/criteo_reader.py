"""Criteo TSV -> binary cache conversion speed (rows/s), on synthetic Kaggle-format lines.

Question: how fast does a Criteo TSV become the binary memmap cache, with hashed and with
frequency ids?

Generates `--rows` lines with `recgnn.data.criteo_synthetic` (the exact Kaggle format: 40
tab-separated fields, Kaggle missing-value rates) once under `--workdir`, then converts them
with `recgnn.data.criteo.convert` into a fresh cache directory, `--reps` times per mode:

  parse       the vectorized parser alone over the file (no ids, no writes)
  hash        one pass: parse, hash ids, write labels/dense/sparse .npy
  frequency   parse + count every value + write labels/dense/raw values, then remap the raw
              values to frequency ids (the text is parsed once)
  hash_2_workers   `hash` with the blocks parsed in 2 worker processes (num_workers=2)

Reports the median wall-clock rows/s and the CPU rows/s (rows / CPU seconds of this process
and its worker processes: what the code costs when it has the cores to itself; the machine is
shared, so wall time depends on the neighbours) against the target of 300,000 rows/s.

  python benchmarks/criteo_reader.py            # 2M lines (~1 minute)
  python benchmarks/criteo_reader.py --quick    # 300k lines, 1 repetition
Writes benchmarks/results/criteo_reader.{json,md}.
"""

from __future__ import annotations

import os
import resource
import shutil
import statistics
import time

# Runnable as `python benchmarks/criteo_reader.py` from a checkout without installing recgnn.
import harness

from recgnn.data import criteo
from recgnn.data import criteo_synthetic as cs

RESULTS = harness.RESULTS
TARGET_ROWS_PER_S = 300_000


def cpu_seconds() -> float:
  """CPU time of this process and its finished children (the worker processes)."""
  me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
  return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def timed(fn):
  """(fn(), wall seconds, CPU seconds of this process and its children)."""
  w, c = time.perf_counter(), cpu_seconds()
  out = fn()
  return out, time.perf_counter() - w, cpu_seconds() - c


def parse_only(path: str, block_bytes: int) -> int:
  rows = 0
  for buf, size, _ in criteo.iter_blocks(path, block_bytes):
    rows += criteo.parse_block(buf, size).labels.shape[0]
  return rows


def main(argv=None):
  ap = harness.flags.parser(__doc__)
  ap.add_argument("--rows", type=int, default=2_000_000)
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--workdir", default="/tmp/recgnn_criteo_bench")
  ap.add_argument("--quick", action="store_true", help="300k lines, 1 repetition")
  args = ap.parse_args(argv)
  if args.quick:
    args.rows, args.reps = 300_000, 1
  info = harness.machine_info()
  os.makedirs(args.workdir, exist_ok=True)
  cfg = cs.SyntheticConfig(num_rows=args.rows, scale=0.01, seed=0)
  tsv = os.path.join(args.workdir, f"train-{args.rows}.txt")
  side = cs.load_info(tsv)
  if side is None or side["config"] != cfg.to_json() or not os.path.exists(tsv):
    cs.generate_tsv(tsv, cfg)
    side = cs.load_info(tsv)
  size = os.path.getsize(tsv)
  print(f"{args.rows:,} lines, {size / 2**20:,.0f} MiB ({size / args.rows:.0f} bytes/line)")

  modes = {
    "parse": None,
    "hash": criteo.ReaderConfig(categorical="hash", hash_sizes=cfg.cardinalities()),
    "frequency": criteo.ReaderConfig(categorical="frequency"),
    "hash_2_workers": criteo.ReaderConfig(
      categorical="hash", hash_sizes=cfg.cardinalities(), num_workers=2
    ),
  }
  block = criteo.ReaderConfig().block_bytes
  results = {}
  for name, reader in modes.items():
    walls, cpus = [], []
    for _ in range(args.reps):
      out = os.path.join(args.workdir, f"cache-{name}")
      shutil.rmtree(out, ignore_errors=True)
      if reader is None:
        rows, wall, cpu = timed(lambda: parse_only(tsv, block))
      else:
        manifest, wall, cpu = timed(
          lambda r=reader, o=out: criteo.convert([tsv], o, r, progress=None)
        )
        rows = manifest["num_rows"]
      assert rows == args.rows, (name, rows)
      walls.append(wall)
      cpus.append(cpu)
    wall, cpu = statistics.median(walls), statistics.median(cpus)
    results[name] = {
      "wall_s": walls,
      "cpu_s": cpus,
      "rows_per_s_wall": args.rows / wall,
      "rows_per_s_cpu": args.rows / cpu,
      "mib_per_s_wall": size / 2**20 / wall,
    }
    print(f"{name}: {args.rows / wall:,.0f} rows/s wall, {args.rows / cpu:,.0f} rows/s CPU")
  for name in modes:
    shutil.rmtree(os.path.join(args.workdir, f"cache-{name}"), ignore_errors=True)

  what = {
    "parse": "parse only (no ids, no writes)",
    "hash": "convert, hashed ids (1 pass)",
    "frequency": "convert, frequency ids (parse + count, then remap)",
    "hash_2_workers": "convert, hashed ids, 2 worker processes",
  }
  lines = [
    "# Criteo reader: TSV -> .npy cache conversion speed",
    "",
    f"{args.rows:,} synthetic Kaggle-format lines ({size / 2**20:,.0f} MiB, "
    f"{size / args.rows:.0f} bytes/line), block {block >> 20} MiB, median of {args.reps}; "
    f"{info['cpus']} CPUs shared (load average at start "
    f"{info['load_avg_at_start'][0]:.1f}), {info['date_utc']}. "
    "CPU rows/s = rows / CPU seconds of the benchmark and its workers (the code's own cost); "
    "wall rows/s depends on the neighbours.",
    "",
    harness.md_table(
      ["step", "wall rows/s", "CPU rows/s", "wall MiB/s"],
      [
        [
          what[name],
          f"{r['rows_per_s_wall']:,.0f}",
          f"{r['rows_per_s_cpu']:,.0f}",
          f"{r['mib_per_s_wall']:,.0f}",
        ]
        for name, r in results.items()
      ],
    ),
  ]
  h = results["hash"]
  met = "met" if h["rows_per_s_wall"] >= TARGET_ROWS_PER_S else "NOT met"
  lines += [
    "",
    f"Target: >= {TARGET_ROWS_PER_S:,} rows/s for the conversion (hashed ids): "
    f"**{h['rows_per_s_wall']:,.0f}** wall ({met}), {h['rows_per_s_cpu']:,.0f} CPU.",
    "",
  ]
  payload = {
    "machine": info,
    "rows": args.rows,
    "bytes": size,
    "block_bytes": block,
    "reps": args.reps,
    "target_rows_per_s": TARGET_ROWS_PER_S,
    "results": results,
    "synthetic": {"config": side["config"], "oracle_auc": side["oracle_auc"]},
  }
  harness.write_results("criteo_reader", payload, "\n".join(lines))


if __name__ == "__main__":
  main()
