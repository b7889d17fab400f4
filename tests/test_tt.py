"""The `tt` backend against its own reference: the dense reconstruction of its cores.

TT cannot match `dense` (it is a compressed table), so tests/test_contract.py's EXACT list does
not apply; instead, at every step of a run driven like the trainer's (prepare running ahead),
lookups must equal the reconstructed table, core gradients must equal jax.grad of a naive
reference, and the optimizer must act on core slices as documented in
recgnn/backends/tt/__init__.py.
"""

import dataclasses
import functools
import json
import math

import contract_lib as contract
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from recgnn import planner, sharding
from recgnn.backends import tt
from recgnn.embeddings import base

SGD = base.OptimizerSpec(name="sgd", learning_rate=0.1)
ADAGRAD = base.OptimizerSpec(name="rowwise_adagrad", learning_rate=0.1, initial_accumulator=0.1)
OPTIMIZERS = [SGD, ADAGRAD]
TOL = {"rtol": 2e-4, "atol": 2e-6}
# Every way of computing rows: the kernels, and the prefix / unique kernels with each level
# product (contract=); all must compute the same rows and gradients.
VARIANTS = [
  "kernel=naive",
  "kernel=unique, contract=batched",
  "kernel=unique, contract=pairs",
  "kernel=prefix, contract=batched",
  "kernel=prefix, contract=pairs",
]


def _spec(opt=SGD, num_rows=1000, dim=8, **kw):
  return base.TableSpec(name="t", num_rows=num_rows, dim=dim, optimizer=opt, **kw)


def _batches(num_rows=1000, n=6, seed=1, batch=64, bag=3):
  return contract.zipf_ids(seed=seed, num_batches=n, batch=batch, bag=bag, num_rows=num_rows)


def _member(text, spec, mesh=None) -> tt.TT:
  """The per-table TT backend of a group of one (its unpooled rows, cores and options)."""
  return planner.make_backend(text, spec, mesh).members[spec.name]


def _numpy_rows(cores, ids, num_rows):
  """Reference: each row as the chain product of one slice per core, in float64 numpy."""
  cores = [np.asarray(c, np.float64) for c in cores]
  n = [c.shape[0] for c in cores]
  out = np.zeros(ids.shape + (math.prod(c.shape[2] for c in cores),))
  for pos, i in np.ndenumerate(ids):
    if not 0 <= i < num_rows:
      continue
    digits = np.unravel_index(i, n)
    m = cores[0][digits[0]][0]  # [d_1, r_1]
    for c, d in zip(cores[1:], digits[1:]):
      m = np.einsum("ar,rbs->abs", m, c[d]).reshape(-1, c.shape[3])
    out[pos] = m[:, 0]
  return out


def _drive(backend_text, spec, batches, prefetch=contract.PREFETCH, eval_at=(), mesh=None):
  """contract.run (the trainer's prepare driver, run-ahead included) with a check at every
  item, before its update: the pooled lookup equals the pooled rows of table(state), and the
  table's unpooled rows (`members["t"].lookup`) equal table(state)[ids], 0 at padding.

  `eval_at`: steps before which an eval batch (that step's batch reversed) is prepared with
  train=False and looked up but never updated. Returns the train steps' lookups.
  """
  group = planner.make_backend(backend_text, spec, mesh)
  rows_of = jax.jit(group.members[spec.name].lookup)
  kinds = []

  def check(item, state):
    table = group.tables(state)[spec.name]
    contract.assert_lookups_equal_table(item.pooled, table, item.ids, **TOL)
    rows = np.asarray(rows_of(state[spec.name], item.prepared[spec.name]["rows"]))
    valid = item.ids >= 0
    np.testing.assert_allclose(rows[valid], table[item.ids[valid]], **TOL)
    np.testing.assert_array_equal(rows[~valid], 0.0, err_msg="padding must look up as 0")
    kinds.append(item.kind)

  evals = {s: batches[s][::-1] for s in eval_at}
  trace = contract.run(
    backend_text, spec, batches, prefetch=prefetch, evals=evals, group=group, check=check
  )
  assert kinds.count("eval") == len(eval_at) and kinds.count("train") == len(batches)
  trace.lookups = [x for x, k in zip(trace.lookups, kinds) if k == "train"]
  return trace


