"""offload's part of a dynamic table's row reuse (the RowReset protocol; recgnn/backends/
dynamic/): where the step of a prepared batch holds each row the batch reuses, on the host.

A reused row is one the batch reads (its new id's first read), so the planner has put it in
the cache for that step, one of two ways:

  resident    in the cache when the step starts: a hit, or loaded by the previous step's
              "next" exchange. Reset in its cache slot by `DeviceStep.reset_rows`, after
              that fill and before the lookup.
  loaded now  in the batch's "now" list: the step itself brings it (from the host rows, or
              the ring of recent write-backs), and its slot still holds the victim the
              update's exchange evicts, so there is no slot to reset before the lookup. The
              loaded row in the prepared batch takes the reset instead (the ring's value
              dropped: `host_tier.reset_staged`) and enters the cache from there.

Either way the step trains the row from its reset, and it goes back to the host as any
trained row does (evicted, into the ring and to the writer): the host's old copy is never
read while the row is resident, and a write-back of it still in flight is the old id's
row, which the cache's copy supersedes (offload's own invariant). No host write of a reset.
"""

from __future__ import annotations

import numpy as np

from recgnn.backends.offload.stacked_batch import ABSENT, bag_of
from recgnn.embeddings import host_tier


def place(stacks, specs: dict, prepared: dict, resets: dict) -> dict:
  """resets {table: {"slots", "rows": f32[R, D], "at": int32[R] (the row's first read in
  the table's ids, flattened; padding past them)}} of a prepared train batch (numpy, its
  "now" rows edited in place) -> {table: {"slots": int32[R] the resident rows' slots in
  their stack's cache (ABSENT: loaded now, or padding), "rows"}} for `reset_rows`. O(R)."""
  out = {}
  for n, r in resets.items():
    slots = np.full(r["slots"].shape, ABSENT, np.int32)
    out[n] = {"slots": slots, "rows": r["rows"]}
    if r["at"].size == 0:  # (an eval batch, or a table that never reuses a row)
      continue
    stack, _, bag, j = bag_of(stacks, prepared, n)
    ids = bag["ids"][:, j]
    real = np.flatnonzero(r["at"] < ids.size)
    if real.size == 0:
      continue
    b, pos = np.unravel_index(r["at"][real], ids.shape)
    lists = prepared["lists"][stack]
    now_pos = bag["now_pos"][:, j][b, pos]
    now = now_pos < lists["now"].shape[1]
    slots[real[~now]] = ids[b, pos][~now]
    if now.any():
      init = specs[n].optimizer.initial_accumulator
      rows = r["rows"][real[now]]
      host_tier.reset_staged(lists["now_rows"], lists["now_src"], now_pos[now], rows, init)
  return out
