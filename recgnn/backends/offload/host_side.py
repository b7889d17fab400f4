"""`HostSide`: offload's host tier: the tables' rows in host RAM, what each step
loads (read on the input thread into the prepared batch) and writes back (by the writer
thread, from the rows the step returns), and the bookkeeping of the device ring of recent
write-backs, per stack of tables. One object with one job, composed into `OffloadGroup`
(which keeps the device state and the step); the mechanisms are recgnn.embeddings.host_tier's.
"""

from __future__ import annotations

import collections

import jax
import numpy as np

from recgnn.backends.offload.cache_plan import EVICT_ROWS, LOAD_ROWS
from recgnn.backends.offload.disk_rows import DiskRows
from recgnn.backends.offload.options import OffloadOptions
from recgnn.embeddings import base, host_cache, host_tier

# The device ring of recent write-backs (`host_tier.Recent`) holds this many times a stack's
# most loads per batch (the sum of min(ids per batch, C) over its tables), at most its rows
# (`ring_rows`): the input thread's run-ahead (PREFETCH batches prepared before the step of
# the first of them runs) when every step evicts all it can, many more steps in practice (the
# misses). A row evicted before that is read from the host, after its write-back landed.
# Device memory: PREFETCH batches of rows (`OffloadGroup.batch_memory`), beside the cache.
# With k > 1 steps per call it holds the write-backs of a call's k - 1 earlier steps too
# (`host_tier.call_ring_steps`), each step's two lists ("now" and "next") at their longest.
RING_BATCHES = base.PREFETCH
LISTS_PER_STEP = 2


