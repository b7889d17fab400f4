"""tt's device code (jit-able): the rows of a batch from the cores (the prefix tree's level
products, or the naive per-id chain), the cache's rows over them, and the sparse update of
the core slices (and cache rows) the batch touched.

One concern: what runs inside the step. `DeviceStep` is an object the `TT` front holds
(recgnn/backends/tt/backend.py): pure functions of the state and the prepared batch over the
frozen `TTShape` and options, no host bookkeeping.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from recgnn.backends.tt.kernels import level
from recgnn.backends.tt.options import TTOptions
from recgnn.backends.tt.shape import TTShape
from recgnn.embeddings import base


class DeviceStep:
  """lookup (unpooled, or pooled with the prefix tree's pullback as residuals), update,
  core_grads (tests). cache_rows: the cache's rows (0: none)."""

  def __init__(self, spec: base.TableSpec, shape: TTShape, o: TTOptions, cache_rows: int):
    self._spec, self._shape, self._o, self._cache_rows = spec, shape, o, cache_rows

  def _tree_rows(self, slices: Sequence[jax.Array], prepared) -> jax.Array:
    """Distinct rows float32[U, D] from the gathered slices of each core (prefix tree)."""
    pre = None
    for k in range(self._shape.num_cores):
      if k == 0:
        s = slices[0].at[prepared["slice_of0"]].get(mode="fill", fill_value=0.0)
        pre = s[:, 0]  # [P_0, d_1, r_1]
        continue
      out = level(
        pre, slices[k], prepared[f"parent{k}"], prepared[f"slice_of{k}"], self._o.contract
      )
      p, a, d, r1 = out.shape
      pre = out.reshape(p, a * d, r1)
    return pre.reshape(pre.shape[0], self._spec.dim)

  def _gather_slices(self, state, prepared) -> list[jax.Array]:
    return [
      g.at[prepared[f"slices{k}"]].get(mode="fill", fill_value=0.0)
      for k, g in enumerate(state["cores"])
    ]

  def naive_rows(self, cores: Sequence[jax.Array], ids: jax.Array) -> jax.Array:
    """Rows float32[..., D] of ids (N = padding -> 0), one slice per core per id."""
    shape, spec = self._shape, self._spec
    flat = ids.reshape(-1)
    pre = None
    for k, g in enumerate(cores):
      digit = (flat // shape.strides[k]) % shape.row_factors[k]
      s = g[digit]  # [M, r, d, s]
      if k == 0:
        pre = s[:, 0]
        continue
      m, a, r = pre.shape
      pre = jnp.matmul(pre, s.reshape(m, r, -1)).reshape(m, a * s.shape[2], s.shape[3])
    rows = pre.reshape(flat.shape[0], spec.dim)
    rows = jnp.where((flat < spec.num_rows)[:, None], rows, 0.0)
    return rows.reshape(ids.shape + (spec.dim,))

  def _tt_rows_from(self, slices, prepared):
    rows = self._tree_rows(slices, prepared)
    return rows.at[prepared["inverse"]].get(mode="fill", fill_value=0.0)

  def _cache_filled(self, state, prepared) -> jax.Array:
    return jnp.all(state["cache_ids"] == prepared["cache_ids"])

  def lookup(self, state, prepared):
    """-> f32[B, L, D]: the cores' rows (0 at padding), the cache's where the batch hits it."""
    if self._o.kernel == "naive":
      rows = self.naive_rows(state["cores"], prepared["ids"])
    else:
      rows = self._tt_rows_from(self._gather_slices(state, prepared), prepared)
    return self._overlay_cache(state, prepared, rows)

  def lookup_tree(self, state, prepared):
    """Prefix kernels: -> (f32[B, L, D] as `lookup`, residuals: the gathered core slices and
    the pullback of the prefix tree's products, `jax.vjp`'s linearization)."""
    slices = self._gather_slices(state, prepared)
    rows, pull = jax.vjp(lambda s: self._tree_rows(s, prepared), slices)
    out = rows.at[prepared["inverse"]].get(mode="fill", fill_value=0.0)
    return self._overlay_cache(state, prepared, out), {"slices": slices, "pull": pull}

  def _overlay_cache(self, state, prepared, out):
    """The cores' rows `out` f32[B, L, D] with the cache's rows where the batch hits it."""
    if not self._cache_rows:
      return out
    slot = prepared["cache_slot"]
    hit = slot < self._cache_rows
    # Until an update has filled the cache for this hot set (the first batch after the
    # warm-up, or a batch looked up but never updated, e.g. eval), hot rows come from the
    # cores, which is what the fill will copy: the logical table stays continuous.
    cached = jax.lax.cond(
      self._cache_filled(state, prepared),
      lambda: state["cache"].at[slot].get(mode="fill", fill_value=0.0),
      lambda: self.naive_rows(
        state["cores"],
        jnp.where(
          hit,
          jnp.asarray(prepared["cache_ids"]).at[slot].get(mode="fill", fill_value=0),
          self._spec.num_rows,
        ),
      ),
    )
    return jnp.where(hit[..., None], cached, out)

  def core_grads(self, state, prepared, grads) -> list[jax.Array]:
    """d loss / d cores (dense, core-shaped) given grads float32[B, L, D] of the lookup.

    Only the cores' part: cache hits contribute nothing. For tests; `update` stays sparse.
    """
    if self._o.kernel == "naive":
      _, vjp = jax.vjp(lambda c: self.naive_rows(c, prepared["ids"]), list(state["cores"]))
      return vjp(grads)[0]
    slices = self._gather_slices(state, prepared)
    _, vjp = jax.vjp(lambda s: self._tt_rows_from(s, prepared), slices)
    g = vjp(grads)[0]
    return [
      jnp.zeros_like(c).at[prepared[f"slices{k}"]].add(g[k], mode="drop")
      for k, c in enumerate(state["cores"])
    ]

  def update(self, state, prepared, grads, residuals=None):
    """grads f32[B, L, D]. residuals: `lookup_tree`'s (prefix kernels), else the forward
    pass is run again here for its pullback."""
    spec, opt = self._spec, self._spec.optimizer
    state = dict(state)
    if self._cache_rows:
      # Fill before anything trains: the rows this batch looked up were the cores' rows.
      state = jax.lax.cond(
        self._cache_filled(state, prepared),
        lambda s: s,
        lambda s: self._fill(s, prepared),
        state,
      )
      slots = {k: state[f"cache_{k}"] for k in opt.slot_names()}
      cprep = {"ids": prepared["cache_slot"]}
      if opt.needs_unique:
        cprep["unique"], cprep["inverse"] = prepared["cache_unique"], prepared["cache_inverse"]
      hit = (prepared["cache_slot"] < self._cache_rows)[..., None]
      cache, slots = base.sparse_sgd_or_adagrad(
        spec, state["cache"], slots, cprep, jnp.where(hit, grads, 0.0)
      )
      state["cache"] = cache
      state.update({f"cache_{k}": v for k, v in slots.items()})
      grads = jnp.where(hit, 0.0, grads)
    if self._o.kernel == "naive":
      g = self.core_grads(state, prepared, grads)
      cores, accum = [], []
      for k, c in enumerate(state["cores"]):
        flat = c.reshape(c.shape[0], -1)
        acc = {"accum": state["accum"][k]} if opt.needs_unique else {}
        new, acc = opt.apply(flat, acc, g[k].reshape(flat.shape))
        cores.append(new.reshape(c.shape))
        accum.extend(acc.values())
    else:
      if residuals:
        slices = residuals["slices"]
        # The transpose of the lookup's gather of distinct rows: sum the grads per row.
        u = prepared[f"slice_of{self._shape.num_cores - 1}"].shape[0]
        g_rows = jnp.zeros((u, spec.dim), grads.dtype)
        g = residuals["pull"](g_rows.at[prepared["inverse"]].add(grads, mode="drop"))[0]
      else:
        slices = self._gather_slices(state, prepared)
        _, vjp = jax.vjp(lambda s: self._tt_rows_from(s, prepared), slices)
        g = vjp(grads)[0]  # summed per distinct slice: the gather's transpose adds repeats
      cores, accum = [], []
      for k, c in enumerate(state["cores"]):
        idx = prepared[f"slices{k}"]
        flat, gk = slices[k].reshape(idx.shape[0], -1), g[k].reshape(idx.shape[0], -1)
        acc = {}
        if opt.needs_unique:
          acc = {"accum": state["accum"][k].at[idx].get(mode="fill", fill_value=0.0)}
        new, acc = opt.apply(flat, acc, gk)
        cores.append(c.at[idx].set(new.reshape(slices[k].shape), mode="drop"))
        if opt.needs_unique:
          accum.append(state["accum"][k].at[idx].set(acc["accum"], mode="drop"))
    state["cores"] = cores
    if opt.needs_unique:
      state["accum"] = accum
    return state

  def _fill(self, state, prepared):
    ids = prepared["cache_ids"]
    state = dict(state)
    state["cache"] = self.naive_rows(state["cores"], ids)
    state["cache_ids"] = ids
    for k, v in self._spec.optimizer.init_slots(self._cache_rows).items():
      state[f"cache_{k}"] = v
    return state
