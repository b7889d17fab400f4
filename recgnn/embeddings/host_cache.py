"""Host-cache bookkeeping shared by the backends that keep rows in host memory behind a device
copy planned on the input thread (offload's cache, hot_cold's hot rows).

The host plans batch k + PREFETCH before the device has run batch k, so every prepared train
batch carries the layout version it was planned for; the step checks it against the state's
and counts mismatches (`advance`), and `check_stale` refuses, at sync / save time, a run in
which a prepared batch was skipped or ran out of order (`StaleCheck`); `Counters` are the
input thread's statistics,
read and reset by `stats()` on the main thread. `octave_bucket` and `ListSizer` size the lists
of rows a step moves over the host link (offload's exchanges, hot_cold's cold rows) by what the
batch needs, in a few shapes.
"""

from __future__ import annotations

import collections
import threading

import jax
import jax.numpy as jnp
import numpy as np


def advance(state: dict, prepared: dict) -> dict:
  """In the step: {"version": int32[...], "stale": int32[...]} after a train batch prepared
  for layout `prepared["version"]` (stale counts the batches planned for another layout;
  a scalar, or one entry per table: offload's group)."""
  ok = state["version"] == prepared["version"]
  return {
    "version": prepared["version"] + 1,
    "stale": state["stale"] + jnp.where(ok, 0, 1).astype(jnp.int32),
  }


def check_stale(state: dict, owner: str, layout: str) -> None:
  """Refuse a state whose updates ran with batches planned for another layout (stale: an
  int32[] or one entry per table, int32[T])."""
  stale = int(np.sum(jax.device_get(state["stale"])))
  if stale:
    raise RuntimeError(
      f"{owner}: {stale} update(s) ran with a batch prepared for another {layout} layout: a "
      "prepared train batch was skipped or ran out of order. Batches that only run lookup "
      "(eval) must be prepared with prepare(ids, upcoming, train=False)."
    )


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


