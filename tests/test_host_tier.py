"""The memory tiers' step holds no host work and no table (issue 42), read off the step itself.

On the one GPU measured (H100), `compute_on` host gathers / scatters inside the step made each
launch wait, and XLA:GPU copied every host table whole into the write-back (pinned -> pinned,
in the step's CUDA graph): an O(rows) cost that XLA:CPU's compiled program never showed. So
these tests read the LOWERED step (StableHLO, before any backend's passes), for CPU and for
CUDA (`.trace(...).lower(lowering_platforms=("cuda",))` needs no GPU), and check what no
compiler can add back: no host computation region, no array in host memory, no argument or
result as large as a table. The rows a step loads are inputs (read on the input thread, moved
with the batch); the rows it evicts are an output (TO_HOST) a host writer applies
(recgnn.embeddings.host_tier). The writer's ordering (a row written back by step k and read
ahead for step k + 1, before step k ran) is checked by exactness with the forwarding broken.
"""

import re
import threading
import time

import contract_lib as contract
import jax
import numpy as np
import pytest
from test_experiments import small_config

from recgnn import planner
from recgnn.embeddings import base, host_tier
from recgnn.train import setup
from tests.trainer_lib import xla_compiles

ADAGRAD = base.OptimizerSpec(name="rowwise_adagrad", learning_rate=0.1, initial_accumulator=0.1)
SGD = base.OptimizerSpec(name="sgd", learning_rate=0.1)
ROWS = 200_000
HOST_TIERS = [
  "offload(cache_rows=4000, lookahead=1)",
  # a hot set picked after one batch: the step lowered is the pick's (its migration: rows
  # joining the hot set from the ring or the host) and the next (popular / non-popular
  # micro-batches, cold rows through the ring)
  "hot_cold(budget=0.01, profile_batches=1)",
  "hot_cold(budget=0.01, profile_batches=1, reprofile=1)",
]


def _spec(num_rows=ROWS, dim=16, opt=ADAGRAD):
  return base.TableSpec(name="t", num_rows=num_rows, dim=dim, optimizer=opt)


def _step(group):
  """lookup + update (the gradient is the pooled lookup), its TO_HOST output apart, as the
  trainer's step returns it."""

  def step(state, prepared):
    pooled, res = group.lookup(state, prepared)
    return base.split_to_host(group.update(state, prepared, res, {"t": pooled["t"]}))

  return step


def _assert_no_host_work(text: str, specs, what: str) -> None:
  """StableHLO text of a lowered step: no host computation, nothing in host memory, no
  tensor shaped as one of these host tables (its rows, or its rows padded to ROW_ALIGN)."""
  assert "_xla_compute_type" not in text, f"{what}: a host computation inside the step"
  assert "pinned_host" not in text and "unpinned_host" not in text, f"{what}: host memory"
  lead = {int(m) for m in re.findall(r"tensor<(\d+)(?:x|[a-z])", text)}
  tables = {n for s in specs for n in (s.num_rows, base.aligned_rows(s.num_rows))}
  assert not lead & tables, f"{what}: tensors with a table's rows: {sorted(lead & tables)}"