# ----------------------------------------------------------------------------- shapes


def test_factorizations():
  assert tt.balanced_row_factors(10_131_227, 3) == (216, 217, 217)
  assert tt.balanced_dim_factors(16, 3) == (2, 2, 4)
  assert tt.balanced_dim_factors(13, 3) == (1, 1, 13)
  for n in [1, 2, 7, 1000, 1001, 99_999, 10_131_227, 2**20 + 1]:
    for k in [1, 2, 3, 4]:
      f = tt.balanced_row_factors(n, k)
      assert len(f) == k and math.prod(f) >= n, (n, k, f)
      # Balanced: no factor can shrink by one and still cover n.
      assert max(f) - min(f) <= 1 or math.prod(f) // max(f) * (max(f) - 1) < n, (n, k, f)
  for d in [1, 4, 8, 12, 16, 64, 128]:
    assert math.prod(tt.balanced_dim_factors(d, 3)) == d


def test_shape_ranks_are_capped_and_counted():
  s = tt.tt_shape(10_131_227, 16, rank=32)
  assert s.ranks == (1, 32, 32, 1)
  assert s.core_shapes() == [(216, 1, 2, 32), (217, 32, 2, 32), (217, 32, 4, 1)]
  assert s.num_params == 216 * 64 + 217 * 2048 + 217 * 128
  # 3 x 8 table as 3 x 1 x 2 x 4: rank above min(n_1 d_1, ...) adds nothing, so it is capped.
  small = tt.tt_shape(3, 8, rank=32, cores=2)
  assert small.ranks[1] <= min(small.row_factors[0] * small.dim_factors[0], 2 * 4)
  with pytest.raises(ValueError, match="row_factors"):
    tt.tt_shape(1000, 8, row_factors=(9, 9, 9))
  with pytest.raises(ValueError, match="dim_factors"):
    tt.tt_shape(1000, 8, dim_factors=(2, 2, 3))


def test_plan_string_options():
  spec = _spec(num_rows=50_000, dim=16)
  b = _member("tt(rank=16, cores=3, init=sampled_gaussian, cache_rows=10000, kernel=prefix)", spec)
  assert b.shape.ranks == (1, 16, 16, 1) and b.cache_rows == 10000 and b.options.kernel == "prefix"
  assert planner.make_backend(b.describe(), spec).describe() == b.describe()
  b4 = _member("tt(rank=(4, 8, 4), cores=4, init=orthogonal, kernel=naive)", spec)
  assert b4.shape.ranks == (1, 4, 8, 4, 1) and b4.options.init == "orthogonal"
  for text in [
    b4.describe(),
    "tt(rank=8, row_factors=(50, 40, 30), dim_factors=(4, 2, 2), cache_rows=5, cache_warmup=7)",
  ]:
    again = _member(planner.make_backend(text, spec).describe(), spec)
    assert again.describe() == planner.make_backend(text, spec).describe()
    assert again.shape == _member(text, spec).shape
  assert "cache_warmup=7" in again.describe() and again.shape.dim_factors == (4, 2, 2)
  for bad, msg in [
    ("tt(kernel=fast)", "available: naive, unique, prefix"),
    ("tt(init=xavier)", "available: sampled_gaussian"),
    ("tt(rnak=4)", "Bad options"),
    ("tt(pad=full, lookahead=8)", "pad=full has none to size"),
  ]:
    with pytest.raises(ValueError, match=msg):
      planner.make_backend(bad, spec)
  with pytest.raises(ValueError, match="initializer='uniform'"):
    planner.make_backend("tt", _spec(initializer="zeros"))


