"""`auto(...)`: pick each table's backend for a per-device memory budget from measured costs.

A plan rule whose backend string is `auto(...)` hands its tables to this planner:

  config.embeddings.plan = (("C(3|4)", "tt(rank=32)"), (".*", "auto(budget=0.25)"))

For each such table the planner lists candidate placements (`candidates`): dense (and
dense(shard=rows) / sharded when the mesh has a model axis), offload and hot_cold at a few cache
/ hot fractions, tt at the ranks the user accepts (TT changes the model: only ranks named in
`tt_ranks`, the quality constraint, are candidates). Each candidate's bytes per device and on
the host come from the backend's own `memory()` (nothing allocated); its cost is the measured
time of that table's train step (lookup + update, the backend alone on the run's mesh, on the
run's first batches: `measure`) and the host time of its `prepare` (which the trainer's input
thread runs beside the step). The search is a multiple-choice knapsack solved exactly as an
integer program (scipy.optimize.milp, HiGHS): minimize the sum of step times (objective=time)
or of device bytes (objective=memory) with one candidate per table and the bytes per device
within the budget. A budget no choice can meet is refused before anything is allocated,
naming the smallest budget that fits and the tables that force it.

The per-table costs add: the step of the chosen plan is predicted as the sum of its tables'
own shares of their steps and each group's fixed part once (`group_overhead`), plus the model
part (the MLPs and the interaction: the same for every plan, timed once and kept in the cost
cache with the tables' figures, `cached_model_seconds`) and the input thread's prepare. That
ignores what XLA fuses across tables and what overlaps, which the plan report
(`PlanChoice.report`) says next to the figures.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import ClassVar

import jax
import numpy as np

from recgnn import sharding
from recgnn.embeddings.contract import BackendOptions, Layout
from recgnn.embeddings.specs import TableSpec
from recgnn.planner import budget as budget_lib
from recgnn.planner import plan as plan_lib

OBJECTIVES = ("time", "memory")
KINDS = ("dense", "offload", "hot_cold", "tt", "sharded")
# Backends whose groups re-plan their host lists' sizes (bucketed): each distinct string is a
# group whose shapes move on their own, and every new combination is a step to compile.
HOST_TIERS = ("offload", "hot_cold")
# An offload cache is a candidate only when it holds this many times the most distinct rows
# of the first batches: later batches touch a few percent more or fewer (a hand-written
# plan at exactly the first batches' most failed 400 steps in on dlrm_kaggle, 1135 > 1134).
OFFLOAD_HEADROOM = 1.25
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
    fractions: offload's cache and hot_cold's hot budget, as shares of each table (hot_cold
      at each with its prefetch and without: `prefetch=False` holds no buffer of a batch's
      cold rows, `Backend.batch_memory`).
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
      whole step does (multi-group plans of dlrm_kaggle measured 11-19% above their sum,
      single-group ones within ~10%). 1: the solver's plan, untimed.
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
    if self.finalists < 1:
      raise ValueError(f"auto: finalists must be >= 1, got {self.finalists}")


parse_bytes = budget_lib.parse_bytes  # '512M', '2G', '1.5GiB', '1000000' -> bytes


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One placement of one table: its plan string, bytes and measured costs (seconds per step:
  the device step of this table alone, and its host-side prepare)."""

  table: str
  text: str
  device_bytes: int
  host_bytes: int
  step_s: float = float("nan")
  prepare_s: float = float("nan")
  # Candidates of one family share a limit on how many distinct backend strings (groups) the
  # plan may hold (`solve`'s limits): those that split a batch into micro-batches (hot_cold;
  # a batch has one split) and the host tiers, whose list sizes each group re-plans (every
  # new combination of group shapes is a step program to compile). None: no limit.
  family: str | None = None


def candidates(spec: TableSpec, options: AutoOptions, mesh: jax.sharding.Mesh) -> list[str]:
  """The plan strings worth trying for one table (duplicates and ones that are the same as
  dense for this table, e.g. a cache holding every row, left out)."""
  _, model = sharding.mesh_shape(mesh)
  out = []
  if "dense" in options.kinds:
    out.append("dense")
    if model > 1:
      out.append("dense(shard=rows)")
  if "sharded" in options.kinds and model > 1:
    out.append("sharded")
  for f in options.fractions:
    if f * spec.num_rows < 1:
      continue
    if "offload" in options.kinds:
      out.append(f"offload(cache_fraction={f})")
    if "hot_cold" in options.kinds:
      # and without its prefetch buffer (a batch's cold rows on every device: at small
      # budgets more than the hot rows themselves)
      out += [f"hot_cold(budget={f})", f"hot_cold(budget={f}, prefetch=False)"]
  if "tt" in options.kinds:
    out += [f"tt(rank={r})" for r in options.tt_ranks]
  return out


def memory_of(
  text: str, spec: TableSpec, mesh, layout: Layout, ids_shape: tuple[int, ...] | None = None
) -> tuple[int, int]:
  """(bytes per device, host bytes) of `text` for `spec`, from the backend's own `memory`,
  and with ids_shape (a train batch's ids of this table, global) the buffers its state
  comes to hold for such batches (`batch_memory`, e.g. hot_cold's prefetch)."""
  group = plan_lib.make_group(text, [spec], mesh, layout)
  mem = group.memory()[spec.name]
  extra = group.batch_memory({spec.name: tuple(ids_shape)}) if ids_shape is not None else {}
  return mem.device_bytes + extra.get(spec.name, 0), mem.host_bytes


