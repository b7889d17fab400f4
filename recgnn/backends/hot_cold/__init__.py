"""`hot_cold`: Hotline / FAE. Popular rows row-sharded over the mesh, the rest in host RAM.

Plan string: `hot_cold(budget=0.05, profile_batches=20, reprofile=0, split=True)`; options in
`HotColdOptions`. One instance per GROUP of tables: an example is popular only when ALL its
ids in the group's tables are hot (FAE's rule), so put the large tables in one hot_cold rule
and the small ones (wholly on the devices anyway) under `dense`.

Why (Adnan et al., ISCA'24 "Hotline"; FAE, VLDB'22): a few rows take most accesses. Those
rows, with their optimizer state, live in one device array per table, split by rows over every
device of the mesh (NamedSharding P(BATCH)); the long tail stays in host RAM (numpy, the
host tier shared with `offload`: recgnn.embeddings.host_tier). A batch is split into a popular
micro-batch (every id hot: computed from device memory only) and a non-popular one (some id
cold: its cold rows came with the batch), so the accelerators work on the popular examples
first.

How a batch flows (no host computation and no host array inside the step):

  input thread, prepare(k)   counts accesses while profiling (recgnn.embeddings.access_counts);
                             maps each id to a hot slot or to the batch's list of distinct
                             cold rows: ONE list for every table of a row layout (dim,
                             optimizer), table after table, padded to a bucketed length
                             (`hot_set.Buckets` over the layout's total); READS the list's
                             rows and their optimizer state from the numpy host tables into
                             the prepared batch ("vals": they reach the devices with the
                             batch's own transfer, ahead of the step), with a ring slot per
                             row whose newest value may still be on the device ("src", below);
                             splits a train batch's examples per device into the popular and
                             the non-popular micro-batch (the popular one's size fixed per hot
                             set, the other the rest: the step compiles a few times per run,
                             not per batch; when the popular size per device rounds to 0 the
                             batch runs whole and the log says why: `micro.off_reason`);
                             when a profile completes, picks the hot set for the byte budget
                             and plans the migration (rows in / out of the hot arrays), the
                             rows joining read from the host tables too ("in_vals").
  step k, lookup             popular micro-batch: hot rows only (a masked gather on each
                             device's shard, a reduce-scatter of the rows: exact, every row
                             has one non-zero term). Non-popular: the same, plus the cold rows
                             the batch brought (the ring's value where "src" says so): the
                             residuals carry them to the update.
  step k, update             ONE sparse update for the whole batch, as `dense` applies it:
                             hot rows on their owner devices, cold rows on the batch's copy
                             (exact: the same adds in the same order as dense's). Every cold
                             row the step touched is written into the device ring ("dst") and
                             returned as the step's output for the host (contract.TO_HOST).
                             Then the migration planned with k: rows leaving the hot set read
                             off the updated hot arrays, written into the ring and returned
                             for the host; rows joining take their value from the ring (this
                             step's cold rows are in it by then: a row cold in k and hot from
                             k + 1 moves its NEW value; or an earlier write-back still in
                             flight) or from "in_vals".
  after the step             `after_update` (main thread, O(1)) hands TO_HOST to the host
                             writer thread, which copies it to the host and writes it into the
                             numpy tables in place, in step order (`host_tier.Writer`).

Ordering (exact under the trainer's run-ahead of `prepare`, PREFETCH batches): every cold row
a train step touches is written back, so "cold in batch k, cold again in k + 1, prepared
before step k ran" is the common case, not a corner. The device ring of recent write-backs
(`host_tier.Recent`, one per row layout, in the state) covers it: a load planned while its
row's write-back may be in flight reads the ring ("src"); a row whose ring entry was
overwritten since is read from the host after the writer applied the step that wrote it
(`Writer.wait`: in practice long done). The ring holds RING_BATCHES (= PREFETCH) steps' worth of
write-backs: the cold list's cap (the sum of min(ids per batch, rows) over the layout's tables)
and, with reprofile, the hot slots a re-pick may empty (not capped at the layout's rows: a
FIFO of write-backs, two steps may each write back most of a small table); with k > 1 steps
per call, at least k - 1 steps' worth: a call's write-backs reach the host after it, so a row
a later step of the call reads again must be in the ring (call_shapes.py). The hot /
cold layout changes only by a migration that runs at the end of the update of the batch whose
`prepare` planned it, and every later batch is prepared for the new layout. `version` in the
state checks that updates run in prepare order (as `offload`); a step's write-back that does
not match what its prepare planned is refused by the writer.

The hot set: the first `profile_batches` train batches are profiled (every row cold
meanwhile); then the most accessed rows that fit the budget are migrated in. FAE samples 5 %
of the input before training: the trainer gives a backend no look at the data before it
runs, so the sample is the head of the (shuffled) stream; `use_profile` takes a profile made
elsewhere (e.g. `profile.profile_sample` over a 5 % sample) instead. `reprofile=N` re-picks
the hot set every N train batches from the accesses counted since the last pick, for drifting
popularity. A checkpoint holds the logical rows (restorable into any "rows" backend, on any
mesh) and the hot set (`extras`, the checkpoint's metadata): `restore_extras` migrates it in
after `import_` (on the host tables and the hot arrays, not by a step), so a resumed run
neither re-profiles nor starts all cold. hotline_kaggle sets `profile_batches` to a share of
an epoch of its data (train rows // batch size).

State {"tables": {table: {"hot": {"table": f32[Ha, D], slot: f32[Ha]}   rows over the mesh
                          "hot_rows": int32[Ha]}}   (the row in each hot slot; N = empty)
       "ring": per row layout {"table": f32[V, D], slot: f32[V]}   recent write-backs
       "version": int32[], "stale": int32[]}
Ha = the hot capacity rounded up to a multiple of the devices; V = the ring's rows
(`_ring_rows`: made at the rows the trainer's train batches need, `expect_batches`; else
[0, ...] until the first train step sizes it from its batch's "ring" shape, a second program),
replicated as the cold rows are. The host tables (numpy, every row, aligned to
base.aligned_rows(N)) are the group's, never state and never an argument of the step; a hot
row's host copy is stale until `sync` writes it back. The ring is not checkpointed: `export`
drains the writer, so the host tables hold every cold row's value.

Why the host reads and writes are outside the step: host computations inside it
(`compute_on("device_host")` gathers and scatters on pinned-host tables) make the launch wait
for each one, and XLA:GPU copies every host table whole into the write-back (pinned -> pinned,
O(rows) per step; docs/architecture.md, "The host tier"). So the reads happen in prepare,
which the input pipeline runs ahead of the step (every batch's cold rows are read ahead), the
write-back is an output applied by a host thread, and a row the step updated and a later
batch reads comes from the ring, across the pipeline's depth. tests/test_host_tier.py reads
the lowered step (CPU and CUDA): no host computation, no host memory, no table-sized tensor.

Limits, and why:
  - The budget is per table (each table's hot array holds `budget` of its rows), not FAE's one
    budget over all tables: the hot arrays' shapes are fixed at init (memory is reported
    before allocating), before any profile exists. `profile.hot_set_for_budget` makes the
    global choice within those capacities.
  - The order "popular first, cold rows meanwhile" is a data dependency, not a schedule: the
    popular micro-batch never reads a cold row (tests/test_hot_cold_tiers.py checks it on the
    step's HLO). With the cold rows an input of the step, there is nothing left to overlap
    inside it: their transfer is the batch's, issued ahead of the step.
  - The ring costs V rows (with optimizer state) of device memory on every device
    (`batch_memory`: the planner and the trainer's budget count it): with a batch of 26 x
    2048 ids and 68-byte rows, 2 x 53k rows, 7.2 MB; reprofile adds 2 x the hot slots.
    A hot set given by `use_profile` after init, without reprofile, may empty more slots in one
    step than the ring holds beyond its cold rows: a row leaving then read within the run-ahead
    is refused by the writer's check ("has not run"), not read stale.
  - The cold list moves each way whole (padding included: within ~1.1x of the cold ids, a
    few lengths per run, tests/test_hot_cold_tiers.py); every device gets it whole (it is
    replicated, as the update on it is).
  - The split is off (batches run whole, logged once per group, then a count) when the popular
    micro-batch size rounds to 0 on the device with fewest popular examples: every device
    runs the same sizes and the popular micro-batch holds popular examples only.

Files, one object per phase, which the front class holds and calls (none reads another's
attributes; docs/architecture.md, "How a backend is composed"): options.py (`HotColdOptions`),
geometry.py (`Geometry`: the frozen layout, capacities, stacks, shardings, memory), hot_set.py
(`HotSet`: the row <-> slot maps, profile, pick and migrations), micro.py (the popular /
non-popular split), host_side.py (`HostTier`: the host tables, a batch's rows read and its
ring slots handed out, the writer, sync / export), prepare.py (`Preparer`: ids -> prepared on
the input thread, stats), call_shapes.py (a call's k batches made one shape: cold lists,
migrations and the split, for k train steps per call), device.py (`DeviceStep`: the step's
lookup, update, ring and migration), state.py (`StateKeeper`: init, import_ / export,
restore, extras); backend.py, the front `HotCold` class. Shared mechanisms live in
recgnn/embeddings (row_sharded, host_tier, host_cache, access_counts, microbatch).
"""

from __future__ import annotations

from recgnn.backends.hot_cold.backend import HotCold
from recgnn.backends.hot_cold.host_side import RING_BATCHES
from recgnn.backends.hot_cold.micro import MARGIN
from recgnn.backends.hot_cold.options import HotColdOptions

__all__ = ["MARGIN", "RING_BATCHES", "HotCold", "HotColdOptions"]
