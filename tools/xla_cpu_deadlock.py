"""XLA:CPU's collective deadlock on simulated devices, without recgnn: is waiting for each step
before launching the next what avoids it?

  python tools/xla_cpu_deadlock.py [--runs=10] [--steps=3000] [--busy=2]

Each run is a fresh process with 8 simulated CPU devices (async dispatch off, as
recgnn.xla_env sets it) that launches a small jitted step (a matmul, the all-reduce of its
gradient, an all-gather; the state donated) STEPS times with a fresh batch transferred per
step. Mode "back_to_back" launches each step as soon as the previous launch returns (what
the trainer did); "one_in_flight" waits for the previous step's output first (what
recgnn.sharding.OneInFlight does). A run that hangs is ended by XLA itself after 40 s in the
rendezvous ("Expected 8 threads to join the rendezvous, but only 7 of them arrived") or by
a 240 s timeout. Modes alternate run by run; BUSY CPU-bound processes spin meanwhile, the runs
at a lower priority (nice +10). The race is lost when XLA's threads get the cores late: the
same program hung in 2 of 12 back-to-back runs (0 of 8 one at a time) here while other jobs
held the load near 10, and in none of 10 with only the two spinners (load ~3).
Writes benchmarks/results/xla_cpu_deadlock.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
MODES = ("back_to_back", "one_in_flight")


def _child(mode: str, steps: int) -> None:
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
  os.environ["JAX_CPU_ENABLE_ASYNC_DISPATCH"] = "false"
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = Mesh(np.array(jax.devices()), ("d",))
  rep, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("d"))

  @functools.partial(jax.jit, donate_argnums=0, in_shardings=(rep, split),
                     out_shardings=(rep, rep))  # fmt: skip
  def step(w, x):
    h = jnp.tanh(x @ w)
    g = x.T @ h / x.shape[0]  # all-reduce over the batch
    first = jax.lax.with_sharding_constraint(x[:, 0], rep)  # all-gather
    return w - 1e-3 * g, first.sum()

  w = jax.device_put(np.eye(64, dtype=np.float32), rep)
  rng = np.random.default_rng(0)
  for _ in range(steps):
    x = jax.device_put(rng.normal(size=(512, 64)).astype(np.float32), split)
    w, m = step(w, x)
    if mode == "one_in_flight":
      m.block_until_ready()
  jax.block_until_ready(w)
  print("finished", flush=True)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--runs", type=int, default=10, help="runs, the modes alternating")
  ap.add_argument("--steps", type=int, default=3000, help="steps each run launches")
  ap.add_argument("--busy", type=int, default=2, help="CPU-bound processes spinning meanwhile")
  args = ap.parse_args()
  runs, steps, busy = args.runs, args.steps, args.busy
  spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
  try:
    out = _runs(runs, steps)
  finally:
    for p in spinners:
      p.kill()
      p.wait()
  _write(out, runs, steps, busy)


def _runs(runs: int, steps: int) -> list[dict]:
  out = []
  for i in range(runs):
    for mode in MODES if i % 2 == 0 else MODES[::-1]:
      t0 = time.time()
      cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, str(steps)]
      try:
        # At a lower priority than the spinners: XLA's threads get the cores late, as on a
        # loaded machine, which is when the race is lost.
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                           preexec_fn=lambda: os.nice(10))  # fmt: skip
        text, code = p.stdout + p.stderr, p.returncode
      except subprocess.TimeoutExpired:
        text, code = "", None
      hung = code != 0 or "finished" not in text
      seven = "only 7 of them arrived" in text
      out.append({"mode": mode, "run": i + 1, "hung": hung, "seven_of_eight": seven,
                  "returncode": code, "wall_s": round(time.time() - t0, 1),
                  "load_1min": round(os.getloadavg()[0], 2)})  # fmt: skip
      print(json.dumps(out[-1]), flush=True)
  return out


def _write(out: list[dict], runs: int, steps: int, busy: int) -> None:
  os.makedirs(RESULTS, exist_ok=True)
  date = datetime.datetime.now().isoformat(timespec="seconds")
  with open(os.path.join(RESULTS, "xla_cpu_deadlock.json"), "w") as f:
    json.dump({"date": date, "steps": steps, "busy": busy, "runs": out}, f, indent=2)
  lines = [
    f"# XLA:CPU collective deadlock, 8 simulated devices ({date})",
    "",
    f"`python tools/xla_cpu_deadlock.py --runs={runs} --steps={steps} --busy={busy}`: "
    f"{steps} launches of a small 8-device step (all-reduce + all-gather, state donated) per "
    f"run, a fresh process per run (at nice +10), modes alternating, {busy} CPU-bound processes "
    f"beside them on {os.cpu_count()} CPUs. jax " + _jax_version() + ".",
    "",
    "| mode | runs | hung | of which 7 of 8 devices in the all-gather |",
    "|---|---:|---:|---:|",
  ]
  for mode in MODES:
    rs = [r for r in out if r["mode"] == mode]
    lines.append(f"| {mode} | {len(rs)} | {sum(r['hung'] for r in rs)} | "
                 f"{sum(r['seven_of_eight'] for r in rs)} |")  # fmt: skip
  with open(os.path.join(RESULTS, "xla_cpu_deadlock.md"), "w") as f:
    f.write("\n".join(lines) + "\n")


def _jax_version() -> str:
  out = subprocess.run([sys.executable, "-c", "import jax; print(jax.__version__)"],
                       capture_output=True, text=True)  # fmt: skip
  return out.stdout.strip()


if __name__ == "__main__":
  if len(sys.argv) > 1 and sys.argv[1] == "--child":
    _child(sys.argv[2], int(sys.argv[3]))
  else:
    main()
