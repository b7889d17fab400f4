"""The host path of a step (issue 43): packing cached per structure, the traffic reader keyed
by the packed layout (no walk of the arguments), the stacked dedup of a dense group, the
input thread's transfer by platform."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from recgnn import planner, sharding
from recgnn.embeddings import OptimizerSpec, TableSpec, base, kernels
from recgnn.train import feeder as feeder_lib
from recgnn.train import inputs, traffic
from recgnn.train import train_state as state_lib
from recgnn.train.input_thread import InputThread


def _mesh(n):
  return jax.make_mesh((n, 1), (sharding.DATA, sharding.MODEL), devices=jax.devices()[:n])


def _tree(rng, b=16):
  return {
    "a": rng.integers(0, 9, (b, 3)).astype(np.int32),
    "b": rng.normal(size=(b,)).astype(np.float32),
    "g": rng.integers(0, 9, (5,)).astype(np.int32),  # a global leaf
    "h": np.arange(7, dtype=np.int32),  # a host leaf
  }


SPECS = {"a": sharding.BATCH_SPEC, "b": sharding.BATCH_SPEC, "g": sharding.REPLICATED,
         "h": sharding.HOST_SPEC}  # fmt: skip


@pytest.mark.parametrize("devices", [1, 8])
def test_pack_then_unpack_gives_each_device_its_slice(devices):
  rng = np.random.default_rng(0)
  tree = _tree(rng)
  mesh = _mesh(devices)
  (bufs, host), layout = inputs.pack(tree, SPECS, devices)
  assert [b.shape[0] for b in bufs] == [devices] * len(bufs)
  # Row i of the int32 buffer: device i's rows of "a", then the whole "g".
  i32 = bufs[[b.dtype for b in bufs].index(np.int32)]
  b = 16 // devices
  np.testing.assert_array_equal(
    i32[1 % devices, : b * 3], tree["a"][b * (1 % devices) :][:b].ravel()
  )
  np.testing.assert_array_equal(i32[devices - 1, b * 3 :], tree["g"])
  put = inputs.put((bufs, host), mesh)
  out = jax.jit(lambda bf: inputs.unpack(bf, layout, mesh))(put)
  for k in ("a", "b", "g"):
    np.testing.assert_array_equal(np.asarray(out[k]), tree[k])
  np.testing.assert_array_equal(np.asarray(out["h"]), tree["h"])


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("devices", [1, 8])
def test_pack_on_threads_makes_the_buffers_of_one_thread(monkeypatch, threads, devices):
  """A large batch's copies split over hostpool's threads (a tiny COPY_CHUNK_BYTES here, so
  every tree of this test is cut): runs of leaves of about equal bytes, covering each leaf
  once; the buffers equal the one-thread packing's, byte for byte."""
  from recgnn import hostpool

  rng = np.random.default_rng(threads)
  tree = {**_tree(rng, b=64), "c": rng.normal(size=(64, 9)).astype(np.float32),
          "e": np.zeros((64, 0), np.int32)}  # fmt: skip
  specs = {**SPECS, "c": sharding.BATCH_SPEC, "e": sharding.BATCH_SPEC}
  old = hostpool.set_threads(1)
  try:
    (want, _), _ = inputs.pack(tree, specs, devices)
    hostpool.set_threads(threads)
    monkeypatch.setattr(inputs, "COPY_CHUNK_BYTES", 16)
    leaves, treedef = jax.tree.flatten(tree)
    packer = inputs.Packer(treedef, leaves, jax.tree.leaves(specs), devices)
    cuts = packer._copy_cuts()
    assert cuts[0] == 0 and cuts[-1] == len(packer.slots) and cuts == sorted(set(cuts))
    assert len(cuts) - 1 == min(threads, len(packer.slots))  # (5 leaves on the devices)
    got, _ = packer(leaves)
  finally:
    hostpool.set_threads(old)
  for a, b in zip(got, want, strict=True):
    np.testing.assert_array_equal(a, b)


