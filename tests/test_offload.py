"""The offload backend (cDLRM) beyond the shared contract (tests/test_contract.py has it in EXACT).

Checked against references: the dense backend (bit-identical tables and lookups, also across a
checkpoint and resume, on one device and on an 8x1 mesh, resumed on the same mesh or on one
device), an independent replay of the planner's exchange lists (rows moved host->device are
exactly the misses), hand-worked eviction orders, compile-time memory. Every run goes through
the trainer's own prepare driver (contract_lib.run: inputs.prepare_stream + run_ahead).
"""

import json

import contract_lib as contract
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from recgnn import planner, sharding
from recgnn.backends import offload
from recgnn.embeddings import base

SGD = base.OptimizerSpec(name="sgd", learning_rate=0.1)
ADAGRAD = base.OptimizerSpec(name="rowwise_adagrad", learning_rate=0.1, initial_accumulator=0.1)
OPTIMIZERS = [SGD, ADAGRAD]
POLICY_STRINGS = [
  "offload(cache_rows=60, policy=lru, lookahead=2)",
  "offload(cache_rows=60, policy=lfu, lookahead=2)",
  "offload(cache_rows=60, policy=lookahead, lookahead=3)",
]


def _spec(opt, num_rows=1000, dim=4):
  return base.TableSpec(name="t", num_rows=num_rows, dim=dim, optimizer=opt)


def _batches(num_batches=12, batch=32, bag=2, num_rows=1000, seed=5):
  return contract.zipf_ids(seed, num_batches, batch, bag, num_rows)


def _plan(group: base.Backend) -> planner.Plan:
  return planner.Plan({group.name: group}, {n: group.name for n in group.specs}, group.mesh)


def _assert_same_run(lookups, table, ref: contract.Trace, what):
  assert len(lookups) == len(ref.lookups), what
  for step, (a, b) in enumerate(zip(lookups, ref.lookups)):
    np.testing.assert_array_equal(a, b, err_msg=f"{what}: lookup differs at step {step}")
  np.testing.assert_array_equal(table, ref.table, err_msg=f"{what}: final table differs")


# ----------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("text", POLICY_STRINGS)
@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: o.name)
def test_exact_with_6_percent_cache(text, opt):
  """12 steps, a cache of 6% of the rows (batches touch ~45 distinct rows): equal to dense."""
  batches = _batches()
  trace = contract.assert_matches_dense(text, _spec(opt), batches)
  s = trace.backend.stats()
  assert s["t/d2h_rows_per_step"] > 0, "the cache never evicted a dirty row: test too easy"


# (mesh of the run that saves, mesh of the run that restores and resumes)
CHECKPOINT_MESHES = [((1, 1), (1, 1)), ((8, 1), (8, 1)), ((8, 1), (1, 1))]


@pytest.mark.parametrize(
  "save_mesh, resume_mesh",
  CHECKPOINT_MESHES,
  ids=lambda m: f"{m[0]}x{m[1]}",
)
@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: o.name)
def test_checkpoint_and_resume_match_uninterrupted_dense(opt, save_mesh, resume_mesh, tmp_path):
  """Sync at step 5 and keep going (the prepared-ahead batches stay valid), save with Orbax,
  restore into a fresh backend (on the same mesh, or on one device) and resume from step 5:
  both equal an uninterrupted single-device dense run, bit for bit."""
  from recgnn.train import checkpoint
  from recgnn.train import train_state as state_lib

  spec, batches, k = _spec(opt), _batches(), 5
  text = "offload(cache_rows=60, policy=lookahead, lookahead=3)"
  ref = contract.run("dense", spec, batches)
  dense_at_k = contract.run("dense", spec, batches[:k]).table
  ckpt = checkpoint.Checkpointer(str(tmp_path))

  def train_state(group, emb):
    # The checkpoint of a trainer state whose only table is this group's.
    plan = planner.Plan({"g": group}, {"t": "g"}, group.mesh)
    params = {"w": jnp.zeros((2,), jnp.float32)}
    st = state_lib.TrainState(
      step=jnp.zeros((), jnp.int32), params=params, opt_state=(), emb={"g": emb},
      key=jax.random.key(0),
    )  # fmt: skip
    return st, plan

  # Run A: sync mid-run while batches k..k+PREFETCH are already prepared, then continue.
  a = planner.make_backend(text, spec, sharding.make_mesh(*save_mesh))
  saved = []

  def sync_and_save(item, state):
    if item.kind != "train" or item.step + 1 != k:
      return None
    state = a.sync(state)
    # After sync the host tables alone describe the table (what a checkpoint saves).
    np.testing.assert_array_equal(a.export(state)["t"]["rows"][:1000], dense_at_k)
    st, plan_a = train_state(a, state)
    ckpt.save(st, k, plan_a)
    saved.append(k)
    return state

  run_a = contract.run(text, spec, batches, group=a, after=sync_and_save)
  assert saved == [k]
  _assert_same_run(run_a.lookups, run_a.table, ref, "sync mid-run")

  # Run B: a fresh process restores the checkpoint and resumes at step k.
  b = planner.make_backend(text, spec, sharding.make_mesh(*resume_mesh))
  abstract, plan_b = train_state(b, b.init(jax.random.key(123)))
  restored = ckpt.restore(abstract, plan_b, k).emb["g"]
  # The host table is the group's (numpy, one copy), never device state.
  assert "host" not in restored
  np.testing.assert_array_equal(b.export(restored)["t"]["rows"][:1000], dense_at_k)
  run_b = contract.run(text, spec, batches, group=b, state=restored, start=k)
  _assert_same_run(run_a.lookups[:k] + run_b.lookups, run_b.table, ref, "resume")
  ckpt.close()