class HostSide:
  """The host tier of one offload group.

  stacks: the group's stacks of tables (names; `host_tier.layouts`), specs: {name: TableSpec},
  index: {name: its position in the group} (the host arrays' order), options: the group's
  (storage=ssd:DIR: the rows in row files behind a host cache, `DiskRows`), steps_per_call:
  `Layout.steps_per_call` (the ring covers a call's write-backs)."""

  def __init__(
    self, owner: str, stacks, specs: dict, index: dict[str, int], options=None,
    steps_per_call: int = 1,
  ):  # fmt: skip
    self.owner = owner
    self.steps_per_call = steps_per_call
    self.stacks, self.specs, self.index = stacks, specs, index
    o = options or OffloadOptions(cache_rows=1)
    if o.storage_dir is None:
      self.rows = host_tier.HostRows(owner)
    else:
      order = [specs[n] for n in sorted(index, key=index.get)]
      self.rows = DiskRows(
        owner, order, o.storage_dir, [o.host_cache_rows(s.num_rows) for s in order],
        o.policy, o.io, o.lookahead,
      )  # fmt: skip
    self.disk = isinstance(self.rows, DiskRows)
    self._ahead: collections.deque = collections.deque(maxlen=4 * (o.lookahead + 2))
    # Per stack, each table's first row in the ring's numbering (table after table).
    self.row_base = [
      np.cumsum([0] + [specs[n].num_rows for n in names]).astype(np.int64) for names in stacks
    ]
    self.recent: list[host_tier.Recent] = []
    self.outbox = host_tier.Outbox()
    self.written = 0  # the writer's jobs handed over before the last reset

  # -- the tables

  def set_tables(self, arrays: list[dict]) -> None:
    """Own these host arrays (numpy, in the group's order)."""
    self.rows.set(arrays)

  def table(self, name: str) -> dict:
    """A table's host arrays (numpy; current once `drain` returned; the SSD level: a copy
    read from its row file)."""
    return self.rows.table(self.index[name])

  def stream(self, name: str):
    """The SSD level: a table's logical form read from its row file a chunk at a time
    (`DiskRows.stream`: a checkpoint never holds the whole table)."""
    return self.rows.stream(self.index[name])

  def drain(self) -> None:
    """Every write-back handed over applied."""
    self.rows.writer.drain()

  def reset(self) -> None:
    """New cache bookkeeping (init / restore): no write-back in flight, none planned, the
    rings empty (their rows sized again by the next train batch)."""
    self.drain()
    self.written = self.rows.writer.submitted
    self.outbox.clear()
    self.recent = [host_tier.Recent(int(b[-1]), self.steps_per_call) for b in self.row_base]

  def write_resident(self, name: str, slot_rows: np.ndarray, cache: dict) -> None:
    """table[slot_rows[s]] = cache[s] for every occupied slot (the device copy written back
    before a checkpoint; slot_rows int32[C], N = empty). Call after `drain`."""
    resident = slot_rows < self.specs[name].num_rows
    rows = slot_rows[resident].astype(np.int64)
    self.rows.put(self.index[name], rows, {k: v[resident] for k, v in cache.items()})

  def ring_rows(self, stack: int, cap: int) -> int:
    """The ring's rows for a stack whose most loads per batch are `cap` (the sum of min(ids
    per batch, C) over its tables): RING_BATCHES x cap, at most the stack's rows. (At most
    its cache's rows was tried: the run-ahead's steps then overwrite ring entries a prepared
    batch still needs whenever a step evicts most of a small cache, and the input side must
    wait for the step: what the ring is for.) With k > 1 steps per call, at least a call's
    write-backs (`host_tier.call_ring_steps`), not capped at the stack's rows: the ring is a
    FIFO of write-backs, and the steps of one call may evict the same rows again and again."""
    rows = int(min(RING_BATCHES * cap, self.row_base[stack][-1]))
    if self.steps_per_call > 1:
      steps = host_tier.call_ring_steps(self.steps_per_call, RING_BATCHES, LISTS_PER_STEP)
      rows = max(rows, steps * cap)
    return rows

  # -- the input thread

  def stage(
    self, entry: dict, stack: int, train: bool, cap: int, counters: host_cache.Counters
  ) -> dict | None:
    """The host tier's part of a stack's lists (in place on `entry`), on the input thread:
    per exchange "{kind}_rows" {k: f32[W, ...]}, the rows it loads read from the host tables
    (zeros past the list's entries), and "{kind}_src" int32[W], where the device ring of
    recent write-backs holds a row's current value instead (`host_tier.Recent`; ABSENT: the
    host's is current). A train batch also gets "{kind}_dst" int32[W], the ring slot each
    evicted row is written to (ABSENT: no write-back), and "ring" int32[0, V] (V, the ring's
    rows, as a shape). -> train: the write-backs of the step, per exchange [(table index in
    the host tier, rows, positions in the list)], for the writer (`plan`, `hand_over`)."""
    names = self.stacks[stack]
    tabs = [self.index[n] for n in names]
    first_row = self.row_base[stack]
    num_rows = np.diff(first_row)
    recent = self.recent[stack] if self.recent else None
    if train:
      if recent.size == 0:
        recent.resize(self.ring_rows(stack, cap))
      entry["ring"] = np.zeros((0, recent.size), np.int32)
    kinds = [k for k in ("now", "next") if k in entry and entry[k].shape[1]]
    segs, need = {}, 0
    for kind in kinds:  # where each load comes from, before this step writes back anything
      lst, off = entry[kind], entry[f"{kind}_off"]
      n = int(off[-1])
      tab = np.repeat(np.arange(len(off) - 1), np.diff(off))  # each entry's table
      rows = lst[LOAD_ROWS, :n].astype(np.int64)
      src = np.full(lst.shape[1], host_tier.ABSENT, np.int32)
      if recent is not None and n:
        src[:n], k_need = recent.sources(first_row[tab] + rows)
        need = max(need, k_need)
      segs[kind] = (rows, src, off, tab)
    if need:  # a host read of a row written back by a step that may still be in flight
      if recent is not None:
        recent.check_in_call(need, self.owner)
      self.rows.writer.wait(self.written + need, f" after {self.written} before")
    spec = self.specs[names[0]]
    for kind in kinds:
      rows, src, off, _ = segs[kind]
      width = entry[kind].shape[1]
      if self.rows.loaded():
        got = self.rows.gather(
          [(tabs[i], rows[off[i] : off[i + 1]]) for i in range(len(tabs))], width
        )
      else:  # (an example batch prepared before init: shapes only)
        got = {"table": np.zeros((width, spec.dim), np.float32)}
        got.update({k: np.zeros(width, np.float32) for k in spec.optimizer.slot_names()})
      held = np.flatnonzero(src != host_tier.ABSENT)
      if held.shape[0]:  # (the ring's value wins; the host's may be mid-write: not shipped)
        for v in got.values():
          v[held] = 0
      entry[f"{kind}_rows"], entry[f"{kind}_src"] = got, src
      if train:
        counters.add(ring_rows=int(held.shape[0]))
    if not train:
      return None
    writes = {}
    for kind in kinds:  # ring slots of this step's write-backs, "now"'s then "next"'s
      lst, off, tab = entry[kind], segs[kind][2], segs[kind][3]
      n = int(off[-1])
      evicted = lst[EVICT_ROWS, :n].astype(np.int64)
      pos = np.flatnonzero(evicted < num_rows[tab])  # (padding: past the table)
      dst = np.full(lst.shape[1], host_tier.ABSENT, np.int32)
      dst[pos] = recent.assign(first_row[tab[pos]] + evicted[pos])
      entry[f"{kind}_dst"] = dst
      # Per table its entries (pos is ascending, so its tables are too): slices, no masks.
      cut = np.searchsorted(tab[pos], np.arange(len(tabs) + 1))
      rows = evicted[pos]
      writes[kind] = [
        (tabs[i], rows[cut[i] : cut[i + 1]], pos[cut[i] : cut[i + 1]]) for i in range(len(tabs))
      ]
    recent.end_step()
    return writes

  def read_ahead(self, upcoming, planners: dict) -> None:
    """The SSD level only: hand the batches of the look-ahead window (`DiskRows.window`
    batches after the next one, whose rows this prepare reads) not handed before to the
    prefetch thread: their rows the device cache does not hold (`planners`: {name: its
    `Planner`}), read into the host cache before their prepare needs them."""
    if not self.disk or not self.rows.loaded():
      return
    self.rows.tick()
    for batch in list(upcoming)[1 : 1 + self.rows.window()]:
      first = batch[next(iter(planners))]
      if any(first is seen for seen in self._ahead):
        continue
      self._ahead.append(first)
      job = []
      for name, p in planners.items():
        ids = np.asarray(batch[name]).reshape(-1)
        rows = np.unique(ids[ids >= 0])
        job.append((self.index[name], rows[p.row_slot[rows] < 0]))
      self.rows.prefetch(job)

  def plan(self, writes: list) -> None:
    """A train batch's write-backs (per stack, `stage`'s), for its step's `hand_over`."""
    self.outbox.plan(writes)

  # -- after the step (main thread), then the writer thread

  def hand_over(self, to_host, steps: int = 1) -> None:
    """A step's evicted rows (per stack {"now" / "next": {k: f32[W, ...]}}, in list order)
    to the writer thread with the rows its prepare listed: it copies them to the host and
    writes them into the tables in place, in step order. O(1) here: no wait for the step.
    steps = k > 1: a call's, every leaf [k, W, ...] (its k steps' write-backs, in order)."""
    plans = [self.outbox.take() for _ in range(steps)]
    host = self.rows

    def apply(values):
      for i, writes in enumerate(plans):
        apply_step(writes, values if steps == 1 else jax.tree.map(lambda v, i=i: v[i], values))

    def apply_step(writes, values):
      for stack, kinds in enumerate(writes):
        got = values[stack]
        # (a list a call padded from empty comes back, with nothing to write: a subset)
        if not set(kinds) <= set(got) or any(
          max((p.max(initial=-1) for _, _, p in w), default=-1) >= got[k]["table"].shape[0]
          for k, w in kinds.items()
        ):
          raise RuntimeError(
            "a step's evicted rows do not match the write-back its prepare planned: a "
            "prepared train batch was skipped or ran out of order (batches that only run "
            "lookup, e.g. eval, must be prepared with prepare(ids, upcoming, train=False))"
          )
        for kind, w in kinds.items():
          host.scatter(w, got[kind])

    host.write_back(to_host, apply, steps)


def zero_write_backs(prepared) -> tuple:
  """For drivers that prepare a train batch whose step never runs (prepare-only tests and
  measurements): zeros of the TO_HOST its step would return (each stack's rows every
  exchange of the batch loads, the evicted rows' shapes), to hand to `after_update`, so later
  prepares find every write-back they wait for. The host tables' values are then
  meaningless."""
  return tuple(
    {
      kind: {k: np.zeros_like(v) for k, v in lists[f"{kind}_rows"].items()}
      for kind in ("now", "next")
      if lists[kind].shape[1]
    }
    for lists in prepared["lists"]
  )