def ids_shapes(batches: Sequence[dict[str, np.ndarray]]) -> dict[str, tuple[int, ...]]:
  """{table: the largest ids shape of `batches`} (train batches' ids)."""
  out: dict[str, tuple[int, ...]] = {}
  for b in batches:
    for t, ids in b.items():
      shape = tuple(np.shape(ids))
      out[t] = max(out.get(t, shape), shape, key=lambda x: int(np.prod(x)))
  return out


def measure(
  text: str,
  spec: TableSpec,
  batches: Sequence[np.ndarray],
  mesh,
  layout: Layout,
  measure_rows: int,
  copies: int = 1,
) -> tuple[float, float]:
  """(median device step seconds, median prepare seconds) of `text` for `spec` alone on
  `mesh`: the backend's lookup and update (the gradient is the pooled lookup) on each of
  `batches` (ids int[B] or [B, L]), the table folded to `measure_rows` rows; timed on a second
  pass over the batches, after a first that compiled every step shape they need. copies > 1:
  that many copies of the table in one group (same ids), for the group's own cost
  (`group_overhead`)."""
  rows = min(spec.num_rows, measure_rows)
  names = [spec.name] if copies == 1 else [f"{spec.name}__{i}" for i in range(copies)]
  smalls = [dataclasses.replace(spec, name=n, num_rows=rows) for n in names]
  group = plan_lib.make_group(text, smalls, mesh, layout)
  ahead = group.lookahead
  fold = [np.where(b >= 0, b % rows, b) if rows < spec.num_rows else b for b in batches]
  state = group.init(jax.random.key(0))

  # The state donated, as the trainer's step donates it: without, every update would copy
  # the whole table (O(rows) per step: 2 ms for a 1M-row one here) where the trainer's
  # scatters in place.
  @functools.partial(jax.jit, donate_argnums=0)
  def step(state, prepared):
    pooled, res = group.lookup(state, prepared)
    return group.update(state, prepared, res, {n: pooled[n] for n in names})

  steps, preps = [], []
  # Two passes over the batches: the first compiles every step shape they need (and warms a
  # cache), the second is timed.
  for timed in (False, True):
    for i, ids in enumerate(fold):
      upcoming = [{n: u for n in names} for u in fold[i + 1 : i + 1 + ahead]]
      t0 = time.perf_counter()
      prepared = group.prepare({n: ids for n in names}, upcoming, train=True)
      t1 = time.perf_counter()
      prepared = jax.device_put(prepared)
      jax.block_until_ready(prepared)
      t2 = time.perf_counter()
      state = step(state, prepared)
      jax.block_until_ready(state)
      t3 = time.perf_counter()
      if timed:
        steps.append(t3 - t2)
        preps.append(t1 - t0)
  return float(np.median(steps)), float(np.median(preps))


# Part of every cost cache key: raised whenever `measure` changes what it times, so figures
# timed the old way are not reused.
MEASURE_VERSION = 2


# Part of the model part's key: raised whenever `recgnn.train.step.model_step_seconds`
# changes what it times.
MODEL_VERSION = 1


def _digest(arrays: Sequence[np.ndarray]) -> str:
  h = hashlib.sha256()
  for b in arrays:
    a = np.ascontiguousarray(b)
    h.update(str((a.dtype.str, a.shape)).encode())
    h.update(a.tobytes())
  return h.hexdigest()


def _where(mesh) -> tuple:
  """(mesh shape, platform, device kind, jax version): the part of a key naming where it ran."""
  dev = mesh.devices.flat[0]
  return (
    tuple(mesh.devices.shape),
    dev.platform,
    getattr(dev, "device_kind", ""),
    jax.__version__,
  )


class CostCache:
  """Measured (step s, prepare s) of candidates, and the model part's seconds (`model_key`),
  kept in a JSON file across runs: a second run with the same tables, ids, mesh and software
  (every part of the key) reuses the first run's figures instead of timing again, and so also
  makes the same choice and the same prediction. The file is rewritten whole (a temporary
  file renamed over it), so a killed run leaves it readable."""

  def __init__(self, path: str):
    self.path = os.path.expanduser(path)
    self.hits = self.misses = 0
    try:
      with open(self.path) as f:
        self.entries: dict[str, list[float]] = json.load(f)
    except FileNotFoundError:
      self.entries = {}
    except ValueError as e:
      raise ValueError(f"auto: cost cache {self.path} is not readable JSON ({e}); remove it") from e

  @staticmethod
  def key(text, spec: TableSpec, ids: Sequence[np.ndarray], mesh, layout, measure_rows) -> str:
    """A candidate's key: its text, table, ids, mesh, layout and software (in the order
    keys have always had, so that existing cache files stay valid)."""
    shape, *software = _where(mesh)
    parts = (
      MEASURE_VERSION,
      " ".join(text.split()),
      repr(spec),
      min(spec.num_rows, measure_rows),
      _digest(ids),
      shape,
      repr(layout),
      *software,
    )
    return hashlib.sha256(repr(parts).encode()).hexdigest()

  @staticmethod
  def model_key(what: str, batches: Sequence, mesh) -> str:
    """The model part's key (`cached_model_seconds`): `what` (the task, its model and
    optimizer config, the tables' dims: what sets the cost of the step's shared part, never
    the plan), every array of `batches` (their batch size, shapes and values), mesh and
    software."""
    leaves = [np.asarray(x) for b in batches for x in jax.tree.leaves(b)]
    parts = (MODEL_VERSION, "model part", what, _digest(leaves), *_where(mesh))
    return hashlib.sha256(repr(parts).encode()).hexdigest()

  def get(self, key: str) -> tuple[float, float] | None:
    v = self.entries.get(key)
    if v is None:
      self.misses += 1
      return None
    self.hits += 1
    return float(v[0]), float(v[1])

  def put(self, key: str, value: tuple[float, float]) -> None:
    self.entries[key] = [float(value[0]), float(value[1])]
    os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
    tmp = f"{self.path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
      json.dump(self.entries, f)
    os.replace(tmp, self.path)


