"""DeepFM (Guo et al., IJCAI 2017): a factorization machine and a deep MLP over the same
embeddings, their logits summed. Takes activations, never ids or a backend.

  v_0 = bottom_mlp(dense), v_t = e_t (t = 1 .. T)      the fields, float32[B, F, D], F = T + 1
  first  = w . concat(dense, e_1, ..., e_T) + b        float32[B]: first order
  second = 1/2 sum_d [(sum_f v_f)^2 - sum_f v_f^2]     float32[B]: sum_{f < g} <v_f, v_g>
  deep   = top_mlp(concat(v_0, ..., v_T))              float32[B]: the last top layer linear
  logit  = first + second + deep

Criteo's dense features are values, not ids: the bottom MLP (DLRM's) maps them to one more
field of the embeddings' width D, as DLRM does. The first-order term of a categorical field is
a scalar per id: the paper's own 1-wide table, here w_t . e_t(id) (the backends look up the
D-wide tables only). The second-order term is computed in float32 whatever the dtype: its
difference of two large sums cancels.

The CTR model "deepfm" of `recgnn.models.registry` (model.bottom, model.top, model.dtype).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from recgnn.models.dlrm import MLP, bottom_mlp, compute_dtype, compute_inputs, dlrm_kernel_init


def fm_second_order(fields: jax.Array) -> jax.Array:
  """float32[B, F, D] -> float32[B]: the sum over pairs f < g of <v_f, v_g>, in O(F D)."""
  v = fields.astype(jnp.float32)
  s = jnp.sum(v, axis=1)
  return 0.5 * jnp.sum(s * s - jnp.sum(v * v, axis=1), axis=1)


class DeepFM(nn.Module):
  """dense float32[B, Dd], embeddings {table: float32[B, D]} -> logits float32[B].

  The bottom MLP's last width must equal the embedding dim D (the factorization machine pairs
  every two fields). top: the deep MLP, ending in width 1. tables: the order the embeddings
  are concatenated in (empty: sorted names). dtype: the computation's (`compute_dtype`);
  params and logits float32.
  """

  bottom: Sequence[int] = (512, 256, 64, 16)
  top: Sequence[int] = (512, 256, 1)
  tables: Sequence[str] = ()
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, dense: jax.Array, embeddings: Mapping[str, jax.Array]) -> jax.Array:
    dense, embs = compute_inputs(self.dtype, dense, embeddings, self.tables)
    x = bottom_mlp("DeepFM", self.bottom, self.dtype, dense, embs)
    first = nn.Dense(1, kernel_init=dlrm_kernel_init, name="first_order", dtype=self.dtype)
    fields = jnp.stack([x, *embs], axis=1)
    deep = MLP(self.top, relu_last=False, name="top", dtype=self.dtype)
    logit = (
      first(jnp.concatenate([dense, *embs], axis=1))[:, 0].astype(jnp.float32)
      + fm_second_order(fields)
      + deep(fields.reshape(fields.shape[0], -1))[:, 0].astype(jnp.float32)
    )
    return logit


def from_config(model, tables: Sequence[str]) -> DeepFM:
  """config.model (bottom, top: the deep MLP, dtype) and the task's tables -> DeepFM (the
  registry's entry)."""
  dtype = compute_dtype(model.get("dtype", "float32"))
  return DeepFM(bottom=tuple(model.bottom), top=tuple(model.top), tables=tuple(tables), dtype=dtype)


CTR_MODEL = from_config
