"""TT device kernels: one level of the prefix tree's products, and the grow-only capacity
rounding that keeps the step's shapes static per bucket."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from recgnn.backends.tt.cost import level_product


def level(pre, slices, parent_of, slice_of, how: str = "auto") -> jax.Array:
  """One level of the prefix tree: prefix p's product pre[parent_of[p]] @ slices[slice_of[p]].

  pre float32[P_{k-1}, a, r], slices float32[S_k, r, d, r1] (the distinct slices of core k),
  parent_of / slice_of int32[P_k] (slice_of = S_k for padding: its product is 0).
  how: batched | pairs | auto (`level_product` picks). Returns float32[P_k, a, d, r1].
  """
  p_prev, a, r = pre.shape
  n_s, _, d, r1 = slices.shape
  if how == "auto":
    how = level_product(p_prev, a, r, n_s, d, r1, parent_of.shape[0])
  if how == "pairs":
    # [P_{k-1} a, r] @ [r, S_k d r1]: every (parent, slice) pair in one GEMM, then the P_k
    # pairs used. A padded prefix's slice index is S_k (out of range): it gets 0.
    lhs = pre.reshape(p_prev * a, r)
    rhs = jnp.transpose(slices, (1, 0, 2, 3)).reshape(r, n_s * d * r1)
    table = (lhs @ rhs).reshape(p_prev, a, n_s, d, r1)
    return table.at[parent_of, :, slice_of].get(mode="fill", fill_value=0.0)
  s = slices.at[slice_of].get(mode="fill", fill_value=0.0)
  # One batched matmul: [P, a, r] @ [P, r, d * r1].
  out = jnp.matmul(pre[parent_of], s.reshape(s.shape[0], r, -1))
  return out.reshape(out.shape[0], a, d, r1)


HEADROOM = 1.25  # capacity / count when a capacity grows: batch-to-batch noise stays inside


def _round_up(n: int) -> int:
  """HEADROOM * n rounded up to one of 4 sizes per octave (2^k * {1, 1.25, 1.5, 1.75}), min 8.

  Coarse on purpose: every new size recompiles the train step, so a capacity should grow a
  few times in a run, not whenever a batch has a few more distinct rows than the last.
  """
  n = max(8, math.ceil(HEADROOM * n))
  step = 1 << max(0, n.bit_length() - 3)
  return -(-n // step) * step
