"""The trainer: one loop for every task and every embedding backend.

  input thread:  task batches (+ eval batches at their steps) -> backend.prepare per table
                 (dedup, cache planning, prefetch; sees `lookahead` upcoming batches)
                 -> packed host buffers -> a bounded queue (base.PREFETCH deep)
  main thread:   device_put of the next batch, jitted train step (state donated) ... metrics
                 read only every log_every steps; eval, checkpoints (backends synced first),
                 profiler trace, TensorBoard.

Every `prepare` call happens on the input thread, in stream order, eval batches included,
so stateful backends (device caches) see one consistent sequence of batches.

Every call into the devices (transfers, steps, reads) is made from the main thread, and on
CPU devices one multi-device step runs at a time (`sharding.OneInFlight`, in
`step.jit_packed`). 8-device runs hung in XLA:CPU (gdb: 7 devices in the step's all-gather,
the 8th device's launch blocked on its one in-flight slot, held by its part of the previous
step, which never started). Moving the transfers off the input thread (a put had been made
during each hung launch) was not enough: a run still hung with the put on the main thread;
launching each step after the previous one finished was (issue 30; README "Many devices").
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import os
import pkgutil
import queue
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import jax
import ml_collections
import numpy as np
from jax.experimental import multihost_utils

from recgnn import distributed, hostmem, sharding
from recgnn.embeddings import base
from recgnn.tasks.base import Task
from recgnn.train import checkpoint as ckpt_lib
from recgnn.train import inputs, workdir_lock
from recgnn.train import step as step_lib
from recgnn.train import watchdog as watchdog_lib


def log(msg: str) -> None:
  """Progress on stdout, from process 0 only (every process runs the same loop)."""
  if jax.process_index() == 0:
    print(msg, flush=True)


# ----------------------------------------------------------------------------- setup


def available_tasks() -> list[str]:
  import recgnn.tasks as pkg

  return sorted(m.name for m in pkgutil.iter_modules(pkg.__path__) if m.name != "base")


def config_mesh(config: ml_collections.ConfigDict) -> jax.sharding.Mesh:
  """The trainer's mesh for `config` (its `mesh` section; every device when absent)."""
  return sharding.mesh_from_config(config.get("mesh", {}))


def load_task(config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh) -> Task:
  """Instantiate `recgnn.tasks.<config.task>.TASK(config, mesh)` on the trainer's mesh."""
  names = available_tasks()
  if config.task not in names:
    raise ValueError(f"Unknown task {config.task!r}; available: {', '.join(names)}")
  module = importlib.import_module(f"recgnn.tasks.{config.task}")
  return module.TASK(config, mesh)


def parse_steps(text: str | None) -> tuple[int, int] | None:
  """'100:120' -> (100, 120): profile steps [100, 120)."""
  if not text:
    return None
  try:
    a, b = (int(x) for x in text.split(":"))
  except ValueError:
    raise ValueError(f"--profile_steps must look like START:STOP, got {text!r}") from None
  if not 0 <= a < b:
    raise ValueError(f"--profile_steps {text!r}: need 0 <= START < STOP")
  return a, b


def parse_bytes(text: str | None) -> int | None:
  """'512M', '2G', '1.5GiB', '1000000' -> bytes."""
  if text in (None, ""):
    return None
  t = str(text).strip().upper().removesuffix("IB").removesuffix("B")
  mult = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
  if t and t[-1] in mult:
    return int(float(t[:-1]) * mult[t[-1]])
  return int(float(t))


# ----------------------------------------------------------------------------- input thread


@dataclasses.dataclass
class Item:
  kind: str  # "train" | "eval" | "eval_end"
  split: str | None
  batch_size: int
  prepared: Any  # (buffers, layout) of (prepared ids, batch), step.Feeder.pack: host buffers
  # on the queue, device buffers once `InputThread.get` transferred them


