"""offload's SSD level (storage='ssd:DIR', issue 44) beyond the contract (tests/test_contract.py
has it in EXACT): the disk is really used, resume from a checkpoint on another mesh is exact,
bad options / directories / row files are refused naming the fix, and a kill -9 during a
write-back or a checkpoint then --resume continues bit-identically."""

import os
import signal
import subprocess
import sys
import threading

import contract_lib as contract
import jax
import numpy as np
import pytest

from recgnn import planner, sharding
from recgnn.backends.offload import row_file
from recgnn.embeddings import base

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SGD = base.OptimizerSpec(name="sgd", learning_rate=0.1)
ADAGRAD = base.OptimizerSpec(name="rowwise_adagrad", learning_rate=0.1, initial_accumulator=0.1)


def _text(directory, host_cache=0.1, policy="lookahead", **kw):
  extra = "".join(f", {k}={v}" for k, v in kw.items())
  return (
    f"offload(cache_rows=60, policy={policy}, lookahead=3, host_cache={host_cache}, "
    f"storage='ssd:{directory}'{extra})"
  )


def _spec(opt, num_rows=1000, dim=4):
  return base.TableSpec(name="t", num_rows=num_rows, dim=dim, optimizer=opt)


def _batches(num_batches=12, batch=32, bag=2, num_rows=1000, seed=5):
  return contract.zipf_ids(seed, num_batches, batch, bag, num_rows)


@pytest.mark.parametrize(
  "io, policy", [("direct", "lookahead"), ("buffered", "lru"), ("direct", "lfu")]
)
def test_disk_is_used_and_bytes_are_the_misses(io, policy, tmp_path):
  """A 10% host cache under a 6% device cache: equal to dense, rows read from and written to
  the file every few steps, and the file's bytes read = host-cache misses x record bytes."""
  text = _text(tmp_path, policy=policy, io=io)
  trace = contract.assert_matches_dense(text, _spec(ADAGRAD), _batches())
  rows = trace.backend._tier.rows
  c = rows.counts()
  assert c["misses"] > 0 and c["evicted"] > 0, c
  assert c["prefetched"] > 0, c  # the look-ahead window's rows were read ahead
  f = rows.tables[0].file
  assert c["bytes_read"] == (c["misses"] + c["prefetched"]) * f.record + f.num_rows * f.record
  if io == "direct":  # 4 + 1 floats padded to the logical block the code probed (512 or 4096)
    assert f.record == row_file.logical_block(str(tmp_path)) in (512, 4096)
  s = trace.backend.stats()
  assert 0 <= s["ssd_host_hit_rate"] < 1 and s["ssd_read_bytes_per_step"] > 0


@pytest.mark.parametrize("opt", [SGD, ADAGRAD], ids=lambda o: o.name)
def test_checkpoint_and_resume_on_another_mesh(opt, tmp_path):
  """Sync + save at step 5 on an 8x1 mesh, restore into a fresh group on one device (a new
  row file written from the checkpoint) and resume: equal to an uninterrupted dense run."""
  from recgnn.train import checkpoint

  spec, batches, k = _spec(opt), _batches(), 5
  text = _text(tmp_path / "rows")
  ref = contract.run("dense", spec, batches)
  ckpt = checkpoint.Checkpointer(str(tmp_path / "ckpt"))

  a = planner.make_backend(text, spec, contract.mesh_or_skip(8, 1))

  def sync_and_save(item, state):
    if item.kind == "train" and item.step + 1 == k:
      state = a.sync(state)
      st, plan = _train_state(a, state)
      ckpt.save(st, k, plan)
      return state
    return None

  run_a = contract.run(text, spec, batches, group=a, after=sync_and_save)
  np.testing.assert_array_equal(run_a.table, ref.table)
  b = planner.make_backend(text, spec, sharding.make_mesh(1, 1))
  abstract, plan_b = _train_state(b, b.init(jax.random.key(123)))
  restored = ckpt.restore(abstract, plan_b, k).emb["g"]
  run_b = contract.run(text, spec, batches, group=b, state=restored, start=k)
  for step, (x, y) in enumerate(zip(run_a.lookups[:k] + run_b.lookups, ref.lookups)):
    np.testing.assert_array_equal(x, y, err_msg=f"lookup {step}")
  np.testing.assert_array_equal(run_b.table, ref.table)
  ckpt.close()


