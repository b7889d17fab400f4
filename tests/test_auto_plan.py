"""plan=auto (recgnn/embeddings/auto_plan.py): the options, the integer program against brute
force, the refusal of a budget nothing fits, real candidates' bytes from the backends, and a
trainer run whose auto rule places two tables within a budget."""

from __future__ import annotations

import itertools
import json
import os

import numpy as np
import pytest
import trainer_lib

from recgnn.embeddings import auto_plan, base
from recgnn.embeddings.auto_plan import AutoOptions, Candidate
from recgnn.train import loop


def test_options_refused_with_the_reason():
  with pytest.raises(ValueError, match="objective must be one of time, memory"):
    AutoOptions(objective="speed")
  with pytest.raises(ValueError, match="tt_ranks is empty"):
    AutoOptions(kinds=("dense", "tt"))
  with pytest.raises(ValueError, match="fractions must be in"):
    AutoOptions(fractions=(0.5, 1.0))
  with pytest.raises(ValueError, match="fraction of the all-dense bytes"):
    AutoOptions(budget=4.0)
  with pytest.raises(ValueError, match="unknown option"):
    AutoOptions.parse({"budgt": 0.5})
  with pytest.raises(ValueError, match="one auto"):
    auto_plan.auto_options([("a", "auto(budget=0.5)"), ("b", "auto(budget=0.25)")])
  with pytest.raises(ValueError, match="resolved by recgnn.train.setup.build"):
    base.resolve_plan([(".*", "auto")], [base.TableSpec(name="t", num_rows=100, dim=4)])


def _random_candidates(rng, tables=5, per=4):
  out = {}
  for t in range(tables):
    out[f"t{t}"] = [
      Candidate(f"t{t}", f"c{k}", int(rng.integers(1, 1000)), 0, float(rng.uniform(1, 10)))
      for k in range(per)
    ]
  return out


def _brute(cands, budget, objective):
  best_key = None
  for combo in itertools.product(*cands.values()):
    b = sum(c.device_bytes for c in combo)
    if budget is not None and b > budget:
      continue
    s = sum(c.step_s for c in combo)
    key = (s, b) if objective == "time" else (b, s)
    if best_key is None or key < best_key:
      best_key = key
  return best_key


@pytest.mark.parametrize("objective", ["time", "memory"])
def test_solve_matches_brute_force(objective):
  rng = np.random.default_rng(0)
  for trial in range(12):
    cands = _random_candidates(rng)
    lo = sum(min(c.device_bytes for c in cs) for cs in cands.values())
    hi = sum(max(c.device_bytes for c in cs) for cs in cands.values())
    budget = None if trial == 0 else int(rng.integers(lo, hi + 1))
    chosen = auto_plan.solve(cands, budget, objective)
    b = sum(c.device_bytes for c in chosen.values())
    s = sum(c.step_s for c in chosen.values())
    assert budget is None or b <= budget
    want = _brute(cands, budget, objective)
    got = (s, b) if objective == "time" else (b, s)
    assert got[0] == pytest.approx(want[0], rel=1e-9), (trial, got, want)


def test_infeasible_budget_names_the_smallest_plan_and_its_tables():
  cands = {
    "big": [Candidate("big", "dense", 900, 0, 1.0), Candidate("big", "offload", 300, 0, 2.0)],
    "small": [Candidate("small", "dense", 50, 0, 1.0)],
  }
  with pytest.raises(base.PlanDoesNotFit) as e:
    auto_plan.solve(cands, 200, "time")
  msg = str(e.value)
  assert "350 bytes" in msg and "big" in msg and "(offload)" in msg
  chosen = auto_plan.solve(cands, 350, "time")
  assert chosen["big"].text == "offload" and chosen["small"].text == "dense"


def test_choose_real_backends_bytes_and_budgets():
  """The backends' own memory() for the candidates; a model cost (dense fastest, host tiers
  slower as the cache shrinks): a 100% budget keeps every table dense, a small one fits by
  moving the big tables to the host, and a budget below every choice is refused."""
  specs = [
    base.TableSpec(name=f"t{i}", num_rows=n, dim=8) for i, n in enumerate([50_000, 20_000, 300])
  ]
  mesh = base.default_mesh()

  def cost(text, spec):
    if text == "dense":
      return 1.0, 0.0
    frac = float(text.split("=")[1].rstrip(")"))
    return 1.0 + (0.5 if text.startswith("offload") else 0.6) / frac**0.1, 0.0

  opts = AutoOptions(budget=1.0)
  full = auto_plan.choose(specs, opts, mesh, base.Layout(), [], cost=cost)
  assert {c.text for c in full.chosen.values()} == {"dense"}
  dense_bytes = full.all_dense_bytes
  assert full.device_bytes == dense_bytes
  small = auto_plan.choose(specs, AutoOptions(budget=0.1), mesh, base.Layout(), [], cost=cost)
  assert small.device_bytes <= 0.1 * dense_bytes
  assert small.chosen["t0"].text != "dense"
  assert small.chosen["t2"].text == "dense"  # a 300-row table costs nothing to keep
  report = small.report()
  assert "runner-up" in report and "t0" in report
  with pytest.raises(ValueError, match="no model axis"):
    auto_plan.choose(specs, AutoOptions(kinds=("dense", "sharded")), mesh, base.Layout(), [])
  with pytest.raises(base.PlanDoesNotFit, match="smallest plan needs"):
    auto_plan.choose(specs, AutoOptions(budget=0.001), mesh, base.Layout(), [], cost=cost)


def test_trainer_auto_rule_places_two_tables_within_budget(tmp_path):
  """smoke with two tables under auto (measured on the run's batches) and the rest dense: the
  chosen plan fits the budget, trains, and its choice is written beside the results."""
  probe = trainer_lib.smoke_config(str(tmp_path / "cache"), mesh=(1, 1))
  run = loop.setup.build(probe, allocate=False)
  names = list(run.plan.table_group)
  big = sorted(names, key=lambda n: -run.plan.specs[n].num_rows)[:2]
  dense_all = sum(g.device_bytes() for g in run.plan.groups.values())
  big_bytes = sum(run.plan.backend_of(n).memory()[n].device_bytes for n in big)
  budget = dense_all - big_bytes // 2  # the two big tables cannot both stay dense
  pattern = "|".join(big)
  opts = f"auto(budget='{budget}', kinds=('dense', 'offload'), fractions=(0.2,), batches=3)"
  c = trainer_lib.smoke_config(
    str(tmp_path / "cache"),
    mesh=(1, 1),
    plan=((pattern, opts), (".*", "dense")),
    steps=4,
    log_every=2,
  )
  workdir = str(tmp_path / "run")
  result = loop.train(c, workdir)
  assert result.metrics["step"] == 4
  with open(os.path.join(workdir, "auto_plan.json")) as f:
    choice = json.load(f)
  assert choice["device_bytes"] <= budget
  assert set(choice["chosen"]) == set(big)
  assert any(v["text"].startswith("offload") for v in choice["chosen"].values())
  for v in choice["chosen"].values():
    assert v["step_s"] > 0 and np.isfinite(v["step_s"])
  used = {n: result.plan.backend_of(n).describe(n) for n in big}
  assert any("offload" in d or "host" in d for d in used.values()), used