def _stream(task: Task, start: int, total: int, eval_every: int, eval_split: str, final):
  """Train batches with eval passes inserted after their steps; then the final evals."""
  train = task.train_batches(start)
  for s in range(start, total):
    try:
      batch = next(train)
    except StopIteration:
      raise RuntimeError(
        f"{type(task).__name__}.train_batches ended at step {s}; it must cycle over epochs"
      ) from None
    yield "train", None, batch
    if eval_every and (s + 1) % eval_every == 0 and s + 1 < total:
      for b in task.eval_batches(eval_split):
        yield "eval", eval_split, b
      yield "eval_end", eval_split, None
  for split in final:
    for b in task.eval_batches(split):
      yield "eval", split, b
    yield "eval_end", split, None


class InputThread:
  """Runs every group's `prepare` (inputs.prepare_stream) and the packing of each batch into
  per-dtype host buffers ahead of the step on a background thread; `get` (main thread) makes
  the transfer. The thread never calls into the devices (see the module docstring)."""

  def __init__(
    self, stream: Iterator, plan: base.Plan, feeder, depth: int, task: Task, scale: int = 1
  ):
    self._plan = plan
    self._scale = scale
    self._feeder = feeder
    self._task = task
    self._queue: queue.Queue = queue.Queue(maxsize=depth)
    self._stop = threading.Event()
    self.busy_seconds = 0.0
    self._thread = threading.Thread(target=self._run, args=(stream,), daemon=True)
    self._thread.start()

  def _run(self, stream):
    try:
      items = inputs.prepare_stream(self._plan, stream)
      while not self._stop.is_set():
        t0 = time.perf_counter()
        try:
          it = next(items)  # prepare runs here
        except StopIteration:
          break
        host = None
        if it.batch is not None:
          host = self._feeder.pack(it.prepared, it.batch, f"{it.kind} batch")
        self.busy_seconds += time.perf_counter() - t0
        size = self._task.num_examples(it.batch) * self._scale if it.batch is not None else 0
        self._put(Item(it.kind, it.split, size, host))
      self._put(None)
    except BaseException as e:  # forwarded to the main thread, which re-raises
      self._put(e)

  def _put(self, item):
    while not self._stop.is_set():
      try:
        self._queue.put(item, timeout=0.1)
        return
      except queue.Full:
        continue

  def get(self) -> Item | None:
    """The next item, its batch transferred to the devices (from the calling thread)."""
    item = self._queue.get()
    if isinstance(item, BaseException):
      raise item
    if item is not None and item.prepared is not None:
      buffers, layout = item.prepared
      item.prepared = (self._feeder.put(buffers), layout)
    return item

  def close(self):
    self._stop.set()
    self._thread.join(timeout=5)


# ----------------------------------------------------------------------------- trainer


class _Sigterm:
  """Turns SIGTERM into a flag the loop checks after each step (checkpoint, then exit)."""

  def __init__(self):
    self.received = False
    self._old = None

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      self._old = signal.signal(signal.SIGTERM, self._handle)
    return self

  def _handle(self, signum, frame):
    del signum, frame
    self.received = True

  def __exit__(self, *exc):
    if self._old is not None:
      signal.signal(signal.SIGTERM, self._old)


def _summary_writer(workdir: str):
  try:
    from tensorboardX import SummaryWriter
  except ImportError:  # scalars still go to metrics.jsonl
    return None
  return SummaryWriter(os.path.join(workdir, "tensorboard"))


def _sync_all(plan: base.Plan, state: step_lib.TrainState) -> step_lib.TrainState:
  return state.replace(emb={k: g.sync(state.emb[k]) for k, g in plan.groups.items()})


class NonFiniteLoss(FloatingPointError):
  """A NaN / inf training loss: the run stops without saving (the last checkpoint is good)."""


def _first_non_finite(steps: list[int], losses) -> tuple[int, float] | None:
  """(step, loss) of the first non-finite loss among `losses` (of steps `steps`), or None."""
  for s, v in zip(steps, losses):
    if not np.isfinite(v):
      return s, float(v)
  return None


