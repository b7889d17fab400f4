"""Pure train and eval steps over a Task and its embedding plan, on a device mesh.

One step:  pooled, res = group.lookup(emb, prepared)       per group: {table: f32[B, D]}
           loss, (g_params, g_pooled) = value_and_grad(task.loss)(params, pooled)
           params <- optax;  emb <- group.update(emb, prepared, res, g_pooled)   (sparse, donated)
Embedding tables never go through optax: their gradient w.r.t. the pooled lookups is all a
backend needs, so no table-sized cotangent is ever built.

On a (DATA, MODEL) mesh the batch is split over every device (B / n examples each, when the
plan's `Layout.split_batch`), the dense params and their optimizer state are replicated (XLA
all-reduces their gradients), and each group places its tables as its `state_sharding` says.
Steps are jitted with explicit in / out shardings and the state donated.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from recgnn import planner, sharding
from recgnn.embeddings import base, microbatch
from recgnn.train import host_handoff, inputs
from recgnn.train.task import Task
from recgnn.train.train_state import TrainState

PyTree = Any


def lookup_all(plan: planner.Plan, emb, prepared) -> tuple[dict[str, jax.Array], dict[str, Any]]:
  """-> ({table: f32[B, D]} pooled embeddings of every group, {group key: its residuals})."""
  out, residuals = {}, {}
  for key, group in plan.groups.items():
    pooled, residuals[key] = group.lookup(emb[key], prepared[key])
    out.update(pooled)
  return out, residuals


def splitting_group(plan: planner.Plan) -> str | None:
  """The key of the group that declares micro-batches (`Capabilities.splits_batch`,
  recgnn.embeddings.microbatch), if any, and if the batches are split per example (a
  replicated batch, e.g. one subgraph, runs whole)."""
  keys = [k for k, g in plan.groups.items() if g.capabilities.splits_batch]
  if len(keys) > 1:
    raise ValueError(
      f"Embedding groups {keys} each split batches into micro-batches; a batch has one split. "
      "Give those tables one plan rule (one backend string), e.g. ('C(3|4|10)', "
      "'hot_cold(budget=0.05)'), or set split=False on all but one."
    )
  return keys[0] if keys and plan.layout.split_batch else None


def _per_example(task: Task, batch) -> bool:
  """Whether every leaf of the (device) batch is batch-major, so a micro-batch can take its
  examples' rows; a task whose batches carry replicated leaves (`Task.batch_spec`, e.g. a
  subgraph's edges) runs its batches whole."""
  spec_of = getattr(task, "batch_spec", None)
  if spec_of is None:
    return True
  specs = jax.tree.leaves(spec_of(batch), is_leaf=lambda x: isinstance(x, sharding.P))
  return all(s == sharding.BATCH_SPEC for s in specs)


def _micro_loss_and_grads(task, plan, skey, idxs, state, prepared, batch, key):
  """The loss and its gradients over micro-batches (the split `plan.groups[skey]` declares),
  run in its order: pooled rows of micro-batch m from the splitting group's `lookup_micro`
  and, for the other groups, their whole-batch lookup's rows of those examples. Returns the
  groups' residuals too, for their updates.

  The Task contract's loss is a weighted mean over examples, so with W_m the weight of
  micro-batch m (its examples' batch["weight"], or its example count) and W = sum W_m, the
  batch's loss is sum_m (W_m / W) loss_m: the same value and gradients as the whole batch up to
  float summation order. d loss / d pooled is put back in batch order, so every group applies
  ONE update for the whole batch.
  """
  mesh = plan.mesh
  whole, residuals = {}, {}
  for k, g in plan.groups.items():
    if k != skey:
      pooled, residuals[k] = g.lookup(state.emb[k], prepared[k])
      whole.update(pooled)
  micro, residuals[skey] = plan.groups[skey].lookup_micro(state.emb[skey], prepared[skey])
  size = jax.tree.leaves(batch)[0].shape[0]
  b = size // mesh.size

  def loss_fn(params, pooled, batch_m):
    return task.loss(params, batch_m, pooled, key)

  pieces = []
  for m, idx in enumerate(idxs):
    pooled = dict(micro[m])
    pooled.update({t: microbatch.take(mesh, True, x, idx) for t, x in whole.items()})
    batch_m = jax.tree.map(lambda x, idx=idx: microbatch.take(mesh, True, x, idx), batch)
    if "weight" in batch_m:
      w = jnp.sum(batch_m["weight"].astype(jnp.float32))
    else:
      w = jnp.sum((idx < b).astype(jnp.float32))
    (loss, aux), grads = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(
      state.params, pooled, batch_m
    )
    pieces.append((w, loss, aux, grads))
  total = sum(w for w, *_ in pieces)
  # A task loss divides by max(W_m, 1) (no NaN on an all-padding piece): undo that exactly.
  scale = [jnp.maximum(w, 1.0) / jnp.maximum(total, 1.0) for w, *_ in pieces]
  loss = sum(c * p[1] for c, p in zip(scale, pieces))
  aux = jax.tree.map(lambda *a: sum(c * x for c, x in zip(scale, a)), *[p[2] for p in pieces])
  g_params = jax.tree.map(
    lambda *g: sum(c * x for c, x in zip(scale, g)), *[p[3][0] for p in pieces]
  )
  g_pooled = {
    t: microbatch.merge(mesh, True, size, idxs, [c * p[3][1][t] for c, p in zip(scale, pieces)])
    for t in pieces[0][3][1]
  }
  return loss, aux, g_params, g_pooled, residuals


