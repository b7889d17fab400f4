"""hot_cold (Hotline): exact against dense (multi-table groups, mean pooling, eval batches,
migrations, checkpoint + resume on another mesh), the popular split, stats, the shared access
profiler, and the trainer's micro-batched step."""

import functools

import contract_lib as contract
import jax
import numpy as np
import pytest

from recgnn import planner, sharding
from recgnn.embeddings import access_counts as profile
from recgnn.embeddings import base
from recgnn.train import inputs

SGD = base.OptimizerSpec(name="sgd", learning_rate=0.1)
ADAGRAD = base.OptimizerSpec(name="rowwise_adagrad", learning_rate=0.1, initial_accumulator=0.1)
TEXT = "hot_cold(budget=0.3, profile_batches=2, reprofile=2)"
# 64 examples per device on 8 devices: enough popular ones per device for a popular
# micro-batch (its size is the popular count less hot_cold.MARGIN standard deviations).
# Row-wise Adagrad at this batch size differs from dense by 1 ulp (its mean over D is
# reduced in another order for another number of rows), so Adagrad tests run batches of 64.
SPLIT_BATCH = 512


def _specs(opt, pooling="sum"):
  """Tables a and b of one group, both `pooling`; "mixed": a sums, b takes the mean (both
  poolings in one program: one case checks both)."""
  pa, pb = ("sum", "mean") if pooling == "mixed" else (pooling, pooling)
  return [
    base.TableSpec(name="a", num_rows=1000, dim=8, optimizer=opt, pooling=pa),
    base.TableSpec(name="b", num_rows=300, dim=4, optimizer=opt, pooling=pb),
  ]


def _batches(specs, n=6, batch=64, bag=3, seed=1):
  out = [dict() for _ in range(n)]
  for i, s in enumerate(specs):
    for k, ids in enumerate(contract.zipf_ids(seed + i, n, batch, bag, s.num_rows)):
      out[k][s.name] = ids
  return out


def _run_group(text, specs, batches, mesh, *, evals=(), group=None, state=None, start=0, stop=None):
  """contract.run for a group of tables: the trainer's prepare driver (look-ahead + run-ahead),
  jitted lookup / update (donated), eval batches (lookup only) before the listed steps."""
  stop = len(batches) if stop is None else stop
  if group is None:
    group = planner.make_group(text, specs, mesh)
    state = group.init(jax.random.key(0))
  plan = planner.Plan({group.name: group}, {s.name: group.name for s in specs}, group.mesh)
  lookup = jax.jit(group.lookup)
  update = jax.jit(group.update, donate_argnums=0)
  stream = []
  for k in range(start, len(batches)):
    if k in evals:
      stream.append(("eval", "valid", {"ids": batches[(k + 3) % len(batches)]}))
    stream.append(("train", None, {"ids": batches[k]}))
  looked, k = [], start
  for item in inputs.run_ahead(inputs.prepare_stream(plan, stream), base.PREFETCH):
    if k >= stop:
      break
    prepared = contract.put_prepared(group, item.prepared[group.name], group.mesh)
    pooled, residuals = lookup(state, prepared)
    looked.append({n: np.asarray(v) for n, v in pooled.items()})
    if item.kind == "train":
      g = {n: contract.grads_for(k * 7 + i, v) for i, (n, v) in enumerate(sorted(pooled.items()))}
      state = group.after_update(update(state, prepared, residuals, g))
      k += 1
  state = group.sync(state)
  return looked, group.tables(state), group, state


def test_told_batches_make_the_ring_the_first_step_needs():
  """`expect_batches` (the trainer's, before it builds the state: setup.build) makes the
  device ring of recent write-backs at the rows train batches need, so the first train
  step runs the program every later one runs (at [0, ...] rows the first step resized it:
  a second compile of the whole step). The same lookups and tables as a group not told."""
  specs, mesh = _specs(ADAGRAD), planner.default_mesh()
  batches = _batches(specs, n=3)
  text = "hot_cold(budget=0.3, profile_batches=4)"  # (no pick in 3 steps: one program)
  told = planner.make_group(text, specs, mesh)
  told.expect_batches({n: b.shape for n, b in batches[0].items()})
  state = told.init(jax.random.key(0))
  widths = [lst["ring"].shape[1] for lst in told.prepare(batches[0], train=True)["cold"]]
  assert [r["table"].shape[0] for r in state["ring"]] == widths and min(widths) > 0
  untold = planner.make_group(text, specs, mesh)
  assert [r["table"].shape[0] for r in untold.init(jax.random.key(0))["ring"]] == [0, 0]
  a = _run_group(text, specs, batches, mesh, group=told, state=told.init(jax.random.key(0)))
  b = _run_group(text, specs, batches, mesh)
  for x, y in zip(a[0], b[0], strict=True):
    for n in x:
      np.testing.assert_array_equal(x[n], y[n])
  for n in a[1]:
    np.testing.assert_array_equal(a[1][n], b[1][n])


