"""hot_cold's host-side preparer (the input thread): a batch's ids -> its prepared pytree.

One concern: the per-batch host work, in stream order. Each id mapped to a hot slot or to
its stack's list of distinct cold rows (bucketed lengths), the profile counted and a new hot
set's migration planned (`HotSet.plan`), the rows read from the host tier (`HostTier.stage`),
the popular / non-popular split (`micro.split`), the prepare-order version, and the counters
`stats` reports. `Preparer` is an object the `HotCold` front holds
(recgnn/backends/hot_cold/backend.py).
"""

from __future__ import annotations

import time
from typing import NamedTuple

import jax
import numpy as np

from recgnn import sharding
from recgnn.backends.hot_cold import hot_set as hot_set_lib
from recgnn.backends.hot_cold.geometry import BATCH_MAJOR, Geometry
from recgnn.backends.hot_cold.host_side import HostTier
from recgnn.backends.hot_cold.hot_set import HotSet, cold_cap
from recgnn.backends.hot_cold.micro import split
from recgnn.backends.hot_cold.options import HotColdOptions
from recgnn.embeddings import base, host_cache, host_tier


class _Classified(NamedTuple):
  """A table's ids of one batch, int64[B, L], split into hot and cold."""

  x: np.ndarray
  valid: np.ndarray  # bool[B, L]: not padding
  slot: np.ndarray  # int[B, L]: hot slot, < 0: not hot
  hot: np.ndarray  # bool[B, L]
  cold: np.ndarray  # bool[B, L]: valid and not hot
  cold_rows: np.ndarray  # int64[U]: the distinct cold rows, ascending
  cold_pos: np.ndarray  # int[sum(cold)]: each cold id's position among them


