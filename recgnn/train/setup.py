"""One setup for every run: `build(config) -> Run`, used by the trainer, the tests and the
benchmarks, so none of them rebuilds the chain by hand.

  mesh -> task (its mesh, config and process slice given at construction) -> input layout
  (`Task.input_layout`: batch split, process-local input) -> plan (`planner.resolve_plan`, every
  backend given the mesh and layout) -> memory check -> Feeder -> optax -> initial state
  (tables placed by their groups, dense params replicated) -> state shardings -> the jitted
  packed train / eval steps (explicit in / out shardings, the train state donated).

What happens after (checkpoints, resume, the input thread, evals, logging) is the loop's
(`recgnn.train.loop`).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import itertools
import pkgutil
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import ml_collections
import numpy as np
import optax
from jax.experimental import multihost_utils

from recgnn import distributed, planner, sharding
from recgnn.embeddings import base
from recgnn.planner import auto as auto_lib
from recgnn.train import device_feed, inputs
from recgnn.train import feeder as feeder_lib
from recgnn.train import step as step_lib
from recgnn.train import train_state as state_lib
from recgnn.train.plan_figures import plan_figures
from recgnn.train.task import Task

#: Where tasks live: `config.task` names a module of this package whose TASK is the task's
#: class. The trainer finds a task by that name only (tasks import the trainer's contract,
#: `recgnn.train.task`, so the trainer never imports them: docs/architecture.md, "Layers").
TASKS_PACKAGE = "recgnn.tasks"


def available_tasks() -> list[str]:
  """The modules of `TASKS_PACKAGE` (a task's name is its module's), found without importing
  any of them."""
  spec = importlib.util.find_spec(TASKS_PACKAGE)
  return sorted(m.name for m in pkgutil.iter_modules(spec.submodule_search_locations))


def config_mesh(config: ml_collections.ConfigDict) -> jax.sharding.Mesh:
  """The trainer's mesh for `config` (its `mesh` section; every device when absent)."""
  return sharding.mesh_from_config(config.get("mesh", {}))


def load_task(config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh) -> Task:
  """Instantiate `recgnn.tasks.<config.task>.TASK(config, mesh)` on the trainer's mesh."""
  names = available_tasks()
  if config.task not in names:
    raise ValueError(f"Unknown task {config.task!r}; available: {', '.join(names)}")
  module = importlib.import_module(f"{TASKS_PACKAGE}.{config.task}")
  return module.TASK(config, mesh)


parse_bytes = planner.parse_bytes  # '512M', '2G', '1.5GiB', '1000000' -> bytes
# ...and 'plan+10%': the plan's own bytes plus a margin (planner.RelativeBudget)
parse_budget = planner.parse_budget


def _train_ids_shapes(plan: planner.Plan, task: Task, example: dict):
  """A train batch's ids shapes ({table: shape}) when a group holds buffers sized by the
  batch (`Backend.batch_memory`, asked with the `example` batch's shapes first): one batch
  read, for the budget and for the groups to make those buffers at their size
  (`Backend.expect_batches`); else None (nothing to add)."""
  probe = {t: tuple(np.shape(x)) for t, x in example["ids"].items()}
  if not planner.batch_bytes(plan, probe):
    return None
  return auto_lib.ids_shapes([next(task.train_batches(0))["ids"]])


def training_length(tcfg, task: Task) -> tuple[int, str]:
  """Steps to train and how they were derived: `train.steps` when set (> 0), else
  `train.epochs` x the task's steps per epoch."""
  steps = int(tcfg.get("steps", 0) or 0)
  per_epoch = task.steps_per_epoch()
  if steps > 0:
    epochs = f" = {steps / per_epoch:,.3f} epoch(s) of {per_epoch:,} steps" if per_epoch else ""
    return steps, f"{steps:,} steps (train.steps){epochs}"
  epochs = float(tcfg.get("epochs", 0) or 0)
  if epochs <= 0:
    raise ValueError("Set train.epochs (> 0) or train.steps (> 0)")
  if per_epoch == 0:
    raise ValueError(
      f"{type(task).__name__}: its train split holds less than one batch, so an epoch has no "
      "steps; lower train.batch_size (and set train.steps)"
    )
  if per_epoch is None:
    raise ValueError(
      f"{type(task).__name__} does not know its train split's size; set train.steps instead "
      "of train.epochs"
    )
  steps = max(1, round(epochs * per_epoch))
  return steps, f"{steps:,} steps = {epochs:g} epoch(s) x {per_epoch:,} steps (train.epochs)"


