"""What jit's dispatch costs the launching thread per argument array, on this platform.

Question (issue 43): a train step takes and returns its whole TrainState (donated); how much
of the main thread's time per step is the count of arrays in it? A jitted step that does
nothing but `step + 1` over a state of N float32[64, 8] leaves (donated, as the trainer's),
called `--calls` times after a warm-up: CPU microseconds of the calling thread per call
(time.thread_time), for each N, `--rounds` rounds interleaved (the machine is shared), min /
median / max; the slope (us per leaf) from a least-squares line over the medians.

For scale: `dlrm_kaggle`'s TrainState had 97 leaves with one array per dense table and its
row-wise Adagrad slot (26 x 2), 47 with the group's tables fused (recgnn/backends/
dense_fused.py); benchmarks/host_path.py measures the real loop.

  python benchmarks/dispatch.py                 # results/dispatch.{json,md}
"""

from __future__ import annotations

import os
import time

import harness
import jax
import jax.numpy as jnp
import numpy as np

LEAVES = (1, 10, 30, 50, 100, 200)


def per_call_us(n: int, calls: int, warmup: int) -> float:
  """CPU us of this thread per call of a donated no-work step over n leaves (+ a counter)."""
  state = (jnp.zeros((), jnp.int32), [jnp.zeros((64, 8), jnp.float32) for _ in range(n)])
  step = jax.jit(lambda s: (s[0] + 1, s[1]), donate_argnums=0)
  for _ in range(warmup):
    state = step(state)
  jax.block_until_ready(state)
  t = time.thread_time()
  for _ in range(calls):
    state = step(state)
  us = (time.thread_time() - t) / calls * 1e6
  jax.block_until_ready(state)
  return us


def main():
  ap = harness.flags.parser(__doc__)
  ap.add_argument("--calls", type=int, default=2000)
  ap.add_argument("--warmup", type=int, default=100)
  ap.add_argument("--rounds", type=int, default=5)
  ap.add_argument(
    "--quick", action="store_true", help="smoke run, not figures: 1 round of 100 calls"
  )
  args = ap.parse_args()
  if args.quick:
    args.calls, args.warmup, args.rounds = 100, 10, 1
  payload = harness.record(args)
  loads, runs = [], {n: [] for n in LEAVES}
  for r in range(args.rounds):
    loads.append(os.getloadavg()[0])
    for n in harness.alternated(LEAVES, r):
      runs[n].append(per_call_us(n, args.calls, args.warmup))
    print(f"round {r + 1}: " + ", ".join(f"{n}: {runs[n][-1]:.0f} us" for n in LEAVES), flush=True)
  summary = {n: harness.distribution(v) for n, v in runs.items()}
  med = np.array([summary[n]["median"] for n in LEAVES])
  slope, base = np.polyfit(np.array(LEAVES, float), med, 1)
  m = payload["machine"] = harness.machine_info()
  payload.update(runs={str(n): v for n, v in runs.items()}, us_per_leaf=slope, fixed_us=base)
  cell = lambda d: " / ".join(f"{d[q]:.0f}" for q in ("min", "median", "max"))  # noqa: E731
  md = "\n".join([
    "# jit dispatch per argument array (benchmarks/dispatch.py)",
    "",
    f"`{m['command']}` on {m['cpus']} CPUs ({m['cpu_model']}), jax {jax.__version__} "
    f"({jax.default_backend()}), {m['date_utc']}; {args.rounds} rounds interleaved, "
    f"{args.calls} calls each after {args.warmup}; load average before each round: "
    f"{min(loads):.1f} - {max(loads):.1f}. Cells: CPU us of the calling thread per call, min / "
    "median / max over rounds.",
    "",
    harness.md_table(["state leaves", "us / call"], [[n, cell(summary[n])] for n in LEAVES]),
    "",
    f"- least squares over the medians: **{slope:.2f} us per leaf** + {base:.0f} us per call",
    "",
  ])  # fmt: skip
  harness.write_results("dispatch", payload, md)


if __name__ == "__main__":
  main()