def test_pack_layout_hash_is_cached_and_structural():
  rng = np.random.default_rng(0)
  _, l1 = inputs.pack(_tree(rng), SPECS, 2)
  _, l2 = inputs.pack(_tree(rng), SPECS, 2)
  _, l3 = inputs.pack(_tree(rng, b=8), SPECS, 2)
  assert l1 is not l2 and l1 == l2 and hash(l1) == hash(l2)  # one jit program for both
  assert l1 != l3
  treedef, where = l1  # (unpacks as the tuple it replaced)
  assert len(where) == 4


def _dense_plan(mesh, tables=3, rows=50, pooling="sum", optimizer="rowwise_adagrad"):
  opt = OptimizerSpec(name=optimizer, learning_rate=0.1)
  specs = [
    TableSpec(name=f"t{i}", num_rows=rows + i, dim=4, optimizer=opt, pooling=pooling)
    for i in range(tables)
  ]
  return planner.resolve_plan([(".*", "dense")], specs, mesh, base.Layout(), log=False)


def _batch(rng, tables=3, b=16, rows=50):
  ids = {f"t{i}": rng.integers(-1, rows, (b, 1)).astype(np.int32) for i in range(tables)}
  return {"ids": ids, "dense": rng.normal(size=(b, 2)).astype(np.float32),
          "weight": np.ones(b, np.float32)}  # fmt: skip


def test_feeder_reuses_one_layout_per_signature_and_still_refuses_bad_batches():
  rng = np.random.default_rng(0)
  plan = _dense_plan(_mesh(8))
  feeder = feeder_lib.Feeder(plan)
  layouts = []
  for _ in range(3):
    batch = _batch(rng)
    prepared = inputs.prepare_one(plan, batch, [], train=True)
    bufs, layout = feeder.pack(prepared, batch)
    layouts.append(layout)
    # The cached packer gives what a fresh `inputs.pack` gives.
    (ref, _), ref_layout = inputs.pack(
      (prepared, state_lib.device_batch(batch)),
      feeder.specs(prepared, state_lib.device_batch(batch)),
      8,
    )
    assert ref_layout == layout
    for x, y in zip(bufs[0], ref):
      np.testing.assert_array_equal(x, y)
  assert layouts[0] is layouts[1] is layouts[2]
  # A batch that does not divide over 8 devices is refused, as before the cache.
  bad = _batch(rng, b=12)
  with pytest.raises(ValueError, match="12"):
    feeder.pack(inputs.prepare_one(plan, bad, [], train=True), bad)


class _NoWalk:
  """Arguments a per-step walk would touch: any use but identity fails."""

  def __iter__(self):
    raise AssertionError("the traffic reader walked the step's arguments")

  __len__ = __getitem__ = __iter__


def test_traffic_reads_each_program_once_and_never_walks_the_arguments():
  reads = []

  class Step:
    def lower(self, state, buffers, layout):
      reads.append(layout)
      return layout

  per = traffic.PerProgram(lambda lowered: f"program {lowered}")
  step, layout_a, layout_b = Step(), ("a",), ("b",)
  for layout in (layout_a, layout_a, layout_b, layout_a, layout_b):
    per.observe(step, None, (_NoWalk(), layout))
  assert reads == [layout_a, layout_b] and per.programs == 2
  assert per.current == "program ('b',)"
  assert [n for n, _ in per.take_new()] == [1, 2]
  per.observe(Step(), None, (_NoWalk(), layout_a))  # a re-jit: its programs are new
  assert per.programs == 3


@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_stacked_dedup_addresses_the_same_rows_as_per_table_dedup(pooling):
  if kernels.stacked_dedup_kernel() is None:
    pytest.skip("numba not installed: the group prepares table by table")
  rng = np.random.default_rng(1)
  plan = _dense_plan(_mesh(1), tables=4, rows=30, pooling=pooling)
  (group,) = plan.groups.values()
  assert group._stacked is not None
  for _ in range(3):
    batch = _batch(rng, tables=4, b=64, rows=30)
    got = group.prepare(batch["ids"], train=True)
    for n, m in group.members.items():
      want = base.TableBackend.prepare(m, batch["ids"][n])
      g = got[n]["rows"]
      np.testing.assert_array_equal(g["ids"], want["ids"])
      # The same row for every id (unique's order differs: first occurrence, not sorted) ...
      np.testing.assert_array_equal(
        g["unique"][g["inverse"].ravel()], want["unique"][want["inverse"].ravel()]
      )
      # ... the same distinct rows, each once, then the filler.
      k = len(np.unique(want["unique"]))
      assert sorted(g["unique"][:k]) == sorted(np.unique(want["unique"]))
      assert (g["unique"][k:] == m.pad_id).all()
      if pooling == "mean":
        np.testing.assert_array_equal(got[n]["count"], np.sum(batch["ids"][n] >= 0, axis=1))