def _train_state(group, emb):
  from recgnn.train import train_state as state_lib

  plan = planner.Plan({"g": group}, {"t": "g"}, group.mesh)
  st = state_lib.TrainState(
    step=jax.numpy.zeros((), jax.numpy.int32), params={"w": jax.numpy.zeros(2)},
    opt_state=(), emb={"g": emb}, key=jax.random.key(0),
  )  # fmt: skip
  return st, plan


def test_checkpoint_streams_the_table_in_bounded_chunks(tmp_path, monkeypatch, fast_table_init):
  """A table bigger than host RAM can be checkpointed: with the chunk bound patched to 1/40 of
  the table, no read of the row file or of the checkpoint's files is over it (a counting
  wrapper) and the arrays held for the save and the restore stay far below the table
  (tracemalloc's peak over what the restore keeps); the restore (another mesh, and into
  `dense`) holds the saved values exactly. (`fast_table_init`: three 1M-row inits, every run
  in this process.)"""
  import tracemalloc

  from recgnn.embeddings import streamed
  from recgnn.train import checkpoint, streamed_item

  n, dim = 1_000_000, 16  # (68 MB: far above the checksums' 4 MiB reads)
  spec = _spec(ADAGRAD, num_rows=n, dim=dim)
  logical = base.aligned_rows(n) * (dim + 1) * 4  # (the "rows" form: rows + the slot)
  bound = logical // 40
  monkeypatch.setattr(streamed, "CHUNK_BYTES", bound)
  sizes = []  # the bytes of every read of the row file / the checkpoint's files
  read_all, chunk = row_file.RowFile.read_all, streamed.TableReader.chunk

  def counted_read_all(self, first, k):
    sizes.append(k * self.record)
    return read_all(self, first, k)

  def counted_chunk(self, first, k):
    out = chunk(self, first, k)
    sizes.append(sum(v.nbytes for v in out.values()))
    return out

  monkeypatch.setattr(row_file.RowFile, "read_all", counted_read_all)
  monkeypatch.setattr(streamed.TableReader, "chunk", counted_chunk)
  text = _text(tmp_path / "rows", host_cache=0.002, io="buffered")
  a = planner.make_backend(text, spec, contract.mesh_or_skip(2, 1))
  run_a = contract.run(text, spec, _batches(6, num_rows=n), group=a)
  state = a.sync(run_a.state)
  ckpt = checkpoint.Checkpointer(str(tmp_path / "ckpt"))
  st, plan = _train_state(a, state)
  ckpt.save(st, 5, plan)  # (Orbax's first save allocates its own: not traced)

  def traced(f):
    sizes.clear()
    tracemalloc.start()
    out = f()
    kept, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert sizes and max(sizes) <= bound, (max(sizes), bound)
    # (what stays: the new row maps, O(N) int32 / int64 per row as in memory(): not a table)
    assert peak - kept < logical / 4, (peak, kept, logical)
    return out

  traced(lambda: ckpt.save(st, 6, plan))
  step_dir = tmp_path / "ckpt" / "checkpoints" / "6" / streamed_item.ITEM / "0"
  saved = streamed.TableReader(str(step_dir)).arrays()
  want = a._tier.rows.table(0)
  np.testing.assert_array_equal(saved["rows"], want["table"])
  np.testing.assert_array_equal(saved["accum"], want["accum"])

  b = planner.make_backend(text, spec, sharding.make_mesh(1, 1))
  st, plan = _train_state(b, b.init(jax.random.key(1)))
  ckpt.restore(st, plan, 5)  # (Orbax's first restore: not traced)
  restored = traced(lambda: ckpt.restore(st, plan, 6)).emb["g"]
  got = b._tier.rows.table(0)
  np.testing.assert_array_equal(got["table"], want["table"])
  np.testing.assert_array_equal(got["accum"], want["accum"])
  np.testing.assert_array_equal(b.tables(restored)["t"], run_a.table)

  d = planner.make_backend("dense", spec, sharding.make_mesh(1, 1))  # (the reader's arrays)
  dense = ckpt.restore(*_train_state(d, d.init(jax.random.key(2))), 6).emb["g"]
  np.testing.assert_array_equal(d.tables(dense)["t"], run_a.table)
  ckpt.close()


