"""GraphSAGE link prediction: the GraphSAGE encoder over a batch's sampled blocks, then a
decoder that scores node pairs.

Decoders:
  dot  s(u, v) = <h_u, h_v>                                  (PyG examples/link_pred.py)
  mlp  s(u, v) = MLP(h_u * h_v), ReLU and dropout between     (OGB's ddi / collab examples)

The encoder is `graphsage.GraphSAGE` with `num_classes` = the output width: its last layer
has no ReLU, as PyG's and OGB's link encoders.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from recgnn.models import graphsage

DECODERS = ("dot", "mlp")


class LinkSAGE(nn.Module):
  """Encoder + pair decoder.

  Attributes:
    sizes: the sampler's padded frontier sizes (n_0, ..., n_L) (static).
    hidden: width of the encoder's hidden layers; out: its output width.
    decoder: one of DECODERS; mlp_layers: the MLP's layers (the last outputs 1).
    dropout: rate in the encoder (each layer's input) and between the MLP's layers.
  """

  sizes: Sequence[int]
  hidden: int
  out: int
  decoder: str = "dot"
  mlp_layers: int = 3
  dropout: float = 0.5
  dtype: Any = jnp.float32

  def setup(self):
    if self.decoder not in DECODERS:
      raise ValueError(f"Unknown model.decoder {self.decoder!r}; available: {', '.join(DECODERS)}")
    self.encoder = graphsage.GraphSAGE(
      sizes=self.sizes, hidden=self.hidden, num_classes=self.out, dropout=self.dropout,
      dtype=self.dtype,
    )  # fmt: skip
    if self.decoder == "mlp":
      widths = [self.hidden] * (self.mlp_layers - 1) + [1]
      self.mlp = [nn.Dense(w, name=f"mlp{i}", dtype=self.dtype) for i, w in enumerate(widths)]
      self.drop = nn.Dropout(self.dropout)

  def __call__(
    self,
    x: jax.Array,
    layers: Sequence[dict[str, jax.Array]],
    src: jax.Array,
    dst: jax.Array,
    *,
    train: bool,
  ) -> jax.Array:
    """x: float32[n_L, F] inputs of the deepest frontier; layers: the sampled blocks;
    src, dst: int32[P] pair endpoints as positions in frontier 0 -> float32[P] scores
    (logits)."""
    h = self.encoder(x, layers, train=train)
    hu, hv = jnp.take(h, src, axis=0), jnp.take(h, dst, axis=0)
    if self.decoder == "dot":
      return jnp.sum(hu * hv, axis=-1).astype(jnp.float32)
    z = (hu * hv).astype(self.dtype)
    for i, dense in enumerate(self.mlp):
      z = dense(z)
      if i < len(self.mlp) - 1:
        z = self.drop(nn.relu(z), deterministic=not train)
    return z[:, 0].astype(jnp.float32)
