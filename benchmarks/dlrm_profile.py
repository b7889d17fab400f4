"""`dlrm_throughput.py --profile`: recgnn's DLRM step taken apart, each piece jitted alone.

Question: where does recgnn's DLRM train step spend its time (the MLPs, the interaction, the
embedding lookups and updates), and would one of the candidate changes in `IDEAS` make it
faster?

  python benchmarks/dlrm_throughput.py --processes=0 --profile   # results/dlrm_throughput*.md

`profile_pieces(rec, args)` takes dlrm_throughput's `Recgnn` (the trainer's own step over
its batches) and times the pieces in round-robin on the same device batches.
"""

from __future__ import annotations

import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax

from recgnn.models import dlrm as dlrm_lib
from recgnn.train import step as step_lib
from recgnn.train import train_state as state_lib


def profile_pieces(rec, args) -> dict:
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
    pooled, res = step_lib.lookup_all(rec.plan, emb, prepared)
    total = sum(jnp.sum(r) for r in pooled.values())  # keep the lookups alive
    return {
      k: g.update(emb[k], prepared[k], res[k], {n: g_fixed + 0 * total for n in g.specs})
      for k, g in rec.plan.groups.items()
    }

  emb_step = jax.jit(embeddings_fn, donate_argnums=0)

  runners = {}
  steps = {}
  runners["full_step"] = rec.runner()
  # The same step over unpacked, already-placed inputs: what the packing (one transfer per
  # batch, sliced apart inside the step by a shard_map) costs or saves.
  runners["unpacked_step"] = harness.jitted_runner(
    lambda s, inp: rec.train_step(s, *inp)[0], rec.init_state(), rec.inputs
  )
  runners["dense_part"] = harness.jitted_runner(
    lambda s, inp: dense_part(s[:2], inp)[:2], (params, rec.tx.init(params)), [(batch0, pooled0)]
  )
  runners["bottom_mlp"] = harness.jitted_runner(bottom_mlp, p["bottom"], [data])
  runners["interaction"] = harness.jitted_runner(
    make_interaction(dlrm_lib.dot_interaction), data["feats"], [data]
  )
  runners["top_mlp"] = harness.jitted_runner(top_mlp, p["top"], [data])
  runners["embeddings"] = harness.jitted_runner(
    lambda s, inp: emb_step(s, inp[0]), state.emb, rec.inputs
  )
  for idea, fn in INTERACTIONS.items():
    runners[f"interaction[{idea}]"] = harness.jitted_runner(
      make_interaction(fn), data["feats"], [data]
    )
  one = OneGather(rec)
  runners["idea:one_gather"] = one.runner()
  for idea, fn in INTERACTIONS.items():
    runners[f"idea:interaction={idea}"] = patched_runner(rec, fn)
  for n in runners:
    steps[n] = args.steps_per_rep
  timing = harness.interleaved_timing(runners, args.warmup, args.reps, steps)
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

  def __init__(self, rec):
    self.rec = rec
    cfg = rec.cfg
    offsets = np.concatenate([[0], np.cumsum(cfg.rows)[:-1]]).astype(np.int32)
    self.offsets = offsets
    names = rec.task.names
    self.inputs = [
      jax.device_put(
        (
          np.stack([np.asarray(h["ids"][n])[:, 0] for n in names], axis=1) + offsets,
          state_lib.device_batch(h),
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
    return _one_table(st, self.rec.task.names), st.params, st.opt_state

  def runner(self):
    return harness.jitted_runner(self.step, self.init_state(), self.inputs)

  def check_against(self, rec, steps: int = 3) -> float:
    """Max |table difference| between this and recgnn's step after `steps` steps."""
    st = rec.init_state()
    one = self.init_state()
    for i in range(steps):
      prepared, batch = rec.inputs[i % len(rec.inputs)]
      st = rec.train_step(st, prepared, batch)[0]
      one = self.step(one, self.inputs[i % len(self.inputs)])
    ref = _one_table(st, rec.task.names)
    return float(jnp.max(jnp.abs(ref - one[0])))


def _one_table(st, names) -> jax.Array:
  """The dense group's tables as one array, each at its aligned offset: the fused group's own
  array (recgnn/backends/dense_fused.py), or one array per table concatenated."""
  group = st.emb["dense"]
  if "table" in group:
    return group["table"]
  return jnp.concatenate([group[n]["table"] for n in names], axis=0)


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


def patched_runner(rec, interaction):
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

  return harness.jitted_runner(fn, state, rec.inputs)


IDEAS = {
  "one_gather": OneGather.__doc__.strip().splitlines()[0],
  "interaction=slices": interaction_slices.__doc__.strip().splitlines()[0],
  "interaction=take_unique": interaction_take_unique.__doc__.strip().splitlines()[0],
}