def cached_model_seconds(cache: CostCache | None, key: str, measure: Callable[[], float]) -> float:
  """The model part's seconds (`PlanChoice.model_s`), or a finalist's whole step
  (`PlanChoice.whole_step_s`), through `cache` under `key` (`CostCache.model_key`): timed
  once, then the same figure for every run of the experiment.
  Timed in each run's own process it moved from run to run more than any plan's tables did
  (two runs of dlrm_kaggle predicted 36% and 46% high from it alone, the same plans within
  13% in the next round), and it is in every plan's prediction."""
  hit = cache.get(key) if cache else None
  if hit is not None:
    return hit[0]
  out = float(measure())
  if cache:
    cache.put(key, (out, 0.0))
  return out


def timed_cost(
  batches: Sequence[dict[str, np.ndarray]],
  mesh,
  layout: Layout,
  measure_rows: int,
  cache: CostCache | None = None,
) -> Callable[..., tuple[float, float]]:
  """The planner's default cost, (text, spec, copies=1) -> (step s, prepare s): `measure` on
  the run's batches, through `cache` if given."""

  def cost(text: str, spec: TableSpec, copies: int = 1) -> tuple[float, float]:
    ids = [b[spec.name] for b in batches]
    tag = text if copies == 1 else f"{text} x{copies}"
    key = CostCache.key(tag, spec, ids, mesh, layout, measure_rows) if cache else ""
    hit = cache.get(key) if cache else None
    if hit is not None:
      return hit
    out = measure(text, spec, ids, mesh, layout, measure_rows, copies)
    if cache:
      cache.put(key, out)
    return out

  return cost


GROUP_COPIES = 4  # tables in the group timed for each backend string's own cost


def group_overhead(
  alone: float, cost: Callable[..., tuple[float, float]], text: str, spec: TableSpec
) -> float:
  """Seconds a group of `text` costs whatever its tables (its program's fixed part, dispatch
  included), from the step of `spec` alone (`alone`) and of GROUP_COPIES copies of it in one
  group: with c(k) = a + k b, a = c(1) - (c(k) - c(1)) / (k - 1), kept within [0, c(1)]. A
  table timed alone carries a; in the train step its group pays a once, however many tables
  it holds (26 dense tables are one group, one gather, one scatter)."""
  many = cost(text, spec, GROUP_COPIES)[0]
  per_table = max(many - alone, 0.0) / (GROUP_COPIES - 1)
  return min(max(alone - per_table, 0.0), alone)


def shared_cores(mesh) -> int | None:
  """The host cores a CPU mesh computes on (which the input thread shares), else None."""
  if mesh.devices.flat[0].platform != "cpu":
    return None
  return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def dispatch_seconds(mesh, calls: int = 50) -> float:
  """Median seconds of a jitted call that computes nothing worth timing, on `mesh`."""
  x = sharding.put(
    np.zeros((8,), np.float32), jax.sharding.NamedSharding(mesh, sharding.REPLICATED)
  )
  f = jax.jit(lambda x: x + 1)
  jax.block_until_ready(f(x))
  times = []
  for _ in range(calls):
    t0 = time.perf_counter()
    x = jax.block_until_ready(f(x))
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


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
  # `recgnn.train.step.model_step_seconds`), None when not measured.
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
    budget = "none" if self.budget_bytes is None else _mib(self.budget_bytes)
    beside = (
      f" + prepare / {self.shared_cores} cores" if self.shared_cores else ", prepare beside it"
    )
    model = (
      ""
      if self.model_s is None
      else f" + model part {self.model_s * 1e3:.2f} ms{beside} = train step "
      f"{self.predicted_step_s * 1e3:.2f} ms"
    )
    what = (
      "plan as written" if self.objective == "given" else f"auto plan (objective={self.objective})"
    )
    lines = [
      f"{what}: {_mib(self.device_bytes)} per device of budget "
      f"{budget} (all dense: {_mib(self.all_dense_bytes)}); predicted: embeddings "
      f"{self.embedding_step_s * 1e3:.2f} ms (tables' measured steps added){model}; input "
      f"thread's prepare {self.prepare_s * 1e3:.2f} ms per batch; planned in "
      f"{self.planning_s:.1f} s",
      f"{'table':<12} {'choice':<32} {'per device':>10} {'host':>10} {'step ms':>8} "
      f"{'prep ms':>8}  runner-up",
    ]
    if self.finalists:
      lines[1:1] = [
        f"finalists timed whole ({len(self.finalists)}; the fastest taken): "
        + "; ".join(
          f"{label}: {what}, predicted {p * 1e3:.1f} ms, measured {m * 1e3:.1f} ms"
          for label, what, p, m in self.finalists
        )
      ]
    for t, c in self.chosen.items():
      r = self.runner_up.get(t)
      alt = f"{r.text} ({_mib(r.device_bytes)}, {r.step_s * 1e3:.2f} ms)" if r is not None else "-"
      lines.append(
        f"{t:<12} {c.text:<32} {_mib(c.device_bytes):>10} {_mib(c.host_bytes):>10} "
        f"{c.step_s * 1e3:>8.2f} {c.prepare_s * 1e3:>8.2f}  {alt}"
      )
    return "\n".join(lines)

  def as_dict(self) -> dict:
    return {
      "objective": self.objective,
      "budget_bytes": self.budget_bytes,
      "all_dense_bytes": self.all_dense_bytes,
      "device_bytes": self.device_bytes,
      "predicted_step_s": self.predicted_step_s,
      "embedding_step_s": self.embedding_step_s,
      "model_s": self.model_s,
      "device_step_s": self.device_step_s,
      "shared_cores": self.shared_cores,
      "dispatch_s": self.dispatch_s,
      "overhead_s": self.overhead_s,
      "prepare_s": self.prepare_s,
      "planning_s": self.planning_s,
      "label": self.label,
      "whole_step_s": self.whole_step_s,
      "finalists": [
        {"label": a, "placed": b, "predicted_step_s": p, "whole_step_s": m}
        for a, b, p, m in self.finalists
      ],
      "chosen": {t: dataclasses.asdict(c) for t, c in self.chosen.items()},
      "fixed": {t: dataclasses.asdict(c) for t, c in self.fixed.items()},
      "runner_up": {
        t: dataclasses.asdict(c) if c is not None else None for t, c in self.runner_up.items()
      },
    }