@functools.cache
def dense_ref(opt, pooling="sum", n=6, batch=64, evals=()):
  """(lookups, tables) of `_run_group("dense", ...)` over `_batches(_specs(opt, pooling), n,
  batch)` on one device: the reference of every mesh's and every resume's run of one stream,
  computed once per process (each run traces and lowers its own lookup and update). Read
  only."""
  specs = _specs(opt, pooling)
  batches = _batches(specs, n=n, batch=batch)
  return tuple(_run_group("dense", specs, batches, planner.default_mesh(), evals=evals)[:2])


def planned_only(group, prepared):
  """For tests that only prepare train batches (their steps never run): hand the writer zeros
  of what each step would return (`HotCold.planned_to_host`), so later prepares find every
  write-back they wait for (the host tables' values are then meaningless)."""
  group.after_update(None, group.planned_to_host(prepared))
  return prepared


def _assert_same(got, ref):
  (la, ta), (lb, tb) = got, ref
  assert len(la) == len(lb)
  for step, (x, y) in enumerate(zip(la, lb)):
    for n in y:
      np.testing.assert_array_equal(x[n], y[n], err_msg=f"lookup {n} at {step}")
  for n in tb:
    np.testing.assert_array_equal(ta[n], tb[n], err_msg=f"table {n}")


# Adagrad on 2x4 and SGD on 1x1 in the default run (each optimizer once, the mesh that
# splits over both axes once); the other four under `-m long` (the suite's 10 minutes).
GROUP_CASES = [
  pytest.param(o, m, id=f"{o.name}-{m[0]}x{m[1]}", marks=() if (o, m) in keep else pytest.mark.long)
  for keep in [((ADAGRAD, (2, 4)), (SGD, (1, 1)))]
  for o in (SGD, ADAGRAD)
  for m in ((1, 1), (8, 1), (2, 4))
]


@pytest.mark.parametrize("opt,mesh_shape", GROUP_CASES)
def test_group_matches_dense(opt, mesh_shape):
  """Two tables in one group (an example is popular only if its ids in BOTH are hot), one
  sum-pooled and one mean-pooled, eval batches between train steps, two migrations:
  bit-identical to single-device dense. SGD's batches are large enough for popular
  micro-batches on every mesh. (Both poolings in one group: one program per case, where a
  case per pooling compiled two.)"""
  specs = _specs(opt, "mixed")
  batches = _batches(specs, batch=SPLIT_BATCH if opt is SGD else 64)
  mesh = sharding.make_mesh(*mesh_shape)
  ref = dense_ref(opt, "mixed", batch=SPLIT_BATCH if opt is SGD else 64, evals=(1, 4))
  got = _run_group(TEXT, specs, batches, mesh, evals=(1, 4))
  _assert_same(got[:2], ref[:2])
  s = got[2].stats()
  assert 0 < s["popular_fraction"] < 1 and s["migrated_rows_per_step"] > 0
  if opt is SGD:
    assert s["micro_popular_size"] > 0  # the popular micro-batch ran


@pytest.mark.parametrize("split", [True, False])
def test_split_option_same_values(split):
  specs = _specs(SGD)
  batches = _batches(specs, n=4, batch=SPLIT_BATCH)
  mesh = sharding.make_mesh(8, 1)
  text = f"hot_cold(budget=0.4, profile_batches=1, split={split})"
  ref = dense_ref(SGD, n=4, batch=SPLIT_BATCH)
  got = _run_group(text, specs, batches, mesh)
  _assert_same(got[:2], ref[:2])
  assert (got[2].stats().get("micro_popular_size", 0) > 0) == split


