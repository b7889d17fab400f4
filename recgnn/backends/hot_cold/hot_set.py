"""hot_cold's hot set (host side): each table's row <-> hot slot maps, the access profile that
picks the hot rows for the byte budget, and the migrations (rows in / out of the hot arrays)
a new pick plans.

One concern: which rows are hot, and when that changes (`HotSet`, an object the `HotCold`
front holds: recgnn/backends/hot_cold/backend.py).
"""

from __future__ import annotations

import base64
import dataclasses
import zlib

import numpy as np
from absl import logging

from recgnn.backends.hot_cold.geometry import Geometry
from recgnn.backends.hot_cold.options import HotColdOptions
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


class HotSet:
  """Which rows are hot, and when that changes (host bookkeeping only): each table's row <->
  slot maps (`TableRows`), the profile window, the pick and the migrations it plans.

  `placed`: a state exists (init / import_ / restore ran), so a new pick becomes a migration
  planned with the next train batch rather than the initial hot arrays."""

  def __init__(self, geometry: Geometry, options: HotColdOptions):
    self._g = geometry
    self._o = options
    self.rows: dict[str, TableRows] = {
      name: TableRows(
        spec=spec,
        capacity=geometry.capacity[name],
        alloc=geometry.alloc[name],
        row_slot=np.full(spec.num_rows, -1, np.int32),
        slot_row=np.full(geometry.alloc[name], -1, np.int64),
        profile=profile.AccessProfile(spec.num_rows),
      )
      for name, spec in geometry.specs.items()
    }
    self.placed = False
    self.picked = False  # a hot set has been picked (initial profile done)
    self._since_pick = 0  # train batches counted since the last pick
    self._pending: dict[str, np.ndarray] | None = None  # a hot set to migrate to

  # --------------------------------------------------------------------- lifecycle

  def clear(self) -> None:
    """No row hot (a state imported from the logical rows: profiled again)."""
    for r in self.rows.values():
      r.row_slot[:] = -1
      r.slot_row[:] = -1
    self.picked = False

  def restart(self) -> None:
    """A state was just built or restored: the profile window starts over."""
    self._since_pick, self._pending = 0, None
    for r in self.rows.values():
      r.profile.reset()
    self.placed = True

  def adopt_slots(self, hot_rows: dict[str, np.ndarray]) -> None:
    """The slot maps of a restored state ({table: int64[Ha] its "hot_rows", N = empty})."""
    for name, r in self.rows.items():
      x = hot_rows[name]
      if x.shape[0] != r.alloc:
        raise ValueError(
          f"hot_cold: the state has {x.shape[0]} hot slots for table {name!r}, this "
          f"backend {r.alloc}; restore checkpoints through export / import_ (the logical rows)"
        )
      r.slot_row = np.where(x < r.spec.num_rows, x, -1)
      r.row_slot[:] = -1
      filled = r.slot_row >= 0
      r.row_slot[r.slot_row[filled]] = np.flatnonzero(filled).astype(np.int32)
    self.picked = any((r.slot_row >= 0).any() for r in self.rows.values())

  def saved_fits(self, saved: dict) -> dict[str, np.ndarray] | None:
    """A checkpoint's hot set ({table: `encode_rows` text}) as {table: sorted rows}, or None
    (logged) when it does not fit this backend (another budget, other tables)."""
    rows = {}
    for name, r in self.rows.items():
      x = decode_rows(saved[name]) if name in saved else None
      if x is None or x.size > r.capacity or (x.size and x[-1] >= r.spec.num_rows):
        logging.info("hot_cold: the checkpoint's hot set does not fit table %r: profiling", name)
        return None
      rows[name] = x
    return rows

  def adopted(self, rows: dict[str, np.ndarray]) -> None:
    """A saved hot set was migrated in (`restore_extras`): no profile until the next pick."""
    self.picked = bool(any(x.size for x in rows.values()))
    self._since_pick, self._pending = 0, None

  # --------------------------------------------------------------------- picks

  def use_profile(self, profiles: dict[str, profile.AccessProfile]) -> profile.HotSet:
    """Pick the hot set from a profile made elsewhere (e.g. `profile.profile_sample` over 5 %
    of the training input). Before `init`: init places it. After: the next train batch's
    prepare plans the migration. Ends the initial profiling."""
    chosen = self._choose(profiles)
    if not self.placed:
      for name, r in self.rows.items():
        r.row_slot[:] = -1
        r.slot_row[:] = -1
        rows = chosen.rows[name]
        r.slot_row[: rows.size] = rows
        r.row_slot[rows] = np.arange(rows.size, dtype=np.int32)
    else:
      self._pending = chosen.rows
    self.picked = True
    return chosen

  def _choose(self, profiles) -> profile.HotSet:
    """The hot set of the budget: the most accessed rows per byte, each table capped at its
    hot capacity (profile.hot_set_for_budget)."""
    specs = self._g.specs
    row_bytes = {n: s.row_bytes for n, s in specs.items()}
    caps = {n: r.capacity for n, r in self.rows.items()}
    budget = sum(caps[n] * row_bytes[n] for n in specs)
    return profile.hot_set_for_budget(
      {n: profiles[n] for n in specs}, row_bytes, budget, capacity=caps
    )

  def slot_of(self, name: str, ids: np.ndarray) -> np.ndarray:
    """int64[...] ids of table `name` (PAD = -1) -> int32[...] their hot slots (-1: cold or
    padding), as batches prepared now see them."""
    return np.where(ids >= 0, self.rows[name].row_slot[np.maximum(ids, 0)], -1)

  def hot_set(self) -> dict[str, np.ndarray]:
    """The current hot rows of each table (as prepared batches see them), sorted."""
    return {n: r.hot for n, r in self.rows.items()}

  def fill(self) -> float:
    """Hot rows / the hot arrays' capacity, as later batches are prepared."""
    hot = sum(int((r.slot_row >= 0).sum()) for r in self.rows.values())
    return hot / max(sum(r.capacity for r in self.rows.values()), 1)

  def plan(self, ids, train) -> dict[str, tuple[np.ndarray, ...]]:
    """Count this train batch; when a profile window completes, pick the hot set and plan
    the migration run at the end of this batch's update. -> {table: `migrate`'s tuple}, empty
    when nothing moves (a new hot set: every table's entry)."""
    if not train:
      return {}
    o = self._o
    if self._pending is None and (not self.picked or o.reprofile):
      for name, x in ids.items():
        self.rows[name].profile.add(x)
      self._since_pick += 1
      window = o.reprofile if self.picked else o.profile_batches
      if self._since_pick >= window:
        self._pending = self._choose({n: r.profile for n, r in self.rows.items()}).rows
        self._note_fill(self._pending, window)
        for r in self.rows.values():
          r.profile.reset()
        self._since_pick, self.picked = 0, True
    if self._pending is None:
      return {}
    chosen, self._pending = self._pending, None
    return {name: migrate(self.rows[name], new) for name, new in chosen.items()}

  def _note_fill(self, chosen: dict[str, np.ndarray], window: int) -> None:
    """Log a hot set that fills less of the hot arrays than the budget allows. Only rows the
    profile saw can be picked (a row never accessed has no claim over another), so a window
    of fewer accesses than the budget's rows leaves slots empty: a larger budget then picks
    the same rows and moves the same cold rows (benchmarks/memory_tiers.py's 4-batch profile
    did, at 5% and 20%). `stats()["hot_fill"]` reports it per step."""
    rows = sum(int(x.size) for x in chosen.values())
    cap = sum(r.capacity for r in self.rows.values())
    if rows < cap:
      logging.info(
        "hot_cold: the profile of %d batch(es) saw %d distinct row(s) of the hot set's %d "
        "slots: the hot set holds those (%.0f%% full); a longer profile_batches fills more",
        window, rows, cap, 100 * rows / max(cap, 1),
      )  # fmt: skip

  def pack_migration(self, name, m) -> dict:
    """A migration's lists for the step (`migrate`'s tuple, or None: empty lists)."""
    r = self.rows[name]
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


def migrate(r: TableRows, new: np.ndarray) -> tuple[np.ndarray, ...]:
  """Make `new` (sorted rows) the hot set: rows staying keep their slots. -> (rows in, their
  slots, slots out, the rows leaving them) with the row map updated for the batches after
  this one."""
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
