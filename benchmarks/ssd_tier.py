"""offload's SSD level (storage='ssd:DIR', issue 44) against offload with the whole table in
RAM: step time, disk bytes read / written per step, host-cache hit rate and peak RSS, at
host caches of 1 / 5 / 20% of the rows, on a Zipf(1.05) id stream, the same device cache.

Each configuration runs in its own process (peak RSS and /proc/self/io are the process's),
driven as the trainer drives a backend (recgnn.train.inputs: the input thread prepares
`--prefetch` batches ahead; jitted lookup + update with the state donated; after_update
hands the write-back to the writer thread). Timed: the steps after `--warmup` (compiles,
caches filled), wall clock per step. Disk bytes: /proc/self/io read_bytes / write_bytes
over the timed steps, against the rows the host caches missed (read from the file: on
demand and ahead) x the file's record bytes (`row_file`: the row and its optimizer state,
padded to the disk's logical block under io=direct).

  python benchmarks/ssd_tier.py                      # ~5 minutes on 2 cores
  python benchmarks/ssd_tier.py --rows 4000000 --out ssd_tier_4m
  python benchmarks/ssd_tier.py --big                # a table bigger than RAM (not in CI)
Writes benchmarks/results/<out>.{json,md,png}. The row files go to --dir, removed after.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

import harness  # (this checkout first on sys.path)
import numpy as np

RESULTS = harness.RESULTS
HOST_CACHES = (0.01, 0.05, 0.20)


def proc_io() -> dict[str, int]:
  with open("/proc/self/io") as f:
    return {k: int(v) for k, v in (line.split(": ") for line in f)}


def peak_rss() -> int:
  """The process's peak resident bytes (VmHWM: this process's own, reset by `reset_peak_rss`;
  getrusage's ru_maxrss would carry a forking parent's peak into a child)."""
  return _status("VmHWM:")


def _status(key: str) -> int:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(key):
        return int(line.split()[1]) * 1024
  return 0


def rss() -> int:
  """The process's resident bytes now (VmRSS)."""
  return _status("VmRSS:")


def backend_text(args, host_cache: float | None) -> str:
  size = f"cache_rows={args.cache_rows}" if args.cache_rows else f"cache_fraction={args.cache}"
  text = f"offload({size}, policy=lru, lookahead={args.lookahead}"
  if host_cache is not None:
    text += f", host_cache={host_cache}, storage='ssd:{args.dir}', io={args.io}"
  return text + ")"


def _spec_text(args, host_cache: float | None):
  """(the table's spec, the backend string) of a configuration."""
  from recgnn.embeddings import base

  rows = args.ram_rows if host_cache is None and args.ram_rows else args.rows
  spec = base.TableSpec(
    name="t", num_rows=rows, dim=args.dim,
    optimizer=base.OptimizerSpec(name="rowwise_adagrad", learning_rate=0.01),
  )  # fmt: skip
  return spec, backend_text(args, host_cache)


