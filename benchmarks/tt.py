"""TT-Rec (`tt` backend): compression, kernel throughput, train-step cost and AUC vs dense.

Question: how much does TT compress the tables, and what does it cost in step time and AUC
against dense?

Sections (`--sections`, default all):
  compression  embedding floats of the Kaggle DLRM (real cardinalities, dim 16) with TT on the
               7 largest tables, per rank, against all-dense: computed from the specs, nothing
               allocated.
  levels       one prefix-tree level (`tt.level`), forward + vjp, contract=batched vs pairs at
               the level shapes of ttrec_kaggle's synthetic and real-size tables, beside the
               choice of `contract=auto`'s cost model (`tt.level_product`).
  kernels      one table (default C3's 10,131,227 rows x 16), one Kaggle batch of one-hot ids
               (2048), row-wise Adagrad: lookup -> grad -> update, jitted with the state
               donated, for `dense` and `tt` at each rank and kernel (naive / unique /
               prefix), ids Zipf(1.1) in two orders: `frequency` (id = popularity rank, what
               the Criteo reader's default produces) and `hashed` (hot rows scattered). Also
               the host `prepare` time per batch (off the step's path, on the input thread).
  train_step   the full DLRM train step of ttrec_kaggle (per rank) and dlrm_kaggle, same
               batches, same process, alternating so machine noise hits both alike.
  quality      test AUC of ttrec_kaggle and dlrm_kaggle trained on the same synthetic data for
               the same steps, per seed, beside the synthetic data's oracle AUC. With
               --real_sizes: the synthetic generator at scale 1.0 (Kaggle's real
               cardinalities), ids hashed into exactly the 26 Kaggle table sizes
               (data.categorical=hash), so the trained tables ARE the real-size tables.
  nimble       TT node embeddings (Nimble, KDD'22) on a graph without features
               (sage_tt_synthetic: 1M nodes; --nimble_experiment=sage_tt_cora: Cora): test
               accuracy, node-table compression and train-step time per (table, node order,
               init), the full table beside; PNG plot (results/<name>.png).
  nimble_step  train-step ms per node order (full table, partition, rcm, random), the configs
               interleaved per repetition in one process.

  python benchmarks/tt.py --quick                  # seconds per section
  python benchmarks/tt.py --sections=kernels --name=tt_kernels
Writes benchmarks/results/<name>.{json,md} (--name, default tt). The committed results:
  tt_compression  python benchmarks/tt.py --sections=compression --name=tt_compression
  tt_kernels      python benchmarks/tt.py --sections=kernels --name=tt_kernels
  tt_levels       python benchmarks/tt.py --sections=levels --name=tt_levels
  tt_contract     python benchmarks/tt.py --sections=kernels --ranks=32 --kernels=prefix \
                    --contracts=batched,pairs,auto --rows=97336 --name=tt_contract
                    (ttrec_kaggle's synthetic C3: 46^3 rows; --rows=10131227: the real C3)
  tt_train_step   python benchmarks/tt.py --sections=train_step --step_batches=8 --reps=5 \
                    --name=tt_train_step
  tt_quality      python benchmarks/tt.py --sections=quality --seeds=0,1,2 --quality_steps=1000 \
                    --name=tt_quality
  tt_train_step_cache  python benchmarks/tt.py --sections=train_step --ranks=32 --step_batches=8
                    --reps=5 --name=tt_train_step_cache
                    --step_variants='cache_rows=2000,cache_warmup=2;cache_rows=10000,cache_warmup=2'
  tt_quality_real  python benchmarks/tt.py --sections=quality --real_sizes --seeds=0,1,2 \
                    --quality_steps=837 --name=tt_quality_real   (4M rows: half an epoch)
  tt_nimble       python benchmarks/tt.py --sections=nimble --seeds=0 --name=tt_nimble
  tt_nimble_3seeds  python benchmarks/tt.py --sections=nimble --seeds=0,1,2 \
                    --nimble_variants='table=dense,order=none;order=partition;order=random' \
                    --name=tt_nimble_3seeds
  tt_nimble_cora  python benchmarks/tt.py --sections=nimble --nimble_experiment=sage_tt_cora \
                    --seeds=0,1,2 --name=tt_nimble_cora
  tt_nimble_step  python benchmarks/tt.py --sections=nimble_step --step_batches=16 --reps=5 \
                    --name=tt_nimble_step
The machine is shared and noisy: compare numbers within one run (ratios), never across runs.
"""

from __future__ import annotations

import pathlib
import statistics
import time

import harness
import jax
import jax.numpy as jnp
import numpy as np

from recgnn import planner
from recgnn.backends import tt
from recgnn.embeddings import base

KAGGLE_RANKS = (8, 16, 32, 64)
KERNELS = tt.KERNELS


# ----------------------------------------------------------------------------- compression


