"""The integer program: one candidate per table within the budget and the families' limits
(`solve`, scipy.optimize.milp), and each table's runner-up (`runner_ups`)."""

from __future__ import annotations

import numpy as np

from recgnn.planner import budget as budget_lib
from recgnn.planner.auto.placements import Candidate
from recgnn.planner.auto.report import mib as _mib


def check_fits(
  options_by_table: dict[str, list[Candidate]],
  budget_bytes: int | None,
  *,
  fixed_bytes: int = 0,
  total_budget: int | None = None,
) -> None:
  """Refuses (PlanDoesNotFit) a budget below the smallest choice (every table at its smallest
  candidate), with the numbers and the tables that force it. Bytes only: `choose_finalists`
  asks before timing anything, `solve` again. fixed_bytes / total_budget: the other rules'
  tables' bytes and the whole budget, named when given."""
  smallest = {t: min(c.device_bytes for c in cs) for t, cs in options_by_table.items()}
  if budget_bytes is not None and sum(smallest.values()) > budget_bytes:
    need = sum(smallest.values())
    worst = sorted(smallest.items(), key=lambda kv: -kv[1])[:5]
    of = (
      f": the budget's {total_budget:,} less the {fixed_bytes:,} the other rules' tables take"
      if fixed_bytes and total_budget is not None
      else ""
    )
    raise budget_lib.PlanDoesNotFit(
      f"auto plan: no choice of placements fits {_mib(budget_bytes)} per device "
      f"({budget_bytes:,} bytes{of}); the smallest plan needs {_mib(need)} ({need:,} bytes), "
      f"{need / max(budget_bytes, 1):.1f}x the budget. Tables forcing it (their smallest "
      "placement): "
      + ", ".join(
        f"{t} {_mib(b)} ({min(options_by_table[t], key=lambda c: c.device_bytes).text})"
        for t, b in worst
      )
      + ". Raise the budget, add smaller kinds (tt with tt_ranks, smaller fractions) or split "
      "tables over a model axis of the mesh."
    )


def solve(
  options_by_table: dict[str, list[Candidate]],
  budget_bytes: int | None,
  objective: str,
  limits: dict[str, int] | None = None,
  group_s: dict[str, float] | None = None,
  host_budget: int | None = None,
) -> dict[str, Candidate]:
  """One candidate per table minimizing the objective with the bytes per device within
  `budget_bytes` (and their host bytes within `host_budget`, when given): an integer
  program, binary x[t, c], sum_c x[t, c] = 1, sum bytes <= budget;
  and for each family f in `limits`, at most limits[f] distinct backend strings among its
  candidates (binary y[s] >= x[t, c] for every c of string s, sum_{s in f} y[s] <= limits[f]).
  group_s: seconds a backend string costs once if any table takes it (a group's fixed part:
  objective time adds group_s[s] y[s]); the candidates' step_s are then their own shares.
  Refuses (PlanDoesNotFit) a budget below the smallest choice, naming the tables that force
  it. Ties go to the other measure (time: fewer bytes; memory: less time)."""
  from scipy import optimize

  limits, group_s = limits or {}, group_s or {}
  tables = list(options_by_table)
  check_fits(options_by_table, budget_bytes)
  flat = [(i, c) for i, t in enumerate(tables) for c in options_by_table[t]]
  # Variables: x (one per candidate), then y (one per distinct backend string of a limited
  # family or with a group cost).
  limited = sorted(
    {(c.family or "", c.text) for _, c in flat if c.family in limits or group_s.get(c.text)}
  )
  cost = _costs(flat, limited, group_s, objective)
  constraints = _constraints(flat, limited, len(tables), limits, budget_bytes, host_budget)
  n = cost.shape[0]
  res = optimize.milp(
    cost, constraints=constraints, integrality=np.ones(n), bounds=optimize.Bounds(0, 1)
  )
  if not res.success:
    # The byte check above cannot see the families' limits: name them.
    raise budget_lib.PlanDoesNotFit(
      f"auto plan: no plan fits {_mib(budget_bytes or 0)} per device within the limits on "
      f"distinct backend strings {limits} (a batch has one micro-batch split; each host-tier "
      f"group is its own set of step programs)"
      + (f" and {_mib(host_budget)} of host memory" if host_budget is not None else "")
      + f"; solver: {res.message}. Raise the budget, "
      "`strings_per_kind`, or allow other kinds."
    )
  pick = np.flatnonzero(res.x[: len(flat)] > 0.5)
  return {tables[flat[k][0]]: flat[k][1] for k in pick}


