"""`sharded`: model-parallel tables against `dense`, their placements, and the codecs of the
all-to-all (the error bound holds for every value)."""

import contract_lib as contract
import hypothesis as hyp
import hypothesis.extra.numpy as hnp
import hypothesis.strategies as hst
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from recgnn import comms, planner, sharding
from recgnn.backends import sharded
from recgnn.embeddings import base, codecs

ADAGRAD = base.OptimizerSpec(name="rowwise_adagrad", learning_rate=0.1, initial_accumulator=0.1)
SGD = base.OptimizerSpec(name="sgd", learning_rate=0.1)


def _specs(opt, dim=8):
  """Tables of different sizes, bags and poolings; T4 holds most of the bytes."""
  rows = {"T0": 300, "T1": 1000, "T2": 50, "T3": 700, "T4": 20_000}
  pooling = {"T1": "mean", "T4": "mean"}
  return [
    base.TableSpec(name=n, num_rows=r, dim=dim, optimizer=opt, pooling=pooling.get(n, "sum"))
    for n, r in rows.items()
  ]


def _batches(specs, steps, batch=64, seed=0):
  bags = {"T0": 1, "T1": 3, "T2": 2, "T3": 1, "T4": 4}
  out = []
  for i in range(steps):
    out.append(
      {
        s.name: contract.zipf_ids(seed * 100 + i * 7 + j, 1, batch, bags[s.name], s.num_rows)[0]
        for j, s in enumerate(specs)
      }
    )
  return out


def _drive(group, batches, state=None):
  """Lookups of every step and the final tables, the update driven by the contract's grads."""
  state = group.init(jax.random.key(0)) if state is None else state
  lookup = jax.jit(group.lookup)
  update = jax.jit(group.update, donate_argnums=0)
  looks = []
  for step, ids in enumerate(batches):
    prepared = contract.put_prepared(group, group.prepare(ids), group.mesh)
    pooled, residuals = lookup(state, prepared)
    looks.append(jax.device_get(pooled))
    grads = {n: contract.grads_for(step, v) for n, v in pooled.items()}
    state = update(state, prepared, residuals, grads)
  return looks, group.tables(group.sync(state)), state


def _compare(text, mesh_shape, opt, atol=0.0, rtol=0.0, steps=5):
  specs = _specs(opt)
  batches = _batches(specs, steps)
  ref_looks, ref_tables, _ = _drive(planner.make_group("dense", specs), batches)
  group = planner.make_group(text, specs, sharding.make_mesh(*mesh_shape))
  looks, tables, state = _drive(group, batches)
  for step, (a, b) in enumerate(zip(looks, ref_looks)):
    for n in b:
      np.testing.assert_allclose(
        a[n], b[n], atol=atol, rtol=rtol, err_msg=f"{text} {n} step {step}"
      )
  for n in ref_tables:
    np.testing.assert_allclose(
      tables[n], ref_tables[n], atol=atol, rtol=rtol, err_msg=f"{text} {n}"
    )
  return group, state


# 8 x 1 (one MODEL shard: every table on it) is covered by the contract test.
@pytest.mark.parametrize("mesh_shape", [(2, 4), (1, 8)], ids=lambda m: f"{m[0]}x{m[1]}")
@pytest.mark.parametrize("opt", [SGD, ADAGRAD], ids=lambda o: o.name)
def test_table_wise_group_equals_dense(mesh_shape, opt):
  """Five tables (bags of 1-4, sum and mean pooling) spread table-wise over the MODEL shards:
  every lookup and the final tables equal single-device dense: bit-identical with SGD; with
  row-wise Adagrad to float rounding (the fused update of several tables compiles to other loops
  than dense's per-table one; sums over the batch are in the same order: rows touched once
  differ as much as rows touched often)."""
  tol = {} if opt.name == "sgd" else dict(rtol=1e-5, atol=1e-7)
  group, _ = _compare("sharded(kind=table)", mesh_shape, opt, **tol)
  owners = {p.shard for p in group.geometry.placement.values()}
  assert len(owners) == min(5, mesh_shape[1])  # the tables really are spread


