"""TT-Rec (`tt` backend): compression, kernel throughput, train-step cost and AUC vs dense.

Sections (`--sections`, default all):
  compression  embedding floats of the Kaggle DLRM (real cardinalities, dim 16) with TT on the
               7 largest tables, per rank, against all-dense: computed from the specs, nothing
               allocated.
  kernels      one table (default C3's 10,131,227 rows x 16), one Kaggle batch of one-hot ids
               (2048), row-wise Adagrad: lookup -> grad -> update, jitted with the state
               donated, for `dense` and `tt` at each rank and kernel (naive / unique /
               prefix), ids Zipf(1.1) in two orders: `frequency` (id = popularity rank, what
               the Criteo reader's default produces) and `hashed` (hot rows scattered). Also
               the host `prepare` time per batch (off the step's path, on the input thread).
  train_step   the full DLRM train step of ttrec_kaggle (per rank) and dlrm_kaggle, same
               batches, same process, alternating so machine noise hits both alike.
  quality      test AUC of ttrec_kaggle and dlrm_kaggle trained on the same synthetic data for
               the same steps, per seed, beside the synthetic data's oracle AUC.

  python benchmarks/tt.py --quick                  # seconds per section
  python benchmarks/tt.py --sections=kernels --name=tt_kernels
Writes benchmarks/results/<name>.{json,md} (--name, default tt). The committed results:
  tt_compression  python benchmarks/tt.py --sections=compression --name=tt_compression
  tt_kernels      python benchmarks/tt.py --sections=kernels --name=tt_kernels
  tt_train_step   python benchmarks/tt.py --sections=train_step --step_batches=8 --reps=5 \
                    --name=tt_train_step
  tt_quality      python benchmarks/tt.py --sections=quality --seeds=0,1,2 --quality_steps=1000 \
                    --name=tt_quality
  tt_train_step_cache  python benchmarks/tt.py --sections=train_step --ranks=32 --step_batches=8
                    --reps=5 --name=tt_train_step_cache
                    --step_variants='cache_rows=2000,cache_warmup=2;cache_rows=10000,cache_warmup=2'
The machine is shared and noisy: compare numbers within one run (ratios), never across runs.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

_ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_ROOT))
sys.path.insert(0, str(_ROOT / "benchmarks"))
import sparse_update  # noqa: E402  (machine_info, write_results)

from recgnn.embeddings import base, tt  # noqa: E402

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

    sizes["synthetic_trained"] = loop.load_task(dlrm_kaggle.get_config()).data.cardinalities
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
  p = 1.0 / np.arange(1, num_rows + 1, dtype=np.float64) ** exponent
  cdf = np.cumsum(p)
  cdf /= cdf[-1]
  ranks = np.minimum(np.searchsorted(cdf, rng.random(shape)), num_rows - 1)
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
    pooled = backend.lookup(state, prepared)[name]
    return backend.update(state, prepared, {name: jax.grad(loss)(pooled, target)})

  return jax.jit(step, donate_argnums=0)


class Runner:
  """One variant, compiled and warmed up; `run(steps)` times `steps` steps (donated state)."""

  def __init__(self, text, spec, batches, warmup):
    backend = base.make_backend(text, spec)
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
      (f"tt r={r} {k}", f"tt(rank={r}, kernel={k})") for r in args.ranks for k in args.kernels
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


def train_step(args) -> dict:
  """Median train-step ms of each config on the same batches, configs interleaved per rep."""
  from recgnn.train import inputs as inputs_lib
  from recgnn.train import loop
  from recgnn.train import step as step_lib

  configs = _step_configs(args)
  task = loop.load_task(next(iter(configs.values())))
  stream = task.train_batches(0)
  batches = [next(stream) for _ in range(args.step_batches)]
  runs = {}
  for name, config in configs.items():
    plan = base.resolve_plan(list(map(tuple, config.embeddings.plan)), task.tables(), log=False)
    feeder = step_lib.Feeder(plan, task.shard_batch)
    tx = step_lib.make_optimizer(config.optimizer)
    state = step_lib.init_state(task, plan, tx, jax.random.key(0), batches[0])
    t0 = time.perf_counter()
    # In stream order through the trainer's driver (capacities grow here).
    stream = [("train", None, x) for x in batches]
    prepared = [item.prepared for item in inputs_lib.prepare_stream(plan, stream)]
    prep_ms = 1e3 * (time.perf_counter() - t0) / len(batches)
    # Exactly the trainer's step: one packed transfer per batch, split over the mesh.
    inputs = [feeder(p, x) for p, x in zip(prepared, batches)]
    shapes = {repr(layout) for _, layout in inputs}
    sh = step_lib.state_sharding(plan, state)
    fn = step_lib.jit_packed(step_lib.make_train_step(task, plan, tx), plan, sh, True, True)
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
  for _ in range(args.reps):
    for r in runs.values():
      state = r["state"]
      t0 = time.perf_counter()
      for p, x in r["inputs"]:
        state, _ = r["fn"](state, p, x)
      jax.block_until_ready(state)
      r["times"].append((time.perf_counter() - t0) / len(r["inputs"]))
      r["state"] = state
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


def quality(args) -> dict:
  """Test AUC of dlrm_kaggle and ttrec_kaggle, same synthetic data and steps, per seed."""
  import tempfile

  from experiments import dlrm_kaggle, ttrec_kaggle
  from recgnn.train import loop

  out = []
  for seed in args.seeds:
    for name, make in [
      ("dlrm_kaggle", dlrm_kaggle.get_config),
      (f"ttrec_kaggle {args.quality_arg}", lambda: ttrec_kaggle.get_config(args.quality_arg)),
    ]:
      c = make()
      c.seed = seed
      c.train.steps = args.quality_steps
      c.train.log_every = max(1, args.quality_steps // 4)
      c.train.checkpoint_every = 0
      if args.data_rows:
        c.data.synthetic.rows = args.data_rows
      with tempfile.TemporaryDirectory() as wd:
        t0 = time.perf_counter()
        m = loop.train(c, wd).metrics
      row = {
        "config": name,
        "seed": seed,
        "steps": args.quality_steps,
        "test_auc": m["test/auc"],
        "valid_auc": m["valid/auc"],
        "test_logloss": m["test/logloss"],
        "oracle_auc": m.get("test/oracle_auc"),
        "seconds": time.perf_counter() - t0,
      }
      out.append(row)
      print(f"  seed {seed} {name}: test AUC {row['test_auc']:.5f}", flush=True)
  summary = {}
  for name in dict.fromkeys(r["config"] for r in out):
    aucs = [r["test_auc"] for r in out if r["config"] == name]
    summary[name] = {"mean_test_auc": float(np.mean(aucs)), "std": float(np.std(aucs))}
  names = list(summary)
  gap = summary[names[1]]["mean_test_auc"] - summary[names[0]]["mean_test_auc"]
  return {
    "runs": out,
    "seeds": list(args.seeds),
    "summary": summary,
    "tt_minus_dense": gap,
    "oracle_auc": out[0]["oracle_auc"],
  }


def quality_md(res: dict) -> str:
  lines = [
    f"### Test AUC, synthetic default data, same steps, seeds {res['seeds']}",
    "",
    "| config | mean test AUC | std | per seed | oracle AUC |",
    "|---|---:|---:|---|---:|",
  ]
  for name, s in res["summary"].items():
    per = ", ".join(f"{r['test_auc']:.4f}" for r in res["runs"] if r["config"] == name)
    lines.append(
      f"| {name} | {s['mean_test_auc']:.5f} | {s['std']:.5f} | {per} | {res['oracle_auc']:.4f} |"
    )
  lines.append(f"\nttrec - dlrm mean test AUC: {res['tt_minus_dense']:+.5f}")
  return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- main


SECTIONS = {
  "compression": (lambda a: compression(a.ranks), compression_md),
  "kernels": (kernels, kernels_md),
  "train_step": (train_step, train_step_md),
  "quality": (quality, quality_md),
}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--sections", default="compression,kernels,train_step,quality")
  p.add_argument("--quick", action="store_true")
  p.add_argument("--ranks", default="8,16,32,64")
  p.add_argument("--kernels", default=",".join(KERNELS))
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
  args = p.parse_args(argv)
  args.ranks = [int(x) for x in args.ranks.split(",")]
  args.kernels = args.kernels.split(",")
  args.orders = args.orders.split(",")
  args.step_variants = [v for v in args.step_variants.split(";") if v]
  args.seeds = [int(x) for x in args.seeds.split(",")]
  if args.quick:
    args.rows, args.batches, args.reps, args.steps = 1_000_000, 4, 3, 5
    args.step_batches, args.seeds, args.quality_steps = 3, [0], 50
  payload = {"machine": sparse_update.machine_info(), "args": vars(args)}
  md = [f"## TT-Rec benchmarks\n\n`{payload['machine']['command']}`\n"]
  for s in args.sections.split(","):
    if s not in SECTIONS:
      raise SystemExit(f"Unknown section {s!r}; available: {', '.join(SECTIONS)}")
    run, to_md = SECTIONS[s]
    print(f"== {s}", flush=True)
    payload[s] = run(args)
    md.append(to_md(payload[s]))
  sparse_update.write_results(args.name, payload, "\n".join(md))


if __name__ == "__main__":
  main()
