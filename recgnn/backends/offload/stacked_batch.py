"""A batch of an offload group's tables made its stacks' (`OffloadGroup.prepare`): one input
leaf per kind for a stack's tables, not one per table (each leaf is a slice of the trainer's
input buffer inside the step, a kernel apiece)."""

from __future__ import annotations

import numpy as np

try:
  from numba import njit
except ImportError:  # pragma: no cover (numba is a dependency: the same loops as Python, slow)

  def njit(*args, **kwargs):
    del args, kwargs
    return lambda f: f


# Why compiled: the numpy version (a where / add / transpose pass per kind over every table's
# [B, L], ~11 passes of int64 temporaries) held the GIL for most of the 0.75 ms a
# cdlrm_kaggle batch's stack took (26 tables, B 2048, one thread), on the planning thread,
# which shares the cores and the GIL with the input thread (benchmarks/host_path.py); this
# pass takes 0.13 ms without the GIL (the whole stack 0.40 ms). (Indexed [T', B * L] ->
# [B, T' * L] with one-hot bags looped without the bag's loop: numba's loop of one iteration
# per element made the pass 3-5x slower, as did 3-d indexing.)
@njit(nogil=True, cache=True)
def _bag(ids, pos, inv, bag, rows, first, lo, hi, now, start, absent, out_ids, out_pos, out_inv):
  """One bag of a stack, batch-major: ids, pos, inv int32[T', B * L] (each table's [B, L]
  flattened; inv [0, 0] where no row-wise optimizer), bag: L; rows, first, lo, hi, start
  int64[T'] (each table's cache rows, first slot, "now" segment [lo, hi), first position in
  the stack's unique list). Writes out_ids[b, t * L + j] (stack slot; absent: padding),
  out_pos (position in the "now" list; now: not loaded now), out_inv (position in the
  unique list), each int32[B, T' * L]."""
  t_n, b_n = ids.shape[0], out_ids.shape[0]
  has_inv = inv.shape[0] > 0
  for b in range(b_n):
    for t in range(t_n):
      c, f, o, w, s = rows[t], first[t], lo[t], hi[t] - lo[t], start[t]
      if bag == 1:
        x = ids[t, b]
        out_ids[b, t] = x + f if x < c else absent
        p = pos[t, b]
        out_pos[b, t] = p + o if p < w else now
        if has_inv:
          out_inv[b, t] = inv[t, b] + s
      else:
        for j in range(bag):
          x = ids[t, b * bag + j]
          out_ids[b, t * bag + j] = x + f if x < c else absent
          p = pos[t, b * bag + j]
          out_pos[b, t * bag + j] = p + o if p < w else now
          if has_inv:
            out_inv[b, t * bag + j] = inv[t, b * bag + j] + s


@njit(nogil=True, cache=True)
def _unique(u, rows, first, absent, out):
  """out[t * U + i] = u[t, i] as a stack slot (absent: padding): u int32[T', U]."""
  t_n, u_n = u.shape
  for t in range(t_n):
    c, f = rows[t], first[t]
    for i in range(u_n):
      x = u[t, i]
      out[t * u_n + i] = x + f if x < c else absent


_NONE = np.zeros((0, 0), np.int32)


def stack(stacks, slot_off: list, specs: dict, per: dict, lists: list, absent: int) -> tuple:
  """stacks: the group's stacks (table names), slot_off: each stack's tables' first slots,
  per: each table's planned batch (its "rows"), lists: each stack's exchange lists. Every
  table's prepared batch stacked per stack, its slots made the stack's (one
  input leaf per kind for the tables, not one per table: each leaf is a slice of the
  trainer's buffer inside the step, a kernel apiece). Per stack {"bags": {key: {"ids":
  int32[B, T', L] (stack slots, absent: padding), "now_pos": int32[B, T', L] (positions
  in the stack's "now" list; its length: absent), "inverse": int32[B, T', L] (positions
  in "unique"; row-wise optimizers), "count": int32[B, T'] (mean pooling in the stack)}},
  "unique": int32[U] (the tables' distinct slots then absent, table after table; U: the
  sum of B x L)}: one bag per bag length L, key the indices of its tables in the stack
  ("0,1,5": static, the step reads the tables off it)."""
  out = []
  for stack, names in enumerate(stacks):
    first, rows = slot_off[stack], np.diff(slot_off[stack])
    bags: dict[int, list[int]] = {}
    for i, n in enumerate(names):
      bags.setdefault(per[n]["rows"]["ids"].shape[1], []).append(i)
    needs_unique = specs[names[0]].optimizer.needs_unique
    mean = any(specs[n].pooling == "mean" for n in names)
    entry, uniques, u_first = {}, [], 0
    # In key order: a pytree's dict comes back sorted by key inside the step, where the
    # unique list's blocks are read in that order (`_optimizer_inputs`).
    for idx in sorted(bags.values(), key=lambda idx: ",".join(map(str, idx))):
      r = [per[names[i]]["rows"] for i in idx]
      # (np.array of the tables' arrays, [T', B, L]: one copy, whose cost is per array)
      ids = np.array([x["ids"] for x in r], np.int32)
      pos = np.array([x["now_pos"] for x in r], np.int32)
      t_n, b_n, bag_len = ids.shape
      c, f = rows[idx].astype(np.int64), first[idx].astype(np.int64)
      # now_pos: positions in the stack's "now" list (its width: not loaded now)
      now, off = lists[stack]["now"].shape[1], lists[stack]["now_off"].astype(np.int64)
      size = b_n * bag_len  # each table's unique: int32[B * L]
      start = u_first + size * np.arange(t_n, dtype=np.int64)
      inv = np.array([x["inverse"] for x in r], np.int32) if needs_unique else _NONE
      kinds = ("ids", "now_pos") + (("inverse",) if needs_unique else ())
      bag = {k: np.empty((b_n, t_n, bag_len), np.int32) for k in kinds}
      src = [x.reshape(t_n, -1) if x.size else _NONE for x in (ids, pos, inv)]  # [T', B * L]
      dst = [bag[k].reshape(b_n, -1) if k in bag else _NONE for k in ("ids", "now_pos", "inverse")]
      _bag(*src, bag_len, c, f, off[idx], off[np.add(idx, 1)], now, start, absent, *dst)
      if needs_unique:
        u = np.array([x["unique"] for x in r], np.int32)  # [T', U]
        uniques.append(np.empty(u.size, np.int32))
        _unique(u, c, f, absent, uniques[-1])
        u_first += size * len(idx)
      if mean:  # (tables pooled by sum: a count of 1, never read)
        ones = np.ones(b_n, np.int32)
        bag["count"] = np.stack([per[names[i]].get("count", ones) for i in idx], axis=1)
      entry[",".join(map(str, idx))] = bag
    out.append({"bags": entry, **({"unique": np.concatenate(uniques)} if uniques else {})})
  return tuple(out)