@pytest.mark.parametrize("mesh_shape", [(1, 1), (8, 1)], ids=lambda m: f"{m[0]}x{m[1]}")
def test_all_popular_batch_is_one_micro_batch(mesh_shape):
  """A batch whose examples are all popular runs as the popular micro-batch alone (no piece
  of 0 examples), equal to dense."""
  specs = _specs(ADAGRAD)
  batches = [_batches(specs, n=1)[0]] * 4  # profiled once: every id of the later ones hot
  ref = _run_group("dense", specs, batches, planner.default_mesh(), evals=(2,))
  text = "hot_cold(budget=1.0, profile_batches=1)"
  got = _run_group(text, specs, batches, sharding.make_mesh(*mesh_shape), evals=(2,))
  _assert_same(got[:2], ref[:2])
  s = got[2].stats()
  assert s["popular_fraction"] == 0.75 and s["micro_popular_size"] == 0.75 * 64


@pytest.mark.parametrize(
  "save,resume",
  [
    pytest.param((8, 1), (1, 1), id="8x1->1x1", marks=pytest.mark.long),
    pytest.param((1, 1), (2, 4), id="1x1->2x4", marks=pytest.mark.long),
    pytest.param((2, 4), (8, 1), id="2x4->8x1"),  # (the default run's: both axes)
  ],
)
def test_checkpoint_resume_on_another_mesh(save, resume):
  """Stop after 3 steps (a migration just planned), export the logical rows, import them on
  another mesh (numpy in between, as a checkpoint holds them) and finish: equal to an
  uninterrupted dense run; the resumed backend re-profiles and migrates again."""
  specs = _specs(ADAGRAD)
  batches = _batches(specs, n=7)
  ref = dense_ref(ADAGRAD, n=7)
  first = _run_group(TEXT, specs, batches, sharding.make_mesh(*save), stop=3)
  g1, s1 = first[2], first[3]
  saved = jax.device_get(g1.export(s1))
  g2 = planner.make_group(TEXT, specs, sharding.make_mesh(*resume))
  target = g2.logical_target()
  logical = jax.tree.map(lambda x, t: jax.device_put(x, t.sharding), saved, target)
  s2 = g2.import_(logical)
  rest = _run_group(TEXT, specs, batches, None, group=g2, state=s2, start=3)
  _assert_same((first[0] + rest[0], rest[1]), ref[:2])
  assert g2.stats()["migrated_rows_per_step"] > 0


def test_restore_rebuilds_hot_set():
  """A state restored as is (same mesh, the group's own host tables: they are numpy in the
  group, never state) keeps its hot set and continues exactly, though the input thread had
  prepared batches (and planned a migration) past the state's step: restore drops that
  bookkeeping and rebuilds it from the state's hot slots."""
  specs = _specs(SGD)
  batches = _batches(specs, n=6)
  mesh = sharding.make_mesh(8, 1)
  ref = dense_ref(SGD)
  first = _run_group("hot_cold(budget=0.1, profile_batches=2)", specs, batches, mesh, stop=3)
  g2 = first[2]
  g2.restore(first[3])
  hot = g2.hot_set()
  s2 = first[3]
  assert all(np.array_equal(g2.hot_set()[n], hot[n]) for n in hot) and hot["a"].size
  rest = _run_group("", specs, batches, None, group=g2, state=s2, start=3)
  _assert_same((first[0] + rest[0], rest[1]), ref[:2])
  assert g2.stats()["popular_fraction"] > 0  # no re-profiling needed: hot from the start


