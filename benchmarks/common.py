"""What every benchmark shares (one copy): the machine record, results files, markdown tables,
Zipf ids and timing.

  machine_info()            what the numbers were measured on (CPU model, cores, load, versions)
  write_results(name, ...)  results/<name>.json and results/<name>.md
  md_table(header, rows)    a markdown table
  zipf_cdf / zipf_ranks / zipf_ids   bounded Zipf draws
  time_calls(fn, repeat)    min / median / max of repeated calls, blocked on their results
  jitted_runner, interleaved_timing  contestants timed in round-robin on a shared machine

The machine is shared: every record carries the load average, and contestants that are
compared run interleaved so that they see the same load. jax is imported only by the
helpers that time jitted code, so that data benchmarks do not pay for it.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
# Environment variables that change what is measured; recorded with the results.
ENV_RECORDED = (
  "XLA_FLAGS",
  "GLIBC_TUNABLES",
  "OMP_WAIT_POLICY",
  "OMP_NUM_THREADS",
  "MALLOC_CONF",  # jemalloc's settings (dlrm_throughput --allocators)
  "TCMALLOC_RELEASE_RATE",
)


# ----------------------------------------------------------------------------- the machine


def cpu_model() -> str:
  """The CPU's model name (/proc/cpuinfo), else what platform knows."""
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def machine_info() -> dict:
  """What the numbers were measured on (the machine is shared: load average included). jax's
  version, backend and devices only where the benchmark has imported jax."""
  info = {
    "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "host": platform.node(),
    "cpu_model": cpu_model(),
    "python": platform.python_version(),
    "numpy": np.__version__,
    "cpus": len(os.sched_getaffinity(0)),
    "load_avg_at_start": os.getloadavg(),
    "env": {k: os.environ[k] for k in ENV_RECORDED if k in os.environ},
    "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
  }
  jax = sys.modules.get("jax")
  if jax is not None:
    info["jax"] = jax.__version__
    info["jax_backend"] = jax.default_backend()
    info["jax_devices"] = [str(d) for d in jax.devices()]
  return info


# ----------------------------------------------------------------------------- results


def write_results(
  name: str, payload: dict, markdown: str, out_dir: pathlib.Path = RESULTS, sort_keys=False
):
  """results/<name>.json (payload) and results/<name>.md (markdown); prints the markdown."""
  out_dir = pathlib.Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  (out_dir / f"{name}.json").write_text(json.dumps(payload, indent=2, sort_keys=sort_keys) + "\n")
  (out_dir / f"{name}.md").write_text(markdown)
  print(markdown)
  print(f"wrote {out_dir / name}.json and .md")


def md_table(header: Sequence[str], rows: Iterable[Sequence[Any]], align: str = "") -> str:
  """A markdown table: `header` cells, one row per item of `rows` (cells str()-ed). `align`
  one character per column (l / r / c); default: first column left, the others right."""
  align = align or "l" + "r" * (len(header) - 1)
  rule = {"l": "---", "r": "---:", "c": ":---:"}
  lines = ["| " + " | ".join(header) + " |", "|" + "|".join(rule[a] for a in align) + "|"]
  lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
  return "\n".join(lines)


# ----------------------------------------------------------------------------- ids


def zipf_cdf(num_rows: int, exponent: float) -> np.ndarray:
  """float64[num_rows]: the CDF of P(rank r) ~ r^-exponent, r = 1..num_rows."""
  cdf = np.cumsum(np.arange(1, num_rows + 1, dtype=np.float64) ** -exponent)
  return cdf / cdf[-1]


def zipf_ranks(rng: np.random.Generator, cdf: np.ndarray, shape) -> np.ndarray:
  """int64 ranks of `shape` drawn from `cdf` (zipf_cdf): 0 is the most frequent."""
  return np.minimum(np.searchsorted(cdf, rng.random(shape)), len(cdf) - 1)


def zipf_ids(
  rng: np.random.Generator, num_rows: int, shape, exponent: float, perm: np.ndarray | None = None
) -> np.ndarray:
  """Ids with P(rank r) ~ r^-exponent over [0, num_rows), ranks scattered by a permutation.

  A bounded Zipf (numpy's is unbounded); hot rows land anywhere in the table, as with hashed
  categorical features. `perm`: the rank -> id permutation (pass one to keep the same hot rows
  over a stream of batches); by default a fresh one drawn after the ranks (int64 ids).
  """
  ranks = zipf_ranks(rng, zipf_cdf(num_rows, exponent), shape)
  if perm is None:
    return rng.permutation(num_rows)[ranks].astype(np.int64)
  return perm[ranks]


# ----------------------------------------------------------------------------- timing


def time_calls(fn: Callable[[], Any], repeat: int, warmup: int = 1) -> dict:
  """Seconds of `repeat` calls of fn() (after `warmup` untimed ones), each blocked on its
  result (jax.block_until_ready: asynchronous dispatch inside the measurement): min, median,
  max and every run."""
  block = _blocker()
  for _ in range(warmup):
    block(fn())
  runs = []
  for _ in range(repeat):
    t0 = time.perf_counter()
    block(fn())
    runs.append(time.perf_counter() - t0)
  return {
    "min_s": min(runs),
    "median_s": statistics.median(runs),
    "max_s": max(runs),
    "runs_s": runs,
  }


