"""DLRM (Naumov et al., 2019): bottom MLP over dense features, dot interaction with the
pooled embeddings, top MLP to one logit. Takes activations, never ids or a backend."""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np


def _dlrm_kernel_init(key, shape, dtype=jnp.float32):
  # The reference (dlrm_s_pytorch.py) draws W ~ N(0, sqrt(2 / (fan_in + fan_out))).
  fan_in, fan_out = shape
  return jax.random.normal(key, shape, dtype) * np.sqrt(2.0 / (fan_in + fan_out))


def _dlrm_bias_init(fan_in: int):
  def init(key, shape, dtype=jnp.float32):
    return jax.random.normal(key, shape, dtype) * np.sqrt(1.0 / fan_in)

  return init


class MLP(nn.Module):
  """Dense layers with ReLU; `relu_last=False` leaves the last layer linear (logits)."""

  features: Sequence[int]
  relu_last: bool = True

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    for i, f in enumerate(self.features):
      x = nn.Dense(f, kernel_init=_dlrm_kernel_init, bias_init=_dlrm_bias_init(f))(x)
      if i < len(self.features) - 1 or self.relu_last:
        x = nn.relu(x)
    return x


def dot_interaction(features: jax.Array) -> jax.Array:
  """Pairwise dot products without self-interaction.

  features: float32[B, F, D] -> float32[B, F * (F - 1) / 2], the strictly lower triangle of
  features @ features^T in the reference's order (i > j, row-major).
  """
  f = features.shape[1]
  z = jnp.einsum("bfd,bgd->bfg", features, features)
  i, j = np.tril_indices(f, k=-1)
  return z[:, i, j]


class DLRM(nn.Module):
  """dense float32[B, 13], embeddings [float32[B, D]] * T -> logits float32[B].

  The bottom MLP's last width must equal the embedding dim D (the dot interaction needs it).
  """

  bottom: Sequence[int] = (512, 256, 64, 16)
  top: Sequence[int] = (512, 256, 1)

  @nn.compact
  def __call__(self, dense: jax.Array, embeddings: Sequence[jax.Array]) -> jax.Array:
    x = MLP(self.bottom, relu_last=True, name="bottom")(dense)
    if embeddings and embeddings[0].shape[-1] != x.shape[-1]:
      raise ValueError(
        f"DLRM: bottom MLP ends at {x.shape[-1]} but embeddings have dim "
        f"{embeddings[0].shape[-1]}; set the last bottom width to the embedding dim"
      )
    feats = jnp.stack([x, *embeddings], axis=1)
    z = jnp.concatenate([x, dot_interaction(feats)], axis=1)
    return MLP(self.top, relu_last=False, name="top")(z)[:, 0]
