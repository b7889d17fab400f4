"""Plan-string options: each backend honours an option or refuses it, naming it and why
(never accepted and ignored); an unknown option lists the valid ones."""

import dataclasses
import json

import pytest

from recgnn import planner, sharding
from recgnn.backends import offload
from recgnn.embeddings import base

SPEC = base.TableSpec(name="t", num_rows=1000, dim=8)


def test_offload_min_cache_rows_is_a_floor_under_cache_fraction_only():
  with pytest.raises(ValueError, match="min_cache_rows=50 is a floor under cache_fraction"):
    planner.make_backend("offload(cache_rows=100, min_cache_rows=50)", SPEC)
  g = planner.make_backend("offload(cache_fraction=0.01, min_cache_rows=50)", SPEC)
  assert g.members["t"].cache_rows == 50  # honoured: 1% of 1000 rows is 10


def test_tt_cores_must_agree_with_row_factors():
  with pytest.raises(ValueError, match=r"cores=4 but row_factors=\(10, 10, 10\) give 3 cores"):
    planner.make_backend(
      "tt(rank=4, cores=4, row_factors=(10, 10, 10), dim_factors=(2, 2, 2))", SPEC
    )
  g = planner.make_backend(
    "tt(rank=4, cores=3, row_factors=(10, 10, 10), dim_factors=(2, 2, 2))", SPEC
  )
  assert g.members["t"].shape.num_cores == 3
  assert planner.make_backend("tt(rank=4, cores=2)", SPEC).members["t"].shape.num_cores == 2


def test_tt_cache_warmup_needs_a_cache():
  with pytest.raises(ValueError, match="cache_warmup=5 .* no cache"):
    planner.make_backend("tt(rank=4, cache_warmup=5)", SPEC)
  assert (
    planner.make_backend("tt(rank=4, cache_rows=10, cache_warmup=5)", SPEC)
    .members["t"]
    .cache_warmup
    == 5
  )


@pytest.mark.parametrize("kind", ["row", "column"])
def test_sharded_profile_only_with_table_wise_placement(tmp_path, kind):
  specs = [base.TableSpec(name=f"T{i}", num_rows=100, dim=8) for i in range(4)]
  profile = tmp_path / "lookups.json"
  profile.write_text(json.dumps({"T0": 40, "T1": 40, "T2": 1, "T3": 1}))
  mesh = sharding.make_mesh(1, 2)
  with pytest.raises(ValueError, match=f"profile=.*kind={kind}.*drop profile="):
    planner.make_group(f"sharded(kind={kind}, profile='{profile}')", specs, mesh)
  planner.make_group(f"sharded(kind=table, profile='{profile}')", specs, mesh)  # honoured


@pytest.mark.parametrize(
  "text, valid",
  [
    ("dense(shards=rows)", "shard"),
    ("tt(ranks=4)", "rank"),
    ("offload(cache=10)", "cache_rows"),
    ("hot_cold(budgett=0.1)", "budget"),
    # Options that had one allowed value: gone, so unknown.
    ("offload(cache_rows=10, host_memory='pinned_host')", "cache_rows"),
    ("hot_cold(budget=0.1, host_memory='pinned_host')", "budget"),
    ("hot_cold(budget=0.1, prefetch=True)", "budget"),
    ("sharded(kinds=row)", "kind"),
  ],
)
def test_unknown_option_lists_the_valid_ones(text, valid):
  mesh = sharding.make_mesh(1, 2) if text.startswith("sharded") else None
  with pytest.raises(ValueError, match=f"valid options: .*{valid}"):
    planner.make_group(text, [SPEC], mesh)


@pytest.mark.parametrize(
  "text, match",
  [
    # Given for both directions and overridden in both: nothing would use it.
    ("sharded(codec=int8, fwd_codec=fp16, bwd_codec=none)", "codec=int8 is overridden"),
    ("sharded(codec=eb, eb=1e-3, fwd_eb=1e-2, bwd_eb=1e-2)", "eb=0.001 is overridden"),
    # A fixed bound belongs to the eb codec.
    ("sharded(codec=int8, fwd_eb=1e-3)", "fwd bound 0.001 .* error bound for codec=eb"),
  ],
)
def test_sharded_codec_options_that_nothing_uses_are_refused(text, match):
  with pytest.raises(ValueError, match=match):
    planner.make_group(text, [SPEC], sharding.make_mesh(1, 2))
  planner.make_group("sharded(codec=int8, fwd_codec=fp16)", [SPEC], sharding.make_mesh(1, 2))


