"""The cost model: a plan's predicted step from its tables' measured steps (`PlanChoice`):
each table's own share (`marginal_s`), each group's fixed part once, the model part and the
input thread's prepare."""

from __future__ import annotations

import dataclasses

from recgnn.planner.auto import report as report_lib
from recgnn.planner.auto.placements import Candidate


@dataclasses.dataclass(frozen=True)
class PlanChoice:
  """The planner's answer: a rule per table, what was chosen and the runner-up of each."""

  chosen: dict[str, Candidate]
  runner_up: dict[str, Candidate | None]
  fixed_bytes: int  # bytes per device of the tables the rules placed themselves
  budget_bytes: int | None
  all_dense_bytes: int
  objective: str
  # Seconds of the step's part every plan shares (the task's loss, gradient and dense update:
  # `recgnn.train.model_timing.model_step_seconds`), None when not measured.
  model_s: float | None = None
  # Seconds one jitted call costs with nothing to compute (dispatch, block_until_ready): in
  # every table's timed step once, in the trainer's step once for all of them.
  dispatch_s: float = 0.0
  planning_s: float = 0.0  # wall time of the planning: memory, timing, solving
  # Cores the step computes on when the devices are this host's CPU (the input thread's
  # `prepare` then takes its time from them); None for accelerators (prepare runs beside).
  shared_cores: int | None = None
  # The tables other rules place, with the same figures (timed alike): in the predicted step
  # and the report, not in `rules`.
  fixed: dict[str, Candidate] = dataclasses.field(default_factory=dict)
  # Per backend string: what a group of it costs whatever its tables (`group_overhead`,
  # dispatch included). A table's share of the step is its measured step less this; the
  # step pays it once per group, less the one dispatch the model part already holds.
  overhead_s: dict[str, float] = dataclasses.field(default_factory=dict)
  # Which of the solver's finalists this is (`finalist_plans`), e.g. "every kind".
  label: str = ""
  # This plan's train step as the trainer runs it, timed whole while planning (the finalists'
  # ranking: `pick_measured`); None when not timed.
  whole_step_s: float | None = None
  # Every finalist timed whole, this one included: (label, what it placed, predicted s,
  # measured s), in the solver's order.
  finalists: tuple[tuple[str, str, float, float], ...] = ()
  # Every valid candidate of each table (its plan strings, the backends' own offers included,
  # those over the budget too), in `candidates`' order; empty for a plan as written.
  candidates: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)

  @property
  def rules(self) -> tuple[tuple[str, str], ...]:
    return tuple((_exact(t), c.text) for t, c in self.chosen.items())

  @property
  def placed(self) -> str:
    """What the plan placed, counted: '13 x dense, 13 x hot_cold(budget=0.005)'."""
    counts: dict[str, int] = {}
    for c in [*self.chosen.values(), *self.fixed.values()]:
      counts[c.text] = counts.get(c.text, 0) + 1
    return ", ".join(f"{n} x {t}" for t, n in sorted(counts.items(), key=lambda kv: -kv[1]))

  @property
  def device_bytes(self) -> int:
    return self.fixed_bytes + sum(c.device_bytes for c in self.chosen.values())

  @property
  def embedding_step_s(self) -> float:
    """Every table's own share of the step (`marginal_s`) and each group's fixed part once
    (its overhead less the dispatch the model part holds)."""
    every = [*self.chosen.values(), *self.fixed.values()]
    tables = sum(self.marginal_s(c) for c in every)
    groups = sum(
      max(self.overhead_s.get(t, self.dispatch_s) - self.dispatch_s, 0.0)
      for t in {c.text for c in every}
    )
    return tables + groups

  def marginal_s(self, c: Candidate) -> float:
    """A table's own share of the step: its measured step less its group's overhead (one
    dispatch where the overhead was not measured)."""
    return max(c.step_s - self.overhead_s.get(c.text, self.dispatch_s), 0.0)

  @property
  def device_step_s(self) -> float:
    """The step's device work: the shared model part and the chosen tables' steps (the
    tables alone when the model part was not measured)."""
    return (self.model_s or 0.0) + self.embedding_step_s

  @property
  def predicted_step_s(self) -> float:
    """The whole train step with the input thread's `prepare` beside it. On CPU devices both
    run on the same cores: by work conservation the step takes the device work plus the host
    work spread over the cores (prepare / cores); on an accelerator the host prepares the next
    batch while the device computes, and the slower of the two sets the pace. What this
    leaves out: the module docstring."""
    if self.shared_cores:
      return self.device_step_s + self.prepare_s / self.shared_cores
    return max(self.device_step_s, self.prepare_s)

  @property
  def prepare_s(self) -> float:
    """The chosen tables' host-side prepare per batch, added (the input thread's work)."""
    every = [*self.chosen.values(), *self.fixed.values()]
    return sum(c.prepare_s for c in every if c.prepare_s == c.prepare_s)

  def report(self) -> str:
    return report_lib.report(self)

  def as_dict(self) -> dict:
    return report_lib.as_dict(self)


def _exact(name: str) -> str:
  return "".join("\\" + ch if not (ch.isalnum() or ch == "_") else ch for ch in name)


def _share(c: Candidate, overhead: dict[str, float], dispatch: float) -> float:
  return max(c.step_s - overhead.get(c.text, dispatch), 0.0)
