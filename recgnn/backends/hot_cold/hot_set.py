"""hot_cold's hot set (host side): each table's row <-> hot slot maps, the access profile that
picks the hot rows for the byte budget, and the migrations (rows in / out of the hot arrays)
a new pick plans.

One concern: which rows are hot, and when that changes. `HotSetPlanning` is one part of the
`HotCold` class (recgnn/backends/hot_cold/__init__.py): it reads the attributes HotCold's
constructor sets (`specs`, `options`, `_rows`, the profile window's `_since_pick`,
`_picked`, `_pending`, `_p0`, `_initialised`).
"""

from __future__ import annotations

import base64
import dataclasses
import zlib

import numpy as np
from absl import logging

from recgnn.embeddings import access_counts as profile
from recgnn.embeddings import base, host_cache

SHRINK_AFTER = 16  # batches between the cold lists' shrink decisions (`host_cache.ListSizer`)


def bucket(n: int) -> int:
  """A cold list's padded length: `host_cache.octave_bucket`, at least 8 (a list is never
  empty: the step's shapes stay put when a batch has no cold row)."""
  return host_cache.octave_bucket(max(int(n), 1))


def Buckets(patience: int) -> host_cache.ListSizer:  # noqa: N802  (a class-like factory)
  """A cold list's length for one table: the shared host-link list sizer (grow at once to a
  batch's need, shrink every `patience` batches to what the latest needs hold). Sized
  by the batch's distinct cold rows, not by its id count: host traffic falls as the hot set
  covers more."""
  return host_cache.ListSizer(patience)


def cold_cap(ids_shape, spec: base.TableSpec) -> int:
  """The most distinct cold rows a batch of ids int[ids_shape] has in a table: its window in
  the stack's cold list (a static shape of the step)."""
  return int(min(int(np.prod(ids_shape)), spec.num_rows))


def encode_rows(rows: np.ndarray) -> str:
  """Sorted row ids -> a short JSON-able string (zlib'd uint32 deltas, base64): a hot set of
  500k rows is a few hundred kB in a checkpoint's metadata."""
  d = np.diff(np.asarray(rows, np.int64), prepend=0).astype(np.uint32)
  return base64.b64encode(zlib.compress(d.tobytes())).decode("ascii")


def decode_rows(text: str) -> np.ndarray:
  """`encode_rows`' inverse: sorted int64 row ids."""
  d = np.frombuffer(zlib.decompress(base64.b64decode(text)), np.uint32)
  return np.cumsum(d.astype(np.int64))


def pad_to(a: np.ndarray, size: int, fill: int) -> np.ndarray:
  """int[n] (n <= size) -> int32[size]: a, then `fill`."""
  out = np.full(size, fill, np.int32)
  out[: a.shape[0]] = a
  return out


@dataclasses.dataclass
class TableRows:
  """Host bookkeeping of one table: the hot slot of each row, the row of each slot."""

  spec: base.TableSpec
  capacity: int  # hot rows the budget allows (H)
  alloc: int  # hot slots allocated (Ha >= H, a multiple of the devices)
  row_slot: np.ndarray  # int32[N], -1 = cold
  slot_row: np.ndarray  # int64[Ha], -1 = empty
  profile: profile.AccessProfile

  @property
  def hot(self) -> np.ndarray:
    """Sorted hot row ids."""
    return np.sort(self.slot_row[self.slot_row >= 0])