def _quiet(msg: str) -> None:
  del msg


@dataclasses.dataclass(frozen=True)
class Run:
  """A built run: everything between the config and the first step, set once by `build`.
  `state` is the initial state (shapes only when built with allocate=False), which the first
  `train_step` donates: take it once, or call `init_state()` for a fresh one. The loop takes
  it and keeps a copy of the run without it (`state=None`), so the initial tables are not
  held for the whole run."""

  config: ml_collections.ConfigDict
  mesh: jax.sharding.Mesh
  task: Task
  layout: base.Layout
  input_how: str  # which input layout and why (a log line)
  plan: planner.Plan
  feeder: feeder_lib.Feeder
  tx: optax.GradientTransformation
  example: dict  # the batch the dense params are initialised from
  key: jax.Array  # the PRNG key of the initial state
  state: state_lib.TrainState | None
  shardings: state_lib.TrainState  # a NamedSharding per leaf of `state`
  step_inputs: dict | None  # the task's step inputs on the devices (placed once), or None
  train_step: Callable  # (state, buffers, layout) -> (state, metrics); state donated
  eval_step: Callable  # (state, buffers, layout) -> the task's predict outputs
  total_steps: int
  length: str  # how total_steps was derived (a log line)
  auto_plan: auto_lib.PlanChoice | None = None  # what an auto(...) rule chose, and why
  # The planner's figures of the plan (auto's choice, or with plan_report the plan as written):
  # per table bytes and measured step, the predicted train step.
  prediction: auto_lib.PlanChoice | None = None
  # The training data on the devices (train.feed), or None: the host feed.
  device_feed: device_feed.DeviceFeed | None = None
  feed_how: str = ""  # which feed and why (a log line)

  def init_state(self) -> state_lib.TrainState:
    """A freshly allocated initial state, equal to `state` before any step."""
    return state_lib.init_state(self.task, self.plan, self.tx, self.key, self.example)

  def prepare(self, batch: dict, upcoming: Iterable[dict] = (), train: bool = True) -> dict:
    """Every group's `prepare` of one batch: {group key: prepared pytree}. upcoming: the next
    train batches' ids dicts (the look-ahead window)."""
    return inputs.prepare_one(self.plan, batch, list(upcoming), train)

  def packed(self, prepared: dict, batch: dict, what: str = "batch") -> tuple[list, tuple]:
    """A prepared batch on the devices: (buffers [devices, n] per dtype, static layout), the
    arguments after the state of `train_step` / `eval_step` (one transfer)."""
    return self.feeder(prepared, batch, what)

  def feed(self, stream: Iterable, depth: int = 0) -> Iterator[tuple[inputs.Prepared, Any]]:
    """(kind, split, batch) items -> (`inputs.Prepared` item, its packed device batch; None
    for an "eval_end"), prepared in stream order with the look-ahead window and, with depth
    > 0, `depth` items ahead of the consumer as the trainer's input thread runs
    (`inputs.run_ahead`). Here on the calling thread."""
    items = inputs.prepare_stream(self.plan, stream)
    if depth:
      items = inputs.run_ahead(items, depth)
    for item in items:
      on_device = None if item.batch is None else self.packed(item.prepared, item.batch)
      yield item, on_device

  def sync(self, state: state_lib.TrainState) -> state_lib.TrainState:
    """`state` with every group's host-side tables written back (before saving, reading)."""
    return state.replace(emb={k: g.sync(state.emb[k]) for k, g in self.plan.groups.items()})