def _exact(name: str) -> str:
  return "".join("\\" + ch if not (ch.isalnum() or ch == "_") else ch for ch in name)


def _mib(n: float) -> str:
  return f"{n / 2**20:,.1f}M"


def solve(
  options_by_table: dict[str, list[Candidate]],
  budget_bytes: int | None,
  objective: str,
  limits: dict[str, int] | None = None,
  group_s: dict[str, float] | None = None,
) -> dict[str, Candidate]:
  """One candidate per table minimizing the objective with the bytes per device within
  `budget_bytes`: an integer program, binary x[t, c], sum_c x[t, c] = 1, sum bytes <= budget;
  and for each family f in `limits`, at most limits[f] distinct backend strings among its
  candidates (binary y[s] >= x[t, c] for every c of string s, sum_{s in f} y[s] <= limits[f]).
  group_s: seconds a backend string costs once if any table takes it (a group's fixed part:
  objective time adds group_s[s] y[s]); the candidates' step_s are then their own shares.
  Refuses (PlanDoesNotFit) a budget below the smallest choice, naming the tables that force
  it. Ties go to the other measure (time: fewer bytes; memory: less time)."""
  from scipy import optimize, sparse

  limits, group_s = limits or {}, group_s or {}
  tables = list(options_by_table)
  smallest = {t: min(c.device_bytes for c in cs) for t, cs in options_by_table.items()}
  if budget_bytes is not None and sum(smallest.values()) > budget_bytes:
    need = sum(smallest.values())
    worst = sorted(smallest.items(), key=lambda kv: -kv[1])[:5]
    raise budget_lib.PlanDoesNotFit(
      f"auto plan: no choice of placements fits {_mib(budget_bytes)} per device; the smallest "
      f"plan needs {_mib(need)} ({need:,} bytes). Tables forcing it (their smallest "
      "placement): "
      + ", ".join(
        f"{t} {_mib(b)} ({min(options_by_table[t], key=lambda c: c.device_bytes).text})"
        for t, b in worst
      )
      + ". Raise the budget, add smaller kinds (tt with tt_ranks, smaller fractions) or split "
      "tables over a model axis of the mesh."
    )
  flat = [(i, c) for i, t in enumerate(tables) for c in options_by_table[t]]
  nbytes = np.array([c.device_bytes for _, c in flat], float)
  secs = np.array([c.step_s for _, c in flat], float)
  # Variables: x (one per candidate), then y (one per distinct backend string of a limited
  # family or with a group cost).
  limited = sorted(
    {(c.family or "", c.text) for _, c in flat if c.family in limits or group_s.get(c.text)}
  )
  nx, ny = len(flat), len(limited)
  ysecs = np.array([group_s.get(t, 0.0) for _, t in limited], float)
  scale = max(secs.max(initial=0.0), ysecs.max(initial=0.0), 1e-12)
  if objective == "time":
    # tie-break: among equal times, fewer bytes (a weight far below any measured difference)
    cost = secs / scale + 1e-6 * nbytes / max(nbytes.max(), 1.0)
    ycost = ysecs / scale
  else:
    cost = nbytes / max(nbytes.max(), 1.0) + 1e-6 * secs / scale
    ycost = 1e-6 * ysecs / scale
  one = sparse.csr_array(
    (np.ones(nx), ([i for i, _ in flat], np.arange(nx))), shape=(len(tables), nx + ny)
  )
  constraints = [optimize.LinearConstraint(one, 1, 1)]
  if budget_bytes is not None:
    row = np.concatenate([nbytes, np.zeros(ny)])[None, :]
    constraints.append(optimize.LinearConstraint(row, -np.inf, budget_bytes))
  if ny:
    # x[t, c] - y[string of c] <= 0; per family, sum of its y <= its limit.
    index = {key: j for j, key in enumerate(limited)}
    ks = [k for k, (_, c) in enumerate(flat) if (c.family or "", c.text) in index]
    link = sparse.lil_array((len(ks), nx + ny))
    for r, k in enumerate(ks):
      c = flat[k][1]
      link[r, k] = 1
      link[r, nx + index[(c.family or "", c.text)]] = -1
    constraints.append(optimize.LinearConstraint(link.tocsr(), -np.inf, 0))
    families = sorted({f for f, _ in limited if f in limits})
    if families:
      count = sparse.lil_array((len(families), nx + ny))
      for j, (f, _) in enumerate(limited):
        if f in limits:
          count[families.index(f), nx + j] = 1
      caps = np.array([limits[f] for f in families], float)
      constraints.append(optimize.LinearConstraint(count.tocsr(), -np.inf, caps))
  res = optimize.milp(
    np.concatenate([cost, ycost]),
    constraints=constraints,
    integrality=np.ones(nx + ny),
    bounds=optimize.Bounds(0, 1),
  )
  if not res.success:
    # The byte check above cannot see the families' limits: name them.
    raise budget_lib.PlanDoesNotFit(
      f"auto plan: no plan fits {_mib(budget_bytes or 0)} per device within the limits on "
      f"distinct backend strings {limits} (a batch has one micro-batch split; each host-tier "
      f"group is its own set of step programs); solver: {res.message}. Raise the budget, "
      "`strings_per_kind`, or allow other kinds."
    )
  pick = np.flatnonzero(res.x[:nx] > 0.5)
  return {tables[flat[k][0]]: flat[k][1] for k in pick}


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