# ----------------------------------------------------------------------------- data movement


def _replay(prepared_list, batches, cache_rows, num_rows):
  """Independent replay of the exchange lists: checks every load is a miss (not resident,
  no duplicate), every write-back is a dirty resident row, and each batch's ids point at
  the slots holding them. Returns the rows loaded per prepare."""
  slot_row = {}  # slot -> row
  dirty = set()  # rows a train batch touched since they were loaded
  loaded_per_step = []
  for ids, p in zip(batches, prepared_list):
    loaded = 0
    for phase in ("now", "next"):
      ex = p[phase]
      ex = np.asarray(ex)
      es, er = ex[offload.EVICT_SLOTS], ex[offload.EVICT_ROWS]
      ls, lr = ex[offload.LOAD_SLOTS], ex[offload.LOAD_ROWS]
      real_e, real_l = es < cache_rows, ls < cache_rows
      # (>= N: past the logical rows; host arrays may hold padding rows beyond N.)
      assert np.all(er[~real_e] >= num_rows), "padding write-backs must target no row"
      for s, r in zip(es[real_e], er[real_e]):
        assert slot_row.get(s) == r, f"write-back of row {r} from slot {s}, which holds another"
        assert r in dirty, f"row {r} written back although no batch updated it"
      resident = set(slot_row.values())
      rows = lr[real_l]
      assert len(set(rows.tolist())) == rows.shape[0], "a row loaded twice in one exchange"
      assert not resident & set(rows.tolist()), "a resident row was copied again"
      for s, r in zip(ls[real_l], rows):
        old = slot_row.get(s)
        if old is not None:
          assert old not in dirty or (s in es[real_e]), f"dirty row {old} dropped unsaved"
          dirty.discard(old)
        slot_row[s] = r
      loaded += rows.shape[0]
      if phase == "now":
        slots = np.asarray(p["ids"])
        valid = ids >= 0
        held = np.array([slot_row.get(s, -1) for s in slots[valid]])
        np.testing.assert_array_equal(held, ids[valid], err_msg="ids remapped to wrong slots")
        dirty |= set(ids[valid].tolist())
    loaded_per_step.append(loaded)
  return loaded_per_step


def _recorded_run(text, spec, batches):
  """contract.run, recording each batch's per-table prepared (the planner's exchange lists)
  in stream order."""
  record = []
  group = planner.make_backend(text, spec)

  def after(item, _):
    p = item.prepared
    record.append({**group.table_batch(p, "t"), **group.table_exchanges(p, "t")})

  trace = contract.run(text, spec, batches, group=group, after=after)
  return trace, record


@pytest.mark.parametrize("text", POLICY_STRINGS)
def test_rows_moved_equal_misses(text):
  batches = _batches(num_batches=10)
  spec = _spec(ADAGRAD)
  trace, record = _recorded_run(text, spec, batches)
  member = trace.backend.members["t"]
  loaded = _replay(record, batches, member.cache_rows, spec.num_rows)
  s = trace.backend.stats()
  assert 0 < s["t/hit_rate"] < 1
  steps = s["t/steps"]
  assert steps == len(batches)
  assert sum(loaded) == s["t/h2d_rows_per_step"] * steps == s["t/misses_per_step"] * steps
  # The device agrees with the host bookkeeping about which row sits in which slot.
  slot_rows = np.asarray(trace.state["slot_rows"][0])
  host_plan = member._planner
  np.testing.assert_array_equal(
    slot_rows, np.where(host_plan.slot_row >= 0, host_plan.slot_row, spec.num_rows)
  )


def test_large_cache_loads_each_row_once():
  """With a cache as large as the table, the only misses are first touches: the rows moved
  host->device at each step are exactly the rows no earlier batch touched."""
  batches = _batches(num_batches=8)
  spec = _spec(SGD)
  trace, record = _recorded_run("offload(cache_rows=1000, lookahead=1)", spec, batches)
  loaded = _replay(record, batches, trace.backend.members["t"].cache_rows, spec.num_rows)
  # prepare(j) loads batch j+1's new rows (batch 0's are loaded on demand by prepare 0).
  seen, expected = set(), []
  for j, ids in enumerate(batches):
    new = set(ids[ids >= 0].tolist()) - seen
    seen |= new
    if j == 0:
      expected.append(len(new))
    else:
      expected[-1] += len(new)
      expected.append(0)
  assert loaded == expected
  assert trace.backend.stats()["t/d2h_rows_per_step"] == 0


