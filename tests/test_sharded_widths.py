"""`sharded(codec=eb, widths=...)`: per-segment code widths inside the embedding all-to-all.
The bound holds for every value of the exchange at every width (f32 fallback included);
widths=auto re-plans the widths from the bound rule's statistics, a recompile per change
only; the codec state (bounds, widths, peaks) resumes bit-identically."""

import functools
import json

import contract_lib as contract
import hypothesis as hyp
import hypothesis.strategies as hst
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from recgnn import comms, planner, sharding
from recgnn.backends import sharded
from recgnn.embeddings import base, codecs

SGD = base.OptimizerSpec(name="sgd", learning_rate=1e-3)
ROWS = {"T0": 300, "T1": 1000, "T2": 50, "T3": 700, "T4": 2000}


def _specs(dim=8):
  return [base.TableSpec(name=n, num_rows=r, dim=dim, optimizer=SGD) for n, r in ROWS.items()]


def _batches(specs, steps, batch=64, start=0):
  return [
    {s.name: contract.zipf_ids(i * 7 + j, 1, batch, 2, s.num_rows)[0] for j, s in enumerate(specs)}
    for i in range(start, start + steps)
  ]


class Driver:
  """Jitted lookup / update that are rebuilt when `replan` changes the widths (as the
  trainer does); `traces` counts how often each was traced (compiled)."""

  def __init__(self, group):
    self.group, self.traces = group, 0
    self.build()

  def build(self):
    def lookup(state, prepared):
      self.traces += 1
      return self.group.lookup(state, prepared)

    self.lookup = jax.jit(lookup)
    self.update = jax.jit(self.group.update)

  def run(self, state, batches, first_step=0):
    looks = []
    for i, ids in enumerate(batches):
      prepared = contract.put_prepared(self.group, self.group.prepare(ids), self.group.mesh)
      pooled, res = self.lookup(state, prepared)
      looks.append(jax.device_get(pooled))
      grads = {n: contract.grads_for(first_step + i, v) * 1e-2 for n, v in pooled.items()}
      state = self.update(state, prepared, res, grads)
      state, changed = self.group.replan(state, first_step + i + 1)
      if changed:
        self.build()
    return looks, state


def _mesh():
  return sharding.make_mesh(2, 4)


@pytest.mark.parametrize("bits", codecs.WIDTHS)
def test_exchange_within_bound_at_every_width(bits):
  """Lookups through sharded's all-to-all with `bits`-wide codes stay within the fixed bound
  of dense, every value (segments whose range needs more codes go again as f32)."""
  specs = _specs()
  batches = _batches(specs, 1)
  ref, _, _ = _dense(specs, batches)
  eb = 3e-3
  group = planner.make_group(
    f"sharded(kind=table, codec=eb, eb={eb}, widths={bits})", specs, _mesh()
  )
  assert group.codecs["fwd"].widths == (bits,) * len(group.geometry.segment_dims())
  looks, state = Driver(group).run(group.init(jax.random.key(0)), batches)
  for n in ref[0]:
    err = np.abs(looks[0][n].astype(np.float64) - ref[0][n])
    assert (err <= eb).all(), (bits, n, err.max())
  rep = group.codec_report(state)
  assert rep["fwd/steps"] == 1
  assert rep["fwd/mean_bits_per_value"] == pytest.approx(group.codecs["fwd"].bits_per_value())


def _dense(specs, batches):
  group = planner.make_group("dense", specs)
  state = group.init(jax.random.key(0))
  looks = []
  for ids in batches:
    prepared = contract.put_prepared(group, group.prepare(ids), group.mesh)
    pooled, _ = jax.jit(group.lookup)(state, prepared)
    looks.append({n: np.asarray(v, np.float64) for n, v in jax.device_get(pooled).items()})
  return looks, None, state