def choose(specs: Sequence[TableSpec], options: AutoOptions, mesh, layout: Layout, batches, **kw):
  """The solver's plan of `specs` (`choose_finalists`' first: no whole step timed)."""
  return choose_finalists(specs, options, mesh, layout, batches, **kw)[0]


def choose_finalists(
  specs: Sequence[TableSpec],
  options: AutoOptions,
  mesh,
  layout: Layout,
  batches: Sequence[dict[str, np.ndarray]],
  *,
  fixed_bytes: int = 0,
  fixed_splits: bool = False,
  all_dense_bytes: int | None = None,
  budget_bytes: int | None = None,
  cost: Callable[[str, TableSpec], tuple[float, float]] | None = None,
  cache: CostCache | None = None,
  log: Callable[[str], None] = lambda s: None,
) -> list[PlanChoice]:
  """Up to `options.finalists` plans of `specs` (the tables the auto rule matched), distinct,
  each the solver's best of one variant of the candidates (`finalist_plans`), the best over
  every kind first (which a budget nothing fits refuses, with the numbers). batches: the run's first
  training batches ({table: ids}); fixed_bytes: bytes per device of the tables other rules
  placed (they count against the budget); fixed_splits: one of those splits batches into
  micro-batches (then no auto table may: a batch has one split); all_dense_bytes: the
  all-dense plan's bytes per device of every table (what a fractional budget is a fraction
  of; default: these tables'). budget_bytes: the budget when the options give none (the
  run's device_memory_budget). cost: (text, spec) -> (step s, prepare s), default `measure`
  on `batches` through `cache` (tests pass a model)."""
  if "sharded" in options.kinds and sharding.mesh_shape(mesh)[1] == 1:
    raise ValueError(
      f"auto: kinds includes sharded, but mesh {sharding.describe(mesh)} has no model axis to "
      "shard over: drop it or set mesh.model > 1"
    )
  started = time.perf_counter()
  memo: dict[tuple[str, str], tuple[int, int]] = {}
  shapes = ids_shapes(batches)
  dense_bytes = 0
  by_table: dict[str, list[tuple[str, int, int]]] = {}
  for spec in specs:
    rows = []
    # An offload cache must hold one batch's distinct rows (the backend refuses a batch that
    # touches more): caches short of the first batches' most, with headroom for the later
    # batches' spread, are not candidates.
    most = max((np.unique(b[spec.name][b[spec.name] >= 0]).size for b in batches), default=0)
    need = most * OFFLOAD_HEADROOM
    for text in candidates(spec, options, mesh):
      name, opts = plan_lib.parse_backend(text)
      if name == "offload" and opts.get("cache_fraction", 1.0) * spec.num_rows < need:
        continue
      try:
        dev, host = memo.setdefault(
          (text, spec.name), memory_of(text, spec, mesh, layout, shapes.get(spec.name))
        )
      except ValueError as e:  # a placement this table cannot take (the backend says why)
        log(f"auto: {spec.name}: {text} left out ({e})")
        continue
      rows.append((text, dev, host))
    if not rows:
      raise ValueError(f"auto: no candidate placement is valid for table {spec.name!r}")
    by_table[spec.name] = rows
    dense_bytes += memory_of("dense", spec, mesh, layout)[0]
  all_dense = (dense_bytes + fixed_bytes) if all_dense_bytes is None else all_dense_bytes
  budget = options.budget
  if budget is None:
    total_budget = budget_bytes
  elif isinstance(budget, str) and budget.strip().endswith("%"):
    total_budget = int(all_dense * float(budget.strip()[:-1]) / 100)
  elif isinstance(budget, str):
    total_budget = parse_bytes(budget)
  else:
    total_budget = int(all_dense * float(budget))
  avail = None if total_budget is None else total_budget - fixed_bytes
  if avail is not None and avail < 0:
    raise budget_lib.PlanDoesNotFit(
      f"auto plan: the tables other rules place take {_mib(fixed_bytes)} per device, more than "
      f"the budget {_mib(total_budget)}"
    )
  # Time only what could be chosen: candidates smaller than the budget left.
  dispatch = 0.0
  measured = cost is None
  if cost is None:
    dispatch = dispatch_seconds(mesh)
    cost = timed_cost(batches, mesh, layout, options.measure_rows, cache)

  options_by_table: dict[str, list[Candidate]] = {}
  n = sum(len(v) for v in by_table.values())
  done = itertools.count(1)
  t0 = time.perf_counter()
  for spec in specs:
    cs = []
    for text, dev, host in by_table[spec.name]:
      if avail is not None and dev > avail:
        next(done)
        continue
      try:
        step_s, prep_s = cost(text, spec)
      except ValueError as e:  # e.g. a cache smaller than one batch's distinct rows
        log(f"auto: {spec.name}: {text} left out ({e})")
      else:
        cs.append(Candidate(spec.name, text, dev, host, step_s, prep_s, family_of(text)))
      k = next(done)
      if k % 10 == 0 or k == n:
        log(f"auto: timed {k}/{n} candidates ({time.perf_counter() - t0:.0f} s)")
    if not cs:  # every candidate of this table alone exceeds the budget
      cs = [Candidate(spec.name, t, d, h, family=family_of(t)) for t, d, h in by_table[spec.name]]
    options_by_table[spec.name] = cs
  limits = {kind: options.strings_per_kind for kind in HOST_TIERS}
  limits[MICRO_BATCHES] = 0 if fixed_splits else 1
  overhead = {}
  if measured:  # (a model's costs have no group part)
    timed = {(c.text, t): c.step_s for t, cs in options_by_table.items() for c in cs}
    texts = [text for (text, _), v in timed.items() if v == v]
    overhead = overheads(texts, specs, cost, lambda text, s: timed.get((text, s.name)), log)
  # The solver sees what the predicted step counts (`PlanChoice.predicted_step_s`): each
  # table's own share, its prepare spread over the cores on CPU devices (the input thread
  # computes on the same cores), and each group's fixed part once (group_s).
  cores = shared_cores(mesh)

  def seen(c: Candidate) -> float:
    prep = c.prepare_s / cores if cores and c.prepare_s == c.prepare_s else 0.0
    return _share(c, overhead, dispatch) + prep

  shares = {
    t: [dataclasses.replace(c, step_s=seen(c)) for c in cs] for t, cs in options_by_table.items()
  }
  group_s = {t: max(a - dispatch, 0.0) for t, a in overhead.items()}
  solved = []  # (label, picked, limits, kept) of each variant the budget can meet, distinct
  for label, kept, lims in finalist_plans(shares, options, limits):
    try:
      picked = solve(kept, avail, options.objective, lims, group_s)
    except budget_lib.PlanDoesNotFit as e:
      if not solved:  # the solver's own plan: a budget nothing fits, refused with the numbers
        raise
      log(f"auto: no {label} plan fits ({str(e).split(';')[0]})")
      continue
    if any(all(picked[s.name].text == p[s.name].text for s in specs) for _, p, _, _ in solved):
      continue  # the same plan as another variant's
    solved.append((label, picked, lims, kept))
  # The solver's own plan; then the best of each kind of variant (one string per tier, each
  # tier first, no host tier: the sum may misrank a whole kind, and a whole step is timed to
  # catch that), then the rest, each by what the solver minimized.
  rest = sorted(solved[1:], key=lambda v: _objective(v[1], group_s, options.objective))
  best_of_kind: dict[str, tuple] = {}
  for v in rest:
    best_of_kind.setdefault(v[0].split()[0] if v[0].endswith(" first") else v[0], v)
  firsts = {id(v) for v in best_of_kind.values()}
  ordered = [solved[0], *best_of_kind.values(), *[v for v in rest if id(v) not in firsts]]
  out = []
  for label, picked, lims, kept in ordered[: options.finalists]:
    # the candidates as measured (their step alone), not their shares
    chosen = {
      s.name: next(c for c in options_by_table[s.name] if c.text == picked[s.name].text)
      for s in specs
    }
    allowed = {
      t: [c for c in cs if c.text in {k.text for k in kept[t]}]
      for t, cs in options_by_table.items()
    }
    out.append(
      PlanChoice(
        chosen=chosen,
        runner_up=runner_ups(allowed, chosen, avail, options.objective, lims),
        fixed_bytes=fixed_bytes,
        budget_bytes=total_budget,
        all_dense_bytes=all_dense,
        objective=options.objective,
        dispatch_s=dispatch,
        shared_cores=cores,
        overhead_s=overhead,
        label=label,
      )
    )
  if len(solved) > len(out):
    log(
      f"auto: {len(solved)} distinct finalist plans, the {len(out)} the solver ranks first kept "
      f"(finalists={options.finalists})"
    )
  elapsed = time.perf_counter() - started
  return [dataclasses.replace(c, planning_s=elapsed) for c in out]


