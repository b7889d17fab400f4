"""The step's part that is not an embedding backend's, timed alone (`model_step_seconds`):
what `recgnn.planner.auto` adds each table's own step to, and keeps in its cost cache."""

from __future__ import annotations

import time

import jax
import numpy as np
import optax

from recgnn import sharding
from recgnn.train.task import Task
from recgnn.train.train_state import device_batch


def model_step_seconds(
  task: Task, tx, mesh, batches: list[dict], dims: dict[str, int], repeats: int = 3
) -> float:
  """Median seconds of the step's part that is not an embedding backend's: the task's loss
  and its gradient w.r.t. the dense params and the pooled lookups, and the optax update (what
  every plan of the same task shares; `recgnn.planner.auto` adds each table's own
  step to it). Pooled lookups stand in as arrays of the real shapes ({table: f32[B, dim]}),
  the batch split over the mesh as the trainer splits it; timed on `repeats` passes over
  `batches` (task batches), after one that compiled, the median of every timed step (one
  pass of a few batches moved with the load of the moment; the planner also keeps the figure
  in its cost cache: `auto.cached_model_seconds`)."""
  if not batches:
    raise ValueError("model_step_seconds needs at least one batch")
  rng = np.random.default_rng(0)

  def pooled_of(batch):
    n = {t: np.shape(ids)[0] for t, ids in batch["ids"].items()}
    return {t: rng.normal(0, 0.01, (n[t], d)).astype(np.float32) for t, d in dims.items()}

  repl = jax.sharding.NamedSharding(mesh, sharding.REPLICATED)
  split = jax.sharding.NamedSharding(mesh, sharding.BATCH_SPEC)
  first = device_batch(batches[0])
  params = task.init_params(jax.random.key(0), first, pooled_of(batches[0]))
  params = sharding.put(jax.device_get(params), repl)
  opt_state = sharding.put(jax.device_get(tx.init(params)), repl)

  @jax.jit
  def step(params, opt_state, pooled, batch, key):
    def loss_fn(params, pooled):
      return task.loss(params, batch, pooled, key)

    (loss, _), (g_params, g_pooled) = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(
      params, pooled
    )
    updates, opt_state = tx.update(g_params, opt_state, params)
    # g_pooled returned: the backends consume it, so XLA must compute it here too.
    return optax.apply_updates(params, updates), opt_state, g_pooled, loss

  placed = []
  for b in batches:
    rest = device_batch(b)
    specs = task.batch_spec(rest)
    rest = jax.tree.map(
      lambda x, s: sharding.put(np.asarray(x), jax.sharding.NamedSharding(mesh, s)),
      rest,
      specs,
      is_leaf=lambda x: isinstance(x, np.ndarray),
    )
    pooled = {t: sharding.put(v, split) for t, v in pooled_of(b).items()}
    placed.append((rest, pooled))
  key = jax.random.key(1)
  times = []
  for timed in (False, *[True] * max(repeats, 1)):
    for rest, pooled in placed:
      t0 = time.perf_counter()
      params, opt_state, g, loss = step(params, opt_state, pooled, rest, key)
      jax.block_until_ready((params, g))
      if timed:
        times.append(time.perf_counter() - t0)
  return float(np.median(times))
