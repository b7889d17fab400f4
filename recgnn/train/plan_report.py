"""`--plan_report`: the planner's predictions set against what a run measured.

After training, per group of the plan: its tables, backend, the bytes per device and on the
host the planner predicted (the backends' own `memory()` before allocation) against the
bytes the trained state holds (read from its arrays, by memory kind), and the group's share
of the predicted step (its tables' measured steps); for the whole step, the predicted time
(the model part + the tables' steps + their prepare where it shares the cores:
`recgnn.planner.auto.PlanChoice.predicted_step_s`) against the
measured median time per step of the run's logged intervals that compiled no program (the
steady step; how many programs were compiled is reported beside it), and the host-link and
collective bytes per step the compiled program moves (`recgnn.train.traffic`). Written to
workdir/plan_report.json and printed.
"""

from __future__ import annotations

import statistics
from typing import Any

import jax

from recgnn import planner
from recgnn.planner import auto

HOST_KINDS = ("pinned_host", "unpinned_host")


def held_bytes(state_of_group: Any) -> tuple[int, int]:
  """(device bytes, host bytes) of a group's state on its most loaded device: each device's
  shards summed by memory kind (device memory, or a host kind: pinned / unpinned host), the
  largest sum of each kind. Host-side bookkeeping in numpy (e.g. offload's row -> slot map,
  in its predicted host bytes) is not a device array and is not counted."""
  device: dict[Any, int] = {}
  host: dict[Any, int] = {}
  for leaf in jax.tree.leaves(state_of_group):
    if not isinstance(leaf, jax.Array):
      continue
    into = host if leaf.sharding.memory_kind in HOST_KINDS else device
    for shard in leaf.addressable_shards:
      into[shard.device] = into.get(shard.device, 0) + shard.data.nbytes
  return max(device.values(), default=0), max(host.values(), default=0)


def steady_intervals(interval_step_s: list[float], programs: list[int]) -> tuple[list[float], str]:
  """The logged intervals in which no train-step program was compiled (the program count at
  their end equals the one before; the first interval always compiles), and which rule chose
  them. When every interval held a compile: those after the first, said so."""
  steady = [s for i, s in enumerate(interval_step_s) if i > 0 and programs[i] == programs[i - 1]]
  if steady:
    return steady, f"{len(steady)} of {len(interval_step_s)} logged intervals compiled nothing"
  rest = interval_step_s[1:] or interval_step_s
  return rest, "every logged interval compiled a program: their median after the first"


def build(
  prediction: auto.PlanChoice,
  plan: planner.Plan,
  emb_state: dict[str, Any],
  interval_step_s: list[float],
  interval_programs: list[int],
  traffic: dict[str, float],
) -> dict:
  """The report as a dict (what plan_report.json holds)."""
  groups = {}
  for key, group in plan.groups.items():
    tables = list(group.specs)
    every = {**prediction.fixed, **prediction.chosen}
    chosen = [every[t] for t in tables if t in every]
    dev, host = held_bytes(emb_state[key])
    groups[key] = {
      "tables": tables,
      "backend": sorted({c.text for c in chosen}),
      "predicted_device_bytes": sum(c.device_bytes for c in chosen),
      "predicted_host_bytes": sum(c.host_bytes for c in chosen),
      "held_device_bytes": dev,
      "held_host_bytes": host,
      "predicted_step_s": sum(prediction.marginal_s(c) for c in chosen)
      + sum(
        max(prediction.overhead_s.get(t, prediction.dispatch_s) - prediction.dispatch_s, 0.0)
        for t in {c.text for c in chosen}
      ),
      "table_step_s": {c.table: c.step_s for c in chosen},  # as timed (dispatch included)
      "predicted_prepare_s": sum(c.prepare_s for c in chosen),
    }
  steady, rule = steady_intervals(interval_step_s, interval_programs)
  measured = statistics.median(steady) if steady else None
  predicted = prediction.predicted_step_s
  return {
    "objective": prediction.objective,
    "predicted_step_s": predicted,
    "model_s": prediction.model_s,
    "device_step_s": prediction.device_step_s,
    "prepare_s": prediction.prepare_s,
    "shared_cores": prediction.shared_cores,
    "dispatch_s": prediction.dispatch_s,
    "overhead_s": prediction.overhead_s,
    "measured_step_s": measured,
    "predicted_over_measured": None if not measured else predicted / measured,
    "measured_from": rule,
    "interval_step_s": interval_step_s,
    "interval_programs": interval_programs,
    "link": traffic,
    "groups": groups,
  }


def describe(report: dict) -> str:
  """The report as log lines."""
  m = report["measured_step_s"]
  ratio = report["predicted_over_measured"]
  model = report["model_s"]
  lines = [
    f"plan report: step predicted {report['predicted_step_s'] * 1e3:.2f} ms "
    + (f"(model part {model * 1e3:.2f} ms) " if model is not None else "")
    + f"(device {report['device_step_s'] * 1e3:.2f} ms, input thread's prepare "
    f"{report['prepare_s'] * 1e3:.2f} ms"
    + (f" over {report['shared_cores']} shared cores) " if report["shared_cores"] else ") ")
    + (
      f"vs measured {m * 1e3:.2f} ms (median; {report['measured_from']}): {ratio:.2f}x"
      if m
      else "(no step measured)"
    ),  # fmt: skip
    f"{'group':<14} {'tables':>6} {'pred. dev':>10} {'held dev':>10} {'pred. host':>10} "
    f"{'held host':>10} {'pred. ms':>8}  backend",
  ]
  for key, g in report["groups"].items():
    lines.append(
      f"{key:<14} {len(g['tables']):>6} {_mib(g['predicted_device_bytes']):>10} "
      f"{_mib(g['held_device_bytes']):>10} {_mib(g['predicted_host_bytes']):>10} "
      f"{_mib(g['held_host_bytes']):>10} {g['predicted_step_s'] * 1e3:>8.2f}  "
      + ", ".join(g["backend"])
    )
  link = report["link"]
  if link:
    lines.append(
      "bytes per step of the last program: host link "
      f"{link.get('link/host_to_device_bytes', 0) / 1e6:.3f} MB to device, "
      f"{link.get('link/device_to_host_bytes', 0) / 1e6:.3f} MB to host; collectives "
      f"{link.get('link/collective_bytes_per_device', 0) / 1e6:.3f} MB per device; "
      f"{int(link.get('link/programs', 0))} program(s) compiled"
    )
  return "\n".join(lines)


def _mib(n: float) -> str:
  return f"{n / 2**20:,.2f}M"