def test_options_that_cannot_be_honoured_are_refused():
  with pytest.raises(ValueError, match="needs host_cache=F"):
    planner.make_backend("offload(cache_rows=60, storage='ssd:/tmp/x')", _spec(SGD))
  with pytest.raises(ValueError, match="storage=ram keeps every row in RAM"):
    planner.make_backend("offload(cache_rows=60, host_cache=0.1)", _spec(SGD))
  with pytest.raises(ValueError, match="storage=ram keeps every row in RAM"):
    planner.make_backend("offload(cache_rows=60, io=buffered)", _spec(SGD))
  with pytest.raises(ValueError, match="not a storage"):
    planner.make_backend("offload(cache_rows=60, storage=nvme)", _spec(SGD))
  with pytest.raises(ValueError, match=r"host_cache must be in \(0, 1\]"):
    planner.make_backend("offload(cache_rows=60, host_cache=2.0, storage='ssd:/tmp/x')", _spec(SGD))


def test_unusable_directory_is_refused(tmp_path, monkeypatch):
  blocker = tmp_path / "a_file"
  blocker.write_text("x")
  with pytest.raises(ValueError, match=f"storage=ssd:{blocker}/rows: cannot create the directory"):
    planner.make_backend(_text(blocker / "rows"), _spec(SGD))
  free = 100_000
  monkeypatch.setattr(row_file.shutil, "disk_usage", lambda d: type("U", (), {"free": free}))
  need = 1024 * 512 + row_file.HEADER_BYTES  # (1000 rows aligned to 1024, 512-byte records)
  with pytest.raises(ValueError, match=rf"100,000 bytes free .*; the row files need {need:,} "):
    planner.make_backend(_text(tmp_path / "rows"), _spec(SGD))