@hyp.settings(max_examples=6, deadline=None, derandomize=True)
@hyp.given(
  scale=hst.floats(1e-3, 10.0),
  eb=hst.floats(1e-4, 1e-1),
  bits=hst.sampled_from(codecs.WIDTHS),
)
def test_exchange_bound_property(scale, eb, bits):
  """Any table scale, bound and width: every value of the exchange within the bound."""
  specs = _specs(dim=5)  # segments that do not fill whole words
  batches = _batches(specs, 1)
  group = planner.make_group(
    f"sharded(kind=table, codec=eb, eb={eb}, widths={bits})", specs, _mesh()
  )
  state = group.init(jax.random.key(0))
  state["tw"]["rows"] = state["tw"]["rows"] * scale
  prepared = contract.put_prepared(group, group.prepare(batches[0]), group.mesh)
  pooled, _ = jax.jit(group.lookup)(state, prepared)
  rows = group.tables(state)
  for n, v in jax.device_get(pooled).items():
    ids = batches[0][n]
    want = np.where(ids[..., None] >= 0, rows[n][np.maximum(ids, 0)].astype(np.float64), 0)
    err = np.abs(np.asarray(v, np.float64) - want.sum(1))
    assert (err <= eb * (1 + 1e-6) + 1e-7 * scale).all(), (n, err.max(), eb)


def test_auto_widths_replan_with_few_recompiles():
  """widths=auto with the tolerance rule: the widths start at 8 bits, are re-planned every
  `replan` steps from the ranges / bounds seen (a loose tolerance -> narrower codes), and
  the step is traced once per distinct plan, not once per step; no value misses its bound."""
  specs = _specs()
  text = "sharded(kind=table, codec=eb, bound=rms, rel=0.3, widths=auto, replan=2)"
  group = planner.make_group(text, specs, _mesh())
  drv = Driver(group)
  _, state = drv.run(group.init(jax.random.key(0)), _batches(specs, 8))
  _, state = drv.run(state, _batches(specs, 1, start=8), first_step=8)  # (no plan at 9)
  rep = group.codec_report(state)
  widths = group.codecs["fwd"].widths
  assert all(w in codecs.WIDTHS for w in widths)
  assert max(widths) < 8, widths  # a 0.3 RMS bound needs far fewer than 127 codes
  assert rep["fwd/mean_bits_per_value"] < 8
  assert drv.traces == 1 + group.width_changes <= 5  # 4 plans in 9 steps, a trace per change
  assert group.width_changes >= 1
  # The plan's widths and bounds are in the state (so in the checkpoint).
  host = jax.device_get(state["codec"])
  assert tuple(host["fwd"]["widths"]) == widths
  assert tuple(host["bwd"]["widths"]) == group.codecs["bwd"].widths


def test_schedule_loosens_the_bound():
  """bound=rms's schedule: rel for `warmup` steps, then a ramp to rel * late."""
  rule = codecs.BoundRule(mode="rms", rel=0.1, warmup=10, ramp=10, late=3.0)
  rel = [float(rule.rel_at(jnp.int32(s))) for s in (0, 9, 10, 15, 20, 100)]
  np.testing.assert_allclose(rel, [0.1, 0.1, 0.1, 0.2, 0.3, 0.3], rtol=1e-6)
  step = codecs.BoundRule(mode="rms", rel=0.1, warmup=5, late=2.0)
  assert float(step.rel_at(jnp.int32(4))) == pytest.approx(0.1)
  assert float(step.rel_at(jnp.int32(5))) == pytest.approx(0.2)


def test_width_for():
  assert codecs.width_for(0.0, 0.25) == 2
  assert codecs.width_for(1.5, 0.25) == 2  # 1.5 * 1.25 / ~2 < 1 code
  assert codecs.width_for(1.7, 0.25) == 4
  assert codecs.width_for(11.0, 0.25) == 4
  assert codecs.width_for(12.0, 0.25) == 8
  assert codecs.width_for(1e6, 0.25) == 16


@pytest.mark.parametrize(
  "text",
  [
    "codec=eb, widths=auto",  # the range rule sets the bound from the bits
    "codec=eb, widths=3",
    "codec=int8, widths=4",
    "codec=eb, bound=ema, widths=4",
    "codec=eb, rel=0.1",  # rel= without bound=rms
    "codec=eb, eb=1e-3, widths=4, replan=10",  # replan= without widths=auto
    "codec=eb, block=16",  # block-wise steps without code widths
    "codec=eb, widths=4, block=24",  # not a block size
    "codec=eb, fwd_widths=4, bwd_codec=none, bwd_widths=2",  # widths for a direction without eb
    "codec=eb, widths=8, fwd_widths=4, bwd_widths=2",  # widths= overridden both ways
    "codec=eb, fwd_widths=auto",  # auto under the range rule
    "codec=eb, fwd_widths=4, block=32",  # the bwd direction is eb without a width
  ],
)
def test_refused_options(text):
  with pytest.raises(ValueError):
    planner.make_group(f"sharded({text})", _specs(), _mesh())


