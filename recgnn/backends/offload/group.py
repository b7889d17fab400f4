"""`OffloadGroup`: the offload tables of one plan rule, planned together by the compiled kernel
(the registered `offload` backend)."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from recgnn import sharding
from recgnn.backends.offload import cache_plan
from recgnn.backends.offload import planner as hostplan
from recgnn.backends.offload.cache_plan import EVICT_ROWS, LOAD_ROWS, Sizer, _bucket
from recgnn.backends.offload.table import PLANNED, Offload
from recgnn.embeddings import base, host_cache, host_table

# Padding of a group's exchange lists, per row (EVICT_SLOTS, EVICT_ROWS, LOAD_ROWS,
# LOAD_SLOTS, NEXT_FROM_NOW): past every table's window, never read as a table's entry.
FILL = (np.iinfo(np.int32).max, np.iinfo(np.int32).max, 0, np.iinfo(np.int32).max, 0)


@base.register_backend("offload")
class OffloadGroup(base.TableGroup):
  """The offload tables of one plan rule: `TableGroup` with the planning of a train batch
  done for every table at once by the compiled kernel (`recgnn.backends.offload.planner.plan_step`).

  The kernel covers the steady state, a batch admitted by the previous step with the next
  one admitted now (its lists cut to each table's `Offload._width`, whose hysteresis state
  both planners share); everything else (the first batch, one after an eval pass, eval
  batches, a batch that does not fit, numba missing) goes through each table's numpy
  planner. Both work on the same planner arrays: the group keeps
  every table's row->slot map, slot->row map, recency and dirty bits in flat arrays, and
  each `Planner` holds views of its slices. The decisions are the same either way
  (tests/test_offload.py compares every prepared array).

  Each batch's ids and sorted distinct rows are computed once, into a ring of
  lookahead + 3 batches (bounded memory), and reused while it moves through the window.
  """

  capabilities = Offload.capabilities

  def __init__(self, specs, mesh, layout: base.Layout | None = None, text: str = "", **options):
    super().__init__(Offload, specs, mesh, layout, text, **options)
    self._flat = None
    self._ring = None
    self._admitted = None  # the arrays of the batch the kernel admitted ahead
    self.fast_batches = 0  # batches planned by the compiled kernel (tests, benchmarks)
    # One exchange list per row layout: the step's shapes are one (now, next) length pair
    # per layout, sized over its tables together (their total moves little from batch to
    # batch; each table sized apart changed the step's signature every few steps).
    self._stacks = host_table.layouts({n: m.spec for n, m in self.members.items()})
    self._sizers = []
    self.list_widths: set[tuple[int, int]] = set()  # (now, next) lengths of train steps
    self._list_counters = host_cache.Counters()

  # -- state: the planners' arrays as slices of flat ones

  def init(self, key):
    state = super().init(key)
    self._adopt()
    return state

  def restore(self, state):
    state = super().restore(state)
    self._adopt()
    return state

  def import_(self, logical):
    state = super().import_(logical)
    self._adopt()
    return state

  def _adopt(self):
    self._flat, self._ring, self._admitted = None, None, None
    # New cache bookkeeping: the lists start from the cap again (`Sizer(start_at_cap)`).
    self._sizers = [
      {k: Sizer(cache_plan.PATIENCE, start_at_cap=True) for k in ("now", "next")}
      for _ in self._stacks
    ]
    # Each list's window: the most entries one table has in it (`_window_width`).
    self._win_sizers = [
      {k: host_cache.window_sizer(cache_plan.PATIENCE, start_at_cap=True) for k in ("now", "next")}
      for _ in self._stacks
    ]
    members = list(self.members.values())
    if not members or any(m._planner is None for m in members):
      return
    ps = [m._planner for m in members]
    row_off = np.cumsum([0] + [p.num_rows for p in ps]).astype(np.int64)
    slot_off = np.cumsum([0] + [p.cache_rows for p in ps]).astype(np.int64)
    lfu = members[0].options.policy == "lfu"
    flat = {
      "row_slot": np.concatenate([p.row_slot for p in ps]),
      "slot_row": np.concatenate([p.slot_row for p in ps]),
      "last_used": np.concatenate([p.last_used for p in ps]),
      "dirty": np.concatenate([p.dirty for p in ps]),
      "freq": np.concatenate([p.freq for p in ps]) if lfu else np.zeros(0, np.int64),
    }
    for i, p in enumerate(ps):
      r, c = slice(row_off[i], row_off[i + 1]), slice(slot_off[i], slot_off[i + 1])
      p.row_slot, p.slot_row = flat["row_slot"][r], flat["slot_row"][c]
      p.last_used, p.dirty = flat["last_used"][c], flat["dirty"][c]
      if lfu:
        p.freq = p.lfu._dense = flat["freq"][r]
    self._flat = dict(flat, row_off=row_off, slot_off=slot_off)
    self._flat["num_rows"] = np.array([p.num_rows for p in ps], np.int64)
    self._flat["evict_pad"] = np.array([base.aligned_rows(p.num_rows) for p in ps], np.int64)

  # -- the ring of batches (ids and distinct rows, computed once per batch)

  def _layout(self, ids: dict):
    """The ring for batches shaped as this one (rebuilt when the shapes change)."""
    ring = self._ring
    if ring is not None and ids[next(iter(self.members))] is ring["last"]:
      return ring
    shapes = tuple(np.shape(ids[n]) for n in self.members)
    if self._ring is None or self._ring["shapes"] != shapes:
      sizes = [int(np.prod(sh)) for sh in shapes]
      id_off = np.cumsum([0] + sizes).astype(np.int64)
      r, total, t_n = self.lookahead + 3, int(id_off[-1]), len(sizes)
      self._ring = {
        "shapes": shapes,
        "id_off": id_off,
        "ids": np.empty((r, total), np.int64),
        "rows": np.empty((r, total), np.int64),
        "n": np.zeros((r, t_n), np.int64),
        "keys": {},  # id() of the batch's first array -> (ring row, the arrays)
        "order": [],  # ring rows, oldest first
      }
    self._ring["last"] = ids[next(iter(self.members))]
    return self._ring

  def _ring_row(self, ids: dict, busy: list[int]) -> int | None:
    """The ring row of a batch, computed on its first visit. Batches are known by the
    identity of their arrays (as `Offload._unique`): a batch's ids must not change once
    prepare has seen it, in the window or as the batch itself."""
    ring = self._ring
    arrays = tuple(ids[n] for n in self.members)
    hit = ring["keys"].get(id(arrays[0]))
    if hit is not None and all(a is b for a, b in zip(hit[1], arrays)):
      return hit[0]
    if tuple(np.shape(a) for a in arrays) != ring["shapes"]:
      return None
    if len(ring["order"]) < ring["ids"].shape[0]:
      row = len(ring["order"])
    else:
      row = next(r for r in ring["order"] if r not in busy)
      ring["order"].remove(row)
      ring["keys"] = {k: v for k, v in ring["keys"].items() if v[0] != row}
    ring["order"].append(row)
    ring["keys"][id(arrays[0])] = (row, arrays)
    flat = ring["ids"][row]
    np.concatenate([np.asarray(a).reshape(-1) for a in arrays], out=flat)
    sizes = np.diff(ring["id_off"])
    if (sizes == sizes[0]).all():  # one vectorized numpy sort for every table
      ordered = np.sort(flat.reshape(sizes.shape[0], -1), axis=1).reshape(-1)
    else:
      ordered = np.concatenate([np.sort(np.asarray(a).reshape(-1)) for a in arrays])
    bad = np.empty(len(arrays), np.int64)
    hostplan.over_tables(
      hostplan.distinct, len(arrays), flat, ordered.astype(np.int64, copy=False),
      ring["id_off"], self._flat["num_rows"], ring["rows"][row], ring["n"][row], bad,
    )  # fmt: skip
    if (bad >= 0).any():
      ring["keys"].pop(id(arrays[0]))
      ring["order"].remove(row)
      t = int(np.flatnonzero(bad >= 0)[0])
      name = list(self.members)[t]
      raise ValueError(
        f"offload (table {name!r}): id {int(bad[t])} out of range for "
        f"{self.members[name].spec.num_rows} rows"
      )
    return row

  # -- prepare

  def prepare(self, ids, upcoming=(), *, train=True):
    """ids {table: int[B, L]} -> {"tables": {table: {"rows": the table's prepared batch
    (`Offload.prepare`, its exchanges moved to the lists), "count": int32[B] (mean
    pooling)}}, "lists": per row layout (`host_table.layouts`), {"now": int32[4, Wn],
    "now_off": int32[T + 1], "now_win": int32[0, wn], "next": int32[5, Wx], "next_off":
    int32[T + 1], "next_win": int32[0, wx]}: every table's exchange in one list (table i's
    at [off[i], off[i + 1]), its own rows and slots); `*_win` carries, as its shape only,
    the window the step reads per table (`_window_width`)}."""
    per = None
    if train and self._flat is not None and hostplan.enabled():
      per = self._prepare_fast(ids, list(upcoming))
    if per is None:
      if train:
        self._admitted = None  # the numpy planners admit (or not) the next batch themselves
      per = super().prepare(ids, upcoming, train=train)
    return self._lists(per, train)

  # -- one exchange list per row layout

  def _width(self, stack: int, kind: str, need: int | None, cap: int) -> int:
    """Length of a layout's exchange list ("now" or "next") under the `exchange` option.
    need: the rows it loads over the layout's tables (evictions never outnumber them: each
    victim slot receives a missing row), None when no table planned one; cap: the most it
    can load, the sum of min(ids per batch, C) over its tables. Both planners go through
    here (their prepared batches stay equal)."""
    mode = next(iter(self.members.values())).options.exchange
    # Nothing planned: empty, except a "next" of a run with look-ahead (the last batch of a
    # stream, or one before a batch that is not admitted ahead): the steady shapes, so it
    # does not compile a train step of its own (10-40 s in the last interval here).
    steady = kind == "next" and self.lookahead > 0
    if mode == "fixed":
      return cap if need is not None or steady else 0
    if mode == "pow2":
      return min(_bucket(need or 0), cap)
    sizer = self._sizers[stack][kind]
    if need is None:
      return sizer.hold(cap) if steady else 0
    return sizer(need, cap)

  def _window_width(self, stack: int, kind: str, most: int, width: int, cap: int, train: bool):
    """The static window the step reads of each table's segment of a list (at most the
    table's ids per batch): at least `most`, the longest segment of this list. Why: the step
    reads and writes each table's window in the host computation, so windows of a batch's
    ids (26 tables x 2048 ids at batch 2048, whatever the misses) made the host touch ~8x the
    rows the list carries (tests/test_offload_tiers.py measures it); sized by the longest
    segment (bucketed with hysteresis as the list, <= the list's length), the host touches
    about the tables x the longest segment. `fixed` and eval keep the ids' window."""
    mode = next(iter(self.members.values())).options.exchange
    if width == 0:
      return 0
    if mode == "fixed" or not train:
      return cap
    if mode == "pow2":
      return min(_bucket(most), cap, width)
    return min(self._win_sizers[stack][kind](most, cap), width)

  def _lists(self, per: dict, train: bool) -> dict:
    """Move each table's exchanges (exact lengths) into its layout's lists."""
    lists = []
    padded = 0
    for stack, names in enumerate(self._stacks):
      rows = [per[n]["rows"] for n in names]
      planned = [r.pop(PLANNED) for r in rows]
      caps = [min(r["ids"].size, self.members[n].cache_rows) for n, r in zip(names, rows)]
      ids_caps = [r["ids"].size for r in rows]
      entry = {}
      for j, (kind, fill) in enumerate((("now", FILL[:4]), ("next", FILL))):
        parts = [r.pop(kind) for r in rows]
        off = np.cumsum([0] + [x.shape[1] for x in parts]).astype(np.int32)
        if train:
          need = int(off[-1]) if any(f[j] for f in planned) else None
          width = self._width(stack, kind, need, sum(caps))
        else:  # read-only: the batch's cold rows on demand, at most its ids (one shape)
          width = sum(r["ids"].size for r in rows) if kind == "now" else 0
        lst = np.repeat(np.asarray(fill, np.int32)[:, None], width, axis=1)
        lst[:, : off[-1]] = np.concatenate(parts, axis=1)
        entry[kind], entry[f"{kind}_off"] = lst, off
        most = int(np.diff(off).max()) if len(off) > 1 else 0
        win = self._window_width(stack, kind, most, width, max(ids_caps), train)
        entry[f"{kind}_win"] = np.zeros((0, win), np.int32)
        if train:
          padded += width
          # Each table's share of the list (its rows and of the padding, by its rows), so
          # the tables' h2d_padded_bytes_per_step add up to the list's.
          total = int(off[-1])
          for n, c in zip(names, np.diff(off)):
            share = c / total if total else 1 / len(names)
            self.members[n]._count(padded_rows_h2d=int(c) + (width - total) * share)
      width, off = entry["now"].shape[1], entry["now_off"]
      for i, r in enumerate(rows):  # positions in the layout's "now" list (width: absent)
        pos = r["now_pos"]
        r["now_pos"] = np.where(pos < off[i + 1] - off[i], pos + off[i], width).astype(np.int32)
      lists.append(entry)
      if train:
        self.list_widths.add(tuple(entry[k].shape[1] for k in ("now", "next")))
    if train:
      self._list_counters.add(steps=1, padded_rows_h2d=padded)
    return {"tables": per, "lists": tuple(lists)}

  def table_exchanges(self, prepared: dict, table: str) -> dict[str, np.ndarray]:
    """A prepared batch's exchanges of one table, as `Offload.prepare` planned them: {"now":
    int32[4, n], "next": int32[5, m]} (its segments of its layout's lists; NEXT_FROM_NOW as
    positions in its "now"). Host side (tests, inspection)."""
    stack, i = next(
      (s, names.index(table)) for s, names in enumerate(self._stacks) if table in names
    )
    lists = prepared["lists"][stack]
    out = {}
    for kind in ("now", "next"):
      off = np.asarray(lists[f"{kind}_off"])
      out[kind] = np.asarray(lists[kind])[:, off[i] : off[i + 1]]
    return out

  def prepared_spec(self, prepared):
    return {
      "tables": super().prepared_spec(prepared["tables"]),
      "lists": jax.tree.map(lambda _: sharding.REPLICATED, prepared["lists"]),
    }

  def stats(self):
    """Every table's (`Offload.stats`), and the group's: list_rows_h2d_per_step (the rows
    the host reads move per step, padding included: what the host link carries),
    list_shapes (the distinct (now, next) list lengths so far: the step's shapes)."""
    out = super().stats()
    c = self._list_counters.take()
    if c.get("steps"):
      out["list_rows_h2d_per_step"] = c["padded_rows_h2d"] / c["steps"]
      out["list_shapes"] = len(self.list_widths)
    return out

  # -- the step: one host read per exchange, one write-back, for every table of a layout

  def _caps(self, prepared, names, lists, kind) -> list[int]:
    """Each table's window in a list of its layout (static): its ids per batch, at most the
    list's window (`_window_width`, the shape of `lists[kind + "_win"]`)."""
    win = lists[f"{kind}_win"].shape[1]
    return [min(int(np.prod(prepared["tables"][n]["rows"]["ids"].shape)), win) for n in names]

  @staticmethod
  def _padded(lst, values, pad: int):
    """A list int32[r, W] and its values {k: [W, ...]} with `pad` columns / rows after them
    (once per list: every table's window is a slice of these)."""
    if pad == 0:
      return lst, values
    lst = jnp.concatenate([lst, jnp.zeros((lst.shape[0], pad), lst.dtype)], axis=1)
    values = {
      k: jnp.concatenate([v, jnp.zeros((pad,) + v.shape[1:], v.dtype)]) for k, v in values.items()
    }
    return lst, values

  def _window(self, lst, off, i, cap, member, values):
    """Table i's window of a list int32[r, W] (padded by `_padded` when the layout has
    several tables): (int32[r, cap], its values' window {k: [cap, ...]}, its count); entries
    past its count are padding (slots C, rows past the host arrays, loads of row 0,
    NEXT_FROM_NOW absent)."""
    r = lst.shape[0]
    if len(off) == 2:  # one table: its segment starts the list, the window is the list
      cap = lst.shape[1]
    big = np.iinfo(np.int32).max
    pad = np.array(
      [member.cache_rows, base.aligned_rows(member.spec.num_rows), 0, member.cache_rows, big],
      np.int32,
    )[:r, None]
    count = off[i + 1] - off[i]
    if len(off) > 2:
      lst = jax.lax.dynamic_slice(lst, (0, off[i]), (r, cap))
      values = {
        k: jax.lax.dynamic_slice(v, (off[i],) + (0,) * (v.ndim - 1), (cap,) + v.shape[1:])
        for k, v in values.items()
      }
    return jnp.where(jnp.arange(cap) < count, lst, pad), values, count

  def lookup(self, state, prepared):
    """-> (pooled {table: f32[B, D]}, residuals: per layout {"now" / "next": {k: f32[W,
    ...]}}, the rows this step reads from the host: the on-demand rows of this batch, also
    looked up here, and the next batch's (prefetched). Both read the host arrays as they
    came into the step (ONE host computation per exchange for every table of the layout),
    so they depend on nothing the step computes; `update` places them in the caches. Each
    read is materialized (an optimization barrier): no consumer may re-read the host arrays
    later through a fused gather, after the write-back (XLA would then copy the whole table
    to keep the old values; XLA:CPU fuses host gathers into their consumers)."""
    pooled, residuals = {}, []
    for stack, names in enumerate(self._stacks):
      lists = prepared["lists"][stack]
      host = self.members[names[0]].host
      hosts = [state[n]["host"] for n in names]
      res = {}
      for kind in ("next", "now"):
        if lists[kind].shape[1]:
          caps = self._caps(prepared, names, lists, kind)
          got, _ = host.gather_segments(hosts, lists[kind][LOAD_ROWS], lists[f"{kind}_off"], caps)
          res[kind] = jax.lax.optimization_barrier(got)
      residuals.append(res)
      for n in names:
        p = prepared["tables"][n]
        rows = self.members[n].lookup_cache(state[n], p["rows"], res.get("now"))
        pooled[n] = base.pool_rows(rows, p.get("count"))
    return pooled, tuple(residuals)

  def update(self, state, prepared, residuals, grads):
    """Each table's cache changes (`Offload.apply`, on its windows of the lists), then ONE
    write-back (D2H, a scatter on the host) of every table's victims of both exchanges per
    layout. Write after read on the donated host arrays: the write-back's row lists pass
    through an optimization barrier with this step's host reads (the residuals), a
    dependency on reads only, never on compute; the caches take the rows that came through
    the barrier (read once, never again)."""
    out = {}
    for stack, names in enumerate(self._stacks):
      lists = prepared["lists"][stack]
      caps = {k: self._caps(prepared, names, lists, k) for k in ("now", "next")}
      now, nxt = lists["now"], lists["next"]
      back = (now[EVICT_ROWS], nxt[EVICT_ROWS])
      back, res = jax.lax.optimization_barrier((back, residuals[stack]))
      victims = {"now": [], "next": []}
      padded = {
        kind: self._padded(lists[kind], res[kind], max(caps[kind]) if len(names) > 1 else 0)
        for kind in ("now", "next")
        if lists[kind].shape[1]
      }
      for i, n in enumerate(names):
        m, p = self.members[n], prepared["tables"][n]
        g, rows, count = sharding.replicate((grads[n], p["rows"], p.get("count")), self.mesh)
        g = base.unpool(g, count, rows["ids"].shape[1])
        ex = {
          kind: self._window(
            padded[kind][0], lists[f"{kind}_off"], i, caps[kind][i], m, padded[kind][1]
          )
          for kind in padded
        }
        out[n], ev_now, ev_next = m.apply(state[n], rows, g, ex.get("now"), ex.get("next"))
        victims["now"].append(ev_now)
        victims["next"].append(ev_next)
      writes = []
      for kind, b in zip(("now", "next"), back):
        if lists[kind].shape[1]:
          off, parts = lists[f"{kind}_off"], victims[kind]
          values = parts[0] if len(parts) == 1 else host_table.assemble(parts, off, b.shape[0])
          writes.append((b, off, values, caps[kind]))
      if writes:
        host = self.members[names[0]].host
        new = host.scatter_lists([state[n]["host"] for n in names], writes)
        out.update({n: {**out[n], "host": h} for n, h in zip(names, new)})
    return out

  def _prepare_fast(self, ids: dict, upcoming: list) -> dict | None:
    t0 = time.perf_counter()
    members = list(self.members.values())
    first = members[0]
    if first.lookahead < 1 or not upcoming:
      return None
    known = self._admitted
    if known is None or not all(ids[n] is a for n, a in zip(self.members, known)):
      for n, m in self.members.items():
        adm = m._planner.admitted
        x = ids[n]
        if adm is None or adm.shape != np.shape(x) or not np.array_equal(adm, x):
          return None  # not admitted ahead: the "now" exchange, per table
    ring = self._layout(ids)
    busy: list[int] = []
    window = upcoming[: first.lookahead]
    for batch in [ids] + window[: (first.lookahead if first.options.policy == "lookahead" else 1)]:
      row = self._ring_row(batch, busy)
      if row is None:
        return None
      busy.append(row)
    cur, ahead, win = busy[0], busy[1], np.array(busy[2:], np.int64)
    f = self._flat
    caps = np.array([p.cache_rows for p in (m._planner for m in members)], np.int64)
    if (ring["n"][ahead] > caps).any():
      return None  # the next batch does not fit: not admitted ahead (as the numpy planner)
    id_off = ring["id_off"]
    sizes = np.diff(id_off)
    unique = first.spec.optimizer.needs_unique
    cap = np.minimum(sizes, caps)
    per = (3 if unique else 1) * sizes + 5 * cap
    out_off = np.concatenate([[0], np.cumsum(per)]).astype(np.int64)
    out = np.empty(int(out_off[-1]), np.int32)
    stats = np.empty((len(members), 3), np.int64)
    t_now = members[0]._planner.version
    policy = hostplan.POLICY_CODES[first.options.policy]
    hostplan.over_tables(
      hostplan.plan_step, len(members), ring["ids"], ring["rows"], ring["n"], id_off, cur,
      ahead, win, f["row_off"], f["slot_off"], f["row_slot"], f["slot_row"], f["last_used"],
      f["dirty"], f["freq"], f["evict_pad"], t_now, policy, unique, out, out_off, cap, stats,
    )  # fmt: skip
    admitted = ring["ids"][ahead].copy()
    self._admitted = tuple(window[0][n] for n in self.members)
    dt = (time.perf_counter() - t0) / len(members)
    result = {}
    now = np.zeros((4, 0), np.int32)
    for i, (name, m) in enumerate(self.members.items()):
      p = m._planner
      shape = ring["shapes"][i]
      n, k, o = int(sizes[i]), int(cap[i]), int(out_off[i])
      prep = {"ids": out[o : o + n].reshape(shape)}
      if unique:
        prep["unique"] = out[o + n : o + 2 * n]
        prep["inverse"] = out[o + 2 * n : o + 3 * n].reshape(shape)
        o += 2 * n
      e = o + n
      hits, loads, back = (int(v) for v in stats[i])
      prep["now"] = now
      prep["next"] = np.ascontiguousarray(out[e : e + 5 * k].reshape(5, k)[:, :loads])
      prep["now_pos"] = np.zeros(shape, np.int32)
      prep[PLANNED] = (False, True)
      prep["version"] = np.asarray(p.version, np.int32)
      p.version += 1
      p.admitted = admitted[id_off[i] : id_off[i + 1]].reshape(ring["shapes"][i])
      if p.lfu is not None:
        p.lfu.accesses += int(ring["n"][cur, i])
        p.lfu.batches += 1
      m._count(
        hits=hits, misses=loads, steps=1, rows_h2d=loads, rows_h2d_on_demand=0,
        rows_d2h=back, plan_seconds=dt,
      )  # fmt: skip
      entry = {"rows": prep}
      if m.spec.pooling == "mean":
        entry["count"] = np.sum(np.asarray(ids[name]) >= 0, axis=1).astype(np.int32)
      result[name] = entry
    self.fast_batches += 1
    return result