@pytest.mark.parametrize("damage", ["truncate", "header"])
def test_damaged_row_file_is_refused_naming_it(damage, tmp_path):
  spec = _spec(ADAGRAD)
  group = planner.make_backend(_text(tmp_path), spec)
  state = group.init(jax.random.key(0))
  f = group._tier.rows.tables[0].file
  if damage == "truncate":
    os.truncate(f.path, f.size // 2)
  else:
    with open(f.path, "r+b") as fh:
      fh.write(b"XXXX")
  with pytest.raises(RuntimeError, match=rf"row file of table 't' is damaged: {f.path}.*--resume"):
    group.export(group.sync(state))
  if damage == "truncate":  # a read past the end says so (never zeros as rows)
    with pytest.raises(RuntimeError, match=rf"{f.path} returned 0 of .*truncated"):
      group._tier.rows.tables[0].read(np.array([999]), np.empty((1, f.floats), np.float32))


# ----------------------------------------------------------------------------- kill -9

KILL_AFTER = 4  # the checkpoint that completes before the kill


def _trainer_config(cache_dir, rows_dir):
  from tests.trainer_lib import smoke_config

  plan = (
    "offload(cache_fraction=0.03, min_cache_rows=256, policy=lookahead, lookahead=4, "
    f"host_cache=0.05, storage='ssd:{rows_dir}')"
  )
  # (4 tables, one group: a fraction of the 26 tables' build, in the killed process too)
  return smoke_config(cache_dir, checkpoint_every=4, plan=[(".*", plan)], tables=4)


@pytest.fixture(scope="module")
def cache_dir(ctr_cache):
  return ctr_cache  # (conftest: one per process; the killed process reads it too)


@pytest.fixture(scope="module")
def full_run(cache_dir, tmp_path_factory):
  from recgnn.train import loop

  d = tmp_path_factory.mktemp("full")
  return loop.train(_trainer_config(cache_dir, d / "rows"), str(d / "wd"))


@pytest.mark.slow
@pytest.mark.parametrize("when", ["write_back", "checkpoint"])
def test_sigkill_then_resume_is_identical(when, cache_dir, full_run, tmp_path):
  """kill -9 while the writer writes evicted rows to the row file (after checkpoint 4), or
  while checkpoint 8 streams the row file into its temporary directory (chunks written, more
  to come): --resume writes a new row file from checkpoint 4 and ends identical to the
  uninterrupted run."""
  from recgnn.train import checkpoint, loop

  wd, rows = str(tmp_path / "wd"), str(tmp_path / "rows")
  proc = subprocess.run(
    [sys.executable, os.path.abspath(__file__), when, wd, cache_dir, rows],
    cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT},
    capture_output=True, text=True, timeout=900,
  )  # fmt: skip
  assert proc.returncode == -signal.SIGKILL, proc.stdout[-2000:] + proc.stderr[-3000:]
  assert checkpoint.committed_steps(wd) == [KILL_AFTER]
  if when == "checkpoint":  # (killed mid-stream: checkpoint 8 is a temporary, never committed)
    ck = checkpoint.checkpoint_dir(wd)
    assert any(n.startswith(f"8{checkpoint.TMP_MARK}") for n in os.listdir(ck)), os.listdir(ck)
  assert any(n.endswith(row_file.SUFFIX) for n in os.listdir(rows))  # the dead run's file
  resumed = loop.train(_trainer_config(cache_dir, rows), wd, resume=True)
  # (the device caches restart empty after a restore: the logical tables are compared)
  for k, g in resumed.plan.groups.items():
    want = full_run.plan.groups[k].tables(full_run.state.emb[k])
    for n, t in g.tables(resumed.state.emb[k]).items():
      np.testing.assert_array_equal(t, want[n], err_msg=n)
  for u, v in zip(*(jax.tree.leaves(r.state.params) for r in (full_run, resumed)), strict=True):
    np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
  assert resumed.metrics["test/auc"] == full_run.metrics["test/auc"]
  mine = f".pid{os.getpid()}."
  assert all(mine in n for n in os.listdir(rows) if n.endswith(row_file.SUFFIX))  # stale gone


def _kill_in(target, name, armed):
  original = getattr(target, name)

  def hooked(self, *a, **kw):
    if armed():
      os.kill(os.getpid(), signal.SIGKILL)
    return original(self, *a, **kw)

  setattr(target, name, hooked)


if __name__ == "__main__":  # the killed runs of test_sigkill_then_resume_is_identical
  from recgnn.train import checkpoint, loop

  _, when, workdir, cache, rows = sys.argv
  saved = []
  save = checkpoint.Checkpointer.save

  def counting_save(self, state, step, *a, **kw):
    saved.append(step)
    return save(self, state, step, *a, **kw)

  checkpoint.Checkpointer.save = counting_save
  writes = []
  if when == "write_back":  # the 3rd row-file write by the writer thread after checkpoint 4

    def armed():
      if saved == [KILL_AFTER] and threading.current_thread().name.endswith("writer"):
        writes.append(1)
      return len(writes) >= 3

    _kill_in(row_file.RowFile, "write", armed)
  else:  # checkpoint 8 streaming the row file into the checkpoint: its 3rd chunk
    from recgnn.embeddings import streamed

    streamed.CHUNK_BYTES = 64 << 10  # (several chunks: the kill lands mid-stream)
    reads = []

    def armed():
      if saved == [KILL_AFTER, 8]:
        reads.append(1)
      return len(reads) >= 3

    _kill_in(row_file.RowFile, "read_all", armed)
  loop.train(_trainer_config(cache, rows), workdir)
  sys.exit("not killed")


