"""hot_cold as a memory tier (issues 24 and 42), read off the step's HLO and the host side:
the popular micro-batch never uses a cold row (Hotline's claim: it computes from device
memory only); the host link moves what the cold ids need (a bucketed cold list read by
prepare, moved with the batch, and returned updated by the step); the cold list takes a few
shapes per run; the split says why it is off; the hot set survives a checkpoint; the profile
window comes from the data. The step holds no host computation, no host array and no table:
tests/test_host_tier.py (CPU and CUDA lowering); the ring of recent write-backs:
tests/test_hot_cold_prefetch.py."""

import json
import logging

import contract_lib as contract
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_hot_cold import (
  ADAGRAD,
  SGD,
  SPLIT_BATCH,
  _assert_same,
  _batches,
  _run_group,
  _specs,
  dense_ref,
  planned_only,
)

from benchmarks.harness import dlrm_task
from recgnn import hlo, planner, sharding
from recgnn.backends.hot_cold import hot_set, micro
from recgnn.embeddings import base, microbatch


def _init_zeros(group):
  """`group.init` with zero tables (`base.shapes_only`), for tests that only plan or lower:
  the host tables' values change no shape, and drawing them (a 65k-row chunk per table, at
  the suite's XLA -O0) was most of these tests' time."""
  with base.shapes_only():
    return group.init(jax.random.key(0))


def _prepare_stream(group, batches):
  """Every batch's prepare (train), in order, its step's write-back handed over as zeros
  (`planned_only`); the last one's prepared pytree."""
  for ids in batches:
    p = planned_only(group, group.prepare(ids, train=True))
  return p


def sized(state, prepared):
  """The state with its rings at the length the first train step gives them (the prepared
  batch's "ring" shape), so that a lowered step reads them as a steady one does."""
  rings = tuple(
    jax.tree.map(lambda x, v=lst["ring"].shape[1]: jnp.zeros((v,) + x.shape[1:], x.dtype), r)
    for r, lst in zip(state["ring"], prepared["cold"])
  )
  return {**state, "ring": rings}


def _cold_sources(names) -> list[str]:
  """The HLO parameters that carry cold rows: the rows prepare read from the host tables
  (the cold lists' "vals") and the device ring of recent write-backs."""
  return [n for n in names if ("cold" in n and "vals" in n) or n.startswith("state__ring")]


# ----------------------------------------------------------------------------- the HLO


def _micro_step(group, mesh, loss=None):
  """The trainer's micro-batched step, reduced to the embeddings: each micro-batch's loss and
  its gradient (popular first), merged back in batch order, ONE update. Returns (state,
  (loss, d loss / d pooled) of every micro-batch). loss({table: pooled}) -> scalar (default:
  a sum of sines)."""
  loss = loss or (lambda p: sum(jnp.sum(jnp.sin(v)) for v in p.values()))

  def step(state, prepared):
    parts, residuals = group.lookup_micro(state, prepared)
    outs = []
    for part in parts:
      outs.append(jax.value_and_grad(loss)(part))
    idx = group.micro_batches(prepared)
    batch = next(iter(prepared["tables"].values()))["hot_ids"].shape[0]
    g = {
      n: microbatch.merge(mesh, group.layout.split_batch, batch, idx, [o[1][n] for o in outs])
      for n in group.specs
    }
    return group.update(state, prepared, residuals, g), tuple(outs)

  return step


