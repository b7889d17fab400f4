"""DLRM (Naumov et al., 2019): bottom MLP over dense features, dot interaction with the
pooled embeddings, top MLP to one logit. Takes activations, never ids or a backend.

The CTR model "dlrm" of `recgnn.models.registry` (model.bottom, model.top, model.dtype), and
the pieces the other CTR models share: `MLP`, `compute_dtype`, `compute_inputs`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np


def dlrm_kernel_init(key, shape, dtype=jnp.float32):
  # The reference (dlrm_s_pytorch.py) draws W ~ N(0, sqrt(2 / (fan_in + fan_out))).
  fan_in, fan_out = shape
  return jax.random.normal(key, shape, dtype) * np.sqrt(2.0 / (fan_in + fan_out))


def _dlrm_bias_init(fan_in: int):
  def init(key, shape, dtype=jnp.float32):
    return jax.random.normal(key, shape, dtype) * np.sqrt(1.0 / fan_in)

  return init


class MLP(nn.Module):
  """Dense layers with ReLU; `relu_last=False` leaves the last layer linear (logits).
  dtype: the computation's (params stay float32: `param_dtype`)."""

  features: Sequence[int]
  relu_last: bool = True
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    for i, f in enumerate(self.features):
      x = nn.Dense(f, kernel_init=dlrm_kernel_init, bias_init=_dlrm_bias_init(f), dtype=self.dtype)(
        x
      )
      if i < len(self.features) - 1 or self.relu_last:
        x = nn.relu(x)
    return x


DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def compute_dtype(name: str) -> Any:
  """config.model.dtype -> the computation dtype of a model (params stay float32)."""
  if name not in DTYPES:
    raise ValueError(f"Unknown model.dtype {name!r}; available: {', '.join(DTYPES)}")
  return DTYPES[name]


def in_order(embeddings: Mapping[str, jax.Array], tables: Sequence[str]) -> list[jax.Array]:
  """The pooled embeddings {table: f32[B, D_t]} as a list in `tables`' order (empty: the
  names sorted). The keys must be exactly those tables: a missing or unexpected one raises."""
  order = tuple(tables) or tuple(sorted(embeddings))
  if set(order) != set(embeddings) or len(order) != len(embeddings):
    raise ValueError(
      f"the model's tables are {list(order)}, but it was given embeddings for {sorted(embeddings)}"
    )
  return [embeddings[t] for t in order]


def compute_inputs(
  dtype, dense: jax.Array, embeddings: Mapping[str, jax.Array], tables: Sequence[str] = ()
) -> tuple[jax.Array, list[jax.Array]]:
  """The model's inputs in its table order (`in_order`), cast to its computation dtype
  (d loss / d embeddings comes back in float32 through the cast: the embedding backends'
  updates stay float32)."""
  embeddings = in_order(embeddings, tables)
  if dtype == jnp.float32:
    return dense, embeddings
  return dense.astype(dtype), [e.astype(dtype) for e in embeddings]


def bottom_mlp(model: str, bottom, dtype, dense: jax.Array, embeddings: list) -> jax.Array:
  """Inside a compact `__call__`: the bottom MLP ("bottom") of dense f[B, Dd] -> f[B, D],
  refusing embeddings of another dim D (the interaction pairs the bottom's output with
  every table's row)."""
  x = MLP(bottom, relu_last=True, name="bottom", dtype=dtype)(dense)
  if embeddings and embeddings[0].shape[-1] != x.shape[-1]:
    raise ValueError(
      f"{model}: bottom MLP ends at {x.shape[-1]} but embeddings have dim "
      f"{embeddings[0].shape[-1]}; set the last bottom width to the embedding dim"
    )
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
  """dense float32[B, 13], embeddings {table: float32[B, D]} -> logits float32[B].

  The bottom MLP's last width must equal the embedding dim D (the dot interaction needs it).
  tables: the order the embeddings enter the interaction (empty: sorted names).
  dtype: the computation's (`compute_dtype`): the MLPs and the interaction run in it, the
  params, the embeddings' state and the logits stay float32.
  """

  bottom: Sequence[int] = (512, 256, 64, 16)
  top: Sequence[int] = (512, 256, 1)
  tables: Sequence[str] = ()
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, dense: jax.Array, embeddings: Mapping[str, jax.Array]) -> jax.Array:
    dense, embeddings = compute_inputs(self.dtype, dense, embeddings, self.tables)
    x = bottom_mlp("DLRM", self.bottom, self.dtype, dense, embeddings)
    feats = jnp.stack([x, *embeddings], axis=1)
    z = jnp.concatenate([x, dot_interaction(feats)], axis=1)
    return MLP(self.top, relu_last=False, name="top", dtype=self.dtype)(z)[:, 0].astype(jnp.float32)


def from_config(model, tables: Sequence[str]) -> DLRM:
  """config.model (bottom, top, dtype) and the task's tables -> DLRM (the registry's entry)."""
  dtype = compute_dtype(model.get("dtype", "float32"))
  return DLRM(bottom=tuple(model.bottom), top=tuple(model.top), tables=tuple(tables), dtype=dtype)


CTR_MODEL = from_config
