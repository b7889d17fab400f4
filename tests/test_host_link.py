"""Host-link bytes read off a step's HLO (recgnn.comms.host_link) and the HLO reader's
dependency query (recgnn.hlo): exact byte counts on programs whose transfers are known."""

import contract_lib as contract
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import trainer_lib

from recgnn import comms, hlo, planner, sharding
from recgnn.embeddings import base
from tools import host_table as ht

ROWS, DIM, K = 1000, 16, 64


def _host_array(x, mesh=None):
  dev = jax.devices()[0]
  if "pinned_host" not in [m.kind for m in dev.addressable_memories()]:
    pytest.skip("no pinned_host memory on this platform")
  if mesh is None:
    s = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
  else:
    s = jax.sharding.NamedSharding(
      mesh, sharding.P(sharding.BATCH, None), memory_kind="pinned_host"
    )
  return jax.device_put(x, s)


def _to_host(x):
  return jax.device_put(x, jax.memory.Space.Host)


def _gather_then_compute(table, idx):
  """K rows gathered on the host, then used on the device: K ids to the host (s32), K rows
  (f32[K, DIM]) back to the device."""
  rows = ht.host_compute(ht.gather_rows, table, _to_host(idx))
  return (rows * 2.0).sum(), rows


def test_host_gather_moves_the_indices_and_the_rows_exactly():
  table = _host_array(np.ones((ROWS, DIM), np.float32))
  lowered = jax.jit(_gather_then_compute).lower(table, jnp.arange(K, dtype=jnp.int32))
  assert comms.host_params_of(lowered) == {0}
  link = comms.host_link_of(lowered)
  assert link.to_host_bytes == K * 4  # the indices
  assert link.to_device_bytes == K * DIM * 4  # the rows, read once although used twice
  assert link.devices == 1 and link.per_device == link.bytes


def test_host_resident_chain_moves_nothing_between_its_links():
  """A host scatter whose result a second host gather reads: the table never crosses."""
  table = _host_array(np.zeros((ROWS, DIM), np.float32))

  def f(table, idx, values):
    new = ht.host_compute(ht.scatter_rows, table, _to_host(idx), _to_host(values))
    rows = ht.host_compute(ht.gather_rows, new, _to_host(idx))
    return new, rows.sum()

  lowered = jax.jit(f).lower(table, jnp.arange(K, dtype=jnp.int32), jnp.ones((K, DIM)))
  link = comms.host_link_of(lowered)
  # to the host: idx and values for the scatter, idx again for the gather (one operand each)
  assert link.to_host_bytes == K * 4 + K * DIM * 4 + K * 4
  assert link.to_device_bytes == K * DIM * 4
  assert all(t.value != "table" for t in link.transfers)


def test_device_only_program_has_no_host_traffic():
  lowered = jax.jit(lambda x: (x @ x.T).sum()).lower(jnp.ones((8, 8)))
  link = comms.host_link_of(lowered)
  assert (link.to_host_bytes, link.to_device_bytes, link.transfers) == (0, 0, ())


def test_a_program_without_host_values_is_read_without_the_hlo_walk_and_agrees_with_it():
  """host_link_of reads a program with no host parameter, placement or host computation off
  its StableHLO text (no conversion to HLO): the HostLink the HLO walk gives, its devices
  (the mesh's size) too."""
  trainer_lib.skip_unless_devices(8, "a 2x4 mesh")
  mesh = sharding.make_mesh(2, 4)
  split = jax.sharding.NamedSharding(mesh, sharding.P(sharding.BATCH))
  for f in (lambda x: (x @ x.T).sum(), lambda x: jax.lax.with_sharding_constraint(x * 2, split)):
    lowered = jax.jit(f, in_shardings=split).lower(jnp.ones((8, 8)))
    walked = comms.host_link(
      lowered.compiler_ir("hlo").as_hlo_text(), comms.host_params_of(lowered)
    )
    assert comms.host_link_of(lowered) == walked and walked.devices == 8