@pytest.mark.parametrize("mesh_shape", [(2, 4), (1, 8)], ids=lambda m: f"{m[0]}x{m[1]}")
def test_auto_mixes_row_and_table_wise(mesh_shape):
  """auto: the table holding most of the group's bytes goes row-wise, the rest table-wise;
  equal to dense up to the order of the row-wise partial sums."""
  group, state = _compare("sharded", mesh_shape, ADAGRAD, rtol=1e-5, atol=1e-7)
  assert group.geometry.rw == ["T4"] and sorted(group.geometry.tw) == ["T0", "T1", "T2", "T3"]
  rows = state["rw"]["T4"]["rows"]
  k = mesh_shape[1]
  assert {s.data.shape for s in rows.addressable_shards} == {(base.aligned_rows(20_000) // k, 8)}


def test_column_wise_equals_dense():
  _compare("sharded(kind=column)", (2, 4), SGD)  # SGD: bit-identical
  _compare("sharded(kind=column)", (2, 4), ADAGRAD, rtol=1e-5, atol=1e-7)  # mean over columns


def test_planner_balances_and_refuses_impossible_plans():
  specs = {s.name: s for s in _specs(SGD)}
  p = sharded.plan_placements(specs, 4)
  assert p["T4"].kind == "row"
  # Table-wise tables spread over the 4 shards, one each (equal lookups, small bytes).
  assert sorted(x.shard for n, x in p.items() if x.kind == "table") == [0, 1, 2, 3]
  mesh = sharding.make_mesh(1, 8)
  odd = [base.TableSpec(name="a", num_rows=10, dim=12)]
  with pytest.raises(ValueError, match="dim 12, which does not split over the 8 devices"):
    planner.make_group("sharded(kind=column)", odd, mesh)
  mixed = [
    base.TableSpec(name="a", num_rows=10, dim=8),
    base.TableSpec(name="b", num_rows=10, dim=16),
  ]
  with pytest.raises(ValueError, match="need one dim"):
    planner.make_group("sharded(kind=table)", mixed, mesh)
  with pytest.raises(ValueError, match="unknown kind 'diagonal'; available: auto, table"):
    planner.make_group("sharded(kind=diagonal)", mixed, mesh)
  with pytest.raises(ValueError, match="Unknown codec 'zip'"):
    planner.make_group("sharded(codec=zip)", odd, mesh)
  # Options of the adaptive bound where nothing adapts: refused, not ignored.
  one = [base.TableSpec(name="a", num_rows=10, dim=8)]
  for text in ("sharded(codec=eb, eb=1e-3, headroom=0.5)", "sharded(bound=ema)",
               "sharded(codec=eb, fwd_eb=1e-3, bwd_codec=none, bound=ema)"):  # fmt: skip
    with pytest.raises(ValueError, match="no direction adapts"):
      planner.make_group(text, one, mesh)
  planner.make_group("sharded(codec=eb, fwd_eb=1e-3, headroom=0.5)", one, mesh)  # bwd adapts


def test_memory_per_device_and_budget():
  """Per-device bytes are the most one shard holds; a budget below it is refused with the
  numbers, before allocating."""
  specs = _specs(ADAGRAD)
  mesh = sharding.make_mesh(2, 4)
  plan = planner.resolve_plan([(".*", "sharded")], specs, mesh, log=False)
  group = plan.groups["sharded"]
  per_shard = group.device_bytes_by_shard()
  t4 = base.aligned_rows(20_000) // 4 * specs[4].row_bytes
  assert per_shard[0] == t4 + group.geometry.rows_tw * (8 * 4 + 4)
  assert planner.check_memory(plan, None) == max(per_shard)
  with pytest.raises(planner.PlanDoesNotFit, match="per device on mesh"):
    planner.check_memory(plan, max(per_shard) - 1)


def test_export_import_on_another_mesh():
  """Logical rows exported on 2x4 (auto: row + table-wise) import into column-wise on 1x8
  and into dense on 1x1 with the same tables and optimizer slots."""
  specs = _specs(ADAGRAD)
  batches = _batches(specs, 3)
  a = planner.make_group("sharded", specs, sharding.make_mesh(2, 4))
  _, tables, state = _drive(a, batches)
  logical = jax.device_get(a.export(state))
  for text, shape in (("sharded(kind=column)", (1, 8)), ("dense", (1, 1))):
    b = planner.make_group(text, specs, sharding.make_mesh(*shape))
    target = b.logical_target()
    placed = jax.tree.map(lambda x, t: jax.device_put(x, t.sharding), logical, target)
    got = b.tables(b.import_(placed))
    for n in tables:
      np.testing.assert_array_equal(got[n], tables[n], err_msg=f"{text} {n}")
    again = jax.device_get(b.export(b.import_(placed)))
    for n in tables:
      np.testing.assert_array_equal(again[n]["accum"], logical[n]["accum"], err_msg=n)


# ----------------------------------------------------------------------------- codecs


def _check_bound(x, eb):
  codec = codecs.Codec("eb", (x.shape[-1],))
  (dec,), ok = codecs.roundtrip(codec, [jnp.asarray(x)], jnp.asarray([eb]))
  dec = np.asarray(dec, np.float64)
  err = np.abs(np.asarray(x, np.float64) - dec)
  if bool(ok):
    assert err.max() <= eb, f"error {err.max()} > bound {eb}"
  return bool(ok), err


@pytest.mark.parametrize("seed", range(20))
def test_eb_bound_holds_on_random_inputs(seed):
  rng = np.random.default_rng(seed)
  scale = 10.0 ** rng.uniform(-6, 3)
  x = (rng.standard_normal((16, 8, 16)) * scale).astype(np.float32)
  eb = float(scale * 10.0 ** rng.uniform(-3, 0))
  ok, _ = _check_bound(x, eb)
  # Values within 126 steps fit the int8 codes: the message must then be carried.
  if np.abs(x).max() <= 126 * 2 * eb:
    assert ok


def test_eb_bound_on_adversarial_inputs():
  eb = 1e-3
  # Constant rows, zeros, values exactly on the rounding midpoints and at the code limits.
  cases = [
    np.full((4, 16), 0.123456, np.float32),
    np.zeros((4, 16), np.float32),
    (np.arange(64, dtype=np.float32).reshape(4, 16) - 32) * eb,  # multiples of eb: midpoints
    np.full((4, 16), 127 * 2 * eb, np.float32),
    np.full((4, 16), -127 * 2 * eb - 0.9 * eb, np.float32),
    np.float32(np.nextafter(np.float32(eb), np.float32(0))) * np.ones((4, 16), np.float32),
  ]
  for x in cases:
    ok, _ = _check_bound(x, eb)
    assert ok
  # A huge range cannot be carried in int8 codes within the bound: reported, never wrong.
  huge = np.linspace(-1e6, 1e6, 64, dtype=np.float32).reshape(4, 16)
  ok, err = _check_bound(huge, eb)
  assert not ok and err.max() > eb
  # Tiny bounds on huge values: rounding in f32 can miss the bound; the encoder checks it.
  ok, _ = _check_bound(np.full((2, 16), 3.0e4, np.float32), 1e-3)
  assert not ok


def test_non_finite_values_refused():
  codec = codecs.Codec("eb", (4,))
  x = np.array([[0.1, np.nan, 0.2, 0.3]], np.float32)
  with pytest.raises(ValueError, match=r"1 NaN/inf values \(first at index \(0, 1\)"):
    codecs.roundtrip(codec, [x], np.array([0.01], np.float32))
  with pytest.raises(ValueError, match="NaN/inf"):
    codecs.roundtrip(codecs.Codec("int8", (4,)), [np.array([[np.inf, 0, 0, 0]], np.float32)])
  # Inside a jitted step the eb codec reports them as not ok (the f32 fallback carries them).
  _, ok = jax.jit(codec.encode)([jnp.asarray(x)], jnp.array([0.01]))
  assert not bool(ok)


@pytest.mark.parametrize("name", codecs.CODECS)
def test_codec_error_and_bits(name):
  """Every codec round-trips to its format's precision; bits per value as documented."""
  rng = np.random.default_rng(0)
  x = [jnp.asarray(rng.standard_normal((32, 16)).astype(np.float32) * 0.05) for _ in range(3)]
  codec = codecs.Codec(name, (16, 16, 16))
  bounds = jnp.full((3,), 1e-3) if name == "eb" else None
  dec, ok = codecs.roundtrip(codec, x, bounds)
  assert bool(ok)
  rel = {"none": 0, "fp16": 1e-3, "bf16": 8e-3, "fp8_e4m3": 0.07, "fp8_e5m2": 0.13, "int8": 0.01}
  for a, b in zip(dec, x):
    err = np.abs(np.asarray(a) - np.asarray(b))
    if name == "eb":
      assert err.max() <= 1e-3
    else:
      assert err.max() <= rel[name] * np.abs(np.asarray(b)).max() + 1e-12, name
  bits = {"none": 32, "fp16": 16, "bf16": 16, "eb": 8}.get(name, 8 + 32 / 16)
  assert codec.bits_per_value() == bits
  payload, _ = codec.encode(x, bounds)
  nbytes = sum(v.size * v.dtype.itemsize for v in payload.values())
  assert nbytes == codecs.payload_bytes(codec, 32)


def test_eb_lookup_within_bound_and_fallback():
  """Table-wise lookups through the eb codec are within the fixed bound of dense; a bound too
  fine for the values makes the step fall back to f32 (exact), counted in the state."""
  specs = _specs(SGD)
  batches = _batches(specs, 3)
  ref_looks, _, _ = _drive(planner.make_group("dense", specs), batches[:1])
  mesh = sharding.make_mesh(2, 4)
  eb = 2e-3
  group = planner.make_group(f"sharded(kind=table, codec=eb, eb={eb})", specs, mesh)
  looks, _, state = _drive(group, batches[:1])
  for n in ref_looks[0]:
    err = np.abs(looks[0][n] - ref_looks[0][n])
    count = np.maximum((batches[0][n] >= 0).sum(1), 1)[:, None]
    mean = {s.name: s.pooling == "mean" for s in specs}[n]
    assert (err <= eb / (count if mean else 1) * (1 + 1e-5) + 1e-9).all()
    assert err.max() > 0  # really quantized
  rep = group.codec_report(state)
  assert rep["fwd/fallbacks"] == 0 and rep["fwd/steps"] == 1
  fine = planner.make_group("sharded(kind=table, codec=eb, eb=1e-9)", specs, mesh)
  looks, _, state = _drive(fine, batches[:1])
  for n in ref_looks[0]:
    np.testing.assert_array_equal(looks[0][n], ref_looks[0][n])
  assert fine.codec_report(state)["fwd/fallbacks"] == 1


def test_adaptive_bounds_follow_each_table():
  """Adaptive eb: each table's bound tracks its own range (tables scaled 1000x apart get
  bounds 1000x apart) and, after the first step (no statistics yet), no step falls back. A
  small learning rate: the contract's synthetic gradients (~3 per value) would otherwise
  move the ranges by more than the headroom every step, which training does not."""
  specs = _specs(base.OptimizerSpec(name="sgd", learning_rate=1e-3))
  batches = _batches(specs, 4)
  group = planner.make_group("sharded(kind=table, codec=eb)", specs, sharding.make_mesh(2, 4))
  state = group.init(jax.random.key(0))
  state["tw"]["rows"] = state["tw"]["rows"] * jnp.where(
    jnp.arange(group.geometry.k)[:, None, None] == group.geometry.placement["T0"].shard, 1000.0, 1.0
  )
  _, _, state = _drive(group, batches, state=state)
  rep = group.codec_report(state)
  assert rep["fwd/bound/T0"] > 100 * rep["fwd/bound/T3"]
  assert rep["fwd/fallbacks"] <= 1 and rep["bwd/fallbacks"] <= 1


def test_wire_bytes_from_hlo():
  """The compiled step's all-to-all carries int8 codes for eb (4x fewer bytes than f32), and
  the f32 fallback sits in its own named scope."""
  specs = _specs(SGD)
  mesh = sharding.make_mesh(1, 8)
  out = {}
  for codec in ("none", "eb"):
    group = planner.make_group(f"sharded(kind=table, codec={codec})", specs, mesh)
    state = group.init(jax.random.key(0))
    ids = _batches(specs, 1, batch=64)[0]
    prepared = contract.put_prepared(group, group.prepare(ids), mesh)
    hlo = jax.jit(group.lookup).lower(state, prepared).compile().as_text()
    out[codec] = comms.summary(hlo, skip_scope=sharded.FALLBACK_SCOPE)["by_op"]["all-to-all"]
  assert out["eb"]["dtypes"] == ["s32", "s8"]
  f32 = out["none"]["operand_bytes"]
  s8 = out["eb"]["operand_bytes"]
  ids_bytes = 8 * (64 // 8) * group.geometry.tmax * 4 * 4  # routed ids int32[k, b, Tmax, L=4]
  assert (f32 - ids_bytes) == 4 * (s8 - ids_bytes)


def test_access_profile_spreads_hot_tables(tmp_path):
  """With an access profile, the two tables that take most lookups go to different shards
  even when bytes alone would pair them; the profile is read from a plan option."""
  specs = [base.TableSpec(name=f"T{i}", num_rows=100, dim=8) for i in range(4)]
  profile = tmp_path / "profile.json"
  profile.write_text('{"T0": 40, "T1": 40, "T2": 1, "T3": 1}')
  group = planner.make_group(
    f"sharded(kind=table, profile='{profile}')", specs, sharding.make_mesh(1, 2)
  )
  assert group.geometry.placement["T0"].shard != group.geometry.placement["T1"].shard
  with pytest.raises(FileNotFoundError):
    planner.make_group("sharded(profile='/nonexistent.json')", specs, sharding.make_mesh(1, 2))


@hyp.settings(max_examples=300, derandomize=True, deadline=None)
@hyp.given(
  x=hnp.arrays(
    np.float32,
    (4, 16),  # one shape: one compilation for every example
    elements=hst.floats(width=32, allow_nan=False, allow_infinity=False),
  ),
  eb=hst.floats(float(np.float32(1e-30)), float(np.float32(1e30)), width=32),
)
def test_eb_bound_property(x, eb):
  """Any finite f32 message, any bound: if the encoder says ok, every decoded value is
  within eb (exactly, in float64); and a message whose codes fit is always carried."""
  ok, err = _check_bound(x, float(eb))
  if ok:
    assert err.max() <= float(eb)
  elif np.abs(x).max() <= 126 * 2 * float(eb) and np.isfinite(2 * 127 * float(eb)):
    raise AssertionError(f"a message within the codes was refused: max {np.abs(x).max()}, eb {eb}")