def _open_task(config, mesh, log) -> Task:
  if jax.process_count() == 1:
    return load_task(config, mesh)
  # Process 0 builds shared caches (Criteo conversion, synthetic data) first; the others
  # then open them.
  task = load_task(config, mesh) if distributed.is_main() else None
  multihost_utils.sync_global_devices("recgnn: data ready")
  if task is None:
    task = load_task(config, mesh)
  log(f"{distributed.describe()}: {jax.process_count()} processes")
  return task


def place_step_inputs(task: Task, mesh: jax.sharding.Mesh) -> dict | None:
  """`task.step_inputs()` on the devices of `mesh`, once per run (`place_inputs`); None when
  the task has none."""
  host = task.step_inputs()
  return place_inputs(host, mesh) if host else None


def place_inputs(tree, mesh: jax.sharding.Mesh):
  """Step inputs on the devices: host (numpy) leaves replicated on every device of `mesh`;
  leaves that are device arrays already (e.g. a graph's rows split over the mesh) stay as
  they were placed. Their shardings are the step's in_shardings (`step.jit_packed`)."""
  repl = sharding.named(mesh, sharding.REPLICATED)
  return jax.tree.map(lambda x: x if isinstance(x, jax.Array) else sharding.put(x, repl), tree)


def refuse_stacked_calls(task: Task, plan: planner.Plan) -> None:
  """k > 1 batches per call (`Task.batches_per_call`) with a host-tier group that does not
  declare `Capabilities.stacks_calls` (offload and hot_cold do): refused, named. Such a
  group plans its lists, ring slots and write-backs per step and hands them over per step;
  a call of k needs them of one shape per call and handed over per call."""
  if task.batches_per_call <= 1:
    return
  bad = [
    g.text or g.name
    for g in plan.groups.values()
    if g.capabilities.writes_host and not g.capabilities.stacks_calls
  ]
  if bad:
    key = task.steps_per_call_key or "steps_per_call"
    raise ValueError(
      f"{key}={task.batches_per_call} with host-tier embedding groups {bad} that run one "
      "step per call (they do not declare Capabilities.stacks_calls: their lists and "
      "write-backs are planned and handed over per step). Use "
      f"{key}=1 with this plan, or offload / hot_cold / dense / tt / sharded tables."
    )


def jit_steps(
  task: Task,
  plan: planner.Plan,
  tx,
  shardings,
  step_inputs: dict | None = None,
  feed: device_feed.DeviceFeed | None = None,
) -> tuple[Callable, Callable]:
  """The jitted packed (train, eval) steps of a plan: built once by `build`, and again by the
  loop when a group re-plans its static shapes (capability `replans_shapes`). The train step
  is the task's own when it has one (`Task.train_step`), which reads `step_inputs`
  (`place_step_inputs`, the run's `Run.step_inputs`). With the device feed (`feed`), both
  gather their batches on the devices (`device_feed.fed_step`)."""
  if feed is not None:
    return device_feed.jit_steps(task, plan, tx, shardings, feed)
  own = task.train_step(plan, tx)
  if own is not None and step_inputs is None and task.step_inputs():
    raise ValueError(
      f"{type(task).__name__}'s train step reads step inputs: pass the run's placed ones "
      "(Run.step_inputs) to jit_steps"
    )
  if own is not None and task.batches_per_call > 1:
    raise ValueError(
      f"{type(task).__name__} has a train step of its own and batches_per_call="
      f"{task.batches_per_call}: only the shared step stacks batches"
    )
  train_step = step_lib.jit_packed(
    step_lib.make_train_step(task, plan, tx) if own is None else own,
    plan,
    shardings,
    donate_state=True,
    out_state=True,
    name="train_step",
    step_inputs=step_inputs if own is not None else None,
    stacked=task.batches_per_call,
  )
  eval_step = step_lib.jit_packed(
    step_lib.make_eval_step(task, plan),
    plan,
    shardings,
    donate_state=False,
    out_state=False,
    name="eval_step",
  )
  return train_step, eval_step


