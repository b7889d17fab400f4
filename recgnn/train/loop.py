"""The trainer: one loop for every task and every embedding backend, over the run that
`recgnn.train.setup.build` makes (task, plan, feeder, state, jitted steps). The loop adds
checkpoints and resume, the input thread (`recgnn.train.input_thread`), evals, metrics.

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
launching each step after the previous one finished was (issue 30; docs/multi-device.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from typing import Any

import jax
import ml_collections
import numpy as np

from recgnn import distributed, hostmem, planner
from recgnn.embeddings import base
from recgnn.train import checkpoint as ckpt_lib
from recgnn.train import input_worker, non_finite, setup, workdir_lock
from recgnn.train import plan_report as plan_report_lib
from recgnn.train import step as step_lib
from recgnn.train import traffic as traffic_lib
from recgnn.train import watchdog as watchdog_lib
from recgnn.train.input_thread import InputThread, stream
from recgnn.train.non_finite import NonFiniteLoss
from recgnn.train.scalars_out import ScalarWriter

# Names callers reach through `loop` (tests, benchmarks, run.py).
config_mesh, load_task, parse_bytes = setup.config_mesh, setup.load_task, setup.parse_bytes
parse_budget = setup.parse_budget
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
  run = setup.build(
    config, device_memory_budget=device_memory_budget, plan_report=plan_report, log=log
  )
  # The loop owns the state from here (each step donates it, a resume replaces it): the run
  # keeps no reference that would hold the initial tables for the whole run.
  state, run = run.state, dataclasses.replace(run, state=None)
  task, plan = run.task, run.plan
  # The input's host half in a worker process where the task and plan allow one (issue 43).
  workers, workers_how = input_worker.workers_for(
    int(tcfg.get("input_workers", input_worker.AUTO)), task, plan
  )

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
    # A train step of k steps per call: every step the loop acts at on a call boundary.
    check_call_boundaries(
      task,
      **{"resumed step" if start else "start": start},
      **{"train.steps (total)": run.total_steps, "stop_after": stop_after},
      **{f"train.{n}": tcfg.get(n, 0) for n in ("log_every", "checkpoint_every", "eval_every")},
      **dict(zip(("profile start", "profile stop"), profile_steps or ())),
    )
    # Only now: a refused resume leaves the config of the run that saved the checkpoints.
    if distributed.is_main():
      with open(os.path.join(workdir, "config.json"), "w") as f:
        f.write(config_json)
      log(f"Config written to {os.path.join(workdir, 'config.json')}")
  except BaseException:
    ckpt.close()  # (an open manager's threads end the process with pages of asyncio errors)
    raise

  total = run.total_steps
  train_step, eval_step = run.train_step, run.eval_step
  # Steps per call of the train step (one per loop item): the loop counts them per item.
  per_call = task.steps_per_call
  # Groups that re-plan static shapes while training (sharded's code widths): asked after
  # every step, the jitted steps rebuilt when one changed.
  replanning = {k: g for k, g in run.plan.groups.items() if g.capabilities.replans_shapes}
  final_splits = tuple(tcfg.get("final_eval_splits", ("valid", "test")))
  end = total if stop_after is None else min(total, start + stop_after)
  items = stream(
    task,
    start,
    end,
    tcfg.eval_every,
    tcfg.get("eval_split", "valid"),
    final_splits if end == total else (),
  )
  # samples/s counts global examples: a process-local batch is 1 / processes of one.
  scale = task.process_shard[1] if run.layout.process_local else 1
  if run.device_feed is not None:
    feed = run.device_feed.input(
      task, start, end, tcfg.eval_every, tcfg.get("eval_split", "valid"),
      final_splits if end == total else (),
    )  # fmt: skip
  else:
    log(f"Input: {workers_how}")
    feed = InputThread(
      items, plan, run.feeder, depth=base.PREFETCH, task=task, scale=scale, worker=workers > 0
    )
  main = distributed.is_main()  # only process 0 writes metrics, TensorBoard, results
  scalars_out = ScalarWriter.open(workdir, main)
  if main and run.auto_plan is not None:  # what an auto(...) rule chose, with its figures
    with open(os.path.join(workdir, "auto_plan.json"), "w") as f:
      json.dump(run.auto_plan.as_dict(), f, indent=2)

  def write_scalars(step: int, scalars: dict[str, float]):
    if scalars_out is not None:
      scalars_out.write(step, scalars)

  results: dict[str, Any] = {}
  # Host-link and collective bytes of each train-step program, read once per program.
  traffic = traffic_lib.StepTraffic()
  pending: list = []  # device metrics since the last log; read only at log time
  pending_steps: list[int] = []  # the step number after each of them
  failed = False  # a non-finite loss or a failed save: nothing more is written

  def check_finite(host_losses) -> None:
    """Stop on a NaN / inf loss before the state that follows it can be saved. host_losses:
    the pending calls' losses (scalars, or [k] per call), in step order."""
    nonlocal failed
    losses = [v for x in host_losses for v in np.ravel(x)]
    bad = non_finite.first_non_finite(pending_steps, losses)
    if bad is None:
      return
    failed = True
    report = non_finite.report(plan, run.sync(state))
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
  interval_steps = 0  # train steps since the last log
  interval_step_s: list[float] = []  # seconds per step of each logged interval
  interval_programs: list[int] = []  # train-step programs compiled by the end of each
  profiling = False
  interrupted = False
  phase.done = True  # from here on an error is the run's, not the configuration's
  dog = watchdog_lib.Watchdog(
    factor=float(tcfg.get("watchdog_factor", 20.0)),
    min_s=float(tcfg.get("watchdog_min_s", 120.0)),
    first_s=float(tcfg.get("watchdog_first_s", 1800.0)),
    grace_s=float(tcfg.get("sigterm_grace_s", 120.0)),
    log=log,
  )
  try:
    with watchdog_lib.SigtermFlag() as sigterm:
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
            dog.unit(
              "step", f"step {step + 1}" if per_call == 1 else f"steps {step + 1}-{step + per_call}"
            ),
            jax.profiler.StepTraceAnnotation("train", step_num=step),
          ):
            state, m = train_step(state, *item.prepared)
          traffic.observe(train_step, state, item.prepared)  # (a lookup but for a new program)
          pending.append(m)  # (with k > 1 steps per call: [k] arrays, one per step)
          step += per_call
          rebuild = False
          for k, g in replanning.items():  # a no-op but every N steps (a host read then)
            new, changed = g.replan(state.emb[k], step)
            state, rebuild = state.replace(emb={**state.emb, k: new}), rebuild or changed
          if rebuild:
            train_step, eval_step = setup.jit_steps(
              run.task, run.plan, run.tx, run.shardings, feed=run.device_feed
            )
          dog.last_step = step
          pending_steps.extend(range(step - per_call + 1, step + 1))
          examples += int(item.batch_size)
          interval_steps += per_call
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
            # The mean over the steps since the last log (each call's k steps).
            scalars = {
              name: float(np.mean(np.concatenate([np.ravel(h[name]) for h in host])))
              for name in host[0]
            }
            rate = examples / max(now - t_last, 1e-9)
            interval_step_s.append((now - t_last) / max(interval_steps, 1))
            interval_programs.append(traffic.programs)
            examples = interval_steps = 0
            scalars["samples_per_second"] = rate
            for g in plan.groups.values():
              scalars.update(g.stats())
            scalars.update(traffic.scalars())
            write_scalars(step, scalars)
            for n, program in traffic.take_new():  # at the first log line, then new programs
              log(f"Train step program {n}: {traffic_lib.describe(program)}")
            unit = task.example_unit
            log(f"step {step:>7}/{total}  loss {scalars['loss']:.5f}  {rate:,.0f} {unit}/s")
            t_last = now
          if tcfg.checkpoint_every and step % tcfg.checkpoint_every == 0 and step < end:
            t0 = time.perf_counter()
            with dog.unit("save", f"saving checkpoint {step}"):
              check_finite(jax.device_get([m["loss"] for m in pending]))  # saving syncs anyway
              state = run.sync(state)
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
    if run.device_feed is not None:
      run.device_feed.close()
    if profiling:
      jax.profiler.stop_trace()
    try:
      if not failed:
        with dog.unit("save", f"saving checkpoint {step}"):
          # Never leave a non-finite state as the newest checkpoint.
          check_finite(jax.device_get([m["loss"] for m in pending]))
          state = run.sync(state)
          if step > start or interrupted:
            ckpt.save(state, step, plan, data_state=task.data_state(step))
    finally:
      dog.close()
      ckpt.close()
      if scalars_out is not None:
        scalars_out.close()  # (every line written before the files close)

  results["step"] = step
  if run.device_feed is not None:  # (its own uploads: a streamed feed's are not the step's)
    results.update(run.device_feed.report())
  results["input_thread_seconds"] = feed.busy_seconds
  if feed.worker is not None:  # (the worker's CPU: every thread of it, numba's included)
    results["input_worker_cpu_seconds"] = feed.worker.cpu_seconds
  # The last train step's program: its bytes over the host link and between devices.
  results.update(traffic.scalars())
  for key, group in plan.groups.items():  # e.g. a codec's bounds and fallbacks (a host read)
    results.update({f"emb/{key}/{k}": v for k, v in group.report(state.emb[key]).items()})
  if run.prediction is not None and main:
    report = plan_report_lib.build(
      run.prediction, plan, state.emb, interval_step_s, interval_programs, traffic.scalars()
    )
    with open(os.path.join(workdir, "plan_report.json"), "w") as f:
      json.dump(report, f, indent=2)
    log(plan_report_lib.describe(report))
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
  plan: planner.Plan