@pytest.mark.parametrize("mesh_shape", [(1, 1), (8, 1)], ids=lambda m: f"{m[0]}x{m[1]}")
def test_memory_matches_allocation(mesh_shape):
  """memory() is per device; on a mesh every device holds the whole (replicated) state."""
  mesh = sharding.make_mesh(*mesh_shape)
  for text, opt in [("tt(rank=8)", SGD), ("tt(rank=8, cache_rows=100)", ADAGRAD)]:
    b = planner.make_backend(text, _spec(opt, num_rows=5000, dim=16), mesh)
    state = b.init(jax.random.key(0))
    leaves = jax.tree.leaves(state)
    assert all(x.sharding.is_fully_replicated for x in leaves)
    for d in mesh.devices.flat:
      held = sum(s.data.nbytes for x in leaves for s in x.addressable_shards if s.device == d)
      assert b.memory()["t"].device_bytes == held


# ----------------------------------------------------------------------------- init


# tt_svd compresses a given table (its variance: tests/test_nimble.py).
@pytest.mark.parametrize("init", [i for i in tt.INITS if i != "tt_svd"])
@pytest.mark.parametrize("initializer,num_rows", [("uniform", 20_000), ("normal", 3000)])
def test_init_variance_matches_dense_initializer(init, initializer, num_rows):
  spec = _spec(num_rows=num_rows, dim=16, initializer=initializer)
  target = 1 / (3 * num_rows) if initializer == "uniform" else 1 / 16
  assert tt.target_variance(spec) == pytest.approx(target)
  b = planner.make_backend(f"tt(rank=16, init={init})", spec)
  tables = [b.tables(b.init(jax.random.key(s)))["t"] for s in range(6)]
  var = np.mean([np.var(t) for t in tables])
  assert abs(np.mean([t.mean() for t in tables])) < 0.1 * math.sqrt(target)
  assert var == pytest.approx(target, rel=0.08), f"{init}: variance {var:.3g}, target {target:.3g}"


def test_reconstruct_matches_numpy_chain_product():
  spec = _spec(num_rows=700, dim=12)
  for text in ["tt(rank=5)", "tt(rank=(3, 4, 2), cores=4)", "tt(rank=6, cores=2)"]:
    b = _member(text, spec)
    state = b.init(jax.random.key(3))
    ids = np.random.default_rng(0).integers(0, spec.num_rows, 100)
    ref = _numpy_rows(state["cores"], ids, spec.num_rows)
    np.testing.assert_allclose(b.table(state)[ids], ref, rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------- lookup, grads


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: o.name)
def test_lookups_equal_reconstruction_every_step_and_kernels_agree(opt):
  batches = _batches()
  traces = {v: _drive(f"tt(rank=4, {v})", _spec(opt), batches) for v in VARIANTS}
  ref = traces["kernel=naive"]
  for k, tr in traces.items():  # (_drive checks padding looks up as 0)
    assert not np.allclose(tr.lookups[0], tr.lookups[-1])  # it trained
    for step, (a, b) in enumerate(zip(tr.lookups, ref.lookups)):
      np.testing.assert_allclose(a, b, **TOL, err_msg=f"{k} vs naive, step {step}")
    np.testing.assert_allclose(tr.table, ref.table, **TOL, err_msg=k)


@pytest.mark.parametrize(
  "text", ["tt(rank=4)", "tt(rank=4, kernel=naive, cache_rows=40, cache_warmup=2)"]
)
@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: o.name)
@pytest.mark.parametrize("mesh_shape", [(8, 1), (2, 4)], ids=lambda m: f"{m[0]}x{m[1]}")
def test_on_a_mesh_equals_its_reconstruction_and_one_device(text, opt, mesh_shape):
  """On a mesh (8x1, 2x4) TT is replicated and the batch split over the devices: at every
  step (an eval batch included) lookups equal its own dense reconstruction, and the run equals
  one device's."""
  batches = _batches()
  got = _drive(text, _spec(opt), batches, eval_at=(3,), mesh=sharding.make_mesh(*mesh_shape))
  for x in jax.tree.leaves(got.state):
    assert x.sharding.is_fully_replicated and len(x.sharding.device_set) == 8
  one = _drive(text, _spec(opt), batches, eval_at=(3,))
  assert not np.allclose(got.lookups[0], got.lookups[-1])  # it trained
  for step, (a, b) in enumerate(zip(got.lookups, one.lookups)):
    np.testing.assert_allclose(a, b, **TOL, err_msg=f"8x1 vs 1x1, step {step}")
  np.testing.assert_allclose(got.table, one.table, **TOL)