class Preparer:
  """ids -> prepared, over the group's hot set and host tier.

  off_key: the backend string a batch run whole is counted under (`micro.OFF_LOG`)."""

  def __init__(
    self, geometry: Geometry, options: HotColdOptions, hot: HotSet, host: HostTier, off_key: str
  ):
    self._g, self._o, self._hot, self._host = geometry, options, hot, host
    self._off_key = off_key
    self._version = 0
    self._p0: dict[int, int] = {}  # per-device batch size b -> popular micro-batch size
    self._counters = host_cache.Counters()
    # Each stack's cold-list length, for train and eval batches apart (their steps are
    # separate programs): bucketed, so each takes a few shapes per run.
    grow = hot_set_lib.SHRINK_AFTER
    self._cold_len = {
      t: [hot_set_lib.Buckets(grow) for _ in geometry.stacks] for t in (True, False)
    }
    self.cold_shapes: set[tuple[int, ...]] = set()  # the train steps' cold-list lengths seen

  def restart(self, version: int) -> None:
    """A state was just built or restored: its version; the split's sizes start over."""
    self._version, self._p0 = version, {}

  def restart_split(self) -> None:
    """A new hot set placed outside a step (`restore_extras`): the split's sizes start over."""
    self._p0 = {}

  def prepare(self, ids, train: bool):
    """ids {table: int[B, L]} (PAD = -1) -> the prepared pytree: {"tables": {table:
    {"hot_ids": int32[B, L] (hot slot; Ha: none), "cold_ids": int32[B, L] (position in its
    stack's cold list; W: none), ..., the migration's "in_rows" / "in_slots" / "out_slots"
    and host tier's "in_src" / "in_vals" / "out_dst" (`HostTier.stage`)}}, "cold": per
    stack {"off": int32[T + 1] (each table's segment of the list), "vals": {k: f32[W,
    ...]} (the list's rows read from the host tables here), "src": int32[W] (ring slots),
    train: "dst": int32[W], "ring": int32[0, V] (`HostTier.stage`)}, "micro": the split
    (`micro.split`), "version": int32[]}.

    train=False (eval): read-only; neither counts toward the profile nor migrates.
    """
    t0 = time.perf_counter()
    g, hot_set = self._g, self._hot
    if train and not hot_set.placed:
      raise RuntimeError("hot_cold: call init (or import_ / restore) before prepare(train=True)")
    ids = {n: np.asarray(ids[n]).astype(np.int64) for n in g.specs}
    batch = next(iter(ids.values())).shape[0]
    n_dev = g.devices()
    if batch % n_dev:
      sharding.check_batch(batch, g.mesh)
    per = {name: self._classify(name, x) for name, x in ids.items()}
    example_cold = np.zeros(batch, bool)
    for p in per.values():
      example_cold |= p.cold.any(axis=1)
    own = [self._cold_list(k, names, per, train) for k, names in enumerate(g.stacks)]
    p0s = self._p0  # (the split of a batch planning a migration keeps the old hot set's)
    migrate = self._plan_migration(ids, train)
    out, lengths, ring_rows = self._stage(per, own, migrate, train)
    # Eval batches run whole: the eval step has no model to split, only lookups to merge.
    micro = (
      split(p0s, out["tables"], ~example_cold, n_dev, batch // n_dev, self._off_key)
      if self._o.split and train
      else None
    )
    if micro is not None:
      out["micro"] = micro
    if train:
      self.cold_shapes.add(tuple(lengths))
    version = -1 if not train else self._version
    if train:
      self._version += 1
    out["version"] = np.asarray(version, np.int32)
    stats = dict(
      examples=batch,
      popular=int((~example_cold).sum()),
      hot_ids=sum(int(p.hot.sum()) for p in per.values()),
      ids=sum(int(p.valid.sum()) for p in per.values()),
      plan_seconds=time.perf_counter() - t0,
    )
    if train:
      stats.update(self._train_stats(per, lengths, ring_rows, migrate, micro, batch))
    else:
      stats = {f"eval_{k}": v for k, v in stats.items()}
    self._counters.add(**stats)
    return out

  def _classify(self, name: str, x: np.ndarray) -> _Classified:
    """A table's ids int64[B, L] -> hot slots, cold ids and their distinct rows."""
    valid = x >= 0
    slot = self._hot.slot_of(name, x)
    hot = slot >= 0
    cold = valid & ~hot
    cold_rows, cold_pos = np.unique(x[cold], return_inverse=True)
    return _Classified(x, valid, slot, hot, cold, cold_rows, cold_pos)

  def _cold_list(self, stack: int, names, per: dict, train: bool) -> tuple:
    """A stack's cold list: its distinct cold rows, table after table, padded to a bucketed
    length (`Buckets`: within 12.5 % of the need, grown at once, shrunk after a while): host
    traffic is what the cold ids need, and the step compiles a few times per run. -> (each
    table's rows, offsets int32[T + 1], each table's cap, the padded length)."""
    g = self._g
    segs = [per[n].cold_rows for n in names]
    off = np.cumsum([0] + [x.size for x in segs]).astype(np.int32)
    caps = [cold_cap(per[n].x.shape, g.specs[n]) for n in names]
    # Before the first hot set (the profile) every id is cold, and the phase ends at the
    # pick: one length for it, the batch's ids (as `fixed`), not the few a sizer takes
    # over a phase of a few batches (each a compile; the pick's migration step is one).
    if self._o.cold_list == "fixed" or (train and not self._hot.picked):
      self._cold_len[train][stack].tick()  # (decision points at the same steps as others')
      return segs, off, caps, sum(caps)
    return segs, off, caps, self._cold_len[train][stack](max(int(off[-1]), 1), sum(caps))

  def _plan_migration(self, ids: dict, train: bool) -> dict:
    """The hot set's migration this batch plans ({table: (out, in) rows}; empty: none)."""
    migrate = self._hot.plan(ids, train)
    if migrate:
      # The popular share changes with the hot set: the first batch prepared for it sets the
      # popular micro-batch size again. And it changes every later batch's cold rows: their
      # lists start over (the next batch's need sets the length, instead of waiting out the
      # old hot set's).
      self._p0 = {}
      for s in self._cold_len[True]:
        s.reset()
    return migrate

  def _table_ids(self, name: str, c: _Classified, first: int, length: int, migrate) -> dict:
    """A table's prepared arrays: hot slots, positions in its stack's cold list (from
    `first`; `length` = none), Adagrad's dedup, mean pooling's counts, the migration."""
    alloc, spec = self._g.alloc[name], self._g.specs[name]
    cold_ids = np.full(c.x.shape, length, np.int32)  # positions in the stack's list
    cold_ids[c.cold] = first + c.cold_pos
    t = {"hot_ids": np.where(c.hot, c.slot, alloc).astype(np.int32), "cold_ids": cold_ids}
    if spec.optimizer.needs_unique:
      t["hot_unique"], t["hot_inverse"] = base.dedup(np.where(c.hot, c.slot, -1), alloc)
    if spec.pooling == "mean":
      t["count"] = c.valid.sum(axis=1).astype(np.int32)
    t.update(self._hot.pack_migration(name, migrate.get(name)))
    return t

  def _stage(self, per: dict, own: list, migrate: dict, train: bool):
    """Every table's arrays and each stack's cold list read from the host tier -> ({"tables",
    "cold"}, each stack's list length, the rows the device ring served)."""
    g = self._g
    out = {"tables": {}, "cold": []}
    lengths, writes, ring_rows = [], [], 0
    for stack, names in enumerate(g.stacks):
      segs, off, caps, uc = own[stack]
      lengths.append(uc)
      for i, name in enumerate(names):
        out["tables"][name] = self._table_ids(name, per[name], off[i], uc, migrate)
      lst, w, held = self._host.stage(stack, segs, off, caps, uc, migrate, out["tables"], train)
      out["cold"].append(lst)
      writes.append(w)
      ring_rows += held
    out["tables"] = {n: out["tables"][n] for n in g.specs}
    out["cold"] = tuple(out["cold"])
    if train:
      self._host.plan_writes(writes)
    return out, lengths, ring_rows

  def _train_stats(self, per, lengths, ring_rows, migrate, micro, batch) -> dict:
    """A train batch's counters beyond the eval ones: host traffic, migration, split."""
    cold_rows_n = sum(p.cold_rows.size for p in per.values())
    stats = dict(
      steps=1,
      rows_h2d=cold_rows_n,
      cold_list=sum(lengths),  # the rows moved each way, padding included
      rows_d2h=cold_rows_n,
      bytes_h2d=sum(p.cold_rows.size * self._g.specs[n].row_bytes for n, p in per.items()),
      ring_rows=ring_rows,
      migrated_rows=sum(int(m[1].size) + int(m[0].size) for m in migrate.values()),
    )
    if self._o.split:
      p0 = micro[0]["idx"].shape[0] if micro else 0
      stats.update(micro_popular=p0, micro_cold=batch - p0)
    return stats

  def place_resets(self, prepared, resets):
    """Host, right after `prepare` of the train batch the resets belong to (RowReset: a
    dynamic table in front): where its step holds each reset row. A hot row -> its hot slot,
    reset by `reset_rows` before the lookup (the hot set changes only at the end of a step,
    by the migration this batch planned, which reads the updated hot arrays). A cold row has
    no device slot: its entry in the batch's cold list takes the reset
    (`host_tier.reset_staged`, the ring's value dropped), is trained from there, written
    into the ring and back to the host as any cold row (and a row joining the hot set at
    this step's end takes it from the ring). -> (prepared, {table: {"slots": hot slots
    (Ha: none), "rows"}})."""
    out = {}
    for n, r in resets.items():
      t = prepared["tables"][n]
      alloc = self._g.alloc[n]
      slots = np.full(r["slots"].shape, alloc, np.int32)
      out[n] = {"slots": slots, "rows": r["rows"]}
      real = np.flatnonzero(r["at"] < t["hot_ids"].size)
      if real.size == 0:
        continue
      b, pos = np.unravel_index(r["at"][real], t["hot_ids"].shape)
      hot = t["hot_ids"][b, pos]
      is_hot = hot < alloc
      slots[real[is_hot]] = hot[is_hot]
      lst = prepared["cold"][self._g.stack_of[n][0]]
      init = self._g.specs[n].optimizer.initial_accumulator
      cold_pos = t["cold_ids"][b, pos][~is_hot]
      host_tier.reset_staged(lst["vals"], lst["src"], cold_pos, r["rows"][real[~is_hot]], init)
    return prepared, out

  def prepared_spec(self, prepared):
    batch = sharding.BATCH_SPEC if self._g.split_batch else sharding.REPLICATED
    out = {
      "tables": {
        n: jax.tree.map(lambda _: sharding.REPLICATED, t)
        | {k: batch for k in t if k in BATCH_MAJOR}
        for n, t in prepared["tables"].items()
      },
      "version": sharding.REPLICATED,
      # (the cold rows read from the host and their ring slots: every device gets them whole)
      "cold": jax.tree.map(lambda _: sharding.REPLICATED, prepared["cold"]),
    }
    if "micro" in prepared:
      out["micro"] = jax.tree.map(lambda _: batch, prepared["micro"])
    return out

  def stats(self):
    """Since the last call, per train step: popular_fraction (examples whose ids are all
    hot), hot_coverage (ids served by a hot row), rows / bytes host -> device and back
    (cold rows), the padded cold lists' rows and their distinct lengths so far, the loads
    the device ring served (ring_rows_per_step: rows a recent step wrote back, read ahead
    of its write-back), migrated rows, micro-batch sizes (all devices), plan ms on the
    input thread, hot_fill (hot rows / the hot arrays' capacity, as later batches are
    prepared: below 1 when the profile saw fewer rows than the budget holds,
    `HotSet._note_fill`). Eval batches: eval_popular_fraction, eval_hot_coverage."""
    c = self._counters.take()
    out = {"hot_fill": self._hot.fill()}
    steps = c.get("steps", 0)
    if steps:
      out.update(
        popular_fraction=c["popular"] / max(c["examples"], 1),
        hot_coverage=c["hot_ids"] / max(c["ids"], 1),
        h2d_rows_per_step=c["rows_h2d"] / steps,
        # The cold lists' padded lengths (the rows the batch and the write-back really
        # move) and how many distinct lengths (step shapes) the run has compiled for so far.
        cold_list_rows_per_step=c["cold_list"] / steps,
        cold_list_shapes=len(self.cold_shapes),
        d2h_rows_per_step=c["rows_d2h"] / steps,
        # A cold row comes in and goes back once per step (rows + optimizer state).
        h2d_bytes_per_step=c["bytes_h2d"] / steps,
        d2h_bytes_per_step=c["bytes_h2d"] / steps,
        ring_rows_per_step=c["ring_rows"] / steps,
        migrated_rows_per_step=c["migrated_rows"] / steps,
        plan_ms_per_step=1e3 * c["plan_seconds"] / steps,
        steps=steps,
      )
      if "micro_popular" in c:
        out["micro_popular_size"] = c["micro_popular"] / steps
        out["micro_cold_size"] = c["micro_cold"] / steps
    if c.get("eval_examples"):
      out["eval_popular_fraction"] = c["eval_popular"] / c["eval_examples"]
      out["eval_hot_coverage"] = c["eval_hot_ids"] / max(c["eval_ids"], 1)
    return out
