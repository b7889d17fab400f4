"""Pure train and eval steps over a Task and its tables' backends.

One step:  rows = backend.lookup(emb, prepared)              per table, float32[B, L, D]
           loss, (g_params, g_rows) = value_and_grad(task.loss after pooling)(params, rows)
           params <- optax;  emb <- backend.update(emb, prepared, g_rows)   (sparse, donated)
Embedding tables never go through optax: their gradient w.r.t. the looked-up rows is all a
backend needs, so no table-sized cotangent is ever built.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from recgnn.embeddings import base
from recgnn.tasks.base import Task

PyTree = Any


@flax.struct.dataclass
class TrainState:
  """Everything a step reads and writes; donated to the step, saved in checkpoints."""

  step: jax.Array  # int32[]
  params: PyTree  # the task's dense params
  opt_state: PyTree  # optax state of `params`
  emb: dict[str, PyTree]  # each table's backend state
  key: jax.Array  # base PRNG key; step keys are fold_in(key, step)


def make_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """optax optimizer for the dense params from config.optimizer (name, learning_rate, ...)."""
  name = config.name
  lr = config.learning_rate
  if config.get("warmup_steps", 0):
    lr = optax.linear_schedule(0.0, lr, config.warmup_steps)
  makers = {
    "sgd": lambda: optax.sgd(lr),
    "adagrad": lambda: optax.adagrad(lr, initial_accumulator_value=0.0, eps=1e-8),
    "adam": lambda: optax.adam(lr),
    "adamw": lambda: optax.adamw(lr, weight_decay=config.get("weight_decay", 0.0)),
  }
  if name not in makers:
    raise ValueError(f"Unknown optimizer {name!r}; available: {', '.join(sorted(makers))}")
  tx = makers[name]()
  if config.get("weight_decay", 0.0) and name != "adamw":
    tx = optax.chain(optax.add_decayed_weights(config.weight_decay), tx)
  return tx


def pooled(
  backends: Mapping[str, base.Backend], rows: dict[str, jax.Array], batch
) -> dict[str, jax.Array]:
  """Per table: rows float32[B, L, D] -> float32[B, D] with the table's pooling."""
  return {n: base.pool(rows[n], batch["ids"][n], b.spec.pooling) for n, b in backends.items()}


def lookup_all(backends, emb, prepared) -> dict[str, jax.Array]:
  return {n: b.lookup(emb[n], prepared[n]) for n, b in backends.items()}


def make_train_step(task: Task, backends: Mapping[str, base.Backend], tx):
  """(state, prepared, batch) -> (state, metrics). Jit it with the state donated."""

  def step(state: TrainState, prepared, batch):
    key = jax.random.fold_in(state.key, state.step)
    rows = lookup_all(backends, state.emb, prepared)

    def loss_fn(params, rows):
      return task.loss(params, batch, pooled(backends, rows, batch), key)

    (loss, aux), (g_params, g_rows) = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(
      state.params, rows
    )
    updates, opt_state = tx.update(g_params, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    emb = {n: b.update(state.emb[n], prepared[n], g_rows[n]) for n, b in backends.items()}
    new = state.replace(step=state.step + 1, params=params, opt_state=opt_state, emb=emb)
    return new, {"loss": loss, **aux}

  return step


def make_eval_step(task: Task, backends: Mapping[str, base.Backend]):
  """(state, prepared, batch) -> the task's predict outputs."""

  def step(state: TrainState, prepared, batch):
    rows = lookup_all(backends, state.emb, prepared)
    return task.predict(state.params, batch, pooled(backends, rows, batch))

  return step


def jit_train_step(task, backends, tx):
  """The train step jitted over unpacked inputs (benchmarks; the trainer uses jit_packed)."""
  return jax.jit(make_train_step(task, backends, tx), donate_argnums=0)


# A batch and its prepared ids are ~100 small arrays; one device_put each costs more than the
# step itself on CPU (measured: 25 ms for a 26-table Criteo batch). So the input thread packs
# them into one flat buffer per dtype and the jitted step slices them apart (free in XLA).


def pack(tree) -> tuple[list[np.ndarray], tuple]:
  """A pytree of numpy arrays -> (one flat buffer per dtype, static layout for `unpack`)."""
  leaves, treedef = jax.tree.flatten(tree)
  dtypes = sorted({np.dtype(x.dtype).str for x in leaves})
  parts: dict[str, list] = {d: [] for d in dtypes}
  offsets = dict.fromkeys(dtypes, 0)
  where = []
  for x in leaves:
    x = np.asarray(x)
    d = x.dtype.str
    where.append((dtypes.index(d), offsets[d], x.shape))
    parts[d].append(x.reshape(-1))
    offsets[d] += x.size
  buffers = [np.concatenate(parts[d]) if parts[d] else np.zeros(0, d) for d in dtypes]
  return buffers, (treedef, tuple(where))


def unpack(buffers, layout):
  """Inverse of `pack`, inside jit: static slices of the buffers."""
  treedef, where = layout
  leaves = [
    jax.lax.slice(buffers[i], (off,), (off + int(np.prod(shape)),)).reshape(shape)
    for i, off, shape in where
  ]
  return jax.tree.unflatten(treedef, leaves)


def jit_packed(step_fn, donate_state: bool):
  """step_fn(state, prepared, batch) -> jitted f(state, buffers, layout) over `pack` output."""

  def packed(state, buffers, layout):
    prepared, batch = unpack(buffers, layout)
    return step_fn(state, prepared, batch)

  return jax.jit(packed, static_argnums=2, donate_argnums=0 if donate_state else ())


def init_state(
  task: Task,
  backends: Mapping[str, base.Backend],
  tx,
  key: jax.Array,
  example_batch,
  mesh=None,
) -> TrainState:
  """Allocate every table (placement decided by its backend) and the dense params."""
  k_emb, k_params, k_run = jax.random.split(key, 3)
  emb = {n: b.init(jax.random.fold_in(k_emb, i), mesh) for i, (n, b) in enumerate(backends.items())}
  zeros = {
    n: jnp.zeros(example_batch["ids"][n].shape[:1] + (b.spec.dim,), jnp.float32)
    for n, b in backends.items()
  }
  params = task.init_params(k_params, example_batch, zeros)
  return TrainState(
    step=jnp.zeros((), jnp.int32),
    params=params,
    opt_state=tx.init(params),
    emb=emb,
    key=k_run,
  )