def test_host_memory_budget_points_at_the_ssd_level(tmp_path):
  """A plan over the host budget is refused naming the largest table and the SSD level; with
  its rows on disk it fits (host cache + maps only), and the plan table shows the disk."""
  spec = _spec(ADAGRAD, num_rows=100_000, dim=64)

  def plan_of(text):
    g = planner.make_backend(text, spec)
    return planner.Plan({g.name: g}, {"t": g.name}, g.mesh)

  ram = plan_of("offload(cache_fraction=0.01)")
  with pytest.raises(planner.PlanDoesNotFit, match=r"host budget is 10.0M.*t .*storage='ssd:"):
    planner.check_host_memory(ram, 10 << 20)
  # (host_cache=0.01: 1,000 records, 4 MB where the disk's block is 4096, 0.5 MB at 512)
  ssd = plan_of(_text(tmp_path, host_cache=0.01).replace("cache_rows=60", "cache_rows=1000"))
  assert planner.check_host_memory(ssd, 10 << 20) < 10 << 20
  mem = ssd.backend_of("t").memory()["t"]
  block = row_file.logical_block(str(tmp_path))  # (64 + 1 floats: one block of 512 or 4096)
  assert mem.disk_bytes == row_file.HEADER_BYTES + base.aligned_rows(100_000) * block
  assert "disk" in planner.format_plan(ssd).splitlines()[1]


def test_trainer_refuses_a_plan_over_the_host_budget(cache_dir, tmp_path):
  """config.host_memory_budget (run.py --host_memory_budget) is checked before allocating."""
  from recgnn.train import loop

  config = _trainer_config(cache_dir, tmp_path / "rows")
  config.host_memory_budget = "1K"
  with pytest.raises(planner.PlanDoesNotFit, match="of host memory, host budget is 0.0M"):
    loop.train(config, str(tmp_path / "wd"))


def test_auto_takes_the_ssd_level_when_host_memory_is_exceeded(tmp_path):
  """plan=auto with ssd=DIR lists the SSD level among a table's candidates, and its solver
  takes it for the tables the host budget cannot hold in RAM (the faster RAM placement
  elsewhere)."""
  from recgnn.planner.auto import milp, options, placements

  opts = options.AutoOptions(fractions=(0.01,), ssd=str(tmp_path), host_budget="300M")
  texts = placements.candidates(_spec(SGD), opts, planner.default_mesh())
  assert f"offload(cache_fraction=0.01, host_cache=0.05, storage='ssd:{tmp_path}')" in texts
  C = placements.Candidate  # noqa: N806
  by_table = {
    t: [C(t, "offload(ram)", 10, 200 << 20, 1.0), C(t, "offload(ssd)", 10, 20 << 20, 2.0)]
    for t in ("a", "b")
  }
  assert {c.text for c in milp.solve(by_table, None, "time").values()} == {"offload(ram)"}
  got = milp.solve(by_table, None, "time", host_budget=300 << 20)
  assert sorted(c.text for c in got.values()) == ["offload(ram)", "offload(ssd)"]
  with pytest.raises(planner.PlanDoesNotFit, match="and 30.0M of host memory"):
    milp.solve(by_table, None, "time", host_budget=30 << 20)


def test_a_read_ahead_that_never_lands_ends_with_the_message(tmp_path, monkeypatch):
  """A read of a row whose read-ahead never lands (its slot still pending: the disk stopped
  answering) ends after the bound with a message naming the file, not a wait forever."""
  from recgnn.backends.offload import disk_rows
  from recgnn.embeddings import host_tier

  f = row_file.RowFile(str(tmp_path), "t", num_rows=64, dim=4, slots=(), io="buffered")
  f.create(lambda first, n: np.zeros((n, f.floats), np.float32))
  rows = disk_rows.CachedRows(f, host_rows=8, policy="lru")
  rows.read(np.arange(4), None)  # (resident: slots of rows 0-3)
  rows.pending[rows.planner.row_slot[2]] = 99  # (a read-ahead of row 2 that never lands)
  monkeypatch.setattr(host_tier, "WAIT_SECONDS", 0.2)
  with pytest.raises(RuntimeError, match=r"still being read ahead from .*after 0.2 s"):
    rows.read(np.array([2]), None)
  f.close(remove=True)
