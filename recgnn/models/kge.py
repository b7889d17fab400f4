"""Knowledge-graph embedding decoders: DistMult, ComplEx, RotatE, TransE.

Entity activations in, never entity ids: the task looks entity rows up through the embedding
plan (or encodes them with a GNN, `recgnn.models.rgcn`) and hands them here. Relation
embeddings are the decoder's own (small) Flax params, indexed by relation id.

Shapes: entity width D. ComplEx / RotatE read an entity row as D/2 complex numbers
(real halves first). Relation widths: DistMult, ComplEx, TransE D; RotatE D/2 phases.

  score(h f32[..., D], r f32[..., Dr], t f32[..., D]) -> f32[...]       one score per triple
  score_all(q f32[B, D], r f32[B, Dr], cands f32[N, D], side) -> f32[B, N]
      side "tail": score (q, r, c) for every candidate c; side "head": (c, r, q).

Bilinear decoders (DistMult, ComplEx) score all candidates with one matmul; the distance
decoders (RotatE, TransE) broadcast over candidates in chunks of `chunk` to bound memory.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

DECODERS = ("distmult", "complex", "rotate", "transe")
BILINEAR = ("distmult", "complex")


def check_decoder(name: str, dim: int) -> None:
  if name not in DECODERS:
    raise ValueError(f"Unknown decoder {name!r}; available: {', '.join(DECODERS)}")
  if name in ("complex", "rotate") and dim % 2:
    raise ValueError(f"{name} reads entity rows as complex numbers: dim must be even, got {dim}")


def relation_dim(name: str, dim: int) -> int:
  return dim // 2 if name == "rotate" else dim


def _halves(x):
  k = x.shape[-1] // 2
  return x[..., :k], x[..., k:]


def _rotation(r):
  return jnp.cos(r), jnp.sin(r)


def score(name: str, h, r, t, gamma: float = 0.0, p: int = 1):
  """Triple scores (higher = more plausible), broadcasting over leading dims."""
  if name == "distmult":
    return jnp.sum(h * r * t, -1)
  if name == "complex":
    hr, hi = _halves(h)
    rr, ri = _halves(r)
    tr, ti = _halves(t)
    return jnp.sum(hr * (rr * tr + ri * ti) + hi * (rr * ti - ri * tr), -1)
  if name == "rotate":
    hr, hi = _halves(h)
    cr, ci = _rotation(r)
    tr, ti = _halves(t)
    dr, di = hr * cr - hi * ci - tr, hr * ci + hi * cr - ti
    return gamma - jnp.sum(jnp.sqrt(dr * dr + di * di + 1e-9), -1)
  if name == "transe":
    d = h + r - t
    n = jnp.sum(jnp.abs(d), -1) if p == 1 else jnp.sqrt(jnp.sum(d * d, -1) + 1e-9)
    return gamma - n
  raise ValueError(f"Unknown decoder {name!r}; available: {', '.join(DECODERS)}")


def query_vector(name: str, q, r, side: str):
  """Bilinear decoders: the vector v with score = v . candidate (tail or head side)."""
  if name == "distmult":
    return q * r
  qr, qi = _halves(q)
  rr, ri = _halves(r)
  if side == "tail":  # Re(<h, r, conj(t)>) with h = q: coefficients of (t_re, t_im)
    return jnp.concatenate([qr * rr - qi * ri, qr * ri + qi * rr], -1)
  # head side, t = q: coefficients of (h_re, h_im)
  return jnp.concatenate([rr * qr + ri * qi, rr * qi - ri * qr], -1)


def score_all(name: str, q, r, cands, side: str = "tail", gamma=0.0, p=1, chunk=1024):
  """Scores of every candidate for B queries: f32[B, N]."""
  if side not in ("tail", "head"):
    raise ValueError(f"side must be 'tail' or 'head', got {side!r}")
  if name in BILINEAR:
    return query_vector(name, q, r, side) @ cands.T
  n = cands.shape[0]
  pad = -n % chunk
  c = jnp.pad(cands, ((0, pad), (0, 0))).reshape(-1, chunk, cands.shape[-1])

  def one(block):
    if side == "tail":
      return score(name, q[:, None], r[:, None], block[None], gamma, p)
    if name == "rotate":  # |h o r - t| = |h - t o conj(r)| since |r| = 1
      return score(name, block[None], r[:, None], q[:, None], gamma, p)
    return score(name, block[None], r[:, None], q[:, None], gamma, p)

  out = jax.lax.map(one, c)  # [chunks, B, chunk]
  return jnp.moveaxis(out, 0, 1).reshape(q.shape[0], -1)[:, :n]


def n3(*xs, complex_pairs: bool):
  """Nuclear 3-norm regularizer (Lacroix et al. 2018): sum |x|^3, complex moduli if asked."""
  total = 0.0
  for x in xs:
    if complex_pairs:
      a, b = _halves(x)
      total = total + jnp.sum(jnp.sqrt(a * a + b * b + 1e-12) ** 3)
    else:
      total = total + jnp.sum(jnp.abs(x) ** 3)
  return total


class Relations(nn.Module):
  """The relation embeddings of a decoder: ordinary Flax params, f32[num_relations, Dr]."""

  num_relations: int
  dim: int
  decoder: str
  init_scale: float = 1e-3

  @nn.compact
  def __call__(self, rel):
    if self.decoder == "rotate":  # phases, uniform on the circle
      init = nn.initializers.uniform(2 * jnp.pi)
      table = self.param("phase", init, (self.num_relations, self.dim))
      return jnp.take(table, rel, axis=0) - jnp.pi
    init = nn.initializers.normal(self.init_scale)
    if self.decoder in BILINEAR:
      # Bilinear scores vanish with an all-small relation: start from the identity-like 1.
      ones = jnp.ones((self.dim,), jnp.float32)
      if self.decoder == "complex":
        ones = ones.at[self.dim // 2 :].set(0.0)
      table = self.param("embedding", init, (self.num_relations, self.dim))
      return jnp.take(table, rel, axis=0) + ones
    table = self.param("embedding", nn.initializers.normal(0.1), (self.num_relations, self.dim))
    return jnp.take(table, rel, axis=0)