def _steps(text, spec):
  """(group, [(state, prepared, rows)]) of the train steps to lower: offload's batch that
  runs both exchanges (on-demand and the next batch's, with write-backs); hot_cold's pick
  (batch 0 is profiled and plans the migration; with reprofile=1 every batch re-picks: rows
  leave the hot set too) and the batches after it, each with the state its step would get
  (rings sized); rows: what its TO_HOST returns."""
  group = planner.make_backend(text, spec)
  with base.shapes_only():  # (zero tables: values change no program; 200k rows at -O0 did)
    state = group.init(jax.random.key(0))
  batches = contract.zipf_ids(0, 5, 256, 2, spec.num_rows)
  if text.startswith("offload"):
    prepared = group.prepare({"t": batches[0]}, [{"t": batches[1]}])
    lists = prepared["lists"][0]
    return group, [(state, prepared, lists["now"].shape[1] + lists["next"].shape[1])]
  from test_hot_cold import planned_only
  from test_hot_cold_tiers import sized

  out = []
  for k in range(3):
    prepared = planned_only(group, group.prepare({"t": batches[k]}))
    t = prepared["tables"]["t"]
    rows = prepared["cold"][0]["src"].shape[0] + t["out_slots"].shape[0]
    out.append((sized(state, prepared), prepared, rows))
  assert any(p["tables"]["t"]["in_rows"].shape[0] for _, p, _ in out), "no migration"
  assert any("micro" in p for _, p, _ in out), "no micro-batches"
  if "reprofile" in text:
    assert any(p["tables"]["t"]["out_slots"].shape[0] for _, p, _ in out), "no row left"
  return group, out


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
@pytest.mark.parametrize("text", HOST_TIERS)
def test_the_step_holds_no_host_work_and_no_table(text, platform):
  """One table of 200k rows, steps that write rows back (offload: both exchanges; hot_cold:
  its cold rows, a migration, micro-batches): the lowered step has no host computation, no
  host-memory array, nothing table-sized; its TO_HOST output is the rows it writes back (x
  their optimizer state: offload's exchanges, hot_cold's cold list and rows leaving the hot
  set)."""
  spec = _spec()
  group, steps = _steps(text, spec)
  for state, prepared, width in steps:
    traced = jax.jit(_step(group), donate_argnums=0).trace(state, prepared)
    lowered = traced.lower(lowering_platforms=(platform,))
    _assert_no_host_work(lowered.as_text(), [spec], f"{text} lowered for {platform}")
    out = jax.eval_shape(_step(group), state, prepared)[1]
    moved = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(out))
    assert 0 < moved == width * spec.row_bytes  # the rows written back, no more
  if platform == "cpu":  # and what XLA:CPU compiled of it: no table-sized buffer either
    compiled = lowered.compile()
    assert f"f32[{spec.num_rows}" not in compiled.as_text()
    assert f"f32[{base.aligned_rows(spec.num_rows)}" not in compiled.as_text()
    ma = compiled.memory_analysis()
    assert ma.argument_size_in_bytes + ma.temp_size_in_bytes < spec.table_bytes / 4


@pytest.mark.parametrize("experiment, most", [("cdlrm_kaggle", 20), ("hotline_kaggle", 7)])
def test_the_trainers_step_lowers_for_cuda_without_host_work(experiment, most, tmp_path):
  """The trainer's own packed train step of an experiment with its large tables in a host
  tier (cdlrm_kaggle: offload; hotline_kaggle: hot_cold, the profile's step) (the issue's
  reading of the H100 run: 159 host call sites, 108 pinned host arguments, a
  host call returning 52 tables), lowered for CUDA on this CPU: none of them."""
  config = small_config(experiment, str(tmp_path / "cache"))
  run = setup.build(config)
  assert any(g.capabilities.writes_host for g in run.plan.groups.values())
  batches = run.task.train_batches()
  batch, upcoming = next(batches), next(batches)
  prepared = run.prepare(batch, [upcoming["ids"]])
  buffers, layout = run.packed(prepared, batch)
  lowered = run.train_step.trace(run.state, buffers, layout).lower(lowering_platforms=("cuda",))
  host = [
    s for g in run.plan.groups.values() if g.capabilities.writes_host for s in g.specs.values()
  ]
  assert len(host) >= most
  # (no table-shape check here: 12k synthetic rows make tables of at most 12k distinct ids,
  # whose row counts are batch-like numbers; the 200k-row test above checks the shapes)
  _assert_no_host_work(lowered.as_text(), [], f"{experiment}'s train step for cuda")


# ----------------------------------------------------------------------------- the ring


RUN_AHEAD = 2  # the contract driver prepares this many batches ahead of the step
TEXT = "offload(cache_rows=60, policy=lru, lookahead=1)"


def _stream():
  return _spec(1000, 4, SGD), contract.zipf_ids(5, 16, 32, 2, 1000)


