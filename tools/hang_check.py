"""Back-to-back runs of the README's 8-device example under CPU load: does any of them hang?

  python tools/hang_check.py [--runs=20] [--busy=2] [--steps=400] [--timeout=900]

Runs `XLA_FLAGS=--xla_force_host_platform_device_count=8 python run.py
--experiment=dlrm_kaggle --config.mesh.data=8 --config.train.steps=STEPS` RUNS times, one
after another, while BUSY other processes spin on the CPU (issue 30: the example hung at its
first all-gather in 3 of 8 runs, before steps were launched one at a time on simulated
devices). A run that does not end within --timeout seconds counts as hung: its threads'
native and Python stacks are saved (py-spy, when installed) and it is killed. Writes
benchmarks/results/hang_check.{json,md}: per run the exit status, wall time, load average.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")

_RUNS = flags.DEFINE_integer("runs", 20, "Runs, one after another.")
_BUSY = flags.DEFINE_integer("busy", 2, "CPU-bound processes spinning during the runs.")
_STEPS = flags.DEFINE_integer("steps", 400, "train.steps of each run.")
_TIMEOUT = flags.DEFINE_integer("timeout", 900, "Seconds after which a run counts as hung.")
_NAME = flags.DEFINE_string("name", "hang_check", "Results file name (without extension).")


def _spin():
  return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def _stacks(pid: int) -> str:
  spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
  if not os.path.exists(spy):
    return "(py-spy not installed: no stacks)"
  out = subprocess.run([spy, "dump", "--native", "--pid", str(pid)], capture_output=True,
                       text=True, timeout=120)  # fmt: skip
  return out.stdout + out.stderr


def main(argv):
  del argv
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
         "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}  # fmt: skip
  busy = [_spin() for _ in range(_BUSY.value)]
  runs = []
  try:
    for i in range(_RUNS.value):
      workdir = tempfile.mkdtemp(prefix="hang_check_")
      cmd = [sys.executable, "run.py", "--experiment=dlrm_kaggle", f"--workdir={workdir}",
             "--config.mesh.data=8", f"--config.train.steps={_STEPS.value}"]  # fmt: skip
      t0 = time.time()
      proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)  # fmt: skip
      hung, stacks = False, ""
      try:
        out, _ = proc.communicate(timeout=_TIMEOUT.value)
      except subprocess.TimeoutExpired:
        hung = True
        stacks = _stacks(proc.pid)
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate()
      wall = time.time() - t0
      final = [line for line in out.splitlines() if line.startswith("Final:")]
      run = {
        "run": i + 1,
        "returncode": proc.returncode,
        "hung": hung,
        "wall_s": round(wall, 1),
        "load_1min_after": round(os.getloadavg()[0], 2),
        "final": final[-1] if final else None,
      }
      if hung or proc.returncode != 0:
        run["tail"] = out[-4000:]
        run["stacks"] = stacks[-20000:]
      runs.append(run)
      print(json.dumps({k: v for k, v in run.items() if k not in ("tail", "stacks")}), flush=True)
      shutil.rmtree(workdir, ignore_errors=True)
  finally:
    for p in busy:
      p.kill()
      p.wait()
  _write(runs)


def _write(runs):
  os.makedirs(RESULTS, exist_ok=True)
  meta = {
    "date": datetime.datetime.now().isoformat(timespec="seconds"),
    "command": "XLA_FLAGS=--xla_force_host_platform_device_count=8 python run.py "
    f"--experiment=dlrm_kaggle --config.mesh.data=8 --config.train.steps={_STEPS.value}",
    "busy_processes": _BUSY.value,
    "timeout_s": _TIMEOUT.value,
    "cpus": os.cpu_count(),
  }
  hung = sum(r["hung"] for r in runs)
  failed = sum(r["returncode"] != 0 and not r["hung"] for r in runs)
  with open(os.path.join(RESULTS, f"{_NAME.value}.json"), "w") as f:
    json.dump({"meta": meta, "runs": runs}, f, indent=2)
  walls = sorted(r["wall_s"] for r in runs)
  lines = [
    f"# {len(runs)} back-to-back 8-device runs under load ({meta['date']})",
    "",
    f"`{meta['command']}`, {len(runs)} times in a row, while {meta['busy_processes']} "
    f"CPU-bound processes (`while True: pass`) ran on the {meta['cpus']} CPUs; a run still "
    f"going after {meta['timeout_s']} s counts as hung. Command: `python "
    f"tools/hang_check.py --runs={len(runs)} --busy={meta['busy_processes']} "
    f"--steps={_STEPS.value}`.",
    "",
    f"**Hung: {hung} of {len(runs)}**; other failures: {failed}; wall time per run "
    f"{walls[0]:.0f}-{walls[-1]:.0f} s (median {walls[len(walls) // 2]:.0f} s).",
    "",
    "| run | exit | hung | wall s | load (1 min) after |",
    "|---:|---:|:---:|---:|---:|",
  ]
  for r in runs:
    lines.append(
      f"| {r['run']} | {r['returncode']} | {'yes' if r['hung'] else 'no'} | {r['wall_s']:.0f} "
      f"| {r['load_1min_after']:.1f} |"
    )
  with open(os.path.join(RESULTS, f"{_NAME.value}.md"), "w") as f:
    f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
  app.run(main)
