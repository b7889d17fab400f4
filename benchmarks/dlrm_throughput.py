"""DLRM train-step throughput: recgnn vs TorchRec vs plain PyTorch, on identical batches.

Question: is recgnn's DLRM (or DCNv2) train step as fast as TorchRec's on the same batches, and
how far is it from the MLPs' matmul floor?

All three train the DLRM reference Kaggle model (26 tables, dim 16, bottom 13-512-256-64-16,
dot interaction, top 367-512-256-1, BCE-with-logits, SGD lr 0.1 for tables and MLPs) on the
same numpy batches (batch 2048, 26 tables x 100k rows, Zipf ids with exponent 1.05):

  recgnn    recgnn.train.step's jitted train step (state donated) over the CTR task's loss
            and recgnn.models.dlrm.DLRM, every table on the `dense` backend with sparse SGD;
            the batch's `prepare` and host->device transfer are done before timing, as the
            trainer's input thread does them off the step's path.
  torchrec  torchrec.models.dlrm.DLRM over a FusedEmbeddingBagCollection (FBGEMM, fused SGD
            in the backward), KeyedJaggedTensors built before timing (benchmarks/peers/dlrm.py).
  pytorch   nn.EmbeddingBag(sum, sparse=True) per table + torch.optim.SGD (the dlrm
            reference's structure), tensors built before timing.

Contestants are timed in round-robin (rep r of each before rep r + 1 of any) so the shared
machine's load hits them alike; reported: median samples/s and recgnn / TorchRec.
`--profile` also times recgnn's pieces (MLPs, interaction, embedding lookups + updates) and
the ideas listed in `dlrm_profile.IDEAS`, each as its own jitted function on the same batches.

--model=dcnv2 times DLRM-DCNv2 instead (low-rank cross layers in place of the dot
interaction, MLPerf's multi-hot bags, sum pooling): recgnn's CTR task with
model.name=dcn against TorchRec's DLRM_DCN over a fused EBC, same tables, MLPs, cross
layers and SGD (benchmarks/peers/dcn.py says what is matched and how). Every such run first
checks that the two compute the same on identical weights (--check: only that).

Beside wall time, each contestant's CPU time (user + system, all threads) and minor page
faults per step are reported: on a loaded machine they say what the wall time cannot.

  python benchmarks/dlrm_throughput.py               # 1-3 minutes
  python benchmarks/dlrm_throughput.py --quick       # ~1 minute
  python benchmarks/dlrm_throughput.py --profile     # + where recgnn's step time goes
  python benchmarks/dlrm_throughput.py --model=dcnv2 [--quick]   # DCNv2 vs TorchRec DLRM_DCN
  --omp-wait-policy passive   torch's idle threads sleep (fairer to torch under heavy load)
  --malloc default            glibc's default malloc (the trainer uses recgnn.hostmem's)
  --allocators jemalloc=/path/libjemalloc.so.2,tcmalloc=/path/libtcmalloc_minimal.so.4
                              also time recgnn's step with each allocator preloaded
                              (LD_PRELOAD; a bare name is looked up with ldconfig), as
                              contestants recgnn+NAME in the same rounds
Writes benchmarks/results/NAME.{json,md}, NAME = --name or dlrm_throughput[_dcnv2]
[_malloc_default][_omp_passive][_processes].
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

# (--against runs another commit's copy of this script, which imports that commit's recgnn.)
import dlrm_profile
import harness
import jax
from harness import dlrm_task
from peers import dcn as peers_dcn
from peers import dlrm as peers_dlrm

from recgnn import hostmem, sharding
from recgnn.train import setup as train_setup
from recgnn.train import step as step_lib
from recgnn.train import train_state as state_lib

# --model: the peers' module (its PEERS, available(), runner()) and the names in result files.
PEER_MODULES = {"dlrm": peers_dlrm, "dcnv2": peers_dcn}
TITLES = {"dlrm": ("DLRM", "TorchRec vs PyTorch"), "dcnv2": ("DLRM-DCNv2", "TorchRec's DLRM_DCN")}

# XLA:CPU allocates a step's temporaries (44.6 MB for this DLRM) with malloc on every
# execution, and glibc hands them back to the kernel after each step unless told otherwise
# (recgnn/hostmem.py says how and why): ~11k minor faults and ~19 ms of kernel time per step.


def keep_freed_memory(arenas: int = 0) -> str:
  """recgnn.hostmem.keep_freed_memory for this process (torch's tensors included);
  arenas=1: one malloc arena (blocks over 64 MiB kept too; one lock for every thread)."""
  if not hostmem.keep_freed_memory(arenas=arenas):
    raise RuntimeError("mallopt failed; --malloc keep needs glibc")
  return (
    "recgnn.hostmem.keep_freed_memory() (glibc mallopt: no trim, thread heaps kept, mmap only"
    " above 1 GiB" + (", one arena)" if arenas else ", glibc's thread arenas)")
  )


# ----------------------------------------------------------------------------- recgnn


class Recgnn:
  """recgnn's side: task, plan, optimizer, and the trainer's own jitted step over the
  trainer's packed, device-resident inputs (what the input thread hands the step)."""

  def __init__(self, cfg: peers_dlrm.DlrmConfig, batches, plan=((".*", "dense"),), seed=0):
    self.cfg = cfg
    self.config = dlrm_task.config_of(cfg)
    self.config.embeddings.plan = [tuple(r) for r in plan]
    mesh = sharding.make_mesh(1, 1)
    task = dlrm_task.task_of(self.config, cfg, mesh)
    self.host = [dlrm_task.to_batch(b, task.names) for b in batches]
    self.key = jax.random.key(seed)
    # The trainer's own setup (recgnn.train.setup.build): plan, feeder, optimizer, state,
    # the jitted packed step.
    self.run = train_setup.build(self.config, mesh=mesh, task=task, example=self.host[0],
                                 key=self.key)  # fmt: skip
    self.task, self.plan, self.tx = self.run.task, self.run.plan, self.run.tx
    # What the trainer's input thread does ahead of the step: prepare + one packed transfer.
    self.prepared = [self.run.prepare(h, [], train=True) for h in self.host]
    self.packed = [self.run.packed(p, h) for p, h in zip(self.prepared, self.host)]
    # Unpacked device copies, for the pieces profiled alone.
    self.inputs = [
      jax.device_put((p, state_lib.device_batch(h))) for p, h in zip(self.prepared, self.host)
    ]
    self.packed_step = self.run.train_step
    self.train_step = jax.jit(
      step_lib.make_train_step(self.task, self.plan, self.tx), donate_argnums=0
    )

  def init_state(self) -> state_lib.TrainState:
    return self.run.init_state()

  def runner(self):
    def fn(state, packed):
      return self.packed_step(state, *packed)[0]

    return harness.jitted_runner(fn, self.init_state(), self.packed)

  def loss(self, state) -> float:
    """The loss of batch 0 under `state` (a sanity check that training moves)."""
    prepared, batch = self.inputs[0]
    pooled, _ = step_lib.lookup_all(self.plan, state.emb, prepared)
    return float(self.task.loss(state.params, batch, pooled, state.key)[0])


# ----------------------------------------------------------------------------- main


def markdown(payload: dict) -> str:
  a, m, r = payload["config"], payload["machine"], payload["results"]
  lines = [
    "# {} train-step throughput: recgnn vs {}".format(*TITLES[a["model"]]),
    "",
    f"Batch {a['batch']}, {a['tables']} tables x {a['rows']:,} rows, dim {a['dim']}, "
    f"{a['model_note']}, SGD lr {a['lr']}, Zipf ids (exponent {a['zipf']}), "
    f"{a['num_batches']} distinct batches, identical for all. Median over {a['reps']} "
    f"repetitions x {a['steps_per_rep']} steps after {a['warmup']} warmup steps, contestants "
    f"in round-robin. {m['cpus']} CPUs (torch threads {payload['torch_threads']}), load "
    f"average {m['load_avg_at_start'][0]:.1f} at start and {payload['load_avg_at_end'][0]:.1f} "
    f"at end, {m['date_utc']}. malloc: {payload['malloc']}. Environment: {m['env'] or 'none'}.",
    "",
    "| contestant | samples/s | ms/step | CPU user / system ms per step | page faults per step "
    "| loss after timing |",
    "|---|---:|---:|---:|---:|---:|",
  ]
  for name in ("recgnn", *peers_dlrm.PEERS):
    x = r.get(name)
    if x is None:
      continue
    if "unavailable" in x:
      lines.append(f"| {name} | not available: {x['unavailable']} | | | | |")
    else:
      lines.append(
        f"| {name} | {x['samples_per_s']:,.0f} | {x['step_ms']:.1f} | "
        f"{x['cpu_user_ms_per_step']:.0f} / {x['cpu_system_ms_per_step']:.0f} | "
        f"{x['minor_faults_per_step']:,.0f} | {x['final_loss']:.4f} |"
      )
  lines.append("")
  for k, v in payload["ratios"].items():
    lines.append(f"- {k}: **{v:.2f}**")
  lines += peers_dcn.check_lines(payload.get("check"))
  prof = payload.get("profile")
  if prof:
    full = prof["full_step"]
    lines += [
      "",
      "## Where recgnn's step time goes",
      "",
      "Each piece jitted alone on the same batch, timed in round-robin with the full step. "
      "CPU ms = user + system time of all threads per step (robust to the machine's load).",
      "",
      "| piece | wall ms | % of full step | CPU ms | % of full step | page faults |",
      "|---|---:|---:|---:|---:|---:|",
    ]
    for k, v in prof.items():
      if "diff" not in k:
        lines.append(
          f"| {k} | {v['wall_ms']:.2f} | {100 * v['wall_ms'] / full['wall_ms']:.0f}% | "
          f"{v['cpu_ms']:.2f} | {100 * v['cpu_ms'] / full['cpu_ms']:.0f}% | "
          f"{v['minor_faults']:,.0f} |"
        )
    lines += [
      "",
      "Ideas (`idea:` rows are full train steps with one change; `interaction[...]` rows the "
      "interaction alone, to compare with `interaction`):",
      "",
      *[f"- {k}: {v}" for k, v in payload["ideas"].items()],
      "",
      "Same math: max |difference| "
      + ", ".join(
        f"{k.replace('_max_abs_diff', '')} {v:.1e}" for k, v in prof.items() if "diff" in k
      )
      + ".",
    ]
  lines.append("")
  return "\n".join(lines)


# ----------------------------------------------------------------------------- the floor


def mlp_gflop_per_batch(cfg: peers_dlrm.DlrmConfig, batch: int) -> float:
  """The model's matmul work per train step: forward + two backward matmuls per layer (2 flops
  per multiply-add), the MLPs and any cross layers (cfg.matmul_macs). 5.83 GFLOP for the
  reference Kaggle DLRM at batch 2048."""
  return 3 * 2 * batch * cfg.matmul_macs / 1e9


# ----------------------------------------------------------------------------- one process


def time_in_process(args, contestants: list[str]) -> dict:
  """Times `contestants` ('recgnn' and peers) in this process, round-robin; the payload."""
  cfg = cfg_of(args)
  peers = PEER_MODULES[args.model]
  batches = peers.make_batches(cfg, args.batch, args.num_batches, args.zipf, args.seed)
  machine = harness.machine_info()

  results: dict[str, dict] = {}
  runners = {}
  rec = None
  if "recgnn" in contestants:
    rec = Recgnn(cfg, batches, seed=args.seed)
    runners["recgnn"] = rec.runner()
  avail = peers.available() if set(contestants) - {"recgnn"} else {}
  torch_threads = None
  for name in contestants:
    if name == "recgnn":
      continue
    if avail.get(name, "unknown peer") is not None:
      results[name] = {"unavailable": avail.get(name, f"unknown peer {name!r}")}
      print(f"peer {name}: not available ({results[name]['unavailable']})", flush=True)
      continue
    torch_threads = peers.set_threads(args.threads or None)
    runners[name] = peers.runner(name, cfg, batches, seed=args.seed)

  t0 = time.perf_counter()
  timing = harness.interleaved_timing(runners, args.warmup, args.reps, args.steps_per_rep)
  elapsed = time.perf_counter() - t0
  for name, t in timing.items():
    results[name] = {"samples_per_s": 1e3 * args.batch / t["step_ms"], **t}
  if rec is not None:
    results["recgnn"]["final_loss"] = rec.loss(runners["recgnn"].box["state"])
    # The floor in the same process, right after the step: the machine's load as the step's.
    gflops = harness.matmul_gflops()
    floor_ms = 1e3 * mlp_gflop_per_batch(cfg, args.batch) / gflops
    results["recgnn"].update(
      matmul_gflops=gflops,
      floor_ms=floor_ms,
      floor_fraction=floor_ms / results["recgnn"]["step_ms"],
    )
  for name in runners:
    if name != "recgnn":
      results[name]["final_loss"] = runners[name](1)
  ratios = {}

  def cpu_ms(x):
    return x["cpu_user_ms_per_step"] + x["cpu_system_ms_per_step"]

  if "recgnn" in timing:
    for name in peers_dlrm.PEERS:
      if name in timing:
        ratios[f"recgnn / {name} (samples/s)"] = (
          results["recgnn"]["samples_per_s"] / results[name]["samples_per_s"]
        )
        # Load-robust, but counts OpenMP spin-waiting as work (see --omp-wait-policy).
        ratios[f"{name} / recgnn (CPU ms per step)"] = cpu_ms(results[name]) / cpu_ms(
          results["recgnn"]
        )
  del runners

  payload = {
    "benchmark": "dlrm_throughput",
    "config": {
      **vars(args),
      "model_note": cfg.describe(),
      "bottom": list(cfg.bottom),
      "top": list(cfg.top),
      "interaction_width": cfg.interaction_width,
      "mlp_gflop_per_batch": mlp_gflop_per_batch(cfg, args.batch),
    },
    "machine": machine,
    "peer_versions": peers.versions() if set(contestants) - {"recgnn"} else {},
    "torch_threads": torch_threads,
    "malloc": args.malloc_note,
    "timed_seconds": elapsed,
    "load_avg_at_end": os.getloadavg(),
    "results": results,
    "ratios": ratios,
  }
  if rec is not None:
    payload["recgnn_plan"] = {n: rec.plan.backend_of(n).describe(n) for n in rec.plan.table_group}
    if args.profile:
      payload["profile"] = dlrm_profile.profile_pieces(rec, args)
      payload["ideas"] = dlrm_profile.IDEAS
  return payload


# ----------------------------------------------------------------------------- many processes

# Columns of the distribution table: (key in a process's results, header, format).
DIST_COLUMNS = (
  ("samples_per_s", "samples/s", "{:,.0f}"),
  ("cpu_user_ms_per_step", "user ms / step", "{:.0f}"),  # load-robust (but counts OMP spinning)
  ("cpu_system_ms_per_step", "system ms / step", "{:.1f}"),
  ("minor_faults_per_step", "page faults / step", "{:,.0f}"),
)


def child_command(args, contestant: str, out: str, src: str = "") -> list[str]:
  """One process of the rounds: this script timing `contestant` alone, into `out`; src: the
  tree of an --against commit, whose own copy of the script runs instead."""
  peer = contestant if contestant in peers_dlrm.PEERS else ""
  # recgnn+NAME: another allocator (preloaded by the caller's env) replaces glibc's malloc, so
  # glibc's mallopt settings would act on nothing: that child runs with --malloc=default.
  malloc = "default" if contestant.startswith("recgnn+") else args.malloc
  # (the DCNv2 options only where used: an --against commit from before them rejects them)
  model = (
    {"model": args.model, "cross-layers": args.cross_layers, "low-rank": args.low_rank}
    if args.model != "dlrm"
    else {}
  )
  opts = {
    **model,
    "batch": args.batch,
    "tables": args.tables,
    "rows": args.rows,
    "dim": args.dim,
    "zipf": args.zipf,
    "lr": args.lr,
    "num-batches": args.num_batches,
    "warmup": args.warmup,
    "reps": args.reps,
    "steps-per-rep": args.steps_per_rep,
    "threads": args.threads,
    "malloc": malloc,
    "omp-wait-policy": args.omp_wait_policy,
    "seed": args.seed,
    "processes": 0,
    "peers": peer,
    "no-recgnn": int(peer != ""),
    "child-out": out,
  }
  script = (
    os.path.join(src, "benchmarks", "dlrm_throughput.py")
    if src
    else str(pathlib.Path(__file__).resolve())
  )
  return [sys.executable, script] + [f"--{k}={v}" for k, v in opts.items()]


def trainer_command(args, workdir: str) -> list[str]:
  """The same model in the trainer (`run.py`): dlrm_kaggle on its synthetic Criteo-format
  data with every categorical column hashed to args.rows rows (26 equal tables, as here), SGD
  for tables and MLPs at args.lr, no evaluation or checkpoints: what the trainer's input
  thread, packing and loop add to the step."""
  root = pathlib.Path(__file__).resolve().parents[1]
  steps = args.trainer_steps
  cfg = {
    "data.categorical": "hash",
    "data.hash_sizes": f"({args.rows},)",
    "train.batch_size": args.batch,
    "train.steps": steps,
    "train.log_every": max(steps // 8, 1),
    "train.eval_every": 0,
    "train.final_eval_splits": "()",
    "train.checkpoint_every": 0,
    "embeddings.dim": args.dim,
    "embeddings.initializer": "uniform",
    "embeddings.optimizer.name": "sgd",
    "embeddings.optimizer.learning_rate": args.lr,
    "optimizer.name": "sgd",
    "optimizer.learning_rate": args.lr,
  }
  return [
    sys.executable,
    str(root / "run.py"),
    "--experiment=dlrm_kaggle",
    f"--workdir={workdir}",
    *[f"--config.{k}={v}" for k, v in cfg.items()],
  ]


def trainer_result(workdir: str) -> dict:
  """samples/s of a trainer run: the median of its logged intervals after the first (which
  holds compilation), as gpu_check and end_to_end read them."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  rates = [r["samples_per_second"] for r in rows if "samples_per_second" in r][1:]
  if not rates:
    raise SystemExit(f"trainer run in {workdir} logged no steady interval; raise --trainer-steps")
  return {"samples_per_s": statistics.median(rates), "intervals": rates}


def cfg_of(args) -> peers_dlrm.DlrmConfig:
  sizes = dict(num_rows=args.rows, num_tables=args.tables, dim=args.dim, learning_rate=args.lr)
  if args.model == "dlrm":
    return peers_dlrm.DlrmConfig(**sizes)
  return peers_dcn.DcnConfig(**sizes, cross_layers=args.cross_layers, low_rank=args.low_rank)


def allocators(spec: str) -> dict[str, str]:
  """--allocators: {name: shared library path}. NAME=PATH, or a bare name found by the
  dynamic linker's cache (ctypes.util.find_library, e.g. jemalloc, tcmalloc_minimal)."""
  import ctypes.util

  out = {}
  for item in [s for s in spec.split(",") if s]:
    name, _, path = item.partition("=")
    if not path:
      found = ctypes.util.find_library(name)
      if not found:
        raise SystemExit(
          f"--allocators: no library for {name!r} on the linker's path; give NAME=PATH "
          "(e.g. jemalloc=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2)"
        )
      path = found
    elif not os.path.exists(path):
      raise SystemExit(f"--allocators: {name}={path}: no such file")
    out[name] = path
  return out


def run_processes(args) -> dict:
  """Each contestant in args.processes separate processes, in rounds (every contestant once
  per round, the order rotated each round), so the machine's load and each process's memory
  luck (page faults) spread over all of them; the payload with every process's figures."""
  # Every process's output, trainer workdirs and the --against tree; removed at the end.
  with tempfile.TemporaryDirectory(prefix="dlrm_throughput_") as tmp:
    return _run_processes(args, tmp)


def _run_processes(args, tmp: str) -> dict:
  contestants = ["recgnn"]
  env_of = {"recgnn": {}}
  src_of: dict[str, str] = {}
  against = None
  if args.against:
    src, sha = harness.extract_commit(args.against, tmp)
    against = {"commit": sha, "src": src}
    name = f"recgnn@{sha[:10]}"
    contestants.append(name)
    env_of[name] = {}
    src_of[name] = src
  for name, lib in allocators(args.allocators).items():
    contestants.append(f"recgnn+{name}")
    env_of[f"recgnn+{name}"] = {"LD_PRELOAD": lib}
  if args.trainer:
    contestants.append("trainer")
    env_of["trainer"] = {}
  avail = PEER_MODULES[args.model].available() if args.peers else {}
  skipped = {}
  for p in [s for s in args.peers.split(",") if s]:
    if avail.get(p, "unknown peer") is None:
      contestants.append(p)
      env_of[p] = {}
    else:
      skipped[p] = avail.get(p, f"unknown peer {p!r}")
      print(f"peer {p}: not available ({skipped[p]})", flush=True)
  machine = harness.machine_info()
  t_start = time.perf_counter()

  def run(c: str, r: int) -> dict:
    out = os.path.join(tmp, f"{r}_{c.replace('@', '_')}.json")
    workdir = os.path.join(tmp, f"trainer_{r}")
    cmd = (
      trainer_command(args, workdir)
      if c == "trainer"
      else child_command(args, c, out, src_of.get(c, ""))
    )
    t0 = time.perf_counter()
    load = os.getloadavg()[0]
    harness.run_checked(cmd, env_vars=env_of[c], what=f"process {r} of {c}")
    if c == "trainer":
      res = {**trainer_result(workdir), "load_avg": load}
      shutil.rmtree(workdir, ignore_errors=True)
    else:
      with open(out) as f:
        child = json.load(f)
      key = "recgnn" if c.startswith("recgnn") else c
      res = {**child["results"][key], "load_avg": child["machine"]["load_avg_at_start"][0]}
    res["process_seconds"] = time.perf_counter() - t0
    return res

  def show(c: str, res: dict) -> str:
    extra = (
      f", {res['cpu_system_ms_per_step']:.1f} system ms, "
      f"{res['minor_faults_per_step']:,.0f} faults / step"
      if "minor_faults_per_step" in res
      else ""
    )
    return f"{res['samples_per_s']:,.0f} samples/s{extra}"

  # Every contestant once per round, the order rotated: each leads once in len(contestants).
  order = lambda r: harness.rotated(contestants, r)  # noqa: E731
  runs = harness.rounds(args.processes, order, run, show)
  summary = {c: distribution(v) for c, v in runs.items()}
  ratios = {}
  for p in peers_dlrm.PEERS:
    if p in summary:
      for c in contestants:
        if c.startswith("recgnn"):
          sps, ref = summary[c]["samples_per_s"], summary[p]["samples_per_s"]["median"]
          ratios[f"{c} slowest / {p} median"] = sps["min"] / ref
          ratios[f"{c} median / {p} median"] = sps["median"] / ref
  if against:
    a, b = summary["recgnn"]["samples_per_s"], summary[contestants[1]]["samples_per_s"]
    ratios[f"recgnn median / {contestants[1]} median"] = a["median"] / b["median"]
  for c in contestants:
    if c.startswith("recgnn+"):
      a, b = summary[c]["samples_per_s"], summary["recgnn"]["samples_per_s"]
      ratios[f"{c} median / recgnn median"] = a["median"] / b["median"]
  if "trainer" in summary:
    a, b = summary["trainer"]["samples_per_s"], summary["recgnn"]["samples_per_s"]
    ratios["trainer median / recgnn step median"] = a["median"] / b["median"]
  return {
    "benchmark": "dlrm_throughput",
    "mode": "processes",
    "config": {
      **vars(args),
      "model_note": cfg_of(args).describe(),
      "mlp_gflop_per_batch": mlp_gflop_per_batch(cfg_of(args), args.batch),
    },
    "machine": machine,
    "load_avg_at_end": os.getloadavg(),
    "against": against and {"commit": against["commit"]},
    "allocators": {c: e["LD_PRELOAD"] for c, e in env_of.items() if "LD_PRELOAD" in e},
    "unavailable": skipped,
    "wall_seconds": time.perf_counter() - t_start,
    "runs": runs,
    "summary": summary,
    "ratios": ratios,
  }


def distribution(runs: list[dict]) -> dict:
  out = {}
  for key in (*(k for k, _, _ in DIST_COLUMNS), "floor_fraction"):
    vals = [r[key] for r in runs if key in r]
    if vals:
      out[key] = harness.distribution(vals)
  return out


def markdown_processes(payload: dict) -> str:
  a, m = payload["config"], payload["machine"]
  loads = [r["load_avg"] for v in payload["runs"].values() for r in v]
  lines = [
    f"# {TITLES[a['model']][0]} train-step throughput: distributions over separate processes",
    "",
    f"Batch {a['batch']}, {a['tables']} tables x {a['rows']:,} rows, dim {a['dim']}, "
    f"{a['model_note']}, SGD lr {a['lr']}, Zipf ids (exponent {a['zipf']}). Each "
    f"contestant in {a['processes']} separate processes, in rounds (one process of each per "
    f"round, order rotated); each process times {a['reps']} x {a['steps_per_rep']} steps after "
    f"{a['warmup']} warmup steps and reports its median. {m['cpus']} CPUs, load average "
    f"{min(loads):.1f}-{max(loads):.1f} at the processes' starts, {m['date_utc']}, jax "
    f"{m['jax']}. malloc: {a['malloc_note']}. Environment: {m['env'] or 'none'}. "
    f"`{m['command']}`.",
    "",
    *(
      [
        f"trainer: `run.py --experiment=dlrm_kaggle` on its synthetic Criteo-format data, every "
        f"column hashed to {a['rows']:,} rows, SGD lr {a['lr']}, {a['trainer_steps']} steps; "
        "its samples/s is the median of its logged intervals after the first (compilation), "
        "so it includes the input thread, the packed transfer and the loop.",
        "",
      ]
      if "trainer" in payload["runs"]
      else []
    ),
    *(
      [
        "recgnn+NAME: recgnn's step in a process started with LD_PRELOAD="
        + ", ".join(f"`{v}` ({k})" for k, v in payload["allocators"].items())
        + ", that allocator in place of glibc's malloc (no mallopt settings).",
        "",
      ]
      if payload.get("allocators")
      else []
    ),
    "| contestant | " + " | ".join(f"{h} min / median / max" for _, h, _ in DIST_COLUMNS) + " |",
    "|---|" + "---:|" * len(DIST_COLUMNS),
  ]
  for c, d in payload["summary"].items():
    cells = []
    for key, _, fmt in DIST_COLUMNS:
      x = d.get(key)
      cells.append(" / ".join(fmt.format(x[s]) for s in ("min", "median", "max")) if x else "-")
    lines.append(f"| {c} | " + " | ".join(cells) + " |")
  lines.append("")
  for k, v in payload["ratios"].items():
    lines.append(f"- {k}: **{v:.2f}**")
  ff = payload["summary"]["recgnn"].get("floor_fraction")
  if ff:
    lines.append(
      f"- recgnn's step as a fraction of the MLPs' matmul floor ({a['mlp_gflop_per_batch']:.2f} "
      "GFLOP per batch at the f32 matmul rate each process measured after its step): "
      f"min {ff['min']:.0%}, median **{ff['median']:.0%}**, max {ff['max']:.0%}"
    )
  for p, why in payload.get("unavailable", {}).items():
    lines.append(f"- {p}: not available ({why})")
  lines += peers_dcn.check_lines(payload.get("check"))
  lines += ["", "Every process (in run order within each contestant):", ""]
  for c, v in payload["runs"].items():
    lines.append(
      f"- {c}: "
      + ", ".join(
        f"{r['samples_per_s'] / 1e3:.1f}k"
        + (f" ({r['minor_faults_per_step']:,.0f} pf)" if "minor_faults_per_step" in r else "")
        for r in v
      )
    )
  lines.append("")
  return "\n".join(lines)


# ----------------------------------------------------------------------------- main

MODEL_HELP = """dlrm: the Kaggle DLRM on one-hot ids (vs TorchRec's DLRM and plain PyTorch)
dcnv2: DLRM-DCNv2 on MLPerf's multi-hot bags vs TorchRec's DLRM_DCN (peers_dcn.py)"""
CHECK_HELP = """dcnv2: only check that recgnn and TorchRec compute the same (exit 1 if not);
every dcnv2 run with torchrec checks first and reports it"""


def main(argv=None):
  p = harness.flags.parser(__doc__)
  p.add_argument("--model", choices=tuple(PEER_MODULES), default="dlrm", help=MODEL_HELP)
  p.add_argument("--cross-layers", type=int, default=3, help="dcnv2: low-rank cross layers")
  p.add_argument("--low-rank", type=int, default=64, help="dcnv2: the cross layers' rank")
  p.add_argument("--check", action="store_true", help=CHECK_HELP)
  harness.flags.add_dlrm(p)
  p.add_argument("--lr", type=float, default=0.1)
  p.add_argument("--num-batches", type=int, default=8, help="distinct batches cycled over")
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--reps", type=int, default=7)
  p.add_argument("--steps-per-rep", type=int, default=5)
  p.add_argument("--peers", default=None, help="'' for recgnn only (default: all of --model's)")
  p.add_argument("--threads", type=int, default=0, help="torch threads (0: all usable CPUs)")
  p.add_argument(
    "--processes",
    type=int,
    default=10,
    help="separate processes per contestant, in rounds (0: every contestant in this process)",
  )
  p.add_argument(
    "--against",
    default="",
    metavar="COMMIT",
    help="also time COMMIT's recgnn step in the same rounds (its recgnn/ and its own copy of "
    "this benchmark, from git)",
  )
  p.add_argument(
    "--trainer",
    action="store_true",
    help="also run the same model in the trainer (run.py dlrm_kaggle, tables hashed to --rows)",
  )
  p.add_argument("--trainer-steps", type=int, default=400, help="steps of each trainer run")
  p.add_argument(
    "--malloc",
    choices=("default", "keep", "keep_one_arena"),
    default="keep",
    help="keep (what recgnn's trainer does): glibc malloc keeps freed memory; keep_one_arena: "
    "the same in one malloc arena (for steps whose temporaries pass 64 MiB); default: glibc's",
  )
  p.add_argument(
    "--allocators",
    default="",
    help="also time recgnn's step with each of these allocators preloaded (LD_PRELOAD), "
    "NAME=PATH or NAME (found by ldconfig), comma-separated: contestants recgnn+NAME",
  )
  p.add_argument(
    "--omp-wait-policy",
    choices=("", "active", "passive"),
    default="",
    help="OMP_WAIT_POLICY for torch's threads ('' = torch's default)",
  )
  p.add_argument("--profile", action="store_true", help="also time recgnn's pieces and ideas")
  p.add_argument("--quick", action="store_true", help="3 processes, 3 reps x 3 steps, 4 batches")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--name", default="", help="results file stem (default from the options)")
  p.add_argument("--child-out", default="", help=argparse.SUPPRESS)  # a --processes child
  p.add_argument("--no-recgnn", type=int, default=0, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.peers is None:
    args.peers = ",".join(PEER_MODULES[args.model].PEERS)
  if args.model == "dcnv2" and (args.profile or args.trainer):
    p.error("--profile and --trainer time the dot DLRM only: use --model=dlrm")
  if args.check and args.model != "dcnv2":
    p.error("--check compares the DCNv2 models: add --model=dcnv2")
  if args.quick:
    args.reps, args.steps_per_rep, args.num_batches, args.warmup = 3, 3, 4, 2
    args.processes = min(args.processes, 3)
  if args.profile and args.processes:
    p.error("--profile times recgnn's pieces in one process: add --processes=0")
  if (args.against or args.trainer or args.allocators) and not args.processes:
    p.error(
      "--against, --trainer and --allocators run in their own processes: --processes must be > 0"
    )
  args.malloc_note = (
    keep_freed_memory(arenas=int(args.malloc == "keep_one_arena"))
    if args.malloc.startswith("keep")
    else "glibc default"
  )
  if args.omp_wait_policy:
    os.environ["OMP_WAIT_POLICY"] = args.omp_wait_policy.upper()  # before torch loads libgomp
  if not args.name:
    args.name = "dlrm_throughput" + ("_dcnv2" if args.model == "dcnv2" else "")
    args.name += f"_malloc_{args.malloc}" if args.malloc != "keep" else ""
    args.name += f"_omp_{args.omp_wait_policy}" if args.omp_wait_policy else ""
    args.name += "_processes" if args.processes else ""

  check = None
  if args.check or (
    args.model == "dcnv2" and not args.child_out and "torchrec" in args.peers.split(",")
  ):
    check = peers_dcn.check_at(cfg_of(args), args.batch, args.zipf, args.seed, Recgnn)
    if args.check:
      sys.exit(0 if check and check["ok"] else 1)
  if args.processes:
    payload = run_processes(args)
    payload["check"] = check
    harness.write_results(args.name, payload, markdown_processes(payload))
    return payload
  contestants = ([] if args.no_recgnn else ["recgnn"]) + [s for s in args.peers.split(",") if s]
  payload = time_in_process(args, contestants)
  payload["check"] = check
  if args.child_out:
    with open(args.child_out, "w") as f:
      json.dump(payload, f)
    return payload
  harness.write_results(args.name, payload, markdown(payload))
  return payload


if __name__ == "__main__":
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
  main()