@pytest.mark.parametrize("mesh_shape", [(1, 1), (2, 4)], ids=lambda m: f"{m[0]}x{m[1]}")
def test_rows_written_back_then_read_ahead_come_from_the_ring(mesh_shape):
  """With the input RUN_AHEAD batches ahead of the step, a row step k evicts and step k + 1
  loads was read on the input thread before step k ran: the device ring of recent
  write-backs supplies it. Bit-equal to single-device dense, and the case occurs."""
  spec, batches = _stream()
  ref = contract.run("dense", spec, batches)
  mesh = contract.mesh_or_skip(*mesh_shape)
  got = contract.run(TEXT, spec, batches, mesh=mesh, prefetch=RUN_AHEAD)
  stats = got.backend.stats()
  assert stats["ring_rows_per_step"] > 0, "no load came from the ring: test too easy"
  assert stats["t/d2h_rows_per_step"] > 0
  for k, (a, b) in enumerate(zip(got.lookups, ref.lookups)):
    np.testing.assert_array_equal(a, b, err_msg=f"lookup differs at step {k}")
  np.testing.assert_array_equal(got.table, ref.table)


def test_a_ring_never_written_breaks_it(monkeypatch):
  """Mutation check: steps that never write their evictions into the ring (every slot
  ABSENT) serve stale rows to the loads planned from it: the run above is no longer exact."""
  real = host_tier.Recent.assign

  def nowhere(self, rows):
    real(self, rows)
    return np.full(rows.shape[0], host_tier.ABSENT, np.int32)

  monkeypatch.setattr(host_tier.Recent, "assign", nowhere)
  spec, batches = _stream()
  ref = contract.run("dense", spec, batches)
  got = contract.run(TEXT, spec, batches, prefetch=RUN_AHEAD)
  assert not np.array_equal(got.table, ref.table)


def test_a_host_read_before_its_write_back_is_refused(monkeypatch):
  """Mutation check: without the ring's sources every such load is a host read of a row
  whose write-back has not happened (its step has not run): refused at once, not read stale."""

  contract.break_ring_sources(monkeypatch)
  spec, batches = _stream()
  with pytest.raises(RuntimeError, match="has not run"):
    contract.run(TEXT, spec, batches, prefetch=RUN_AHEAD)


def test_the_writer_applies_in_order_and_reports_errors():
  writer = host_tier.Writer("t")
  seen = []
  for i in range(5):
    writer.submit(lambda i=i: seen.append(i))
  writer.drain()
  assert seen == list(range(5)) and writer.applied == 5

  def fail():
    raise ValueError("boom")

  writer.submit(fail)
  with pytest.raises(RuntimeError, match="boom"):
    writer.drain()
  host_tier.WAIT_SECONDS, saved = 0.2, host_tier.WAIT_SECONDS
  try:
    with pytest.raises(RuntimeError, match="has not run"):
      host_tier.Writer("u").wait(1)
  finally:
    host_tier.WAIT_SECONDS = saved
  # A write-back handed over after the wait began (the trainer's main thread behind the
  # input thread) is waited for, not refused.
  late = host_tier.Writer("v")
  threading.Timer(0.3, lambda: late.submit(lambda: None)).start()
  late.wait(1)
  assert late.applied == 1


def test_a_wait_on_the_thread_that_runs_the_steps_is_refused_at_once(monkeypatch):
  """A driver that prepares and steps on one thread and waits for a step it has not handed
  over can never be answered (it is the thread that would hand it over): refused at once,
  saying so, not after WAIT_SECONDS. Another thread's wait still waits (the trainer's input
  thread, its main thread behind)."""
  monkeypatch.setattr(host_tier, "WAIT_SECONDS", 5.0)
  writer = host_tier.Writer("w")
  writer.submit(lambda: None)
  t0 = time.perf_counter()
  with pytest.raises(RuntimeError, match=r"train step 2 .*1 handed over.*this thread runs"):
    writer.wait(2)
  assert time.perf_counter() - t0 < 2.0
  waited = threading.Event()

  def other():
    writer.wait(2)
    waited.set()

  t = threading.Thread(target=other, daemon=True)
  t.start()
  t.join(0.2)
  assert t.is_alive(), "another thread's wait was refused"
  writer.submit(lambda: None)
  assert waited.wait(10) and writer.applied == 2


