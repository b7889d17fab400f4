"""`int8`: a backend in one file outside the package, loaded by the trainer with
`--config.embeddings.modules=tests/int8_backend.py` and named in a plan (`plan=int8`).

Each table is int8 codes with a float32 scale per row, replicated: 1 byte per value instead of
4 (plus 4 per row, and the optimizer's slots). The lookup dequantizes the rows it gathers; the
update gathers the batch's distinct rows, dequantizes them, applies the table's optimizer
(SGD or row-wise Adagrad, `OptimizerSpec.apply` on `segment_rows`' sums, as
tests/toy_backend.py does) and requantizes each row once per step before scattering it back.

It implements only the per-table core (`init`, `state_sharding`, `lookup`, `update`,
`memory`, `table`) and `from_rows`: `TableBackend`'s default "rows" checkpoint exports the
dequantized rows (dense's logical form), and `from_rows` quantizes them back. A row's scale is
a power of two (`quantize`), so dequantized rows quantize back to the same codes and scale:
a checkpoint resumes exactly. It offers itself to `auto(...)` (`auto_candidates`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from recgnn.embeddings import base

LEVELS = 127  # codes in [-127, 127]


def quantize(rows: jax.Array) -> tuple[jax.Array, jax.Array]:
  """rows f32[U, D] -> (codes int8[U, D], scale f32[U]). scale = 2^(e - 7), e the exponent of
  the row's largest |value| m (m in [2^(e-1), 2^e)), so m / scale is in [64, 128): every
  value within scale / 2 of its code's (the largest clipped to 127 within 1 scale). A
  dequantized row quantizes back to the same codes and scale."""
  _, e = jnp.frexp(jnp.max(jnp.abs(rows), axis=-1))
  scale = jnp.ldexp(jnp.ones(e.shape, jnp.float32), e - 7)
  codes = jnp.clip(jnp.round(rows / scale[:, None]), -LEVELS, LEVELS).astype(jnp.int8)
  return codes, scale


def dequantize(codes: jax.Array, scale: jax.Array) -> jax.Array:
  """codes int8[..., D], scale f32[...] -> f32[..., D] (exact: a power of two times an int)."""
  return codes.astype(jnp.float32) * scale[..., None]


@base.register_backend("int8")
class Int8(base.TableBackend):
  """One replicated table. State: {"codes": int8[N, D], "scale": f32[N], "accum": f32[N]
  (row-wise Adagrad only)}."""

  @property
  def dedup_on_host(self) -> bool:
    return not self.process_local  # (each row requantized once: the batch's distinct rows)

  @classmethod
  def auto_candidates(cls, spec, context):
    return ["int8"]

  def init(self, key):
    return self.from_rows(base.init_table(key, self.spec), self._fresh_slots())

  def _fresh_slots(self) -> dict[str, np.ndarray]:
    opt = self.spec.optimizer
    return {s: np.full(self.spec.num_rows, opt.initial_accumulator, np.float32)
            for s in opt.slot_names()}  # fmt: skip

  def state_sharding(self):
    keys = ("codes", "scale", *self.spec.optimizer.slot_names())
    return {k: self.replicated() for k in keys}

  def from_rows(self, rows, slots):
    codes, scale = jax.jit(quantize)(jnp.asarray(rows, jnp.float32))
    return jax.device_put({"codes": codes, "scale": scale, **slots}, self.state_sharding())

  def lookup(self, state, prepared):
    """ids int32[B, L] -> f32[B, L, D]; padding (id N) reads zeros."""
    ids = prepared["ids"]
    codes = state["codes"].at[ids].get(mode="fill", fill_value=0)
    return dequantize(codes, state["scale"].at[ids].get(mode="fill", fill_value=0.0))

  def update(self, state, prepared, grads):
    """grads f32[B, L, D] -> the new state: each distinct row of the batch gathered,
    dequantized, stepped and requantized once."""
    opt = self.spec.optimizer
    if "unique" in prepared:
      unique, inverse = prepared["unique"], prepared["inverse"]
    else:  # (process-local input: the batch's ids were gathered on every device)
      unique, inverse = base.device_dedup(prepared["ids"], self.spec.num_rows)
    g = base.segment_rows(grads, inverse, unique.shape[0])  # f32[U, D]

    def take(x, fill):
      return x.at[unique].get(mode="fill", fill_value=fill)

    rows = dequantize(take(state["codes"], 0), take(state["scale"], 0.0))
    rows, slots = opt.apply(rows, {k: take(state[k], 0.0) for k in opt.slot_names()}, g)
    codes, scale = quantize(rows)
    new = {"codes": codes, "scale": scale, **slots}
    return {k: state[k].at[unique].set(v, mode="drop") for k, v in new.items()}

  def memory(self):
    slots = len(self.spec.optimizer.slot_names())
    per_row = self.spec.dim + 4 + 4 * slots
    return base.MemoryReport(self.spec.num_rows * per_row, 0, "device (replicated, int8 rows)")

  def table(self, state):
    return np.asarray(jax.device_get(dequantize(state["codes"], state["scale"])))


__all__ = ["Int8", "dequantize", "quantize"]
