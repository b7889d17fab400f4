"""DCN-v2: the cross network against a numpy reference, low rank against full rank, and the
whole model's layer order."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from recgnn.models.dcn import DCN, CrossNet


def numpy_cross(x0, weights, biases):
  """x_{l+1} = x0 * (W_l x_l + b_l) + x_l, in float64 (row vectors: x W)."""
  x = x0
  for w, b in zip(weights, biases):
    x = x0 * (x @ w + b) + x
  return x


def test_low_rank_cross_matches_reference_and_full_rank():
  x0 = np.random.default_rng(0).normal(size=(5, 12)).astype(np.float32)
  low = CrossNet(num_layers=3, low_rank=4)
  p = low.init(jax.random.key(0), x0)["params"]
  assert p["V_0"].shape == (12, 4) and p["U_0"].shape == (4, 12) and p["b_0"].shape == (12,)
  assert not np.any(np.asarray(p["b_0"]))  # zero bias, as TorchRec
  p = {k: v + 0.1 if k.startswith("b_") else v for k, v in p.items()}  # nonzero biases
  got = low.apply({"params": p}, x0)
  ws = [np.asarray(p[f"V_{i}"], np.float64) @ np.asarray(p[f"U_{i}"], np.float64) for i in range(3)]
  bs = [np.asarray(p[f"b_{i}"], np.float64) for i in range(3)]
  np.testing.assert_allclose(got, numpy_cross(x0.astype(np.float64), ws, bs), rtol=1e-4, atol=1e-5)
  full = CrossNet(num_layers=3, low_rank=0)
  fp = {**{f"W_{i}": jnp.asarray(ws[i], jnp.float32) for i in range(3)},
        **{f"b_{i}": p[f"b_{i}"] for i in range(3)}}  # fmt: skip
  np.testing.assert_allclose(full.apply({"params": fp}, x0), got, rtol=1e-4, atol=1e-5)


def test_xavier_normal_init_scale():
  x0 = jnp.zeros((1, 300))
  p = CrossNet(num_layers=1, low_rank=100).init(jax.random.key(1), x0)["params"]
  assert np.std(np.asarray(p["V_0"])) == pytest.approx(np.sqrt(2 / 400), rel=0.05)


def test_dcn_model_order():
  """bottom MLP -> concat with the embeddings (in the model's table order, whatever the
  dict's) -> cross -> top MLP, one logit per example."""
  rng = np.random.default_rng(2)
  dense = rng.normal(size=(6, 13)).astype(np.float32)
  embs = [rng.normal(size=(6, 8)).astype(np.float32) for _ in range(4)]
  names = ("t2", "t10", "t1", "t3")  # the model's order, not the names' sorted one
  by_name = dict(zip(names, embs))
  model = DCN(bottom=(16, 8), top=(32, 1), cross_layers=2, low_rank=5, tables=names)
  v = model.init(jax.random.key(0), dense, by_name)
  out = model.apply(v, dense, dict(sorted(by_name.items())))
  assert out.shape == (6,)
  p = v["params"]
  assert p["cross"]["V_0"].shape == (8 + 4 * 8, 5)

  def relu_mlp(x, layers, last_relu):
    for i, layer in enumerate(layers):
      x = x @ np.asarray(layer["kernel"]) + np.asarray(layer["bias"])
      if last_relu or i < len(layers) - 1:
        x = np.maximum(x, 0)
    return x

  bottom = [p["bottom"][f"Dense_{i}"] for i in range(2)]
  top = [p["top"][f"Dense_{i}"] for i in range(2)]
  x0 = np.concatenate([relu_mlp(dense, bottom, True), *embs], axis=1)
  ws = [np.asarray(p["cross"][f"V_{i}"]) @ np.asarray(p["cross"][f"U_{i}"]) for i in range(2)]
  bs = [np.asarray(p["cross"][f"b_{i}"]) for i in range(2)]
  ref = relu_mlp(numpy_cross(x0, ws, bs), top, False)[:, 0]
  np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)


def test_cross_net_matches_torchrec_low_rank_cross_net():
  """The same weights through TorchRec's LowRankCrossNet (where the peers are installed)."""
  torch = pytest.importorskip("torch")
  crossnet = pytest.importorskip("torchrec.modules.crossnet")
  torch.manual_seed(0)
  ref = crossnet.LowRankCrossNet(in_features=24, num_layers=3, low_rank=6)
  with torch.no_grad():
    for b in ref.bias:
      b.normal_()  # nonzero biases: the test sees where they enter
  x0 = np.random.default_rng(3).normal(size=(7, 24)).astype(np.float32)
  # TorchRec: x_l V^T with V_kernels[l] [r, N], then W_kernels[l] [N, r]: ours V = V^T, U = W^T.
  params = {}
  for i in range(3):
    params[f"V_{i}"] = jnp.asarray(ref.V_kernels[i].detach().numpy().T)
    params[f"U_{i}"] = jnp.asarray(ref.W_kernels[i].detach().numpy().T)
    params[f"b_{i}"] = jnp.asarray(ref.bias[i].detach().numpy())
  got = CrossNet(num_layers=3, low_rank=6).apply({"params": params}, x0)
  want = ref(torch.from_numpy(x0)).detach().numpy()
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
