"""`DeviceStep`: offload's jitted step for a group, per stack of tables (dim, optimizer) on its
ONE cache array: the lookup (one gather per bag length), the sparse update, the exchanges and
the write-back (see the package docstring, "One cache per stack")."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from recgnn import sharding
from recgnn.backends.offload.cache_plan import EVICT_SLOTS, LOAD_ROWS, LOAD_SLOTS, NEXT_FROM_NOW
from recgnn.embeddings import base, host_cache


def _take(x: jax.Array, idx: jax.Array) -> jax.Array:
  """x[idx], zeros where idx is out of range (padding, ABSENT)."""
  return x.at[idx].get(mode="fill", fill_value=0.0)


def _put(x: jax.Array, idx: jax.Array, values: jax.Array) -> jax.Array:
  """x[idx] = values, out-of-range idx (padding, ABSENT) dropped."""
  return x.at[idx].set(values, mode="drop")


def _rows_mask(mask: jax.Array, v: jax.Array) -> jax.Array:
  """bool[W] -> bool[W, 1, ...], broadcastable against v [W, ...]."""
  return mask.reshape(mask.shape + (1,) * (v.ndim - 1))


def bag_tables(key: str) -> list[int]:
  """A bag's tables (indices in the stack) from its key (`stacked_batch.stack`)."""
  return [int(i) for i in key.split(",")]