def test_write_back_is_what_makes_it_exact(monkeypatch):
  """Mutation check: dropping write-backs must break exactness (the contract check can fail)."""
  admit = offload.Planner.admit

  def no_write_back(self, *a, **kw):
    ex = admit(self, *a, **kw)
    z = np.zeros(0, np.int32)
    return offload.Exchange(
      evict_slots=z, evict_rows=z, load_rows=ex.load_rows, load_slots=ex.load_slots
    )

  monkeypatch.setattr(offload.Planner, "admit", no_write_back)
  with pytest.raises(AssertionError):
    contract.assert_matches_dense(POLICY_STRINGS[0], _spec(SGD), _batches(num_batches=8))


# ----------------------------------------------------------------------------- policies


def _planner(policy):
  p = offload.Planner(num_rows=10, cache_rows=3, policy=policy)
  for t, rows in enumerate([[0, 1, 2], [0], [1]]):
    p.admit(np.array(rows), t, [])
  return p  # last use: row 2 at t=0, row 0 at t=1, row 1 at t=2


def test_lru_evicts_least_recently_used():
  ex = _planner("lru").admit(np.array([5]), 3, [])
  assert ex.load_rows.tolist() == [5] and ex.hits == 0
  p = _planner("lru")
  p.dirty[:] = True
  ex = p.admit(np.array([5]), 3, [])
  assert ex.evict_rows.tolist() == [2]


def test_lfu_evicts_least_frequent():
  p = _planner("lfu")
  p.dirty[:] = True
  p.freq[[0, 1, 2]] = [1, 3, 5]
  assert p.admit(np.array([5]), 3, []).evict_rows.tolist() == [0]


def test_lookahead_keeps_rows_needed_in_window():
  p = _planner("lookahead")
  p.dirty[:] = True
  # LRU would evict row 2; it is needed in two batches, so row 0 (not needed) goes.
  assert p.admit(np.array([5]), 3, [np.array([7]), np.array([2])]).evict_rows.tolist() == [0]
  # Every resident row is needed: the one needed farthest ahead goes (Belady).
  p = _planner("lookahead")
  p.dirty[:] = True
  window = [np.array([1]), np.array([2]), np.array([0])]
  assert p.admit(np.array([5]), 3, window).evict_rows.tolist() == [0]


def test_batch_larger_than_cache_names_the_size():
  backend = planner.make_backend("offload(cache_rows=10)", _spec(SGD))
  backend.init(jax.random.key(0))
  ids = np.arange(24, dtype=np.int32).reshape(12, 2)
  with pytest.raises(ValueError, match=r"touches 24 distinct rows.*cache_rows>=24"):
    backend.prepare({"t": ids}, [])


@pytest.mark.parametrize(
  "text, match",
  [
    ("offload", "exactly one of cache_rows"),
    ("offload(cache_rows=10, policy=fifo)", "unknown policy 'fifo'"),
    ("offload(cache_rows=10, policy=lookahead, lookahead=0)", "needs lookahead>=1"),
  ],
)
def test_bad_options_name_the_fix(text, match):
  with pytest.raises(ValueError, match=match):
    planner.make_backend(text, _spec(SGD))


# ----------------------------------------------------------------------------- eval batches


@pytest.mark.parametrize("prefetch", [0, contract.PREFETCH], ids=lambda p: f"prefetch{p}")
def test_eval_batches_read_only_and_stale_plans_detected(prefetch):
  spec, batches = _spec(ADAGRAD), _batches(num_batches=6)
  evalb = _batches(num_batches=1, batch=64, seed=9)[0]  # ~100 distinct rows: more than C
  text = "offload(cache_rows=60, policy=lru, lookahead=1)"
  ref = contract.run("dense", spec, batches)

  # An eval batch before train step 3, prepared with train=False in stream order by the
  # shared driver (with and without run-ahead): its lookups equal the table, and training
  # continues exactly. Sync right after it, while train batches are prepared ahead.
  group = planner.make_backend(text, spec)
  checked = []

  def sync_and_check_eval(item, state):
    if item.kind != "eval":
      return None
    state = group.sync(state)
    contract.assert_lookups_equal_table(
      item.pooled, group.tables(state)["t"], evalb, rtol=1e-6, atol=1e-7
    )
    checked.append(item.step)
    return state

  trace = contract.run(
    text, spec, batches, prefetch=prefetch, evals={3: evalb}, group=group, after=sync_and_check_eval
  )
  assert checked == [3]
  _assert_same_run(trace.lookups[:3] + trace.lookups[4:], trace.table, ref, "with eval")
  assert 0 <= group.stats()["t/eval_hit_rate"] < 1

  # The same eval batch prepared as a train batch and never updated: sync refuses.
  group = planner.make_backend(text, spec)

  def stray_train_prepare(item, state):
    if item.kind == "train" and item.step == 2:
      group.prepare({"t": evalb[:20]}, [{"t": batches[3]}])  # its update never runs

  with pytest.raises(RuntimeError, match="train=False"):
    contract.run(text, spec, batches, prefetch=prefetch, group=group, after=stray_train_prepare)