def build(
  config: ml_collections.ConfigDict,
  *,
  mesh: jax.sharding.Mesh | None = None,
  task: Task | None = None,
  example: dict | None = None,
  key: jax.Array | None = None,
  device_memory_budget: int | planner.RelativeBudget | None = None,
  allocate: bool = True,
  plan_report: bool = False,
  log: Callable[[str], None] = _quiet,
) -> Run:
  """The run of `config`, ready for its first step.

  mesh: instead of the config's (`config_mesh`). task: a Task instance to use instead of
  `config.task`'s (e.g. a benchmark's task over given table sizes, without a dataset); built
  on `mesh`. example: the batch the dense params are initialised from (default
  `task.example_batch()`). key: the initial state's PRNG key (default: `config.seed`'s).
  device_memory_budget: bytes per device the plan must fit, or a `planner.RelativeBudget`
  ('plan+10%', resolved against the plan's own bytes and logged; default
  `config.device_memory_budget`, else unchecked). allocate=False: `state` holds shapes and
  dtypes only (`jax.eval_shape`), enough to lower and compile the steps of a state that would
  not fit; `init_state()` allocates one. plan_report: time each table's placement as the
  auto planner would (`Run.prediction`), for a plan without an auto rule too (an auto rule's
  figures are always there). log: progress lines (the trainer's prints
  from process 0; quiet by default).
  """
  # Backends in their own files register before the task or the plan reads a plan string.
  planner.load_modules(config.get("embeddings", {}).get("modules", ""))
  mesh = config_mesh(config) if mesh is None else mesh
  if task is None:
    task = _open_task(config, mesh, log)
    log(task.describe())
  specs = task.tables()
  rules = planner.rules_of(config.embeddings.plan)
  budget = _budget(config, device_memory_budget, rules)
  fixed = None if isinstance(budget, planner.RelativeBudget) else budget
  rules, choice = plan_figures(config, task, rules, specs, mesh, fixed, plan_report, log, build)
  auto = choice if auto_lib.auto_options(planner.rules_of(config.embeddings.plan)) else None
  layout, input_how = _input_layout(task, rules, specs, mesh, config.train, log)
  example = task.example_batch() if example is None else example
  plan, rows, feed_how = _plan(config, task, rules, specs, mesh, layout, example, budget, log)
  log(f"Input: {feed_how}")
  planner.check_host_memory(plan, planner.parse_bytes(config.get("host_memory_budget")))
  total_steps, length = training_length(config.train, task)
  log(f"Mesh {sharding.describe(mesh)}; training {length}")
  tx = state_lib.make_optimizer(config.optimizer)
  _check_example(task, plan, example)
  key = jax.random.key(config.seed) if key is None else key
  state = _initial_state(task, plan, tx, key, example, allocate)
  log(f"Dense params: {sum(x.size for x in jax.tree.leaves(state.params)):,}")
  shardings = state_lib.state_sharding(plan, state)
  step_inputs = place_step_inputs(task, mesh)
  k = task.batches_per_call
  feed = device_feed.DeviceFeed(rows, plan, k) if rows is not None and allocate else None
  train_step, eval_step = jit_steps(task, plan, tx, shardings, step_inputs, feed=feed)
  return Run(
    config=config, mesh=mesh, task=task, layout=plan.layout, input_how=input_how, plan=plan,
    feeder=feeder_lib.Feeder(plan, task.batch_spec), tx=tx, example=example, key=key,
    state=state, shardings=shardings, step_inputs=step_inputs, train_step=train_step,
    eval_step=eval_step, total_steps=total_steps, length=length, auto_plan=auto,
    prediction=choice, device_feed=feed, feed_how=feed_how,
  )  # fmt: skip


def _budget(config, budget, rules):
  """The device memory budget (bytes per device, a `planner.RelativeBudget`, or None): the
  argument, else `config.device_memory_budget`. A relative one is refused with an auto rule
  (the plan it is relative to is yet to be chosen)."""
  if budget is None and config.get("device_memory_budget"):
    budget = parse_budget(config.device_memory_budget)
  if isinstance(budget, planner.RelativeBudget) and auto_lib.auto_options(rules) is not None:
    raise ValueError(
      f"device_memory_budget={budget} is relative to the plan, which an auto(...) rule has "
      "yet to choose: give plan=auto a budget in bytes (e.g. 64M)"
    )
  return budget