class DeviceStep:
  """The step of one offload group: stacks (names per stack), specs {name: TableSpec}, mesh."""

  def __init__(self, stacks, specs: dict, mesh):
    self._stacks, self.specs, self.mesh = stacks, specs, mesh

  # -- the step: per stack, one host read per exchange, one gather, one sparse update, one
  # set of exchange kernels and one write-back for all of its tables

  def lookup(self, state, prepared):
    """-> (pooled {table: f32[B, D]}, residuals: per stack {"now" / "next": {k: f32[W,
    ...]}}, the rows this step reads from the host: the on-demand rows of this batch, also
    looked up here, and the next batch's (prefetched). Both read the host arrays as they
    came into the step (ONE host computation per exchange for every table of the stack),
    so they depend on nothing the step computes; `update` places them in the caches. Each
    read is materialized (an optimization barrier): no consumer may re-read the host arrays
    later through a fused gather, after the write-back (XLA would then copy the whole table
    to keep the old values; XLA:CPU fuses host gathers into their consumers). The rows of
    a stack's tables of one bag length come from its cache in one gather (int32[B, T, L]
    slots -> f32[B, T, L, D], pooled over L): not a gather per table."""
    pooled, residuals = {}, []
    for stack, names in enumerate(self._stacks):
      lists = prepared["lists"][stack]
      ring = state["ring"][stack]
      res = {}
      for kind in ("next", "now"):
        if lists[kind].shape[1]:
          got = lists[f"{kind}_rows"]
          if ring["table"].shape[0]:  # rows whose write-back may not have reached the host
            src = lists[f"{kind}_src"]
            held = src < ring["table"].shape[0]
            got = {
              k: jnp.where(_rows_mask(held, v), _take(ring[k], src), v) for k, v in got.items()
            }
          res[kind] = got
      residuals.append(res)
      cache = state["cache"][stack]["table"]
      for key, bag in prepared["batch"][stack]["bags"].items():
        rows = _take(cache, bag["ids"])
        if (
          "now" in res
        ):  # rows loaded on demand: from the host read (the cache gets them in update)
          fresh, pos = res["now"]["table"], bag["now_pos"]
          rows = jnp.where((pos < fresh.shape[0])[..., None], _take(fresh, pos), rows)
        summed = jnp.sum(rows, axis=2)
        for j, i in enumerate(bag_tables(key)):
          n = names[i]
          count = bag["count"][:, j] if self.specs[n].pooling == "mean" else None
          pooled[n] = base.pool_rows(summed[:, j, None], count)
    return pooled, tuple(residuals)

  def reset_rows(self, state, resets):
    """resets {table: {"slots": int32[R] slots of its stack's cache (out of range: none),
    "rows": f32[R, D]}} (`OffloadGroup.place_resets`) -> the state with those slots set to
    the rows and their optimizer slots to the initial value: one scatter per array of each
    stack holding a reset table. O(R * D)."""
    caches = list(state["cache"])
    for stack, names in enumerate(self._stacks):
      mine = [n for n in names if n in resets]
      if not mine:
        continue
      at = jnp.concatenate([resets[n]["slots"] for n in mine])
      rows = jnp.concatenate([resets[n]["rows"] for n in mine])
      init = self.specs[names[0]].optimizer.initial_accumulator
      caches[stack] = {
        k: _put(v, at, rows) if k == "table" else v.at[at].set(init, mode="drop")
        for k, v in caches[stack].items()
      }
    return {**state, "cache": tuple(caches)}

  def _optimizer_inputs(self, prepared, stack: int, grads):
    """A stack's batch for ONE sparse update of its cache (`base.sparse_sgd_or_adagrad`):
    ({"ids": int32[n] and, for row-wise optimizers, "unique": int32[U], "inverse":
    int32[n]}, grads f32[n, D]) over every table (n = the sum of B x L), gathered on every
    device (an all-gather per leaf of the stack, not per table). Per row, its positions
    keep their order within its table's batch: the same sums as `dense`'s, bit for bit.
    Third: the update's `mean_square` (row-wise Adagrad), or None."""
    names = self._stacks[stack]
    batch = prepared["batch"][stack]
    ids, inverse, g, blocks = [], [], [], []
    for key, bag in sorted(batch["bags"].items()):  # (`_batch`'s order of "unique")
      tabs = [names[i] for i in bag_tables(key)]
      blocks += [bag["ids"].shape[0] * bag["ids"].shape[2]] * len(tabs)
      x = {k: v for k, v in bag.items() if k in ("ids", "inverse", "count")}
      x["g"] = jnp.stack([grads[n] for n in tabs], axis=1)  # [B, T', D]
      x = sharding.replicate(x, self.mesh)
      gb = x["g"]
      if "count" in x:  # mean pooling; a sum-pooled table divides by 1 (exact)
        mean = np.array([self.specs[n].pooling == "mean" for n in tabs])
        count = jnp.where(mean, jnp.maximum(x["count"], 1), 1).astype(gb.dtype)
        gb = gb / count[..., None]
      bag_len = x["ids"].shape[2]
      g.append(jnp.broadcast_to(gb[:, :, None], gb.shape[:2] + (bag_len,) + gb.shape[2:]))
      ids.append(x["ids"].reshape(-1))
      if "inverse" in x:
        inverse.append(x["inverse"].reshape(-1))
    cat = lambda xs: xs[0] if len(xs) == 1 else jnp.concatenate(xs)  # noqa: E731
    out = {"ids": cat(ids)}
    mean_square = None
    if inverse:
      out["unique"], out["inverse"] = batch["unique"], cat(inverse)
      # Each row's mean squared gradient reduced per table, on its table's block of the
      # stack's distinct rows (int32[B * L] each): XLA:CPU picks a reduction's summation
      # order by the array's size ([256, 8] and [512, 8] can differ in the last bit),
      # so one reduce over the stack's rows is not `dense`'s, whose arrays are per table.
      # One small kernel per table, only for row-wise optimizers.
      ends = np.cumsum(blocks).tolist()

      def mean_square(grads):
        return cat([jnp.mean(x * x, axis=-1) for x in jnp.split(grads, ends[:-1])])

    d = g[0].shape[-1]
    return out, cat([x.reshape(-1, d) for x in g]), mean_square

  def update(self, state, prepared, residuals, grads):
    """Per stack, on its ONE cache array: the "now" exchange (victims read, on-demand rows
    placed), the sparse update of every table's batch, the "next" exchange (victims read
    from the updated cache, prefetched rows placed; a row "now" evicted and the next batch
    needs back takes the evicted value, NEXT_FROM_NOW: its host copy is stale until the
    write-back), then ONE write-back (D2H, a scatter on the host) of both exchanges'
    victims, read off the cache in list order. Each exchange is one gather and one scatter per array
    for every table (slots of the stack's cache, `stacked_batch.segments`). Reads of the cache come
    before writes to it through optimization barriers (in place on the donated cache). Write after
    read on the donated host arrays: the write-back's values pass through an optimization barrier
    with this step's host reads (the residuals), a dependency on reads only, never on compute; the
    caches take the rows the reads materialized (read once, never again)."""
    if base.TO_HOST in state:
      raise ValueError(
        "offload: the state still holds the previous step's rows for the host: hand them to "
        "after_update(state) after each update"
      )
    out = {**state, **host_cache.advance(state, prepared)}
    new_cache, new_slots, new_ring, to_host = [], [], [], []
    for stack, names in enumerate(self._stacks):
      lists = prepared["lists"][stack]
      now, nxt = lists["now"], lists["next"]
      res = residuals[stack]
      cache, slot_rows = dict(state["cache"][stack]), state["slot_rows"][stack]
      victims = {}
      for kind, lst in (("now", now), ("next", nxt)):
        if kind == "next":  # after the optimizer on this batch's rows
          batch, g, mean_square = self._optimizer_inputs(prepared, stack, grads)
          slots = {k: v for k, v in cache.items() if k != "table"}
          spec = self.specs[names[0]]
          table, slots = base.sparse_sgd_or_adagrad(
            spec, cache["table"], slots, batch, g, mean_square
          )
          cache = {"table": table, **slots}
        if not lst.shape[1]:
          continue
        loaded = res[kind]
        if kind == "next" and "now" in victims:  # rows "now" evicted that the next batch needs
          pos = lst[NEXT_FROM_NOW]
          again = pos < now.shape[1]
          loaded = {
            k: jnp.where(_rows_mask(again, v), _take(victims["now"][k], pos), v)
            for k, v in loaded.items()
          }
        evicted = {k: _take(v, lst[EVICT_SLOTS]) for k, v in cache.items()}
        evicted, cache = jax.lax.optimization_barrier((evicted, cache))  # read, then overwrite
        cache = {k: _put(v, lst[LOAD_SLOTS], loaded[k]) for k, v in cache.items()}
        slot_rows = slot_rows.at[lst[LOAD_SLOTS]].set(lst[LOAD_ROWS], mode="drop")
        victims[kind] = evicted
      # The write-backs: into the ring of recent ones (a later step may load a row before
      # its write-back reaches the host: `host_tier.Recent`), and out of the step for the
      # host writer (TO_HOST, list order). The ring is written after this step's reads of
      # it (the residuals) and sized by the first train batch (`HostSide.stage`).
      ring = state["ring"][stack]
      width = lists["ring"].shape[1]
      if ring["table"].shape[0] != width:
        ring = {k: jnp.zeros((width,) + v.shape[1:], v.dtype) for k, v in ring.items()}
      else:
        _, ring = jax.lax.optimization_barrier((res, ring))
      for kind in ("now", "next"):
        if kind in victims:
          dst = lists[f"{kind}_dst"]
          ring = {k: _put(v, dst, victims[kind][k]) for k, v in ring.items()}
      new_cache.append(cache)
      new_slots.append(slot_rows)
      new_ring.append(ring)
      to_host.append(victims)
    return {
      **out,
      "cache": tuple(new_cache),
      "slot_rows": tuple(new_slots),
      "ring": tuple(new_ring),
      base.TO_HOST: tuple(to_host),
    }
