"""The trainer: one loop for every task and every embedding backend, over the run that
`recgnn.train.setup.build` makes (task, plan, feeder or device feed, state, jitted steps).
`_train_in` reads top to bottom: build, restore or start, then per call of the train step
its periodic actions (recgnn.train.periodic: report, profile, checkpoint, eval, re-plan),
then the last checkpoint and the results.

  input:         the device feed (the data on the devices: a cursor per step), or the input
                 thread (task batches, every group's `prepare` in stream order with the
                 look-ahead window, packed host buffers, a bounded queue base.PREFETCH deep)
  main thread:   the next batch, the jitted train step (state donated) ... metrics read only
                 every log_every steps; evals, checkpoints (backends synced first), profiler
                 trace, TensorBoard.

Every `prepare` call happens on the input side, in stream order, eval batches included, so
stateful backends (device caches) see one consistent sequence of batches.

Every call into the devices (transfers, steps, reads) is made from the main thread, and on
CPU devices one multi-device step runs at a time (`sharding.OneInFlight`, in
`step.jit_packed`): XLA:CPU can deadlock when a multi-device step is launched, or a transfer
made, while the previous one still runs (docs/multi-device.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from typing import Any

import jax
import ml_collections

from recgnn import distributed, hostmem, planner
from recgnn.embeddings import base
from recgnn.train import checkpoint as ckpt_lib
from recgnn.train import input_worker, periodic, setup, workdir_lock
from recgnn.train import plan_report as plan_report_lib
from recgnn.train import train_state as state_lib
from recgnn.train import watchdog as watchdog_lib
from recgnn.train.input_thread import InputThread, stream
from recgnn.train.scalars_out import ScalarWriter
from recgnn.train.task import FINAL_EVAL_SPLITS

# Names callers reach through `loop` (tests, benchmarks, run.py).
config_mesh, load_task, parse_bytes = setup.config_mesh, setup.load_task, setup.parse_bytes
parse_budget = setup.parse_budget
NonFiniteLoss = periodic.NonFiniteLoss
training_length = setup.training_length


def log(msg: str) -> None:
  """Progress on stdout, from process 0 only (every process runs the same loop)."""
  if jax.process_index() == 0:
    print(msg, flush=True)


def check_call_boundaries(task, **steps: int | None) -> None:
  """A task whose train step runs k > 1 steps per call (`Task.steps_per_call`) is only
  between steps at multiples of k: every step the loop acts at (`steps`: name -> step count,
  None / 0 = unused) must be one. Refused, naming each value and k, rather than running a
  last partial call: that would be a second program to compile, and checkpoints off the
  call boundaries could not resume into whole calls."""
  k = task.steps_per_call
  bad = [f"{name}={v}" for name, v in steps.items() if v and v % k]
  if k > 1 and bad:
    key = f" ({task.steps_per_call_key})" if task.steps_per_call_key else ""
    raise ValueError(
      f"{type(task).__name__} runs {k} train steps per call{key}, and the loop can act only "
      f"between calls: {', '.join(bad)} must be multiple(s) of {k}"
    )


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


# ----------------------------------------------------------------------------- trainer


RESUME_MODES = (False, True, "if_present")


def train(
  config: ml_collections.ConfigDict,
  workdir: str,
  *,
  resume: bool | str = False,
  profile_steps: tuple[int, int] | None = None,
  device_memory_budget: int | planner.RelativeBudget | None = None,
  stop_after: int | None = None,
  plan_report: bool = False,
) -> Result:
  """Train `config` in `workdir`; returns the final metrics (also in workdir/results.json).

  resume: False: a new run (refused in a workdir that holds another run's checkpoints);
  True: continue from the latest checkpoint (refused when there is none, or when it does not
  fit `config`: ckpt_lib.IncompatibleCheckpoint names the keys); "if_present": continue if
  there is a checkpoint, else start at step 0 (a scheduler that reruns the same command).
  stop_after: stop (with a checkpoint) after this many steps of this call, as if killed;
  used to test that resuming reproduces an uninterrupted run. plan_report: time each table's
  placement before training as the auto planner does and, after it, set the predicted step
  and bytes against the measured ones (workdir/plan_report.json; always done for a plan with
  an auto rule).

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
    return _train(
      config, workdir, resume, profile_steps, device_memory_budget, stop_after, plan_report
    )
  finally:
    if lock is not None:
      lock.release()


def _train(
  config, workdir, resume, profile_steps, device_memory_budget, stop_after, plan_report
) -> Result:
  phase = _Setup()
  with phase:
    return _train_in(
      config, workdir, resume, profile_steps, device_memory_budget, stop_after, plan_report, phase
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


def _train_in(
  config, workdir, resume, profile_steps, device_memory_budget, stop_after, plan_report, phase
):
  """The run, top to bottom: build, restore or start, the calls with their periodic actions,
  the last checkpoint, the results."""
  _check_workdir(workdir, resume)
  os.makedirs(workdir, exist_ok=True)
  hostmem.keep_freed_memory()  # reuse per-step temporaries instead of page-faulting them in
  tcfg = config.train
  run = setup.build(
    config, device_memory_budget=device_memory_budget, plan_report=plan_report, log=log
  )
  # The loop owns the state from here (each step donates it, a resume replaces it): the run
  # keeps no reference that would hold the initial tables for the whole run.
  state, run = run.state, dataclasses.replace(run, state=None)
  config_json = config.to_json_best_effort(indent=2)
  ckpt = ckpt_lib.Checkpointer(
    workdir, max_to_keep=tcfg.get("keep_checkpoints", 2), config=json.loads(config_json)
  )
  try:
    workers = _input_workers(run)  # (a worker refused: before anything is written)
    state, start = _restore_or_start(run, ckpt, state, resume)
    end = run.total_steps if stop_after is None else min(run.total_steps, start + stop_after)
    _check_boundaries(run, start, stop_after, profile_steps)
    _write_config(config_json, workdir)  # (only now: a refused resume keeps the run's config)
  except BaseException:
    ckpt.close()  # (an open manager's threads end the process with pages of asyncio errors)
    raise
  feed = _open_input(run, start, end, workers)
  main = distributed.is_main()  # only process 0 writes metrics, TensorBoard, results
  writer = ScalarWriter.open(workdir, main)
  if main and run.auto_plan is not None:  # what an auto(...) rule chose, with its figures
    with open(os.path.join(workdir, "auto_plan.json"), "w") as f:
      json.dump(run.auto_plan.as_dict(), f, indent=2)
  phase.done = True  # from here on an error is the run's, not the configuration's
  dog = watchdog_lib.Watchdog.from_config(tcfg, log=log)
  report = periodic.Report(run, tcfg.log_every, end, run.total_steps, writer, ckpt, log)
  actions = _Actions(
    report=report,
    profile=periodic.Profile(profile_steps, workdir, log),
    checkpoints=periodic.Checkpoints(ckpt, run, report, tcfg.checkpoint_every, end, dog),
    evals=periodic.Evals(run.task, report, log),
    replan=periodic.Replan(run, lambda: _jit_steps(run)),
    dog=dog,
  )
  at = _At(state=state, step=start)
  try:
    _calls(run, feed, at, actions)
  finally:
    feed.close()
    if run.device_feed is not None:
      run.device_feed.close()
    actions.profile.stop()
    try:
      at.state = actions.checkpoints.final(at.step, at.state, at.step > start or at.interrupted)
    finally:
      dog.close()
      ckpt.close()
      if writer is not None:
        writer.close()  # (every line written before the files close)
  return _results(run, at, feed, actions, workdir, main)


def _check_workdir(workdir: str, resume) -> None:
  """Before anything slow: a fresh run over another run's checkpoints would die at its first
  save (Orbax StepAlreadyExistsError) or, resumed later, mix two runs; --resume needs one."""
  ckpt_lib.refuse_existing(workdir, bool(resume))
  if resume is True and not ckpt_lib.committed_steps(workdir):
    raise ckpt_lib.NoCheckpoint(
      f"--resume: no checkpoint in {ckpt_lib.checkpoint_dir(workdir)}, nothing to continue. "
      "Drop --resume to start a new run there, or pass --resume_if_present to continue when "
      "there is a checkpoint and start from step 0 when there is none."
    )


def _write_config(config_json: str, workdir: str) -> None:
  if distributed.is_main():
    path = os.path.join(workdir, "config.json")
    with open(path, "w") as f:
      f.write(config_json)
    log(f"Config written to {path}")


def _restore_or_start(run, ckpt, state, resume) -> tuple[state_lib.TrainState, int]:
  """(state, first step): the newest readable checkpoint's with `resume` (checked against
  this run first: another config is refused naming the keys, the checkpoint stays; a
  corrupted one is refused, moved aside, and the one before it used), else the initial."""
  ckpt.check_artifacts(run.task.artifacts(), bool(resume) and ckpt.latest_step() is not None)
  if not resume:
    return state, 0
  if ckpt.latest_step() is None:
    log(f"--resume_if_present: no checkpoint in {ckpt.directory}; starting from step 0")
    return state, 0
  state = ckpt.restore(state, run.plan, log=log)
  meta = ckpt.metadata(ckpt.restored_step)
  start = int(state.step)
  # The input continues where the checkpoint's iterator was (mid-epoch).
  run.task.restore_data_state(meta.get("data_state"), start)
  log(
    f"Resumed from checkpoint at step {start} in {ckpt.directory} (saved on mesh "
    f"{meta.get('mesh', '?')}; tables restored into this run's plan and mesh)"
  )
  return state, start


def _check_boundaries(run, start: int, stop_after, profile_steps) -> None:
  """k steps per call: every step the loop acts at on a call boundary."""
  tcfg = run.config.train
  check_call_boundaries(
    run.task,
    **{"resumed step" if start else "start": start},
    **{"train.steps (total)": run.total_steps, "stop_after": stop_after},
    **{f"train.{n}": tcfg.get(n, 0) for n in ("log_every", "checkpoint_every", "eval_every")},
    **dict(zip(("profile start", "profile stop"), profile_steps or ())),
  )


def _input_workers(run) -> tuple[int, str]:
  """(input worker processes, a line saying why): train.input_workers for the host feed (a
  worker refused where the task or plan cannot run in one); none with the device feed."""
  tcfg = run.config.train
  setting = int(tcfg.get("input_workers", input_worker.AUTO))
  if run.device_feed is None:
    return input_worker.workers_for(setting, run.task, run.plan)
  if setting == 1:
    raise ValueError(
      "train.input_workers=1 with the device feed, whose host side is a cursor per step: "
      "use train.input_workers=-1 or 0, or train.feed=host for a worker process"
    )
  return 0, run.feed_how


def _open_input(run, start: int, end: int, workers: tuple[int, str]):
  """The input of steps [start, end), evals at their steps and the final passes when `end`
  is the run's last step: the device feed's, or the host feed's input thread (its host half
  in a worker process: `workers`, from `_input_workers`)."""
  tcfg, task = run.config.train, run.task
  final = tuple(tcfg.get("final_eval_splits", FINAL_EVAL_SPLITS)) if end == run.total_steps else ()
  split = tcfg.get("eval_split", "valid")
  if run.device_feed is not None:
    return run.device_feed.input(task, start, end, tcfg.eval_every, split, final)
  count, how = workers
  log(f"Input: {how}")
  items = stream(task, start, end, tcfg.eval_every, split, final)
  # samples/s counts global examples: a process-local batch is 1 / processes of one.
  scale = task.process_shard[1] if run.layout.process_local else 1
  return InputThread(
    items, run.plan, run.feeder, depth=base.PREFETCH, task=task, scale=scale, worker=count > 0
  )


def _jit_steps(run) -> tuple:
  return setup.jit_steps(run.task, run.plan, run.tx, run.shardings, feed=run.device_feed)


@dataclasses.dataclass
class _At:
  """Where the run is: its state and step (what the last save saves, whatever ended it)."""

  state: state_lib.TrainState
  step: int
  interrupted: bool = False  # SIGTERM: stopped after a call, to be saved


@dataclasses.dataclass
class _Actions:
  """The periodic actions (recgnn.train.periodic) and the watchdog."""

  report: periodic.Report
  profile: periodic.Profile
  checkpoints: periodic.Checkpoints
  evals: periodic.Evals
  replan: periodic.Replan
  dog: watchdog_lib.Watchdog


def _calls(run, feed, at: _At, actions: _Actions) -> None:
  """Every item of the input, in order: a train call (then its periodic actions), an eval
  batch, or an eval pass's end. SIGTERM stops after the call in progress."""
  dog, steps = actions.dog, (run.train_step, run.eval_step)
  per_call = run.task.steps_per_call
  with watchdog_lib.SigtermFlag() as sigterm:
    dog.watch_sigterm()
    while True:
      with dog.unit("input", f"the input of step {at.step + 1}"):
        item = feed.get()  # (and its transfer to the devices)
      if item is None:
        return
      if item.kind == "eval":
        what = f"eval batch {len(actions.evals.outputs) + 1} of {item.split} @ {at.step}"
        with dog.unit("eval", what):
          actions.evals.add(steps[1](at.state, *item.prepared))
        continue
      if item.kind == "eval_end":
        with dog.unit("eval_end", f"reading the {item.split} eval outputs @ step {at.step}"):
          actions.evals.end(item.split, at.step)
        continue
      steps = _train_call(at, item, steps, per_call, actions)
      if sigterm.received:
        dog.sigterm_acknowledged()
        log(f"SIGTERM at step {at.step}: saving a checkpoint and stopping")
        at.interrupted = True
        return


def _train_call(at: _At, item, steps: tuple, per_call: int, actions: _Actions) -> tuple:
  """One call of the train step (k = per_call steps), then the periodic actions. -> the
  jitted steps (new ones when a group re-planned its shapes)."""
  dog, report = actions.dog, actions.report
  s = at.step
  actions.profile.before(s)
  what = f"step {s + 1}" if per_call == 1 else f"steps {s + 1}-{s + per_call}"
  with dog.unit("step", what), jax.profiler.StepTraceAnnotation("train", step_num=s):
    at.state, metrics = steps[0](at.state, *item.prepared)
  report.traffic.observe(steps[0], at.state, item.prepared)  # (a lookup but for a new program)
  at.step = s + per_call
  report.add(at.step, per_call, metrics, int(item.batch_size))  # ([k] arrays with k > 1)
  at.state, steps = actions.replan(at.step, at.state, steps)
  dog.last_step = at.step
  actions.profile.after(at.step, at.state)
  if report.due(at.step):
    with dog.unit("metrics", f"reading the metrics of steps up to {at.step}"):
      report(at.step, at.state)
  if actions.checkpoints.due(at.step):
    at.state = actions.checkpoints.save(at.step, at.state)
  return steps


def _results(run, at: _At, feed, actions: _Actions, workdir: str, main: bool) -> Result:
  """The run's figures (results.json when it reached its last step) and its final state."""
  results: dict[str, Any] = dict(actions.evals.results)
  results["step"] = at.step
  if run.device_feed is not None:  # (its own uploads: a streamed feed's are not the step's)
    results.update(run.device_feed.report())
  results["input_thread_seconds"] = feed.busy_seconds
  if feed.worker is not None:  # (the worker's CPU: every thread of it, numba's included)
    results["input_worker_cpu_seconds"] = feed.worker.cpu_seconds
  report = actions.report
  results.update(report.traffic.scalars())  # the last train step's program's bytes
  for key, group in run.plan.groups.items():  # e.g. a codec's bounds and fallbacks
    results.update({f"emb/{key}/{k}": v for k, v in group.report(at.state.emb[key]).items()})
  if run.prediction is not None and main:
    plan_rep = plan_report_lib.build(
      run.prediction, run.plan, at.state.emb, report.step_seconds, report.programs,
      report.traffic.scalars(),
    )  # fmt: skip
    with open(os.path.join(workdir, "plan_report.json"), "w") as f:
      json.dump(plan_rep, f, indent=2)
    log(plan_report_lib.describe(plan_rep))
  if at.step == run.total_steps:
    results.update(run.task.final_report(results))
    if main:
      with open(os.path.join(workdir, "results.json"), "w") as f:
        json.dump(results, f, indent=2, sort_keys=True)
  return Result(metrics=results, state=at.state, plan=run.plan)


@dataclasses.dataclass
class Result:
  """What `train` returns: final metrics (also in results.json), the synced state, backends."""

  metrics: dict[str, Any]
  state: state_lib.TrainState
  plan: planner.Plan