class HotSetPlanning:
  """The hot-set half of `HotCold`: profile, pick, migrate (host bookkeeping only)."""

  def use_profile(self, profiles: dict[str, profile.AccessProfile]) -> profile.HotSet:
    """Pick the hot set from a profile made elsewhere (e.g. `profile.profile_sample` over 5 %
    of the training input). Before `init`: init places it. After: the next train batch's
    prepare plans the migration. Ends the initial profiling."""
    chosen = self._choose(profiles)
    if not self._initialised:
      for name, r in self._rows.items():
        r.row_slot[:] = -1
        r.slot_row[:] = -1
        rows = chosen.rows[name]
        r.slot_row[: rows.size] = rows
        r.row_slot[rows] = np.arange(rows.size, dtype=np.int32)
    else:
      self._pending = chosen.rows
    self._picked = True
    return chosen

  def _choose(self, profiles) -> profile.HotSet:
    """The hot set of the budget: the most accessed rows per byte, each table capped at its
    hot capacity (profile.hot_set_for_budget)."""
    row_bytes = {n: s.row_bytes for n, s in self.specs.items()}
    caps = {n: r.capacity for n, r in self._rows.items()}
    budget = sum(caps[n] * row_bytes[n] for n in self.specs)
    return profile.hot_set_for_budget(
      {n: profiles[n] for n in self.specs}, row_bytes, budget, capacity=caps
    )

  def hot_set(self) -> dict[str, np.ndarray]:
    """The current hot rows of each table (as prepared batches see them), sorted."""
    return {n: r.hot for n, r in self._rows.items()}

  def _plan_profile(self, ids, train) -> dict[str, tuple[np.ndarray, np.ndarray] | None]:
    """Count this train batch; when a profile window completes, pick the hot set and plan
    the migration run at the end of this batch's update. -> {table: (rows in, rows out)}."""
    if not train:
      return {}
    if self._pending is None and (not self._picked or self.options.reprofile):
      for name, x in ids.items():
        self._rows[name].profile.add(x)
      self._since_pick += 1
      window = self.options.reprofile if self._picked else self.options.profile_batches
      if self._since_pick >= window:
        self._pending = self._choose({n: r.profile for n, r in self._rows.items()}).rows
        self._note_fill(self._pending, window)
        for r in self._rows.values():
          r.profile.reset()
        self._since_pick, self._picked = 0, True
    if self._pending is None:
      return {}
    chosen, self._pending = self._pending, None
    out = {}
    for name, new in chosen.items():
      out[name] = self._migrate(self._rows[name], new)
    # The popular share changes with the hot set: the first batch prepared for it sets the
    # popular micro-batch size again.
    self._p0 = {}
    return out

  def _note_fill(self, chosen: dict[str, np.ndarray], window: int) -> None:
    """Log a hot set that fills less of the hot arrays than the budget allows. Only rows the
    profile saw can be picked (a row never accessed has no claim over another), so a window
    of fewer accesses than the budget's rows leaves slots empty: a larger budget then picks
    the same rows and moves the same cold rows (benchmarks/memory_tiers.py's 4-batch profile
    did, at 5% and 20%). `stats()["hot_fill"]` reports it per step."""
    rows = sum(int(x.size) for x in chosen.values())
    cap = sum(r.capacity for r in self._rows.values())
    if rows < cap:
      logging.info(
        "hot_cold: the profile of %d batch(es) saw %d distinct row(s) of the hot set's %d "
        "slots: the hot set holds those (%.0f%% full); a longer profile_batches fills more",
        window, rows, cap, 100 * rows / max(cap, 1),
      )  # fmt: skip

  @staticmethod
  def _migrate(r: TableRows, new: np.ndarray) -> tuple[np.ndarray, ...]:
    """Make `new` (sorted rows) the hot set: rows staying keep their slots. -> (rows in,
    their slots, slots out, the rows leaving them) with the row map updated for the batches
    after this one."""
    old_slots = np.flatnonzero(r.slot_row >= 0)
    old_rows = r.slot_row[old_slots]
    stay = np.isin(old_rows, new)
    out_slots = old_slots[~stay]
    r.row_slot[old_rows[~stay]] = -1
    r.slot_row[out_slots] = -1
    incoming = new[r.row_slot[new] < 0]
    free = np.flatnonzero(r.slot_row < 0)[: incoming.size]
    r.slot_row[free] = incoming
    r.row_slot[incoming] = free.astype(np.int32)
    # (the step reads the rows leaving from the state's slot map; the host side needs them
    # for the write-back: the writer puts their values into the host tables)
    return incoming, free, out_slots, old_rows[~stay]

  def _pack_migration(self, name, m) -> dict:
    r = self._rows[name]
    if m is None:
      m = (np.zeros(0, np.int64),) * 3
    incoming, slots_in, slots_out = m[:3]
    # Every migration's lists have the hot capacity's length: one more step shape per run
    # (migrations are rare; an exact-size list would recompile the step at each one).
    k_in = r.alloc if incoming.size else 0
    k_out = r.alloc if slots_out.size else 0
    return {
      # Padding: row 0 is read (in range) and dropped at slot Ha.
      "in_rows": pad_to(incoming, k_in, 0),
      "in_slots": pad_to(slots_in, k_in, r.alloc),
      # Padding slot Ha reads zeros; its row (from hot_rows: none) is dropped by the scatter.
      "out_slots": pad_to(slots_out, k_out, r.alloc),
    }