def _reference_loss(cores, ids, g, num_rows):
  """sum(rows * g) with rows from the dense reconstruction: the naive reference."""
  table = tt.reconstruct(cores, num_rows)
  rows = jnp.where((ids >= 0)[..., None], table[jnp.maximum(ids, 0)], 0.0)
  return jnp.sum(rows * g)


@pytest.mark.parametrize("variant", VARIANTS)
def test_core_grads_match_jax_grad_of_reconstruction(variant):
  spec = _spec(num_rows=1000, dim=8)
  ids = _batches(n=1)[0]
  b = _member(f"tt(rank=4, {variant})", spec)  # unpooled: a gradient per bag slot
  state = b.init(jax.random.key(1))
  g = jax.random.normal(jax.random.key(2), ids.shape + (spec.dim,))
  # (both sides jitted whole: op by op, each compiled a program per op)
  ref = jax.jit(jax.grad(_reference_loss), static_argnums=3)(
    state["cores"], jnp.asarray(ids), g, spec.num_rows
  )
  got = jax.jit(b.core_grads)(state, b.prepare(ids), g)
  for k, (a, r) in enumerate(zip(got, ref)):
    assert float(jnp.abs(r).max()) > 0
    np.testing.assert_allclose(a, r, rtol=1e-4, atol=1e-6, err_msg=f"core {k}")


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: o.name)
def test_update_applies_rowwise_optimizer_to_core_slices(variant, opt):
  """SGD: cores -= lr * grad. Adagrad: one accumulator per slice G_k[i], as documented."""
  spec = _spec(opt, num_rows=1000, dim=8)
  ids = np.array([[3, 17, -1], [512, 3, 998]])  # repeats, padding, and untouched slices
  b = _member(f"tt(rank=4, {variant})", spec)  # unpooled: a gradient per bag slot
  state = b.init(jax.random.key(1))
  g = jax.random.normal(jax.random.key(2), ids.shape + (spec.dim,))
  ref = jax.grad(_reference_loss)(state["cores"], jnp.asarray(ids), g, spec.num_rows)
  old = jax.tree.map(np.asarray, state)
  new = jax.jit(b.update)(state, b.prepare(ids), g)
  for k, (c0, c1, gk) in enumerate(zip(old["cores"], new["cores"], ref)):
    c0, gk = c0.astype(np.float64), np.asarray(gk, np.float64)
    flat = gk.reshape(gk.shape[0], -1)
    if opt.name == "sgd":
      want = c0 - opt.learning_rate * gk
    else:
      acc = old["accum"][k] + np.mean(flat**2, axis=1)
      np.testing.assert_allclose(new["accum"][k], acc, rtol=1e-4, atol=1e-7)
      want = c0 - opt.learning_rate * gk / (np.sqrt(acc) + opt.eps)[:, None, None, None]
    np.testing.assert_allclose(c1, want, rtol=1e-4, atol=1e-6, err_msg=f"core {k}")
    touched = np.abs(flat).max(axis=1) > 0
    assert touched.any() and not touched.all()  # untouched slices exist and stay put
    np.testing.assert_array_equal(np.asarray(c1)[~touched], old["cores"][k][~touched])


@pytest.mark.parametrize(
  "variant, num_rows",
  [("kernel=naive", 200_000), ("contract=batched", 200_000), ("contract=auto", 2_000_000)],
)
def test_update_is_sparse(variant, num_rows):
  """contract=pairs's scratch is O(distinct parents x slices): bounded (auto keeps the pair
  table under the cost model's pairs_max_floats), not by the batch alone, so at 200k rows
  (58 x 59 x 59) it is over a quarter of the table; auto weighs it against the batched
  product (at 2M rows it takes the batched one for this batch: few prefixes share a parent)."""
  spec = _spec(ADAGRAD, num_rows=num_rows, dim=16)
  batch = _batches(num_rows=spec.num_rows, n=1, batch=256, bag=2)[0]
  contract.assert_update_is_sparse(f"tt(rank=16, {variant})", spec, batch)