def test_read_only_prepare_before_init_has_the_shapes_of_one_after():
  """The trainer prepares an example eval batch before `init` (to lay out and check its
  transfer); a train batch before init is an error."""
  spec, ids = _spec(SGD), _batches(num_batches=1, batch=64)[0]
  b = planner.make_backend("offload(cache_rows=60)", spec)
  with pytest.raises(RuntimeError, match="call init"):
    b.prepare({"t": ids})
  before = b.prepare({"t": ids}, train=False)
  assert "t/eval_hit_rate" not in b.stats()  # the layout probe is not an eval batch
  b.init(jax.random.key(0))
  after = b.prepare({"t": ids}, train=False)
  assert jax.tree.structure(before) == jax.tree.structure(after)
  for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
    assert np.shape(x) == np.shape(y) and np.asarray(x).dtype == np.asarray(y).dtype
  assert b.stats()["t/eval_hit_rate"] == 0  # after init: counted, and nothing resident yet


# ----------------------------------------------------------------------------- memory


@pytest.mark.parametrize("mesh_shape", [(1, 1), (8, 1)], ids=lambda m: f"{m[0]}x{m[1]}")
def test_placement_and_memory_report(mesh_shape):
  spec = _spec(ADAGRAD, num_rows=100_000, dim=16)
  b = planner.make_backend("offload(cache_fraction=0.01)", spec, sharding.make_mesh(*mesh_shape))
  assert b.members["t"].cache_rows == 1000
  with base.shapes_only():  # (zero tables: values change no placement or size)
    state = b.init(jax.random.key(0))
  m = b.memory()["t"]
  assert m.device_bytes == 1000 * spec.row_bytes + 1000 * 4 + 8
  assert m.host_bytes >= spec.table_bytes
  # Per device: every device of the mesh holds the whole cache, slot map and scalars.
  dev = jax.tree.leaves([state[k] for k in ("cache", "slot_rows", "version", "stale")])
  for d in b.mesh.devices.flat:
    held = sum(s.data.nbytes for x in dev for s in x.addressable_shards if s.device == d)
    assert held == m.device_bytes
  # The table is host RAM (numpy, one copy), never part of the device state.
  assert "host" not in state
  assert not any(x.size >= spec.num_rows for x in jax.tree.leaves(state))
  assert isinstance(b.tables(state)["t"], np.ndarray)
  # A budget a tenth of the table: dense is refused, offload fits.
  budget = spec.table_bytes // 10
  with pytest.raises(planner.PlanDoesNotFit):
    planner.check_memory(planner.resolve_plan([(".*", "dense")], [spec], b.mesh, log=False), budget)
  assert planner.check_memory(_plan(b), budget) == m.device_bytes


def test_update_is_sparse_and_holds_no_table():
  """The step's scratch memory and every array it reads or writes are O(batch): the table
  is no argument of it (tests/test_host_tier.py reads the lowered step for CPU and CUDA)."""
  spec = _spec(ADAGRAD, num_rows=200_000, dim=16)
  text = "offload(cache_rows=4000, lookahead=1)"
  batches = contract.zipf_ids(0, 2, 256, 2, spec.num_rows)
  contract.assert_update_is_sparse(text, spec, batches[0])
  b = planner.make_backend(text, spec)
  with base.shapes_only():  # (zero tables: values change no program)
    state = b.init(jax.random.key(0))
  b.prepare({"t": batches[0]}, [{"t": batches[1]}])
  p = b.prepare({"t": batches[1]}, [{"t": batches[0][::-1]}])
  assert p["lists"][0]["next"].shape[1] > 0  # the exchange is compiled in
  grads = {"t": np.ones((batches[0].shape[0], 16), np.float32)}
  residuals = jax.eval_shape(b.lookup, state, p)[1]
  compiled = jax.jit(b.update, donate_argnums=0).lower(state, p, residuals, grads).compile()
  ma = compiled.memory_analysis()
  big = spec.num_rows * spec.dim * 4
  assert ma.temp_size_in_bytes < big / 4
  assert ma.argument_size_in_bytes < big / 4, "a table-sized argument"
  assert f"f32[{spec.num_rows}" not in compiled.as_text()


# ----------------------------------------------------------------------------- trainer


