"""Host-cache bookkeeping shared by the backends that keep rows in host memory behind a device
copy planned on the input thread (offload's cache, hot_cold's hot rows).

The host plans batch k + PREFETCH before the device has run batch k, so every prepared train
batch carries the layout version it was planned for; the step checks it against the state's
and counts mismatches (`advance`), and `check_stale` refuses, at sync / save time, a run in
which a prepared batch was skipped or ran out of order. `flush` writes the device copy back
to the host table (sync before a checkpoint); `Counters` are the input thread's statistics,
read and reset by `stats()` on the main thread. `octave_bucket` and `ListSizer` size the lists
of rows a step moves over the host link (offload's exchanges, hot_cold's cold rows) by what the
batch needs, in a few shapes.
"""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp

from recgnn.embeddings.specs import aligned_rows


def advance(state: dict, prepared: dict) -> dict:
  """In the step: {"version": int32[], "stale": int32[]} after a train batch prepared for
  layout `prepared["version"]` (stale counts the batches planned for another layout)."""
  ok = state["version"] == prepared["version"]
  return {
    "version": prepared["version"] + 1,
    "stale": state["stale"] + jnp.where(ok, 0, 1).astype(jnp.int32),
  }


def check_stale(state: dict, owner: str, layout: str) -> None:
  """Refuse a state whose updates ran with batches planned for another layout."""
  stale = int(jax.device_get(state["stale"]))
  if stale:
    raise RuntimeError(
      f"{owner}: {stale} update(s) ran with a batch prepared for another {layout} layout: a "
      "prepared train batch was skipped or ran out of order. Batches that only run lookup "
      "(eval) must be prepared with prepare(ids, upcoming, train=False)."
    )


def flush(host_table, host: dict, slot_rows: jax.Array, num_rows: int, values: dict) -> dict:
  """Write the device copy back: host[k][slot_rows[s]] = values[k][s] for every occupied slot
  s (slot_rows int32[S], N = empty: past the host arrays, so the scatter drops it). O(S)."""
  rows = jnp.where(slot_rows < num_rows, slot_rows, aligned_rows(num_rows))
  return {**host, **{k: host_table.scatter(host[k], rows, v) for k, v in values.items()}}


class Counters:
  """Statistics bumped on the input thread (`add`), taken and reset by `stats()` (`take`)."""

  def __init__(self):
    self._lock = threading.Lock()
    self._counters: dict[str, float] = {}

  def add(self, **kv) -> None:
    with self._lock:
      for k, v in kv.items():
        self._counters[k] = self._counters.get(k, 0) + v

  def take(self) -> dict[str, float]:
    with self._lock:
      c, self._counters = self._counters, {}
    return c


class Syncer:
  """A host-cached backend's `sync`: refuse a stale state (`check`), then the flush, jitted
  once with the state donated. flush(state) -> state with the device copy written back."""

  def __init__(self, flush, owner: str, layout: str):
    self._flush, self.owner, self.layout = flush, owner, layout
    self._jitted = None

  def check(self, state: dict) -> None:
    check_stale(state, self.owner, self.layout)

  def __call__(self, state: dict) -> dict:
    self.check(state)
    if self._jitted is None:
      self._jitted = jax.jit(self._flush, donate_argnums=0)
    return self._jitted(state)


def octave_bucket(n: int) -> int:
  """Padded length of a list of n rows: 0, 8, or the smallest m * 2**k >= n with m in 8..15
  (eighth-octave steps: at most 12.5% padding, and a stream of needs takes a few lengths)."""
  n = int(n)
  if n <= 0:
    return 0
  if n <= 8:
    return 8
  k = n.bit_length() - 4
  return -(-n // (1 << k)) << k


class ListSizer:
  """Hysteresis over `octave_bucket`: a list's length grows at once to fit a larger need and
  shrinks (to the bucket of the largest need meanwhile) only after `patience` consecutive
  needs fit a smaller bucket. A steady stream keeps one length for long stretches, so the
  step compiles a few times, not per batch.

  start_at_cap: the first length is `cap` (offload: the first steps, whose cold cache misses
  most, keep one shape) instead of the first need's bucket. `sizes`: every length handed out
  (the step's shapes, for tests and stats)."""

  def __init__(self, patience: int = 16, start_at_cap: bool = False):
    self.patience = patience
    self.start_at_cap = start_at_cap
    self.width: int | None = None  # None: nothing sized yet (or reset)
    self._low = 0  # consecutive needs that fit a smaller bucket
    self._peak = 0  # the largest of them
    self.sizes: set[int] = set()

  def reset(self) -> None:
    """Forget the length (the needs change at once, e.g. a new hot set)."""
    self.width, self._low, self._peak = None, 0, 0

  def __call__(self, need: int, cap: int) -> int:
    """The length for a list of `need` entries, at most `cap` (the longest useful list)."""
    b = min(octave_bucket(need), cap)
    if self.width is None:
      width = cap if self.start_at_cap else 0
    else:
      width = min(self.width, cap)
    if b >= width:
      width, self._low, self._peak = b, 0, 0
    else:
      self._low += 1
      self._peak = max(self._peak, need)
      if self._low >= self.patience:
        width, self._low, self._peak = min(octave_bucket(self._peak), cap), 0, 0
    self.width = width
    self.sizes.add(width)
    return width

  def hold(self, cap: int) -> int:
    """The current length, for a list with nothing planned that keeps the steady shapes."""
    width = cap if self.width is None else min(self.width, cap)
    self.sizes.add(width)
    return width