def make_train_step(task: Task, plan: planner.Plan, tx):
  """(state, prepared, batch) -> (state, metrics, to_host). Jit it with the state donated;
  hand to_host ({group key: its update's TO_HOST output}; empty without a host tier) to
  `host_handoff.hand_to_host` after each call (`jit_packed`'s step does).

  A group that declares micro-batches (`hot_cold`: popular / non-popular examples) has the
  loss run per micro-batch, in its order, with one embedding update for the whole batch
  (`_micro_loss_and_grads`; recgnn.embeddings.microbatch says how a backend declares one).
  """
  skey = splitting_group(plan)
  if skey is not None and not task.loss_is_per_example_mean:
    raise ValueError(
      f"{type(task).__name__}'s loss is not a per-example mean (loss_is_per_example_mean), so "
      f"group {skey!r}'s micro-batches cannot be recombined into it: use hot_cold(split=False)"
    )

  def step(state: TrainState, prepared, batch):
    key = jax.random.fold_in(state.key, state.step)
    idxs = plan.groups[skey].micro_batches(prepared[skey]) if skey is not None else None
    if idxs and _per_example(task, batch):
      loss, aux, g_params, g_pooled, residuals = _micro_loss_and_grads(
        task, plan, skey, idxs, state, prepared, batch, key
      )
    else:
      pooled, residuals = lookup_all(plan, state.emb, prepared)

      def loss_fn(params, pooled):
        return task.loss(params, batch, pooled, key)

      (loss, aux), (g_params, g_pooled) = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(
        state.params, pooled
      )
    updates, opt_state = tx.update(g_params, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    emb, to_host = {}, {}
    for key, group in plan.groups.items():
      new_emb = group.update(
        state.emb[key], prepared[key], residuals[key], {t: g_pooled[t] for t in group.specs}
      )
      emb[key], out = base.split_to_host(new_emb)
      if out is not None:  # a host tier's rows: an output of the step, not state
        to_host[key] = out
    new = state.replace(step=state.step + 1, params=params, opt_state=opt_state, emb=emb)
    return new, {"loss": loss, **aux}, to_host

  return step


def make_eval_step(task: Task, plan: planner.Plan):
  """(state, prepared, batch) -> the task's predict outputs."""

  def step(state: TrainState, prepared, batch):
    # The residuals are dropped: XLA computes nothing that only an update would read.
    return task.predict(state.params, batch, lookup_all(plan, state.emb, prepared)[0])

  return step


def jit_packed(
  step_fn,
  plan: planner.Plan,
  state_shardings,
  donate_state: bool,
  out_state: bool,
  name: str = "packed",
  step_inputs: PyTree | None = None,
  stacked: int = 1,
  inputs_of: Callable[[], PyTree] | None = None,
):
  """step_fn(state, prepared, batch) -> jitted f(state, buffers, layout) over `inputs.pack`
  output, with explicit in / out shardings (state as `state_shardings`, buffers split over
  the mesh, metrics / predictions replicated). `name` names the XLA module (`jit_NAME`), so a
  profiler trace or an HLO dump tells the train step from the eval step.

  step_inputs: device arrays (placed: `setup.place_inputs`) that every call reads besides its batch
  (`Task.step_inputs`, e.g. the graph each device samples from): step_fn is then
  step_fn(state, prepared, batch, step_inputs), and they are the jitted function's last
  argument, bound here (f keeps the signature above). An argument, not a closure: a
  closed-over array would be a constant of the program, the whole graph in its HLO.
  inputs_of: step inputs that change between calls (the device feed's pass orders): each
  call reads inputs_of(), of `step_inputs`' structure, shapes and shardings.

  stacked: k > 1 train steps per call over k batches (`Feeder.pack_call`: buffers [k,
  devices, n], one layout, no host leaves): one `lax.scan` of step_fn over them, the state carried,
  metrics stacked ([k] per key), and a host tier's rows for the host too ([k, ...] per leaf,
  handed over once per call: `host_handoff.HandsToHost(steps=k)`). Each iteration is the
  one-step program's body on batch i, so k calls of one step and one call of k end
  bit-identical (tests/test_steps_per_call.py)."""
  mesh = plan.mesh
  spec = inputs.STACKED_SPEC if stacked > 1 else sharding.BATCH_SPEC
  buf = jax.sharding.NamedSharding(mesh, spec)
  repl = jax.sharding.NamedSharding(mesh, sharding.REPLICATED)

  # A train step of a plan with a host tier returns the rows the host takes back as a third
  # output (`make_train_step`), handed to the writers by `host_handoff.HandsToHost`.
  hands = out_state and any(g.capabilities.writes_host for g in plan.groups.values())

  def packed(state, buffers, layout, *extra):
    if stacked > 1:
      bufs, host = buffers

      def body(state, bufs_i):
        prepared, batch = inputs.unpack((bufs_i, host), layout, mesh)
        new, metrics, *to_host = step_fn(state, prepared, batch, *extra)
        return new, (metrics, to_host[0] if to_host else {})

      state, (metrics, to_host) = _scan(body, state, bufs)
      return (state, metrics, to_host) if hands else (state, metrics)
    prepared, batch = inputs.unpack(buffers, layout, mesh)
    out = step_fn(state, prepared, batch, *extra)
    if not out_state:
      return out
    new, metrics, *to_host = out  # (a task's own train step may have no host tier's output)
    return (new, metrics, to_host[0] if to_host else {}) if hands else (new, metrics)

  packed.__name__ = packed.__qualname__ = name
  # (the host tiers' rows replicated: every device holds the same cache / cold rows)
  out = ((state_shardings, repl, repl) if hands else (state_shardings, repl)) if out_state else repl
  # (the packed buffers split over the mesh; the host leaves in pinned host memory)
  in_shardings = (state_shardings, (buf, sharding.named(mesh, sharding.HOST_SPEC)))
  if step_inputs is not None:  # as placed (`setup.place_inputs`)
    in_shardings += (jax.tree.map(lambda x: x.sharding, step_inputs),)
  jitted = jax.jit(
    packed,
    static_argnums=2,
    donate_argnums=0 if donate_state else (),
    in_shardings=in_shardings,
    out_shardings=out,
  )
  # Simulated CPU devices: one step in flight at a time (XLA:CPU deadlocks otherwise; see
  # sharding.OneInFlight). Elsewhere the jitted function itself: no Python frame per call.
  one = sharding.OneInFlight(jitted, mesh) if sharding.needs_one_in_flight(mesh) else jitted
  if step_inputs is not None:
    one = _BoundInputs(one, inputs_of or (lambda: step_inputs))
  return host_handoff.HandsToHost(one, plan, stacked) if hands else one


def _scan(body, state, bufs):
  """lax.scan of body(state, bufs[i]) -> (state, out) over axis 0 of `bufs`: (the last
  state, every out stacked). A step that changes the state's shapes (a host tier's ring of
  recent write-backs is [0, ...] until its first train step sizes it) runs first, outside
  the scan: a scan carries one shape. The same steps either way, in the same order. (Told
  by an abstract trace of the body, nothing computed: any backend's state that a step
  resizes, with no backend named here.)"""
  first = jax.tree.map(lambda b: b[0], bufs)
  spec = lambda t: jax.tree.map(lambda x: (x.shape, x.dtype), t)  # noqa: E731
  if spec(jax.eval_shape(body, state, first)[0]) == spec(state):
    return jax.lax.scan(body, state, bufs)
  state, out = body(state, first)
  state, outs = jax.lax.scan(body, state, jax.tree.map(lambda b: b[1:], bufs))
  return state, jax.tree.map(lambda a, b: jnp.concatenate([a[None], b]), out, outs)


class _BoundInputs:
  """A `jit_packed` step with its step inputs bound as the last argument: called (and
  lowered) as f(state, buffers, layout), like a step without them. inputs_of() gives them
  at each call."""

  def __init__(self, fn, inputs_of: Callable[[], PyTree]):
    self._fn, self._inputs_of = fn, inputs_of

  @property
  def step_inputs(self) -> PyTree:
    return self._inputs_of()

  def __call__(self, state, buffers, layout):
    return self._fn(state, buffers, layout, self._inputs_of())

  def lower(self, state, buffers, layout):
    return self._fn.lower(state, buffers, layout, self._inputs_of())