# With block-wise steps (their headers are recomputed each step; the widths and bounds are
# the state), one run for both: a second one costs a minute on 2 loaded cores.
@pytest.mark.parametrize("widths", ["widths=auto, block=16"])
def test_resume_bit_identical(widths):
  """Save the codec state (extras, as the checkpoint writes them, through JSON) mid-run and
  restore it into a fresh group: the widths it is compiled with, the bounds, peaks and
  counters, and the steps after, are bit-identical to the run that went on."""
  specs = _specs()
  text = (
    "sharded(kind=table, codec=eb, bound=rms, rel=0.2, warmup=2, ramp=2, late=2.0, "
    f"{widths}, replan=2)"
  )
  batches = _batches(specs, 8)
  a = planner.make_group(text, specs, _mesh())
  drv = Driver(a)
  _, state = drv.run(a.init(jax.random.key(0)), batches[:5])
  saved = json.loads(json.dumps(a.extras(state)))
  tables = a.export(state)
  looks_a, state_a = drv.run(state, batches[5:], first_step=5)

  b = planner.make_group(text, specs, _mesh())
  fresh = b.import_(jax.device_get(tables))
  fresh = b.restore_extras(fresh, saved)
  assert b.codecs["fwd"].widths == tuple(saved["codec"]["fwd"]["widths"])
  looks_b, state_b = Driver(b).run(fresh, batches[5:], first_step=5)
  for x, y in zip(looks_a, looks_b):
    for n in x:
      np.testing.assert_array_equal(x[n], y[n])
  ha, hb = jax.device_get(state_a["codec"]), jax.device_get(state_b["codec"])
  for d in ha:
    for k in ha[d]:
      np.testing.assert_array_equal(ha[d][k], hb[d][k], err_msg=f"{d}/{k}")
  assert a.codecs == b.codecs


@pytest.mark.parametrize("bits, block", [(b, 0) for b in codecs.WIDTHS] + [(4, 16), (2, 32)])
def test_backward_exchange_within_bound(bits, block):
  """The backward all-to-all (gradients to the owners, per-peer bounds) at every width, and
  with block-wise steps: every received value within its table's bound of the exact (f32)
  all-to-all, on heavy-tailed values whose outliers force some segments to fall back."""
  specs = _specs(dim=8 if block else 5)
  extra = f", block={block}" if block else ""
  text = f"sharded(kind=table, codec=eb, eb=1e-2, widths={bits}{extra})"
  group = planner.make_group(text, specs, _mesh())
  codec, exact = group.codecs["bwd"], codecs.Codec("none", group.geometry.segment_dims())
  k, b, ndev = group.geometry.k, 4, group.mesh.size
  rng = np.random.default_rng(bits)
  segs = [
    jnp.asarray(rng.standard_t(2, (ndev * k, b, d)).astype(np.float32) * 0.05) for d in codec.dims
  ]
  bounds = jnp.asarray(rng.uniform(2e-3, 2e-2, len(specs) + 1).astype(np.float32))
  spec = sharding.P(sharding.BATCH)

  @jax.jit
  @functools.partial(
    jax.shard_map, mesh=group.mesh, in_specs=(spec,), out_specs=(spec, spec), check_vma=False
  )
  def ratio(segs):
    send = group._device.exchange.seg_bounds(bounds, sender=True, owner_is_sender=False)
    recv_b = group._device.exchange.seg_bounds(bounds, sender=False, owner_is_sender=False)
    got, fell = group._device.exchange.exchange(codec, segs, send, recv_b)
    want, _ = group._device.exchange.exchange(exact, segs, None, None)
    r = jnp.stack([jnp.max(jnp.abs(g - w)) / recv_b[i] for i, (g, w) in enumerate(zip(got, want))])
    return r[None], fell[None]

  r, fell = jax.device_get(ratio(segs))
  assert (r <= 1.0).all(), (bits, r.max())
  assert fell.all() or r.max() > 0.1  # really quantized where not sent as f32
  if bits >= 8:
    assert not fell.all()
  if bits <= 4:
    assert fell.any()  # t(2) tails do not fit 2- / 4-bit codes: the fallback carried them


