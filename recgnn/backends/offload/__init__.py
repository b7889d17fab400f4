"""`offload`: cDLRM. The table and its optimizer state in host memory, a device cache of C rows.

Plan string: `offload(cache_rows=200_000, policy=lru, lookahead=8)`; see `OffloadOptions`. With
the SSD level: `offload(cache_fraction=0.01, host_cache=0.05, storage='ssd:/mnt/nvme/rows')`.

How a batch flows (cDLRM, Balasubramanian et al., RecSys'21), and what moves when (no host
computation and no host array inside the step; recgnn/embeddings/host_tier.py):

  input thread, prepare(k)   the planner (numpy, host; `planner.plan_step` compiled for the
                             steady state of a group) admits batch k+1 into the cache: picks
                             victim slots (LRU / LFU / look-ahead-aware), lists the dirty
                             victims to write back and the missing rows to load ("next"), and
                             remaps batch k's ids to cache slots. Then it reads the rows step k
                             loads (batch k+1's misses and, for a batch it did not see coming,
                             batch k's own: "now") from the numpy host tables into the
                             prepared batch: they reach the devices with the batch's own
                             transfer, ahead of the step. A row whose write-back may still be
                             in flight (evicted by a step that has not run yet or whose rows
                             have not reached the host) is taken from the device ring of
                             recent write-backs instead (`host_tier.Recent`). In the
                             trainer the planning runs on a thread of its own, up to 2
                             batches ahead of the reads (`prepare_ahead`, recgnn.train.
                             plan_ahead); the reads, the ring and their waits stay here.
  step k, lookup             gathers batch k from the cache ("now" rows from the loaded ones).
  step k, update             "now" victims read from the cache, their slots take the loaded
                             rows; the row-wise optimizer on batch k's slots; "next" victims
                             read from the updated cache, their slots take the prefetched rows;
                             the victims go into the ring and out of the step (TO_HOST).
  after step k               `after_update` hands them to the host writer (a thread: copies
                             them to the host, writes them into the numpy tables in place, in
                             step order).

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
lists' slots and NEXT_FROM_NOW `stacked_batch.segments`, the batch's ids, unique and
inverse `stacked_batch.stack`, one input leaf per kind for the stack: each leaf is a slice of
the trainer's input buffer, a kernel apiece). Stacked, the step's kernel count does not grow with
the table count (the counts: docs/backends/offload.md); tests/test_offload_tiers.py pins that 16
tables run as many as 2 (SGD; Adagrad: one more per table). The host arrays stay one set per table
(numpy, in this process).

A row loaded for k+1 was not resident at k+1's admission, so step k's update does not touch it
and its host copy is current once every earlier write-back landed (or the ring holds it),
except a row the "now" exchange evicts in the same step (resident before, dirty, needed back
by k+1): the planner gives each "next" load its position among "now"'s write-backs (row
NEXT_FROM_NOW of the "next" array) and update takes that row's value from the evicted cache
row instead.

Exchange sizes (`OffloadOptions.exchange`): the group lays every table's exchange in ONE list
per stack (dim, optimizer) and direction, table after table with offsets ("now_off",
"next_off"); prepare reads each list's rows from the host tables (O(the list), on the input
thread) and the writer writes its victims back (O(the list)). With
`exchange=bucket` (the default) a list is as long as the group's real misses, rounded up to an
eighth-octave bucket with hysteresis (`cache_plan.Sizer`): host-link bytes follow the hit rate
(tests/test_offload_tiers.py: 1.05-1.09x the missed rows x row bytes at 1%, 5% and 20% caches
for 26 tables, within 1.25x for one) and the step takes one or two shapes over 200 steps of a
26-table stream, since the group's total misses move ~sqrt(26) less than one table's relative
to their size (sized per table, every new combination of the tables' lengths would be a new
step). `fixed` keeps one shape, the sum of min(ids per batch, C) over the tables,
whatever the misses. On a mesh the cache is replicated: every device receives the list's
rows with its share of the batch (each device's link carries the list's length).

Where the state lives, and why: the host tables are numpy arrays owned by the group
(`host_tier.HostRows`), not arrays of the jitted state: as pinned-host jax arrays read and
written by `compute_on` host computations, XLA:GPU copies every host table whole into the
write-back each step (O(rows)) and each host computation makes the launch wait
(docs/architecture.md, "The host tier"). Read on the input thread and written by a writer
thread, the tables cost the host O(rows moved) per step, never a copy, and the step's inputs
and outputs are O(batch) (tests/test_host_tier.py reads the lowered step, CPU and CUDA).
Checkpoints: `sync` drains the writer and writes the resident cache rows to the tables; `export`
copies them (the writer keeps writing while a checkpoint saves).

State (the group's: `OffloadGroup.state_sharding`):
  cache:     per stack {"table": float32[C, D], "accum": float32[C]}, C = the sum of its
             tables' cache rows                                                   device
  ring:      per stack, the same for V rows: the recent write-backs (V = RING_BATCHES x the
             stack's most loads per batch, at most its rows; made at that size when told
             the train batches' shapes, `expect_batches`, else [0, ...] until the first step)
  slot_rows: per stack int32[C], the row of its table in each slot (that table's N = empty)
  version:   int32[T], train batches applied per table; stale: int32[T], updates that ran
             with a plan made for another cache layout (checked by `sync`, which raises).

Eval batches: the trainer runs `lookup` without `update` for them, so a plan that moves rows
would never execute. `prepare(ids, upcoming, train=False)` plans read-only (resident rows from
the cache, the others straight from the host table). If an update ever runs with a plan made
for another layout, `stale` counts it and `sync` raises (never a silent wrong table).

Residuals (lookup -> update): per stack, {"now": {"table": f32[M, D], "accum": f32[M]},
"next": the same for the next batch's rows}, present where that exchange is: the loaded rows
(from the batch, or the ring where it holds them); every table of the stack in one list (its
rows at its offsets).

The SSD level (`storage='ssd:DIR'`, `host_cache=F`): the host tables become row
files on disk behind a host-RAM cache of F of the rows (disk_rows.py `DiskRows`, the same
interface as `host_tier.HostRows`: nothing above it changes), read ahead over the look-ahead
window; docs/architecture.md "Below the host tier".

Files: options.py (`OffloadOptions`), table.py (`Offload`, one table: its plan, its host
arrays and its memory), group.py (`OffloadGroup`, the registered backend: the state, the
stacked caches, the lists, checkpoints), fast_plan.py (`SteadyPlanner`: the compiled
steady-state planning of the group's batches), device_step.py (`DeviceStep`: the jitted
lookup and update), host_side.py (`HostSide`: the rows read and written back per stack),
cache_plan.py (the numpy cache planner, its `Exchange` and the list sizing `Sizer`),
call_lists.py (a call's k batches made one shape: k train steps per call),
planner.py (its compiled kernels), row_file.py (`RowFile`: one table's rows on disk, verified)
and disk_rows.py (`DiskRows`: the host cache over the row files, the read-ahead); the host
tables in RAM, their writer and the ring's bookkeeping are recgnn/embeddings/host_tier.py's
(shared with hot_cold).
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
from recgnn.backends.offload.table import Offload

__all__ = [
  "EVICT_ROWS",
  "EVICT_SLOTS",
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