def test_a_prepare_no_step_will_answer_ends_with_the_message(monkeypatch):
  """What benchmarks/end_to_end.py's planning section did (it hung: every thread on a
  futex): an offload group's train batches prepared in stream order with no step run. A
  read of a row evicted beyond the device ring waits for a step that never comes; the wait
  ends (WAIT_SECONDS, 0.5 s here) in the refusal naming the step and why, not a hang."""
  from recgnn.train import inputs

  monkeypatch.setattr(host_tier, "WAIT_SECONDS", 0.5)
  spec, batches = _stream()
  group = planner.make_backend(TEXT, spec, planner.default_mesh())
  group.init(jax.random.key(0))
  plan = planner.Plan({group.name: group}, {spec.name: group.name}, group.mesh)
  stream = [("train", None, {"ids": {spec.name: b}}) for b in batches]
  errors = []

  def prepare_all():
    try:
      for _ in inputs.prepare_stream(plan, stream):
        pass
    except RuntimeError as e:
      errors.append(str(e))

  t = threading.Thread(target=prepare_all, daemon=True)
  t.start()
  t.join(30)
  assert not t.is_alive(), "prepare without steps still waiting after 30 s"
  assert len(errors) == 1 and re.search(r"train step \d+ .*has not run.*waited 0.5 s", errors[0])


def test_a_dropped_writer_ends_its_thread_and_lets_go_of_its_last_job():
  """The writer's thread holds its writer weakly (recgnn.owned_thread): a writer dropped with
  its group ends its thread and lets go of the last job's arrays. A thread started on a bound
  method kept both to the end of the process (one test process had 94 idle writer threads
  after two test files, each holding its group's host tables)."""
  import gc
  import weakref

  class Rows:  # (stands for a write-back's arrays)
    pass

  rows = Rows()
  gone = weakref.ref(rows)
  writer = host_tier.Writer("dropped")
  writer.submit(lambda r=rows: None)
  writer.drain()
  thread = writer._thread
  del writer, rows
  gc.collect()
  thread.join(timeout=10)
  assert not thread.is_alive()
  assert gone() is None


def test_rows_to_host_reads_any_range_through_one_program():
  """A cache's rows read to the host a piece at a time (offload's sync): every range, the
  last shorter one too, through one program per array shape and window (slicing [lo:hi]
  compiled one per start and length)."""
  import jax.numpy as jnp

  arrays = {"rows": jnp.arange(101 * 3, dtype=jnp.float32).reshape(101, 3),
            "slot": jnp.arange(101, dtype=jnp.float32) * 0.5}  # fmt: skip
  want = {k: np.asarray(v) for k, v in arrays.items()}
  host_tier.rows_to_host(arrays, 0, 10, 10)  # (the program, compiled here)
  with xla_compiles() as compiles:
    for lo, hi in [(0, 10), (10, 20), (37, 41), (95, 101), (100, 101)]:
      got = host_tier.rows_to_host(arrays, lo, hi, 10)
      for k in want:
        np.testing.assert_array_equal(got[k], want[k][lo:hi], err_msg=f"{k} [{lo}:{hi})")
  assert compiles == []
  with pytest.raises(ValueError, match="window of 10 rows"):
    host_tier.rows_to_host(arrays, 0, 11, 10)  # (more rows than the window: refused)
  small = host_tier.rows_to_host({"x": jnp.ones((4, 2))}, 1, 3, 10)  # window > rows
  np.testing.assert_array_equal(small["x"], np.ones((2, 2)))


def test_row_copies_off_the_gil_equal_numpys():
  """The compiled row copies (no GIL: the input and writer threads do not hold it against the
  launching thread) read and write what numpy's fancy indexing does, 1-D and 2-D rows."""
  rng = np.random.default_rng(0)
  for shape in ((1000,), (1000, 16)):
    src = rng.normal(size=shape).astype(np.float32)
    rows = rng.choice(1000, 300, replace=False)
    out = np.zeros((300,) + shape[1:], np.float32)
    host_tier._take(src, rows, out)
    np.testing.assert_array_equal(out, src[rows])
    dst, want = src.copy(), src.copy()
    pos = rng.permutation(300)
    host_tier._put(dst, rows, out, pos)
    want[rows] = out[pos]
    np.testing.assert_array_equal(dst, want)