def _blocker() -> Callable[[Any], Any]:
  jax = sys.modules.get("jax")
  return jax.block_until_ready if jax is not None else (lambda x: x)


def jitted_runner(fn, state, inputs):
  """run(k): k steps of `state = fn(state, inputs[i])` (state donated), then block on it.

  Blocking at the end of each run puts asynchronous dispatch inside the measurement.
  """
  import jax

  box = {"state": state, "i": 0}

  def run(k: int):
    st = box["state"]
    for _ in range(k):
      st = fn(st, inputs[box["i"] % len(inputs)])
      box["i"] += 1
    box["state"] = jax.block_until_ready(st)
    return box["state"]

  run.box = box
  return run


def interleaved_timing(
  runners: dict[str, Callable[[int], Any]],
  warmup: int,
  reps: int,
  steps_per_rep: dict[str, int] | int,
) -> dict[str, dict]:
  """Times several contestants in round-robin: rep r of each before rep r + 1 of any.

  The machine is shared; interleaving exposes every contestant to the same load, so their
  ratios are fair even when the absolute numbers drift. Returns, per name,
  {"step_ms": median over reps of the mean step time, "per_rep_ms": [...]}.
  """
  if isinstance(steps_per_rep, int):
    steps_per_rep = dict.fromkeys(runners, steps_per_rep)
  for run in runners.values():
    run(warmup)
  per = {n: [] for n in runners}
  usage = {n: np.zeros(3) for n in runners}  # minor page faults, user s, system s
  for _ in range(reps):
    for n, run in runners.items():
      k = steps_per_rep[n]
      r0 = resource.getrusage(resource.RUSAGE_SELF)
      t0 = time.perf_counter()
      run(k)
      per[n].append((time.perf_counter() - t0) / k)
      r1 = resource.getrusage(resource.RUSAGE_SELF)
      usage[n] += [
        r1.ru_minflt - r0.ru_minflt,
        r1.ru_utime - r0.ru_utime,
        r1.ru_stime - r0.ru_stime,
      ]
  out = {}
  for n, v in per.items():
    steps = reps * steps_per_rep[n]
    faults, user, system = usage[n] / steps
    out[n] = {
      "step_ms": 1e3 * statistics.median(v),
      "per_rep_ms": [1e3 * x for x in v],
      # Process-wide counters over this contestant's reps (contestants run one at a time).
      "minor_faults_per_step": float(faults),
      "cpu_user_ms_per_step": 1e3 * float(user),
      "cpu_system_ms_per_step": 1e3 * float(system),
    }
  return out


def extract_commit(commit: str, into: str) -> tuple[str, str]:
  """(directory under `into` holding COMMIT's tree: `recgnn`, `benchmarks`, `experiments` and
  `run.py`; its full hash), from this checkout's git, for `--against COMMIT`: a benchmark runs
  the other commit's own copy of itself (or its run.py), since that commit's recgnn API may
  differ from this one's while the benchmark's model, data and options do not."""
  root = pathlib.Path(__file__).resolve().parents[1]
  full = subprocess.run(
    ["git", "-C", str(root), "rev-parse", "--verify", f"{commit}^{{commit}}"],
    capture_output=True,
    text=True,
  )
  if full.returncode:
    raise SystemExit(f"--against: {commit!r} is not a commit of {root}: {full.stderr.strip()}")
  sha = full.stdout.strip()
  out = tempfile.mkdtemp(prefix=f"recgnn_{sha[:10]}_", dir=into)
  archive = subprocess.run(
    ["git", "-C", str(root), "archive", sha, "recgnn", "benchmarks", "experiments", "run.py"],
    capture_output=True,
    check=True,
  ).stdout
  subprocess.run(["tar", "-x", "-C", out], input=archive, check=True)
  return out, sha


# ----------------------------------------------------------------------------- trainer runs


def trainer_process(
  root: str, experiment: str, workdir: str, flags: dict, args: tuple[str, ...] = ()
) -> list[float]:
  """One `run.py` training run of `experiment` as its own process, from `root` (this tree or
  an --against commit's), with `--config.K=V` for each of `flags` and run.py's own `args`;
  the samples/s of its logged intervals after the first that compiled no new program. Exits
  with the run's last lines if it fails or logs no steady interval."""
  cmd = [sys.executable, os.path.join(root, "run.py"), f"--experiment={experiment}",
         f"--workdir={workdir}", *[f"--config.{k}={v}" for k, v in flags.items()],
         *args]  # fmt: skip
  proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True)
  if proc.returncode:
    tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
    raise SystemExit(f"{experiment} in {root} failed (exit {proc.returncode}):\n{tail}")
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    lines = [json.loads(x) for x in f if x.strip()]
  lines = [x for x in lines if x.get("samples_per_second") is not None]
  # Steady intervals: after the first, those in which the run compiled no new train-step
  # program (`link/programs` did not grow; a memory tier's lists settle over its warm-up);
  # all after the first where the run does not log it.
  progs = [x.get("link/programs") for x in lines]
  steady = [
    x["samples_per_second"]
    for i, x in enumerate(lines)
    if i > 0 and (progs[i] is None or progs[i] == progs[i - 1])
  ]
  if not steady:
    raise SystemExit(f"{experiment} in {workdir}: no steady interval logged; raise the steps")
  return steady
