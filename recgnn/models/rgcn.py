"""R-GCN encoder with basis decomposition (Schlichtkrull et al., ESWC 2018).

  h_i' = act( W_0 h_i + sum_r sum_{j in N_r(i)} (1 / c_{i,r}) W_r h_j ),   W_r = sum_b a_rb V_b

Activations in (entity rows f32[n, D], from the embedding plan), encoded rows out; the graph
is given as edge arrays over those n rows. With M_b = sum_r a_rb A_r the layer is
sum_b (M_b H) V_b. The edges are processed in chunks inside a scan, so the [E, D] gathered
rows are never materialised (XLA:CPU gathers into a large fresh buffer slowly): each chunk's
source rows are scattered, weighted by a_rb / c, into one aggregate per basis.

Graph leaves (all int32[E] / f32[E], padded edges have norm 0):
  src, dst: row indices of each edge's source and destination
  rel:      relation id (reciprocal relations are ordinary relations here)
  norm:     1 / c, an in-degree of dst (all relations, or under rel) in the WHOLE graph,
            computed on the host so that a partition's subgraph, which holds every in-edge
            of the rows it encodes exactly, gives those rows their whole-graph encoding.
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
  chunk: int = 8192

  @nn.compact
  def __call__(self, h, graph, edge_weight):
    h = jnp.asarray(h)
    n, d_in = h.shape
    nb = self.num_bases
    bases = self.param("bases", nn.initializers.glorot_uniform(), (nb, d_in, self.dim))
    coeff = self.param("coeff", nn.initializers.normal(1.0 / nb**0.5), (self.num_relations, nb))
    out = nn.Dense(self.dim, use_bias=True, name="self")(h)
    e = graph["src"].shape[0]
    c = min(self.chunk, max(e, 1))
    pad = -e % c

    def split(x):  # [E, ...] -> [E / c, c, ...]; padded edges have weight 0
      x = jnp.pad(x, ((0, pad),) + ((0, 0),) * (x.ndim - 1))
      return x.reshape(-1, c, *x.shape[1:])

    # Per chunk: one gather of source rows, one scatter-add per basis, in place in the scan's
    # carry: faster than all edges at once (gather [E, D], then segment_sum per basis),
    # transform-first with [c, bases * D] rows, or a batched einsum mixing bases per edge
    # (docs/kg.md).
    a = coeff.at[graph["rel"]].get(mode="promise_in_bounds") * edge_weight[:, None]  # [E, nb]

    # Rematerialised in the backward pass: saving each chunk's rows would store [E, D] again.
    @jax.checkpoint
    def body(accs, chunk):
      src, dst, a = chunk
      rows = h.at[src].get(mode="promise_in_bounds")  # [c, D]
      new = tuple(
        acc.at[dst].add(rows * a[:, b : b + 1], mode="promise_in_bounds")
        for b, acc in enumerate(accs)
      )
      return new, None

    zeros = tuple(jnp.zeros((n, d_in), h.dtype) for _ in range(nb))
    accs, _ = jax.lax.scan(body, zeros, (split(graph["src"]), split(graph["dst"]), split(a)))
    for b, acc in enumerate(accs):
      out = out + acc @ bases[b]
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
