"""How offload's SSD level reads rows (issue 44): random reads of a step's rows from a file
of float32 rows, three ways, on this machine's disk:

  buffered   os.preadv per run of rows, posix_fadvise(RANDOM) (no read-ahead), page cache
  direct     O_DIRECT, rows padded to the logical block (row_file.RowFile, io=direct)
  rocksdict  RocksDB (the `rocksdict` binding, pip; not a project dependency): a key per row,
             multi-get of a step's keys

Each step reads `--rows` distinct random rows (sorted) of a table of `--table_rows` rows of
`--dim` floats + 1 accumulator, the page cache of the files dropped first (fadvise
DONTNEED: every read reaches the disk). Reports rows/s, us per row and the disk bytes read
(/proc/self/io read_bytes) per logical row byte. Results: benchmarks/results/ssd_io.md.

  python benchmarks/ssd_io.py --dir /tmp/ssd_io --table_rows 1000000 --rows 16384 --steps 8
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import time

import numpy as np

from recgnn.backends.offload import row_file


def read_bytes() -> int:
  with open("/proc/self/io") as f:
    for line in f:
      if line.startswith("read_bytes:"):
        return int(line.split()[1])
  return 0


def drop_cache(paths) -> None:
  for p in paths:
    fd = os.open(p, os.O_RDONLY)
    try:
      os.fsync(fd) if os.access(p, os.W_OK) else None
      os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
      os.close(fd)


def steps_of(args, seed=0):
  rng = np.random.default_rng(seed)
  return [
    np.sort(rng.choice(args.table_rows, args.rows, replace=False)).astype(np.int64)
    for _ in range(args.steps)
  ]


def bench_file(args, io: str) -> dict:
  f = row_file.RowFile(args.dir, f"bench_{io}", args.table_rows, args.dim, ("accum",), io)
  rng = np.random.default_rng(1)
  f.create(lambda a, n: rng.standard_normal((n, f.floats), dtype=np.float32))
  steps = steps_of(args)
  drop_cache([f.path])
  buf = f.buffer(args.rows)
  b0, t0 = read_bytes(), time.perf_counter()
  for rows in steps:
    f.read(rows, buf)
  dt, db = time.perf_counter() - t0, read_bytes() - b0
  f.close(remove=True)
  return {"record": f.record, "seconds": dt, "disk_bytes": db}


def bench_rocksdict(args) -> dict | None:
  try:
    import rocksdict
  except ImportError:
    return None
  path = os.path.join(args.dir, "bench_rocksdb")
  shutil.rmtree(path, ignore_errors=True)
  opts = rocksdict.Options(raw_mode=True)
  opts.create_if_missing(True)
  db = rocksdict.Rdict(path, opts)
  rng = np.random.default_rng(1)
  logical = 4 * (args.dim + 1)
  chunk = 65536
  for a in range(0, args.table_rows, chunk):
    n = min(chunk, args.table_rows - a)
    vals = rng.standard_normal((n, args.dim + 1), dtype=np.float32)
    wb = rocksdict.WriteBatch(raw_mode=True)
    for i in range(n):
      wb.put((a + i).to_bytes(8, "big"), vals[i].tobytes())
    db.write(wb)
  db.flush()
  db.compact_range(None, None)
  db.close()
  db = rocksdict.Rdict(path, opts)
  steps = steps_of(args)
  drop_cache(glob.glob(os.path.join(path, "*.sst")))
  b0, t0 = read_bytes(), time.perf_counter()
  for rows in steps:
    got = db.get([int(r).to_bytes(8, "big") for r in rows])
    assert len(got[0]) == logical
  dt, db_bytes = time.perf_counter() - t0, read_bytes() - b0
  db.close()
  shutil.rmtree(path, ignore_errors=True)
  return {"record": logical, "seconds": dt, "disk_bytes": db_bytes}


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--dir", default="/tmp/recgnn_ssd_io")
  ap.add_argument("--table_rows", type=int, default=1_000_000)
  ap.add_argument("--dim", type=int, default=64)
  ap.add_argument("--rows", type=int, default=16384)
  ap.add_argument("--steps", type=int, default=8)
  ap.add_argument("--out", default="")
  ap.add_argument(
    "--quick", action="store_true", help="smoke run, not figures: 20,000 rows, 2 steps"
  )
  args = ap.parse_args()
  if args.quick:
    args.table_rows, args.rows, args.steps = 20_000, 1024, 2
  os.makedirs(args.dir, exist_ok=True)
  logical = 4 * (args.dim + 1)
  results = {io: bench_file(args, io) for io in ("buffered", "direct")}
  rdb = bench_rocksdict(args)
  if rdb is not None:
    results["rocksdict"] = rdb
  n = args.rows * args.steps
  lines = [
    f"table {args.table_rows:,} rows x ({args.dim} + 1) float32 ({logical} B logical), "
    f"{args.steps} steps of {args.rows:,} distinct random rows, page cache dropped; "
    f"load {os.getloadavg()[0]:.2f}",
    "",
    "| method | record B | rows/s | us/row | disk bytes / logical row bytes | / record bytes |",
    "|---|---|---|---|---|---|",
  ]
  for k, r in results.items():
    lines.append(
      f"| {k} | {r['record']} | {n / r['seconds']:,.0f} | {1e6 * r['seconds'] / n:.2f} | "
      f"{r['disk_bytes'] / (n * logical):.2f} | {r['disk_bytes'] / (n * r['record']):.2f} |"
    )
  text = "\n".join(lines)
  print(text)
  if args.out:
    with open(args.out, "w") as f:
      f.write(text + "\n")


if __name__ == "__main__":
  main()