def finalist_plans(
  options_by_table: dict[str, list[Candidate]], options: AutoOptions, limits: dict[str, int]
) -> list[tuple[str, dict[str, list[Candidate]], dict[str, int]]]:
  """(label, candidates per table, the families' limits) of each plan the solver gives a
  finalist for: every kind under `limits` (the solver's own plan, first); every kind with one
  backend string per host tier (fewer groups: fewer step programs and fixed parts); for each
  host tier and fraction, that tier at that fraction first (the plans a person writes: a table
  that leaves device memory goes to it, and to the other tier at the same fraction only where
  it has no such candidate, e.g. an offload cache too small for a batch's rows); no host tier
  at all. A variant that leaves a table no candidate is left out; one the budget cannot meet
  is skipped by the caller."""

  def kind(c: Candidate) -> str:
    return plan_lib.parse_backend(c.text)[0]

  def fraction(c: Candidate) -> float | None:
    name, opts = plan_lib.parse_backend(c.text)
    return opts.get("cache_fraction" if name == "offload" else "budget")

  def only(keep: Callable[[str, Candidate], bool]) -> dict[str, list[Candidate]] | None:
    out = {t: [c for c in cs if keep(t, c)] for t, cs in options_by_table.items()}
    return out if all(out.values()) else None

  def first(tier: str, f: float) -> Callable[[str, Candidate], bool]:
    has = {
      t
      for t, cs in options_by_table.items()
      if any(kind(c) == tier and fraction(c) == f for c in cs)
    }

    def keep(t: str, c: Candidate) -> bool:
      if kind(c) not in HOST_TIERS:
        return True
      return fraction(c) == f and (kind(c) == tier or t not in has)

    return keep

  one = {f: min(n, 1) for f, n in limits.items()}
  out = [("every kind", options_by_table, limits)]
  if one != limits:
    out.append(("one string per tier", options_by_table, one))
  for tier in HOST_TIERS:
    for f in options.fractions if tier in options.kinds else ():
      kept = only(first(tier, f))
      if kept is not None:
        out.append((f"{tier} {f:g} first", kept, one))
  kept = only(lambda t, c: kind(c) not in HOST_TIERS)
  if kept is not None and any(k in options.kinds for k in HOST_TIERS):
    out.append(("no host tier", kept, limits))
  return out


