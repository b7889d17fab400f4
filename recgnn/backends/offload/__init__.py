"""`offload`: cDLRM. The table and its optimizer state in host memory, a device cache of C rows.

Plan string: `offload(cache_rows=200_000, policy=lru, lookahead=8)`; see `OffloadOptions`.

How a batch flows (cDLRM, Balasubramanian et al., RecSys'21):

  input thread, prepare(k)   the planner (numpy, host) admits batch k+1 into the cache: picks
                             victim slots (LRU / LFU / look-ahead-aware), lists the dirty
                             victims to write back and the missing rows to load, and remaps
                             batch k's ids to cache slots. It runs ahead of the step.
  step k, lookup             gather from the cache (rows of batch k are resident).
  step k, update             row-wise optimizer on the cache slots of batch k; then the
                             exchange for batch k+1: evicted rows -> host table (D2H, scatter
                             on the host), missing rows <- host table (gather on the host,
                             H2D) -> their cache slots.

So the rows a step needs were copied in by the previous step, after its optimizer: the copy
for k+1 overlaps nothing on XLA:CPU but is independent of step k+1's compute, and XLA on an
accelerator runs the host gather and the copies on their own streams. Only a batch the
planner did not see coming (the first, one after an eval pass, or `lookahead=0`) is loaded
on demand inside its own step ("now" exchange: lookup reads those rows straight from the
host table, update inserts them first).

Where the state lives, and why (measured on this CPU, jax 0.10; see tests/test_offload.py):
the host table is a `pinned_host` jax.Array *inside* the state, not a numpy array owned by
the backend. The step's outputs reach the host only through the state: the contract gives
`prepare` no handle on step k's evicted rows, so a numpy table on the input thread could not
receive write-backs without a host callback (a host sync in the step). In the state, the
write-back is an in-place scatter on the donated pinned_host buffer under
`compute_on("device_host")`: no copy of the table (the exchange is ordered read-cache ->
write-host -> read-host -> write-cache so XLA inserts no defensive table copy; reading and
writing a buffer in unrelated order made XLA copy the whole table, 25 ms for 1M x 16), the
state alone is checkpointable with Orbax, and after `sync` describes the whole table.
`prepare` returns numpy only: the row indices of host gathers/scatters reach host memory by
a `device_put` inside the step (small int arrays), because a device_put per table on the
input thread cost ~0.8 ms of Python each (26 tables: the input thread fell behind the step).

State:
  host:      {"table": float32[N, D], "accum": float32[N] (row-wise Adagrad)}  pinned_host
  cache:     {"table": float32[C, D], "accum": float32[C]}                      device
  slot_rows: int32[C], the row in each slot (N = empty)                          device
  version:   int32[], train batches applied; stale: int32[], updates that ran with a plan
             made for another cache layout (checked by `sync`, which raises).

Eval batches: the trainer runs `lookup` without `update` for them, so a plan that moves rows
would never execute. `prepare(ids, upcoming, train=False)` plans read-only (resident rows from
the cache, the others straight from the host table). If an update ever runs with a plan made
for another layout, `stale` counts it and `sync` raises (never a silent wrong table).

Files: table.py (`Offload`, one table), group.py (`OffloadGroup`, the registered backend),
cache_plan.py (the numpy cache planner and its `Exchange`), planner.py (its compiled kernels).
"""

from recgnn.backends.offload import planner
from recgnn.backends.offload.cache_plan import (
  EVICT_ROWS,
  EVICT_SLOTS,
  LOAD_ROWS,
  LOAD_SLOTS,
  NEXT_FROM_NOW,
  POLICIES,
  Exchange,
  Planner,
  Sizer,
  octave_bucket,
  smallest,
)
from recgnn.backends.offload.group import OffloadGroup
from recgnn.backends.offload.table import HOST_MEMORIES, Offload, OffloadOptions

__all__ = [
  "EVICT_ROWS",
  "EVICT_SLOTS",
  "HOST_MEMORIES",
  "LOAD_ROWS",
  "LOAD_SLOTS",
  "NEXT_FROM_NOW",
  "POLICIES",
  "Exchange",
  "Offload",
  "OffloadOptions",
  "OffloadGroup",
  "Planner",
  "Sizer",
  "octave_bucket",
  "planner",
  "smallest",
]