@pytest.mark.parametrize("mesh_shape", [(1, 1), (8, 1)], ids=lambda m: f"{m[0]}x{m[1]}")
def test_popular_micro_batch_does_not_depend_on_the_cold_rows(mesh_shape):
  """On the step's HLO: the popular micro-batch's loss and gradients use no cold row (neither
  the rows the batch brought from the host tables nor the device ring), so they compute from
  device memory only; the non-popular micro-batch's do (the control), and so does the
  update."""
  specs = _specs(SGD)
  mesh = sharding.make_mesh(*mesh_shape)
  group = planner.make_group("hot_cold(budget=0.3, profile_batches=2)", specs, mesh)
  state = group.init(jax.random.key(0))
  prepared = _prepare_stream(group, _batches(specs, n=4, batch=SPLIT_BATCH))
  state = sized(state, prepared)
  assert len(prepared["micro"]) == 2  # a popular and a non-popular micro-batch
  put = contract.put_prepared(group, prepared, mesh)
  step = _micro_step(group, mesh)
  lowered = jax.jit(step).lower(state, put)
  module = hlo.parse(lowered.compiler_ir("hlo").as_hlo_text())
  entry = module.instrs()
  root = module.root(module.entry)
  n_state = len(jax.tree.leaves(jax.eval_shape(step, state, put)[0]))
  n_micro = 1 + len(specs)  # (loss, {table: grad}) per micro-batch
  outs = root.operands[n_state:]
  assert len(outs) == 2 * n_micro
  popular, cold = outs[:n_micro], outs[n_micro:]
  params = {i.parameter: n for n, i in entry.items() if i.op == "parameter"}
  host = _cold_sources(params.values())
  assert len(host) == 2 * len(group.geometry.stacks)  # each layout's rows and its ring
  sources = host
  for out in popular:
    used = module.ancestors(out)
    assert not used & set(sources), f"{out} uses {sorted(used & set(sources))}"
  for out in cold[1:]:  # the non-popular micro-batch's gradients read the cold rows
    assert module.ancestors(out) & set(host)
  update = root.operands[:n_state]
  assert any(module.ancestors(o) & set(host) for o in update)


def test_trainer_step_runs_the_popular_micro_batch_without_the_cold_rows():
  """The trainer's own step (DLRM, two micro-batches): no matmul of the popular micro-batch's
  forward or backward uses a cold row (the rows the batch brought from the host tables, the
  ring), transitively; the non-popular micro-batch's do."""
  import optax

  from recgnn.train import step as step_lib
  from recgnn.train import train_state as state_lib

  specs = [  # DLRM's interaction needs one dim
    base.TableSpec(name="a", num_rows=1000, dim=8, optimizer=SGD),
    base.TableSpec(name="b", num_rows=300, dim=8, optimizer=SGD),
  ]
  mesh = sharding.make_mesh(1, 1)
  group = planner.make_group("hot_cold(budget=0.3, profile_batches=2)", specs, mesh)
  plan = planner.Plan({group.name: group}, {s.name: group.name for s in specs}, mesh)
  task = dlrm_task.dlrm(specs, mesh, bottom=(16, 8), top=(16, 1))
  batches = _batches(specs, n=4, batch=SPLIT_BATCH)
  rng = np.random.default_rng(0)
  batch = {
    "dense": rng.random((SPLIT_BATCH, 13), np.float32),
    "label": (rng.random(SPLIT_BATCH) < 0.3).astype(np.float32),
    "weight": np.ones(SPLIT_BATCH, np.float32),
  }
  tx = optax.sgd(0.1)
  state = state_lib.init_state(task, plan, tx, jax.random.key(0), {**batch, "ids": batches[0]})
  prepared = _prepare_stream(group, batches)
  assert len(prepared["micro"]) == 2
  state = state.replace(emb={group.name: sized(state.emb[group.name], prepared)})
  put = {group.name: contract.put_prepared(group, prepared, mesh)}
  lowered = jax.jit(step_lib.make_train_step(task, plan, tx)).lower(state, put, batch)
  module = hlo.parse(lowered.compiler_ir("hlo").as_hlo_text())
  entry = module.instrs()
  params = {i.parameter: n for n, i in entry.items() if i.op == "parameter"}
  host = set(_cold_sources(params.values()))
  assert host
  # Each micro-batch's examples are taken by its index list (a parameter named by its path):
  # the matmuls that read micro-batch m's list are its forward and backward.
  (idx0,) = [n for n in params.values() if "micro___0___idx" in n]
  (idx1,) = [n for n in params.values() if "micro___1___idx" in n]
  dots = {n: module.ancestors(n) for n, i in entry.items() if i.op == "dot"}
  popular = [n for n, used in dots.items() if idx0 in used]
  other = [n for n, used in dots.items() if idx1 in used]
  assert popular and other and not set(popular) & set(other)
  assert not any(dots[n] & host for n in popular)  # never waits for the host
  assert any(dots[n] & host for n in other)  # the control: the cold rows feed these


# ----------------------------------------------------------------------------- host link


def link_of(group, state, prepared) -> tuple[int, int]:
  """(bytes to the device, to the host) the host tier moves in one step: the rows prepare
  read from the host tables for it (the cold lists' "vals" and the migration's "in_vals",
  moved with the batch) and the rows its update returns for the host writer (TO_HOST)."""
  down = sum(x.nbytes for lst in prepared["cold"] for x in jax.tree.leaves(lst["vals"]))
  down += sum(x.nbytes for t in prepared["tables"].values() for x in jax.tree.leaves(t["in_vals"]))

  def step(state, prepared):
    pooled, res = group.lookup(state, prepared)
    return group.update(state, prepared, res, pooled)

  out = jax.eval_shape(step, state, prepared)[base.TO_HOST]
  return down, sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(out))