def test_hot_cold_reprofile_needs_a_budget_under_one():
  with pytest.raises(ValueError, match="reprofile=2 re-picks the hot set, but budget=1"):
    planner.make_group("hot_cold(budget=1.0, reprofile=2)", [SPEC])
  planner.make_group("hot_cold(budget=0.5, reprofile=2)", [SPEC])  # honoured


def test_offload_refuses_a_window_its_planner_cannot_mark():
  """The compiled planner marks a slot's window position in 16 bits: a lookahead past the
  bound is refused, not silently mixed up with another batch's."""
  with pytest.raises(ValueError, match=r"lookahead must be <= 4096, got 70000"):
    planner.make_group("offload(cache_rows=10, lookahead=70000)", [SPEC])
  planner.make_group("offload(cache_rows=10, lookahead=4096)", [SPEC])  # honoured


@pytest.mark.parametrize(
  "text, match",
  [
    ("dense(shard=3)", r"shard=3 must be a str"),
    ("tt(rank=4.5)", r"rank=4.5 must be an int or a tuple of int"),
    ("offload(cache_rows=10, lookahead=True)", r"lookahead=True must be an int"),
    ("hot_cold(split=0)", r"split=0 must be a bool"),
  ],
)
def test_an_option_of_the_wrong_type_names_the_type(text, match):
  with pytest.raises(ValueError, match=match):
    planner.make_group(text, [SPEC])


@pytest.mark.parametrize("name", ["dense", "tt", "offload", "hot_cold", "sharded"])
def test_each_backend_declares_its_options_in_one_frozen_dataclass(name):
  """Every option has a default and a line in the dataclass's docstring; the backend keeps
  the parsed options."""
  # offload's registered class is the group of its per-table backends.
  cls = offload.Offload if name == "offload" else planner.backend_class(name)
  options = cls.Options
  assert dataclasses.is_dataclass(options) and options.__dataclass_params__.frozen
  for f in dataclasses.fields(options):
    assert f.default is not dataclasses.MISSING, f.name
    assert f"    {f.name}: " in options.__doc__, f"{name}: option {f.name} is not documented"


# ----------------------------------------------------------------------------- plan form


@pytest.mark.parametrize(
  "plan,rules",
  [
    ("auto", [(".*", "auto")]),
    (("auto",), [(".*", "auto")]),  # what --config.embeddings.plan=auto gives
    (("tt(rank=8)",), [(".*", "tt(rank=8)")]),
    (((".*", "dense"),), [(".*", "dense")]),
    ([["C1", "offload(cache_fraction=0.1)"], [".*", "dense"]],  # as config.json holds it
     [("C1", "offload(cache_fraction=0.1)"), (".*", "dense")]),
  ],
)  # fmt: skip
def test_a_plan_is_rules_or_one_backend_for_every_table(plan, rules):
  assert planner.rules_of(plan) == rules


@pytest.mark.parametrize(
  "plan", [(".*", "dense"), ((".*",),), ((".*", "dense", "x"),), (), ("",), 5, ((1, "dense"),)]
)
def test_a_malformed_plan_is_refused_naming_the_form(plan):
  with pytest.raises(ValueError, match=r"expected a list of \(regex over table names, backend"):
    planner.rules_of(plan)


def test_plan_auto_on_the_command_line_reads_as_one_rule():
  """`--config.embeddings.plan=auto` (a tuple field given one string) is auto for every table,
  and a resume's config comparison reads it as the rules it means."""
  import run
  from recgnn.train import checkpoint

  config = run.apply_overrides(run.load_config("dlrm_kaggle"), ["--config.embeddings.plan=auto"])
  assert planner.rules_of(config.embeddings.plan) == [(".*", "auto")]
  saved = {"embeddings": {"plan": [[".*", "auto"]]}}
  assert checkpoint.config_differences(saved, {"embeddings": {"plan": ["auto"]}}) == []
  assert checkpoint.config_differences(saved, {"embeddings": {"plan": ["dense"]}})
