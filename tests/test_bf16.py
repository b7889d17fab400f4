"""model.dtype=bfloat16 (issue 43): bf16 compute with float32 params, optimizer state and
embedding tables, for DLRM, DCNv2, DeepFM and GraphSAGE; it trains, and its loss stays near
float32's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from recgnn.models import dcn, deepfm, dlrm, graphsage
from recgnn.train import loop
from tests.test_graphsage import small_config as sage_config
from tests.trainer_lib import smoke_config


def _ctr_model(kind, dtype):
  if kind == "dot":
    return dlrm.DLRM(bottom=(32, 8), top=(32, 1), dtype=dtype)
  if kind == "deepfm":
    return deepfm.DeepFM(bottom=(32, 8), top=(32, 1), dtype=dtype)
  return dcn.DCN(bottom=(32, 8), top=(32, 1), cross_layers=2, low_rank=4, dtype=dtype)


@pytest.mark.parametrize("kind", ["dot", "dcn", "deepfm"])
def test_bf16_model_keeps_float32_params_grads_and_logits(kind):
  rng = np.random.default_rng(0)
  dense = jnp.asarray(rng.normal(size=(64, 13)), jnp.float32)
  emb = {f"t{i}": jnp.asarray(rng.normal(size=(64, 8)), jnp.float32) for i in range(3)}
  f32, bf16 = _ctr_model(kind, jnp.float32), _ctr_model(kind, jnp.bfloat16)
  # (every computation jitted whole: op by op, each layer's ops compiled a program apiece)
  params = jax.jit(f32.init)(jax.random.key(0), dense, emb)
  # The same params (float32) serve both: the dtype is the computation's only.
  bf16_params = jax.eval_shape(bf16.init, jax.random.key(0), dense, emb)
  assert jax.tree.structure(bf16_params) == jax.tree.structure(params)
  assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}

  def loss(model, params, emb):
    return jnp.mean(model.apply(params, dense, emb) ** 2)

  out = jax.jit(bf16.apply)(params, dense, emb)
  assert out.dtype == jnp.float32 and out.shape == (64,)
  grad = jax.jit(jax.grad(lambda p, e: loss(bf16, p, e), argnums=(0, 1)))
  g_params, g_emb = grad(params, emb)
  assert {x.dtype for x in jax.tree.leaves((g_params, g_emb))} == {jnp.dtype(jnp.float32)}
  # bf16 has 8 bits of mantissa: logits within a few % of the float32 ones.
  ref = np.asarray(jax.jit(f32.apply)(params, dense, emb))
  np.testing.assert_allclose(out, ref, rtol=0.05, atol=0.05 * float(np.std(ref)))
  # ... and its compiled program computes its matmuls in bf16 (not a float32 no-op).
  hlo = jax.jit(lambda p: bf16.apply(p, dense, emb)).lower(params).as_text()
  assert "bf16" in hlo


def test_graphsage_bf16_keeps_float32_params_and_logits():
  model = graphsage.GraphSAGE(sizes=(4, 8), hidden=16, num_classes=3, dtype=jnp.bfloat16)
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(8, 5)), jnp.float32)
  layer = {"nbr": jnp.asarray(rng.integers(0, 8, (4, 3)), jnp.int32),
           "mask": jnp.ones((4, 3), bool)}  # fmt: skip
  params = model.init(jax.random.key(0), x, [layer], train=False)
  assert {v.dtype for v in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
  out = model.apply(params, x, [layer], train=False)
  assert out.dtype == jnp.float32 and out.shape == (4, 3)


def test_unknown_dtype_names_the_valid_ones():
  with pytest.raises(ValueError, match="bfloat16"):
    dlrm.compute_dtype("float16")


def _final_losses(res_dir):
  import json
  import os

  with open(os.path.join(res_dir, "metrics.jsonl")) as f:
    rows = [json.loads(x) for x in f]
  return [r["loss"] for r in rows if "loss" in r]


@pytest.mark.parametrize("interaction", ["dot", "dcn"])
def test_ctr_trains_in_bf16_with_losses_near_float32(ctr_cache, tmp_path, interaction):
  """The trainer's smoke run (DLRM / DCNv2) with bf16 compute: float32 tables and params in
  the state; every logged loss within 2% of the float32 run's, and both learn."""
  losses, states = {}, {}
  for dtype in ("float32", "bfloat16"):
    # (4 tables: a fraction of the 26 tables' build; no eval: losses only)
    c = smoke_config(ctr_cache, tables=4, steps=40, log_every=10, final_eval_splits=())
    c.model.dtype = dtype
    c.model.interaction = interaction
    if interaction == "dcn":
      c.model.cross_layers, c.model.low_rank = 2, 4
    res = loop.train(c, str(tmp_path / dtype))
    losses[dtype] = _final_losses(str(tmp_path / dtype))
    states[dtype] = res.state
  leaves = jax.tree.leaves((states["bfloat16"].params, states["bfloat16"].emb))
  assert {x.dtype for x in leaves} == {jnp.dtype(jnp.float32)}
  f32, bf16 = np.array(losses["float32"]), np.array(losses["bfloat16"])
  assert f32[-1] < f32[0] and bf16[-1] < bf16[0], (f32, bf16)
  np.testing.assert_allclose(bf16, f32, rtol=0.02)


def test_graphsage_trains_in_bf16(tmp_path):
  c = sage_config("features", 60)
  c.model.dtype = "bfloat16"
  res = loop.train(c, str(tmp_path)).metrics
  assert res["test/accuracy"] > res["chance_accuracy"] + 0.3, res