def _non_finite_report(plan: base.Plan, state: step_lib.TrainState) -> str:
  """Which tables and dense params hold NaN / inf (their stored form: rows, slots, cores)."""
  parts = []
  for key, group in plan.groups.items():
    for name, arrays in group.export(state.emb[key]).items():
      bad = sum(int(np.sum(~np.isfinite(np.asarray(x)))) for x in jax.tree.leaves(arrays))
      if bad:
        parts.append(f"{name} ({bad:,} values)")
  tables = ", ".join(parts) or "none"
  flat = jax.tree_util.tree_flatten_with_path(jax.device_get(state.params))[0]
  dense = [jax.tree_util.keystr(p) for p, x in flat if not np.all(np.isfinite(np.asarray(x)))]
  shown = ", ".join(dense[:8]) + (f" and {len(dense) - 8} more" if len(dense) > 8 else "")
  return f"tables with non-finite values: {tables}; dense params: {shown or 'none'}"


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


RESUME_MODES = (False, True, "if_present")


def train(
  config: ml_collections.ConfigDict,
  workdir: str,
  *,
  resume: bool | str = False,
  profile_steps: tuple[int, int] | None = None,
  device_memory_budget: int | None = None,
  stop_after: int | None = None,
) -> Result:
  """Train `config` in `workdir`; returns the final metrics (also in workdir/results.json).

  resume: False: a new run (refused in a workdir that holds another run's checkpoints);
  True: continue from the latest checkpoint (refused when there is none, or when it does not
  fit `config`: ckpt_lib.IncompatibleCheckpoint names the keys); "if_present": continue if
  there is a checkpoint, else start at step 0 (a scheduler that reruns the same command).
  stop_after: stop (with a checkpoint) after this many steps of this call, as if killed;
  used to test that resuming reproduces an uninterrupted run.

  Errors of the configuration, the plan, the data or the workdir raised before the first
  step carry `during_setup = True` (run.py prints them as one line).
  """
  if resume not in RESUME_MODES:
    raise ValueError(f"resume={resume!r}; valid: False, True, 'if_present'")
  # One run per workdir (process 0 holds it for all processes of a run).
  try:
    lock = workdir_lock.WorkdirLock(workdir, log=log) if distributed.is_main() else None
  except workdir_lock.WorkdirLocked as e:
    e.during_setup = True
    raise
  try:
    return _train(config, workdir, resume, profile_steps, device_memory_budget, stop_after)
  finally:
    if lock is not None:
      lock.release()


def _train(config, workdir, resume, profile_steps, device_memory_budget, stop_after) -> Result:
  setup = _Setup()
  with setup:
    return _train_in(
      config, workdir, resume, profile_steps, device_memory_budget, stop_after, setup
    )


class _Setup:
  """Marks an exception raised before the first step with `during_setup = True`, once
  `done` is not set: the configuration, plan, data or workdir was wrong (not a bug in a step)."""

  done = False

  def __enter__(self):
    return self

  def __exit__(self, kind, e, tb):
    if e is not None and not self.done and isinstance(e, Exception):
      with contextlib.suppress(AttributeError):  # (an exception type with __slots__)
        e.during_setup = True
    return False


