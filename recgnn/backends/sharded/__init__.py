"""`sharded`: model-parallel tables over the mesh's MODEL axis, the embedding all-to-all in
shard_map, optionally carried by a lossy codec (recgnn/embeddings/codecs.py).

DLRM's model parallelism (TorchRec's table-, row- and column-wise sharding), replicated over
DATA (2D parallelism). Within a MODEL group of k devices (the devices sharing a DATA index,
holding k * b consecutive examples of the batch, b per device):

  table-wise   a whole table on one MODEL shard. Its ids go to the owner (all-to-all of ids),
               the owner gathers and pools them for the group's k * b examples, and the
               pooled [b, D] blocks go back to each example's device (the all-to-all).
  row-wise     rows split over MODEL. Ids all-gathered over MODEL; each shard pools the rows
               it owns (zeros elsewhere) and the partial sums go back through the same
               all-to-all, summed by the receiver (a reduce-scatter's bytes).
  column-wise  dims split over MODEL (D / k columns per shard). Ids all-gathered; each shard
               pools its columns; the all-to-all returns each device its examples' columns.

Forward and backward move ONE fused message per step and direction: every table's segment
of every example, [k, b, W] per device (W = Tmax * D + sum of row-wise D + sum of column-wise
D / k, Tmax the most tables one shard owns), so one all-to-all per payload array (one for
f32; codes + scales for int8). Backward is the reverse: pooled gradients to the owners, then
an all-gather over DATA of (ids, gradients) of the group's examples so every replica of a
shard applies the same sparse row-wise update (SGD, row-wise Adagrad): O(B) bytes, never a
table-sized all-reduce. The lookup's routing (each device's routed ids) and, under an
adaptive forward codec, the forward message's statistics reach `update` as the contract's
residuals (as TorchRec keeps them from the forward): nothing is routed or pooled twice.

Files, one object per phase, which the front class holds and calls (none reads another's
attributes; docs/architecture.md, "How a backend is composed"): options.py
(`ShardedOptions`), placement.py (the placement planner), geometry.py (`Geometry`: the frozen
layout: placements, the message's segments, bytes, shardings), wire.py (`Wire`: the codecs,
their adaptive bounds and width re-plans), prepare.py (`Preparer`: ids -> prepared), step.py
(`DeviceStep`: the lookup and the update, the sharding type's input distribution, lookup and
output distribution read as the steps of one step; made of routing.py's `Routing`, ids to
their owners and pooled segments back, and exchange.py's `Exchange`, the all-to-all through a
codec and its f32 fallback), state.py (`StateKeeper`: init, tables, checkpoints), reset.py
(`Reset`: rows put back to given values in the step, a dynamic table's reused rows, each where
the storage holds it); backend.py, the front `Sharded` class.

Placement (`kind`): `auto` (default) puts a table row-wise when it holds more than 1 / k of
the group's bytes (it would unbalance the shards) and table-wise otherwise, assigning the
table-wise ones greedily (largest first) to the shard with the least cost, cost = its
share of the group's bytes + its share of expected lookups (bag length, or an access profile
JSON {table: lookups per example} given as `profile=path`). `table`, `row`, `column` force
one placement for every table of the group (give tables different plan strings to mix).

Codecs: `codec=` for both directions, `fwd_codec=` / `bwd_codec=` to override one; the error-
bounded `eb` takes `eb=<fixed bound>` (or `fwd_eb=`, `bwd_eb=`) or adapts per table and
iteration (`codecs.BoundRule`: `bound=current` from each iteration's own ranges, the
default, or `bound=ema`; `headroom=`; or `bound=rms`, a tolerance rel * each table's RMS,
scheduled by `warmup=` / `ramp=` / `late=`). `widths=2|4|8|16|auto` carries `eb`'s codes
bit-packed in that many bits per segment; `auto` re-plans them every `replan=` steps from
the range / bound ratio the tables reached (`replan`, a host check the trainer calls after
each step: the jitted steps close over `self.codecs` and are rebuilt when a width changes,
a few recompiles per run); `fwd_widths=` / `bwd_widths=` set one direction's. `block=16|32|
64|128|256` adds block-wise steps: each block of that many values (whole vectors of a segment
and destination) steps at its table's step * 2^(-j/4), j a one-byte header chosen from the
block's own range, so the table's bound is a ceiling and a small block (a small gradient, a
short pooled row) is carried relative to itself (codecs.Codec.block; 8 / block bits more per
value). A segment (table) that `eb` cannot carry within its
bound goes again as f32 that step (agreed over the mesh, so every device takes the same
branch); the count of such fallbacks is in the state and in `report`.

State (state.py): {"tw": {"rows": f32[k, R, D], slots: f32[k, R]} (split over MODEL; shard m
holds its tables one after another), "rw": {t: {"rows": f32[S, D] P(MODEL), slots}}, "cw": {t:
{"rows": f32[S, D] P(None, MODEL), slots replicated}}, "codec": {"fwd"|"bwd": BoundRule
state}}.
"""

from __future__ import annotations

from recgnn.backends.sharded.backend import Sharded
from recgnn.backends.sharded.exchange import FALLBACK_SCOPE
from recgnn.backends.sharded.options import ShardedOptions
from recgnn.backends.sharded.placement import KINDS, Placement, plan_placements

__all__ = ["FALLBACK_SCOPE", "KINDS", "Placement", "Sharded", "ShardedOptions", "plan_placements"]