def compression(ranks=KAGGLE_RANKS, trained: bool = True) -> dict:
  """Per rank: the real Kaggle cardinalities, and (trained=True) the tables the synthetic
  default actually trains (its reader's vocabulary; the data is generated on first use)."""
  from experiments import dlrm_kaggle, ttrec_kaggle

  sizes = {"kaggle": ttrec_kaggle.KAGGLE_CARDINALITIES}
  if trained:
    from recgnn.train import loop

    config = dlrm_kaggle.get_config()
    task = loop.load_task(config, loop.config_mesh(config))
    sizes["synthetic_trained"] = task.data.cardinalities
  out = {}
  for what, cards in sizes.items():
    rows = []
    for r in ranks:
      plan = ttrec_kaggle.make_plan(ttrec_kaggle.parse_arg(f"rank={r}"))
      rep = ttrec_kaggle.compression_report(cards, plan)
      del rep["tables"]
      rows.append({"rank": r, "plan": plan, **rep})
    out[what] = rows
  out["cardinalities"] = {k: list(v) for k, v in sizes.items()}
  return out


def compression_md(res: dict) -> str:
  titles = {
    "kaggle": "Kaggle DLRM, real cardinalities",
    "synthetic_trained": "synthetic default as trained (reader vocabulary, Kaggle x 0.01)",
  }
  lines = []
  for what, title in titles.items():
    if what not in res:
      continue
    lines += [
      f"### Embedding compression, {title} (dim 16, TT on the 7 largest tables)",
      "",
      "| rank | TT floats (7 tables) | dense floats (19 tables) | total floats | all-dense floats "
      "| compression | of the 7 TT tables |",
      "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res[what]:
      lines.append(
        f"| {r['rank']} | {r['tt_params']:,} | {r['dense_params']:,} | {r['total_params']:,} "
        f"| {r['all_dense_params']:,} | {r['ratio']:.1f}x | {r['tt_tables_ratio']:.0f}x |"
      )
    lines.append("")
  return "\n".join(lines)


# ----------------------------------------------------------------------------- kernels


def zipf_ids(rng, num_rows, shape, exponent=1.1, order="frequency", perm_seed=0):
  """int32 ids with P(rank r) ~ (r + 1)^-exponent; `hashed` scatters ranks over the rows."""
  ranks = harness.zipf_ranks(rng, harness.zipf_cdf(num_rows, exponent), shape)
  if order == "hashed":
    # An odd-multiplier bijection mod a power of two >= N, folded into [0, N).
    m = 1 << int(num_rows - 1).bit_length()
    ranks = (ranks * 2654435761 + perm_seed) % m
    ranks = np.where(ranks < num_rows, ranks, ranks % num_rows)
  return ranks.astype(np.int32)


def make_step(backend: base.Backend):
  """(state, (prepared, target)) -> state: pooled lookup, a small loss's grad w.r.t. the
  pooled rows, update (contract v2; `backend` is a group of one table)."""
  (name,) = backend.specs

  def loss(pooled, target):
    return jnp.mean((pooled - target) ** 2)

  def step(state, inputs):
    prepared, target = inputs
    pooled, residuals = backend.lookup(state, prepared)
    return backend.update(state, prepared, residuals, {name: jax.grad(loss)(pooled[name], target)})

  return jax.jit(step, donate_argnums=0)


class Runner:
  """One variant, compiled and warmed up; `run(steps)` times `steps` steps (donated state)."""

  def __init__(self, text, spec, batches, warmup):
    backend = planner.make_backend(text, spec)
    self.state = backend.init(jax.random.key(0))
    t0 = time.perf_counter()
    prepared = [backend.prepare({spec.name: b}) for b in batches]
    self.prepare_ms = 1e3 * (time.perf_counter() - t0) / len(batches)
    # Capacities grown: the final shapes.
    prepared = [backend.prepare({spec.name: b}) for b in batches]
    target = jnp.zeros((batches[0].shape[0], spec.dim), jnp.float32)
    self.inputs = [(jax.device_put(p), target) for p in prepared]
    self.fn, self.k, self.times = make_step(backend), 0, []
    for _ in range(max(warmup, len(self.inputs))):  # compile every shape
      self._step()
    jax.block_until_ready(self.state)

  def _step(self):
    self.state = self.fn(self.state, self.inputs[self.k % len(self.inputs)])
    self.k += 1

  def run(self, steps):
    t0 = time.perf_counter()
    for _ in range(steps):
      self._step()
    jax.block_until_ready(self.state)
    self.times.append((time.perf_counter() - t0) / steps)


def kernels(args) -> dict:
  opt = base.OptimizerSpec(name="rowwise_adagrad", learning_rate=0.05)
  spec = base.TableSpec(name="C3", num_rows=args.rows, dim=16, optimizer=opt)
  rng = np.random.default_rng(0)
  out = []
  for order in args.orders:
    batches = [zipf_ids(rng, args.rows, (args.batch, 1), order=order) for _ in range(args.batches)]
    uniq = float(np.mean([np.unique(b).size for b in batches]))
    variants = [("dense", "dense")] + [
      (
        f"tt r={r} {k}" + (f" {c}" if c != "auto" else ""),
        f"tt(rank={r}, kernel={k}, contract={c})",
      )
      for r in args.ranks
      for k in args.kernels
      for c in (["auto"] if k == "naive" else args.contracts)
    ]
    runners = {name: Runner(text, spec, batches, args.warmup) for name, text in variants}
    for _ in range(args.reps):  # round-robin: machine noise hits every variant alike
      for r in runners.values():
        r.run(args.steps)
    d = statistics.median(runners["dense"].times)
    for name, r in runners.items():
      ms = 1e3 * statistics.median(r.times)
      print(f"  {order:<9} {name:<20} {ms:8.3f} ms  x{ms / 1e3 / d:.1f}", flush=True)
      out.append(
        {
          "order": order,
          "variant": name,
          "step_ms": ms,
          "vs_dense": ms / 1e3 / d,
          "per_rep_ms": [1e3 * t for t in r.times],
          "prepare_ms": r.prepare_ms,
          "unique_ids": uniq,
        }
      )
    del runners
  return {"rows": args.rows, "batch": args.batch, "results": out}


def kernels_md(res: dict) -> str:
  lines = [
    f"### Lookup + update, one {res['rows']:,} x 16 table, batch {res['batch']} one-hot, "
    "row-wise Adagrad",
    "",
    "| ids | variant | step ms | x dense | host prepare ms | distinct ids / batch |",
    "|---|---|---:|---:|---:|---:|",
  ]
  for r in res["results"]:
    lines.append(
      f"| {r['order']} | {r['variant']} | {r['step_ms']:.3f} | {r['vs_dense']:.1f} "
      f"| {r['prepare_ms']:.2f} | {r['unique_ids']:.0f} |"
    )
  return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- train step


def _step_configs(args) -> dict:
  from experiments import dlrm_kaggle, ttrec_kaggle

  configs = {"dlrm_kaggle": dlrm_kaggle.get_config()}
  for r in args.ranks:
    configs[f"ttrec_kaggle rank={r}"] = ttrec_kaggle.get_config(f"rank={r}")
  for extra in args.step_variants:
    configs[f"ttrec_kaggle {extra}"] = ttrec_kaggle.get_config(extra)
  for c in configs.values():
    c.train.batch_size = args.step_batch
    if args.data_rows:
      c.data.synthetic.rows = args.data_rows
  return configs


def _packed_run(config, task, batches):
  """The trainer's run of `config` over `task` on one device, and `batches` prepared in stream
  order through the trainer's driver (capacities grow here), then packed as the trainer's step
  takes them (one transfer per batch): (run, [(buffers, layout)], prepare ms per batch)."""
  from recgnn.train import inputs as inputs_lib
  from recgnn.train import setup

  run = setup.build(
    config, mesh=planner.default_mesh(), task=task, example=batches[0], key=jax.random.key(0)
  )
  t0 = time.perf_counter()
  stream = [("train", None, x) for x in batches]
  prepared = [item.prepared for item in inputs_lib.prepare_stream(run.plan, stream)]
  prep_ms = 1e3 * (time.perf_counter() - t0) / len(batches)
  return run, [run.packed(p, x) for p, x in zip(prepared, batches)], prep_ms


def _time_interleaved(runs: dict, reps: int) -> None:
  """Seconds per step of each run over its packed inputs, appended to its "times"; the runs
  interleaved per repetition (the machine is shared: load changes hit them all)."""
  for _ in range(reps):
    for r in runs.values():
      state = r["state"]
      t0 = time.perf_counter()
      for p, x in r["inputs"]:
        state, _ = r["fn"](state, p, x)
      jax.block_until_ready(state)
      r["times"].append((time.perf_counter() - t0) / len(r["inputs"]))
      r["state"] = state


def train_step(args) -> dict:
  """Median train-step ms of each config on the same batches, configs interleaved per rep."""
  from recgnn.train import loop

  configs = _step_configs(args)
  first = next(iter(configs.values()))
  task = loop.load_task(first, loop.config_mesh(first))
  stream = task.train_batches(0)
  batches = [next(stream) for _ in range(args.step_batches)]
  runs = {}
  for name, config in configs.items():
    run, inputs, prep_ms = _packed_run(config, task, batches)
    state, fn = run.state, run.train_step
    shapes = {repr(layout) for _, layout in inputs}
    t0 = time.perf_counter()
    for p, x in inputs:  # compile every shape once
      state, _ = fn(state, p, x)
    jax.block_until_ready(state)
    runs[name] = {
      "fn": fn,
      "state": state,
      "inputs": inputs,
      "compile_s": time.perf_counter() - t0,
      "prepare_ms": prep_ms,
      "distinct_shapes": len(shapes),
      "times": [],
    }
    print(
      f"  {name}: {len(shapes)} step shape(s), warm-up {runs[name]['compile_s']:.1f} s", flush=True
    )
  _time_interleaved(runs, args.reps)
  base_ms = 1e3 * statistics.median(runs["dlrm_kaggle"]["times"])
  out = []
  for name, r in runs.items():
    ms = 1e3 * statistics.median(r["times"])
    out.append(
      {
        "config": name,
        "plan": str(configs[name].embeddings.plan[0][1]),
        "step_ms": ms,
        "vs_dlrm": ms / base_ms,
        "per_rep_ms": [1e3 * t for t in r["times"]],
        "prepare_ms": r["prepare_ms"],
        "distinct_shapes": r["distinct_shapes"],
        "warmup_s": r["compile_s"],
      }
    )
    print(f"  {name:<36} {ms:8.2f} ms  x{ms / base_ms:.2f}", flush=True)
  cards = dict(zip(task.names, task.data.cardinalities))
  return {
    "batch": args.step_batch,
    "batches": args.step_batches,
    "cardinalities": cards,
    "results": out,
  }


def train_step_md(res: dict) -> str:
  lines = [
    f"### DLRM train step (batch {res['batch']}, {res['batches']} batches x reps, synthetic "
    "default data)",
    "",
    "| config | step ms | x dlrm_kaggle | host prepare ms / batch | step shapes | per-rep ms |",
    "|---|---:|---:|---:|---:|---|",
  ]
  for r in res["results"]:
    reps = ", ".join(f"{t:.1f}" for t in r["per_rep_ms"])
    lines.append(
      f"| {r['config']} | {r['step_ms']:.2f} | {r['vs_dlrm']:.2f} | {r['prepare_ms']:.2f} "
      f"| {r['distinct_shapes']} | {reps} |"
    )
  return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- quality


def real_sizes(c) -> None:
  """Config overrides: the synthetic generator at Kaggle's real cardinalities (scale 1.0), ids
  hashed into exactly the 26 Kaggle table sizes, so every trained table has its real size
  (frequency ids would keep only the ids a few million rows happen to draw: ~600k rows in
  the largest table at 4M rows, not 10.1M)."""
  from experiments import dlrm_kaggle

  c.data.synthetic.scale = 1.0
  c.data.categorical = "hash"
  c.data.hash_sizes = tuple(int(x) for x in dlrm_kaggle.KAGGLE_CARDINALITIES)


def _table_floats(plan) -> dict[str, int]:
  """Trainable floats per table of a resolved plan (TT: its cores)."""
  out = {}
  for g in plan.groups.values():
    out.update(g.num_params())
  return out


def _median_rate(workdir: str, key: str = "samples_per_second") -> float | None:
  """Median of the trainer's logged throughput, the first window (compilation) left out."""
  import json
  import os

  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return None
  with open(path) as f:
    rates = [r[key] for r in map(json.loads, f) if key in r]
  rates = rates[1:] or rates
  return float(statistics.median(rates)) if rates else None


def quality(args) -> dict:
  """Test AUC of dlrm_kaggle and ttrec_kaggle, same synthetic data and steps, per seed."""
  import tempfile

  from experiments import dlrm_kaggle, ttrec_kaggle
  from recgnn.train import loop

  out, cards = [], None
  for seed in args.seeds:
    for name, make in [
      ("dlrm_kaggle", dlrm_kaggle.get_config),
      (f"ttrec_kaggle {args.quality_arg}", lambda: ttrec_kaggle.get_config(args.quality_arg)),
    ]:
      c = make()
      c.seed = seed
      c.train.steps = args.quality_steps
      c.train.log_every = max(1, args.quality_steps // 8)
      c.train.checkpoint_every = 0
      if args.data_rows:
        c.data.synthetic.rows = args.data_rows
      if args.real_sizes:
        real_sizes(c)
      with tempfile.TemporaryDirectory() as wd:
        t0 = time.perf_counter()
        result = loop.train(c, wd)
        seconds = time.perf_counter() - t0
        rate = _median_rate(wd)
      m = result.metrics
      floats = _table_floats(result.plan)
      if cards is None:
        cards = [int(s.num_rows) for s in result.plan.specs.values()]
      row = {
        "config": name,
        "seed": seed,
        "steps": args.quality_steps,
        "batch_size": c.train.batch_size,
        "data_rows": c.data.synthetic.rows,
        "scale": c.data.synthetic.scale,
        "categorical": c.data.categorical,
        "test_auc": m["test/auc"],
        "valid_auc": m["valid/auc"],
        "test_logloss": m["test/logloss"],
        "oracle_auc": m.get("test/oracle_auc"),
        "seconds": seconds,
        "train_samples_per_second": rate,
        "embedding_floats": int(sum(floats.values())),
      }
      out.append(row)
      print(f"  seed {seed} {name}: test AUC {row['test_auc']:.5f}", flush=True)
      del result
  summary = {}
  for name in dict.fromkeys(r["config"] for r in out):
    runs = [r for r in out if r["config"] == name]
    aucs = [r["test_auc"] for r in runs]
    summary[name] = {
      "mean_test_auc": float(np.mean(aucs)),
      "std": float(np.std(aucs)),
      "embedding_floats": runs[0]["embedding_floats"],
      "train_samples_per_second": float(
        np.median([r["train_samples_per_second"] or np.nan for r in runs])
      ),
    }
  names = list(summary)
  gap = summary[names[1]]["mean_test_auc"] - summary[names[0]]["mean_test_auc"]
  return {
    "runs": out,
    "seeds": list(args.seeds),
    "real_sizes": bool(args.real_sizes),
    "trained_cardinalities": cards,
    "summary": summary,
    "tt_minus_dense": gap,
    "compression": summary[names[0]]["embedding_floats"] / summary[names[1]]["embedding_floats"],
    "oracle_auc": out[0]["oracle_auc"],
  }


def quality_md(res: dict) -> str:
  r0 = res["runs"][0]
  if res.get("real_sizes"):
    what = (
      f"synthetic data at Kaggle's real cardinalities (scale {r0['scale']}, ids hashed into "
      f"the 26 Kaggle table sizes: {sum(res['trained_cardinalities']):,} rows in all), "
      f"{r0['data_rows']:,} rows"
    )
  else:
    what = "synthetic default data"
  lines = [
    f"### Test AUC, {what}, {r0['steps']} steps of batch {r0.get('batch_size', 2048)}, "
    f"seeds {res['seeds']}",
    "",
    "| config | embedding floats | mean test AUC | std | per seed | oracle AUC | train samples/s |",
    "|---|---:|---:|---:|---|---:|---:|",
  ]
  for name, s in res["summary"].items():
    per = ", ".join(f"{r['test_auc']:.4f}" for r in res["runs"] if r["config"] == name)
    floats = s.get("embedding_floats")
    rate = s.get("train_samples_per_second")
    lines.append(
      f"| {name} | {f'{floats:,}' if floats else '-'} | {s['mean_test_auc']:.5f} "
      f"| {s['std']:.5f} | {per} | {res['oracle_auc']:.4f} "
      f"| {f'{rate:,.0f}' if rate and rate == rate else '-'} |"
    )
  lines.append(f"\nttrec - dlrm mean test AUC: {res['tt_minus_dense']:+.5f}")
  if "compression" in res:
    lines.append(f"\nembedding compression (dlrm floats / ttrec floats): {res['compression']:.1f}x")
  return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- nimble

NIMBLE_VARIANTS = (
  "table=dense,order=none",
  "order=partition",
  "order=rcm",
  "order=random",
  "order=partition,init=orthogonal",
  "order=partition,init=eigen",
  "order=random,init=eigen",
)


def nimble(args) -> dict:
  """TT vs full node embeddings on a feature-less graph, per node order and init."""
  import importlib
  import tempfile

  from recgnn.train import loop

  exp = importlib.import_module(f"experiments.{args.nimble_experiment}")
  out = []
  for seed in args.seeds:
    for variant in args.nimble_variants:
      c = exp.get_config(variant)
      c.seed = seed
      if args.nimble_steps:
        c.train.steps = args.nimble_steps
      c.train.log_every = max(1, c.train.steps // 10)
      c.train.checkpoint_every = 0
      with tempfile.TemporaryDirectory() as wd:
        t0 = time.perf_counter()
        result = loop.train(c, wd)
        seconds = time.perf_counter() - t0
        rate = _median_rate(wd)
      m = result.metrics
      spec = result.plan.specs["node"]
      floats = _table_floats(result.plan)["node"]
      row = {
        "variant": variant,
        "seed": seed,
        "plan": result.plan.backend_of("node").describe("node"),
        "node_order": c.data.node_order,
        "num_nodes": spec.num_rows,
        "dim": spec.dim,
        "floats": int(floats),
        "compression": spec.num_rows * spec.dim / floats,
        "test_accuracy": m["test/accuracy"],
        "valid_accuracy": m["valid/accuracy"],
        "chance_accuracy": m.get("chance_accuracy"),
        "steps": c.train.steps,
        "batch_size": c.sampler.batch_size,
        "step_ms": 1000.0 * c.sampler.batch_size / rate if rate else None,
        "seconds": seconds,
      }
      out.append(row)
      print(
        f"  seed {seed} {variant}: test acc {row['test_accuracy']:.4f}, "
        f"{row['compression']:,.0f}x, step {row['step_ms'] or float('nan'):.1f} ms",
        flush=True,
      )
      del result
  summary = {}
  for v in dict.fromkeys(r["variant"] for r in out):
    runs = [r for r in out if r["variant"] == v]
    acc = [r["test_accuracy"] for r in runs]
    summary[v] = {
      "mean_test_accuracy": float(np.mean(acc)),
      "std": float(np.std(acc)),
      "compression": runs[0]["compression"],
      "floats": runs[0]["floats"],
      "step_ms": float(np.median([r["step_ms"] for r in runs])),
      "plan": runs[0]["plan"],
      "node_order": runs[0]["node_order"],
    }
  return {"experiment": args.nimble_experiment, "seeds": list(args.seeds), "runs": out,
          "summary": summary}  # fmt: skip


NIMBLE_STEP_VARIANTS = ("table=dense,order=none", "order=partition", "order=rcm", "order=random")


def nimble_step(args) -> dict:
  """Train-step ms per node order, the configs interleaved per repetition in one process (the
  machine is shared: only ratios within a run mean anything). Each config has its own task
  (its own relabelled graph) and its first `step_batches` train batches; the jitted step is
  the trainer's (Feeder + jit_packed), as in `train_step`."""
  import importlib

  from recgnn.train import loop

  exp = importlib.import_module(f"experiments.{args.nimble_experiment}")
  runs = {}
  for variant in args.nimble_step_variants:
    config = exp.get_config(variant)
    task = loop.load_task(config, loop.config_mesh(config))
    stream = task.train_batches(0)
    batches = [next(stream) for _ in range(args.step_batches)]
    run, inputs, prep_ms = _packed_run(config, task, batches)
    state, fn = run.state, run.train_step
    for p, x in inputs:  # compile every shape once
      state, _ = fn(state, p, x)
    jax.block_until_ready(state)
    stats = run.plan.backend_of("node").stats()
    runs[variant] = {"fn": fn, "state": state, "inputs": inputs, "prepare_ms": prep_ms,
                     "times": [], "stats": stats, "order": config.data.node_order}  # fmt: skip
    print(f"  {variant}: ready (prepare {prep_ms:.1f} ms/batch)", flush=True)
    del task
  _time_interleaved(runs, args.reps)
  base_ms = 1e3 * statistics.median(next(iter(runs.values()))["times"])
  out = []
  for variant, r in runs.items():
    ms = 1e3 * statistics.median(r["times"])
    out.append({"variant": variant, "node_order": r["order"], "step_ms": ms,
                "vs_first": ms / base_ms, "per_rep_ms": [1e3 * t for t in r["times"]],
                "prepare_ms": r["prepare_ms"], "backend_stats": r["stats"]})  # fmt: skip
    print(f"  {variant:<36} {ms:8.2f} ms  x{ms / base_ms:.2f}", flush=True)
  return {"experiment": args.nimble_experiment, "batches": args.step_batches,
          "reps": args.reps, "results": out}  # fmt: skip


def nimble_step_md(res: dict) -> str:
  first = res["results"][0]["variant"]
  lines = [
    f"### Train step per node order, `{res['experiment']}`, interleaved: {res['reps']} reps of "
    f"{res['batches']} batches each (median)",
    "",
    f"| variant | node order | step ms | vs {first} | host prepare ms / batch | TT capacities |",
    "|---|---|---:|---:|---:|---|",
  ]
  for r in res["results"]:
    caps = ", ".join(f"{k.split('@')[0]} {v:,.0f}" for k, v in r["backend_stats"].items())
    lines.append(
      f"| {r['variant']} | {r['node_order']} | {r['step_ms']:.1f} | {r['vs_first']:.2f}x "
      f"| {r['prepare_ms']:.1f} | {caps or '-'} |"
    )
  return "\n".join(lines) + "\n"


def nimble_md(res: dict) -> str:
  r0 = res["runs"][0]
  full = [s for v, s in res["summary"].items() if s["compression"] == 1.0]
  lines = [
    f"### TT vs full node embeddings, `{res['experiment']}` ({r0['num_nodes']:,} nodes, dim "
    f"{r0['dim']}, no node features), {r0['steps']} steps of {r0['batch_size']} seeds, "
    f"seeds {res['seeds']}",
    "",
    "| variant | node table | node order | floats | compression | mean test acc | std "
    "| vs full | train step ms |",
    "|---|---|---|---:|---:|---:|---:|---:|---:|",
  ]
  for v, s in res["summary"].items():
    vs = f"{s['mean_test_accuracy'] - full[0]['mean_test_accuracy']:+.4f}" if full else "-"
    plan = s["plan"].split(", init_path")[0] + (")" if "init_path" in s["plan"] else "")
    lines.append(
      f"| {v} | {plan} | {s['node_order']} | {s['floats']:,} | {s['compression']:,.0f}x "
      f"| {s['mean_test_accuracy']:.4f} | {s['std']:.4f} | {vs} | {s['step_ms']:.1f} |"
    )
  lines.append(f"\nchance accuracy (majority class of test): {r0['chance_accuracy']:.4f}. Step "
               "ms: the trainer's median samples/s over a run's log windows (first left out), runs "
               "one after another on a shared machine; the `nimble_step` section times them "
               "interleaved.")  # fmt: skip
  return "\n".join(lines) + "\n"


def nimble_plot(res: dict, path: pathlib.Path) -> None:
  """Test accuracy (bars) and train-step ms (dots) per variant."""
  if not harness.can_plot():
    return
  names = list(res["summary"])
  s = [res["summary"][n] for n in names]
  with harness.png(path, figsize=(10, 4.5), dpi=110) as (fig, ax):
    x = np.arange(len(names))
    acc = [v["mean_test_accuracy"] for v in s]
    ax.bar(x, acc, yerr=[v["std"] for v in s], color=["#888" if v["compression"] == 1 else "#3a7"
                                                     for v in s])  # fmt: skip
    for i, v in enumerate(s):
      ax.text(i, acc[i] + 0.005, f"{v['compression']:,.0f}x", ha="center", fontsize=8)
    lo = min(acc) - 0.1
    ax.set_ylim(max(0.0, lo), min(1.0, max(acc) + 0.05))
    ax.set_xticks(x, [n.replace(",", "\n") for n in names], fontsize=8)
    ax.set_ylabel("test accuracy (bars; label: compression)")
    ax2 = ax.twinx()
    ax2.plot(x, [v["step_ms"] for v in s], "ko", label="train step ms")
    ax2.set_ylabel("train step ms (dots)")
    ax2.set_ylim(0, max(v["step_ms"] for v in s) * 1.3)
    r0 = res["runs"][0]
    ax.set_title(f"{res['experiment']}: {r0['num_nodes']:,} nodes, TT vs full node embeddings")


# ----------------------------------------------------------------------------- main


# One prefix-tree level per row: (P_{k-1}, a, r, d, r1, P_k) at ttrec_kaggle's synthetic C3
# (46^3 rows: levels 1 and 2) and at the real 10M-row C3 (217^3: a batch's levels), each with
# several counts S_k of distinct slices.
LEVEL_SHAPES = [(46, 2, 32, 2, 32, 448), (448, 4, 32, 4, 1, 1280), (200, 2, 32, 2, 32, 1500),
                (1500, 4, 32, 4, 1, 2000)]  # fmt: skip
LEVEL_SLICES = (16, 46, 100, 217)


def levels(args) -> dict:
  """Forward + vjp ms of one level (`tt.level`) with contract=batched and =pairs, beside the
  choice of the cost model (`tt.level_product`): the data its constants are fitted to."""
  rng = np.random.default_rng(0)
  out = []
  # (gpu_check's calibrate stage adds small levels, where a GPU's launch cost shows.)
  for p_prev, a, r, d, r1, p in getattr(args, "level_shapes", None) or LEVEL_SHAPES:
    for n_s in getattr(args, "level_slices", None) or LEVEL_SLICES:
      pre = jnp.asarray(rng.normal(size=(p_prev, a, r)), jnp.float32)
      sl = jnp.asarray(rng.normal(size=(n_s, r, d, r1)), jnp.float32)
      parent_of = jnp.asarray(np.sort(rng.integers(0, p_prev, p)), jnp.int32)
      slice_of = jnp.asarray(rng.integers(0, n_s, p), jnp.int32)
      fns = {}
      for how in ("batched", "pairs"):

        def f(x, y, par, sli, how=how):
          o, vjp = jax.vjp(lambda u, w: tt.level(u, w, par, sli, how), x, y)
          return vjp(o)

        fns[how] = jax.jit(f)
        jax.block_until_ready(fns[how](pre, sl, parent_of, slice_of))
      times = {how: [] for how in fns}
      for _ in range(args.reps):  # interleaved: noise hits both alike
        for how, f in fns.items():
          t0 = time.perf_counter()
          for _ in range(args.steps):
            res = f(pre, sl, parent_of, slice_of)
          jax.block_until_ready(res)
          times[how].append(1e3 * (time.perf_counter() - t0) / args.steps)
      ms = {how: statistics.median(t) for how, t in times.items()}
      row = {
        "p_prev": p_prev, "a": a, "r": r, "d": d, "r1": r1, "p": p, "slices": n_s,
        "batched_ms": ms["batched"], "pairs_ms": ms["pairs"],
        "faster": min(ms, key=ms.get), "auto": tt.level_product(p_prev, a, r, n_s, d, r1, p),
      }  # fmt: skip
      print(f"  {row}", flush=True)
      out.append(row)
  return {"results": out}


def levels_md(res: dict) -> str:
  lines = [
    "### One prefix-tree level, forward + vjp: contract=batched vs pairs, and auto's choice",
    "",
    "| P_{k-1} | a | d x r_k | P_k | S_k | pairs / products | batched ms | pairs ms | faster "
    "| auto |",
    "|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
  ]
  for x in res["results"]:
    lines.append(
      f"| {x['p_prev']} | {x['a']} | {x['d']} x {x['r1']} | {x['p']} | {x['slices']} | "
      f"{x['p_prev'] * x['slices'] / x['p']:.1f} | {x['batched_ms']:.3f} | {x['pairs_ms']:.3f} "
      f"| {x['faster']} | {x['auto']} |"
    )
  agree = sum(x["faster"] == x["auto"] for x in res["results"])
  lines += ["", f"auto picks the faster product at {agree} of {len(res['results'])} levels."]
  return "\n".join(lines) + "\n"


SECTIONS = {
  "compression": (lambda a: compression(a.ranks), compression_md),
  "kernels": (kernels, kernels_md),
  "levels": (levels, levels_md),
  "train_step": (train_step, train_step_md),
  "quality": (quality, quality_md),
  "nimble": (nimble, nimble_md),
  "nimble_step": (nimble_step, nimble_step_md),
}


def main(argv=None):
  p = harness.flags.parser(__doc__)
  p.add_argument("--sections", default="compression,kernels,train_step,quality")
  p.add_argument("--quick", action="store_true")
  p.add_argument("--ranks", default="8,16,32,64")
  p.add_argument("--kernels", default=",".join(KERNELS))
  p.add_argument(
    "--contracts", default="auto", help="level products of unique/prefix: auto,batched,pairs"
  )
  p.add_argument("--orders", default="frequency,hashed")
  p.add_argument("--rows", type=int, default=10_131_227)
  p.add_argument("--batch", type=int, default=2048)
  p.add_argument("--batches", type=int, default=8)
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--name", default="tt")
  p.add_argument("--step_batch", type=int, default=2048)
  p.add_argument("--step_batches", type=int, default=8)
  p.add_argument(
    "--step_variants",
    default="pad=full;kernel=unique",
    help="';'-separated ttrec_kaggle args, e.g. 'cache_rows=2000,cache_warmup=2;pad=full'",
  )
  p.add_argument("--data_rows", type=int, default=0, help="synthetic rows (0: the default)")
  p.add_argument("--seeds", default="0,1,2")
  p.add_argument("--quality_steps", type=int, default=1000)
  p.add_argument("--quality_arg", default="rank=32")
  p.add_argument("--real_sizes", action="store_true", help="quality at Kaggle's real sizes")
  p.add_argument("--nimble_experiment", default="sage_tt_synthetic")
  p.add_argument("--nimble_variants", default=";".join(NIMBLE_VARIANTS))
  p.add_argument("--nimble_steps", type=int, default=0, help="0: the experiment's steps")
  p.add_argument("--nimble_step_variants", default=";".join(NIMBLE_STEP_VARIANTS))
  args = p.parse_args(argv)
  args.ranks = [int(x) for x in args.ranks.split(",")]
  args.kernels = args.kernels.split(",")
  args.contracts = args.contracts.split(",")
  args.orders = args.orders.split(",")
  args.step_variants = [v for v in args.step_variants.split(";") if v]
  args.seeds = [int(x) for x in args.seeds.split(",")]
  args.nimble_variants = [v for v in args.nimble_variants.split(";") if v]
  args.nimble_step_variants = [v for v in args.nimble_step_variants.split(";") if v]
  if args.quick:
    args.rows, args.batches, args.reps, args.steps = 1_000_000, 4, 3, 5
    args.step_batches, args.seeds, args.quality_steps = 3, [0], 50
    args.nimble_experiment, args.nimble_steps = "sage_tt_cora", 20
  payload = {"machine": harness.machine_info(), "args": vars(args)}
  md = [f"## TT-Rec benchmarks\n\n`{payload['machine']['command']}`\n"]
  for s in args.sections.split(","):
    if s not in SECTIONS:
      raise SystemExit(f"Unknown section {s!r}; available: {', '.join(SECTIONS)}")
    run, to_md = SECTIONS[s]
    print(f"== {s}", flush=True)
    payload[s] = run(args)
    md.append(to_md(payload[s]))
  harness.write_results(args.name, payload, "\n".join(md))
  if "nimble" in payload:
    nimble_plot(payload["nimble"], harness.RESULTS / f"{args.name}.png")


if __name__ == "__main__":
  main()
