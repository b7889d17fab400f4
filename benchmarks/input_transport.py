"""How the trainer's input worker hands its packed batches to the training process: our ring
of /dev/shm slots (recgnn.train.input_worker) against grain's multiprocessing
(`IterDataset.mp_prefetch`, grain's own shared-memory transfer of numpy arrays), on the
same batches.

Question (issue 43): does grain's multiprocessing fit the input worker? Its workers run a
`MapDataset` (random access by index) through picklable transforms and send each element to
the consumer; ours forks the trainer's stream and writes each batch into a slot. Here both
only deliver: each batch is a copy of one packed `dlrm_kaggle` batch (batch 2048, 26 tables:
the same per-dtype buffers and bytes `feeder.Feeder.pack` makes), made in the worker, so what
differs is the transport. Per batch, in the training (consumer) process: CPU ms of the thread
that takes the batches (time.thread_time: what competes with the launching thread), wall ms
(batches/s of the delivery alone), after `--warmup` batches; `--processes` rounds interleaved
(the machine is shared), min / median / max.

  python benchmarks/input_transport.py                  # results/input_transport.{json,md}
"""

from __future__ import annotations

import os
import time

import harness
import numpy as np

# dlrm_kaggle's packed train batch at batch 2048 (feeder.Feeder.pack: one [devices, n] buffer per
# dtype): float32 (dense features, label, weight) and int32 (26 tables' ids, unique, inverse).
SHAPES = (("<f4", (1, 2048 * 15)), ("<i4", (1, 2048 * 26 * 3)))
MB = sum(np.prod(s) * np.dtype(d).itemsize for d, s in SHAPES) / 2**20


def _batch(i: int) -> list:
  return [np.full(shape, i % 7, np.dtype(d)) for d, shape in SHAPES]


class _Produce:
  """The worker side for the shm ring: each batch packed into its slot (`alloc`), as the
  trainer's packing does."""

  busy_seconds, batches = 0.0, 0

  def __init__(self, n: int):
    self.n, self.alloc = n, None

  def __iter__(self):
    from recgnn.train import inputs
    from recgnn.train.packing import Item

    layout = inputs.PackLayout(None, ())
    for i in range(self.n):
      src = _batch(i)
      bufs = self.alloc([(d, s) for d, s in SHAPES])
      for b, x in zip(bufs, src):
        b[...] = x
      self.batches += 1
      yield Item("train", None, 2048, ((bufs, []), layout))


def consume(batches, args, release) -> dict:
  """CPU and wall ms per batch of the consuming thread after the warmup."""
  n = 0
  for bufs in batches:
    if n == args.warmup:
      c, w = time.thread_time(), time.perf_counter()
    assert int(bufs[1][0, 0]) == n % 7  # (in order, intact)
    release()
    n += 1
  m = n - args.warmup
  cpu, wall = time.thread_time() - c, time.perf_counter() - w
  return {"cpu_ms": 1e3 * cpu / m, "wall_ms": 1e3 * wall / m}


def shm(args) -> dict:
  from recgnn.train.input_worker import InputWorker

  w = InputWorker(lambda: _Produce(args.batches), slots=3)
  state = {}

  def batches():
    for item in w:
      state["release"] = item.release
      yield item.prepared[0][0]

  try:
    return consume(batches(), args, lambda: state["release"]())
  finally:
    w.close()


def grain_mp(args) -> dict:
  import grain
  from absl import flags

  flags.FLAGS.mark_as_parsed()  # (grain's workers read absl flags; this script has none)

  ds = grain.MapDataset.range(args.batches).map(_batch).to_iter_dataset()
  ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=1, per_worker_buffer_size=3))
  return consume(iter(ds), args, lambda: None)


def main():
  ap = harness.flags.parser(__doc__)
  ap.add_argument("--batches", type=int, default=3000)
  ap.add_argument("--warmup", type=int, default=200)
  ap.add_argument("--processes", type=int, default=3)
  ap.add_argument(
    "--quick", action="store_true", help="smoke run, not figures: 1 round of 100 batches"
  )
  args = ap.parse_args()
  if args.quick:
    args.batches, args.warmup, args.processes = 100, 10, 1

  runs: dict[str, list] = {"shm ring": [], "grain mp_prefetch": []}
  for r in range(args.processes):
    order = list(runs) if r % 2 == 0 else list(reversed(runs))
    for name in order:
      load = os.getloadavg()[0]
      res = (shm if name == "shm ring" else grain_mp)(args)
      res["load_before"] = load
      runs[name].append(res)
      print(f"round {r + 1} {name}: {res['cpu_ms']:.3f} CPU ms / batch, {res['wall_ms']:.3f} "
            f"wall ms / batch (load {load:.1f})", flush=True)  # fmt: skip
  summary = {
    n: {k: harness.distribution([x[k] for x in xs]) for k in ("cpu_ms", "wall_ms")}
    for n, xs in runs.items()
  }
  m = harness.machine_info()
  loads = [x["load_before"] for xs in runs.values() for x in xs]
  cell = lambda d: " / ".join(f"{d[q]:.3f}" for q in ("min", "median", "max"))  # noqa: E731
  rows = [[n, cell(s["cpu_ms"]), cell(s["wall_ms"])] for n, s in summary.items()]
  md = "\n".join([
    "# The input worker's transport: /dev/shm ring vs grain (benchmarks/input_transport.py)",
    "",
    f"`{m['command']}` on {m['cpus']} CPUs ({m['cpu_model']}), {m['date_utc']}; "
    f"{args.processes} rounds interleaved, {args.batches} batches each after {args.warmup}; "
    f"load average before each: {min(loads):.1f} - {max(loads):.1f}. One dlrm_kaggle packed "
    f"batch (2048 examples, {MB:.2f} MB) per item; cells min / median / max over rounds.",
    "",
    harness.md_table(["transport", "consumer CPU ms / batch", "wall ms / batch"], rows),
    "",
  ])  # fmt: skip
  harness.write_results("input_transport", {"machine": m, "args": vars(args), "runs": runs,
                                            "summary": summary}, md)  # fmt: skip


if __name__ == "__main__":
  main()
