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


def _aggregate_chunked(h: jax.Array, src: jax.Array, dst: jax.Array, chunk: int) -> jax.Array:
  """sum over edges e of h[src[e]] into row dst[e], `chunk` edges at a time (a scan: the
  gather holds chunk x D values, not E x D). src, dst: int32[E], E a multiple of chunk;
  padding edges have dst = n (dropped) -> float32[n, D]."""
  n = h.shape[0]
  pieces = (src.reshape(-1, chunk), dst.reshape(-1, chunk))

  def add(acc, piece):
    s, d = piece
    return acc + jax.ops.segment_sum(jnp.take(h, s, axis=0), d, num_segments=n), None

  total, _ = jax.lax.scan(add, jnp.zeros(h.shape, h.dtype), pieces)
  return total


def full_graph_scores(
  params, x: jax.Array, graph: dict[str, jax.Array], src: jax.Array, dst: jax.Array, *,
  decoder: str, chunk: int,
) -> jax.Array:  # fmt: skip
  """`LinkSAGE`'s scores from every node's full neighbourhood, layer by layer over all nodes
  (not sampled): the same params and function as the sampled model with every neighbour.

  Args:
    params: LinkSAGE's params ({"encoder": GraphSAGE's, "mlp<i>": ...}).
    x: float32[N, F] every node's inputs.
    graph: {"msg_src", "msg_dst": int32[E] the message edges (dst aggregates from src; E a
      multiple of chunk, padding dst = N), "inv_deg": float32[N] 1 / max(in-degree, 1)}.
    src, dst: int32[P] node ids of the scored pairs.
  Returns:
    float32[P] logits.
  """
  enc = params["encoder"]
  num_layers = sum(1 for k in enc if k.startswith("lin_r"))
  h = x
  for i in range(num_layers):
    wl, wr = enc[f"lin_l{i}"]["kernel"], enc[f"lin_r{i}"]
    # Project before the mean when it narrows the rows (as GraphSAGE; the mean is linear).
    if h.shape[-1] > wl.shape[-1]:
      agg = _aggregate_chunked(h @ wl, graph["msg_src"], graph["msg_dst"], chunk)
    else:
      agg = _aggregate_chunked(h, graph["msg_src"], graph["msg_dst"], chunk) @ wl
    h = agg * graph["inv_deg"][:, None] + h @ wr["kernel"] + wr["bias"]
    if i < num_layers - 1:
      h = jax.nn.relu(h)
  hu, hv = jnp.take(h, src, axis=0), jnp.take(h, dst, axis=0)
  if decoder == "dot":
    return jnp.sum(hu * hv, axis=-1)
  z = hu * hv
  mlp = sorted((k for k in params if k.startswith("mlp")), key=lambda k: int(k[3:]))
  for j, name in enumerate(mlp):
    z = z @ params[name]["kernel"] + params[name]["bias"]
    if j < len(mlp) - 1:
      z = jax.nn.relu(z)
  return z[:, 0]
