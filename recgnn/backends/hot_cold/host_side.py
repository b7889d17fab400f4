"""hot_cold's host tier (host side): the cold rows in host RAM (numpy, recgnn.embeddings.
host_tier), read for a batch on the input thread, written back by one writer thread after its
step, and the device ring of recent write-backs that keeps reads ahead of a step exact.

One concern: what moves between the host tables and the step, and in which order (the package
docstring: "How a batch flows", "Ordering"). `HostTier` is an object the `HotCold` front holds
(recgnn/backends/hot_cold/backend.py); the preparer stages a batch's rows through it.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from recgnn.backends.hot_cold.geometry import Geometry
from recgnn.backends.hot_cold.hot_set import cold_cap
from recgnn.embeddings import base, host_tier

ABSENT = host_tier.ABSENT

# The device ring of recent write-backs (`host_tier.Recent`, one per stack) holds this many
# times what one train step writes back at most: its cold list's cap (the sum of min(ids per
# batch, rows) over the stack's tables) and, with reprofile, the hot slots a re-pick may
# empty. The input thread prepares PREFETCH batches ahead of the step (`inputs.run_ahead`),
# so the write-backs of every step not run when a batch is prepared are in it. With k > 1
# steps per call it holds the write-backs of a call's k - 1 earlier steps too
# (`host_tier.call_ring_steps`).
RING_BATCHES = base.PREFETCH


class HostTier:
  """hot_cold's host tier: every row in host RAM (numpy, in `specs` order, `host_tier.
  HostRows`), read on the input thread, written by one writer thread; per stack, the ring of
  recent write-backs (rows numbered table after table: `Geometry.row_base`); the write-backs
  planned for steps not yet handed over (`host_tier.Outbox`). Staging a batch's rows, the
  writer, sync / export.

  reprofile: the hot set is re-picked while training, so the ring also holds the hot slots a
  re-pick may empty. steps_per_call: `Layout.steps_per_call` (the ring covers a call)."""

  def __init__(self, geometry: Geometry, reprofile: bool, steps_per_call: int = 1):
    self._g = geometry
    self._reprofile = reprofile
    self._steps_per_call = steps_per_call
    self._host = host_tier.HostRows(geometry.owner)
    self._recent: list[host_tier.Recent] = []
    self._outbox = host_tier.Outbox()
    self._written = 0  # the writer's jobs handed over before the last init / restore
    self._expected: list[int] | None = None  # per stack, the ring's rows (`expect`)
    self._sized: list[bool] = []  # per stack, a train batch sized the ring since `adopt`

  def _ring_rows(self, caps: Sequence[int], names) -> int:
    """The ring's rows for a stack whose tables' cold caps (min(ids per batch, rows)) are
    `caps`: RING_BATCHES steps' write-backs (their cold rows, and with reprofile the hot
    slots a re-pick may empty). Not capped at the stack's rows: the ring is a FIFO of
    write-backs, not a map of rows, so two steps writing back most of a small table's rows
    each fill twice its rows before the older is on the host. With k > 1 steps per call, at
    least a call's k - 1 earlier steps' write-backs (`host_tier.call_ring_steps`)."""
    out = sum(self._g.alloc[n] for n in names) if self._reprofile else 0
    steps = host_tier.call_ring_steps(self._steps_per_call, RING_BATCHES)
    return int(steps * (sum(caps) + out))

  def _stack_caps(self, ids_shapes) -> list[list[int] | None]:
    """Per stack, its tables' cold caps for train ids shaped `ids_shapes` (None: a table of
    the stack is not in it)."""
    specs = self._g.specs
    return [
      [cold_cap(ids_shapes[n], specs[n]) for n in names]
      if all(n in ids_shapes for n in names) else None
      for names in self._g.stacks
    ]  # fmt: skip

  def expect(self, ids_shapes) -> None:
    """The rings of states built or restored from now on are made at the rows train ids
    shaped `ids_shapes` need (`ring_rows`), not at zero rows (`Backend.expect_batches`)."""
    caps = self._stack_caps(ids_shapes)
    self._expected = [
      0 if c is None else self._ring_rows(c, names) for c, names in zip(caps, self._g.stacks)
    ]

  def ring_rows(self, stack: int) -> int:
    """Rows of `stack`'s ring in a state built or restored now: `expect`'s, or 0 (the first
    train step then sizes it from its batch's "ring" shape)."""
    return self._expected[stack] if self._expected else 0

  def batch_memory(self, ids_shapes):
    """The device ring of recent write-backs (`RING_BATCHES` x a step's most write-backs),
    with its optimizer state, replicated on every device: each
    stack's ring split over its tables by their cold caps."""
    out = {}
    specs = self._g.specs
    for names, caps in zip(self._g.stacks, self._stack_caps(ids_shapes)):
      if caps is None:
        continue
      ring = self._ring_rows(caps, names)
      left = ring
      for i, n in enumerate(names):
        share = left if i == len(names) - 1 else ring * caps[i] // max(sum(caps), 1)
        left -= share
        out[n] = share * specs[n].row_bytes
    return out

  def set(self, host: dict) -> None:
    """Every table's rows ({table: {"table": f32[N', D], slot: f32[N']}}, numpy, N' the
    aligned rows) become the host tables."""
    self._host.set([host[n] for n in self._g.specs])

  def drain(self) -> None:
    """Every write-back handed over applied."""
    self._host.writer.drain()

  def adopt(self) -> None:
    """New host-tier bookkeeping for the state just built or restored: every write-back
    handed over applied, no write-back planned, no ring position held."""
    self._host.writer.drain()
    self._written = self._host.writer.submitted
    self._outbox.clear()
    self._recent = [host_tier.Recent(int(b[-1]), self._steps_per_call) for b in self._g.row_base]
    for stack, recent in enumerate(self._recent):
      recent.resize(self.ring_rows(stack))  # (the state's ring: `StateKeeper._empty_ring`)
    self._sized = [False] * len(self._recent)

  def host_of(self, name: str) -> dict:
    """{k: f32[N', ...]}: table `name`'s host arrays (numpy, written in place)."""
    return self._host.arrays[self._g.index[name]]

  def export(self):
    """The logical rows of a synced state (`sync` wrote every hot row back): copies of the
    host tables, as the writer keeps writing them while a checkpoint saves."""
    self._host.writer.drain()
    out = {}
    for name, spec in self._g.specs.items():
      h = self.host_of(name)
      slots = spec.optimizer.slot_names()
      out[name] = {"rows": h["table"].copy(), **{k: h[k].copy() for k in slots}}
    return out

  def sync(self, state):
    """Every write-back handed over applied, then every hot row written to the host tables
    (O(hot rows), a host read of the hot arrays); the state stays as it is."""
    self._host.writer.drain()
    for name, t in state["tables"].items():
      hot_rows, hot = jax.device_get((t["hot_rows"], t["hot"]))
      filled = hot_rows < self._g.specs[name].num_rows
      host = self.host_of(name)
      for k, v in host.items():
        v[hot_rows[filled]] = hot[k][filled]
    return state

  def tables(self, state):
    self._host.writer.drain()
    out = {}
    for name, t in state["tables"].items():
      n = self._g.specs[name].num_rows
      table = self.host_of(name)["table"][:n].copy()
      hot_rows, hot = jax.device_get((t["hot_rows"], t["hot"]["table"]))
      filled = hot_rows < n
      table[hot_rows[filled]] = hot[filled]
      out[name] = table
    return out

  def host_write_seconds(self) -> float:
    """Seconds the host writer spent copying rows to the host and writing them back (not its
    waits for the steps), since this group was built; after every write-back handed over."""
    self._host.writer.drain()
    return self._host.write_seconds

  def after_update(self, state, to_host=None, steps=1):
    """The step's rows for the host (TO_HOST: per stack {"cold": the updated cold rows, in
    list order; "out": {table: the rows leaving the hot set}}) to the writer thread, with
    the rows the prepare of that step listed (`_outbox`): it copies them to the host and
    writes them into the tables in place, in step order. O(1) here: no wait for the step.
    steps = k > 1: a call's output, every leaf [k, ...] (its k steps', in order)."""
    if to_host is None:
      state, to_host = base.split_to_host(state)
    plans = [self._outbox.take() for _ in range(steps)]
    host = self._host

    def apply_call(values):
      for i, writes in enumerate(plans):
        apply(writes, values if steps == 1 else jax.tree.map(lambda v, i=i: v[i], values))

    def apply(writes, values):
      if len(values) != len(writes):
        raise RuntimeError("hot_cold: a step's rows for the host do not match its stacks")
      for w, got in zip(writes, values):
        width = got["cold"]["table"].shape[0]
        # (a migration a call padded from empty comes back, with nothing to write: a subset)
        if not set(w["out"]) <= set(got["out"]) or any(
          p.max(initial=-1) >= width for _, _, p in w["cold"]
        ):
          raise RuntimeError(
            "hot_cold: a step's cold rows do not match the write-back its prepare planned: "
            "a prepared train batch was skipped or ran out of order (batches that only run "
            "lookup, e.g. eval, must be prepared with prepare(ids, train=False))"
          )
        host.scatter(w["cold"], got["cold"])
        for name, ww in w["out"].items():
          host.scatter(ww, got["out"][name])

    host.write_back(to_host, apply_call, steps)
    return state

  def plan_writes(self, writes: list) -> None:
    """A train batch's write-backs ({"cold": ..., "out": ...} per stack, `stage`), for
    `after_update` to hand over with its step's rows."""
    self._outbox.plan(writes)

  def planned_to_host(self, prepared) -> tuple:
    """For drivers that prepare a train batch whose step never runs (prepare-only tests and
    measurements): zeros of the TO_HOST its step would return, to hand to `after_update`,
    so later prepares find every write-back they wait for. The host tables' values are
    then meaningless."""
    out = []
    for names, lst in zip(self._g.stacks, prepared["cold"]):
      cold = {k: np.zeros_like(v) for k, v in lst["vals"].items()}
      gone = {}
      for n in names:
        k_out = prepared["tables"][n]["out_slots"].shape[0]
        if k_out:
          gone[n] = {k: np.zeros((k_out,) + v.shape[1:], v.dtype) for k, v in cold.items()}
      out.append({"cold": cold, "out": gone})
    return tuple(out)

  def stage(self, stack, segs, off, caps, uc, migrate, tables, train):
    """The host tier's part of a stack's batch, on the input thread: the cold list's rows
    read from the host tables, the ring slots where a newer value is held, and (train) the
    ring slots of this step's write-backs; the same for the migration's rows joining and
    leaving the hot set (in `tables`, in place). -> (the list {"off", "vals", "src"[, "dst",
    "ring"]}, the step's write-backs {"cold": [(host index, rows, positions)], "out": {table:
    [...]}} (None for eval), the loads the ring serves).

    Order (the step's): this batch's cold loads see earlier steps' write-backs; its cold
    rows are written into the ring; the rows joining the hot set see those (a row cold in
    this batch and hot from the next takes its new value); the rows leaving are written
    last."""
    names = self._g.stacks[stack]
    index = self._g.index
    tab = np.repeat(np.arange(len(names)), np.diff(off))
    rows = np.concatenate(segs).astype(np.int64)
    first_row = self._g.row_base[stack]
    recent = self._recent[stack] if self._recent else None
    lst = {"off": off}
    need = 0
    src = np.full(uc, ABSENT, np.int32)
    if recent is not None and rows.size:
      src[: rows.size], need = recent.sources(first_row[tab] + rows)
    w = None
    if train:
      if not self._sized[stack]:  # (the first train batch since init / restore sizes the
        # ring; where `expect` guessed its size right, that is no change, and no resize in
        # the step: `DeviceStep.update` resizes a ring of another width)
        recent.resize(self._ring_rows(caps, names))
        self._sized[stack] = True
      lst["ring"] = np.zeros((0, recent.size), np.int32)
      dst = np.full(uc, ABSENT, np.int32)
      dst[: rows.size] = _assign(recent, first_row[tab] + rows)
      lst["dst"] = dst
      pos = np.arange(rows.size)
      w = {
        "cold": [(index[n], rows[tab == i], pos[tab == i]) for i, n in enumerate(names)],
        "out": {},
      }
      for i, n in enumerate(names):  # rows joining: after this step's cold write-back
        m = migrate.get(n)
        t = tables[n]
        k_in = t["in_rows"].shape[0]
        t["in_src"] = np.full(k_in, ABSENT, np.int32)
        if m is not None and m[0].size:
          t["in_src"][: m[0].size], k_need = recent.sources(first_row[i] + m[0])
          need = max(need, k_need)
      for i, n in enumerate(names):  # rows leaving: written last
        m = migrate.get(n)
        t = tables[n]
        t["out_dst"] = np.full(t["out_slots"].shape[0], ABSENT, np.int32)
        if m is not None and m[3].size:
          t["out_dst"][: m[3].size] = self._leaving_slots(recent, first_row[i] + m[3])
          w["out"][n] = [(index[n], m[3], np.arange(m[3].size))]
      if need:  # (before the step count moves on: the call is this step's)
        recent.check_in_call(need, self._g.owner)
      recent.end_step()
    if need:  # a host read of a row written back by a step that may still be in flight
      self._host.writer.wait(self._written + need, f" after {self._written} before")
    lst["vals"] = self._read(names, tab, rows, uc, src)
    lst["src"] = src
    if train:
      for n in names:
        t = tables[n]
        k_in = t["in_rows"].shape[0]
        m = migrate.get(n)
        rows_in = m[0] if m is not None else np.zeros(0, np.int64)
        got = self._read([n], np.zeros(rows_in.size, np.int64), rows_in, k_in, t["in_src"])
        t["in_vals"] = got
    return lst, w, int(np.sum(src != ABSENT))

  def _leaving_slots(self, recent: host_tier.Recent, rows: np.ndarray) -> np.ndarray:
    """Ring slots for the rows a migration moves out of the hot set (`_assign`): they may be
    read cold by batches prepared before the step runs."""
    del self
    return _assign(recent, rows)

  def scatter_leaving(self, name: str, rows: np.ndarray, values: dict) -> None:
    """The rows a migration outside a step moved out of the hot set (`restore_extras`):
    their values ({k: [>= rows, ...]}) into the host tables."""
    for k, v in self.host_of(name).items():
      v[rows] = values[k][: rows.size]

  def _read(self, names, tab, rows, width, src) -> dict:
    """{k: [width, ...]}: the rows (of table names[tab]) read from the host tables, then
    zeros; zeros too where the ring holds the current value (src: the host's may be
    mid-write, and a deterministic batch is easier to test)."""
    if self._host.arrays:
      off = np.searchsorted(tab, np.arange(len(names) + 1)) if tab.size else None
      segs = [
        (self._g.index[n], rows[off[i] : off[i + 1]] if off is not None else rows[:0])
        for i, n in enumerate(names)
      ]
      got = self._host.gather(segs, width)
    else:  # (a batch prepared before init: shapes only)
      spec = self._g.specs[names[0]]
      got = {"table": np.zeros((width, spec.dim), np.float32)}
      got.update({k: np.zeros(width, np.float32) for k in spec.optimizer.slot_names()})
    held = src != ABSENT
    if held.any():
      for v in got.values():
        v[held] = 0
    return got


def _assign(recent: host_tier.Recent, rows: np.ndarray) -> np.ndarray:
  """`Recent.assign`, but with no two of its slots the same: when one step writes back more
  rows than the ring holds, the first ones' slots (overwritten by the later ones, so no
  longer held, `Recent.sources`) are dropped (ABSENT), so one scatter never writes a slot
  twice (XLA leaves the winner unspecified)."""
  dst = recent.assign(rows)
  extra = rows.shape[0] - recent.size
  if extra > 0:
    dst[:extra] = ABSENT
  return dst