@pytest.mark.long  # (test_resume_bit_identical checks the same at the group, in the default run)
def test_trainer_resume_with_replanned_widths_is_bit_identical(ctr_cache, tmp_path):
  """Through the trainer: widths=auto re-planned every 2 steps, a run stopped after 5 steps
  (checkpoint 4) and resumed to 12 ends bit-identical to the run that never stopped (the
  codec state, widths included, restored from the checkpoint and the step rebuilt at
  them)."""
  from recgnn.train import loop
  from tests.trainer_lib import smoke_config, state_leaves

  plan = ((".*", "sharded(codec=eb, bound=rms, rel=0.3, widths=auto, replan=2)"),)

  def config():  # (no final eval: the state and the codec's figures are compared)
    return smoke_config(
      ctr_cache, mesh=(2, 4), plan=plan, tables=4, checkpoint_every=2, final_eval_splits=()
    )

  whole = loop.train(config(), str(tmp_path / "a"))
  wd = str(tmp_path / "b")
  loop.train(config(), wd, stop_after=5)
  resumed = loop.train(config(), wd, resume=True)
  for x, y in zip(state_leaves(whole.state), state_leaves(resumed.state)):
    np.testing.assert_array_equal(x, y)
  m = {k: v for k, v in whole.metrics.items() if "/width/" in k or "/bound/" in k}
  assert m and m == {k: resumed.metrics[k] for k in m}


@pytest.mark.parametrize("bits, block", [(4, 16)])  # other widths / blocks: test_codec_blocks
def test_block_exchange_within_bound(bits, block):
  """Lookups through the all-to-all with block-wise steps stay within the fixed bound of
  dense, every value, and most blocks step finer than the table (their error far under it)."""
  specs = _specs()
  batches = _batches(specs, 1)
  ref, _, _ = _dense(specs, batches)
  eb = 3e-2
  text = f"sharded(kind=table, codec=eb, eb={eb}, widths={bits}, block={block})"
  group = planner.make_group(text, specs, _mesh())
  assert group.codecs["fwd"].block == group.codecs["bwd"].block == block
  looks, state = Driver(group).run(group.init(jax.random.key(0)), batches)
  errs = []
  for n in ref[0]:
    err = np.abs(looks[0][n].astype(np.float64) - ref[0][n])
    assert (err <= eb).all(), (bits, n, err.max())
    errs.append(err.ravel())
  assert np.median(np.concatenate(errs)) < eb / 4  # the blocks' own, finer steps
  rep = group.codec_report(state)
  assert rep["fwd/mean_bits_per_value"] == pytest.approx(bits + 8 / block)


def test_block_wire_bytes_from_hlo():
  """The compiled step's all-to-alls carry what `wire_bytes` counts for block-wise steps:
  codes and one-byte headers in uint32 words (4-bit codes, blocks of 16: 4.5 bits per
  value, 7.1x fewer than f32)."""
  specs = _specs(dim=16)
  mesh = sharding.make_mesh(1, 8)
  batch = 256
  out, wire = {}, {}
  for codec in ("codec=none", "codec=eb, widths=4, block=16"):
    group = planner.make_group(f"sharded(kind=table, {codec})", specs, mesh)
    state = group.init(jax.random.key(0))
    prepared = contract.put_prepared(group, group.prepare(_batches(specs, 1, batch)[0]), mesh)

    def step(state, prepared, group=group):
      pooled, res = group.lookup(state, prepared)
      return group.update(state, prepared, res, pooled)

    hlo = jax.jit(step).lower(state, prepared).compile().as_text()
    a2a = comms.summary(hlo, skip_scope=sharded.FALLBACK_SCOPE)["by_op"]["all-to-all"]
    out[codec] = a2a["operand_bytes"]
    wire[codec] = sum(group.wire_bytes(batch).values())
  ids_bytes = out["codec=none"] - wire["codec=none"]  # the routed ids, the same in both
  assert ids_bytes > 0
  coded = out["codec=eb, widths=4, block=16"] - ids_bytes
  assert coded == wire["codec=eb, widths=4, block=16"]
  assert wire["codec=none"] / coded == pytest.approx(32 / 4.5)
