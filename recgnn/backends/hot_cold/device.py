"""hot_cold's device code (jit-able): the hot rows' lookup and update over the mesh, the cold
rows (read by prepare, moved with the batch) updated and returned for the host writer, the
device ring of recent write-backs, the migration of rows between the hot arrays and the host.
No host computation and no host array: the step's inputs and outputs are its only link to
the host tables (recgnn.embeddings.host_tier).

One concern: what runs inside the step. `DeviceStep` is an object the `HotCold` front holds
(recgnn/backends/hot_cold/backend.py): pure functions of the state and the prepared batch
over the frozen `Geometry`, no host bookkeeping.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from recgnn import sharding
from recgnn.backends.hot_cold import hot_set
from recgnn.backends.hot_cold.geometry import BATCH_MAJOR, Geometry
from recgnn.embeddings import base, host_cache, microbatch, row_sharded

P = sharding.P


class DeviceStep:
  """hot_cold's step: lookup (whole or per micro-batch), update, migration."""

  def __init__(self, geometry: Geometry):
    self._g = geometry
    self.mesh = geometry.mesh

  def _hot_get(self, hot: jax.Array, slots: jax.Array) -> jax.Array:
    """hot[slots] (slots >= Ha: zeros) as a replicated array: each device gathers the slots
    it owns, a psum adds the one non-zero term per slot (exact)."""
    return row_sharded.gather_everywhere(self.mesh, sharding.BATCH, hot, slots)

  def _hot_set(self, hot: jax.Array, slots: jax.Array, values: jax.Array) -> jax.Array:
    """hot[slots] = values (replicated; slots >= Ha dropped): each device its own slots."""
    return row_sharded.scatter_everywhere(self.mesh, sharding.BATCH, hot, slots, values)

  @staticmethod
  def _local(slots: jax.Array, h: int) -> jax.Array:
    """Hot slots -> this device's local index, h (dropped / zero) where not owned."""
    return row_sharded.local_index(slots, h, sharding.BATCH)

  def _hot_lookup(self, hot: jax.Array, ids: jax.Array) -> jax.Array:
    """Rows of hot slots ids int32[B, L] (batch-split; >= Ha: zeros) -> f32[B, L, D]. Each
    device gathers the rows it owns for the ids of every device and a reduce-scatter hands
    each device its examples' rows (one non-zero term per row: exact)."""
    split = self._g.split_batch
    ids_spec = P(sharding.BATCH, None) if split else sharding.REPLICATED
    out_spec = P(sharding.BATCH, None, None) if split else sharding.REPLICATED

    @functools.partial(
      jax.shard_map,
      mesh=self.mesh,
      in_specs=(P(sharding.BATCH, None), ids_spec),
      out_specs=out_spec,
      check_vma=False,
    )
    def local(h, ids):
      if split:
        ids = row_sharded.every(ids, sharding.BATCH)
      rows = row_sharded.gather(h, self._local(ids, h.shape[0]))
      if split:
        return row_sharded.reduce_scatter_rows(rows, sharding.BATCH)
      return row_sharded.psum_rows(rows, sharding.BATCH)

    return local(hot, ids)

  def micro_batches(self, prepared) -> tuple[jax.Array, ...] | None:
    """The step's micro-batch feature: int32[n * Pm] per micro-batch, batch-major, each
    device's local example indices (b = padding) in the order to run them: popular first."""
    if "micro" not in prepared:
      return None
    return tuple(mb["idx"] for mb in prepared["micro"])

  def _cold(self, state, prepared) -> dict:
    """The residuals: {"rows": per stack of tables (`hot_set.stacks`), the batch's cold rows
    and their optimizer state ({k: [W, ...]}, replicated; table i's at the positions its
    cold_ids give)}: the rows prepare read from the host tables ("vals", moved with the
    batch), but where the device ring of recent write-backs holds a newer value ("src", a
    ring slot: a row some step wrote back while this batch was prepared ahead of it,
    `host_tier.Recent`). Read by the lookup, updated by `update`. An eval step drops them."""
    rows = []
    for stack, lst in enumerate(prepared["cold"]):
      got, ring = lst["vals"], state["ring"][stack]
      if ring["table"].shape[0]:
        got = _from_ring(got, ring, lst["src"])
      rows.append(got)
    return {"rows": tuple(rows)}

  def _cold_table(self, cold, name) -> jax.Array:
    """The cold rows f32[Uc, D] of `name`'s stack (its cold_ids index them)."""
    return cold["rows"][self._g.stack_of[name][0]]["table"]

  def lookup_micro(self, state, prepared) -> tuple[tuple[dict[str, jax.Array], ...], dict]:
    """-> ({table: f32[n * Pm, D]} pooled rows of each micro-batch's examples (padding:
    zeros), in `micro_batches`' order; residuals for `update`)."""
    cold = self._cold(state, prepared)
    parts = []
    for mb in prepared["micro"]:
      out = {}
      for name, spec in self._g.specs.items():
        e = mb[name]
        rows = self._hot_lookup(state["tables"][name]["hot"]["table"], e["hot"])
        if "cold" in e:
          c = self._cold_table(cold, name)
          got = c.at[e["cold"]].get(mode="fill", fill_value=0.0)
          rows = jnp.where((e["cold"] < c.shape[0])[..., None], got, rows)
        count = e.get("count") if spec.pooling == "mean" else None
        out[name] = base.pool_rows(rows, count)
      parts.append(out)
    return tuple(parts), cold

  def lookup(self, state, prepared):
    if "micro" not in prepared:
      cold = self._cold(state, prepared)
      return self._lookup_whole(state, prepared, cold), cold
    parts, cold = self.lookup_micro(state, prepared)
    idx = [mb["idx"] for mb in prepared["micro"]]
    batch = next(iter(prepared["tables"].values()))["hot_ids"].shape[0]
    split = self._g.split_batch
    pooled = {
      n: microbatch.merge(self.mesh, split, batch, idx, [p[n] for p in parts])
      for n in self._g.specs
    }
    return pooled, cold

  def _lookup_whole(self, state, prepared, cold_rows):
    out = {}
    for name, spec in self._g.specs.items():
      t = prepared["tables"][name]
      rows = self._hot_lookup(state["tables"][name]["hot"]["table"], t["hot_ids"])
      cold = self._cold_table(cold_rows, name)
      got = cold.at[t["cold_ids"]].get(mode="fill", fill_value=0.0)
      rows = jnp.where((t["cold_ids"] < cold.shape[0])[..., None], got, rows)
      out[name] = base.pool_rows(rows, t.get("count") if spec.pooling == "mean" else None)
    return out

  def update(self, state, prepared, residuals, grads):
    """The hot rows' update, the cold rows' (written into the device ring and returned for
    the host writer), then the migration planned with this batch: rows joining the hot set
    read from the ring (this step's cold rows are in it by then, and earlier write-backs
    still in flight) or from the values prepare staged, rows leaving it written into the
    ring and returned for the host. -> the new state with TO_HOST: per stack {"cold": {k:
    [W, ...]} (list order), "out": {table: {k: [Ko, ...]}} (the rows leaving)}."""
    if base.TO_HOST in state:
      raise ValueError(
        "hot_cold: the state still holds the previous step's rows for the host: hand them to "
        "after_update(state) after each update"
      )
    specs = self._g.specs
    hot = {}
    for name, spec in specs.items():
      t, p = state["tables"][name], prepared["tables"][name]
      count = p.get("count") if spec.pooling == "mean" else None
      hot[name] = self._update_hot(spec, t["hot"], p, grads[name], count)
    tables, rings, to_host = {}, [], []
    for stack, names in enumerate(self._g.stacks):
      lst = prepared["cold"][stack]
      cold = self._update_cold(stack, prepared, grads, residuals)
      # The ring: sized by the first train batch (its "ring" shape), written after this
      # step's reads of it (the residuals: in place on the donated ring).
      ring = state["ring"][stack]
      width = lst["ring"].shape[1]
      if ring["table"].shape[0] != width:
        ring = {k: jnp.zeros((width,) + v.shape[1:], v.dtype) for k, v in cold.items()}
      else:
        _, ring = jax.lax.optimization_barrier((residuals["rows"][stack], ring))
      ring = _to_ring(ring, lst["dst"], cold)
      out, leaving = {}, {}
      for name in names:
        t, p = state["tables"][name], prepared["tables"][name]
        tables[name], gone = self.migration({**t, "hot": hot[name]}, p, ring, specs[name])
        if gone is not None:
          leaving[name] = gone
      for name, gone in leaving.items():  # (after every read of the ring for rows joining)
        ring = _to_ring(ring, prepared["tables"][name]["out_dst"], gone)
        out[name] = gone
      rings.append(ring)
      to_host.append({"cold": cold, "out": out})
    return {
      "tables": tables,
      "ring": tuple(rings),
      **host_cache.advance(state, prepared),
      base.TO_HOST: tuple(to_host),
    }

  def reset_rows(self, state, resets):
    """resets {table: {"slots": int32[R] hot slots (>= Ha: none), "rows": f32[R, D]}}
    (`Preparer.place_resets`) -> the state with those hot slots set to the rows and their
    optimizer slots to the initial value, each device writing the slots it owns. O(R * D)."""
    tables = dict(state["tables"])
    for name, r in resets.items():
      t = tables[name]
      init = self._g.specs[name].optimizer.initial_accumulator
      hot = {}
      for k, v in t["hot"].items():
        vals = r["rows"] if k == "table" else jnp.full(r["slots"].shape + v.shape[1:], init)
        hot[k] = self._hot_set(v, r["slots"], vals.astype(v.dtype))
      tables[name] = {**t, "hot": hot}
    return {**state, "tables": tables}

  def _update_hot(self, spec, hot, p, g, count):
    """dense(shard=rows)'s update on the hot slots: the batch's (ids, pooled grads) on
    every device, each device updates the slots it owns (cold positions: slot Ha, dropped)."""
    slot_names = spec.optimizer.slot_names()
    keys = ["hot_ids"] + (["hot_unique", "hot_inverse"] if spec.optimizer.needs_unique else [])
    sub = {k: p[k] for k in keys}
    mean = count is not None
    count = count if mean else jnp.zeros((g.shape[0],), jnp.int32)
    split = self._g.split_batch
    bspec = P(sharding.BATCH) if split else sharding.REPLICATED
    p_specs = {k: bspec if k in BATCH_MAJOR else sharding.REPLICATED for k in sub}
    row_spec = {"table": P(sharding.BATCH, None), **{s: P(sharding.BATCH) for s in slot_names}}
    bag = p["hot_ids"].shape[1]

    @functools.partial(
      jax.shard_map,
      mesh=self.mesh,
      in_specs=(row_spec, p_specs, bspec, bspec),
      out_specs=row_spec,
      check_vma=False,
    )
    def local(hot, sub, g, count):
      if split:
        every = functools.partial(row_sharded.every, axis=sharding.BATCH)
        sub = {k: every(v) if k in BATCH_MAJOR else v for k, v in sub.items()}
        g, count = every(g), every(count)
      grads = base.unpool(g, count if mean else None, bag)
      h = hot["table"].shape[0]
      lp = {"ids": self._local(sub["hot_ids"], h)}
      if "hot_unique" in sub:
        lp["unique"] = self._local(sub["hot_unique"], h)
        lp["inverse"] = sub["hot_inverse"]
      slots = {k: hot[k] for k in slot_names}
      table, slots = row_sharded.update(spec, hot["table"], slots, lp, grads)
      return {"table": table, **slots}

    return local(hot, sub, g, count)

  def _update_cold(self, stack, prepared, grads, residuals) -> dict:
    """The cold rows' update on the copy the lookup took (the stack's [W, ...] arrays,
    replicated: every device applies the same), table after table (their segments are
    disjoint: each update touches its own): the same adds in the same order as dense's.
    -> the updated cold rows {k: [W, ...]}."""
    names = self._g.stacks[stack]
    lst = prepared["cold"][stack]
    got = residuals["rows"][stack]
    uc = lst["src"].shape[0]
    off = lst["off"]
    for i, name in enumerate(names):
      spec, p = self._g.specs[name], prepared["tables"][name]
      count = p.get("count") if spec.pooling == "mean" else None
      g, ids, count = sharding.replicate((grads[name], p["cold_ids"], count), self.mesh)
      lp = {"ids": ids}
      if spec.optimizer.needs_unique:
        # The distinct cold rows are the table's segment of the list: cold_ids index it
        # (minus its offset); the window's other entries, and padding, point at the filler
        # entry uc (read as zeros, never written). The window: the most distinct rows a
        # batch of these ids has (static), at most the list.
        cap = min(hot_set.cold_cap(p["cold_ids"].shape, spec), uc)
        j = jnp.arange(cap + 1, dtype=jnp.int32)
        lp["unique"] = jnp.where(j < off[i + 1] - off[i], off[i] + j, uc)
        lp["inverse"] = jnp.where(ids < uc, ids - off[i], cap)
      slots = {k: got[k] for k in spec.optimizer.slot_names()}
      table, slots = base.sparse_sgd_or_adagrad(
        spec, got["table"], slots, lp, base.unpool(g, count, ids.shape[1])
      )
      got = {**got, "table": table, **slots}
    return got

  def migration(self, t, p, ring, spec) -> tuple[dict, dict | None]:
    """Rows leaving the hot set (their values read off the updated hot arrays) and rows
    joining it (after this batch's cold update, so a row cold in this batch and hot from the
    next moves its new value): each joining row from the ring where prepare found it there
    ("in_src": this step's cold rows, or an earlier write-back maybe still in flight), else
    the value prepare read from the host ("in_vals"). -> (the table's state, the leaving
    rows {k: [Ko, ...]} for the ring and the host, or None)."""
    if p["in_rows"].shape[0] == 0 and p["out_slots"].shape[0] == 0:
      return t, None
    hot = dict(t["hot"])
    hot_rows = t["hot_rows"]
    gone = None
    if p["out_slots"].shape[0]:
      gone = {k: self._hot_get(v, p["out_slots"]) for k, v in hot.items()}
      hot_rows = hot_rows.at[p["out_slots"]].set(spec.num_rows, mode="drop")
    if p["in_rows"].shape[0]:
      vals = p["in_vals"]
      if ring["table"].shape[0]:
        vals = _from_ring(vals, ring, p["in_src"])
      for k in hot:
        hot[k] = self._hot_set(hot[k], p["in_slots"], vals[k])
      hot_rows = hot_rows.at[p["in_slots"]].set(p["in_rows"], mode="drop")
    return {**t, "hot": hot, "hot_rows": hot_rows}, gone


def _rows_mask(mask: jax.Array, v: jax.Array) -> jax.Array:
  """bool[W] -> bool[W, 1, ...], broadcastable against v [W, ...]."""
  return mask.reshape(mask.shape + (1,) * (v.ndim - 1))


def _from_ring(vals: dict, ring: dict, src: jax.Array) -> dict:
  """vals {k: [W, ...]}, each row replaced by ring[src] where src holds a ring slot (ABSENT:
  past the ring, the staged value stands)."""
  held = src < ring["table"].shape[0]
  return {
    k: jnp.where(_rows_mask(held, v), ring[k].at[src].get(mode="fill", fill_value=0.0), v)
    for k, v in vals.items()
  }


def _to_ring(ring: dict, dst: jax.Array, vals: dict) -> dict:
  """ring[dst] = vals (ABSENT / padding: dropped)."""
  return {k: v.at[dst].set(vals[k], mode="drop") for k, v in ring.items()}
