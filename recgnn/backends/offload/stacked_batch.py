"""A planned batch of an offload group's tables made its stacks' (`OffloadGroup.prepare`): one
input leaf per kind for a stack's tables, not one per table (each leaf is a slice of the
trainer's input buffer inside the step, a kernel apiece), and one exchange list per stack and
direction (`segments`), each table's slots made the stack's."""

from __future__ import annotations

import numpy as np

from recgnn.backends.offload.cache_plan import EVICT_SLOTS, LOAD_SLOTS, NEXT_FROM_NOW
from recgnn.backends.offload.device_step import bag_tables
from recgnn.backends.offload.planned import Flat, Planned

# An absent slot or position in a stack's lists and batch: past every cache and list
# (gathers read zeros, scatters drop it).
ABSENT = np.iinfo(np.int32).max

try:
  from numba import njit
except ImportError:  # pragma: no cover (numba is a dependency: the same loops as Python, slow)

  def njit(*args, **kwargs):
    del args, kwargs
    return lambda f: f


# Why compiled: the numpy version (a where / add / transpose pass per kind over every table's
# [B, L], ~11 passes of int64 temporaries) holds the GIL for most of a batch's stack, on the
# planning thread, which shares the cores and the GIL with the input thread; this pass is one,
# without the GIL (docs/backends/offload.md). (Read from [T', B * L] segments into
# [B, T' * L] with one-hot bags looped without the bag's loop: numba's loop of one iteration
# per element makes the pass several times slower, as does 3-d indexing.)
@njit(nogil=True, cache=True)
def _bag(
  ids, ids_at, pos, pos_at, inv, inv_at, bag, rows, first, lo, hi, now, start, absent,
  out_ids, out_pos, out_inv,
):  # fmt: skip
  """One bag of a stack, batch-major: table t's ids, pos, inv (each its [B, L] flattened)
  at ids[ids_at[t]:], pos[pos_at[t]:], inv[inv_at[t]:] (inv_at empty: no row-wise
  optimizer), bag: L; rows, first, lo, hi, start int64[T'] (each table's cache rows, first
  slot, "now" segment [lo, hi), first position in the stack's unique list). Writes
  out_ids[b, t * L + j] (stack slot; absent: padding), out_pos (position in the "now"
  list; now: not loaded now), out_inv (position in the unique list), each int32[B, T' * L]."""
  t_n, b_n = ids_at.shape[0], out_ids.shape[0]
  has_inv = inv_at.shape[0] > 0
  for b in range(b_n):
    for t in range(t_n):
      c, f, o, w, s = rows[t], first[t], lo[t], hi[t] - lo[t], start[t]
      a, q = ids_at[t] + b * bag, pos_at[t] + b * bag
      if bag == 1:
        x = ids[a]
        out_ids[b, t] = x + f if x < c else absent
        p = pos[q]
        out_pos[b, t] = p + o if p < w else now
        if has_inv:
          out_inv[b, t] = inv[inv_at[t] + b] + s
      else:
        for j in range(bag):
          x = ids[a + j]
          out_ids[b, t * bag + j] = x + f if x < c else absent
          p = pos[q + j]
          out_pos[b, t * bag + j] = p + o if p < w else now
          if has_inv:
            out_inv[b, t * bag + j] = inv[inv_at[t] + b * bag + j] + s


@njit(nogil=True, cache=True)
def _unique(u, u_at, u_n, rows, first, absent, out):
  """out[t * u_n + i] = table t's u[u_at[t] + i] as a stack slot (absent: padding)."""
  for t in range(u_at.shape[0]):
    c, f, a = rows[t], first[t], u_at[t]
    for i in range(u_n):
      x = u[a + i]
      out[t * u_n + i] = x + f if x < c else absent


@njit(nogil=True, cache=True)
def _segments(src, at, n, stride, rows, first, now_n, now_at, absent, lst):
  """A stack's exchange list lst int32[R, W] (R: 4 "now", 5 "next"; filled beforehand),
  its tables' entries one after another from column 0: table t's entry j of row r from
  src[at[t] + r * stride[t] + j], j < n[t], its slots (EVICT_SLOTS, LOAD_SLOTS) made the
  stack's (x < rows[t]: x + first[t]; padding: absent) and NEXT_FROM_NOW made a position
  in the stack's "now" list (x < now_n[t]: x + now_at[t]; else absent)."""
  r_n = lst.shape[0]
  col = 0
  for t in range(at.shape[0]):
    c, f, a, st = rows[t], first[t], at[t], stride[t]
    for j in range(n[t]):
      for r in range(r_n):
        x = src[a + r * st + j]
        if r in (EVICT_SLOTS, LOAD_SLOTS):
          x = x + f if x < c else absent
        elif r == NEXT_FROM_NOW:
          x = x + now_at[t] if x < now_n[t] else absent
        lst[r, col] = x
      col += 1


_NO_AT = np.zeros(0, np.int64)
_NONE = np.zeros((0, 0), np.int32)