def test_level_product_cost_model():
  """auto takes pairs where the distinct parents x slices are few (the synthetic default's
  levels), the batched product where they are many (real Kaggle sizes) or the pair table
  would be large; contract= overrides it and is refused where it means nothing. (XLA:CPU's
  constants, whatever platform runs the test.)"""
  cpu = tt.CPU_COSTS
  assert tt.level_product(46, 2, 32, 46, 2, 32, 448, cpu) == "pairs"  # ttrec_kaggle C3, level 1
  assert tt.level_product(448, 4, 32, 46, 4, 1, 1280, cpu) == "pairs"  # level 2
  assert tt.level_product(1500, 4, 32, 216, 4, 1, 2000, cpu) == "batched"  # 10M-row C3, level 2
  assert tt.level_product(217, 2, 32, 217, 2, 32, 1500, cpu) == "batched"  # its level 1
  assert tt.level_product(8, 4, 32, 10_000, 4, 64, 100_000, cpu) == "batched"  # > the float cap
  with pytest.raises(ValueError, match="available: auto, batched, pairs"):
    _member("tt(contract=fast)", _spec())


def test_cost_model_per_platform(tmp_path, monkeypatch):
  """contract=auto's constants are the platform's: tt_cost.json's entry for the device kind,
  else for the backend, else XLA:CPU's; a fixed (launch) cost moves the choice to the
  product with fewer kernels."""
  path = tmp_path / "tt_cost.json"
  gpu = {"batched_fixed_ns": 20_000.0, "batched_ns": 1.0, "batched_ns_per_mac": 0.001,
         "pairs_fixed_ns": 5_000.0, "pairs_ns_per_mac": 0.0001, "pairs_max_floats": 1 << 24,
         "source": "test"}  # fmt: skip
  path.write_text(json.dumps({"_doc": "x", "gpu": gpu, "gpu:H9": {**gpu, "pairs_fixed_ns": 1e9}}))
  # The cost model lives in tt.cost (recgnn/backends/tt/cost.py): patch it there.
  monkeypatch.setattr(tt.cost, "_COST_FILE", str(path))
  monkeypatch.setattr(
    tt.cost, "_read_cost_file", functools.partial(tt.cost._read_cost_file, str(path))
  )
  tt.cost_model.cache_clear()
  try:
    assert tt.cost_model() == tt.CPU_COSTS  # this CPU: not in the file
    assert tt.cost_model("tpu", "v5") == tt.CPU_COSTS
    g = tt.cost_model("gpu", "H100")
    assert g.platform == "gpu" and g.pairs_fixed_ns == 5_000.0
    assert tt.cost_model("gpu", "H9").platform == "gpu:H9"
    # The 10M-row C3's level 1: batched on the CPU, pairs (one GEMM) on this GPU model.
    level = (217, 2, 32, 217, 2, 32, 1500)
    assert tt.level_product(*level, tt.CPU_COSTS) == "batched"
    assert tt.level_product(*level, g) == "pairs"
    assert tt.level_product(*level, tt.cost_model("gpu", "H9")) == "batched"
  finally:
    tt.cost_model.cache_clear()


