"""Measurements in separate processes, in rounds, and against another commit.

  run_checked(cmd, what=)        a subprocess; a failure stops the benchmark with its last lines
  rounds(n, order, run)          n rounds, every contestant once per round (order(r): the
                                 round's order, `rotated` / `alternated`), a line per run
  distribution(values)           min / median / max
  extract_commit(commit, into)   COMMIT's tree (`git archive`), for --against
  trees(against, tmp)            {"this": this checkout, COMMIT[:10]: its tree}
  trainer_process(root, ...)     one `run.py` run of a tree, its steady samples/s
  trainer_flags(steps, every)    its flags for a timed run (no checkpoints, no evals)

Why processes: a process's speed depends on more than the load (where its memory landed, page
faults), so one process says little; rounds spread the machine's changes over every
contestant. Why --against runs the other commit's own files: its recgnn API may differ from
this one's while the benchmark's model, data and options do not.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Hashable, Sequence

from . import env


def run_checked(cmd: Sequence[str], *, what: str, env_vars=None, cwd=None, tail: int = 15):
  """subprocess.run(cmd) with its output captured; a non-zero exit stops the benchmark
  (SystemExit) naming `what`, the exit status and the output's last `tail` lines. `env_vars`:
  added to this process's environment."""
  run_env = {**os.environ, **env_vars} if env_vars else None
  proc = subprocess.run(list(cmd), env=run_env, cwd=cwd, capture_output=True, text=True)
  if proc.returncode:
    lines = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-tail:])
    raise SystemExit(f"{what} failed (exit {proc.returncode}):\n{lines}")
  return proc


def rotated(items: Sequence, r: int) -> list:
  """Round r's order: the items rotated by r (each leads once every len(items) rounds)."""
  k = r % len(items) if items else 0
  return [*items[k:], *items[:k]]


def alternated(items: Sequence, r: int) -> list:
  """Round r's order: as given on even rounds, reversed on odd ones (two contestants)."""
  return list(items) if r % 2 == 0 else list(items)[::-1]


def rounds(
  n: int,
  order: Callable[[int], Sequence[Hashable]],
  run: Callable[[Hashable, int], dict],
  show: Callable[[Hashable, dict], str] = lambda c, res: "",
) -> dict[Hashable, list[dict]]:
  """`n` rounds; in round r every contestant of `order(r)` runs once, in that order:
  `run(contestant, r)` -> its result (a dict; "load_before", the 1-minute load average when it
  started, is added). Prints `round r/n CONTESTANT: show(contestant, result) (load L)` per
  run. Returns {contestant: [result of each round]}."""
  runs: dict[Hashable, list[dict]] = {}
  for r in range(n):
    for c in order(r):
      load = os.getloadavg()[0]
      res = run(c, r)
      res.setdefault("load_before", load)
      runs.setdefault(c, []).append(res)
      label = "@".join(map(str, c)) if isinstance(c, tuple) else c
      print(f"round {r + 1}/{n} {label}: {show(c, res)} (load {load:.1f})", flush=True)
  return runs


def distribution(values: Sequence[float]) -> dict:
  """{"min", "median", "max"} of `values`."""
  return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def extract_commit(commit: str, into: str) -> tuple[str, str]:
  """(directory under `into` holding COMMIT's tree: `recgnn`, `benchmarks`, `experiments` and
  `run.py`; its full hash), from this checkout's git, for `--against COMMIT`: a benchmark runs
  the other commit's own copy of itself (or its run.py), since that commit's recgnn API may
  differ from this one's while the benchmark's model, data and options do not."""
  root = env.ROOT
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


def trees(against: str, tmp: str) -> tuple[dict[str, str], str]:
  """({"this": this checkout} plus {COMMIT[:10]: its `git archive` under tmp} with
  `against`; the commit's full hash, "" without)."""
  out = {"this": str(env.ROOT)}
  if not against:
    return out, ""
  src, sha = extract_commit(against, tmp)
  out[sha[:10]] = src
  return out, sha


def trainer_flags(steps: int, log_every: int) -> dict:
  """The `--config.` flags of a timed trainer run: `steps` steps logged every `log_every`,
  no checkpoints, no evaluation (what a throughput figure must not include)."""
  return {
    "train.steps": steps,
    "train.log_every": log_every,
    "train.checkpoint_every": 0,
    "train.eval_every": 0,
    "train.final_eval_splits": "()",
  }


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
  run_checked(cmd, cwd=root, what=f"{experiment} in {root}")
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