def _costs(flat: list, limited: list, group_s: dict, objective: str) -> np.ndarray:
  """The objective's coefficients, f64[nx + ny]: x's (a candidate's own share) then y's (a
  string's group cost), normalized, ties broken by the other measure."""
  nbytes = np.array([c.device_bytes for _, c in flat], float)
  secs = np.array([c.step_s for _, c in flat], float)
  ysecs = np.array([group_s.get(t, 0.0) for _, t in limited], float)
  scale = max(secs.max(initial=0.0), ysecs.max(initial=0.0), 1e-12)
  if objective == "time":
    # tie-break: among equal times, fewer bytes (a weight far below any measured difference)
    cost = secs / scale + 1e-6 * nbytes / max(nbytes.max(), 1.0)
    ycost = ysecs / scale
  else:
    cost = nbytes / max(nbytes.max(), 1.0) + 1e-6 * secs / scale
    ycost = 1e-6 * ysecs / scale
  return np.concatenate([cost, ycost])


def _constraints(
  flat: list,
  limited: list,
  num_tables: int,
  limits: dict,
  budget_bytes: int | None,
  host_budget: int | None,
) -> list:
  """The program's linear constraints over (x, y): one candidate per table, the device and
  host budgets (when given), and the families' limits on distinct strings."""
  from scipy import optimize, sparse

  nx, ny = len(flat), len(limited)
  one = sparse.csr_array(
    (np.ones(nx), ([i for i, _ in flat], np.arange(nx))), shape=(num_tables, nx + ny)
  )
  constraints = [optimize.LinearConstraint(one, 1, 1)]
  for budget, field in ((budget_bytes, "device_bytes"), (host_budget, "host_bytes")):
    if budget is not None:
      row = np.array([getattr(c, field) for _, c in flat] + [0.0] * ny, float)[None, :]
      constraints.append(optimize.LinearConstraint(row, -np.inf, budget))
  if ny:
    constraints += _string_limits(flat, limited, limits)
  return constraints


def _string_limits(flat: list, limited: list, limits: dict) -> list:
  """x[t, c] - y[string of c] <= 0; per family, sum of its y <= its limit."""
  from scipy import optimize, sparse

  nx, ny = len(flat), len(limited)
  index = {key: j for j, key in enumerate(limited)}
  ks = [k for k, (_, c) in enumerate(flat) if (c.family or "", c.text) in index]
  link = sparse.lil_array((len(ks), nx + ny))
  for r, k in enumerate(ks):
    c = flat[k][1]
    link[r, k] = 1
    link[r, nx + index[(c.family or "", c.text)]] = -1
  out = [optimize.LinearConstraint(link.tocsr(), -np.inf, 0)]
  families = sorted({f for f, _ in limited if f in limits})
  if families:
    count = sparse.lil_array((len(families), nx + ny))
    for j, (f, _) in enumerate(limited):
      if f in limits:
        count[families.index(f), nx + j] = 1
    caps = np.array([limits[f] for f in families], float)
    out.append(optimize.LinearConstraint(count.tocsr(), -np.inf, caps))
  return out


def runner_ups(
  options_by_table: dict[str, list[Candidate]],
  chosen: dict[str, Candidate],
  budget_bytes: int | None,
  objective: str,
  limits: dict[str, int] | None = None,
) -> dict[str, Candidate | None]:
  """For each table, the best other candidate with every other table's choice kept, among
  those that still fit the budget and the families' limits (what the plan would take if this
  one were ruled out)."""
  limits = limits or {}
  total = sum(c.device_bytes for c in chosen.values())
  key = (
    (lambda c: (c.step_s, c.device_bytes))
    if objective == "time"
    else (lambda c: (c.device_bytes, c.step_s))
  )

  def within_limits(t, c):
    if c.family not in limits:
      return True
    strings = {d.text for u, d in chosen.items() if u != t and d.family == c.family}
    return len(strings | {c.text}) <= limits[c.family]

  out = {}
  for t, cs in options_by_table.items():
    fits = [
      c
      for c in cs
      if c.text != chosen[t].text
      and (budget_bytes is None or total - chosen[t].device_bytes + c.device_bytes <= budget_bytes)
      and within_limits(t, c)
    ]
    out[t] = min(fits, key=key) if fits else None
  return out