def test_fit_cost_model_recovers_constants():
  """Timings made by a known model (with 2% noise) give back its constants, and the fitted
  model makes the same choices as the true one."""
  true = tt.CostModel(batched_fixed_ns=8000.0, batched_ns=40.0, batched_ns_per_mac=0.002,
                      pairs_fixed_ns=6000.0, pairs_ns_per_mac=0.0005)  # fmt: skip
  rng = np.random.default_rng(0)
  levels = []
  for p_prev, a, r, d, r1, p in [(8, 2, 32, 2, 32, 16), *BENCH_LEVEL_SHAPES]:
    for s in (16, 46, 100, 217):
      w = a * r * d * r1
      b = true.batched_fixed_ns + p * (true.batched_ns + w * true.batched_ns_per_mac)
      q = true.pairs_fixed_ns + p_prev * s * w * true.pairs_ns_per_mac
      noise = 1 + 0.02 * rng.standard_normal(2)
      levels.append({"p_prev": p_prev, "a": a, "r": r, "d": d, "r1": r1, "p": p, "slices": s,
                     "batched_ms": b * noise[0] / 1e6, "pairs_ms": q * noise[1] / 1e6})  # fmt: skip
  fit = tt.fit_cost_model(levels, source="test", platform="gpu")
  assert fit.pairs_ns_per_mac == pytest.approx(true.pairs_ns_per_mac, rel=0.05)
  assert fit.batched_ns_per_mac == pytest.approx(true.batched_ns_per_mac, rel=0.15)
  assert fit.pairs_fixed_ns == pytest.approx(true.pairs_fixed_ns, rel=0.2)
  agree = sum(
    tt.level_product(x["p_prev"], x["a"], x["r"], x["slices"], x["d"], x["r1"], x["p"], fit)
    == tt.level_product(x["p_prev"], x["a"], x["r"], x["slices"], x["d"], x["r1"], x["p"], true)
    for x in levels
  )
  assert agree >= len(levels) - 1
  with pytest.raises(ValueError, match="need at least 3"):
    tt.fit_cost_model(levels[:2], source="x", platform="gpu")


# benchmarks/tt.py's LEVEL_SHAPES (p_prev, a, r, d, r1, p): the levels calibration times.
BENCH_LEVEL_SHAPES = [(46, 2, 32, 2, 32, 448), (448, 4, 32, 4, 1, 1280), (200, 2, 32, 2, 32, 1500),
                      (1500, 4, 32, 4, 1, 2000)]  # fmt: skip


def test_committed_cost_file_is_valid():
  """Every entry of the committed tt_cost.json builds a CostModel with every constant."""
  fields = {f.name for f in dataclasses.fields(tt.CostModel)}
  for key, entry in tt._read_cost_file().items():
    assert fields - {"platform", "pairs_max_floats"} <= entry.keys(), key
    model = tt.CostModel(**{k: v for k, v in entry.items() if k in fields}, platform=key)
    assert model.batched_ns_per_mac > 0 and model.pairs_ns_per_mac > 0 and model.source, key
  with pytest.raises(ValueError, match="needs kernel=prefix or unique"):
    _member("tt(kernel=naive, contract=pairs)", _spec())
  assert "contract=pairs" in _member("tt(contract=pairs)", _spec()).describe()


def test_prefix_kernel_shares_prefixes():
  """Rows of one (i_1, i_2) block share a prefix: the tree has fewer level-2 nodes than rows."""
  spec = _spec(num_rows=1000, dim=8)
  b = planner.make_backend("tt(rank=4, pad=full)", spec)
  ids = np.array([[0, 1, 2, 3, 10, 11, 999, -1]])  # n = (10, 10, 10): prefixes 00, 01, 99
  p = b.prepare({"t": ids})["t"]["rows"]
  assert (p["parent2"][:7] == [0, 0, 0, 0, 1, 1, 2]).all()
  assert (p["slice_of1"][:3] == [0, 1, 2]).all() and p["slice_of1"][3:].min() == p["slices1"].size
  assert p["inverse"][0, -1] == p["slice_of2"].size  # padding -> the zero row


# ----------------------------------------------------------------------------- cache


