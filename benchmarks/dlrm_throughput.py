"""DLRM train-step throughput: recgnn vs TorchRec vs plain PyTorch, on identical batches.

All three train the DLRM reference Kaggle model (26 tables, dim 16, bottom 13-512-256-64-16,
dot interaction, top 367-512-256-1, BCE-with-logits, SGD lr 0.1 for tables and MLPs) on the
same numpy batches (batch 2048, 26 tables x 100k rows, Zipf ids with exponent 1.05):

  recgnn    recgnn.train.step's jitted train step (state donated) over the CTR task's loss
            and recgnn.models.dlrm.DLRM, every table on the `dense` backend with sparse SGD;
            the batch's `prepare` and host->device transfer are done before timing, as the
            trainer's input thread does them off the step's path.
  torchrec  torchrec.models.dlrm.DLRM over a FusedEmbeddingBagCollection (FBGEMM, fused SGD
            in the backward), KeyedJaggedTensors built before timing (benchmarks/peers_dlrm.py).
  pytorch   nn.EmbeddingBag(sum, sparse=True) per table + torch.optim.SGD (the dlrm
            reference's structure), tensors built before timing.

Contestants are timed in round-robin (rep r of each before rep r + 1 of any) so the shared
machine's load hits them alike; reported: median samples/s and recgnn / TorchRec.
`--profile` also times recgnn's pieces (MLPs, interaction, embedding lookups + updates) and
the ideas listed in `IDEAS`, each as its own jitted function on the same batches.

Beside wall time, each contestant's CPU time (user + system, all threads) and minor page
faults per step are reported: on a loaded machine they say what the wall time cannot.

  python benchmarks/dlrm_throughput.py               # 1-3 minutes
  python benchmarks/dlrm_throughput.py --quick       # ~1 minute
  python benchmarks/dlrm_throughput.py --profile     # + where recgnn's step time goes
  --omp-wait-policy passive   torch's idle threads sleep (fairer to torch under heavy load)
  --malloc default            glibc's default malloc (the trainer uses recgnn.hostmem's)
Writes benchmarks/results/dlrm_throughput[_malloc_default][_omp_passive].{json,md}.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

# Runnable as `python benchmarks/dlrm_throughput.py` from a checkout without installing recgnn.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import peers_dlrm  # noqa: E402
import sparse_update  # noqa: E402  (shared timing and results helpers)

from recgnn import hostmem  # noqa: E402
from recgnn.embeddings import base  # noqa: E402
from recgnn.models import dlrm as dlrm_lib  # noqa: E402
from recgnn.tasks import ctr  # noqa: E402
from recgnn.tasks.base import Task  # noqa: E402
from recgnn.train import inputs as inputs_lib  # noqa: E402
from recgnn.train import step as step_lib  # noqa: E402

# XLA:CPU allocates a step's temporaries (44 MiB for this DLRM) with malloc on every
# execution; above glibc's mmap threshold (at most 32 MiB) that is a fresh mmap, so every step
# page-faults the whole buffer in again (~11k minor faults and ~18 ms of kernel time per step,
# measured). With mmap off and trimming off, freed memory is reused and the faults vanish.


def keep_freed_memory() -> str:
  """recgnn.hostmem.keep_freed_memory for this process (torch's tensors included)."""
  if not hostmem.keep_freed_memory():
    raise RuntimeError("mallopt failed; --malloc keep needs glibc")
  return "recgnn.hostmem.keep_freed_memory() (glibc mallopt: no trim, mmap only above 1 GiB)"


# ----------------------------------------------------------------------------- data


def make_batches(cfg: peers_dlrm.DlrmConfig, batch: int, n: int, zipf: float, seed: int):
  """n identical-for-everyone batches: dense N(0,1), Zipf ids per table, Bernoulli labels."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    ids = np.stack([sparse_update.zipf_ids(rng, rows, (batch,), zipf) for rows in cfg.rows], axis=1)
    dense = rng.normal(size=(batch, cfg.num_dense)).astype(np.float32)
    labels = (rng.random(batch) < 0.25).astype(np.float32)
    out.append(peers_dlrm.Batch.of(dense, ids, labels))
  return out


# ----------------------------------------------------------------------------- recgnn


def table_names(cfg: peers_dlrm.DlrmConfig) -> list[str]:
  return [f"C{t + 1}" for t in range(cfg.num_tables)]


class BenchCTR(ctr.CTR):
  """The CTR task's model and loss over tables of given sizes, without opening a dataset."""

  def __init__(self, config: ml_collections.ConfigDict, cfg: peers_dlrm.DlrmConfig):
    Task.__init__(self, config)
    self.data, self.oracle = None, None
    self.names = table_names(cfg)
    self.rows = cfg.rows
    self.model = dlrm_lib.DLRM(bottom=tuple(config.model.bottom), top=tuple(config.model.top))

  def tables(self) -> list[base.TableSpec]:
    e = self.config.embeddings
    opt = base.OptimizerSpec(**e.optimizer.to_dict())
    return [
      base.TableSpec(name=n, num_rows=r, dim=e.dim, optimizer=opt, initializer=e.initializer)
      for n, r in zip(self.names, self.rows)
    ]


def recgnn_config(cfg: peers_dlrm.DlrmConfig) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.model = {"bottom": cfg.bottom, "top": cfg.top}
  c.embeddings = {
    "dim": cfg.dim,
    "initializer": "uniform",
    "optimizer": {"name": "sgd", "learning_rate": cfg.learning_rate},
  }
  c.optimizer = {"name": "sgd", "learning_rate": cfg.learning_rate}
  return c


def to_recgnn_batch(b: peers_dlrm.Batch, names: list[str]) -> dict:
  """The task's batch: dense, label, weight and ids {table: int32[B, 1]} (one-hot bags)."""
  return {
    "dense": b.dense,
    "label": b.labels,
    "weight": np.ones_like(b.labels),
    "ids": {n: b.ids[:, t : t + 1].astype(np.int32) for t, n in enumerate(names)},
  }


class Recgnn:
  """recgnn's side: task, plan, optimizer, and the trainer's own jitted step over the
  trainer's packed, device-resident inputs (what the input thread hands the step)."""

  def __init__(self, cfg: peers_dlrm.DlrmConfig, batches, plan=((".*", "dense"),), seed=0):
    self.cfg = cfg
    self.config = recgnn_config(cfg)
    self.task = BenchCTR(self.config, cfg)
    self.plan = base.resolve_plan(list(plan), self.task.tables(), log=False)
    self.tx = step_lib.make_optimizer(ml_collections.ConfigDict(self.config.optimizer))
    self.host = [to_recgnn_batch(b, self.task.names) for b in batches]
    # What the trainer's input thread does ahead of the step: prepare + one packed transfer.
    feeder = step_lib.Feeder(self.plan, self.task.shard_batch)
    self.prepared = [inputs_lib.prepare_one(self.plan, h, [], train=True) for h in self.host]
    self.packed = [feeder(p, h) for p, h in zip(self.prepared, self.host)]
    # Unpacked device copies, for the pieces profiled alone.
    self.inputs = [
      jax.device_put((p, step_lib.device_batch(h))) for p, h in zip(self.prepared, self.host)
    ]
    self.key = jax.random.key(seed)
    state = self.init_state()
    shardings = step_lib.state_sharding(self.plan, state)
    self.packed_step = step_lib.jit_packed(
      step_lib.make_train_step(self.task, self.plan, self.tx),
      self.plan,
      shardings,
      donate_state=True,
      out_state=True,
    )
    self.train_step = jax.jit(
      step_lib.make_train_step(self.task, self.plan, self.tx), donate_argnums=0
    )

  def init_state(self) -> step_lib.TrainState:
    return step_lib.init_state(self.task, self.plan, self.tx, self.key, self.host[0])

  def runner(self):
    def fn(state, packed):
      return self.packed_step(state, *packed)[0]

    return sparse_update.jitted_runner(fn, self.init_state(), self.packed)

  def loss(self, state) -> float:
    """The loss of batch 0 under `state` (a sanity check that training moves)."""
    prepared, batch = self.inputs[0]
    pooled = step_lib.lookup_all(self.plan, state.emb, prepared)
    return float(self.task.loss(state.params, batch, pooled, state.key)[0])


# ----------------------------------------------------------------------------- profile


def profile_pieces(rec: Recgnn, args) -> dict:
  """Times recgnn's step and its pieces, each jitted alone, on the same device batches.

  Pieces (forward + backward + SGD where they train something):
    full_step       the train step (the trainer's: packed inputs, sliced inside the step)
    unpacked_step   the same step over unpacked, already placed inputs
    dense_part      the DLRM given pooled embeddings: value_and_grad w.r.t. params and
                    embeddings + optax (no lookups or table updates)
    bottom_mlp      13-512-256-64-16 forward + backward + SGD
    interaction     stack + pairwise dots + lower-triangle gather, forward + backward
    top_mlp         367-512-256-1 + BCE, forward + backward + SGD
    embeddings      26 lookups + 26 sparse updates with a fixed gradient
  Ideas (each a full step with one change, same math; see IDEAS):
    one_gather               the 26 tables as one [26 * rows, D] array: one gather, one
                             scatter-add
    interaction=slices       the interaction's lower triangle as static slices + concat
    interaction=take_unique  ... as a flat take with unique, sorted indices
  and `interaction[...]`: those two interactions alone, beside `interaction`.
  """
  cfg = rec.cfg
  names = rec.task.names
  state = rec.init_state()
  params = state.params
  p = params["params"]
  prepared0, batch0 = rec.inputs[0]
  lr = cfg.learning_rate
  bsz = args.batch

  # Every input is an argument: closed-over arrays would be XLA constants and get folded.
  rng = np.random.default_rng(0)
  data = jax.device_put(
    {
      "x_bottom": batch0["dense"],
      "feats": rng.normal(size=(bsz, cfg.num_tables + 1, cfg.dim)).astype(np.float32),
      "z_top": rng.normal(size=(bsz, cfg.interaction_width)).astype(np.float32),
      "label": batch0["label"],
      "w_int": rng.normal(size=(bsz, cfg.interaction_width - cfg.dim)).astype(np.float32),
    }
  )

  def sgd(tree, grads):
    return jax.tree.map(lambda a, g: a - lr * g, tree, grads)

  @jax.jit
  def bottom_mlp(pb, d):
    mlp = dlrm_lib.MLP(cfg.bottom, relu_last=True)
    f = lambda pb: jnp.sum(mlp.apply({"params": pb}, d["x_bottom"]) * d["feats"][:, 0])
    return sgd(pb, jax.grad(f)(pb))

  @jax.jit
  def top_mlp(pt, d):
    def f(pt):
      logits = dlrm_lib.MLP(cfg.top, relu_last=False).apply({"params": pt}, d["z_top"])[:, 0]
      return jnp.mean(optax.sigmoid_binary_cross_entropy(logits, d["label"]))

    return sgd(pt, jax.grad(f)(pt))

  def make_interaction(fn):
    @jax.jit
    def interaction(feats, d):
      f = lambda feats: jnp.sum(fn(feats) * d["w_int"])
      return feats - lr * jax.grad(f)(feats)

    return interaction

  @jax.jit
  def dense_part(state, inputs):
    params, opt_state = state
    batch, pooled = inputs
    (_, _), (g_params, g_emb) = jax.value_and_grad(
      lambda prm, emb: rec.task.loss(prm, batch, emb, rec.key), argnums=(0, 1), has_aux=True
    )(params, pooled)
    updates, opt_state = rec.tx.update(g_params, opt_state, params)
    # g_emb is what the table updates consume; summing keeps it from being dead code.
    return optax.apply_updates(params, updates), opt_state, sum(jnp.sum(g) for g in g_emb.values())

  pooled0 = jax.device_put({n: data["feats"][:, i + 1] for i, n in enumerate(names)})

  g_fixed = jnp.full((bsz, cfg.dim), 1e-4, jnp.float32)

  def embeddings_fn(emb, prepared):
    pooled = step_lib.lookup_all(rec.plan, emb, prepared)
    total = sum(jnp.sum(r) for r in pooled.values())  # keep the lookups alive
    return {
      k: g.update(emb[k], prepared[k], {n: g_fixed + 0 * total for n in g.specs})
      for k, g in rec.plan.groups.items()
    }

  emb_step = jax.jit(embeddings_fn, donate_argnums=0)

  runners = {}
  steps = {}
  runners["full_step"] = rec.runner()
  # The same step over unpacked, already-placed inputs: what the packing (one transfer per
  # batch, sliced apart inside the step by a shard_map) costs or saves.
  runners["unpacked_step"] = sparse_update.jitted_runner(
    lambda s, inp: rec.train_step(s, *inp)[0], rec.init_state(), rec.inputs
  )
  runners["dense_part"] = sparse_update.jitted_runner(
    lambda s, inp: dense_part(s[:2], inp)[:2], (params, rec.tx.init(params)), [(batch0, pooled0)]
  )
  runners["bottom_mlp"] = sparse_update.jitted_runner(bottom_mlp, p["bottom"], [data])
  runners["interaction"] = sparse_update.jitted_runner(
    make_interaction(dlrm_lib.dot_interaction), data["feats"], [data]
  )
  runners["top_mlp"] = sparse_update.jitted_runner(top_mlp, p["top"], [data])
  runners["embeddings"] = sparse_update.jitted_runner(
    lambda s, inp: emb_step(s, inp[0]), state.emb, rec.inputs
  )
  for idea, fn in INTERACTIONS.items():
    runners[f"interaction[{idea}]"] = sparse_update.jitted_runner(
      make_interaction(fn), data["feats"], [data]
    )
  one = OneGather(rec)
  runners["idea:one_gather"] = one.runner()
  for idea, fn in INTERACTIONS.items():
    runners[f"idea:interaction={idea}"] = patched_runner(rec, fn)
  for n in runners:
    steps[n] = args.steps_per_rep
  timing = sparse_update.interleaved_timing(runners, args.warmup, args.reps, steps)
  out = {
    n: {
      "wall_ms": t["step_ms"],
      "cpu_ms": t["cpu_user_ms_per_step"] + t["cpu_system_ms_per_step"],
      "minor_faults": t["minor_faults_per_step"],
    }
    for n, t in timing.items()
  }
  out["one_gather_max_abs_diff_vs_step"] = one.check_against(rec)
  ref = dlrm_lib.dot_interaction(data["feats"])
  for idea, fn in INTERACTIONS.items():
    out[f"interaction={idea}_max_abs_diff"] = float(jnp.max(jnp.abs(fn(data["feats"]) - ref)))
  return out


class OneGather:
  """Idea: all tables as one [T * rows, D] array so a step does one gather and one scatter.

  Same math as recgnn's step (sparse SGD on the touched rows, SGD on the MLPs); the ids of
  table t are offset by t * rows on the host. Measured here only; the real change would be a
  backend (or a plan option) that stacks tables of equal dim.
  """

  def __init__(self, rec: Recgnn):
    self.rec = rec
    cfg = rec.cfg
    offsets = np.concatenate([[0], np.cumsum(cfg.rows)[:-1]]).astype(np.int32)
    self.offsets = offsets
    names = rec.task.names
    self.inputs = [
      jax.device_put(
        (
          np.stack([np.asarray(h["ids"][n])[:, 0] for n in names], axis=1) + offsets,
          step_lib.device_batch(h),
        )
      )
      for h in rec.host
    ]
    task, tx, lr = rec.task, rec.tx, cfg.learning_rate

    def step(state, inputs):
      table, params, opt_state = state
      ids, batch = inputs  # ids: int32[B, T], already offset
      rows = table[ids]  # [B, T, D]

      def loss_fn(params, rows):
        emb = {n: rows[:, i] for i, n in enumerate(names)}
        return task.loss(params, batch, emb, rec.key)

      (_, _), (g_params, g_rows) = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(
        params, rows
      )
      updates, opt_state = tx.update(g_params, opt_state, params)
      params = optax.apply_updates(params, updates)
      table = table.at[ids.reshape(-1)].add(-lr * g_rows.reshape(-1, g_rows.shape[-1]))
      return table, params, opt_state

    self.step = jax.jit(step, donate_argnums=0)

  def init_state(self):
    st = self.rec.init_state()
    table = jnp.concatenate([st.emb["dense"][n]["table"] for n in self.rec.task.names], axis=0)
    return table, st.params, st.opt_state

  def runner(self):
    return sparse_update.jitted_runner(self.step, self.init_state(), self.inputs)

  def check_against(self, rec: Recgnn, steps: int = 3) -> float:
    """Max |table difference| between this and recgnn's step after `steps` steps."""
    st = rec.init_state()
    one = self.init_state()
    for i in range(steps):
      prepared, batch = rec.inputs[i % len(rec.inputs)]
      st = rec.train_step(st, prepared, batch)[0]
      one = self.step(one, self.inputs[i % len(self.inputs)])
    ref = jnp.concatenate([st.emb["dense"][n]["table"] for n in rec.task.names], axis=0)
    return float(jnp.max(jnp.abs(ref - one[0])))


def interaction_slices(features: jax.Array) -> jax.Array:
  """dot_interaction's output with the lower triangle cut as static row slices + a concat.

  features float32[B, F, D] -> float32[B, F (F - 1) / 2], same order (i > j, row-major). The
  backward is pads and adds instead of the scatter-add that a fancy-index gather transposes to.
  """
  f = features.shape[1]
  z = jnp.einsum("bfd,bgd->bfg", features, features)
  return jnp.concatenate([z[:, i, :i] for i in range(1, f)], axis=1)


def interaction_take_unique(features: jax.Array) -> jax.Array:
  """dot_interaction via a flat take that tells XLA the indices are unique and sorted."""
  b, f, _ = features.shape
  z = jnp.einsum("bfd,bgd->bfg", features, features).reshape(b, f * f)
  i, j = np.tril_indices(f, k=-1)
  return jnp.take(z, i * f + j, axis=1, unique_indices=True, indices_are_sorted=True)


INTERACTIONS = {"slices": interaction_slices, "take_unique": interaction_take_unique}


def patched_runner(rec: Recgnn, interaction):
  """recgnn's train step compiled with recgnn.models.dlrm.dot_interaction replaced."""
  state = rec.init_state()
  prepared, batch = rec.inputs[0]
  orig = dlrm_lib.dot_interaction
  dlrm_lib.dot_interaction = interaction
  try:
    # A fresh jit: rec.train_step's trace cache must not serve (or keep) the patched trace.
    fresh = jax.jit(step_lib.make_train_step(rec.task, rec.plan, rec.tx), donate_argnums=0)
    compiled = fresh.lower(state, prepared, batch).compile()
  finally:
    dlrm_lib.dot_interaction = orig

  def fn(state, inputs):
    return compiled(state, *inputs)[0]

  return sparse_update.jitted_runner(fn, state, rec.inputs)


IDEAS = {
  "one_gather": OneGather.__doc__.strip().splitlines()[0],
  "interaction=slices": interaction_slices.__doc__.strip().splitlines()[0],
  "interaction=take_unique": interaction_take_unique.__doc__.strip().splitlines()[0],
}


# ----------------------------------------------------------------------------- main


def markdown(payload: dict) -> str:
  a, m, r = payload["config"], payload["machine"], payload["results"]
  lines = [
    "# DLRM train-step throughput: recgnn vs TorchRec vs PyTorch",
    "",
    f"Batch {a['batch']}, {a['tables']} tables x {a['rows']:,} rows, dim {a['dim']}, bottom "
    f"13-{'-'.join(map(str, a['bottom']))}, top {a['interaction_width']}-"
    f"{'-'.join(map(str, a['top']))}, SGD lr {a['lr']}, Zipf ids (exponent {a['zipf']}), "
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


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--batch", type=int, default=2048)
  p.add_argument("--tables", type=int, default=26)
  p.add_argument("--rows", type=int, default=100_000, help="rows per table")
  p.add_argument("--dim", type=int, default=16)
  p.add_argument("--zipf", type=float, default=1.05, help="Zipf exponent of the ids")
  p.add_argument("--lr", type=float, default=0.1)
  p.add_argument("--num-batches", type=int, default=8, help="distinct batches cycled over")
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--reps", type=int, default=7)
  p.add_argument("--steps-per-rep", type=int, default=5)
  p.add_argument("--peers", default=",".join(peers_dlrm.PEERS), help="'' for recgnn only")
  p.add_argument("--threads", type=int, default=0, help="torch threads (0: all usable CPUs)")
  p.add_argument(
    "--malloc",
    choices=("default", "keep"),
    default="keep",
    help="keep (what recgnn's trainer does): glibc malloc keeps freed memory; default: glibc's",
  )
  p.add_argument(
    "--omp-wait-policy",
    choices=("", "active", "passive"),
    default="",
    help="OMP_WAIT_POLICY for torch's threads ('' = torch's default)",
  )
  p.add_argument("--profile", action="store_true", help="also time recgnn's pieces and ideas")
  p.add_argument("--quick", action="store_true", help="3 reps x 3 steps, 4 batches")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--name", default="", help="results file stem (default from the options)")
  args = p.parse_args(argv)
  if args.quick:
    args.reps, args.steps_per_rep, args.num_batches, args.warmup = 3, 3, 4, 2
  malloc_note = keep_freed_memory() if args.malloc == "keep" else "glibc default"
  if args.omp_wait_policy:
    os.environ["OMP_WAIT_POLICY"] = args.omp_wait_policy.upper()  # before torch loads libgomp
  if not args.name:
    args.name = "dlrm_throughput" + ("_malloc_default" if args.malloc == "default" else "")
    args.name += f"_omp_{args.omp_wait_policy}" if args.omp_wait_policy else ""

  cfg = peers_dlrm.DlrmConfig(
    num_rows=args.rows, num_tables=args.tables, dim=args.dim, learning_rate=args.lr
  )
  batches = make_batches(cfg, args.batch, args.num_batches, args.zipf, args.seed)
  machine = sparse_update.machine_info()

  results: dict[str, dict] = {}
  runners = {}
  rec = Recgnn(cfg, batches, seed=args.seed)
  runners["recgnn"] = rec.runner()

  wanted = [s for s in args.peers.split(",") if s]
  avail = peers_dlrm.available()
  torch_threads = None
  for name in wanted:
    if avail.get(name, "unknown peer") is not None:
      results[name] = {"unavailable": avail.get(name, f"unknown peer {name!r}")}
      print(f"peer {name}: not available ({results[name]['unavailable']})", flush=True)
      continue
    torch_threads = peers_dlrm.set_threads(args.threads or None)
    runners[name] = peers_dlrm.runner(name, cfg, batches, seed=args.seed)

  t0 = time.perf_counter()
  timing = sparse_update.interleaved_timing(runners, args.warmup, args.reps, args.steps_per_rep)
  elapsed = time.perf_counter() - t0
  for name, t in timing.items():
    results[name] = {
      "samples_per_s": 1e3 * args.batch / t["step_ms"],
      **t,
    }
  results["recgnn"]["final_loss"] = rec.loss(runners["recgnn"].box["state"])
  for name in runners:
    if name != "recgnn":
      results[name]["final_loss"] = runners[name](1)
  ratios = {}

  def cpu_ms(x):
    return x["cpu_user_ms_per_step"] + x["cpu_system_ms_per_step"]

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
      "bottom": list(cfg.bottom),
      "top": list(cfg.top),
      "interaction_width": cfg.interaction_width,
    },
    "machine": machine,
    "peer_versions": peers_dlrm.versions(),
    "torch_threads": torch_threads,
    "malloc": malloc_note,
    "recgnn_plan": {n: rec.plan.backend_of(n).describe(n) for n in rec.plan.table_group},
    "timed_seconds": elapsed,
    "load_avg_at_end": os.getloadavg(),
    "results": results,
    "ratios": ratios,
  }
  if args.profile:
    payload["profile"] = profile_pieces(rec, args)
    payload["ideas"] = IDEAS
  write = sparse_update.write_results
  write(args.name, payload, markdown(payload))
  return payload


if __name__ == "__main__":
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
  main()