def _input_layout(task, rules, specs, mesh, tcfg, log) -> tuple[base.Layout, str]:
  """The input layout (batch split; with many processes, whether each reads only its slice
  of every batch), decided before the plan: every backend receives it at construction, and
  a task that reads process slices received its slice from the same decision
  (`Task.input_layout`). -> (layout, a line saying which and why)."""
  layout, shard, how = inputs.choose_layout(
    task, rules, specs, mesh, tcfg.get("process_input", "auto")
  )
  if task.reads_process_slice and task.process_shard != (shard or (0, 1)):
    raise ValueError(
      f"{type(task).__name__} reads slice {task.process_shard} of every batch, but this run's "
      f"input layout gives this process {shard or (0, 1)}: build the task with the run's "
      "config and mesh"
    )
  if jax.process_count() > 1:
    log(f"Input: {how}")
  return layout, how


def _plan(config, task, rules, specs, mesh, layout, example, budget, log):
  """The plan (every backend given the layout; the feed's `ids_on_device` decided first),
  logged with its bytes and checked against the budget before anything is allocated, its
  groups told the train batches' shapes. With the device feed, the data's copy counted
  beside the plan: train.feed=auto falls back to the host feed where it does not fit.
  -> (plan, the device feed's rows or None, a line saying which feed)."""
  layout, rows, how = device_feed.layout_for(config.train, task, rules, specs, layout, mesh)
  for attempt in itertools.count():
    plan = planner.resolve_plan(rules, specs, mesh, layout, log=False)
    if not attempt:  # (before any refusal; a fallback's plan holds the same bytes)
      log("Embedding plan (bytes before allocation):\n" + planner.format_plan(plan))
    refuse_stacked_calls(task, plan)
    ids_shapes = _train_ids_shapes(plan, task, example)
    for g in plan.groups.values() if ids_shapes else ():
      g.expect_batches(ids_shapes)  # (before the state is built or restored)
    need = _check_memory(plan, ids_shapes, budget, log)
    fixed = None if isinstance(budget, planner.RelativeBudget) else budget
    why = device_feed.fits(config.train, rows, need, fixed, mesh) if rows is not None else None
    if not why:
      break
    rows, how = None, f"host feed: {why}"  # (the plan as its backends build it for that)
    layout = dataclasses.replace(layout, ids_on_device=False)
  if rows is not None:
    device_feed.check_ids(rows, plan.specs)
    how = device_feed.describe(rows, how)
  return plan, rows, how


def _check_memory(plan, ids_shapes, budget, log) -> int:
  """The plan's bytes per device, refused past the budget; a relative budget ('plan+10%')
  resolved against them and logged (it fits by construction)."""
  if not isinstance(budget, planner.RelativeBudget):
    return planner.check_memory(plan, budget, ids_shapes)
  need = planner.check_memory(plan, None, ids_shapes)
  held = budget.bytes_for(need)
  log(
    f"Device memory budget {budget}: {held:,} bytes per device (the plan needs {need:,}; "
    f"pass --device_memory_budget={held} to hold another plan to the same budget)"
  )
  return need


def _check_example(task, plan, example) -> None:
  """Fail on a batch that cannot be split over the mesh now, before allocating anything
  (train batches are checked as they are packed; a process-local one by the feeder)."""
  if plan.layout.process_local:
    return
  ids, rest = {k: v for k, v in example.items() if k == "ids"}, state_lib.device_batch(example)
  batch_specs = (inputs.batch_spec(ids, task.shard_batch), task.batch_spec(rest))
  inputs.check_split((ids, rest), batch_specs, plan.mesh, "eval batch")


def _initial_state(task, plan, tx, key, example, allocate: bool):
  """The initial state (tables placed by their groups, dense params replicated), or with
  allocate=False its shapes and dtypes only."""

  def init():
    return state_lib.init_state(task, plan, tx, key, example)

  if allocate:
    return init()
  with base.shapes_only():  # (table values change no shape; a traced key cannot make them)
    return jax.eval_shape(init)