def _host_link(budget, steps=60, measured=30):
  """A Zipf stream through one table (row-wise Adagrad, D = 16: 68 bytes a row), its hot set
  picked after 10 batches. For each of the last `measured` steps: its host-link bytes each
  way (`link_of`, once per cold-list length) and its distinct cold ids. -> (links, cold ids
  per step, row bytes)."""
  spec = base.TableSpec(name="t", num_rows=100_000, dim=16, optimizer=ADAGRAD)
  group = planner.make_group(
    f"hot_cold(budget={budget}, profile_batches=10, split=False)", [spec], sharding.make_mesh(1, 1)
  )
  state = _init_zeros(group)
  by_len, links, cold = {}, [], []
  for k, ids in enumerate(contract.zipf_ids(0, steps, 512, 4, spec.num_rows)):
    hot = group.hot_set()["t"]  # the layout this batch is prepared for
    p = planned_only(group, group.prepare({"t": ids}, train=True))
    if k < steps - measured:
      continue
    valid = ids[ids >= 0]
    cold.append(np.unique(valid[~np.isin(valid, hot)]).size)
    n = p["cold"][0]["src"].shape[0]
    if n not in by_len:
      by_len[n] = link_of(group, sized(state, p), p)
    links.append(by_len[n])
  return np.asarray(links), np.asarray(cold), spec.row_bytes


def test_host_link_bytes_follow_the_cold_ids():
  """Zipf ids, budgets 1 %, 5 %, 20 %: the bytes each way per step (the rows the batch
  brings, the rows the step returns; the mean over 30 steps after the hot set is in) within
  1.25x of (the batch's distinct cold ids x row bytes), never below it, and falling as the
  budget grows (the cold list used to be the batch's id count whatever the budget). No index
  crosses the link: the host keeps the lists it planned."""
  got = {}
  for budget in (0.01, 0.05, 0.2):
    links, cold, row = _host_link(budget)
    to_dev, to_host = links[:, 0], links[:, 1]
    assert (to_dev >= cold * row).all() and (to_host >= cold * row).all()
    need = cold.mean() * row
    got[budget] = (to_dev.mean() / need, to_host.mean() / need, cold.mean(), to_dev.mean())
    assert to_dev.mean() <= 1.25 * need and to_host.mean() <= 1.25 * need, (budget, got)
  print("budget: (to_device / need, to_host / need, cold ids, to_device bytes)", got)
  dev = [got[b][3] for b in (0.01, 0.05, 0.2)]
  assert dev[0] > dev[1] > dev[2], got


# ----------------------------------------------------------------------------- shapes


def test_bucket_sizes():
  assert [hot_set.bucket(n) for n in (0, 1, 8, 9, 15, 16, 17, 33, 1000, 1025)] == [
    8, 8, 8, 9, 15, 16, 18, 36, 1024, 1152,
  ]  # fmt: skip
  for n in range(1, 5000):
    assert n <= hot_set.bucket(n) < 1.125 * n + 8


def test_buckets_grow_at_once_and_shrink_after_a_while():
  b = hot_set.Buckets(patience=3)
  assert b(100, 10_000) == 104  # the first need's bucket
  assert b(500, 10_000) == 512  # grows at once
  assert b(100, 10_000) == 512  # a decision point: the window (100, 500, 100) needs 512
  assert [b(130, 10_000) for _ in range(3)] == [512, 512, 144]  # stable: the largest's
  assert b(100, 50) == 50  # never more than the cap (the batch's ids / the table's rows)
  b.reset()
  assert b(300, 10_000) == 320  # a new regime: its first need + 1/16 sets the length


