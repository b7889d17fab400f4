"""What the training loop does between calls of the train step, one object per job (clu's
periodic actions): each is called with the step count after a call and decides itself
whether it is due.

  Report       the metrics every `log_every` steps: the loop's only regular host sync;
               a NaN / inf loss stops the run before its state can be saved
  Profile      an XLA profiler trace of steps [start, stop)
  Checkpoints  a checkpoint every `checkpoint_every` steps, and the last one
  Evals        an eval pass's outputs gathered, its metrics at the pass's end
  Replan       groups that re-plan their static shapes (sharded's code widths): asked after
               every call; the jitted steps rebuilt when one changed
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import jax
import numpy as np

from recgnn.train import checkpoint as ckpt_lib
from recgnn.train import non_finite
from recgnn.train import traffic as traffic_lib
from recgnn.train.non_finite import NonFiniteLoss


class Report:
  """Train metrics since the last report, read every `every` steps (and at `end`): their
  means written (metrics.jsonl, TensorBoard) and logged with samples/s. Time spent in evals
  and saves is not training: `pause(seconds)` keeps it out of samples/s."""

  def __init__(self, run, every: int, end: int, total: int, writer, ckpt, log: Callable):
    self.run, self.every, self.end, self.total = run, every, end, total
    self.writer, self.ckpt, self.log = writer, ckpt, log
    self.traffic = traffic_lib.StepTraffic()  # each train-step program's bytes, read once
    self.pending: list = []  # the device metrics of each call since the last report
    self.steps: list[int] = []  # the step number after each of their steps
    self.examples = self.interval_steps = 0
    self.step_seconds: list[float] = []  # seconds per step of each reported interval
    self.programs: list[int] = []  # train-step programs compiled by the end of each
    self.failed = False  # a non-finite loss (or a failed save): nothing more is saved
    self.t_last = time.perf_counter()

  def pause(self, seconds: float) -> None:
    self.t_last += seconds

  def add(self, step: int, per_call: int, metrics, examples: int) -> None:
    """A call of `per_call` steps ending at `step`: its metrics (device arrays) kept."""
    self.pending.append(metrics)
    self.steps.extend(range(step - per_call + 1, step + 1))
    self.examples += examples
    self.interval_steps += per_call

  def due(self, step: int) -> bool:
    return step % self.every == 0 or step == self.end

  def write(self, step: int, scalars: dict[str, float]) -> None:
    if self.writer is not None:
      self.writer.write(step, scalars)

  def __call__(self, step: int, state) -> None:
    """Read the pending metrics (the host sync), stop on a non-finite loss, write and log."""
    host = jax.device_get(self.pending)
    self.check_finite([h["loss"] for h in host], state)
    self.pending, self.steps = [], []
    now = time.perf_counter()
    scalars = {  # (the mean over the interval's steps: each call's k)
      name: float(np.mean(np.concatenate([np.ravel(h[name]) for h in host]))) for name in host[0]
    }
    rate = self.examples / max(now - self.t_last, 1e-9)
    self.step_seconds.append((now - self.t_last) / max(self.interval_steps, 1))
    self.programs.append(self.traffic.programs)
    self.examples = self.interval_steps = 0
    scalars["samples_per_second"] = rate
    for g in self.run.plan.groups.values():
      scalars.update(g.stats())
    scalars.update(self.traffic.scalars())
    self.write(step, scalars)
    for n, program in self.traffic.take_new():  # at the first report, then new programs
      self.log(f"Train step program {n}: {traffic_lib.describe(program)}")
    unit = self.run.task.example_unit
    self.log(f"step {step:>7}/{self.total}  loss {scalars['loss']:.5f}  {rate:,.0f} {unit}/s")
    self.t_last = now

  def check_pending(self, state) -> None:
    """The losses not yet reported, checked before a save (which syncs anyway)."""
    self.check_finite(jax.device_get([m["loss"] for m in self.pending]), state)

  def check_finite(self, host_losses, state) -> None:
    """NonFiniteLoss at the first NaN / inf among the pending steps' losses (scalars, or
    [k] per call), naming the last good checkpoint."""
    losses = [v for x in host_losses for v in np.ravel(x)]
    bad = non_finite.first_non_finite(self.steps, losses)
    if bad is None:
      return
    self.failed = True
    report = non_finite.report(self.run.plan, self.run.sync(state))
    last = self.ckpt.latest_step()
    if last is None:
      kept = "no checkpoint was saved before it. Lower the learning rate or check the data"
      kept += ", then start again in a fresh --workdir."
    else:
      kept = (
        f"the last good state is checkpoint {last} in {self.ckpt.directory}. Lower the "
        "learning rate or check the data, then rerun with --resume (or a fresh --workdir)."
      )
    raise NonFiniteLoss(
      f"Non-finite training loss {bad[1]} at step {bad[0]}; {report}. Nothing saved after "
      "it: " + kept
    )


class Profile:
  """A profiler trace (xplane and Perfetto's *.trace.json.gz, which recgnn.trace_summary
  reads without TensorBoard) of train steps [start, stop), in workdir/profile."""

  def __init__(self, steps: tuple[int, int] | None, workdir: str, log: Callable):
    self.steps, self.dir, self.log = steps, os.path.join(workdir, "profile"), log
    self.on = False

  def before(self, step: int) -> None:
    if self.steps and step == self.steps[0]:
      jax.profiler.start_trace(self.dir, create_perfetto_trace=True)
      self.on = True

  def after(self, step: int, state) -> None:
    if self.on and step >= self.steps[1]:
      jax.block_until_ready(state)
      self.stop()
      a, b = self.steps
      self.log(
        f"Profile of steps {a}:{b} written to {self.dir} (open with TensorBoard or Perfetto)"
      )

  def stop(self) -> None:
    if self.on:
      jax.profiler.stop_trace()
      self.on = False


class Checkpoints:
  """A checkpoint every `every` steps before `end` (`due`), and the last one (`final`): the
  host tiers synced first, the pending losses checked (never a non-finite state saved)."""

  def __init__(self, ckpt, run, report: Report, every: int, end: int, dog):
    self.ckpt, self.run, self.report, self.every, self.end = ckpt, run, report, every, end
    self.dog = dog

  def due(self, step: int) -> bool:
    return bool(self.every) and step % self.every == 0 and step < self.end

  def save(self, step: int, state):
    """-> the synced state, saved as checkpoint `step`."""
    t0 = time.perf_counter()
    with self.dog.unit("save", f"saving checkpoint {step}"):
      self.report.check_pending(state)
      state = self.run.sync(state)
      try:
        self.ckpt.save(state, step, self.run.plan, data_state=self.run.task.data_state(step))
      except ckpt_lib.CheckpointWriteError:
        self.report.failed = True  # (the final save must not try again on a full disk)
        raise
    self.report.pause(time.perf_counter() - t0)  # samples/s measures training only
    return state

  def final(self, step: int, state, trained: bool):
    """The last save (unless the run failed): `trained` when a step ran or a stop asked."""
    if self.report.failed:
      return state
    with self.dog.unit("save", f"saving checkpoint {step}"):
      self.report.check_pending(state)
      state = self.run.sync(state)
      if trained:
        self.ckpt.save(state, step, self.run.plan, data_state=self.run.task.data_state(step))
    return state


class Evals:
  """An eval pass: each batch's `predict` outputs kept on the devices, read and reduced to
  the task's metrics at the pass's end; its time kept out of samples/s."""

  def __init__(self, task, report: Report, log: Callable):
    self.task, self.report, self.log = task, report, log
    self.outputs: list = []
    self.results: dict[str, float] = {}
    self.t0 = 0.0

  def add(self, outputs) -> None:
    if not self.outputs:
      self.t0 = time.perf_counter()
    self.outputs.append(outputs)

  def end(self, split: str, step: int) -> None:
    res = self.task.metrics(jax.device_get(self.outputs))
    self.report.pause(time.perf_counter() - self.t0)
    self.outputs = []
    self.report.write(step, {f"{split}/{k}": v for k, v in res.items()})
    self.log(f"eval {split} @ step {step}: " + "  ".join(f"{k} {v:.5f}" for k, v in res.items()))
    self.results.update({f"{split}/{k}": v for k, v in res.items()})


class Replan:
  """Groups whose static shapes follow their statistics (`Capabilities.replans_shapes`):
  asked after every call (a no-op but every N steps); `rebuild()` gives new jitted steps
  when one changed."""

  def __init__(self, run, rebuild: Callable):
    self.groups = {k: g for k, g in run.plan.groups.items() if g.capabilities.replans_shapes}
    self.rebuild = rebuild

  def __call__(self, step: int, state, steps: tuple):
    """-> (state, (train_step, eval_step)), rebuilt when a group's shapes changed."""
    changed = False
    for k, g in self.groups.items():
      new, c = g.replan(state.emb[k], step)
      state, changed = state.replace(emb={**state.emb, k: new}), changed or c
    return state, (self.rebuild() if changed else steps)