def _objective(picked: dict[str, Candidate], group_s: dict[str, float], objective: str):
  """What the solver minimized for `picked` (candidates with their shares as step_s): the
  finalists after the solver's own are taken in this order."""
  secs = sum(c.step_s for c in picked.values())
  secs += sum(group_s.get(t, 0.0) for t in {c.text for c in picked.values()})
  nbytes = sum(c.device_bytes for c in picked.values())
  return (secs, nbytes) if objective == "time" else (nbytes, secs)


def _share(c: Candidate, overhead: dict[str, float], dispatch: float) -> float:
  return max(c.step_s - overhead.get(c.text, dispatch), 0.0)


def overheads(
  texts: Iterable[str],
  specs: Sequence[TableSpec],
  cost: Callable[..., tuple[float, float]],
  alone: Callable[[str, TableSpec], float | None] | None = None,
  log: Callable[[str], None] = lambda s: None,
) -> dict[str, float]:
  """Each backend string's group overhead (`group_overhead`), measured on the largest table
  that can take it: the one rule for a plan the planner makes (`choose`, whose `alone` gives
  the steps it timed: candidates that fit the budget left) and one a person wrote
  (`predict_rules`: any table whose cost can be measured). alone(text, spec): the step of
  the table alone, None where it cannot be had; default `cost`'s (None on ValueError)."""

  def measured_alone(text: str, spec: TableSpec) -> float | None:
    try:
      return cost(text, spec)[0]
    except ValueError:  # e.g. a cache that cannot hold this table's batch
      return None

  alone = alone or measured_alone
  out = {}
  for text in dict.fromkeys(texts):
    for spec in sorted(specs, key=lambda s: -s.num_rows):
      step_s = alone(text, spec)
      if step_s is not None and step_s == step_s:
        out[text] = group_overhead(step_s, cost, text, spec)
        break
  if out:
    log("auto: group overheads " + ", ".join(f"{t} {a * 1e3:.2f} ms" for t, a in out.items()))
  return out


# ----------------------------------------------------------------------------- plan rules


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


