"""`auto(...)`'s options (`AutoOptions`), the kinds and families a candidate counts against,
and reading the auto rule off a plan's rules (`auto_options`, `placeholder_rules`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import ClassVar

from recgnn.embeddings.contract import BackendOptions
from recgnn.planner import budget as budget_lib
from recgnn.planner import plan as plan_lib

OBJECTIVES = ("time", "memory")
KINDS = ("dense", "offload", "hot_cold", "tt", "sharded")
# Backends whose groups re-plan their host lists' sizes (bucketed): each distinct string is a
# group whose shapes move on their own, and every new combination is a step to compile.
HOST_TIERS = ("offload", "hot_cold")
MICRO_BATCHES = "micro-batches"  # the family of backends that split a batch (one per plan)


def family_of(text: str) -> str | None:
  """The family whose limit a candidate counts against (`Candidate.family`)."""
  if plan_lib.capabilities_of(text).splits_batch:
    return MICRO_BATCHES
  name = plan_lib.parse_backend(text)[0]
  return name if name in HOST_TIERS else None


@dataclasses.dataclass(frozen=True)
class AutoOptions(BackendOptions):
  """`auto(...)`'s options.

  Attributes:
    budget: bytes per device for every table of the plan (the rules' fixed tables included):
      a fraction of the all-dense plan's bytes per device (0 < budget <= 1, e.g. 0.25), or a
      size ('512MiB', '2G', a number of bytes). None: the run's `device_memory_budget`, else
      no limit.
    objective: `time` (the fastest plan that fits) or `memory` (the smallest plan; ties to
      the faster).
    kinds: the backends to consider, among dense, offload, hot_cold, tt, sharded (sharded
      and dense(shard=rows) only on a mesh with a model axis).
    fractions: offload's cache and hot_cold's hot budget, as shares of each table.
    tt_ranks: the TT ranks allowed (the quality constraint: TT is a different model, so only
      ranks whose accuracy the user accepts; empty = no TT).
    batches: how many of the run's first training batches each candidate is timed on.
    measure_rows: candidates are timed on tables of at most this many rows (ids folded into
      them): past ~1M rows a sparse step's time no longer grows with the rows (DESIGN.md),
      and timing a 40M-row dense table would allocate it.
    strings_per_kind: at most this many distinct offload (and hot_cold without a split)
      strings, e.g. cache fractions, in one plan. Each is a group whose host lists are sized
      on their own (bucketed), and each new combination of the groups' sizes is another step
      program to compile: 8 host-tier groups compiled 11 programs in 200 steps of
      dlrm_kaggle, against 1-2 for one group. hot_cold with its micro-batch split is always
      one string (a batch has one split).
    finalists: how many whole plans to time as the trainer's own train step before taking
      one (`finalist_plans`: the solver's best, then of its best with one string per host
      tier, with each host tier at each fraction first, and with no host tier, the distinct
      ones that fit, the best of each kind first),
      the fastest measured taken (`recgnn.train.plan_timing`). The sum of the
      tables' steps ranks plans whose groups differ in number and kind less well than a
      whole step does (docs/planning.md). 1: the solver's plan, untimed.
    host_budget: host bytes for the tables this rule places (their host tables, caches and
      maps: `memory().host_bytes`), a size ('16G'); None: no limit. Plans over it are not
      chosen; with `ssd`, offload's SSD level is a candidate that keeps only a host cache of
      a table's rows in RAM.
    ssd: a directory on a local SSD: adds offload's SSD level as candidates,
      offload(cache_fraction=f, host_cache=h, storage='ssd:DIR') for each fraction f and each
      of `host_caches` above it (their timing writes row files there).
    host_caches: the SSD level's host caches, as shares of each table.
  """

  backend: ClassVar[str] = "auto"

  budget: float | str | None = None
  objective: str = "time"
  kinds: tuple[str, ...] = ("dense", "offload", "hot_cold")
  fractions: tuple[float, ...] = (0.005, 0.01, 0.05, 0.2)
  tt_ranks: tuple[int, ...] = ()
  batches: int = 6
  measure_rows: int = 1_000_000
  strings_per_kind: int = 2
  finalists: int = 5
  host_budget: str | None = None
  ssd: str | None = None
  host_caches: tuple[float, ...] = (0.05, 0.2)

  def __post_init__(self):
    if self.objective not in OBJECTIVES:
      raise ValueError(
        f"auto: objective must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}"
      )
    bad = sorted(set(self.kinds) - set(KINDS))
    if bad or not self.kinds:
      raise ValueError(f"auto: kinds must be among {', '.join(KINDS)}, got {self.kinds!r}")
    if "tt" in self.kinds and not self.tt_ranks:
      raise ValueError(
        "auto: kinds includes tt but tt_ranks is empty: name the TT ranks whose accuracy you "
        "accept, e.g. tt_ranks=(16, 32)"
      )
    if any(not 0 < f < 1 for f in self.fractions):
      raise ValueError(f"auto: fractions must be in (0, 1), got {self.fractions!r}")
    numeric = isinstance(self.budget, float | int) and not isinstance(self.budget, bool)
    if numeric and not 0 < self.budget <= 1:
      raise ValueError(
        f"auto: a numeric budget is a fraction of the all-dense bytes in (0, 1], got "
        f"{self.budget!r}; give a size as a string ('512MiB')"
      )
    if self.strings_per_kind < 1:
      raise ValueError(f"auto: strings_per_kind must be >= 1, got {self.strings_per_kind}")
    if self.batches < 1:
      raise ValueError(f"auto: batches must be >= 1, got {self.batches}")
    if self.ssd is not None and "offload" not in self.kinds:
      raise ValueError("auto: ssd=DIR adds offload's SSD level: keep offload in kinds")
    if any(not 0 < h <= 1 for h in self.host_caches):
      raise ValueError(f"auto: host_caches must be in (0, 1], got {self.host_caches!r}")
    if self.host_budget is not None:
      parse_bytes(self.host_budget)  # (refused here when it is not a size)
    if self.finalists < 1:
      raise ValueError(f"auto: finalists must be >= 1, got {self.finalists}")


parse_bytes = budget_lib.parse_bytes  # '512M', '2G', '1.5GiB', '1000000' -> bytes


def is_auto(text: str) -> bool:
  return plan_lib.parse_backend(" ".join(text.split()))[0] == "auto"


def auto_options(rules: Sequence[tuple[str, str]]) -> AutoOptions | None:
  """The options of the plan's `auto(...)` rule (None without one; one such rule at most:
  the budget is the whole plan's)."""
  texts = [t for _, t in rules if is_auto(t)]
  if not texts:
    return None
  if len(set(" ".join(t.split()) for t in texts)) > 1:
    raise ValueError(
      f"A plan takes one auto(...) rule (its budget is the whole plan's); got {texts}: use one "
      "regex for every table the planner may place"
    )
  return AutoOptions.parse(plan_lib.parse_backend(" ".join(texts[0].split()))[1])


def placeholder_rules(rules: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
  """The rules with `auto(...)` read as `dense`: what the input layout is chosen from before
  the planner runs (every candidate takes the batch split over the mesh, as dense does)."""
  return [(p, "dense" if is_auto(t) else t) for p, t in rules]
