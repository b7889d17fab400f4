"""A plan's figures as text (`report`, the log's table) and as JSON (`as_dict`,
auto_plan.json): what `PlanChoice.report` and `PlanChoice.as_dict` give."""

from __future__ import annotations

import dataclasses


def mib(n: float) -> str:
  return f"{n / 2**20:,.1f}M"


def report(choice) -> str:
  """The plan's figures, a table per line (`PlanChoice.report`)."""
  budget = "none" if choice.budget_bytes is None else mib(choice.budget_bytes)
  beside = (
    f" + prepare / {choice.shared_cores} cores" if choice.shared_cores else ", prepare beside it"
  )
  model = (
    ""
    if choice.model_s is None
    else f" + model part {choice.model_s * 1e3:.2f} ms{beside} = train step "
    f"{choice.predicted_step_s * 1e3:.2f} ms"
  )
  what = (
    "plan as written"
    if choice.objective == "given"
    else f"auto plan (objective={choice.objective})"
  )
  lines = [
    f"{what}: {mib(choice.device_bytes)} per device of budget "
    f"{budget} (all dense: {mib(choice.all_dense_bytes)}); predicted: embeddings "
    f"{choice.embedding_step_s * 1e3:.2f} ms (tables' measured steps added){model}; input "
    f"thread's prepare {choice.prepare_s * 1e3:.2f} ms per batch; planned in "
    f"{choice.planning_s:.1f} s",
    f"{'table':<12} {'choice':<32} {'per device':>10} {'host':>10} {'step ms':>8} "
    f"{'prep ms':>8}  runner-up",
  ]
  if choice.finalists:
    lines[1:1] = [
      f"finalists timed whole ({len(choice.finalists)}; the fastest taken): "
      + "; ".join(
        f"{label}: {what}, predicted {p * 1e3:.1f} ms, measured {m * 1e3:.1f} ms"
        for label, what, p, m in choice.finalists
      )
    ]
  if choice.candidates:
    lines.insert(1, candidates_line(choice.candidates))
  for t, c in choice.chosen.items():
    r = choice.runner_up.get(t)
    alt = f"{r.text} ({mib(r.device_bytes)}, {r.step_s * 1e3:.2f} ms)" if r is not None else "-"
    lines.append(
      f"{t:<12} {c.text:<32} {mib(c.device_bytes):>10} {mib(c.host_bytes):>10} "
      f"{c.step_s * 1e3:>8.2f} {c.prepare_s * 1e3:>8.2f}  {alt}"
    )
  return "\n".join(lines)


def candidates_line(candidates: dict[str, tuple[str, ...]]) -> str:
  """'candidates (tables offered each): dense (26), int8 (26), ...', in first-seen order."""
  counts: dict[str, int] = {}
  for texts in candidates.values():
    for t in texts:
      counts[t] = counts.get(t, 0) + 1
  return "candidates (tables offered each): " + ", ".join(f"{t} ({n})" for t, n in counts.items())


def as_dict(choice) -> dict:
  """The plan's figures as JSON (auto_plan.json, `PlanChoice.as_dict`)."""
  return {
    "objective": choice.objective,
    "budget_bytes": choice.budget_bytes,
    "all_dense_bytes": choice.all_dense_bytes,
    "device_bytes": choice.device_bytes,
    "predicted_step_s": choice.predicted_step_s,
    "embedding_step_s": choice.embedding_step_s,
    "model_s": choice.model_s,
    "device_step_s": choice.device_step_s,
    "shared_cores": choice.shared_cores,
    "dispatch_s": choice.dispatch_s,
    "overhead_s": choice.overhead_s,
    "prepare_s": choice.prepare_s,
    "planning_s": choice.planning_s,
    "label": choice.label,
    "whole_step_s": choice.whole_step_s,
    "finalists": [
      {"label": a, "placed": b, "predicted_step_s": p, "whole_step_s": m}
      for a, b, p, m in choice.finalists
    ],
    "candidates": {t: list(c) for t, c in choice.candidates.items()},
    "chosen": {t: dataclasses.asdict(c) for t, c in choice.chosen.items()},
    "fixed": {t: dataclasses.asdict(c) for t, c in choice.fixed.items()},
    "runner_up": {
      t: dataclasses.asdict(c) if c is not None else None for t, c in choice.runner_up.items()
    },
  }
