"""A train step's rows for the host tiers, handed to their writers after each call.

A plan with a host tier (`Capabilities.writes_host`: offload, hot_cold) has a packed train
step returning a third output, the rows the host takes back (`step.make_train_step`);
`HandsToHost` wraps that step so callers see (state, metrics) and the rows go to each
group's `after_update` (O(1) per group: the writer thread waits for the step, not this).
"""

from __future__ import annotations

from recgnn import planner


def hand_to_host(plan: planner.Plan, to_host: dict, steps: int = 1) -> None:
  """A train step's host-tier output to each group's writer (`Backend.after_update`: O(1)
  per group, no wait for the step); steps = k: a call of k steps' ([k, ...] per leaf)."""
  for key, out in to_host.items():
    plan.groups[key].after_update(None, out, steps)


class HandsToHost:
  """A jitted train step of a plan with a host tier, called as f(state, buffers, layout) ->
  (state, metrics): its third output (the host tiers' rows) handed to their writers on the
  way out (`hand_to_host`). Plans without one return (state, metrics) from the jitted
  function itself (no Python frame per call). steps: train steps per call (k > 1: the
  rows of the call's k steps, handed over once)."""

  def __init__(self, fn, plan: planner.Plan, steps: int = 1):
    self._fn, self._plan, self._steps = fn, plan, steps

  def __call__(self, state, buffers, layout):
    state, metrics, to_host = self._fn(state, buffers, layout)
    hand_to_host(self._plan, to_host, self._steps)
    return state, metrics

  def __getattr__(self, name):  # .lower(), .trace(), ... of the jitted step
    return getattr(self._fn, name)