class StaleCheck:
  """A host-cached backend's refusal, at sync / export time, of a state whose updates ran
  with batches prepared for another layout (`check_stale`), naming the backend."""

  def __init__(self, owner: str, layout: str):
    self.owner, self.layout = owner, layout

  def check(self, state: dict) -> None:
    check_stale(state, self.owner, self.layout)


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
  """A host-link list's length over a stream of needs, in few distinct lengths: every new
  length is a new static shape, so the whole jitted train step compiles again (a compile
  costs many steps).

  - every length is the bucket of a need plus `headroom` (0 for lists: their length is the
    host-link bytes; more for windows, whose length costs host touches only);
  - the first need sets the first length; the first after `reset` (the needs change at
    once: a new hot set) too, with at least `reset_headroom`: one sample of the steady needs
    that follow, whose largest then fit the same bucket more often than not (hot_cold on
    dlrm_kaggle: one length where the sample's bucket then the largest's made two). The
    very first need's regime is a warm-up (hot_cold's profile, every id cold; offload starts
    at the cap), where headroom would only be shrunk away (a compile);
  - grow at once when a need does not fit (a list must hold every row it moves);
  - shrink only at decision points, every `patience` calls counted from the first: the
    sizers of every group are called once a step from the same start, so their shrinks fall
    on the same steps and cost one recompile for all the groups instead of one each;
  - shrink to the bucket of the largest of the last `patience` needs (they are the
    headroom) once they are stable (the newer half's largest needs that same bucket), or at
    the second decision point in a row that would shrink (a slow drift still shrinks, every
    2 x patience). A warming cache whose misses fall for a few steps then shrinks once, to
    the length that holds, instead of down every bucket on the way (one compile each);
    `slack`: only when that saves more than this fraction of the length (0: any bucket, the
    bytes follow the needs; windows keep a length that is a little long rather than compile
    again);
  - a length already handed out (compiled) is taken instead of a new one when it holds the
    need and is at most one bucket longer.

  start_at_cap: the first length is `cap` (offload: the first steps, whose cold cache misses
  most, keep one shape) instead of the first need's. `sizes`: every length handed out (the
  step's shapes, for tests and stats)."""

  def __init__(
    self,
    patience: int = 16,
    start_at_cap: bool = False,
    headroom: float = 0.0,
    reset_headroom: float = 1 / 16,
    slack: float = 0.0,
  ):
    self.patience = patience
    self.start_at_cap = start_at_cap
    self.headroom = headroom
    self.reset_headroom = max(headroom, reset_headroom)
    self.slack = slack
    self.width: int | None = None  # None: nothing sized yet (or reset)
    self._needs: collections.deque = collections.deque(maxlen=patience)  # the latest needs
    self._calls = 0  # the clock of the decision points (never reset: groups stay aligned)
    self._wanted = False  # the last decision point would have shrunk but the needs fell
    self._reset = False  # the length was forgotten by `reset`
    self.sizes: set[int] = set()

  def reset(self) -> None:
    """Forget the length and the needs (they change at once, e.g. a new hot set)."""
    self.width, self._wanted, self._reset = None, False, True
    self._needs.clear()

  def _fit(self, need: int, cap: int, headroom: float, below: int | None = None) -> int:
    """The length for `need` with `headroom`, at most `cap`: a bucket, or the shortest
    length handed out already (compiled: no new shape), shorter than `below`, that holds
    `need` and is at most one bucket longer."""
    b = min(octave_bucket(need + int(need * headroom)), cap)
    top = octave_bucket(b + 1) if below is None else min(octave_bucket(b + 1), below - 1)
    known = [s for s in self.sizes if octave_bucket(need) <= s <= top]
    return min(min(known, default=b), cap)

  def tick(self) -> bool:
    """A step that sizes nothing here (the clock of the decision points advances, so it
    stays aligned with the other sizers'). -> whether it is a decision point."""
    self._calls += 1
    return self._calls % self.patience == 0

  def __call__(self, need: int, cap: int, tick: bool = True) -> int:
    """The length for a list of `need` entries, at most `cap` (the longest useful list).
    tick=False: a second list sized in the same step (hot_cold's on-demand list beside its
    prefetched one): the clock of the decision points advances once per step."""
    decide = self.tick() if tick else False
    self._needs.append(need)
    if self.width is None:
      first = self.reset_headroom if self._reset else self.headroom
      width = cap if self.start_at_cap else self._fit(need, cap, first)
    else:
      width = min(self.width, cap)
    if min(octave_bucket(need), cap) > width:
      width, self._wanted = self._fit(need, cap, self.headroom), False
    elif decide and len(self._needs) == self.patience:
      needs = list(self._needs)
      target = self._fit(max(needs), cap, self.headroom, below=width)
      newer = self._fit(max(needs[len(needs) // 2 :]), cap, self.headroom, below=width)
      if target >= width * (1 - self.slack):
        self._wanted = False
      elif newer == target or self._wanted:
        width, self._wanted = target, False
      else:
        self._wanted = True
    self.width = width
    self.sizes.add(width)
    return width

  def hold(self, cap: int) -> int:
    """The current length, for a list with nothing planned that keeps the steady shapes (a
    step all the same: the clock advances)."""
    self.tick()
    width = cap if self.width is None else min(self.width, cap)
    self.sizes.add(width)
    return width


def window_sizer(patience: int = 16, start_at_cap: bool = False) -> ListSizer:
  """The sizer of the window a step reads of each table's segment of a list (its longest
  segment): more headroom and a shrink only when it saves a quarter. A window's length costs
  host touches (tables x window), not host-link bytes, and the longest of a few segments
  varies more than their total: sized as the list, it changed bucket (a compile) where the
  list did not."""
  return ListSizer(patience, start_at_cap, headroom=1 / 8, slack=1 / 4)