def test_shard_map_body_counts_once_per_device():
  if len(jax.devices()) < 4:
    pytest.skip("needs 4 devices")
  mesh = sharding.make_mesh(4, 1)
  table = _host_array(np.ones((ROWS, DIM), np.float32), mesh)

  def f(table, idx):
    def local(block, idx):
      rows = ht.host_compute(ht.gather_rows, block, _to_host(idx))
      return jax.lax.psum(rows * 1.0, sharding.BATCH)

    return jax.shard_map(
      local, mesh=mesh, in_specs=(sharding.P(sharding.BATCH, None), sharding.P()),
      out_specs=sharding.P(),
    )(table, idx)  # fmt: skip

  lowered = jax.jit(f).lower(table, jnp.arange(K, dtype=jnp.int32))
  link = comms.host_link_of(lowered)
  assert link.devices == 4
  assert link.to_device_bytes == 4 * K * DIM * 4  # every device reads K rows of its block
  assert link.to_host_bytes == 4 * K * 4
  assert link.per_device == K * DIM * 4 + K * 4


def test_no_step_moves_anything_inside_it_and_offload_moves_rows_with_its_batch():
  """Inside the step nothing crosses the host link, for dense and for offload (issue 42: the
  host tier's rows are read on the input thread and moved with the batch); offload's batch
  carries at least the rows a cold cache misses, its update returns the rows it evicts."""
  spec = base.TableSpec(name="t", num_rows=ROWS, dim=8)
  ids = np.random.default_rng(0).integers(0, ROWS, (K, 1)).astype(np.int32)
  for text in ("dense", "offload(cache_rows=128)"):
    group, lowered = contract.lowered_step(text, spec, ids)
    assert comms.host_link_of(lowered).bytes == 0, text
  group = planner.make_backend("offload(cache_rows=128)", spec)
  group.init(jax.random.key(0))
  lists = group.prepare({"t": ids}, [{"t": ids}])["lists"][0]
  loaded = sum(x.nbytes for k in ("now_rows", "next_rows") for x in jax.tree.leaves(lists.get(k)))
  assert loaded >= K * 8 * 4


def test_depends_follows_operands_transitively():
  text = (
    jax.jit(lambda a, b: (jnp.sin(a) + 1.0, jnp.cos(b)))
    .lower(jnp.ones(4), jnp.ones(4))
    .compiler_ir("hlo")
    .as_hlo_text()
  )
  module = hlo.parse(text)
  entry = module.instrs()
  params = {i.parameter: n for n, i in entry.items() if i.op == "parameter"}
  (sin,) = [n for n, i in entry.items() if i.op == "sine"]
  (cos,) = [n for n, i in entry.items() if i.op == "cosine"]
  assert module.depends(sin, params[0]) and not module.depends(sin, params[1])
  assert module.depends(cos, params[1]) and not module.depends(cos, sin)


def test_parse_reads_compiled_hlo_operands_with_shapes():
  ins = hlo.parse_instr("  %add.1 = f32[2,3]{1,0} add(f32[2,3]{1,0} %p.0, f32[2,3]{1,0} %p.1)")
  assert (ins.name, ins.op, ins.operands, ins.bytes) == ("add.1", "add", ("p.0", "p.1"), 24)
  t = hlo.parse_instr("  ROOT t = (f32[2]{0}, s32[]) tuple(a, b)")
  assert t.root and t.op == "tuple" and t.bytes == 12


OFFLOAD = "offload(cache_fraction=0.5, min_cache_rows=1024, lookahead=1)"


def _trained(cache_dir, plan: str, steps: int):
  """The trainer's own run (`setup.build` of the smoke experiment on 1x1, every table under
  `plan`, a host tier) after `steps` train steps: (run, state, the last step's packed
  arguments)."""
  from recgnn.train import setup

  config = trainer_lib.smoke_config(cache_dir, mesh=(1, 1), plan=[(".*", plan)], tables=4)
  run = setup.build(config)
  it = run.task.train_batches(0)
  state = run.state
  for _, packed in run.feed([("train", None, next(it)) for _ in range(steps)]):
    state, _ = run.train_step(state, *packed)
  return run, state, packed


@pytest.fixture(scope="module")
def trained(ctr_cache):
  """`_trained(plan, steps)` built once per (plan, steps) for the module's tests (the offload
  run and its step's lowering are shared by the two tests that read it)."""
  memo = {}

  def get(plan: str, steps: int):
    if (plan, steps) not in memo:
      run, state, packed = _trained(ctr_cache, plan, steps)
      memo[plan, steps] = run, state, packed, run.train_step.lower(state, *packed)
    return memo[plan, steps]

  return get