@pytest.mark.parametrize("kernel", ["prefix", "naive"])
@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: o.name)
def test_cache_lookups_equal_table_and_hot_set_is_lfu(kernel, opt):
  batches = _batches(n=7)
  spec = _spec(opt)
  text = f"tt(rank=4, kernel={kernel}, cache_rows=40, cache_warmup=3)"
  # Eval batches inside the warm-up (1) and right after it (3) neither count nor break it.
  trace = _drive(text, spec, batches, eval_at=(1, 3))  # (checks padding looks up as 0)
  ids, counts = np.unique(np.concatenate([b[b >= 0] for b in batches[:3]]), return_counts=True)
  want = np.sort(ids[np.lexsort((ids, -counts))[:40]])
  np.testing.assert_array_equal(np.asarray(trace.state["t"]["cache_ids"]), want)
  # Hot rows are served by the cache, not by the cores, once it is filled.
  recon = np.asarray(tt.reconstruct(trace.state["t"]["cores"], spec.num_rows))
  assert np.abs(trace.table[want] - recon[want]).max() > 1e-3


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: o.name)
def test_cached_rows_train_like_dense_rows(opt):
  """From the fill on, a hot row follows the dense backend's row-wise optimizer exactly,
  starting from the cores' reconstruction and fresh optimizer state."""
  spec = _spec(opt)
  batches = _batches(n=6)
  b = planner.make_backend("tt(rank=4, cache_rows=1000, cache_warmup=2)", spec)
  dense = planner.make_backend("dense", spec)
  hot = np.unique(np.concatenate([x[x >= 0] for x in batches[:2]]))  # every row seen is hot
  state, ref = b.init(jax.random.key(0)), None
  # (jitted, as the trainer runs them: op by op, each step compiled a program per op)
  lookup, update = jax.jit(b.lookup), jax.jit(b.update)
  dense_lookup, dense_update = jax.jit(dense.lookup), jax.jit(dense.update)
  for step, ids in enumerate(batches):
    prepared = b.prepare({"t": ids})
    pooled, residuals = lookup(state, prepared)
    g = {"t": contract.grads_for(step, pooled["t"])}
    if step == 1:  # the warm-up ends with batch 1: its update fills the cache first
      table = jnp.asarray(b.tables(state)["t"])
      ref = {"t": {"table": table, **opt.init_slots(spec.num_rows)}}
    state = update(state, prepared, residuals, g)
    if ref is not None:
      dp = dense.prepare({"t": ids})
      ref = dense_update(ref, dp, dense_lookup(ref, dp)[1], g)
      np.testing.assert_allclose(
        b.tables(state)["t"][hot], np.asarray(ref["t"]["table"])[hot], **TOL
      )
  np.testing.assert_array_equal(np.asarray(state["t"]["cache_ids"])[: hot.size], hot)


def test_restore_rebuilds_hot_set():
  spec = _spec(ADAGRAD)
  batches = _batches(n=6)
  text = "tt(rank=4, cache_rows=30, cache_warmup=2)"
  a = planner.make_backend(text, spec)
  state = a.init(jax.random.key(0))
  for step, ids in enumerate(batches[:4]):
    p = a.prepare({"t": ids})
    pooled, residuals = a.lookup(state, p)
    state = a.update(state, p, residuals, {"t": contract.grads_for(step, pooled["t"])})
  state = a.sync(state)
  b = planner.make_backend(text, spec)
  state_b = b.restore(jax.tree.map(jnp.array, state))
  for ids in batches[4:]:
    pa, pb = a.prepare({"t": ids}), b.prepare({"t": ids})
    assert (pb["t"]["rows"]["cache_slot"] < 30).any()  # the hot set is back
    np.testing.assert_array_equal(pa["t"]["rows"]["cache_slot"], pb["t"]["rows"]["cache_slot"])
    np.testing.assert_allclose(b.lookup(state_b, pb)[0]["t"], a.lookup(state, pa)[0]["t"], **TOL)


# ----------------------------------------------------------------------------- experiment


def test_ttrec_kaggle_plan_and_compression(capsys):
  import re

  from experiments import dlrm_kaggle, ttrec_kaggle

  config = ttrec_kaggle.get_config()
  printed = capsys.readouterr().out
  assert "Kaggle (real cardinalities)" in printed and "x smaller" in printed
  base_config = dlrm_kaggle.get_config()
  # Derived from dlrm_kaggle: only the plan differs.
  assert config.embeddings.plan != base_config.embeddings.plan
  config.embeddings.plan = base_config.embeddings.plan
  assert config.to_dict() == base_config.to_dict()
  plan = ttrec_kaggle.make_plan(ttrec_kaggle.parse_arg(None))
  cards = ttrec_kaggle.KAGGLE_CARDINALITIES
  rx = re.compile(plan[0][0])
  tt_tables = [f"C{i + 1}" for i in range(26) if rx.fullmatch(f"C{i + 1}")]
  assert sorted(tt_tables) == sorted(f"C{i + 1}" for i in np.argsort(cards)[-7:])
  rep = ttrec_kaggle.compression_report(cards, plan)
  assert rep["all_dense_params"] == sum(cards) * 16
  want_tt = sum(tt.tt_shape(cards[int(n[1:]) - 1], 16, rank=32).num_params for n in tt_tables)
  assert rep["tt_params"] == want_tt
  assert rep["ratio"] >= 100, f"default rank compresses only {rep['ratio']:.1f}x"
  ratios = [
    ttrec_kaggle.compression_report(cards, ttrec_kaggle.make_plan({"rank": r, "tables": 7}))[
      "ratio"
    ]
    for r in (8, 16, 32, 64)
  ]
  assert ratios == sorted(ratios, reverse=True)
  with pytest.raises(ValueError, match="tables"):
    ttrec_kaggle.parse_arg("tables=30")
  with pytest.raises(ValueError, match="available"):
    ttrec_kaggle.get_config("kernel=fastest")