def plan_rules(
  rules: Sequence[tuple[str, str]],
  specs: Sequence[TableSpec],
  mesh,
  layout: Layout,
  batches: Sequence[dict[str, np.ndarray]],
  *,
  budget_bytes: int | None = None,
  log: Callable[[str], None] = lambda s: None,
  cost: Callable[[str, TableSpec], tuple[float, float]] | None = None,
  cache: CostCache | None = None,
  model_s: float | None = None,
  time_plan: Callable[[list[tuple[str, str]], PlanChoice], float] | None = None,
) -> tuple[list[tuple[str, str]], PlanChoice]:
  """Rules with the auto rule's tables placed by the planner: one exact-name rule per table,
  before the other rules (which keep their tables). The solver's finalists
  (`choose_finalists`) are each timed whole by `time_plan(rules, choice)` (seconds per train
  step as the trainer runs it) and the fastest taken (`pick_measured`); without `time_plan`,
  or with one finalist, the solver's own plan. model_s: the model part's seconds, in every
  finalist's prediction. With many processes every process measures the tables and process
  0's solver plan is taken by all, untimed (the plan must be the same everywhere, and a
  whole-step timing would have to run in lockstep on every process)."""
  options = auto_options(rules)
  assert options is not None
  by_text = plan_lib.assign_rules(rules, specs)
  auto_specs = [s for t, ss in by_text.items() if is_auto(t) for s in ss]
  fixed, fixed_splits = 0, False
  for text, ss in by_text.items():
    if not is_auto(text):
      group = plan_lib.make_group(text, ss, mesh, layout)
      fixed += group.device_bytes()
      fixed_splits = fixed_splits or group.capabilities.splits_batch
  all_dense = sum(memory_of("dense", s, mesh, layout)[0] for s in specs)
  finalists = choose_finalists(
    auto_specs,
    options,
    mesh,
    layout,
    batches,
    fixed_bytes=fixed,
    fixed_splits=fixed_splits,
    all_dense_bytes=all_dense,
    budget_bytes=budget_bytes,
    cost=cost,
    cache=cache,
    log=log,
  )
  if jax.process_count() > 1:
    if len(finalists) > 1 and time_plan is not None:
      log(
        f"auto: {jax.process_count()} processes: the solver's plan is taken untimed (the "
        f"{len(finalists)} finalists' whole-step timing runs on one process only)"
      )
    finalists = [_agree(finalists[0], auto_specs, options, mesh, layout, batches)]
  kept = [(p, t) for p, t in rules if not is_auto(t)]
  others = [s for s in specs if s.name not in finalists[0].chosen]
  if others:  # their step is part of the predicted one too
    given = predict_rules(
      kept, others, mesh, layout, batches, measure_rows=options.measure_rows, cache=cache, cost=cost
    )
    finalists = [
      dataclasses.replace(c, fixed=given.chosen, overhead_s={**given.overhead_s, **c.overhead_s})
      for c in finalists
    ]
  finalists = [dataclasses.replace(c, model_s=model_s) for c in finalists]
  choice = finalists[0]
  if time_plan is not None and len(finalists) > 1:
    started = time.perf_counter()
    timed = []
    for k, c in enumerate(finalists, 1):
      log(f"auto: timing finalist {k}/{len(finalists)} whole ({c.label}: {c.placed})")
      timed.append(dataclasses.replace(c, whole_step_s=time_plan([*c.rules, *kept], c)))
    choice = pick_measured(timed)
    choice = dataclasses.replace(
      choice, planning_s=choice.planning_s + time.perf_counter() - started
    )
  # Exact names first: an auto table is matched by its own rule before any other rule's
  # regex that also matches it; the other rules keep their tables.
  return [*choice.rules, *kept], choice


def pick_measured(timed: Sequence[PlanChoice]) -> PlanChoice:
  """The finalist whose whole step measured fastest (ties: the solver's order), carrying
  every finalist's figures (`PlanChoice.finalists`)."""
  best = min(range(len(timed)), key=lambda i: (timed[i].whole_step_s, i))
  summary = tuple((c.label, c.placed, c.predicted_step_s, c.whole_step_s) for c in timed)
  return dataclasses.replace(timed[best], finalists=summary)


def _agree(
  choice: PlanChoice, specs, options: AutoOptions, mesh, layout, batches: Sequence[dict]
) -> PlanChoice:
  """Process 0's choice on every process (sent as indices into each table's candidate list,
  which every process builds alike); where this process measured another pick, process 0's
  is taken with its bytes and this process's step time left unknown (nan)."""
  from jax.experimental import multihost_utils

  lists = [candidates(s, options, mesh) for s in specs]
  idx = np.array([c.index(choice.chosen[s.name].text) for s, c in zip(specs, lists)], np.int32)
  idx = np.asarray(multihost_utils.broadcast_one_to_all(idx))
  chosen, shapes = dict(choice.chosen), ids_shapes(batches)
  for s, c, i in zip(specs, lists, idx):
    if c[i] != chosen[s.name].text:
      dev, host = memory_of(c[i], s, mesh, layout, shapes.get(s.name))
      chosen[s.name] = Candidate(s.name, c[i], dev, host, family=family_of(c[i]))
  return dataclasses.replace(choice, chosen=chosen)


def predict_rules(
  rules: Sequence[tuple[str, str]],
  specs: Sequence[TableSpec],
  mesh,
  layout: Layout,
  batches: Sequence[dict[str, np.ndarray]],
  *,
  measure_rows: int = AutoOptions.measure_rows,
  cache: CostCache | None = None,
  cost: Callable[[str, TableSpec], tuple[float, float]] | None = None,
) -> PlanChoice:
  """The planner's figures for a plan someone wrote (no auto rule): each table's bytes and
  measured step under the backend its rule gives it, as `choose` would have them, so a
  hand-written plan's prediction can be set against its measured step (`--plan_report`)."""
  started = time.perf_counter()
  dispatch = 0.0
  measured = cost is None
  if cost is None:
    dispatch = dispatch_seconds(mesh)
    cost = timed_cost(batches, mesh, layout, measure_rows, cache)
  chosen = {}
  shapes = ids_shapes(batches)
  by_text = plan_lib.assign_rules(rules, specs)
  for text, ss in by_text.items():
    for spec in ss:
      dev, host = memory_of(text, spec, mesh, layout, shapes.get(spec.name))
      step_s, prep_s = cost(text, spec)
      chosen[spec.name] = Candidate(spec.name, text, dev, host, step_s, prep_s, family_of(text))
  chosen = {s.name: chosen[s.name] for s in specs}
  # The same rule as `choose`'s, so a hand-written plan and the planner's agree on it.
  overhead = overheads(by_text, specs, cost) if measured else {}
  return PlanChoice(
    chosen=chosen,
    runner_up={t: None for t in chosen},
    fixed_bytes=0,
    budget_bytes=None,
    all_dense_bytes=sum(memory_of("dense", s, mesh, layout)[0] for s in specs),
    objective="given",
    dispatch_s=dispatch,
    planning_s=time.perf_counter() - started,
    shared_cores=shared_cores(mesh),
    overhead_s=overhead,
  )
