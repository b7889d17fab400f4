"""`SteadyPlanner`: offload's steady-state planning of a group's train batches by the compiled
kernel (`planner.plan_step`), a batch admitted by the previous step with the next one admitted
now, for every table at once. Everything else (the first batch, one after an eval pass, eval
batches, a batch that does not fit, numba missing) goes through each table's numpy planner
(`Offload.prepare`). Both work on the same planner arrays: this object keeps every table's
row->slot map, slot->row map, recency and dirty bits in flat arrays, and each `Planner` holds
views of its slices. The decisions are the same either way (tests/test_offload.py compares
every prepared array).

Each batch's ids and sorted distinct rows are computed once, into a ring of lookahead + 3
batches (bounded memory), and reused while it moves through the window.
"""

from __future__ import annotations

import time

import numpy as np

from recgnn.backends.offload import planner as hostplan
from recgnn.backends.offload.planned import Flat, Planned
from recgnn.embeddings import base, host_cache


class SteadyPlanner:
  """The compiled planner of one offload group. members: {name: `Offload`} (their planners
  adopted by `adopt`), lookahead: the group's window, counts: where the members' counts
  go (one add per batch for every table, not one per table: each holds a lock)."""

  def __init__(self, members: dict, lookahead: int, counts: host_cache.Counters):
    self.members, self.lookahead = members, lookahead
    self._counts = counts  # per-table counts ({key: int64[T] | scalar}: the group's `stats`)
    self._zeros = np.zeros(0, np.int32)
    self._flat = None
    self._ring = None
    self._admitted = None  # the arrays of the batch the kernel admitted ahead
    self.fast_batches = 0  # batches planned by the compiled kernel (tests, benchmarks)
    self._next_pos = 0  # (`adopt`)

  @property
  def ready(self) -> bool:
    return self._flat is not None

  def forget(self) -> None:
    """The numpy planners admit (or not) the next batch themselves (their admissions do
    not keep the kernel's recency logs: rebuilt by its next call)."""
    self._admitted = None
    if self._flat is not None:
      self._flat["log_ok"][:] = 0

  def adopt(self) -> None:
    """New bookkeeping (init / restore): the members' planners' arrays made slices of flat
    ones (none while a member has no planner yet)."""
    self._flat, self._ring, self._admitted = None, None, None
    members = list(self.members.values())
    if not members or any(m.planner is None for m in members):
      return
    ps = [m.planner for m in members]
    row_off = np.cumsum([0] + [p.num_rows for p in ps]).astype(np.int64)
    slot_off = np.cumsum([0] + [p.cache_rows for p in ps]).astype(np.int64)
    lfu = members[0].options.policy == "lfu"
    windowed = members[0].options.policy == "lookahead"
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
        p.freq = flat["freq"][r]
        p.lfu.use_counts(p.freq)
    self._flat = dict(flat, row_off=row_off, slot_off=slot_off)
    # The recency log of each table and the kernel's scratch (`planner.plan_step`), rebuilt
    # from the state by the kernel's first call (log_ok 0).
    t, c = len(ps), int(slot_off[-1])
    self._flat.update(
      log_off=hostplan.LOG_PER_SLOT * slot_off,
      log_slot=np.empty(hostplan.LOG_PER_SLOT * c, np.int64),
      log_time=np.empty(hostplan.LOG_PER_SLOT * c, np.int64),
      log_head=np.zeros(t, np.int64),
      log_tail=np.zeros(t, np.int64),
      log_ok=np.zeros(t, np.uint8),
      nfree=np.zeros(t, np.int64),
      free_lo=np.zeros(t, np.int64),
      mark=np.full(c, -1, np.int64),
      grp=np.empty(c, np.int64),
      pos=np.empty(c, np.int32),
    )
    self._flat["num_rows"] = np.array([p.num_rows for p in ps], np.int64)
    # Each row's latest window position (`planner.plan_step`'s need; -1: none), and the next
    # stream position a batch gets on its first visit (`_ring_row`).
    # (only the look-ahead policy has a window: empty for the others, never read)
    self._flat["need"] = np.full(int(row_off[-1]) if windowed else 0, -1, np.int32)
    self._next_pos = 0
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
        "pos": np.zeros(r, np.int64),  # each row's batch's stream position
        "stamped": np.zeros(r, bool),  # whether its rows stamped the planner's need
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
    ring["pos"][row], ring["stamped"][row] = self._next_pos, False
    self._next_pos += 1
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

  # -- the steady state

  def plan(self, ids: dict, upcoming: list) -> Planned | None:
    """A train batch planned by the kernel (`Planned`, as `Planned.of_tables` of the
    members' `prepare`), or None where the numpy planners must plan it."""
    t0 = time.perf_counter()
    members = list(self.members.values())
    first = members[0]
    if first.lookahead < 1 or not upcoming or not self._admitted_ahead(ids):
      return None
    ring = self._layout(ids)
    window = upcoming[: first.lookahead]
    busy = self._ring_rows(
      [ids] + window[: (first.lookahead if first.options.policy == "lookahead" else 1)]
    )
    if busy is None:
      return None
    cur, ahead, win = busy[0], busy[1], np.array(busy[2:], np.int64)
    caps = np.array([m.planner.cache_rows for m in members], np.int64)
    if (ring["n"][ahead] > caps).any():
      return None  # the next batch does not fit: not admitted ahead (as the numpy planner)
    sizes = np.diff(ring["id_off"])
    cap = np.minimum(sizes, caps)
    out, out_off, stats = self._run_kernel(ring, cur, ahead, win, cap)
    ring["stamped"][win] = True
    self._admitted = tuple(window[0][n] for n in self.members)
    version = self._advance_planners(ring, cur, ahead)
    loads = stats[:, 1]
    self._counts.add(
      hits=stats[:, 0], misses=loads, steps=1, rows_h2d=loads, rows_d2h=stats[:, 2],
      plan_seconds=(time.perf_counter() - t0) / len(members),
    )  # fmt: skip
    self.fast_batches += 1
    return self._planned(ids, ring["shapes"], out, out_off[:-1], sizes, cap, loads, version)

  def _admitted_ahead(self, ids: dict) -> bool:
    """Whether every table's ids of this batch are the ones admitted ahead (else: the "now"
    exchange, per table, by the numpy planners)."""
    known = self._admitted
    if known is not None and all(ids[n] is a for n, a in zip(self.members, known)):
      return True
    for n, m in self.members.items():
      adm = m.planner.admitted
      x = ids[n]
      if adm is None or adm.shape != np.shape(x) or not np.array_equal(adm, x):
        return False
    return True

  def _ring_rows(self, batches: list) -> list[int] | None:
    """The ring rows of `batches` (this one, the next, the window), or None where one has
    none."""
    busy: list[int] = []
    for batch in batches:
      row = self._ring_row(batch, busy)
      if row is None:
        return None
      busy.append(row)
    return busy

  def _run_kernel(self, ring: dict, cur: int, ahead: int, win: np.ndarray, cap: np.ndarray):
    """`planner.plan_step` over every member -> (out int32[...]: each table's segment of
    ids / unique / inverse and its "next" exchange, out_off int64[T + 1], stats
    int64[T, 3]: hits, loads, write-backs)."""
    members = list(self.members.values())
    first, f = members[0], self._flat
    id_off = ring["id_off"]
    sizes = np.diff(id_off)
    unique = first.spec.optimizer.needs_unique
    per = (3 if unique else 1) * sizes + 5 * cap
    out_off = np.concatenate([[0], np.cumsum(per)]).astype(np.int64)
    out = np.empty(int(out_off[-1]), np.int32)
    stats = np.empty((len(members), 3), np.int64)
    t_now = first.planner.version
    policy = hostplan.POLICY_CODES[first.options.policy]
    hostplan.over_tables(
      hostplan.plan_step, len(members), ring["ids"], ring["rows"], ring["n"], id_off, cur,
      ahead, win, ring["pos"][win], ~ring["stamped"][win], f["need"], f["row_off"],
      f["slot_off"], f["row_slot"], f["slot_row"], f["last_used"], f["dirty"], f["freq"],
      f["log_off"], f["log_slot"], f["log_time"], f["log_head"], f["log_tail"], f["log_ok"],
      f["nfree"], f["free_lo"], f["mark"], f["grp"], f["pos"], f["evict_pad"], t_now, policy,
      unique, out, out_off, cap, stats,
    )  # fmt: skip
    return out, out_off, stats

  def _advance_planners(self, ring: dict, cur: int, ahead: int) -> np.ndarray:
    """Each member's planner one version on, the next batch admitted, LFU's accesses
    counted -> the versions this batch was planned at, int32[T]."""
    # (a loop of Python ints per table, the planners' own fields)
    id_off = ring["id_off"]
    admitted = ring["ids"][ahead].copy()
    version = np.empty(len(self.members), np.int32)
    for i, m in enumerate(self.members.values()):
      p = m.planner
      version[i] = p.version
      p.version += 1
      p.admitted = admitted[id_off[i] : id_off[i + 1]].reshape(ring["shapes"][i])
      if p.lfu is not None:
        p.lfu.accesses += int(ring["n"][cur, i])
        p.lfu.batches += 1
    return version

  def _planned(self, ids, shapes, out, at, sizes, cap, loads, version) -> Planned:
    """The batch's `Planned`: every array a segment of `out` (at: each table's first entry),
    no per-table dict."""
    unique = next(iter(self.members.values())).spec.optimizer.needs_unique
    t_n = len(self.members)
    if self._zeros.shape[0] < sizes.max(initial=0):  # now_pos: no "now" exchange
      self._zeros = np.zeros(int(sizes.max()), np.int32)
    zero = np.zeros(t_n, np.int64)
    none = Flat(out, at, zero, zero)
    return Planned(
      names=tuple(self.members),
      shapes=shapes,
      ids=Flat(out, at, sizes, sizes),
      now_pos=Flat(self._zeros, zero, sizes, sizes),
      unique=Flat(out, at + sizes, sizes, sizes) if unique else none,
      inverse=Flat(out, at + 2 * sizes, sizes, sizes) if unique else none,
      # each table's "next" block: 5 rows of cap entries, its first `loads` planned
      lists={"now": Flat(self._zeros[:0], zero, zero, zero),
             "next": Flat(out, at + (3 if unique else 1) * sizes, loads.copy(), cap)},
      exchange_planned=np.tile(np.array([False, True]), (t_n, 1)),
      version=version,
      count={
        i: np.sum(np.asarray(ids[n]) >= 0, axis=1).astype(np.int32)
        for i, (n, m) in enumerate(self.members.items())
        if m.spec.pooling == "mean"
      },
    )  # fmt: skip