# ----------------------------------------------------------------------------- capacities


def _shapes(prepared) -> dict:
  return {k: np.shape(v) for k, v in prepared.items()}


def test_capacity_grows_only_when_a_count_does_not_fit():
  """pad=grow keeps a capacity while the counts fit it (each new size recompiles the
  trainer's step); a batch with more distinct rows than it holds grows it."""
  spec = _spec(num_rows=100_000)
  b = _member("tt(rank=4, lookahead=0)", spec)
  rng = np.random.default_rng(0)

  def batch(distinct):  # int[100, 2]: `distinct` different ids, padding elsewhere
    ids = np.full(200, -1)
    ids[:distinct] = rng.choice(100_000, size=distinct, replace=False)
    return ids.reshape(100, 2)

  first = b.prepare(batch(100))
  cap = b.stats()["cap_rows@200"]
  assert cap == tt._round_up(100) == 128
  # 120 rows fit in 128 (HEADROOM x 120 does not: the old rule grew and recompiled).
  assert _shapes(b.prepare(batch(120))) == _shapes(first)
  assert b.stats()["cap_rows@200"] == cap
  grown = b.prepare(batch(150))
  assert b.stats()["cap_rows@200"] >= 150 and _shapes(grown) != _shapes(first)


def test_lookahead_sizes_capacities_from_upcoming_batches():
  """The first batch sizes the capacities from the upcoming ones too (the trainer passes
  them): a larger batch later in the window fits without a new shape."""
  spec = _spec(num_rows=100_000)
  rng = np.random.default_rng(1)
  big = rng.choice(100_000, size=(200, 1), replace=False)
  small = np.where(np.arange(200)[:, None] < 50, big, -1)
  for look, grows in ((0, True), (4, False)):
    b = _member(f"tt(rank=4, lookahead={look})", spec)
    first = b.prepare(small, [small, big])
    later = b.prepare(big, [])
    assert (_shapes(first) != _shapes(later)) == grows, look
  b = _member("tt(rank=4)", spec)
  assert b.lookahead == 16 and planner.make_backend("tt(rank=4)", spec).lookahead == 16


@pytest.mark.parametrize("kernel", ["prefix", "unique"])
def test_prefix_tree_equals_np_unique_reference(kernel):
  """The vectorized tree (sorted keys deduped by neighbours, slices by a mark array) equals
  np.unique's: the distinct prefixes per level, their slices and each one's slice."""
  b = _member(f"tt(rank=4, kernel={kernel}, lookahead=0)", _spec(num_rows=5000))
  rng = np.random.default_rng(3)
  for size in (0, 1, 37, 900):
    rows = np.unique(rng.integers(0, 5000, size))
    b._prep.batch_size = 1000
    _, levels = b._prep.tree(rows, 1000)
    for k, (keys, slices, slice_idx, _, _) in enumerate(levels):
      want = rows // b.shape.strides[k]
      if kernel == "prefix" and k < b.shape.num_cores - 1:
        want = np.unique(want)
      np.testing.assert_array_equal(keys, want)
      s, idx = np.unique(want % b.shape.row_factors[k], return_inverse=True)
      np.testing.assert_array_equal(slices, s)
      np.testing.assert_array_equal(slice_idx, idx)