def test_stacked_dedup_updates_the_tables_bit_for_bit_as_sorted_dedup():
  """The dense group's update over the stacked prepare equals the one over per-table sorted
  `dedup` (its unique in another order) after several steps of row-wise Adagrad."""
  if kernels.stacked_dedup_kernel() is None:
    pytest.skip("numba not installed")
  rng = np.random.default_rng(2)
  plan = _dense_plan(_mesh(1), tables=3, rows=20)
  (group,) = plan.groups.values()
  state = {"stacked": group.init(jax.random.key(0)), "sorted": group.init(jax.random.key(0))}
  update = jax.jit(group.update)
  for _ in range(4):
    batch = _batch(rng, tables=3, b=32, rows=20)
    g = {n: jnp.asarray(rng.normal(size=(32, 4)).astype(np.float32)) for n in group.members}
    stacked = group.prepare(batch["ids"], train=True)
    per_table = {
      n: {"rows": base.TableBackend.prepare(m, batch["ids"][n])} for n, m in group.members.items()
    }
    res = {n: () for n in group.members}
    state["stacked"] = update(state["stacked"], stacked, res, g)
    state["sorted"] = update(state["sorted"], per_table, res, g)
  stacked, per_table = group.export(state["stacked"]), group.export(state["sorted"])
  for n in group.members:
    for k in ("rows", "accum"):
      np.testing.assert_array_equal(np.asarray(stacked[n][k]), np.asarray(per_table[n][k]))


class _Task:
  batches_per_call = 1

  def num_examples(self, batch):
    return len(batch["weight"])


@pytest.mark.parametrize("devices", [1, 8])
def test_input_thread_transfers_where_the_platform_allows(devices):
  """One device: the input thread makes the transfer (the main thread only takes the batch);
  several CPU devices: the main thread does (XLA:CPU's multi-device hang, issue 30)."""
  rng = np.random.default_rng(3)
  plan = _dense_plan(_mesh(devices))
  feeder = feeder_lib.Feeder(plan)
  batches = [_batch(rng) for _ in range(5)]
  feed = InputThread(
    iter([("train", None, b) for b in batches]), plan, feeder, depth=2, task=_Task()
  )
  try:
    assert feed.put_here == (devices == 1)
    got = []
    while (item := feed.get()) is not None:
      assert item.on_device and isinstance(item.prepared[0][0][0], jax.Array)
      got.append(item)
  finally:
    feed.close()
  assert len(got) == 5 and all(g.batch_size == 16 for g in got)


def test_the_no_work_loop_runs_a_host_tier_plan(monkeypatch, ctr_cache):
  """benchmarks/host_path.py's ceiling loop over cdlrm_kaggle (offloaded tables): its no-work
  step still hands the host tier its write-backs, so the input thread's prepare, which waits
  for them, never stalls (it hung on the step that returned none)."""
  import argparse
  import importlib
  import pathlib

  # (a benchmark imports its harness by bare name: the scripts run from their folder)
  monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
  host_path = importlib.import_module("host_path")
  config_of = host_path.config_of

  def small(name, args):  # (the suite's small synthetic data, not the benchmark's)
    c = config_of(name, args)
    c.data.synthetic.rows, c.data.cache_dir = 20_000, ctr_cache
    return c

  monkeypatch.setattr(host_path, "config_of", small)

  args = argparse.Namespace(scale=0.002, batch=256, k=1, warmup=4, steady=8, log_every=4)
  out = host_path.measure_loop("cdlrm_kaggle", args, count=False)
  assert out["main_cpu_ms_per_step"] > 0 and out["samples_per_s"] > 0, out