def test_trainer_step_of_an_offload_table_moves_rows_not_the_table(trained):
  """The trainer's own packed step (setup.build): nothing crosses the link inside it; its
  batch's transfer and the rows it returns for the host writer are smaller than the largest
  table (no table moves), and both carry rows."""
  from recgnn.train import traffic

  # (1x1: on a mesh each device's share of an exchange counts once per device)
  # (the run of test_trainer_step_of_a_host_tier_sends_no_index_back[offload]: 8 steps)
  run, _, _, lowered = trained(OFFLOAD, 8)
  assert comms.host_link_of(lowered).bytes == 0
  assert "pinned_host" not in lowered.as_text()  # (no argument in host memory either)
  into, out = traffic.step_io(lowered)
  big = max(s.table_bytes for s in run.plan.specs.values())
  # (the batch's transfer is the batch's ids and rows, not bounded by a table; what comes
  # back is rows the step evicted, less than a table)
  assert into > 0 and 0 < out < big, (into, out, big)


def test_trainer_logs_and_saves_each_step_programs_traffic(ctr_cache, tmp_path, capsys):
  """The trainer reads the host-link and collective bytes of its train step's program once
  (recgnn.train.traffic), logs them, and writes them to results.json: the same figures as
  `traffic.program_traffic` of that step lowered again from the same batches (the batch's
  transfer with the host tier's rows in, the evicted rows out)."""
  import json

  import trainer_lib

  from recgnn.train import loop, setup, traffic

  config = trainer_lib.smoke_config(
    ctr_cache,
    mesh=(2, 1),  # (two devices: the dense gradients' all-reduce is a collective)
    # (two offloaded tables of four: the step compiles in a fraction of the time of 26)
    plan=[
      ("C(1|2)", "offload(cache_fraction=0.5, min_cache_rows=1024, lookahead=1)"),
      (".*", "dense"),
    ],
    tables=("C1", "C2", "C3", "C4"),
    steps=2,
    log_every=2,
    final_eval_splits=(),
  )
  trainer_lib.skip_unless_devices(2, "a 2 x 1 mesh")
  loop.train(config, str(tmp_path / "run"))
  saved = json.loads((tmp_path / "run" / "results.json").read_text())
  out = capsys.readouterr().out
  assert out.count("Train step program ") == saved["link/programs"] >= 1, out

  run = setup.build(config)  # the same run, its last step lowered again
  it = run.task.train_batches(0)
  *_, (_, packed) = run.feed([("train", None, next(it)) for _ in range(2)])  # (prepared in order)
  lowered = run.train_step.lower(run.state, *packed)  # (the steps' state has the same shapes)
  want = traffic.program_traffic(lowered)
  into, back = traffic.step_io(lowered)
  assert saved["link/host_to_device_bytes"] == want["host_to_device_bytes"] == into > 0
  assert saved["link/device_to_host_bytes"] == want["device_to_host_bytes"] == back > 0
  collectives = comms.summary(lowered.compile().as_text())["total_operand_bytes"]
  assert saved["link/collective_bytes_per_device"] == collectives > 0
  metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  assert [m["link/host_to_device_bytes"] for m in metrics if "loss" in m] == [into]


# (hot_cold through the trainer too: 32 s of CI for the same Feeder path)
@pytest.mark.parametrize(
  "plan",
  [
    pytest.param("hot_cold(budget=0.05, profile_batches=2)", marks=pytest.mark.long),
    OFFLOAD,
  ],
)
def test_trainer_step_of_a_host_tier_sends_no_index_back(trained, plan):
  """The host keeps the row lists it planned: what a host tier's step returns for the host
  (TO_HOST) is rows and their optimizer state, never an index; no leaf of the batch lives in
  host memory (the step reads nothing there)."""
  _, _, packed, lowered = trained(plan, 8)
  (_, host), _ = packed
  assert not host
  back = jax.tree.leaves(lowered.out_info[2])
  assert back and all(np.issubdtype(x.dtype, np.floating) for x in back), back
