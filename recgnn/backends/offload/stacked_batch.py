"""A batch of an offload group's tables made its stacks' (`OffloadGroup.prepare`): one input
leaf per kind for a stack's tables, not one per table (each leaf is a slice of the trainer's
input buffer inside the step, a kernel apiece)."""

from __future__ import annotations

import numpy as np


def _batch_major(x: np.ndarray) -> np.ndarray:  # [T', B, L] -> int32[B, T', L], contiguous
  return np.ascontiguousarray(x.transpose(1, 0, 2), np.int32)


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
      # (np.array of the tables' arrays, [T', B, L], then made batch-major: 7x faster than
      # np.stack(axis=1) of 26 tables, whose cost is per array)
      c, f = rows[idx][:, None, None], first[idx][:, None, None]
      ids = np.array([x["ids"] for x in r])
      # now_pos: positions in the stack's "now" list (its width: not loaded now)
      now, off = lists[stack]["now"].shape[1], lists[stack]["now_off"].astype(np.int64)
      pos, lo, hi = np.array([x["now_pos"] for x in r]), off[idx], off[np.add(idx, 1)]
      lo, hi = lo[:, None, None], hi[:, None, None]
      bag = {
        "ids": _batch_major(np.where(ids < c, ids + f, absent)),
        "now_pos": _batch_major(np.where(pos < hi - lo, pos + lo, now)),
      }
      if needs_unique:
        size = r[0]["ids"].size  # each table's unique: int32[B * L]
        start = u_first + size * np.arange(len(idx))[:, None, None]
        bag["inverse"] = _batch_major(np.array([x["inverse"] for x in r]) + start)
        u = np.array([x["unique"] for x in r])  # [T', U]
        uniques.append(np.where(u < c[:, 0], u + f[:, 0], absent).astype(np.int32).reshape(-1))
        u_first += size * len(idx)
      if mean:  # (tables pooled by sum: a count of 1, never read)
        ones = np.ones(ids.shape[1], np.int32)  # (ids: [T', B, L])
        bag["count"] = np.stack([per[names[i]].get("count", ones) for i in idx], axis=1)
      entry[",".join(map(str, idx))] = bag
    out.append({"bags": entry, **({"unique": np.concatenate(uniques)} if uniques else {})})
  return tuple(out)