def test_zipf_stream_compiles_a_few_shapes():
  """200 steps of a Zipf stream with a migration and re-picks, two tables of different dims
  (two cold lists): the cold lists take a few lengths (the step's shapes), not one per
  batch. Printed for the report."""
  specs = _specs(ADAGRAD)
  group = planner.make_group(
    "hot_cold(budget=0.05, profile_batches=10, reprofile=50)", specs, planner.default_mesh()
  )
  group.init(jax.random.key(0))
  needs = set()
  for ids in _batches(specs, n=200, batch=512, bag=3):
    p = planned_only(group, group.prepare(ids, train=True))
    assert len(p["cold"]) == 2  # one list per row layout (dims 8 and 4)
    needs.add(tuple(int(c["off"][-1]) for c in p["cold"]))
  shapes = group.cold_shapes
  s = group.stats()
  assert s["cold_list_shapes"] == len(shapes)
  assert s["h2d_rows_per_step"] <= s["cold_list_rows_per_step"]
  print(f"cold-list shapes over 200 steps: {len(shapes)} ({sorted(shapes)}); distinct needs "
        f"{len(needs)}")  # fmt: skip
  assert len(shapes) <= 12 and len(needs) > 5 * len(shapes)


T26, N26, WARM26, STEPS26 = 26, 50_000, 50, 150


@pytest.fixture(scope="module")
def stream26():
  specs = [
    base.TableSpec(name=f"t{i}", num_rows=N26, dim=16, optimizer=ADAGRAD) for i in range(T26)
  ]
  data = [contract.zipf_ids(i, STEPS26, 256, 4, N26) for i in range(T26)]
  return specs, [{s.name: data[i][k] for i, s in enumerate(specs)} for k in range(STEPS26)]


def test_26_tables_one_list_few_shapes_bytes_follow_the_cold_ids(stream26):
  """A dlrm_kaggle-like group (26 tables, Zipf ids, batch 256 x 4) at 1 %, 5 %, 20 % budgets,
  100 steps after the hot set is in: at most 6 distinct step signatures (every prepared
  leaf's shape; measured: 1), and the cold list's rows (x row bytes: what the host link
  carries each way, checked on the last step's inputs and outputs) within 1.25x of the
  batches' distinct cold ids (measured 1.05-1.14x), falling as the budget grows. Each table
  sized apart made a signature per combination of the 26 widths. (The tables are zeros: a
  plan never reads a value.)"""
  specs, batches = stream26
  rows, sigs = {}, {}
  for budget in (0.01, 0.05, 0.2):
    group = planner.make_group(
      f"hot_cold(budget={budget}, profile_batches=40)", specs, planner.default_mesh()
    )
    state = _init_zeros(group)
    listed = need = 0
    seen = set()
    for k, ids in enumerate(batches):
      hot = group.hot_set()
      p = planned_only(group, group.prepare(ids, train=True))
      if k < WARM26:
        continue
      seen.add(tuple(np.shape(x) for x in jax.tree.leaves(p)))
      (cold,) = p["cold"]  # one layout: one list
      listed += cold["src"].shape[0]
      step_need = 0
      for n, x in ids.items():  # (a mask per table: np.isin sorted the hot set every time)
        is_hot = np.zeros(N26, bool)
        is_hot[hot[n]] = True
        v = x[x >= 0]
        step_need += np.unique(v[~is_hot[v]]).size
      assert int(cold["off"][-1]) == step_need
      need += step_need
    rows[budget], sigs[budget] = listed / need, len(seen)
    assert len(seen) <= 6, (budget, len(seen))
    assert 1 <= listed / need <= 1.25, (budget, listed / need)
    sigs[budget, "cold"] = need

  # The last step's link (one list for the 26 tables): the list's rows each way, nothing
  # else (no index: the host keeps the lists it planned).
  w = cold["src"].shape[0]
  assert link_of(group, sized(state, p), p) == (w * specs[0].row_bytes, w * specs[0].row_bytes)
  print("list rows / cold ids:", rows, "signatures:", sigs)
  assert sigs[0.01, "cold"] > sigs[0.05, "cold"] > sigs[0.2, "cold"]


def _cold_rows_per_step(budget, profile_batches, batches):
  """A one-table group's mean cold-list rows (what the host link carries each way, x row
  bytes: the HLO tests above) over the batches after its hot set is in, and its hot_fill."""
  spec = base.TableSpec(name="t", num_rows=20_000, dim=16, optimizer=ADAGRAD)
  group = planner.make_group(
    f"hot_cold(budget={budget}, profile_batches={profile_batches}, split=False)",
    [spec],
    planner.default_mesh(),
  )
  _init_zeros(group)
  rows = []
  for k, ids in enumerate(batches):
    p = planned_only(group, group.prepare({"t": ids}, train=True))
    if k > profile_batches:
      rows.append(p["cold"][0]["src"].shape[0])
  return float(np.mean(rows)), group.stats()["hot_fill"], group.hot_set()["t"]


