"""A run's state and how it starts: `TrainState` (what a step reads and writes, donated to
the step, saved in checkpoints), the dense params' optax optimizer, the state's shardings,
and `init_state` (every table placed by its group, the dense params replicated).
"""

from __future__ import annotations

import functools
from typing import Any

import flax.struct
import jax
import ml_collections
import numpy as np
import optax

from recgnn import planner, sharding
from recgnn.train.task import Task

PyTree = Any


def device_batch(batch: dict) -> dict:
  """What of a task batch goes to the device: everything but the raw ids (the backends'
  prepared arrays carry what the step needs of them)."""
  return {k: v for k, v in batch.items() if k != "ids"}


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


def state_sharding(plan: planner.Plan, abstract_state: TrainState) -> TrainState:
  """NamedShardings of a TrainState: the groups' for `emb`, replicated for the rest."""
  repl = jax.sharding.NamedSharding(plan.mesh, sharding.REPLICATED)
  out = jax.tree.map(lambda _: repl, abstract_state)
  return out.replace(emb={k: g.state_sharding() for k, g in plan.groups.items()})


@functools.partial(jax.jit, static_argnums=0)
def _shared_init(fn, key, batch, embeddings):
  """fn(key, batch, embeddings) for a task's hashable `Task.init_fn`: one jitted function, so
  jax's cache (keyed by fn's hash and equality, and the arguments' shapes) hands a later
  build with an equal fn the program an earlier one compiled, with no trace, lowering or
  cache read, which every build would otherwise pay (docs/running.md)."""
  return fn(key, batch, embeddings)


def init_state(
  task: Task,
  plan: planner.Plan,
  tx,
  key: jax.Array,
  example_batch,
) -> TrainState:
  """Allocate every table (placed by its group) and the dense params (replicated)."""
  k_emb, k_params, k_run = jax.random.split(key, 3)
  emb = {k: g.init(k_emb) for k, g in plan.groups.items()}
  specs = plan.specs
  zeros = {  # (numpy: jnp.zeros compiled a program per shape; these only enter the jit below)
    n: np.zeros(example_batch["ids"][n].shape[:1] + (s.dim,), np.float32) for n, s in specs.items()
  }
  # Jitted: run eagerly, flax's init dispatches op by op, slower than compiling it
  # (docs/running.md); the values are the same either way.
  fn = task.init_fn()
  init = jax.jit(task.init_params) if fn is None else functools.partial(_shared_init, fn)
  params = init(k_params, device_batch(example_batch), zeros)
  repl = jax.sharding.NamedSharding(plan.mesh, sharding.REPLICATED)
  # sharding.put: with many processes each places its own devices' copies.
  params = sharding.put(jax.device_get(params), repl)
  return TrainState(
    step=sharding.put(np.zeros((), np.int32), repl),
    params=params,
    opt_state=sharding.put(jax.device_get(tx.init(params)), repl),
    emb=emb,
    key=jax.random.wrap_key_data(sharding.put(jax.random.key_data(k_run), repl)),
  )