def run_one(args, host_cache: float | None) -> dict:
  """One configuration, in this process: -> its measurements."""
  import jax

  from recgnn import planner
  from recgnn.embeddings import base
  from recgnn.train import inputs

  rows = args.ram_rows if host_cache is None and args.ram_rows else args.rows
  if args.fast_init:  # (benchmark only: numpy's generator, not the backends' shared init)
    from recgnn.backends.offload.table import Offload

    def fast(self, key, first, n):
      r = np.random.default_rng(first)
      out = {"table": r.standard_normal((n, self.spec.dim), dtype=np.float32) * 0.01}
      out.update({k: np.full(n, 0.1, np.float32) for k in self.spec.optimizer.slot_names()})
      return out

    Offload.init_chunk = fast
    Offload.init_host = lambda self, key: fast(self, key, 0, base.aligned_rows(self.spec.num_rows))
  spec, text = _spec_text(args, host_cache)
  rng = np.random.default_rng(0)
  perm = rng.permutation(rows).astype(np.int32)
  cdf = harness.zipf_cdf(rows, args.exponent)  # (once: O(rows))
  n = args.warmup + args.steps
  batches = [perm[harness.zipf_ranks(rng, cdf, (args.batch, args.bag))] for _ in range(n)]
  del perm, cdf  # (the stream's own O(rows) arrays: not the backend's memory)
  t0 = time.perf_counter()
  group = planner.make_backend(text, spec)
  state = group.init(jax.random.key(0))
  init_s = time.perf_counter() - t0
  plan = planner.Plan({group.name: group}, {"t": group.name}, group.mesh)
  lookup = jax.jit(group.lookup)
  update = jax.jit(group.update, donate_argnums=0)
  grads = jax.jit(lambda pooled: 2e-3 * pooled)
  stream = [("train", None, {"ids": {"t": b}}) for b in batches]
  marks = {}
  for step, item in enumerate(inputs.run_ahead(inputs.prepare_stream(plan, stream), args.prefetch)):
    if step == args.warmup:
      jax.block_until_ready(state)
      group.stats()  # (the counters restart at the timed steps)
      marks = {"t": time.perf_counter(), "io": proc_io()}
      if host_cache is not None:
        marks["counts"] = group._tier.rows.counts()
    prepared = jax.device_put(item.prepared[group.name])
    pooled, residuals = lookup(state, prepared)
    state = update(state, prepared, residuals, {"t": grads(pooled["t"])})
    state = group.after_update(state)
    if step >= args.warmup:
      marks["rss"] = max(marks.get("rss", 0), rss())
  jax.block_until_ready(state)
  group._tier.drain()
  seconds = time.perf_counter() - marks["t"]
  load = os.getloadavg()  # (the machine is shared: the load over the timed steps, 1-minute)
  io = proc_io()
  stats = group.stats()
  checkpoint_s = None
  if not args.fast_init and not args.checkpoint:  # what a checkpoint costs the backend
    t1 = time.perf_counter()
    exported = group.export(group.sync(state))["t"]
    if host_cache is not None:  # (the SSD level streams: read the row file through)
      exported.count(lambda c: 0)
    else:
      jax.block_until_ready(exported["rows"])
    checkpoint_s = time.perf_counter() - t1
  out = {
    "backend": text,
    "host_cache": host_cache,
    "init_s": init_s,
    "load_at_steps": load[0],
    "step_ms": 1e3 * seconds / args.steps,
    "disk_read_bytes_per_step": (io["read_bytes"] - marks["io"]["read_bytes"]) / args.steps,
    "disk_write_bytes_per_step": (io["write_bytes"] - marks["io"]["write_bytes"]) / args.steps,
    "device_hit_rate": stats.get("t/hit_rate"),
    "peak_rss_bytes": peak_rss(),
    # (sampled after each timed step: the training's RSS, not the stream's generation)
    "training_rss_bytes": marks.get("rss", 0),
    "checkpoint_export_s": checkpoint_s,
    "table_bytes": rows * spec.row_bytes,
    "rows": rows,
    "host_budget_bytes": group.memory()["t"].host_bytes,
  }
  if host_cache is not None:
    rows = group._tier.rows
    f = rows.tables[0].file
    c = rows.counts()
    out.update(
      host_hit_rate=stats.get("ssd_host_hit_rate"),
      window=stats.get("ssd_window"),
      record_bytes=f.record,
      logical_row_bytes=f.logical_bytes,
      file_bytes=f.size,
      asked_read_bytes_per_step=(c["bytes_read"] - marks["counts"]["bytes_read"]) / args.steps,
      asked_written_bytes_per_step=(c["bytes_written"] - marks["counts"]["bytes_written"])
      / args.steps,
      read_ahead_rows_per_step=stats.get("ssd_read_ahead_rows_per_step"),
      # (where the step goes: the prefetch thread's disk time per batch against the input
      # thread's time between batches; both averaged by DiskRows)
      prefetch_read_ms_per_batch=1e3 * rows.read_seconds_per_batch,
      batch_interval_ms=1e3 * rows.batch_seconds,
      lifetime=c,
    )
    # Rows read from the file (host-cache misses on demand and ahead) over the same wall
    # window as /proc/self/io (`stats` divides by batches prepared, which run ahead).
    missed = (c["misses"] + c["prefetched"] - marks["counts"]["misses"]
              - marks["counts"]["prefetched"]) / args.steps  # fmt: skip
    out["missed_rows_per_step"] = missed
    out["disk_read_vs_missed_records"] = (
      out["disk_read_bytes_per_step"] / (missed * f.record) if missed else None
    )
    out["disk_read_vs_missed_logical"] = (
      out["disk_read_bytes_per_step"] / (missed * f.logical_bytes) if missed else None
    )
  if args.checkpoint:  # (after the step's counters are read: the save reads the row file)
    out.update(checkpoint_cost(args, group, state, spec))
  if host_cache is not None:
    group._tier.rows.close()
  return out


def reset_peak_rss() -> None:
  """VmHWM back to the current RSS (Linux: clear_refs 5), so `peak_rss` measures what follows."""
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")


