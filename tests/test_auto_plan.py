"""plan=auto (recgnn/planner/auto/): the options, the integer program against brute
force, the refusal of a budget nothing fits, real candidates' bytes from the backends, the
finalists timed whole, and trainer runs whose auto rule places tables within a budget."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os

import numpy as np
import pytest
import trainer_lib

from recgnn import planner
from recgnn.embeddings import base
from recgnn.planner import auto
from recgnn.planner.auto import AutoOptions, Candidate
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
    auto.auto_options([("a", "auto(budget=0.5)"), ("b", "auto(budget=0.25)")])
  with pytest.raises(ValueError, match="resolved by recgnn.train.setup.build"):
    planner.resolve_plan([(".*", "auto")], [base.TableSpec(name="t", num_rows=100, dim=4)])


def _read_json(path: str):
  with open(path) as f:
    return json.load(f)


def _largest(run, k: int) -> list[str]:
  """The k tables of a built run with the most rows."""
  return sorted(run.plan.specs, key=lambda n: -run.plan.specs[n].num_rows)[:k]


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
    chosen = auto.solve(cands, budget, objective)
    b = sum(c.device_bytes for c in chosen.values())
    s = sum(c.step_s for c in chosen.values())
    assert budget is None or b <= budget
    want = _brute(cands, budget, objective)
    got = (s, b) if objective == "time" else (b, s)
    assert got[0] == pytest.approx(want[0], rel=1e-9), (trial, got, want)


@pytest.mark.parametrize("objective", ["time", "memory"])
def test_solve_keeps_each_family_to_its_limit_of_backend_strings(objective):
  """hot_cold-like candidates (split a batch into micro-batches) share one backend string
  across the plan (a batch has one split): the solver's optimum equals the brute force over
  the combinations that keep to the rule, and runner-ups keep to it too."""
  rng = np.random.default_rng(1)
  for trial in range(12):
    cands = {}
    for t in range(5):
      cands[f"t{t}"] = [
        Candidate(
          f"t{t}",
          f"c{k}",
          int(rng.integers(1, 1000)),
          0,
          float(rng.uniform(1, 10)),
          family="micro" if k >= 2 else None,
        )  # fmt: skip
        for k in range(5)
      ]  # c2, c3, c4 split: at most one of them anywhere in the plan
    lo = sum(min(c.device_bytes for c in cs) for cs in cands.values())
    hi = sum(max(c.device_bytes for c in cs) for cs in cands.values())
    budget = None if trial == 0 else int(rng.integers(lo, hi + 1))
    best = None
    for combo in itertools.product(*cands.values()):
      b = sum(c.device_bytes for c in combo)
      if (budget is not None and b > budget) or len({c.text for c in combo if c.family}) > 1:
        continue
      s = sum(c.step_s for c in combo)
      key = (s, b) if objective == "time" else (b, s)
      best = key if best is None or key < best else best
    if best is None:
      with pytest.raises(planner.PlanDoesNotFit, match="one split"):
        auto.solve(cands, budget, objective, {"micro": 1})
      continue
    chosen = auto.solve(cands, budget, objective, {"micro": 1})
    assert len({c.text for c in chosen.values() if c.family}) <= 1
    b = sum(c.device_bytes for c in chosen.values())
    s = sum(c.step_s for c in chosen.values())
    got = (s, b) if objective == "time" else (b, s)
    assert got[0] == pytest.approx(best[0], rel=1e-9), (trial, got, best)
    for t, r in auto.runner_ups(cands, chosen, budget, objective, {"micro": 1}).items():
      if r is not None and r.family:
        others = {c.text for u, c in chosen.items() if u != t and c.family}
        assert others <= {r.text}
  # With a splitting group among the rules' own tables, no auto table may split.
  chosen = auto.solve(cands, None, objective, {"micro": 0})
  assert not any(c.family for c in chosen.values())


def test_infeasible_budget_names_the_smallest_plan_and_its_tables():
  cands = {
    "big": [Candidate("big", "dense", 900, 0, 1.0), Candidate("big", "offload", 300, 0, 2.0)],
    "small": [Candidate("small", "dense", 50, 0, 1.0)],
  }
  with pytest.raises(planner.PlanDoesNotFit) as e:
    auto.solve(cands, 200, "time")
  msg = str(e.value)
  assert "350 bytes" in msg and "big" in msg and "(offload)" in msg
  chosen = auto.solve(cands, 350, "time")
  assert chosen["big"].text == "offload" and chosen["small"].text == "dense"


def test_choose_real_backends_bytes_and_budgets():
  """The backends' own memory() for the candidates; a model cost (dense fastest, host tiers
  slower as the cache shrinks): a 100% budget keeps every table dense, a small one fits by
  moving the big tables to the host, and a budget below every choice is refused."""
  specs = [
    base.TableSpec(name=f"t{i}", num_rows=n, dim=8) for i, n in enumerate([50_000, 20_000, 300])
  ]
  mesh = planner.default_mesh()

  def cost(text, spec):
    if text == "dense":
      return 1.0, 0.0
    frac = float(text.split("=")[1].rstrip(")"))
    return 1.0 + (0.5 if text.startswith("offload") else 0.6) / frac**0.1, 0.0

  opts = AutoOptions(budget=1.0)
  full = auto.choose(specs, opts, mesh, base.Layout(), [], cost=cost)
  assert {c.text for c in full.chosen.values()} == {"dense"}
  dense_bytes = full.all_dense_bytes
  assert full.device_bytes == dense_bytes
  small = auto.choose(specs, AutoOptions(budget=0.1), mesh, base.Layout(), [], cost=cost)
  assert small.device_bytes <= 0.1 * dense_bytes
  assert small.chosen["t0"].text != "dense"
  assert small.chosen["t2"].text == "dense"  # a 300-row table costs nothing to keep
  report = small.report()
  assert "runner-up" in report and "t0" in report
  with pytest.raises(ValueError, match="no model axis"):
    auto.choose(specs, AutoOptions(kinds=("dense", "sharded")), mesh, base.Layout(), [])
  with pytest.raises(planner.PlanDoesNotFit, match="smallest plan needs"):
    auto.choose(specs, AutoOptions(budget=0.001), mesh, base.Layout(), [], cost=cost)


def test_a_budget_below_the_smallest_plan_is_refused_before_any_timing():
  """Bytes are known without timing: a budget below every table at its smallest candidate is
  refused with the numbers before a candidate, the model part or a finalist is timed (the
  cost functions fail if called), by `choose_finalists` and by the trainer's `plan_rules`
  (a device_memory_budget and another rule's tables taking part of it)."""
  specs = [
    base.TableSpec(name=f"t{i}", num_rows=n, dim=8) for i, n in enumerate([50_000, 20_000, 300])
  ]
  mesh = planner.default_mesh()

  def never(*args, **kw):
    raise AssertionError("timed before the budget was checked")

  with pytest.raises(planner.PlanDoesNotFit, match=r"smallest plan needs .*x the budget"):
    auto.choose_finalists(specs, AutoOptions(budget="1K"), mesh, base.Layout(), [], cost=never)
  fixed = planner.make_group("dense", specs[2:], mesh, base.Layout()).device_bytes()
  rules = [("t0|t1", "auto"), (".*", "dense")]
  with pytest.raises(planner.PlanDoesNotFit, match=r"the other rules' tables take\); the smallest"):
    auto.plan_rules(
      rules, specs, mesh, base.Layout(), [], budget_bytes=fixed + 1000, cost=never,
      model_s=never, time_plan=never,
    )  # fmt: skip


# The trainer runs below: smoke on 4 of Criteo's tables (trainer_lib.smoke_config(tables=4): a
# fraction of the 26 tables' build and timing), the two largest under the rule tested.


@pytest.mark.long  # (~30 s on 2 busy workers; plan_report runs in test_dynamic_raw_ids too)
def test_plan_report_of_a_written_plan_and_the_cost_cache(ctr_cache, tmp_path):
  """--plan_report on a plan without an auto rule: every table timed before training, the
  report written after it with the predicted step beside a measured one, and the bytes the
  state holds equal to the backends' predicted bytes (dense and offload). A second run with the
  same cost cache times nothing again and predicts the same per-table costs and model part
  (its planning, in `build`: where the report's figures come from, nothing trained)."""
  cache = str(tmp_path / "costs.json")
  probe = loop.setup.build(trainer_lib.smoke_config(ctr_cache, tables=4), allocate=False)
  big = _largest(probe, 2)
  plan = (("|".join(big), "offload(cache_fraction=0.5)"), (".*", "dense"))
  c = trainer_lib.smoke_config(
    ctr_cache, mesh=(1, 1), plan=plan, tables=4, steps=6, log_every=2, final_eval_splits=()
  )
  c.embeddings.cost_cache = cache
  workdir = str(tmp_path / "run0")
  loop.train(c, workdir, plan_report=True)
  with open(os.path.join(workdir, "plan_report.json")) as f:
    first = json.load(f)
  sizes = [len(_read_json(cache))]
  assert not os.path.exists(os.path.join(workdir, "auto_plan.json"))  # not an auto plan
  second = loop.setup.build(c, allocate=False, plan_report=True).prediction
  sizes.append(len(_read_json(cache)))
  assert first["objective"] == "given"
  assert first["measured_step_s"] > 0 and first["predicted_step_s"] > 0
  assert first["model_s"] > 0 and len(first["interval_step_s"]) == 3
  kinds = {k: g["backend"] for k, g in first["groups"].items()}
  assert sorted(map(tuple, kinds.values())) == [("dense",), ("offload(cache_fraction=0.5)",)]
  for g in first["groups"].values():
    assert g["held_device_bytes"] == g["predicted_device_bytes"], g
  # The cache: the same per-table step figures and the same model part (read back, not timed
  # again).
  every = {**second.fixed, **second.chosen}
  for g in first["groups"].values():
    assert {t: every[t].step_s for t in g["table_step_s"]} == g["table_step_s"]
  assert second.model_s == first["model_s"]
  # One timing per table, plus each string's group timing (GROUP_COPIES copies of the largest
  # table that takes it, and that table alone), and the model part; the second run adds none.
  tables = sum(len(g["tables"]) for g in first["groups"].values())
  assert tables + 3 <= sizes[0] <= tables + 5 and sizes[1] == sizes[0], sizes


def test_auto_on_an_8_device_mesh_places_tables_over_model(ctr_cache, tmp_path):
  """The planner on a 2 x 4 mesh: dense(shard=rows) and sharded are candidates (per-device
  bytes split over `model`), a budget below the replicated plan moves tables onto the model
  axis, and the run trains."""
  trainer_lib.skip_unless_devices(8, "a 2x4 mesh")
  probe = trainer_lib.smoke_config(ctr_cache, mesh=(2, 4), tables=4)
  run = loop.setup.build(probe, allocate=False)
  dense_all = sum(g.device_bytes() for g in run.plan.groups.values())
  # The two largest tables under auto (the rest dense: fewer candidates to time).
  big = _largest(run, 2)
  big_bytes = sum(run.plan.backend_of(n).memory()[n].device_bytes for n in big)
  budget = dense_all - big_bytes // 2  # the two cannot both stay replicated
  opts = f"auto(budget='{budget}', kinds=('dense', 'sharded'), batches=2)"
  c = trainer_lib.smoke_config(
    ctr_cache,
    mesh=(2, 4),
    plan=(("|".join(big), opts), (".*", "dense")),
    tables=4,
    steps=4,
    log_every=2,
    final_eval_splits=(),  # (the plan and its bytes are the point; evals have their own tests)
  )
  workdir = str(tmp_path / "run")
  result = loop.train(c, workdir)
  assert result.metrics["step"] == 4
  with open(os.path.join(workdir, "auto_plan.json")) as f:
    choice = json.load(f)
  assert choice["device_bytes"] <= budget
  assert set(choice["chosen"]) == set(big)
  texts = {v["text"] for v in choice["chosen"].values()}
  assert texts & {"dense(shard=rows)", "sharded"}, texts
  # The bytes the most loaded device holds, group by group: what the planner predicted for
  # dense placements; at most that for sharded, whose per-table maxima (each table's device
  # holding the most of it) add up to a bound on the group's most loaded device.
  with open(os.path.join(workdir, "plan_report.json")) as f:
    report = json.load(f)
  for g in report["groups"].values():
    if g["backend"] == ["sharded"]:
      assert 0 < g["held_device_bytes"] <= g["predicted_device_bytes"], g
    else:
      assert g["held_device_bytes"] == g["predicted_device_bytes"], g


def test_solve_pays_each_used_group_once():
  """With a fixed cost per backend string (a group's own part, paid once however many tables
  take it), the solver's time equals the brute force's over every combination."""
  rng = np.random.default_rng(2)
  for trial in range(10):
    cands = _random_candidates(rng, tables=4, per=3)
    group_s = {f"c{k}": float(rng.uniform(0, 8)) for k in range(3)}
    lo = sum(min(c.device_bytes for c in cs) for cs in cands.values())
    hi = sum(max(c.device_bytes for c in cs) for cs in cands.values())
    budget = None if trial == 0 else int(rng.integers(lo, hi + 1))
    best = None
    for combo in itertools.product(*cands.values()):
      if budget is not None and sum(c.device_bytes for c in combo) > budget:
        continue
      t = sum(c.step_s for c in combo) + sum(group_s[x] for x in {c.text for c in combo})
      best = t if best is None or t < best else best
    chosen = auto.solve(cands, budget, "time", group_s=group_s)
    got = sum(c.step_s for c in chosen.values())
    got += sum(group_s[x] for x in {c.text for c in chosen.values()})
    assert got == pytest.approx(best, rel=1e-9), (trial, got, best)


def test_model_part_through_the_cost_cache(tmp_path):
  """The model part is timed once per key and read back by a second planning with the same
  cache file; its key moves with what sets its cost (model config, batch), not otherwise."""
  mesh = planner.default_mesh()
  path = str(tmp_path / "costs.json")
  batches = [{"ids": {"t0": np.arange(8)}, "dense": np.ones((8, 3), np.float32)}]
  key = auto.CostCache.model_key("ctr (512, 256)", batches, mesh)
  times = iter([0.010, 0.020, 0.030])
  first = auto.cached_model_seconds(auto.CostCache(path), key, lambda: next(times))
  second = auto.cached_model_seconds(auto.CostCache(path), key, lambda: next(times))
  assert first == second == 0.010
  assert auto.cached_model_seconds(None, key, lambda: next(times)) == 0.020  # no cache
  assert auto.CostCache.model_key("ctr (512, 256)", batches, mesh) == key
  assert auto.CostCache.model_key("ctr (256, 256)", batches, mesh) != key
  bigger = [{"ids": {"t0": np.arange(16)}, "dense": np.ones((16, 3), np.float32)}]
  assert auto.CostCache.model_key("ctr (512, 256)", bigger, mesh) != key


def test_finalists_are_distinct_plans_that_fit_each_of_its_variant():
  """The solver's finalists (`choose_finalists`) on real backends' bytes and a model cost:
  the first is `choose`'s plan; every one fits the budget; they are distinct; with a host
  tier first, every table that leaves device memory takes that tier, at one backend string,
  where it has a candidate of it; each names its variant."""
  specs = [
    base.TableSpec(name=f"t{i}", num_rows=n, dim=8)
    for i, n in enumerate([50_000, 40_000, 30_000, 300])
  ]
  mesh = planner.default_mesh()

  def cost(text, spec):  # hot_cold the cheaper tier for t0, offload for the others: mixed
    if text == "dense":
      return 1.0, 0.0
    frac = float(text.split("=")[1].rstrip(")"))
    cheap = "hot_cold" if spec.name == "t0" else "offload"
    return 1.0 + (0.3 if text.startswith(cheap) else 0.4) / frac**0.1, 0.0

  opts = AutoOptions(budget=0.1, fractions=(0.01, 0.05))
  finalists = auto.choose_finalists(specs, opts, mesh, base.Layout(), [], cost=cost)
  assert finalists[0].rules == auto.choose(specs, opts, mesh, base.Layout(), [], cost=cost).rules
  labels = [c.label for c in finalists]
  assert labels[0] == "every kind" and len(set(labels)) == len(labels)
  for tier in ("offload", "hot_cold"):  # a tier at a fraction first
    assert any(x.startswith(tier + " 0.0") and x.endswith(" first") for x in labels), labels
  assert len({c.rules for c in finalists}) == len(finalists)  # distinct plans
  for c in finalists:
    assert c.device_bytes <= 0.1 * c.all_dense_bytes, c.label
    tiers = {x.text for x in c.chosen.values() if x.text != "dense"}
    if c.label.endswith(" first"):  # every table on a host tier here has one of tier(f)
      tier, f = c.label.split()[:2]
      assert len(tiers) == 1 and tiers.pop().startswith(tier + "("), (c.label, tiers)
      assert all(f"={f})" in x.text for x in c.chosen.values() if x.text != "dense")
  assert len(auto.choose_finalists(
    specs, dataclasses.replace(opts, finalists=2), mesh, base.Layout(), [], cost=cost
  )) == 2  # fmt: skip
  # No host tier fits 10%: not a finalist; at 100% it is (all dense), and the first.
  full = auto.choose_finalists(
    specs, AutoOptions(budget=1.0, fractions=(0.01, 0.05)), mesh, base.Layout(), [], cost=cost
  )
  assert "no host tier" not in labels and full[0].placed == "4 x dense"
  with pytest.raises(ValueError, match="finalists must be >= 1"):
    AutoOptions(finalists=0)


def test_pick_measured_takes_the_fastest_whole_step():
  """The finalist measured fastest is taken, whatever the solver's order, carrying every
  finalist's label, predicted and measured step."""
  a = Candidate("t", "dense", 10, 0, 1.0)
  b = Candidate("t", "offload(cache_fraction=0.1)", 1, 9, 2.0)

  def plan(c, label, whole):
    return auto.PlanChoice(
      chosen={"t": c}, runner_up={"t": None}, fixed_bytes=0, budget_bytes=None,
      all_dense_bytes=10, objective="time", label=label, whole_step_s=whole,
    )  # fmt: skip

  timed = [plan(a, "every kind", 0.050), plan(b, "offload first", 0.045)]
  best = auto.pick_measured(timed)
  assert best.label == "offload first" and best.whole_step_s == 0.045
  assert [f[0] for f in best.finalists] == ["every kind", "offload first"]
  assert [f[3] for f in best.finalists] == [0.050, 0.045]
  assert "finalists timed whole (2; the fastest taken)" in best.report()
  assert best.as_dict()["finalists"][1]["whole_step_s"] == 0.045


def test_trainer_times_the_finalists_whole_and_takes_the_fastest(ctr_cache, tmp_path):
  """smoke with its two largest tables under auto (the rest dense) with both host tiers at a
  budget no plan without one fits: two or more finalists are built and timed as the trainer's
  train step (`recgnn.train.plan_timing`), the fastest is taken, fits and trains, and the
  figures are in auto_plan.json; a second run with the same cost cache times nothing again
  and takes the same plan."""
  probe = trainer_lib.smoke_config(ctr_cache, mesh=(1, 1), tables=4)
  run = loop.setup.build(probe, allocate=False)
  big = _largest(run, 2)
  dense_all = sum(g.device_bytes() for g in run.plan.groups.values())
  big_bytes = sum(run.plan.backend_of(n).memory()[n].device_bytes for n in big)
  budget = dense_all - big_bytes // 2
  opts = f"auto(budget='{budget}', fractions=(0.2,), batches=2, finalists=2)"
  cache = str(tmp_path / "costs.json")
  c = trainer_lib.smoke_config(
    ctr_cache,
    mesh=(1, 1),
    plan=(("|".join(big), opts), (".*", "dense")),
    tables=4,
    steps=4,
    log_every=2,
    final_eval_splits=(),
  )
  c.embeddings.cost_cache = cache
  workdir = str(tmp_path / "run")
  assert loop.train(c, workdir).metrics["step"] == 4
  with open(os.path.join(workdir, "auto_plan.json")) as f:
    first = json.load(f)
  sizes = [len(_read_json(cache))]
  # The second run's planning (in build, nothing allocated or trained): from the cache.
  second = loop.setup.build(c, allocate=False).auto_plan.as_dict()
  sizes.append(len(_read_json(cache)))
  finalists = first["finalists"]
  assert len(finalists) == 2, finalists  # (finalists=2: the solver's plan and one more)
  wholes = [f["whole_step_s"] for f in finalists]
  assert all(w > 0 and np.isfinite(w) for w in wholes)
  assert first["whole_step_s"] == min(wholes) and first["device_bytes"] <= budget
  assert first["label"] == finalists[wholes.index(min(wholes))]["label"]
  assert set(first["chosen"]) == set(big)
  for v in first["chosen"].values():
    assert v["step_s"] > 0 and np.isfinite(v["step_s"])
  # The second run: every figure from the cache (nothing added), the same plan and figures.
  assert sizes[1] == sizes[0]
  # (the predictions differ by the dispatch time, which each run measures)
  keep = ("label", "placed", "whole_step_s")
  assert [{k: f[k] for k in keep} for f in second["finalists"]] == [
    {k: f[k] for k in keep} for f in finalists
  ]
  assert {t: v["text"] for t, v in second["chosen"].items()} == {
    t: v["text"] for t, v in first["chosen"].items()
  }
