"""`offload`: cDLRM. The table and its optimizer state in host memory, a device cache of C rows.

Plan string: `offload(cache_rows=200_000, policy=lru, lookahead=8)`; see `OffloadOptions`.

How a batch flows (cDLRM, Balasubramanian et al., RecSys'21), and what moves when:

  input thread, prepare(k)   the planner (numpy, host; `planner.plan_step` compiled for the
                             steady state of a group) admits batch k+1 into the cache: picks
                             victim slots (LRU / LFU / look-ahead-aware), lists the dirty
                             victims to write back and the missing rows to load ("next"), and
                             remaps batch k's ids to cache slots. It runs ahead of the step.
  step k, lookup             gathers batch k from the cache, and reads from the host arrays,
                             as they came into the step, the rows this step loads: batch k+1's
                             misses ("next", H2D) and, only for a batch the planner did not see
                             coming, batch k's own ("now": looked up from there). One host
                             read per exchange for every array of the tables (rows + optimizer
                             state, one index list). These reads depend on nothing the step
                             computes: on an accelerator they overlap the model.
  step k, update             takes those rows as lookup's residuals (never re-reads the host):
                             "now" victims read from the cache, their slots take the on-demand
                             rows; the row-wise optimizer on batch k's slots; "next" victims
                             read from the updated cache, their slots take the prefetched rows;
                             then ONE write-back (D2H, scatter on the host) of both exchanges'
                             dirty victims, ordered after the step's host reads by an
                             optimization barrier on the reads (write after read on the donated
                             host arrays: no copy of the table, no dependency on compute).

One cache per stack of tables, as FBGEMM's table-batched embeddings (TBE) and TorchRec's fused
tables: the group's tables with the same dim and optimizer ("a stack") keep their caches in ONE
device array, table after table (table i's C_i slots from its first slot, `_slot_off`), so the
step runs a stack's work as one op each, whatever its number of tables: one gather for the
lookup ([B, T, L] slots -> [B, T, L, D], pooled over L: one per bag length), one sparse update
(the tables' batches flattened, every row's positions in its table's order: `dense`'s sums bit
for bit; row-wise Adagrad's mean squared gradient alone is reduced per table, a small kernel
each, as XLA:CPU picks a reduction's order by the array's size), one gather and one scatter
per array for each exchange, one write-back. The planner still plans each table in its own
slots; the group makes them the stack's on the host (the
lists' slots and NEXT_FROM_NOW `OffloadGroup._to_stack`, the batch's ids, unique and
inverse `OffloadGroup._batch`, one input leaf per kind for the stack: each leaf is a slice of
the trainer's input buffer, a kernel apiece). Device kernels of a DLRM step, 26 tables
(benchmarks/memory_tiers.py, XLA:CPU's fusion): 480 with a cache and its kernels per table
(~11 per table more than `dense`, whose 189 are a gather and an update per table), 97 stacked
(predicted H100 step 2.38x -> 0.57x dense's, results/memory_tiers.md);
tests/test_offload_tiers.py pins that 16 tables run as many as 2 (SGD; Adagrad: one more per
table). The host arrays stay one set per table (host computations are no device launches;
split by rows over a mesh per table).

A row loaded for k+1 was not resident at k+1's admission, so step k's update does not touch it
and its host copy is current, except a row the "now" exchange evicts in the same step (resident
before, dirty, needed back by k+1): the planner gives each "next" load its position among
"now"'s write-backs (row NEXT_FROM_NOW of the "next" array) and update takes that row's value
from the evicted cache row instead.

Exchange sizes (`OffloadOptions.exchange`): the group lays every table's exchange in ONE list
per stack (dim, optimizer) and direction, table after table with offsets ("now_off",
"next_off"); one host computation reads each list (every table's rows: each table reads a
static window at its offset, inside the host computation: the list's longest table segment,
bucketed with hysteresis ("now_win" / "next_win" carry it as a shape), not the table's ids
per batch, so the host touches ~11 passes over ~1.1x the list's rows, never O(ids) or O(N):
tests/test_offload_tiers.py, and recgnn.step_model.host_kernels lists them) and one writes
both lists' victims back (`host_table.HostTable.gather_segments` / `scatter_lists`). With
`exchange=bucket` (the default) a list is as long as the group's real misses, rounded up to an
eighth-octave bucket with hysteresis (`cache_plan.Sizer`): host-link bytes follow the hit rate
(tests/test_offload_tiers.py: 1.05-1.09x the missed rows x row bytes at 1%, 5% and 20% caches
for 26 tables, within 1.25x for one) and the step takes one or two shapes over 200 steps of a
26-table stream, since the group's total misses move ~sqrt(26) less than one table's relative
to their size (sized per table, every new combination of the 26 widths was a new step: 33-106
in 200 steps). `fixed` keeps one shape, the sum of min(ids per batch, C) over the tables,
whatever the misses. On a mesh the host arrays are split by rows over the devices and every
device reads the whole list against its share (rows it does not own come back as zeros, a psum
adds them) and sends the whole write-back list: each device's link carries the list's length,
not its 1/n share (measured from the HLO, 4 tables, 8x1 and 2x4: per device exactly what one
device carries on 1x1). Carrying only the share needs the lists split per owner device (a
per-device length, an all-gather of the rows read): not built.

Where the state lives, and why (measured on this CPU, jax 0.10; see tests/test_offload.py):
the host table is a `pinned_host` jax.Array *inside* the state, not a numpy array owned by
the backend. The step's outputs reach the host only through the state: the contract gives
`prepare` no handle on step k's evicted rows, so a numpy table on the input thread could not
receive write-backs without a host callback (a host sync in the step). In the state, the
write-back is an in-place scatter on the donated pinned_host buffer under
`compute_on("device_host")`: no copy of the table (every host read is materialized by an
optimization barrier and the write-back's indices pass through a barrier with those reads, so
each read provably precedes the write; reading and writing a buffer in unrelated order made
XLA copy the whole table, 25 ms for 1M x 16; tests/test_offload_tiers.py checks the compiled
step), the state alone is checkpointable with Orbax, and after `sync` describes the whole
table.
`prepare` returns numpy only: the row indices of host gathers/scatters reach host memory by
a `device_put` inside the step (small int arrays), because a device_put per table on the
input thread cost ~0.8 ms of Python each (26 tables: the input thread fell behind the step).

State (the group's: `OffloadGroup.state_sharding`):
  host:      {table: {"table": float32[N, D], "accum": float32[N] (row-wise Adagrad)}}  pinned_host
  cache:     per stack {"table": float32[C, D], "accum": float32[C]}, C = the sum of its
             tables' cache rows                                                   device
  slot_rows: per stack int32[C], the row of its table in each slot (that table's N = empty)
  version:   int32[T], train batches applied per table; stale: int32[T], updates that ran
             with a plan made for another cache layout (checked by `sync`, which raises).

Eval batches: the trainer runs `lookup` without `update` for them, so a plan that moves rows
would never execute. `prepare(ids, upcoming, train=False)` plans read-only (resident rows from
the cache, the others straight from the host table). If an update ever runs with a plan made
for another layout, `stale` counts it and `sync` raises (never a silent wrong table).

Residuals (lookup -> update): per stack, {"now": {"table": f32[M, D], "accum": f32[M]},
"next": the same for the next batch's rows}, present where that exchange is; every table of
the stack in one list (its rows at its offsets).

Files: options.py (`OffloadOptions`), table.py (`Offload`, one table: its plan, its host
arrays and its memory), group.py (`OffloadGroup`, the registered backend: the state, the
stacked caches and the step, the lists, the host reads and the write-back), cache_plan.py (the
numpy cache planner, its `Exchange` and the list sizing `Sizer`), planner.py (its compiled
kernels).
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
from recgnn.backends.offload.options import OffloadOptions
from recgnn.backends.offload.table import HOST_MEMORIES, Offload

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