def segments(src: Flat, idx, slot_off: np.ndarray, lst: np.ndarray, now_off=None) -> None:
  """The tables idx's exchanges (src: "now" or "next", exact lengths, as each table planned
  them) written into their stack's list lst int32[4|5, W] (W >= their sum; the columns past
  them left as they are): slots (EVICT_SLOTS, LOAD_SLOTS) made the stack's cache's (+ the
  table's first slot, slot_off: the stack's tables' first slots then its rows; its padding
  C to absent) and, given now_off (the "now" list's offsets: a "next" list),
  NEXT_FROM_NOW made positions in the "now" list (absent where the table's "now" has no
  such entry). Why: the step then reads and writes the stack's cache with the whole list
  in one op each, no per-table window."""
  data, at, n, stride = src.part(idx)
  if int(n.sum()) > lst.shape[1]:
    raise ValueError(f"exchange list of width {lst.shape[1]} for {int(n.sum())} entries")
  now_n = np.diff(now_off).astype(np.int64) if now_off is not None else np.zeros(len(idx), np.int64)
  now_at = np.asarray(now_off[:-1], np.int64) if now_off is not None else now_n
  _segments(
    data, at, n, stride, np.diff(slot_off), np.asarray(slot_off[:-1], np.int64), now_n, now_at,
    ABSENT, lst,
  )  # fmt: skip


def stack(stacks, slot_off: list, specs: dict, planned: Planned, lists: list, absent: int):
  """stacks: the group's stacks (table names), slot_off: each stack's tables' first slots,
  planned: the batch's plan (`Planned`), lists: each stack's exchange lists. Every
  table's prepared batch stacked per stack, its slots made the stack's (one
  input leaf per kind for the tables, not one per table: each leaf is a slice of the
  trainer's buffer inside the step, a kernel apiece). Per stack {"bags": {key: {"ids":
  int32[B, T', L] (stack slots, absent: padding), "now_pos": int32[B, T', L] (positions
  in the stack's "now" list; its length: absent), "inverse": int32[B, T', L] (positions
  in "unique"; row-wise optimizers), "count": int32[B, T'] (mean pooling in the stack)}},
  "unique": int32[U] (the tables' distinct slots then absent, table after table; U: the
  sum of B x L)}: one bag per bag length L, key the indices of its tables in the stack
  ("0,1,5": static, the step reads the tables off it)."""
  index = {n: i for i, n in enumerate(planned.names)}
  out = []
  for stack, names in enumerate(stacks):
    first, rows = slot_off[stack], np.diff(slot_off[stack])
    member = np.array([index[n] for n in names], np.int64)
    bags: dict[int, list[int]] = {}
    for i, m in enumerate(member.tolist()):
      bags.setdefault(planned.shapes[m][1], []).append(i)
    needs_unique = specs[names[0]].optimizer.needs_unique
    mean = any(specs[n].pooling == "mean" for n in names)
    entry, uniques, u_first = {}, [], 0
    # In key order: a pytree's dict comes back sorted by key inside the step, where the
    # unique list's blocks are read in that order (`_optimizer_inputs`).
    for idx in sorted(bags.values(), key=lambda idx: ",".join(map(str, idx))):
      mem = member[idx]
      b_n, bag_len = planned.shapes[int(mem[0])]
      t_n = len(idx)
      c, f = rows[idx].astype(np.int64), first[idx].astype(np.int64)
      # now_pos: positions in the stack's "now" list (its width: not loaded now)
      now, off = lists[stack]["now"].shape[1], lists[stack]["now_off"].astype(np.int64)
      size = b_n * bag_len  # each table's unique: int32[B * L]
      start = u_first + size * np.arange(t_n, dtype=np.int64)
      kinds = ("ids", "now_pos") + (("inverse",) if needs_unique else ())
      bag = {k: np.empty((b_n, t_n, bag_len), np.int32) for k in kinds}
      dst = [bag[k].reshape(b_n, -1) if k in bag else _NONE for k in ("ids", "now_pos", "inverse")]
      inv_at = planned.inverse.at[mem] if needs_unique else _NO_AT
      _bag(
        planned.ids.data, planned.ids.at[mem], planned.now_pos.data, planned.now_pos.at[mem],
        planned.inverse.data, inv_at, bag_len, c, f, off[idx], off[np.add(idx, 1)], now,
        start, absent, *dst,
      )  # fmt: skip
      if needs_unique:
        uniques.append(np.empty(size * t_n, np.int32))
        _unique(planned.unique.data, planned.unique.at[mem], size, c, f, absent, uniques[-1])
        u_first += size * t_n
      if mean:  # (tables pooled by sum: a count of 1, never read)
        ones = np.ones(b_n, np.int32)
        bag["count"] = np.stack([planned.count.get(m, ones) for m in mem.tolist()], axis=1)
      entry[",".join(map(str, idx))] = bag
    out.append({"bags": entry, **({"unique": np.concatenate(uniques)} if uniques else {})})
  return tuple(out)


def bag_of(stacks, prepared: dict, table: str) -> tuple[int, int, dict, int]:
  """(its stack, its index in the stack, the stacked bag holding its batch, its index among
  the bag's tables) of `table` in a prepared batch (stacks: the group's names per stack)."""
  stack, i = next((s, names.index(table)) for s, names in enumerate(stacks) if table in names)
  for key, bag in prepared["batch"][stack]["bags"].items():
    tabs = bag_tables(key)
    if i in tabs:
      return stack, i, bag, tabs.index(i)
  raise KeyError(table)
