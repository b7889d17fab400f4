"""R-GCN encoder with basis decomposition (Schlichtkrull et al., ESWC 2018).

  h_i' = act( W_0 h_i + sum_r sum_{j in N_r(i)} (1 / c_{i,r}) W_r h_j ),   W_r = sum_b a_rb V_b

Activations in (entity rows f32[n, D], from the embedding plan), encoded rows out; the graph
is given as edge arrays over those n rows. Each basis is one weighted scatter of the gathered
source rows: M_b = sum_r a_rb A_r, so the layer is sum_b (M_b H) V_b, with H[src] gathered once
(memory O(E * D), never O(E * bases * D)).

Graph leaves (all int32[E] / f32[E], padded edges have norm 0):
  src, dst: row indices of each edge's source and destination
  rel:      relation id (reciprocal relations are ordinary relations here)
  norm:     1 / c_{dst, rel}, the in-degree of dst under rel in the WHOLE graph. Computed on
            the host so that a partition's subgraph, which holds every in-edge of the rows it
            encodes exactly, gives those rows the same encoding as the whole graph.
Edge dropout keeps the norms and rescales kept edges by 1 / (1 - rate) (unbiased).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp


class RGCNLayer(nn.Module):
  num_relations: int
  dim: int
  num_bases: int

  @nn.compact
  def __call__(self, h, graph, edge_weight):
    d_in = h.shape[-1]
    bases = self.param("bases", nn.initializers.glorot_uniform(), (self.num_bases, d_in, self.dim))
    coeff = self.param(
      "coeff",
      nn.initializers.normal(1.0 / self.num_bases**0.5),
      (self.num_relations, self.num_bases),
    )
    out = nn.Dense(self.dim, use_bias=True, name="self")(h)
    gathered = jnp.take(h, graph["src"], axis=0)  # [E, D]
    a = jnp.take(coeff, graph["rel"], axis=0) * edge_weight[:, None]  # [E, bases]
    n = h.shape[0]
    for b in range(self.num_bases):
      agg = jax.ops.segment_sum(gathered * a[:, b : b + 1], graph["dst"], num_segments=n)
      out = out + agg @ bases[b]
    return out


class RGCN(nn.Module):
  """`num_layers` R-GCN layers; ReLU between layers, a residual from the input rows."""

  num_relations: int
  dim: int
  num_bases: int = 4
  num_layers: int = 1
  dropout: float = 0.0
  edge_dropout: float = 0.0

  @nn.compact
  def __call__(self, x, graph, train: bool):
    weight = graph["norm"]
    if train and self.edge_dropout > 0:
      keep = jax.random.bernoulli(self.make_rng("dropout"), 1 - self.edge_dropout, weight.shape)
      weight = jnp.where(keep, weight / (1 - self.edge_dropout), 0.0)
    h = x
    for i in range(self.num_layers):
      h = nn.Dropout(self.dropout, deterministic=not train)(h)
      h = RGCNLayer(self.num_relations, self.dim, self.num_bases, name=f"layer{i}")(
        h, graph, weight
      )
      if i < self.num_layers - 1:
        h = nn.relu(h)
    return x + h if x.shape[-1] == self.dim else h
