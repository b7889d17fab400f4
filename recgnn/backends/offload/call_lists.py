"""Offload's k train batches of one call made one shape (`OffloadGroup.stack_call`), so the
trainer stacks them into one scan of k steps (`Layout.steps_per_call`).

Each batch was prepared alone, in stream order, exactly as with one step per call (the
planner's decisions, the lists' `Sizer` widths, the rows read, the ring slots): only each
stack's exchange lists ("now", "next") are then padded to the call's longest, with entries
that move nothing (slots and positions ABSENT: gathers read zeros, scatters drop them; rows
zeros; no ring slot), so the k steps compute what k calls of one step compute. A bag's
"now_pos" says "not loaded now" with the "now" list's width: it follows the width.

Why correct across the call's steps, although the host prepared all k batches before the
first of them runs: a row one step evicts and a later step of the call loads again is read
from the device ring of recent write-backs, which the scan carries from step to step and
which is sized for a call (`host_tier.call_ring_steps`; `Recent.check_in_call` refuses a
ring too small rather than reading the stale host copy).
"""

from __future__ import annotations

import numpy as np

from recgnn.embeddings import host_tier


def one_width(prepared: list[dict], fill: tuple, absent: int) -> tuple[list[dict], int]:
  """prepared: the call's train batches (`OffloadGroup.prepare`'s, in order); fill: a list
  column's padding (EVICT_SLOTS, EVICT_ROWS, LOAD_ROWS, LOAD_SLOTS, NEXT_FROM_NOW); absent:
  "no ring slot". -> (the batches with each stack's lists of one width across them, the
  padding rows added: what the host link carries beyond the batches' own lists)."""
  out = [{**p, "lists": list(p["lists"]), "batch": list(p["batch"])} for p in prepared]
  added = 0
  for stack in range(len(prepared[0]["lists"])):
    for kind, f in (("now", fill[:4]), ("next", fill)):
      lists = [p["lists"][stack] for p in out]
      widths = [e[kind].shape[1] for e in lists]
      width = max(widths)
      if min(widths) == width:
        continue
      # A batch whose list was empty has no rows / ring slots for it: their keys and shapes
      # come from one that has.
      full = lists[widths.index(width)]
      column = np.asarray(f, np.int32)[:, None]
      for p, e, have in zip(out, lists, widths):
        if have == width:
          continue
        e = dict(e)
        e[kind] = host_tier.widen(e[kind], width, column, axis=1)
        rows = e.get(f"{kind}_rows") or {k: v[:0] for k, v in full[f"{kind}_rows"].items()}
        e[f"{kind}_rows"] = {k: host_tier.widen(v, width, 0) for k, v in rows.items()}
        for key in (f"{kind}_src", f"{kind}_dst"):
          if key in full:
            e[key] = host_tier.widen(e.get(key, full[key][:0]), width, absent)
        p["lists"][stack] = e
        added += width - have
        if kind == "now":
          p["batch"][stack] = _now_pos_moved(p["batch"][stack], have, width)
  for p in out:
    p["lists"], p["batch"] = tuple(p["lists"]), tuple(p["batch"])
  return out, added


def _now_pos_moved(entry: dict, old: int, new: int) -> dict:
  """A stack's bags with "now_pos" == old (not loaded now: the old "now" width) made new."""
  bags = {
    key: {**bag, "now_pos": np.where(bag["now_pos"] == old, new, bag["now_pos"]).astype(np.int32)}
    for key, bag in entry["bags"].items()
  }
  return {**entry, "bags": bags}
