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
from recgnn.backends.hot_cold import hot_set
from recgnn.embeddings import base, host_cache, microbatch, row_sharded

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

  def micro_batches(self, prepared) -> tuple[jax.Array, ...] | None:
    """The step's micro-batch feature: int32[n * Pm] per micro-batch, batch-major, each
    device's local example indices (b = padding) in the order to run them: popular first."""
    if "micro" not in prepared:
      return None
    return tuple(mb["idx"] for mb in prepared["micro"])

  def _caps(self, prepared, names, stack, win=None) -> tuple[int, ...]:
    """Each table's window in its stack's cold list (static): its most cold rows (from the
    batch's shape), at most the list's window (the shape of its "win", `prepare`; of the
    next batch's list: `win`, the next batch shaped as this one)."""
    win = (prepared["cold"][stack]["win"] if win is None else win).shape[1]
    return tuple(
      min(hot_set.cold_cap(prepared["tables"][n]["cold_ids"].shape, self.specs[n]), win)
      for n in names
    )

  def _cold(self, state, prepared) -> dict:
    """The residuals: {"rows": per stack of tables (`hot_set.stacks`), the batch's cold rows
    and their optimizer state ({k: [W, ...]}, replicated; table i's at the positions its
    cold_ids give), "moved": per stack, the list left in host memory for the write-back (one
    device; None on a mesh or prefetched), "next": per stack, the next batch's cold rows
    read from the host ({k: [L, ...]}; None without prefetch)}. Read by the lookup, updated
    and written back by `update` (no second trip to host memory). An eval step drops them,
    and XLA with them the slots' gather.

    The batch's rows come from the state's buffer when the previous step gathered them
    ("prefetched"), else from the host tables: one host computation per stack, its list
    crosses the host link once, W rows come back. The next batch's are read from the host
    tables as they came into the step (a read depending on nothing the step computes: on an
    accelerator it overlaps the step), materialized by an optimization barrier: no consumer
    re-reads the host through a fused gather after the write-back (XLA would copy the table
    to keep the old values)."""
    rows, moved, nxt = [], [], []
    for stack, names in enumerate(self._stacks):
      keys = ("table", *self.specs[names[0]].optimizer.slot_names())
      tables = [{k: state["tables"][n]["host"][k] for k in keys} for n in names]
      lst = prepared["cold"][stack]
      if "prefetched" in prepared:
        buf, w = state["next"][stack], lst["rows"].shape[0]
        if buf["table"].shape[0] < w:
          raise ValueError(
            f"hot_cold: a batch prepared as prefetched ({w} cold rows) but the state's buffer "
            f"holds {buf['table'].shape[0]}: the state is not the one the previous prepared "
            "batch's step returned"
          )
        rows.append({k: v[:w] for k, v in buf.items()})
        moved.append(None)
      else:
        caps = self._caps(prepared, names, stack)
        got, m = self.host.gather_segments(tables, lst["rows"], lst["off"], caps)
        rows.append(got)
        moved.append(m)
      if "next" in prepared:
        nl = prepared["next"][stack]
        caps = self._caps(prepared, names, stack, nl["win"])
        got, _ = self.host.gather_segments(tables, nl["rows"], nl["off"], caps)
        nxt.append(jax.lax.optimization_barrier(got))
      else:
        nxt.append(None)
    return {"rows": tuple(rows), "moved": tuple(moved), "next": tuple(nxt)}

  def _cold_table(self, cold, name) -> jax.Array:
    """The cold rows f32[Uc, D] of `name`'s stack (its cold_ids index them)."""
    return cold["rows"][self._stack_of[name][0]]["table"]

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
      cold = self._cold_table(cold_rows, name)
      got = cold.at[t["cold_ids"]].get(mode="fill", fill_value=0.0)
      rows = jnp.where((t["cold_ids"] < cold.shape[0])[..., None], got, rows)
      out[name] = base.pool_rows(rows, t.get("count") if spec.pooling == "mean" else None)
    return out

  def update(self, state, prepared, residuals, grads):
    """The hot rows' update, the cold rows' (written back), the next batch's buffer (with
    prefetch), then the migration planned with this batch."""
    hot = {}
    for name, spec in self.specs.items():
      t, p = state["tables"][name], prepared["tables"][name]
      count = p.get("count") if spec.pooling == "mean" else None
      hot[name] = self._update_hot(spec, t["hot"], p, grads[name], count)
    hosts, buffers = {}, []
    for stack in range(len(self._stacks)):
      h, cold = self._update_cold(stack, state, prepared, grads, residuals)
      hosts.update(h)
      buffers.append(self._buffer(stack, state, prepared, residuals, cold, hot))
    tables = {}
    for name, spec in self.specs.items():
      t, p = state["tables"][name], prepared["tables"][name]
      tables[name] = self._migration({**t, "hot": hot[name], "host": hosts[name]}, p, spec)
    out = {"tables": tables, **host_cache.advance(state, prepared)}
    if "prefetched" in prepared:  # the buffer must hold this very batch's rows
      wrong = state["next_for"] != prepared["version"]
      out["stale"] = out["stale"] + wrong.astype(jnp.int32)
    nxt = "next" in prepared
    out["next"] = tuple(buffers) if nxt else state["next"]
    out["next_for"] = prepared["version"] + 1 if nxt else jnp.full((), -1, jnp.int32)
    return out

  def _buffer(self, stack, state, prepared, residuals, cold, hot) -> dict | None:
    """The next batch's cold rows {k: [C, ...]} (C: the most cold rows a batch shaped as
    this one has, one length for the run, so the state keeps its shapes): read from the host
    as the step came in, but the rows this step updated (from_now: this batch's updated cold
    rows `cold`) and the rows leaving the hot set at this step's migration (from_hot: the
    updated hot arrays `hot`), whose host copies are stale until the write-back /
    migration. None without a next list."""
    if "next" not in prepared:
      return None
    names = self._stacks[stack]
    nl = prepared["next"][stack]
    got = residuals["next"][stack]
    w = next(iter(cold.values())).shape[0]
    fn = nl["from_now"]
    now = (fn < w)[:, None]
    out = {}
    for k, v in got.items():
      mine = cold[k].at[fn].get(mode="fill", fill_value=0.0)
      out[k] = jnp.where(now if v.ndim == 2 else now[:, 0], mine, v)
    if "from_hot" in nl:
      for i, name in enumerate(names):
        slots = nl["from_hot"][i]
        was_hot = (slots < hot[name]["table"].shape[0])[:, None]
        for k in out:
          h = self._hot_get(hot[name][k], slots)
          out[k] = jnp.where(was_hot if h.ndim == 2 else was_hot[:, 0], h, out[k])
    cap = sum(
      hot_set.cold_cap(prepared["tables"][n]["cold_ids"].shape, self.specs[n]) for n in names
    )
    length = nl["rows"].shape[0]
    return {
      k: jnp.concatenate([v, jnp.zeros((cap - length,) + v.shape[1:], v.dtype)])
      for k, v in out.items()
    }

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

  def _update_cold(self, stack, state, prepared, grads, residuals) -> tuple[dict, dict]:
    """The cold rows' update on the copy the lookup gathered (the stack's [Uc, ...] arrays,
    replicated: every device applies the same), table after table (their segments are
    disjoint: each update touches its own), then written back to the host tables in one
    host computation (each device its own rows when they are split). With a next batch's
    read, the values written back pass through an optimization barrier with the rows read:
    write after read on the donated host arrays, ordered by a dependency on the read only
    (never on compute), so XLA neither copies the table nor delays the read. -> ({table:
    host}, the updated cold rows {k: [Uc, ...]})."""
    names = self._stacks[stack]
    lst = prepared["cold"][stack]
    got = residuals["rows"][stack]
    uc = lst["rows"].shape[0]
    off = lst["off"]
    caps = self._caps(prepared, names, stack)
    for i, name in enumerate(names):
      spec, p = self.specs[name], prepared["tables"][name]
      count = p.get("count") if spec.pooling == "mean" else None
      g, ids, count = sharding.replicate((grads[name], p["cold_ids"], count), self.mesh)
      lp = {"ids": ids}
      if spec.optimizer.needs_unique:
        # The distinct cold rows are the table's segment of the list: cold_ids index it
        # (minus its offset); the window's other entries, and padding, point at the filler
        # entry uc (read as zeros, never written).
        j = jnp.arange(caps[i] + 1, dtype=jnp.int32)
        lp["unique"] = jnp.where(j < off[i + 1] - off[i], off[i] + j, uc)
        lp["inverse"] = jnp.where(ids < uc, ids - off[i], caps[i])
      slots = {k: got[k] for k in spec.optimizer.slot_names()}
      table, slots = base.sparse_sgd_or_adagrad(
        spec, got["table"], slots, lp, base.unpool(g, count, ids.shape[1])
      )
      got = {**got, "table": table, **slots}
    keys = tuple(got)
    tables = [{k: state["tables"][n]["host"][k] for k in keys} for n in names]
    moved = residuals["moved"][stack]
    if residuals["next"][stack] is not None:
      # The values written back wait for the next batch's read (write after read on the
      # donated host arrays): a dependency on the read only, never on compute. On the
      # values, not the row list: the list may be in host memory already (an input or
      # `moved`), where a barrier with device arrays would send it to the device and back.
      got, _ = jax.lax.optimization_barrier((got, residuals["next"][stack]))
    new = self.host.scatter_segments(tables, lst["rows"], off, caps, got, moved)
    return {n: {**state["tables"][n]["host"], **h} for n, h in zip(names, new)}, got

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