def test_hot_set_holds_the_rows_the_profile_saw(caplog):
  """Why benchmarks/memory_tiers.py's hot_cold moved the same bytes at 5% and 20% budgets:
  a hot set is picked among the rows its profile saw (a row never accessed has no claim),
  and its 4-batch profile saw fewer rows than a 5% budget holds, so both budgets picked
  the same rows. Here: a one-batch profile (at most 1024 ids) under both the 5% (1000
  rows) and 20% (4000) budgets of a 20k-row table: the same hot set, the same cold lists,
  hot_fill < 1, logged. A 40-batch profile fills both: the cold lists fall from 5% to 20%
  (Zipf ids; the HLO's bytes follow the lists, test_host_link_bytes_follow_the_cold_ids)."""
  batches = contract.zipf_ids(3, 80, 256, 4, 20_000)
  with caplog.at_level(logging.INFO):
    short = {b: _cold_rows_per_step(b, 1, batches) for b in (0.05, 0.2)}
  assert "a longer profile_batches fills more" in caplog.text
  np.testing.assert_array_equal(short[0.05][2], short[0.2][2])
  assert short[0.05][0] == short[0.2][0]
  assert short[0.05][1] < 1 and short[0.2][1] < 1
  long = {b: _cold_rows_per_step(b, 40, batches) for b in (0.05, 0.2)}
  show = lambda d: {k: v[:2] + (v[2].size,) for k, v in d.items()}  # noqa: E731
  print("budget: (cold-list rows per step, hot_fill, hot rows), 1-batch profile:",
        show(short), "40 batches:", show(long))  # fmt: skip
  assert long[0.05][1] == 1 and long[0.2][1] == 1
  assert long[0.05][0] > long[0.2][0]
  assert short[0.05][0] > long[0.05][0]


# ----------------------------------------------------------------------------- the split


def test_split_off_says_why(caplog, monkeypatch):
  """Too few popular examples per device for a popular micro-batch: the batch runs whole and
  the log says why (once per group), not silently."""
  from absl import logging as absl_logging

  monkeypatch.setattr(micro, "OFF_LOG", micro.OffLog())
  h = np.zeros((8, 4), bool)
  h[0, 0] = True
  p0s = {}
  tables = {"t": {"hot_ids": np.zeros((32, 1), np.int32), "cold_ids": np.zeros((32, 1))}}
  with caplog.at_level(logging.WARNING):
    absl_logging.use_python_logging()
    assert micro.split(p0s, tables, h.reshape(-1), 8, 4) is None
    assert micro.split(p0s, tables, h.reshape(-1), 8, 4) is None
  msgs = [r.getMessage() for r in caplog.records if "split off" in r.getMessage()]
  assert len(msgs) == 1 and "1 popular example(s)" in msgs[0] and "0 on the device" in msgs[0]
  reason = micro.off_reason(np.zeros((8, 4), bool), 4, 8)
  assert "no popular example" in reason


def test_split_off_logged_once_per_group_then_counted(caplog, monkeypatch):
  """The split-off warning: the first batch a group (its backend string) runs whole, with the
  reason, then a count every OFF_EVERY such batches; not again for a new hot set (p0s starts
  over) or another group built with the same string (the planner builds one per candidate it
  times, and each runs before any hot set: 129 lines in a 100-step plan=auto run). Through the
  backend too: two groups of one string preparing their profile phase's batches log once."""
  from absl import logging as absl_logging

  monkeypatch.setattr(micro, "OFF_LOG", micro.OffLog(every=10))
  nobody = np.zeros(8 * 4, bool)
  tables = {"t": {"hot_ids": np.zeros((32, 1), np.int32), "cold_ids": np.zeros((32, 1))}}
  with caplog.at_level(logging.WARNING):
    absl_logging.use_python_logging()
    p0s: dict = {}
    for k in range(25):
      if k % 5 == 0:  # a new hot set every 5 batches
        p0s = {}
      assert micro.split(p0s, tables, nobody, 8, 4, "hot_cold(budget=0.1)") is None
    assert micro.split({}, tables, nobody, 8, 4, "hot_cold(budget=0.2)") is None
  msgs = [r.getMessage() for r in caplog.records if "split off" in r.getMessage()]
  first = [m for m in msgs if "logged once for this group" in m]
  counts = [m for m in msgs if "batches run whole so far" in m]
  assert [m.split(":")[0] for m in first] == ["hot_cold(budget=0.1)", "hot_cold(budget=0.2)"]
  assert "no popular example" in first[0]
  assert ["10 batches" in counts[0], "20 batches" in counts[1], len(counts)] == [True, True, 2]
  assert micro.OFF_LOG.counts == {"hot_cold(budget=0.1)": 25, "hot_cold(budget=0.2)": 1}

  specs = _specs(SGD)
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    for _ in range(2):  # two groups of one string, each in its profile phase (nothing hot)
      group = planner.make_group("hot_cold(budget=0.1)", specs, sharding.make_mesh(1, 1))
      group.init(jax.random.key(0))
      for ids in _batches(specs, n=3):
        assert "micro" not in planned_only(group, group.prepare(ids, train=True))
  msgs = [r.getMessage() for r in caplog.records if "split off" in r.getMessage()]
  assert len(msgs) == 1 and msgs[0].startswith(group.describe()), msgs
  assert micro.OFF_LOG.counts[group.describe()] == 6


