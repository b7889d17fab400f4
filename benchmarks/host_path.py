"""The host path of a CTR train step: what the host costs per step when the step costs nothing.

Question (issue 43): is the trainer's host side (reader, prepare, pack, transfer, launch,
metrics) fast enough that an accelerator's step, not the host, sets the pace? Per experiment
(`dlrm_kaggle`: 26 dense tables; `cdlrm_kaggle`: the same tables offloaded), batch 2048, on the
synthetic Criteo-format data at `--scale` x Kaggle's cardinalities (1.0: Kaggle's 33.8M rows):

  input     the input side alone, on one thread, in stream order: the task's batch iterator
            (read), every group's `prepare` (with the look-ahead window), `Feeder.pack`; ms of
            CPU (time.thread_time) and wall per batch, medians after the first few batches.
            A large batch's read and dedup also run on `recgnn.hostpool` threads (their CPU
            is not the input thread's: see the wall columns; RECGNN_HOST_THREADS=1: none).
            Not for a plan with a host tier (cdlrm_kaggle): its prepare waits for the
            write-backs of steps, which this runs none of (it hung there).
  ceiling   `recgnn.train.loop.train` (the real loop: input thread, transfer, launch, traffic,
            metrics every `--log_every` steps) with the jitted train step swapped for one of the
            same signature and shardings that does no work (the state with step + 1, a zero
            loss, a host tier's write-backs as zeros of their shapes; its batch is transferred
            and passed in as the real step's): samples/s over
            the logged intervals after the first; the main thread's CPU ms per step
            (time.thread_time between two calls of the step, over `--steady` steps after
            `--warmup`), the input thread's busy ms per batch (its wall time: GIL waits count).
            With a worker process (`--input_workers`, train.input_workers; this tree's default
            when not given): the worker's CPU ms per batch (all its threads: read, prepare,
            pack into its shared-memory slot, the send) over the batches it packed during the
            steady steps.
  calls     the same loop run again with a counting profiler on the main thread only
            (sys.setprofile; threads keep none) over the same steady steps: Python function
            calls ("call" events) and C calls per step. A separate run: the profiler slows the
            thread it counts.

Every (experiment, tree) measurement is its own process, `--processes` rounds of them
interleaved (the machine is shared: each round runs every contestant once), so the figures
are min / median / max over processes. With `--against=COMMIT` the same script runs over
COMMIT's `recgnn` (a `git archive` of it first on the path) in alternating order, and the
ratios of medians are printed beside the figures they come from.

  python benchmarks/host_path.py                       # results/host_path.{json,md}
  python benchmarks/host_path.py --against=HEAD~3 --processes=5
  python benchmarks/host_path.py --quick               # one process each, a smoke run

The no-work step is the host path's ceiling, not a throughput: a real step adds its compute,
and on CPU its host work competes with the step for the same cores.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

# A child measuring an --against tree imports that tree's recgnn: the harness puts the tree its
# parent names ($RECGNN_BENCH_TREE) first on the path.
import harness

EXPERIMENTS = ("dlrm_kaggle", "cdlrm_kaggle")
# Issue 43's must-show on this CPU (k = 1): the main thread's work per step, the input side.
MAIN_CALLS_MAX = 150
MAIN_CPU_MS_MAX = 0.3
INPUT_MS_MAX = 1.5
# ... and the ceiling at k = 8 (dense) / k = 1 (cdlrm).
CEILING_MIN = {"dlrm_kaggle": 1_000_000, "cdlrm_kaggle": 300_000}


# ----------------------------------------------------------------------------- one process


def config_of(name: str, args):
  """The experiment's config at the benchmark's sizes; NAME@FEED sets train.feed."""
  name, _, feed = name.partition("@")
  c = importlib.import_module(f"experiments.{name}").get_config()
  if feed:
    c.train.feed = feed
  c.data.synthetic.scale = args.scale
  # (cdlrm_kaggle's budget is a tenth of its dense tables at the default scale: not measured)
  c.device_memory_budget = ""
  c.train.batch_size = args.batch
  c.train.steps = args.warmup + args.steady + args.log_every
  c.train.log_every = args.log_every
  c.train.checkpoint_every = 0
  c.train.eval_every = 0
  c.train.final_eval_splits = ()
  if args.k > 1:
    c.train.steps_per_call = args.k
  if getattr(args, "plan", ""):  # one backend string for every table
    c.embeddings.plan = ((".*", args.plan),)
  workers = getattr(args, "input_workers", None)
  if workers is not None:  # (a tree before train.input_workers ignores it)
    c.train.input_workers = workers
  return c


def measure_input(name: str, args) -> dict:
  """ms per batch of read, prepare and pack on this thread, CPU and wall."""
  from recgnn.train import inputs
  from recgnn.train import setup as train_setup

  run = train_setup.build(config_of(name, args), allocate=False)  # (no tables: not used)
  if name.endswith("@device"):
    return measure_device_input(run, args)
  if any(g.capabilities.writes_host for g in run.plan.groups.values()):
    # A host tier's prepare waits for the write-backs of the steps before it (offload's
    # staging, issue 42): without steps it waits forever. Its input side is the loop's
    # input thread figure.
    return {}
  batches = run.task.train_batches(0)
  acc: dict[str, list[float]] = {}

  def timed(part, fn, *a):
    c, w = time.thread_time(), time.perf_counter()
    out = fn(*a)
    acc.setdefault(part + " cpu", []).append(1e3 * (time.thread_time() - c))
    acc.setdefault(part + " wall", []).append(1e3 * (time.perf_counter() - w))
    return out

  def read():
    for _ in range(args.input_batches):
      yield "train", None, timed("read", next, batches)

  items = inputs.prepare_stream(run.plan, read())
  # No step runs here: a host tier's reads of rows written back would wait for steps that
  # never come (harness.prepare_without_steps; cdlrm_kaggle at k = 1: 32 such waits in 60
  # batches). The loop below, with steps, waits as the trainer does.
  with harness.prepare_without_steps():
    for _ in range(args.input_batches - run.plan.lookahead):
      item = timed("read+prepare", next, items)
      timed("pack", run.feeder.pack, item.prepared, item.batch)
  skip = 3  # the first batches: caches filling, numba's first call
  out = {k: statistics.median(v[skip:]) for k, v in acc.items()}
  # read is also inside read+prepare (the look-ahead pulls it): prepare = the difference.
  for t in ("cpu", "wall"):
    out[f"prepare {t}"] = out[f"read+prepare {t}"] - out[f"read {t}"]
    out[f"input {t}"] = out[f"read+prepare {t}"] + out[f"pack {t}"]
  return out


def measure_device_input(run, args) -> dict:
  """The device feed's input side on this thread: the cursors (and the host-prepared groups'
  ids, read, prepared) of each batch, packed: ms per batch, CPU and wall."""
  from recgnn.train import device_feed, inputs

  feed = device_feed.DeviceFeed(run.task.device_rows(), run.plan)
  k = run.task.batches_per_call
  n = args.input_batches
  stream = device_feed.stream(feed.rows, feed.orders, feed.host_tables, 0, n, k, 0, "", ())
  items = inputs.prepare_stream(feed.host_plan, stream)
  cpu, wall = [], []
  for _ in range(n):
    c, w = time.thread_time(), time.perf_counter()
    item = next(items)
    feed.feeder.pack(item.prepared, item.batch)
    cpu.append(1e3 * (time.thread_time() - c))
    wall.append(1e3 * (time.perf_counter() - w))
  feed.close()
  skip = 3
  return {"input cpu": statistics.median(cpu[skip:]), "input wall": statistics.median(wall[skip:])}


class _Probe:
  """The loop's train step, wrapped: the main thread's CPU time between call `warmup` and
  call `warmup + steady`, and with `count` the Python / C calls on the main thread between
  them (the probe's own few calls per step included)."""

  def __init__(self, fn, warmup: int, steady: int, count: bool):
    self.fn, self.warmup, self.steady, self.count = fn, warmup, steady, count
    self.calls = 0
    self.events = {"call": 0, "c_call": 0}
    self.cpu = self.wall = None

  def _profile(self, frame, event, arg):
    del frame, arg
    if event in self.events:
      self.events[event] += 1

  def __call__(self, state, *args):
    i, self.calls = self.calls, self.calls + 1
    if i == self.warmup:
      self._c, self._w = time.thread_time(), time.perf_counter()
      self._worker = self._worker_counts()
      if self.count:
        sys.setprofile(self._profile)
    elif i == self.warmup + self.steady:
      if self.count:
        sys.setprofile(None)
      self.cpu, self.wall = time.thread_time() - self._c, time.perf_counter() - self._w
      if self._worker is not None:  # the worker's CPU over the batches it packed meanwhile
        (c0, b0), (c1, b1) = self._worker, self._worker_counts()
        self.worker_ms = 1e3 * (c1 - c0) / max(b1 - b0, 1)
    return self.fn(state, *args)

  feeds: list = []  # the loop's input feed (`measure_loop` records it)
  worker_ms = None

  def _worker_counts(self):
    worker = getattr(self.feeds[-1], "worker", None) if self.feeds else None
    return None if worker is None else (worker.cpu_seconds, worker.batches)

  def __getattr__(self, name):  # .lower() for the traffic reader
    return getattr(self.fn, name)


def measure_loop(name: str, args, count: bool) -> dict:
  """The trainer's loop over the no-work step: samples/s, main-thread CPU (or calls)."""
  import jax
  import jax.numpy as jnp

  from recgnn.embeddings import base
  from recgnn.train import checkpoint as ckpt_lib
  from recgnn.train import loop
  from recgnn.train import setup as train_setup
  from recgnn.train import step as step_lib

  config = config_of(name, args)
  k = args.k
  calls = (args.warmup + args.steady) // k
  probes = []

  def nowork_for(plan):
    """The no-work step of `plan`'s signature. A host tier's group (offload, hot_cold) also
    returns what its step hands the host writer (evicted / cold rows), as zeros of those
    shapes (`jax.eval_shape` of its lookup and update, traced, never run): their copy to
    the host and the writer's scatters are the host path's, and the input thread's
    `prepare` waits for the write-backs of the steps before it. Its update itself (the
    device cache's exchange, the optimizer on the rows) is the step's work: run here until
    2026-12-02, it took ~3 ms of XLA:CPU's threads per cdlrm_kaggle batch of 2048, on the
    cores the host path runs on (a GPU runs it on the device)."""
    host = {k: g for k, g in plan.groups.items() if g.capabilities.writes_host}

    def to_host_of(group, emb, prepared):
      pooled, residuals = group.lookup(emb, prepared)
      zeros = jax.tree.map(jnp.zeros_like, pooled)
      return base.split_to_host(group.update(emb, prepared, residuals, zeros))[1]

    def nowork(state, prepared, batch, *extra):
      del batch, extra
      to_host = {}
      for key, group in host.items():
        shapes = jax.eval_shape(functools.partial(to_host_of, group), state.emb[key], prepared[key])
        to_host[key] = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
      out = (state.replace(step=state.step + 1), {"loss": jnp.zeros((), jnp.float32)})
      return (*out, to_host) if host else out

    return nowork

  real_jit_steps = train_setup.jit_steps

  def jit_steps(task, plan, tx, shardings, step_inputs=None, **feed):
    _, evaluate = real_jit_steps(task, plan, tx, shardings, step_inputs, **feed)
    # The same signature, shardings and donation as the real step (k > 1: the same scan
    # over the call's stacked batches, of a body that does nothing; with the device feed,
    # its inputs: the resident rows and the pass orders).
    extra = {"stacked": k} if k > 1 else {}  # (a tree before k steps per call: k = 1)
    if feed.get("feed") is not None:
      inputs_of = feed["feed"].train_inputs
      extra.update(step_inputs=inputs_of(), inputs_of=inputs_of)
    fake = step_lib.jit_packed(nowork_for(plan), plan, shardings, True, True, "train_step", **extra)
    probes.append(_Probe(fake, args.warmup // k, args.steady // k, count))
    return probes[-1], evaluate

  real_feed = loop.InputThread

  def feed(*a, **kw):  # (the probe reads a worker's counters off it)
    _Probe.feeds.append(real_feed(*a, **kw))
    return _Probe.feeds[-1]

  workdir = tempfile.mkdtemp(prefix=f"host_path_{name}_")
  patches = [
    (loop, "InputThread", feed),
    (train_setup, "jit_steps", jit_steps),
    # The final checkpoint is not the host path (and 2.3 GB of tables at scale 1).
    (ckpt_lib.Checkpointer, "save", lambda *a, **kw: None),
  ]
  old = [(o, a, getattr(o, a)) for o, a, _ in patches]
  try:
    for o, a, v in patches:
      setattr(o, a, v)
    with contextlib.redirect_stdout(sys.stderr):  # the loop's log lines: not our output
      res = loop.train(config, workdir)
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      lines = [json.loads(x) for x in f if x.strip()]
  finally:
    for o, a, v in old:
      setattr(o, a, v)
    shutil.rmtree(workdir, ignore_errors=True)
  (probe,) = probes
  if probe.cpu is None:
    raise SystemExit(f"{name}: the loop ran {probe.calls} calls, fewer than {calls}")
  rates = [x["samples_per_second"] for x in lines if "samples_per_second" in x]
  steps = config.train.steps
  # (the input thread's busy seconds cover every batch of the run: one per step)
  out = {"input_thread_ms_per_batch": 1e3 * res.metrics["input_thread_seconds"] / steps}
  if probe.worker_ms is not None:  # (steady batches: not the fork, numba's first calls)
    out["worker_cpu_ms_per_batch"] = probe.worker_ms
  if count:
    out.update({
      "main_python_calls_per_step": probe.events["call"] / args.steady,
      "main_c_calls_per_step": probe.events["c_call"] / args.steady,
    })  # fmt: skip
  else:
    out.update({
      "samples_per_s": statistics.median(rates[1:]),
      "samples_per_s_intervals": rates,
      "main_cpu_ms_per_step": 1e3 * probe.cpu / args.steady,
      "main_wall_ms_per_step": 1e3 * probe.wall / args.steady,
    })  # fmt: skip
  return out


def child(args) -> None:
  out = {"machine": harness.machine_info(), "tree": harness.env.tree()}
  out["input"] = measure_input(args.experiment, args)
  out["loop"] = measure_loop(args.experiment, args, count=False)
  out["calls"] = measure_loop(args.experiment, args, count=True)
  cpu = out["input"].get("input cpu")
  if cpu is not None:  # the host's CPU per trained sample (the input side + the main thread)
    per = 1e3 * (cpu + out["loop"]["main_cpu_ms_per_step"]) / args.batch  # (both per batch)
    out["derived"] = {"host_us_per_sample": per}
  else:
    out["derived"] = {}
  import jax

  out["machine"] = {**harness.machine_info(), "jax": jax.__version__}
  with open(args.child_out, "w") as f:
    json.dump(out, f)


# ----------------------------------------------------------------------------- rounds

# (section, key, header, format) of the distribution table
COLUMNS = (
  ("input", "input cpu", "input CPU ms / batch", "{:.2f}"),
  ("input", "read cpu", "read", "{:.2f}"),
  ("input", "prepare cpu", "prepare", "{:.2f}"),
  ("input", "pack cpu", "pack", "{:.2f}"),
  # With hostpool threads (RECGNN_HOST_THREADS) part of a batch's read and prepare runs on
  # other threads, which the CPU figures above (the input thread's) do not see: wall shows it.
  ("input", "read wall", "read wall ms", "{:.2f}"),
  ("input", "prepare wall", "prepare wall ms", "{:.2f}"),
  ("loop", "samples_per_s", "ceiling samples/s", "{:,.0f}"),
  ("loop", "main_cpu_ms_per_step", "main CPU ms / step", "{:.3f}"),
  ("calls", "main_python_calls_per_step", "main Python calls / step", "{:.0f}"),
  ("calls", "main_c_calls_per_step", "main C calls / step", "{:.0f}"),
  ("loop", "input_thread_ms_per_batch", "input busy ms / batch (thread or worker)", "{:.2f}"),
  ("loop", "worker_cpu_ms_per_batch", "worker CPU ms / batch", "{:.2f}"),
  ("derived", "host_us_per_sample", "host CPU us / trained sample (input + main)", "{:.4f}"),
)


def child_command(args, name: str, out: str) -> list[str]:
  opts = {
    "experiment": name,
    "scale": args.scale,
    "batch": args.batch,
    "k": args.k,
    "warmup": args.warmup,
    "steady": args.steady,
    "log_every": args.log_every,
    "input-batches": args.input_batches,
    "child-out": out,
  }
  if args.input_workers is not None:
    opts["input_workers"] = args.input_workers
  if args.plan:
    opts["plan"] = args.plan
  return [sys.executable, str(pathlib.Path(__file__).resolve())] + [
    f"--{k}={v}" for k, v in opts.items()
  ]


def rounds(args, names: list[str], tmp: str) -> dict:
  trees, _ = harness.trees(args.against, tmp)

  def run(c: tuple[str, str], r: int) -> dict:
    n, t = c
    out = os.path.join(tmp, f"{r}_{n}_{t}.json")
    harness.run_checked(
      child_command(args, n, out), env_vars={harness.env.TREE_VAR: trees[t]}, what=f"{n} @ {t}",
      tail=20,
    )  # fmt: skip
    with open(out) as f:
      return json.load(f)

  def show(c: tuple[str, str], res: dict) -> str:
    return ", ".join(f"{h} {fmt.format(res[s][k])}" for s, k, h, fmt in COLUMNS if k in res[s])

  # Each experiment's trees one after the other, their order alternating round by round.
  order = lambda r: [(n, t) for n in names for t in harness.alternated(list(trees), r)]  # noqa: E731
  by_pair = harness.rounds(args.processes, order, run, show)
  runs = {n: {t: by_pair[(n, t)] for t in trees} for n in names}
  summary = {}
  for n in names:
    summary[n] = {}
    for t, xs in runs[n].items():
      summary[n][t] = {}
      for s, k, _, _ in COLUMNS:
        v = [x[s][k] for x in xs if k in x[s]]
        if v:
          summary[n][t][k] = harness.distribution(v)
  return {"trees": {t: p for t, p in trees.items()}, "runs": runs, "summary": summary}


def feed_checks(args, summary: dict) -> list[str]:
  """The device feed's must-show: its host CPU per trained sample at most 1/20 of the host
  feed's, in the same run (the slowest device-feed process against the fastest host one)."""
  out = []
  for n, per in summary.items():
    if not n.endswith("@device") or n.replace("@device", "@host") not in summary:
      continue
    dev = per["this"].get("host_us_per_sample", {}).get("max")
    host = summary[n.replace("@device", "@host")]["this"].get("host_us_per_sample", {}).get("min")
    if not dev or not host:
      continue
    ok = "yes" if dev <= host / 20 else "NO"
    out.append(f"{n}: host CPU {dev:.4f} us / trained sample against the host feed's "
               f"{host:.4f} ({host / dev:,.0f}x less; target >= 20x): {ok}")  # fmt: skip
  return out


def checks(args, summary: dict) -> list[str]:
  """Issue 43's must-show lines, from this tree's medians (and its slowest process)."""
  out = feed_checks(args, summary)
  summary = {n: v for n, v in summary.items() if "@" not in n}
  for n, per in summary.items():
    s = per["this"]
    calls = s["main_python_calls_per_step"]["max"]
    cpu = s["main_cpu_ms_per_step"]["max"]
    ceiling = s["samples_per_s"]["min"]
    if args.k == 1:
      out.append(f"{n}: main thread {calls:.0f} Python calls / step (worst process; target < "
                 f"{MAIN_CALLS_MAX}): {'yes' if calls < MAIN_CALLS_MAX else 'NO'}; "
                 f"{cpu:.3f} ms CPU / step (target < {MAIN_CPU_MS_MAX}): "
                 f"{'yes' if cpu < MAIN_CPU_MS_MAX else 'NO'}")  # fmt: skip
    if n == "dlrm_kaggle":
      # (with a worker: its CPU per batch in the loop; else the input side on one thread)
      where = "worker_cpu_ms_per_batch" if "worker_cpu_ms_per_batch" in s else "input cpu"
      ms = s[where]["max"]
      what = "in the worker" if where != "input cpu" else "on one thread"
      ok = "yes" if ms <= INPUT_MS_MAX else "NO"
      out.append(f"{n}: input side {ms:.2f} CPU ms / batch of {args.batch} {what} (worst "
                 f"process; target <= {INPUT_MS_MAX}): {ok}")  # fmt: skip
    target = CEILING_MIN.get(n)
    if target and (n != "dlrm_kaggle" or args.k == 8):
      out.append(f"{n}: ceiling {ceiling:,.0f} samples/s at k = {args.k} (slowest process; "
                 f"target >= {target:,}): {'yes' if ceiling >= target else 'NO'}")  # fmt: skip
  return out


def markdown(payload: dict) -> str:
  m, a = payload["machine"], payload["args"]
  loads = [x["load_before"] for r in payload["runs"].values() for xs in r.values() for x in xs]
  lines = [
    "# The host path of a CTR step (benchmarks/host_path.py)",
    "",
    f"`{m['command']}` on {m['cpus']} CPUs ({m['cpu_model']}), {m['date_utc']}; "
    f"{a['processes']} process(es) per experiment and tree, interleaved; load average before "
    f"each: {min(loads):.1f} - {max(loads):.1f}. Batch {a['batch']}, k = {a['k']} step(s) per "
    f"call, synthetic data at scale {a['scale']}; {a['steady']} steady steps after "
    f"{a['warmup']}; train.input_workers "
    f"{'as each tree defaults' if a.get('input_workers') is None else a['input_workers']}; "
    f"plan {a.get('plan') or 'as each experiment sets it'}. "
    "Cells: min / median / max over processes.",
    "",
  ]
  trees = list(payload["trees"])
  for n, per in payload["summary"].items():
    lines += [f"## {n}", ""]
    header = ["measure", *[f"{t}" for t in trees]]
    if len(trees) > 1:
      header.append(f"median this / {trees[1]}")
    rows = []
    for _, k, h, fmt in COLUMNS:
      if k not in per["this"]:
        continue
      cells = []
      for t in trees:
        d = per[t].get(k)
        cells.append(" / ".join(fmt.format(d[q]) for q in ("min", "median", "max")) if d else "")
      if len(trees) > 1:
        a_, b_ = per["this"].get(k), per[trees[1]].get(k)
        cells.append(f"{a_['median'] / b_['median']:.3f}" if a_ and b_ and b_["median"] else "")
      rows.append([h, *cells])
    lines += [harness.md_table(header, rows), ""]
  lines += [f"- {x}" for x in payload["checks"]]
  return "\n".join(lines) + "\n"


def main():
  ap = harness.flags.parser(__doc__)
  ap.add_argument(
    "--experiments",
    default=",".join(EXPERIMENTS),
    help="NAME or NAME@FEED (train.feed: host, device), comma-separated",
  )
  ap.add_argument("--scale", type=float, default=1.0, help="x Kaggle's table cardinalities")
  ap.add_argument("--batch", type=int, default=2048)
  ap.add_argument("--k", type=int, default=1, help="train steps per call (train.steps_per_call)")
  ap.add_argument("--warmup", type=int, default=96, help="steps before the measured ones")
  ap.add_argument("--steady", type=int, default=400, help="steps measured (multiple of k)")
  ap.add_argument("--log_every", type=int, default=48)
  ap.add_argument("--input-batches", dest="input_batches", type=int, default=60)
  ap.add_argument("--processes", type=int, default=3)
  ap.add_argument(
    "--input_workers", type=int, default=None, help="-1 auto, 0 thread, 1 worker; default: a tree's"
  )
  ap.add_argument(
    "--plan", default="", help='one backend string for every table, e.g. "dense(dedup=device)"'
  )
  ap.add_argument("--against", default="", metavar="COMMIT")
  ap.add_argument("--name", default="")
  ap.add_argument("--quick", action="store_true")
  ap.add_argument("--experiment", default="", help=argparse.SUPPRESS)  # a child's
  ap.add_argument("--child-out", dest="child_out", default="", help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.quick:
    args.processes, args.steady, args.warmup, args.input_batches = 1, 96, 48, 24
  for v in ("warmup", "steady", "log_every"):
    if getattr(args, v) % args.k:
      ap.error(f"--{v}={getattr(args, v)} must be a multiple of --k={args.k}")
  if args.child_out:
    child(args)
    return
  names = [n for n in args.experiments.split(",") if n]
  with tempfile.TemporaryDirectory(prefix="host_path_") as tmp:
    payload = {"machine": harness.machine_info(), "args": vars(args)}
    payload.update(rounds(args, names, tmp))
  payload["load_avg_at_end"] = os.getloadavg()
  payload["checks"] = checks(args, payload["summary"])
  for line in payload["checks"]:
    print(line, flush=True)
  name = args.name or ("host_path" + (f"_k{args.k}" if args.k > 1 else "")
                       + ("_against" if args.against else ""))  # fmt: skip
  harness.write_results(name, payload, markdown(payload))


if __name__ == "__main__":
  main()