def test_popular_split_and_stats_match_numpy():
  """An example is popular iff all its non-padding ids in every table of the group are hot;
  the stats count that, the hot-access coverage and the cold rows moved. The micro-batches
  have one size per hot set (a new size recompiles the step) and no padding."""
  specs = _specs(SGD)
  # 128 examples per device: enough popular ones for a popular micro-batch (its size is the
  # popular count less hot_cold.MARGIN binomial standard deviations).
  batch, n_dev = 1024, 8
  batches = _batches(specs, n=4, batch=batch)
  mesh = sharding.make_mesh(n_dev, 1)
  g = planner.make_group("hot_cold(budget=0.2, profile_batches=1)", specs, mesh)
  g.init(jax.random.key(0))
  planned_only(g, g.prepare(batches[0]))  # profiles, picks the hot set
  g.stats()
  hot = g.hot_set()
  ids = batches[1]
  p = planned_only(g, g.prepare(ids))
  is_hot = {n: (ids[n] < 0) | np.isin(ids[n], hot[n]) for n in ids}
  popular = np.all([v.all(axis=1) for v in is_hot.values()], axis=0)
  s = g.stats()
  np.testing.assert_allclose(s["popular_fraction"], popular.mean())
  valid = sum((x >= 0).sum() for x in ids.values())
  np.testing.assert_allclose(
    s["hot_coverage"], sum((is_hot[n] & (ids[n] >= 0)).sum() for n in ids) / valid
  )
  cold = sum(np.unique(x[(x >= 0) & ~is_hot[n]]).size for n, x in ids.items())
  assert s["h2d_rows_per_step"] == cold == s["d2h_rows_per_step"]
  # The micro-batches: each device's first P0 popular examples, in batch order, then the
  # rest (its other popular examples, then the non-popular ones); every example once.
  b = batch // n_dev
  idx0, idx1 = (m["idx"].reshape(n_dev, -1) for m in p["micro"])
  p0 = idx0.shape[1]
  assert 0 < p0 <= popular.reshape(n_dev, b).sum(axis=1).min() and idx1.shape[1] == b - p0
  assert s["micro_popular_size"] == n_dev * p0 and s["micro_cold_size"] == batch - n_dev * p0
  for d in range(n_dev):
    mine = popular[d * b : (d + 1) * b]
    assert idx0[d].tolist() == np.flatnonzero(mine)[:p0].tolist()
    rest = np.flatnonzero(mine)[p0:].tolist() + np.flatnonzero(~mine).tolist()
    assert idx1[d].tolist() == rest
  # Popular examples never read a cold row: their micro-batch carries no cold ids at all.
  assert all("cold" not in e for k, e in p["micro"][0].items() if k != "idx")
  # The size holds for the next batch (one step shape); eval batches run whole.
  assert planned_only(g, g.prepare(batches[2]))["micro"][0]["idx"].shape == (
    p["micro"][0]["idx"].shape
  )
  assert "micro" not in g.prepare(batches[3], train=False)