def _train_state(g, emb):
  """A TrainState around one group's state (the checkpoint's dense part: a stand-in)."""
  import jax

  from recgnn import planner
  from recgnn.train import train_state as state_lib

  st = state_lib.TrainState(
    step=jax.numpy.zeros((), jax.numpy.int32), params={"w": jax.numpy.zeros(2)},
    opt_state=(), emb={g.name: emb}, key=jax.random.key(0),
  )  # fmt: skip
  return st, planner.Plan({g.name: g}, {"t": g.name}, g.mesh)


def _sampled(g, spec) -> np.ndarray:
  """f32[<= 4096, dim + 1]: 4096 random rows (a fixed draw) and their Adagrad accumulators, as
  the group holds them."""
  sample = np.unique(np.random.default_rng(7).integers(0, spec.num_rows, 4096))
  if g._tier.disk:
    c = g._tier.rows.tables[0]
    out = np.empty((sample.shape[0], c.file.floats), np.float32)
    c.read(sample, out)
    return out[:, : spec.dim + 1]
  t = g._tier.table("t")
  return np.concatenate([t["table"][sample], t["accum"][sample, None]], 1)


def _workdir(args) -> str:
  return args.dir.rstrip("/") + "_ckpt"


def checkpoint_cost(args, group, state, spec) -> dict:
  """One checkpoint of the trained group, as the trainer takes it (sync, then
  Checkpointer.save: the SSD level streams its row file into it), then its restore in a
  fresh process (`restore_one`: what a --resume costs; this run's row file removed first, so
  the disk holds the checkpoint and one row file): seconds, bytes, peak RSS of each phase."""
  from recgnn.train import checkpoint

  workdir = _workdir(args)
  shutil.rmtree(workdir, ignore_errors=True)
  ckpt = checkpoint.Checkpointer(workdir)
  free = shutil.disk_usage(os.path.dirname(workdir)).free / 2**30
  print(f"checkpoint: free disk {free:.1f} GiB, load {os.getloadavg()}", file=sys.stderr)
  out = {"checkpoint_rss_before": rss()}
  reset_peak_rss()
  t0 = time.perf_counter()
  state = group.sync(state)
  out.update(checkpoint_sync_s=time.perf_counter() - t0, checkpoint_sync_peak_rss=peak_rss())
  reset_peak_rss()
  t0 = time.perf_counter()
  st, plan = _train_state(group, state)
  ckpt.save(st, 1, plan)
  out.update(checkpoint_save_s=time.perf_counter() - t0, checkpoint_save_peak_rss=peak_rss())
  out["checkpoint_load_after_save"] = os.getloadavg()[0]
  ckpt.close()
  step_dir = os.path.join(checkpoint.checkpoint_dir(workdir), "1")
  out["checkpoint_bytes"] = sum(
    os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(step_dir) for f in fs
  )
  np.save(os.path.join(workdir, "sampled.npy"), _sampled(group, spec))
  if group._tier.disk:
    group._tier.rows.close()  # (its row file removed: room for the restore's)
  cfg = "ram" if not group._tier.disk else str(args.one)
  cmd = [sys.executable, __file__, *sys.argv[1:-2], "--one", f"restore:{cfg}"]
  proc = subprocess.run(cmd, capture_output=True, text=True)
  line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
  if proc.returncode or not line:
    raise SystemExit(f"restore failed\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
  out.update(json.loads(line[0][7:]))
  shutil.rmtree(workdir, ignore_errors=True)
  print(f"checkpoint: {out}", file=sys.stderr, flush=True)
  return out


def restore_one(args, host_cache: float | None) -> dict:
  """In a fresh process: restore checkpoint 1 of `checkpoint_cost` into a new group (the SSD
  level: a new row file written from it a chunk at a time) -> seconds, this process's peak
  RSS, and whether SAMPLE's rows equal the trained group's."""
  from recgnn import planner
  from recgnn.train import checkpoint

  spec, text = _spec_text(args, host_cache)
  group = planner.make_backend(text, spec)
  ckpt = checkpoint.Checkpointer(_workdir(args))
  before = rss()
  t0 = time.perf_counter()
  ckpt.restore(*_train_state(group, None), 1)  # (the tables' shapes come from the plan)
  out = {"checkpoint_restore_s": time.perf_counter() - t0}
  out.update(checkpoint_restore_peak_rss=peak_rss(), checkpoint_restore_rss_before=before)
  want = np.load(os.path.join(_workdir(args), "sampled.npy"))
  out["checkpoint_restored_rows_equal"] = bool(np.array_equal(_sampled(group, spec), want))
  ckpt.close()
  if group._tier.disk:
    group._tier.rows.close()
  return out


def markdown(payload: dict) -> str:
  a = payload["args"]
  res = payload["results"]
  ram = next((r for r in res if r["host_cache"] is None), res[0])
  lines = [
    "# offload's SSD level vs the whole table in RAM",
    "",
    f"One table of {a['rows']:,} rows x {a['dim']} (row-wise Adagrad)"
    + (f", the RAM baseline's {a['ram_rows']:,} rows" if a.get("ram_rows") else "")
    + f" ({ram['table_bytes'] / 2**30:.2f} GiB of rows + state in RAM), device cache "
    + (f"{a['cache_rows']:,} rows" if a.get("cache_rows") else f"{a['cache']:.0%}")
    + f", batch {a['batch']} x bag {a['bag']}, Zipf({a['exponent']}), "
    f"{a['steps']} timed steps after {a['warmup']}; io={a['io']}; XLA:CPU, "
    f"{payload['machine']['cpus']} cores, load {payload['machine']['load_avg_at_start'][0]:.1f} "
    "at start (shared machine: compare within the table).",
    "",
  ]
  rows = []
  for r in res:
    ssd = r["host_cache"] is not None
    rows.append(
      [
        (f"ssd, host cache {r['host_cache']:.0%}" if ssd else "RAM (whole table)")
        + (f", {r['rows']:,} rows" if a.get("ram_rows") else ""),
        f"{r['step_ms']:.1f} (load {r['load_at_steps']:.1f})"
        if "load_at_steps" in r
        else f"{r['step_ms']:.1f}",
        f"{r['step_ms'] / ram['step_ms']:.2f}",
        f"{r['host_hit_rate']:.3f}" if ssd and r.get("host_hit_rate") is not None else "-",
        f"{r['disk_read_bytes_per_step'] / 1e6:.2f}",
        f"{r['disk_write_bytes_per_step'] / 1e6:.2f}",
        f"{r['disk_read_vs_missed_records']:.2f}"
        if ssd and r.get("disk_read_vs_missed_records")
        else "-",
        f"{r['peak_rss_bytes'] / 2**30:.2f} / "
        + (f"{r['training_rss_bytes'] / 2**30:.2f}" if r.get("training_rss_bytes") else "-"),
        f"{r.get('host_budget_bytes', 0) / 2**30:.2f}",
        "-" if r.get("checkpoint_export_s") is None else f"{r['checkpoint_export_s']:.2f}",
      ]
    )
  lines.append(
    harness.md_table(
      [
        "config",
        "step ms (1-min load)",
        "x RAM",
        "host hit rate",
        "disk read MB/step",
        "disk written MB/step",
        "read / (misses x record)",
        "peak / training RSS GiB",
        "memory() host GiB",
        "checkpoint sync + export s",
      ],
      rows,
    )  # fmt: skip
  )
  ck = [r for r in res if r.get("checkpoint_save_s") is not None]
  if ck:
    lines += ["", "One checkpoint (sync + Checkpointer.save, then a restore into a fresh group; "
              "the SSD level streams its row file, streamed.CHUNK_BYTES chunks):", ""]  # fmt: skip
    lines.append(
      harness.md_table(
        [
          "config",
          "RSS before GiB",
          "sync s (peak RSS GiB)",
          "save s (peak RSS GiB)",
          "checkpoint GB",
          "restore s, fresh process (its peak RSS GiB)",
          "4096 sampled rows equal",
        ],
        [
          [
            ("ssd" if r["host_cache"] is not None else "RAM") + f", {r['rows']:,} rows",
            f"{r['checkpoint_rss_before'] / 2**30:.2f}",
            f"{r['checkpoint_sync_s']:.1f} ({r['checkpoint_sync_peak_rss'] / 2**30:.2f})",
            f"{r['checkpoint_save_s']:.1f} ({r['checkpoint_save_peak_rss'] / 2**30:.2f})",
            f"{r['checkpoint_bytes'] / 1e9:.2f}",
            f"{r['checkpoint_restore_s']:.1f} ({r['checkpoint_restore_peak_rss'] / 2**30:.2f})",
            str(r["checkpoint_restored_rows_equal"]),
          ]
          for r in ck
        ],
      )  # fmt: skip
    )
  return "\n".join(lines) + "\n"


def plot(payload: dict, path: pathlib.Path) -> None:
  try:
    import matplotlib
  except ImportError:
    print("matplotlib not installed: no PNG (pip install matplotlib)")
    return

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  res = payload["results"]
  ram = next(r for r in res if r["host_cache"] is None)
  ssd = [r for r in res if r["host_cache"] is not None]
  x = [100 * r["host_cache"] for r in ssd]
  fig, ax = plt.subplots(1, 3, figsize=(13, 3.6))
  ax[0].plot(x, [r["step_ms"] for r in ssd], "o-", label="ssd")
  ax[0].axhline(ram["step_ms"], color="gray", ls="--", label="whole table in RAM")
  ax[0].set(xlabel="host cache (% of rows)", ylabel="step ms", title="step time")
  ax[0].legend()
  ax[1].plot(x, [r["disk_read_bytes_per_step"] / 1e6 for r in ssd], "o-", label="read")
  ax[1].plot(x, [r["disk_write_bytes_per_step"] / 1e6 for r in ssd], "s-", label="written")
  ax[1].set(xlabel="host cache (% of rows)", ylabel="MB per step", title="disk bytes")
  ax[1].legend()
  ax[2].plot(x, [r.get("host_hit_rate") or 0 for r in ssd], "o-")
  ax[2].set(xlabel="host cache (% of rows)", ylabel="hit rate", title="host-cache hit rate")
  for a in ax:
    a.set_xscale("log")
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--rows", type=int, default=2_000_000)
  ap.add_argument("--dim", type=int, default=64)
  ap.add_argument("--batch", type=int, default=2048)
  ap.add_argument("--bag", type=int, default=4)
  ap.add_argument("--exponent", type=float, default=1.05)
  ap.add_argument("--cache", type=float, default=0.01, help="device cache, fraction of rows")
  ap.add_argument("--cache_rows", type=int, default=0, help="device cache rows (both)")
  ap.add_argument("--ram_rows", type=int, default=0, help="the RAM baseline's table rows")
  ap.add_argument("--fast_init", action="store_true", help="numpy init (a table > RAM)")
  ap.add_argument("--lookahead", type=int, default=4)
  ap.add_argument("--prefetch", type=int, default=2)
  ap.add_argument("--warmup", type=int, default=20)
  ap.add_argument("--steps", type=int, default=60)
  ap.add_argument("--io", default="direct")
  ap.add_argument("--dir", default="/tmp/recgnn_ssd_tier")
  ap.add_argument("--host_caches", default=",".join(map(str, HOST_CACHES)))
  ap.add_argument("--skip_ram", action="store_true", help="(a table bigger than RAM)")
  ap.add_argument("--checkpoint", action="store_true", help="save + restore one checkpoint")
  ap.add_argument("--out", default="ssd_tier")
  ap.add_argument("--one", default="", help="(internal) run one configuration, print JSON")
  ap.add_argument(
    "--quick",
    action="store_true",
    help="smoke run, not figures: 50,000 rows, batch 256, 4 steps, one host cache",
  )
  args = ap.parse_args(argv)
  if args.quick:
    args.rows, args.batch, args.warmup, args.steps, args.host_caches = 50_000, 256, 2, 4, "0.1"
    args.cache_rows = args.batch * args.bag  # (a 1% cache of 50k rows is under a batch's)
  if args.one.startswith("restore:"):
    cfg = args.one.partition(":")[2]
    out = restore_one(args, None if cfg == "ram" else float(cfg))
    print("RESULT " + json.dumps(out))
    return
  if args.one:
    out = run_one(args, None if args.one == "ram" else float(args.one))
    print("RESULT " + json.dumps(out))
    return
  payload = harness.record(args)  # (the machine record, its load, before anything runs)
  free = shutil.disk_usage(os.path.dirname(args.dir.rstrip("/")) or "/").free
  print(f"free disk {free / 2**30:.1f} GiB; load {os.getloadavg()}")
  configs = ([] if args.skip_ram else ["ram"]) + args.host_caches.split(",")
  results = []
  for c in configs:
    cmd = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--one", c]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode or not line:
      raise SystemExit(f"{c}: failed\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    results.append(json.loads(line[0][7:]))
    print(c, {k: v for k, v in results[-1].items() if k != "lifetime"})
  shutil.rmtree(args.dir, ignore_errors=True)
  payload["results"] = results
  harness.write_results(args.out, payload, markdown(payload))
  if not args.skip_ram and harness.can_plot():
    plot(payload, RESULTS / f"{args.out}.png")
  elif not args.skip_ram:
    print("no plot (matplotlib not installed): pip install matplotlib")


if __name__ == "__main__":
  main()