def _train_in(config, workdir, resume, profile_steps, device_memory_budget, stop_after, setup):
  # Before anything slow: a fresh run over another run's checkpoints would die at its first
  # save (Orbax StepAlreadyExistsError) or, resumed later, mix two runs.
  ckpt_lib.refuse_existing(workdir, bool(resume))
  if resume is True and not ckpt_lib.committed_steps(workdir):
    raise ckpt_lib.NoCheckpoint(
      f"--resume: no checkpoint in {ckpt_lib.checkpoint_dir(workdir)}, nothing to continue. "
      "Drop --resume to start a new run there, or pass --resume_if_present to continue when "
      "there is a checkpoint and start from step 0 when there is none."
    )
  os.makedirs(workdir, exist_ok=True)
  hostmem.keep_freed_memory()  # reuse per-step temporaries instead of page-faulting them in
  tcfg = config.train
  mesh = config_mesh(config)
  if jax.process_count() > 1:
    # Process 0 builds shared caches (Criteo conversion, synthetic data) first; the others
    # then open them.
    if distributed.is_main():
      task = load_task(config, mesh)
    multihost_utils.sync_global_devices("recgnn: data ready")
    if not distributed.is_main():
      task = load_task(config, mesh)
    log(f"{distributed.describe()}: {jax.process_count()} processes")
  else:
    task = load_task(config, mesh)
  log(task.describe())
  specs = task.tables()
  rules = list(map(tuple, config.embeddings.plan))
  # The input layout first (batch split; with many processes, whether each reads only its
  # slice of every batch, when the task and every backend's declared capabilities allow it):
  # every backend receives it at construction.
  layout, shard, how_input = inputs.choose_layout(
    task, rules, specs, mesh, tcfg.get("process_input", "auto")
  )
  if jax.process_count() > 1:
    log(f"Input: {how_input}")
  if shard is not None:
    task.process_shard = shard
  plan = base.resolve_plan(rules, specs, mesh, layout, log=False)
  log("Embedding plan (bytes before allocation):\n" + base.format_plan(plan))
  if device_memory_budget is None and config.get("device_memory_budget"):
    device_memory_budget = parse_bytes(config.device_memory_budget)
  base.check_memory(plan, device_memory_budget)
  feeder = step_lib.Feeder(plan, task.batch_spec)
  total_steps, how = training_length(tcfg, task)
  log(f"Mesh {sharding.describe(mesh)}; training {how}")

  tx = step_lib.make_optimizer(config.optimizer)
  key = jax.random.key(config.seed)
  example = task.example_batch()
  # Fail on a batch that cannot be split over the mesh now, before allocating anything
  # (train batches are checked as they are packed, on the input thread).
  ids, rest = {k: v for k, v in example.items() if k == "ids"}, step_lib.device_batch(example)
  specs = (inputs.batch_spec(ids, task.shard_batch), task.batch_spec(rest))
  if shard is None:  # (a process-local batch is checked by the feeder)
    inputs.check_split((ids, rest), specs, mesh, "eval batch")
  state = step_lib.init_state(task, plan, tx, key, example)
  n_params = sum(x.size for x in jax.tree.leaves(state.params))
  log(f"Dense params: {n_params:,}")

  config_json = config.to_json_best_effort(indent=2)
  ckpt = ckpt_lib.Checkpointer(
    workdir, max_to_keep=tcfg.get("keep_checkpoints", 2), config=json.loads(config_json)
  )
  try:
    start = 0
    ckpt.check_artifacts(task.artifacts(), bool(resume) and ckpt.latest_step() is not None)
    if resume and ckpt.latest_step() is not None:
      # Newest readable checkpoint, checked against this run first (another config is
      # refused, naming the keys; the checkpoint stays). A corrupted one is refused (named
      # in the log) and moved aside, and the one before it is used.
      state = ckpt.restore(state, plan, log=log)
      meta = ckpt.metadata(ckpt.restored_step)
      start = int(state.step)
      # The input pipeline continues where the checkpoint's iterator was (mid-epoch).
      task.restore_data_state(meta.get("data_state"), start)
      log(
        f"Resumed from checkpoint at step {start} in {ckpt.directory} (saved on mesh "
        f"{meta.get('mesh', '?')}; tables restored into this run's plan and mesh)"
      )
    elif resume:
      log(f"--resume_if_present: no checkpoint in {ckpt.directory}; starting from step 0")
    # Only now: a refused resume leaves the config of the run that saved the checkpoints.
    if distributed.is_main():
      with open(os.path.join(workdir, "config.json"), "w") as f:
        f.write(config_json)
      log(f"Config written to {os.path.join(workdir, 'config.json')}")
  except BaseException:
    ckpt.close()  # (an open manager's threads end the process with pages of asyncio errors)
    raise

  total = total_steps
  shardings = step_lib.state_sharding(plan, state)

  def build_steps():  # again when a group re-plans its static shapes (sharded's code widths)
    train = step_lib.jit_packed(
      step_lib.make_train_step(task, plan, tx),
      plan,
      shardings,
      donate_state=True,
      out_state=True,
      name="train_step",
    )
    evaluate = step_lib.jit_packed(
      step_lib.make_eval_step(task, plan),
      plan,
      shardings,
      donate_state=False,
      out_state=False,
      name="eval_step",
    )
    return train, evaluate

  train_step, eval_step = build_steps()
  replanning = {k: g for k, g in plan.groups.items() if hasattr(g, "replan")}
  final_splits = tuple(tcfg.get("final_eval_splits", ("valid", "test")))
  end = total if stop_after is None else min(total, start + stop_after)
  stream = _stream(
    task,
    start,
    end,
    tcfg.eval_every,
    tcfg.get("eval_split", "valid"),
    final_splits if end == total else (),
  )
  # samples/s counts global examples: a process-local batch is 1 / processes of one.
  scale = 1 if shard is None else shard[1]
  feed = InputThread(stream, plan, feeder, depth=base.PREFETCH, task=task, scale=scale)
  main = distributed.is_main()  # only process 0 writes metrics, TensorBoard, results
  writer = _summary_writer(workdir) if main else None
  metrics_file = open(os.path.join(workdir, "metrics.jsonl"), "a") if main else None  # noqa: SIM115

  def write_scalars(step: int, scalars: dict[str, float]):
    if metrics_file is None:
      return
    metrics_file.write(json.dumps({"step": step, **scalars}) + "\n")
    metrics_file.flush()
    if writer is not None:
      for k, v in scalars.items():
        writer.add_scalar(k, v, step)

  results: dict[str, Any] = {}
  pending: list = []  # device metrics since the last log; read only at log time
  pending_steps: list[int] = []  # the step number after each of them
  failed = False  # a non-finite loss or a failed save: nothing more is written

  def check_finite(host_losses) -> None:
    """Stop on a NaN / inf loss before the state that follows it can be saved."""
    nonlocal failed
    bad = _first_non_finite(pending_steps, host_losses)
    if bad is None:
      return
    failed = True
    report = _non_finite_report(plan, _sync_all(plan, state))
    last = ckpt.latest_step()
    if last is None:
      kept = "no checkpoint was saved before it. Lower the learning rate or check the data"
      kept += ", then start again in a fresh --workdir."
    else:
      kept = (
        f"the last good state is checkpoint {last} in {ckpt.directory}. Lower the learning "
        "rate or check the data, then rerun with --resume (or a fresh --workdir)."
      )
    raise NonFiniteLoss(
      f"Non-finite training loss {bad[1]} at step {bad[0]}; {report}. Nothing saved after it: "
      + kept
    )

  eval_outputs: list = []
  t_eval = 0.0
  step = start
  t_last = time.perf_counter()
  examples = 0  # train examples since the last log (batches may vary in size)
  profiling = False
  interrupted = False
  setup.done = True  # from here on an error is the run's, not the configuration's
  dog = watchdog_lib.Watchdog(
    factor=float(tcfg.get("watchdog_factor", 20.0)),
    min_s=float(tcfg.get("watchdog_min_s", 120.0)),
    first_s=float(tcfg.get("watchdog_first_s", 1800.0)),
    grace_s=float(tcfg.get("sigterm_grace_s", 120.0)),
    log=log,
  )
  try:
    with _Sigterm() as sigterm:
      dog.watch_sigterm()
      while True:
        with dog.unit("input", f"the input of step {step + 1}"):
          item = feed.get()  # (and its transfer to the devices)
        if item is None:
          break
        if item.kind == "train":
          if profile_steps and step == profile_steps[0]:
            # The Perfetto trace (*.trace.json.gz) beside the xplane: the form a user (and
            # recgnn.trace_summary) reads without TensorBoard.
            jax.profiler.start_trace(os.path.join(workdir, "profile"), create_perfetto_trace=True)
            profiling = True
          with (
            dog.unit("step", f"step {step + 1}"),
            jax.profiler.StepTraceAnnotation("train", step_num=step),
          ):
            state, m = train_step(state, *item.prepared)
          pending.append(m)
          step += 1
          rebuild = False
          for k, g in replanning.items():  # a no-op but every N steps (a host read then)
            new, changed = g.replan(state.emb[k], step)
            state, rebuild = state.replace(emb={**state.emb, k: new}), rebuild or changed
          if rebuild:
            train_step, eval_step = build_steps()
          dog.last_step = step
          pending_steps.append(step)
          examples += int(item.batch_size)
          if profiling and step >= profile_steps[1]:
            jax.block_until_ready(state)
            jax.profiler.stop_trace()
            profiling = False
            log(
              f"Profile of steps {profile_steps[0]}:{profile_steps[1]} written to "
              f"{os.path.join(workdir, 'profile')} (open with TensorBoard or Perfetto)"
            )
          if step % tcfg.log_every == 0 or step == end:
            with dog.unit("metrics", f"reading the metrics of steps up to {step}"):
              host = jax.device_get(pending)  # the loop's only regular host sync
            check_finite([h["loss"] for h in host])
            pending, pending_steps = [], []
            now = time.perf_counter()
            scalars = {k: float(np.mean([h[k] for h in host])) for k in host[0]}
            rate = examples / max(now - t_last, 1e-9)
            examples = 0
            scalars["samples_per_second"] = rate
            for g in plan.groups.values():
              scalars.update(g.stats())
            write_scalars(step, scalars)
            unit = task.example_unit
            log(f"step {step:>7}/{total}  loss {scalars['loss']:.5f}  {rate:,.0f} {unit}/s")
            t_last = now
          if tcfg.checkpoint_every and step % tcfg.checkpoint_every == 0 and step < end:
            t0 = time.perf_counter()
            with dog.unit("save", f"saving checkpoint {step}"):
              check_finite(jax.device_get([m["loss"] for m in pending]))  # saving syncs anyway
              state = _sync_all(plan, state)
              try:
                ckpt.save(state, step, plan, data_state=task.data_state(step))
              except ckpt_lib.CheckpointWriteError:
                failed = True  # the finally below must not try again on a full disk
                raise
            t_last += time.perf_counter() - t0  # keep samples/s a measure of training only
          if sigterm.received:
            dog.sigterm_acknowledged()
            log(f"SIGTERM at step {step}: saving a checkpoint and stopping")
            interrupted = True
            break
        elif item.kind == "eval":
          if not eval_outputs:
            t_eval = time.perf_counter()
          with dog.unit("eval", f"eval batch {len(eval_outputs) + 1} of {item.split} @ {step}"):
            eval_outputs.append(eval_step(state, *item.prepared))
        else:  # eval_end
          with dog.unit("eval_end", f"reading the {item.split} eval outputs @ step {step}"):
            res = task.metrics(jax.device_get(eval_outputs))
          t_last += time.perf_counter() - t_eval
          eval_outputs = []
          write_scalars(step, {f"{item.split}/{k}": v for k, v in res.items()})
          log(
            f"eval {item.split} @ step {step}: " + "  ".join(f"{k} {v:.5f}" for k, v in res.items())
          )
          results.update({f"{item.split}/{k}": v for k, v in res.items()})
  finally:
    feed.close()
    if profiling:
      jax.profiler.stop_trace()
    try:
      if not failed:
        with dog.unit("save", f"saving checkpoint {step}"):
          # Never leave a non-finite state as the newest checkpoint.
          check_finite(jax.device_get([m["loss"] for m in pending]))
          state = _sync_all(plan, state)
          if step > start or interrupted:
            ckpt.save(state, step, plan, data_state=task.data_state(step))
    finally:
      dog.close()
      ckpt.close()
      if metrics_file is not None:
        metrics_file.close()
      if writer is not None:
        writer.close()

  results["step"] = step
  results["input_thread_seconds"] = feed.busy_seconds
  for key, group in plan.groups.items():  # e.g. a codec's bounds and fallbacks (a host read)
    results.update({f"emb/{key}/{k}": v for k, v in group.report(state.emb[key]).items()})
  if step == total:
    results.update(task.final_report(results))
    if main:
      with open(os.path.join(workdir, "results.json"), "w") as f:
        json.dump(results, f, indent=2, sort_keys=True)
  return Result(metrics=results, state=state, plan=plan)


@dataclasses.dataclass
class Result:
  """What `train` returns: final metrics (also in results.json), the synced state, backends."""

  metrics: dict[str, Any]
  state: step_lib.TrainState
  plan: base.Plan