@pytest.mark.slow
def test_trainer_offload_equals_dense_and_resumes(tmp_path):
  """The trainer (input thread running prepare ahead, one jitted step over 26 tables,
  checkpoints after sync) with every table offloaded, stopped after 3 steps and resumed,
  ends identical to the uninterrupted all-dense run (tables and dense params)."""
  from experiments import smoke
  from recgnn.train import loop

  def config(plan):
    c = smoke.get_config()
    c.data.cache_dir = str(tmp_path / "cache")
    c.data.synthetic.rows = 20_000
    c.data.synthetic.scale = 0.002  # largest table ~20k rows: caches of 3% evict
    c.train.steps, c.train.log_every, c.train.checkpoint_every = 8, 4, 4
    # Eval passes mid-run and at the end: lookup-only batches, prepared with train=False,
    # interleaved with the train batches the planner prefetches for.
    c.train.eval_every, c.train.final_eval_splits = 2, ("test",)
    c.embeddings.plan = [(".*", plan)]
    return c

  offload_plan = "offload(cache_fraction=0.03, min_cache_rows=256, policy=lookahead, lookahead=4)"
  dense = loop.train(config("dense"), str(tmp_path / "dense"))
  part = loop.train(config(offload_plan), str(tmp_path / "part"), stop_after=3)
  assert part.metrics["step"] == 3
  resumed = loop.train(config(offload_plan), str(tmp_path / "part"), resume=True)
  big = max(dense.plan.specs.values(), key=lambda spec: spec.num_rows).name
  group = resumed.plan.backend_of(big)
  assert group.members[big].cache_rows < group.specs[big].num_rows / 10
  logged = [json.loads(x) for x in (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()]
  assert sum(x.get(f"{big}/d2h_rows_per_step", 0) for x in logged) > 0, "the cache never evicted"

  def tables(result):
    return {
      n: t for k, g in result.plan.groups.items() for n, t in g.tables(result.state.emb[k]).items()
    }

  got, want = tables(resumed), tables(dense)
  assert set(got) == set(want) == set(dense.plan.specs)
  for n in want:
    np.testing.assert_array_equal(got[n], want[n], err_msg=n)
  for x, y in zip(jax.tree.leaves(resumed.state.params), jax.tree.leaves(dense.state.params)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert resumed.metrics["test/auc"] == dense.metrics["test/auc"]
  assert resumed.metrics["valid/auc"] == dense.metrics["valid/auc"]


def test_host_table_is_one_copy_whatever_the_mesh():
  """On 8 devices the host table is one numpy copy in this process (not a replica per
  device), and memory() counts one copy."""
  mesh = sharding.make_mesh(8, 1)
  group = planner.make_backend("offload(cache_rows=60)", _spec(ADAGRAD), mesh)
  state = group.init(jax.random.key(0))
  assert "host" not in state
  assert [{k: v.shape for k, v in a.items()} for a in group._tier.rows.arrays] == [
    {"table": (1024, 4), "accum": (1024,)}
  ]
  one = planner.make_backend("offload(cache_rows=60)", _spec(ADAGRAD)).memory()["t"]
  assert group.memory()["t"].host_bytes == one.host_bytes


# ----------------------------------------------------------------------------- compiled planner


def test_smallest_is_key_then_index_order():
  """The victim order both planners share: the k smallest keys, ties to the smaller slot."""
  rng = np.random.default_rng(0)
  for _ in range(50):
    keys = rng.integers(0, 6, size=40).astype(np.int64)  # many ties
    k = int(rng.integers(1, 40))
    want = np.lexsort((np.arange(40), keys))[:k]
    np.testing.assert_array_equal(np.sort(offload.smallest(keys, k)), np.sort(want))


def _group_stream(text, opt, compiled, monkeypatch, threads=1, dims=(4, 4, 4), pooling="sum"):
  """Every prepared pytree of a 3-table group over a Zipf stream with an eval pass inside,
  planned by the compiled kernel (`compiled`) or by each table's numpy planner. dims: the
  tables' (two values: two stacks); pooling: t1's (mean: the batch's counts)."""
  from recgnn.backends.offload import planner as hostplan
  from recgnn.train import inputs

  sizes = (1000, 300, 5000)
  specs = [
    base.TableSpec(
      name=f"t{i}", num_rows=n, dim=dims[i], optimizer=opt, pooling=pooling if i == 1 else "sum"
    )
    for i, n in enumerate(sizes)
  ]
  group = planner.make_group(text, specs)
  group.init(jax.random.key(0))
  tabs = [contract.zipf_ids(i, 16, 32, 2, n) for i, n in enumerate(sizes)]
  stream = []
  for k in range(16):
    stream.append(("train", None, {"ids": {f"t{i}": tabs[i][k] for i in range(3)}}))
    if k == 6:
      stream.append(("eval", "valid", {"ids": {f"t{i}": tabs[i][0][:16] for i in range(3)}}))
      stream.append(("eval_end", "valid", None))
  monkeypatch.setattr(hostplan, "enabled", lambda: compiled)
  monkeypatch.setattr(hostplan, "_THREADS", threads)
  plan = planner.Plan({"g": group}, {s.name: "g" for s in specs}, group.mesh)
  out = []
  for x in inputs.prepare_stream(plan, stream):
    if x.prepared is not None:
      out.append(x.prepared)
      if x.kind == "train":
        contract.planned_only(group, x.prepared["g"])  # (as if its step ran)
  return out, group


@pytest.mark.parametrize("policy", offload.POLICIES)
@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: o.name)
def test_compiled_planner_equals_numpy_planner(policy, opt, monkeypatch):
  """Every prepared array (slots, dedup, exchange lists, versions) of the compiled group
  planner equals the numpy planner's, across evictions, an eval pass and the batches after
  it; on 2 threads too. (Exactness against dense: the tests above, which run it.)"""
  from recgnn.backends.offload import planner as hostplan

  if not hostplan.AVAILABLE:
    pytest.skip("numba not installed")
  text = f"offload(cache_rows=130, policy={policy}, lookahead=3)"
  want, slow = _group_stream(text, opt, False, monkeypatch)
  slow_stats = slow.stats()
  for threads in (1, 2):
    got, fast = _group_stream(text, opt, True, monkeypatch, threads)
    assert slow.fast_batches == 0 and fast.fast_batches >= 12
    assert len(got) == len(want)
    for k, (a, b) in enumerate(zip(want, got)):
      la, lb = jax.tree.leaves_with_path(a), jax.tree.leaves_with_path(b)
      assert [p for p, _ in la] == [p for p, _ in lb]
      for (path, x), (_, y) in zip(la, lb):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape, (k, jax.tree_util.keystr(path))
        np.testing.assert_array_equal(x, y, err_msg=f"batch {k} {jax.tree_util.keystr(path)}")
    s = fast.stats()
    assert s["t0/d2h_rows_per_step"] > 0, "no dirty row was evicted: test too easy"
    assert s == {**slow_stats, **{k: v for k, v in s.items() if "plan_ms" in k}}


def test_compiled_planner_equals_numpy_planner_two_stacks_and_mean(monkeypatch):
  """Two stacks in one group (tables of two dims) and a mean-pooled table: the compiled
  planner's batch (`planned.Planned`, segments of its buffer) laid out per stack as the
  numpy planners' dicts are, every prepared array equal."""
  from recgnn.backends.offload import planner as hostplan

  if not hostplan.AVAILABLE:
    pytest.skip("numba not installed")
  text, dims = "offload(cache_rows=130, policy=lookahead, lookahead=3)", (4, 8, 4)
  want, slow = _group_stream(text, ADAGRAD, False, monkeypatch, dims=dims, pooling="mean")
  got, fast = _group_stream(text, ADAGRAD, True, monkeypatch, dims=dims, pooling="mean")
  assert len(fast._stacks) == 2 and fast.fast_batches >= 12 and len(got) == len(want)
  assert any("count" in bag for s in got[-1]["g"]["batch"] for bag in s["bags"].values())
  for k, (a, b) in enumerate(zip(want, got)):
    la, lb = jax.tree.leaves_with_path(a), jax.tree.leaves_with_path(b)
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (path, x), (_, y) in zip(la, lb):
      np.testing.assert_array_equal(x, y, err_msg=f"batch {k} {jax.tree_util.keystr(path)}")


def _random_stream(seed, text, compiled, monkeypatch):
  """Every prepared pytree of a 4-table group over a random stream made to hit the recency
  log's edge cases: ids from few rows (repeats, many equal recency times), a table smaller
  than its cache (wholly cached, free slots left), one whose batches nearly fill its cache
  (the window does not fit: needed rows evicted), all-padding (empty) batches, an eval pass,
  and a restore (the log rebuilt from a state's slot map, every recency time equal)."""
  from recgnn.backends.offload import planner as hostplan
  from recgnn.train import inputs

  rng = np.random.default_rng(seed)
  sizes = (40, 400, 3000, 200)  # t0: fewer rows than the cache; t3: batches near its size
  specs = [
    base.TableSpec(name=f"t{i}", num_rows=n, dim=4, optimizer=ADAGRAD) for i, n in enumerate(sizes)
  ]
  group = planner.make_group(text, specs)
  state = group.init(jax.random.key(0))
  monkeypatch.setattr(hostplan, "enabled", lambda: compiled)
  plan = planner.Plan({"g": group}, {sp.name: "g" for sp in specs}, group.mesh)

  def batch(k):
    ids = {}
    for i, n in enumerate(sizes):
      hi = n if i != 1 else int(rng.integers(20, n))  # t1: a drifting hot set
      x = rng.integers(0, hi, size=(48, 1)).astype(np.int32)
      if i == 3:
        x = rng.permutation(n)[:60].reshape(60, 1)[:48].astype(np.int32)
      if k % 7 == 3:
        x[:] = -1  # an empty batch of this table
      ids[f"t{i}"] = x
    return {"ids": ids}

  out = []
  for part in range(2):
    stream = [("train", None, batch(k)) for k in range(14)]
    stream[6:6] = [("eval", "valid", batch(0)), ("eval_end", "valid", None)]
    for x in inputs.prepare_stream(plan, stream):
      if x.prepared is not None:
        out.append(x.prepared)
        if x.kind == "train":
          contract.planned_only(group, x.prepared["g"])
    if part == 0:  # a restore: bookkeeping from a slot map (the planners'; times all lost)
      group._tier.drain()
      members = group.members.values()
      slot_rows = [np.where(m._planner.slot_row >= 0, m._planner.slot_row, m.spec.num_rows)
                   for m in members]  # fmt: skip
      version = np.array([m._planner.version for m in members], np.int32)
      assert len(group._stacks) == 1 and (np.concatenate(slot_rows) < 3000).sum() > 100
      state = dict(state, slot_rows=(jnp.asarray(np.concatenate(slot_rows), jnp.int32),),
                   version=jnp.asarray(version))  # fmt: skip
      group.restore(state)
  return out, group


@pytest.mark.parametrize("policy", offload.POLICIES)
@pytest.mark.parametrize("seed", range(3))
def test_compiled_planner_equals_numpy_planner_on_random_streams(seed, policy, monkeypatch):
  """The kernel's recency log (victims in O(misses + window)) picks the numpy planner's
  victims on streams with its edge cases (`_random_stream`): every prepared array equal."""
  from recgnn.backends.offload import planner as hostplan

  if not hostplan.AVAILABLE:
    pytest.skip("numba not installed")
  text = f"offload(cache_rows=64, policy={policy}, lookahead=4)"
  want, _ = _random_stream(seed, text, False, monkeypatch)
  got, fast = _random_stream(seed, text, True, monkeypatch)
  assert fast.fast_batches >= 16
  assert len(got) == len(want)
  for k, (a, b) in enumerate(zip(want, got)):
    for (path, x), (_, y) in zip(jax.tree.leaves_with_path(a), jax.tree.leaves_with_path(b)):
      np.testing.assert_array_equal(
        np.asarray(x), np.asarray(y), err_msg=f"batch {k} {jax.tree_util.keystr(path)}"
      )
  assert fast.stats()["t3/d2h_rows_per_step"] > 0, "t3 never evicted: test too easy"


def test_compiled_planner_runs_in_the_contract(monkeypatch):
  """The bit-equality to dense above runs the compiled planner (not only the numpy one)."""
  from recgnn.backends.offload import planner as hostplan

  if not hostplan.AVAILABLE:
    pytest.skip("numba not installed")
  trace = contract.assert_matches_dense(POLICY_STRINGS[2], _spec(ADAGRAD), _batches())
  assert trace.backend.fast_batches >= len(_batches()) - 2


def test_compiled_planner_names_an_out_of_range_id():
  group = planner.make_backend("offload(cache_rows=60, lookahead=2)", _spec(SGD))
  group.init(jax.random.key(0))
  ids = _batches(num_batches=4)
  group.prepare({"t": ids[0]}, [{"t": ids[1]}, {"t": ids[2]}])
  bad = ids[2].copy()
  bad[0, 0] = 5000
  with pytest.raises((ValueError, IndexError)):
    group.prepare({"t": ids[1]}, [{"t": bad}, {"t": ids[3]}])


def test_told_batches_make_the_ring_the_first_step_needs():
  """`expect_batches` (the trainer's, before it builds the state: setup.build) makes the
  device ring of recent write-backs at the rows the first train batch's lists name, so the
  first train step runs the program every later one runs (at [0, ...] rows the first step
  resized it: a second compile of the whole step). The same lookups and tables as a group
  not told; a ring never resized."""
  spec, batches, mesh = _spec(ADAGRAD), _batches(), planner.default_mesh()
  # (a cache of at least a batch's 32 x 2 ids: `expect_batches` refuses a smaller one)
  text = POLICY_STRINGS[2].replace("cache_rows=60", "cache_rows=64")
  told = planner.make_backend(text, spec, mesh)
  told.expect_batches({"t": batches[0].shape})
  state = told.init(jax.random.key(0))
  upcoming = [{"t": b} for b in batches[1:4]]
  widths = [lst["ring"].shape[1] for lst in told.prepare({"t": batches[0]}, upcoming)["lists"]]
  assert [r["table"].shape[0] for r in state["ring"]] == widths and min(widths) > 0
  untold = planner.make_backend(text, spec, mesh)
  assert [r["table"].shape[0] for r in untold.init(jax.random.key(0))["ring"]] == [0]
  a = contract.run(text, spec, batches, group=told, state=told.init(jax.random.key(0)))
  b = contract.run(text, spec, batches)
  for x, y in zip(a.lookups, b.lookups, strict=True):
    np.testing.assert_array_equal(x, y)
  np.testing.assert_array_equal(a.table, b.table)
  assert [r["table"].shape[0] for r in a.state["ring"]] == widths
  assert a.backend.stats()["t/d2h_rows_per_step"] > 0, "nothing written back: test too easy"


def test_last_batch_keeps_the_steady_shapes():
  """The last batch of a stream (nothing upcoming to admit) is prepared with the shapes of
  the batches before it: no train-step compile of its own at the end of a run."""
  group = planner.make_backend("offload(cache_rows=60, lookahead=2)", _spec(ADAGRAD))
  group.init(jax.random.key(0))
  ids = _batches(num_batches=4)
  shapes = []
  for k in range(4):
    p = group.prepare({"t": ids[k]}, [{"t": u} for u in ids[k + 1 : k + 3]])
    shapes.append(jax.tree.map(np.shape, p))
  assert shapes[1] == shapes[2] == shapes[3]


def _numpy_stack(stacks, slot_off, specs, per, lists, absent):
  """`stacked_batch.stack` as numpy passes (its version before the compiled one): the
  reference the kernel is checked against."""

  def batch_major(x):
    return np.ascontiguousarray(x.transpose(1, 0, 2), np.int32)

  out = []
  for stack, names in enumerate(stacks):
    first, rows = slot_off[stack], np.diff(slot_off[stack])
    bags: dict[int, list[int]] = {}
    for i, n in enumerate(names):
      bags.setdefault(per[n]["rows"]["ids"].shape[1], []).append(i)
    needs_unique = specs[names[0]].optimizer.needs_unique
    mean = any(specs[n].pooling == "mean" for n in names)
    entry, uniques, u_first = {}, [], 0
    for idx in sorted(bags.values(), key=lambda idx: ",".join(map(str, idx))):
      r = [per[names[i]]["rows"] for i in idx]
      c, f = rows[idx][:, None, None], first[idx][:, None, None]
      ids = np.array([x["ids"] for x in r])
      now, off = lists[stack]["now"].shape[1], lists[stack]["now_off"].astype(np.int64)
      pos, lo, hi = np.array([x["now_pos"] for x in r]), off[idx], off[np.add(idx, 1)]
      lo, hi = lo[:, None, None], hi[:, None, None]
      bag = {
        "ids": batch_major(np.where(ids < c, ids + f, absent)),
        "now_pos": batch_major(np.where(pos < hi - lo, pos + lo, now)),
      }
      if needs_unique:
        size = r[0]["ids"].size
        start = u_first + size * np.arange(len(idx))[:, None, None]
        bag["inverse"] = batch_major(np.array([x["inverse"] for x in r]) + start)
        u = np.array([x["unique"] for x in r])
        uniques.append(np.where(u < c[:, 0], u + f[:, 0], absent).astype(np.int32).reshape(-1))
        u_first += size * len(idx)
      if mean:
        ones = np.ones(ids.shape[1], np.int32)
        bag["count"] = np.stack([per[names[i]].get("count", ones) for i in idx], axis=1)
      entry[",".join(map(str, idx))] = bag
    out.append({"bags": entry, **({"unique": np.concatenate(uniques)} if uniques else {})})
  return tuple(out)


@pytest.mark.parametrize(
  "tables, batch, bags, unique, mean",
  [(26, 256, [1], True, False), (5, 64, [1, 3, 2], False, True), (4, 32, [2], True, True)],
)
def test_stacked_batch_equals_numpy_passes(tables, batch, bags, unique, mean):
  """The compiled stacking (one pass per bag) gives the numpy passes' arrays: slots made the
  stack's (padding and ids past a table's cache to ABSENT), "now" positions, inverse
  offsets, the unique list, counts; one-hot and multi-hot bags, with and without dedup."""
  import types

  from recgnn.backends.offload import stacked_batch
  from recgnn.backends.offload.planned import Planned
  from recgnn.backends.offload.table import PLANNED

  rng = np.random.default_rng(tables)
  caps = rng.integers(10, 500, tables)
  names = [f"t{i}" for i in range(tables)]
  per = {}
  for i, n in enumerate(names):
    length = bags[i % len(bags)]
    per[n] = {
      "rows": {
        "ids": rng.integers(0, caps[i] + 1, (batch, length)).astype(np.int32),
        "now_pos": rng.integers(0, 12, (batch, length)).astype(np.int32),
        "inverse": rng.integers(0, batch * length, (batch, length)).astype(np.int32),
        "unique": rng.integers(0, caps[i] + 1, batch * length).astype(np.int32),
        "now": np.zeros((4, 0), np.int32),
        "next": np.zeros((5, 0), np.int32),
        PLANNED: (False, False),
        "version": np.int32(0),
      },
      "count": rng.integers(0, length + 1, batch).astype(np.int32),
    }
  slot_off = [np.concatenate([[0], np.cumsum(caps)])]
  opt = types.SimpleNamespace(needs_unique=unique)
  pooling = "mean" if mean else "sum"
  specs = {n: types.SimpleNamespace(optimizer=opt, pooling=pooling) for n in names}
  lists = [{"now": np.zeros((4, 7 * tables), np.int32), "now_off": np.arange(0, 7 * tables + 1, 7)}]
  absent = np.iinfo(np.int32).max
  planned = Planned.of_tables(per, names)
  got = stacked_batch.stack([names], slot_off, specs, planned, lists, absent)
  want = _numpy_stack([names], slot_off, specs, per, lists, absent)
  lg, lw = jax.tree.leaves_with_path(got), jax.tree.leaves_with_path(want)
  assert [p for p, _ in lg] == [p for p, _ in lw]
  for (path, x), (_, y) in zip(lg, lw):
    assert x.dtype == y.dtype and x.shape == y.shape, jax.tree_util.keystr(path)
    np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path))
