"""hot_cold's device code (jit-able): the hot rows' lookup and update over the mesh, the cold
rows gathered from and written back to the host table, the migration of rows between them.

One concern: what runs inside the step. `DeviceSteps` is one part of the `HotCold` class
(recgnn/backends/hot_cold/__init__.py): it reads the attributes HotCold's constructor sets
(`mesh`, `layout`, `specs`, `host`, `_BATCH_MAJOR`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from recgnn import sharding
from recgnn.embeddings import base, host_cache, host_table, microbatch, row_sharded

P = sharding.P


class DeviceSteps:
  """The device half of `HotCold`: lookup (whole or per micro-batch), update, migration."""

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
    split = self.layout.split_batch
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

  def _cold_rows(self, state, prepared, name, keys=("table",)) -> dict[str, jax.Array]:
    """The batch's cold rows (and optimizer state) from the host table: replicated
    [Uc, ...] arrays (the padding entries read row 0 ... and are never used)."""
    t = state["tables"][name]
    rows = prepared["tables"][name]["cold_rows"]
    s = t["host"]["table"].shape[0]
    rows = jnp.minimum(rows, s - 1)
    return {k: self.host.gather(t["host"][k], rows) for k in keys}

  def micro_batches(self, prepared) -> tuple[jax.Array, ...] | None:
    """The step's micro-batch feature: int32[n * Pm] per micro-batch, batch-major, each
    device's local example indices (b = padding) in the order to run them: popular first."""
    if "micro" not in prepared:
      return None
    return tuple(mb["idx"] for mb in prepared["micro"])

  def _cold(self, state, prepared) -> dict[str, dict[str, jax.Array]]:
    """The residuals: {table: the batch's cold rows and their optimizer state, gathered from
    the host table once ([Uc, D] / [Uc], replicated)}, read by the lookup and updated and
    written back by `update` (no second trip to host memory). An eval step drops them, and
    XLA with them the slots' gather. On an unsplit host table the row list goes to the host
    once, with every array of the table gathered in one host computation; the residuals keep
    it there ("host_rows") for the write-back."""
    out = {}
    for name, spec in self.specs.items():
      keys = ("table", *spec.optimizer.slot_names())
      if self.host.split or not self.host.offloaded:
        out[name] = self._cold_rows(state, prepared, name, keys)
        continue
      t = state["tables"][name]
      # Padding entries (past the table) are clamped by the gather and dropped by the scatter.
      idx = self.host.to_host(prepared["tables"][name]["cold_rows"])
      # The list comes back as a host-resident output: the write-back reads it there
      # (passing `idx` again would move it to the host a second time).
      idx, *got = host_table.host_compute(
        lambda idx, *hs: (idx, *(host_table.gather_rows(h, idx) for h in hs)),
        idx,
        *[t["host"][k] for k in keys],
      )
      out[name] = {k: self.host.to_device(v) for k, v in zip(keys, got)}
      out[name]["host_rows"] = idx
    return out

  def lookup_micro(self, state, prepared) -> tuple[tuple[dict[str, jax.Array], ...], dict]:
    """-> ({table: f32[n * Pm, D]} pooled rows of each micro-batch's examples (padding:
    zeros), in `micro_batches`' order; residuals for `update`)."""
    cold = self._cold(state, prepared)
    parts = []
    for mb in prepared["micro"]:
      out = {}
      for name, spec in self.specs.items():
        e = mb[name]
        rows = self._hot_lookup(state["tables"][name]["hot"]["table"], e["hot"])
        if "cold" in e:
          c = cold[name]["table"]
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
    split = self.layout.split_batch
    pooled = {
      n: microbatch.merge(self.mesh, split, batch, idx, [p[n] for p in parts]) for n in self.specs
    }
    return pooled, cold

  def _lookup_whole(self, state, prepared, cold_rows):
    out = {}
    for name, spec in self.specs.items():
      t = prepared["tables"][name]
      rows = self._hot_lookup(state["tables"][name]["hot"]["table"], t["hot_ids"])
      cold = cold_rows[name]["table"]
      got = cold.at[t["cold_ids"]].get(mode="fill", fill_value=0.0)
      rows = jnp.where((t["cold_ids"] < cold.shape[0])[..., None], got, rows)
      out[name] = base.pool_rows(rows, t.get("count") if spec.pooling == "mean" else None)
    return out

  def update(self, state, prepared, residuals, grads):
    tables = {}
    for name, spec in self.specs.items():
      t, p = state["tables"][name], prepared["tables"][name]
      count = p.get("count") if spec.pooling == "mean" else None
      hot = self._update_hot(spec, t["hot"], p, grads[name], count)
      host = self._update_cold(spec, state, prepared, name, grads[name], count, residuals[name])
      tables[name] = self._migration({**t, "hot": hot, "host": host}, p, spec)
    return {"tables": tables, **host_cache.advance(state, prepared)}

  def _update_hot(self, spec, hot, p, g, count):
    """dense(shard=rows)'s update on the hot slots: the batch's (ids, pooled grads) on
    every device, each device updates the slots it owns (cold positions: slot Ha, dropped)."""
    slot_names = spec.optimizer.slot_names()
    keys = ["hot_ids"] + (["hot_unique", "hot_inverse"] if spec.optimizer.needs_unique else [])
    sub = {k: p[k] for k in keys}
    mean = count is not None
    count = count if mean else jnp.zeros((g.shape[0],), jnp.int32)
    split = self.layout.split_batch
    bspec = P(sharding.BATCH) if split else sharding.REPLICATED
    p_specs = {k: bspec if k in self._BATCH_MAJOR else sharding.REPLICATED for k in sub}
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
        sub = {k: every(v) if k in self._BATCH_MAJOR else v for k, v in sub.items()}
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

  def _update_cold(self, spec, state, prepared, name, g, count, got):
    """The cold rows' update on the copy the lookup gathered (`got`, replicated: every device
    applies the same), then written back to the host table (each device its own rows when it
    is split)."""
    t, p = state["tables"][name], prepared["tables"][name]
    slot_names = spec.optimizer.slot_names()
    g, ids, count = sharding.replicate((g, p["cold_ids"], count), self.mesh)
    grads = base.unpool(g, count, ids.shape[1])
    uc = p["cold_rows"].shape[0]
    lp = {"ids": ids}
    if spec.optimizer.needs_unique:
      # The distinct cold rows are the gathered rows themselves; cold_ids index them, and
      # every other position points at the filler entry uc (read as zeros, never written).
      lp["unique"] = jnp.arange(uc + 1, dtype=jnp.int32)
      lp["inverse"] = ids
    slots = {k: got[k] for k in slot_names}
    table, slots = base.sparse_sgd_or_adagrad(spec, got["table"], slots, lp, grads)
    host = dict(t["host"])
    new = {"table": table, **slots}
    if "host_rows" in got:  # the row list already on the host: one host computation
      keys = tuple(host)
      vals = [self.host.to_host(new[k]) for k in keys]
      out = host_table.host_compute(
        lambda idx, *a: tuple(
          host_table.scatter_rows(h, idx, v) for h, v in zip(a[: len(keys)], a[len(keys) :])
        ),
        got["host_rows"],
        *[host[k] for k in keys],
        *vals,
      )
      return dict(zip(keys, out))
    for k in host:
      host[k] = self.host.scatter(host[k], p["cold_rows"], new[k])
    return host

  def _migration(self, t, p, spec):
    """Rows leaving the hot set -> host; rows joining it <- host (after this batch's cold
    write-back, so a row cold in this batch and hot from the next moves its new value)."""
    if p["in_rows"].shape[0] == 0 and p["out_slots"].shape[0] == 0:
      return t
    n = spec.num_rows
    hot, host = dict(t["hot"]), dict(t["host"])
    hot_rows = t["hot_rows"]
    if p["out_slots"].shape[0]:
      rows = hot_rows.at[p["out_slots"]].get(mode="fill", fill_value=n)
      rows = jnp.where(rows < n, rows, base.aligned_rows(n))  # empty / padding: dropped
      for k in hot:
        host[k] = self.host.scatter(host[k], rows, self._hot_get(hot[k], p["out_slots"]))
      hot_rows = hot_rows.at[p["out_slots"]].set(n, mode="drop")
    if p["in_rows"].shape[0]:
      for k in hot:
        hot[k] = self._hot_set(hot[k], p["in_slots"], self.host.gather(host[k], p["in_rows"]))
      hot_rows = hot_rows.at[p["in_slots"]].set(p["in_rows"], mode="drop")
    return {**t, "hot": hot, "host": host, "hot_rows": hot_rows}
