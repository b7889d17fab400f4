"""DLRM-DCNv2 (Wang et al., 2021; TorchRec's `DLRM_DCN`, the MLPerf Training DLRM-DCNv2).

  x0 = concat(bottom_mlp(dense), e_1, ..., e_T)            float32[B, N], N = D_b + T * D
  x_{l+1} = x0 * (W_l x_l + b_l) + x_l                     l = 0 .. L - 1 (the cross network)
  logit = top_mlp(x_L)                                      the last top layer linear

Cross layers are full rank (W_l float32[N, N]) or low rank (W_l = U_l V_l^T with U_l, V_l
float32[N, r], computed as (x V) U^T so the N x N matrix never exists). The tables' order in
x0 is the model's `tables` (the task's order). As TorchRec's
`LowRankCrossNet` / `CrossNet`: kernels Xavier-normal (N(0, 2 / (fan_in + fan_out))), biases
zero, no bias inside the V projection. The MLPs are this package's DLRM MLP (the DLRM reference
initialization). The MLPerf configuration: bottom 512-256-128, 3 low-rank layers of rank 512,
top 1024-1024-512-256-1, embedding dim 128. Takes activations, never ids or a backend.

The CTR model "dcn" of `recgnn.models.registry` (model.bottom, model.top, model.cross_layers,
model.low_rank, model.dtype).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from recgnn.models.dlrm import MLP, compute_dtype, compute_inputs, dlrm_kernel_init

# Xavier normal, as torch.nn.init.xavier_normal_ (what TorchRec's cross nets use): the DLRM
# reference's dense-layer draw is the same N(0, sqrt(2 / (fan_in + fan_out))).
xavier_normal = dlrm_kernel_init


class CrossNet(nn.Module):
  """DCN-v2 cross layers: float32[B, N] -> float32[B, N].

  Attributes:
    num_layers: cross layers L.
    low_rank: r > 0: W_l = U_l V_l^T (params "V_l" [N, r], "U_l" [r, N]); 0: full rank
      ("W_l" [N, N]).
  """

  num_layers: int = 3
  low_rank: int = 0
  dtype: Any = jnp.float32  # the computation's; params float32

  @nn.compact
  def __call__(self, x0: jax.Array) -> jax.Array:
    n = x0.shape[-1]
    x = x0
    c = self.dtype
    for layer in range(self.num_layers):
      if self.low_rank:
        v = self.param(f"V_{layer}", xavier_normal, (n, self.low_rank)).astype(c)
        u = self.param(f"U_{layer}", xavier_normal, (self.low_rank, n)).astype(c)
        xw = (x @ v) @ u
      else:
        xw = x @ self.param(f"W_{layer}", xavier_normal, (n, n)).astype(c)
      b = self.param(f"b_{layer}", nn.initializers.zeros_init(), (n,)).astype(c)
      x = x0 * (xw + b) + x
    return x


class DCN(nn.Module):
  """dense float32[B, Dd], embeddings {table: float32[B, D_t]} -> logits float32[B].

  Unlike the dot interaction, the widths need not match: the cross network runs on the
  concatenation (TorchRec requires equal widths only because it stacks them). tables: their
  order in the concatenation (empty: sorted names).
  """

  bottom: Sequence[int] = (512, 256, 128)
  top: Sequence[int] = (1024, 1024, 512, 256, 1)
  cross_layers: int = 3
  low_rank: int = 512
  tables: Sequence[str] = ()
  dtype: Any = jnp.float32  # the computation's (dlrm.DLRM's dtype)

  @nn.compact
  def __call__(self, dense: jax.Array, embeddings: Mapping[str, jax.Array]) -> jax.Array:
    dense, embeddings = compute_inputs(self.dtype, dense, embeddings, self.tables)
    x = MLP(self.bottom, relu_last=True, name="bottom", dtype=self.dtype)(dense)
    x0 = jnp.concatenate([x, *embeddings], axis=1)
    z = CrossNet(self.cross_layers, self.low_rank, name="cross", dtype=self.dtype)(x0)
    out = MLP(self.top, relu_last=False, name="top", dtype=self.dtype)(z)[:, 0]
    return out.astype(jnp.float32)


def from_config(model, tables: Sequence[str]) -> DCN:
  """config.model (bottom, top, cross_layers, low_rank: 0 = full rank, dtype) and the task's
  tables -> DCN (the registry's entry)."""
  return DCN(
    bottom=tuple(model.bottom),
    top=tuple(model.top),
    cross_layers=int(model.get("cross_layers", 3)),
    low_rank=int(model.get("low_rank", 512)),
    tables=tuple(tables),
    dtype=compute_dtype(model.get("dtype", "float32")),
  )


CTR_MODEL = from_config