def test_hot_rows_are_row_sharded_and_memory_reported():
  specs = _specs(ADAGRAD)
  mesh = sharding.make_mesh(2, 4)
  g = planner.make_group("hot_cold(budget=0.1)", specs, mesh)
  state = g.init(jax.random.key(0))
  hot = state["tables"]["a"]["hot"]["table"]
  assert hot.sharding.spec == sharding.P(sharding.BATCH, None)
  assert {s.data.shape for s in hot.addressable_shards} == {(hot.shape[0] // 8, 8)}
  assert hot.shape[0] == 104  # 10 % of 1000 rows = 100, rounded up to a multiple of 8
  # The host tables are the group's (numpy, one copy), never state.
  assert set(state["tables"]["a"]) == {"hot", "hot_rows"}
  assert g.memory()["a"].device_bytes == 13 * (8 * 4 + 4) + 104 * 4
  assert g.memory()["a"].host_bytes == base.aligned_rows(1000) * (8 * 4 + 4) + 1000 * 12


@pytest.mark.parametrize("reprofile", [0, 2])
def test_batch_memory_is_the_ring_the_state_holds(reprofile):
  """After train steps, the state holds on each device what `memory()` reports plus
  `batch_memory` for the batches' ids shapes: the device ring of recent write-backs
  (replicated: RING_BATCHES x min(ids, rows) rows per table, and with reprofile its hot
  slots too, each with its optimizer state). The planner and the trainer's budget check
  count it (auto.memory_of, plan.check_memory)."""
  from recgnn.backends.hot_cold import RING_BATCHES
  from recgnn.train import plan_report

  specs = _specs(ADAGRAD)
  batches = _batches(specs, n=6)
  text = f"hot_cold(budget=0.1, profile_batches=2, reprofile={reprofile})"
  *_, g, state = _run_group(text, specs, batches, planner.default_mesh())
  shapes = {s.name: batches[0][s.name].shape for s in specs}
  extra = g.batch_memory(shapes)
  hot = {"a": 100, "b": 30} if reprofile else {"a": 0, "b": 0}  # 10 % of the rows (1 device)
  # 64 x 3 = 192 ids a batch, fewer than either table's rows
  assert extra == {s.name: RING_BATCHES * (192 + hot[s.name]) * s.row_bytes for s in specs}, extra
  held, _ = plan_report.held_bytes(state)
  scalars = 2 * 4  # the group's version and stale counters (int32[] each)
  assert held == g.device_bytes() + sum(extra.values()) + scalars
  plan = planner.Plan({g.name: g}, {s.name: g.name for s in specs}, g.mesh)
  total = planner.check_memory(plan, None, shapes)
  assert total == held - scalars
  with pytest.raises(planner.PlanDoesNotFit, match="buffers sized by the batch"):
    planner.check_memory(plan, total - 1, shapes)
  assert planner.check_memory(plan, held) == g.device_bytes()  # (no shapes: memory() alone)


def test_update_is_sparse():
  spec = base.TableSpec(name="t", num_rows=200_000, dim=16, optimizer=ADAGRAD)
  batch = contract.zipf_ids(seed=0, num_batches=1, batch=256, bag=2, num_rows=spec.num_rows)[0]
  contract.assert_update_is_sparse("hot_cold(budget=0.05)", spec, batch)


def test_skipped_batch_is_detected():
  specs = _specs(SGD)
  batches = _batches(specs, n=3)
  g = planner.make_group("hot_cold(budget=0.1, profile_batches=1)", specs, planner.default_mesh())
  state = g.init(jax.random.key(0))
  g.prepare(batches[0])  # prepared, never run
  p = contract.put_prepared(g, g.prepare(batches[1]), g.mesh)
  grads = {s.name: np.zeros((64, s.dim), np.float32) for s in specs}
  residuals = jax.jit(g.lookup)(state, p)[1]
  state = jax.jit(g.update)(state, p, residuals, grads)
  with pytest.raises(RuntimeError, match="prepared for another hot / cold layout"):
    g.sync(state)


def test_bad_options_name_the_fix():
  with pytest.raises(ValueError, match="budget must be in"):
    planner.make_group("hot_cold(budget=2)", _specs(SGD))
  with pytest.raises(ValueError, match="not both"):
    planner.make_group("hot_cold(budget=0.1, hot_rows=5)", _specs(SGD))


# ----------------------------------------------------------------------------- profiler


def test_profiler_counts_ranks_and_budget():
  p = profile.AccessProfile(10)
  p.add(np.array([[1, 2, -1], [2, 3, 3]]))
  p.add(np.array([[3, 7, -1]]))
  assert p.count_of(np.arange(10)).tolist() == [0, 1, 2, 3, 0, 0, 0, 1, 0, 0]
  assert p.top(2).tolist() == [2, 3]
  assert p.top(3).tolist() == [1, 2, 3]  # ties (1 and 7 once each): the smaller id
  assert p.accesses == 7 and p.coverage(np.array([2, 3])) == 5 / 7
  sparse = profile.AccessProfile(10, sparse=True)
  for ids in ([[1, 2, -1], [2, 3, 3]], [[3, 7, -1]]):
    sparse.add(np.array(ids))
  assert sparse.count_of(np.arange(10)).tolist() == p.count_of(np.arange(10)).tolist()
  assert sparse.top(3).tolist() == p.top(3).tolist()
  q = profile.AccessProfile(5)
  q.add(np.array([0, 0, 0, 0, 4]))
  # Per byte: a row of table "q" (8 bytes) with 4 accesses beats p's rows (16 bytes).
  chosen = profile.hot_set_for_budget({"p": p, "q": q}, {"p": 16, "q": 8}, 8 + 16 + 16)
  assert chosen.rows["q"].tolist() == [0] and chosen.rows["p"].tolist() == [2, 3]
  assert chosen.bytes == 40
  capped = profile.hot_set_for_budget({"p": p}, {"p": 16}, 10_000, capacity={"p": 1})
  assert capped.rows["p"].tolist() == [3]


def test_profile_sample_takes_the_fraction():
  batches = [{"t": np.full((4, 1), i % 10)} for i in range(100)]
  prof = profile.profile_sample(batches, {"t": 10}, fraction=0.05, total=100)
  assert prof["t"].batches == 5 and prof["t"].accesses == 20


def test_offload_lfu_and_tt_cache_use_the_profiler():
  """One profiler: offload's LFU counts and tt's warm-up are AccessProfiles."""
  off = planner.make_backend("offload(cache_rows=10, policy=lfu)", _specs(SGD)[0])
  off.init(jax.random.key(0))
  off.prepare({"a": np.array([[1, 1], [2, -1]])}, [])
  lfu = off.members["a"]._planner.lfu
  assert isinstance(lfu, profile.AccessProfile)
  assert lfu.count_of(np.array([1, 2, 3])).tolist() == [1, 1, 0]  # once per batch
  tt = planner.make_backend("tt(rank=4, cache_rows=2, cache_warmup=2)", _specs(SGD)[0])
  member = tt.members["a"]
  assert isinstance(member._prep.warm, profile.AccessProfile)
  member.prepare(np.array([[5, 5], [6, -1]]))
  member.prepare(np.array([[7, 6], [6, 5]]))
  assert member._prep.hot.tolist() == [5, 6]


# ----------------------------------------------------------------------------- trainer


@pytest.fixture(scope="module")
def cache_dir(ctr_cache):
  return ctr_cache  # (conftest: one per process)


def _trainer_config(cache_dir, mesh, plan):
  from tests.trainer_lib import smoke_config

  # (4 tables: the group's two and two dense, a fraction of the 26 tables' build)
  return smoke_config(cache_dir, mesh=mesh, plan=plan, tables=4)


def test_trainer_micro_batches_and_resume_on_another_mesh(cache_dir, tmp_path):
  """The trainer's step with popular / non-popular micro-batches (two large tables one
  hot_cold group: with 32 examples per device on 8, the 7 largest leave too few popular
  examples per device for a popular micro-batch), stopped after 5 steps on 8 devices and
  resumed on 1: the params and tables of the uninterrupted all-dense 1-device run, to float
  tolerance (the loss is summed per micro-batch, in another order than over the whole
  batch)."""
  from recgnn.train import loop

  hot = (("C(3|4)", "hot_cold(budget=0.3, profile_batches=2)"), (".*", "dense"))
  ref = loop.train(_trainer_config(cache_dir, (1, 1), ((".*", "dense"),)), str(tmp_path / "ref"))
  wd = str(tmp_path / "wd")
  part = loop.train(_trainer_config(cache_dir, (8, 1), hot), wd, stop_after=5)
  assert part.metrics["step"] == 5
  group = part.plan.groups["hot_cold"]
  # The split really ran: a popular micro-batch once the hot set is migrated in.
  one = _trainer_config(cache_dir, (1, 1), hot)
  ids = next(iter(loop.load_task(one, loop.config_mesh(one)).train_batches(5)))
  p = group.prepare({n: ids["ids"][n] for n in group.specs}, train=True)
  assert p["micro"][0]["idx"].shape[0] > 0
  saved_hot = group.hot_set()
  res = loop.train(_trainer_config(cache_dir, (1, 1), hot), wd, resume=True)
  assert res.metrics["step"] == 12
  # The hot set came back from the checkpoint (extras), not from a new profile of the
  # resumed batches.
  resumed_hot = res.plan.groups["hot_cold"].hot_set()
  assert all(np.array_equal(resumed_hot[n], saved_hot[n]) for n in saved_hot)
  for x, y in zip(
    jax.tree.leaves(jax.device_get(ref.state.params)),
    jax.tree.leaves(jax.device_get(res.state.params)),
  ):
    np.testing.assert_allclose(x, y, rtol=2e-4, atol=2e-6)
  ta = {}
  for k, g in ref.plan.groups.items():
    ta.update(g.tables(ref.state.emb[k]))
  tb = {}
  for k, g in res.plan.groups.items():
    tb.update(g.tables(res.state.emb[k]))
  for n in ta:
    np.testing.assert_allclose(ta[n], tb[n], rtol=2e-4, atol=2e-6, err_msg=n)
  assert abs(ref.metrics["test/auc"] - res.metrics["test/auc"]) < 1e-3