# ----------------------------------------------------------------------------- checkpoint


def restored(group, state, text, specs, mesh):
  """(group, state) of `text` on `mesh` restored from `group`'s `state` as a checkpoint holds
  it: the logical tables (export / import_) and the JSON extras (restore_extras)."""
  saved = jax.device_get(group.export(state))
  extras = json.loads(json.dumps(group.extras(state)))
  g = planner.make_group(text, specs, mesh)
  target = g.logical_target()
  s = g.import_(jax.tree.map(lambda x, t: jax.device_put(x, t.sharding), saved, target))
  return g, g.restore_extras(s, extras)


@pytest.mark.parametrize(
  "save,resume",
  [pytest.param((8, 1), (1, 1), marks=pytest.mark.long), ((1, 1), (2, 4))],
  ids=str,
)
def test_hot_set_in_the_checkpoint(save, resume):
  """The hot set goes into the checkpoint's metadata (`extras`, JSON) and comes back on
  another mesh (`restore_extras` after `import_`): the resumed run starts from the same hot
  rows, without re-profiling, and stays bit-equal to dense."""
  specs = _specs(ADAGRAD)
  batches = _batches(specs, n=7)
  text = "hot_cold(budget=0.1, profile_batches=2)"
  ref = dense_ref(ADAGRAD, n=7)
  first = _run_group(text, specs, batches, sharding.make_mesh(*save), stop=4)
  g1, s1 = first[2], first[3]
  hot = g1.hot_set()
  assert hot["a"].size
  g2, s2 = restored(g1, s1, text, specs, sharding.make_mesh(*resume))
  assert all(np.array_equal(g2.hot_set()[n], hot[n]) for n in hot)
  rest = _run_group(text, specs, batches, None, group=g2, state=s2, start=4)
  _assert_same((first[0] + rest[0], rest[1]), ref[:2])
  s = g2.stats()
  assert s["popular_fraction"] > 0 and s["migrated_rows_per_step"] == 0  # no new profile


def test_hot_set_that_does_not_fit_is_profiled_again():
  specs = _specs(SGD)
  g = planner.make_group("hot_cold(budget=0.01, profile_batches=2)", specs, planner.default_mesh())
  state = g.init(jax.random.key(0))
  big = {"hot_set": {"a": hot_set.encode_rows(np.arange(500)), "b": hot_set.encode_rows([])}}
  assert g.restore_extras(state, big) is state and not g.hot_set()["a"].size


def test_rows_encoding_round_trips():
  rows = np.sort(np.random.default_rng(0).choice(10_000_000, 50_000, replace=False))
  assert np.array_equal(hot_set.decode_rows(hot_set.encode_rows(rows)), rows)
  assert hot_set.decode_rows(hot_set.encode_rows(np.zeros(0, np.int64))).size == 0


# ----------------------------------------------------------------------------- profile window


def test_hotline_profile_window_from_the_data():
  from experiments import hotline_kaggle

  c = hotline_kaggle.get_config()
  steps = hotline_kaggle.steps_per_epoch(c)
  assert steps == 1674  # the synthetic default: 4M rows, 6/7 train, batch 2048
  assert f"profile_batches={round(0.05 * steps)}" in c.embeddings.plan[0][1]
  c.data.synthetic.rows, c.train.batch_size = 700_000, 1000
  assert hotline_kaggle.steps_per_epoch(c) == 600
  assert "profile_batches=30" in hotline_kaggle.hot_cold_text(
    hotline_kaggle.parse_arg(None), hotline_kaggle.steps_per_epoch(c)
  )
