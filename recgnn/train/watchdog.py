"""A run that stops making progress ends with a report instead of waiting forever.

The trainer marks each unit of work (a train step, an eval batch, a metrics read, a
checkpoint save) with `Watchdog.unit(kind, name)`. A thread checks the unit in progress:

  - the first unit of each kind (it includes compiling) may take up to `first_s`;
  - later ones up to `factor` x the median of that kind's earlier units, and never less
    than `min_s` (a loaded machine slows steps down several times; a hang is forever).

Past the bound the watchdog prints every Python thread's stack (faulthandler), names the
unit and the last finished step, and ends the process with EXIT_HUNG: a hung collective
(e.g. an all-gather that some devices never join) would otherwise hold a job, or CI, until
killed.

SIGTERM: the trainer's handler asks the loop to stop after the step in progress (then it
saves a checkpoint). Python runs that handler only between bytecodes of the main thread, so
a step that never returns would never see it: the C-level handler also writes to a wakeup
fd that this thread watches, and if the loop has not acknowledged the signal within
`grace_s` the process ends (saving nothing: the step's state is not there to save) with
EXIT_SIGTERM, after printing the stacks.
"""

from __future__ import annotations

import collections
import contextlib
import faulthandler
import os
import select
import signal
import statistics
import sys
import threading
import time

EXIT_HUNG = 3
EXIT_SIGTERM = 128 + signal.SIGTERM

#: The watchdog's bounds by their `train.*` config keys: the one place that sets their
#: defaults (run.py's `with_defaults` fills a config's missing keys from it, the trainer
#: builds its watchdog with `Watchdog.from_config`).
CONFIG_DEFAULTS: dict[str, float] = {
  "watchdog_factor": 20.0,
  "watchdog_min_s": 120.0,
  "watchdog_first_s": 1800.0,
  "sigterm_grace_s": 120.0,
}


class Watchdog:
  """See the module docstring. `enabled=False` (or factor <= 0): units are not watched
  (SIGTERM's grace still is)."""

  def __init__(
    self,
    *,
    factor: float = CONFIG_DEFAULTS["watchdog_factor"],
    min_s: float = CONFIG_DEFAULTS["watchdog_min_s"],
    first_s: float = CONFIG_DEFAULTS["watchdog_first_s"],
    grace_s: float = CONFIG_DEFAULTS["sigterm_grace_s"],
    log=print,
    exit=os._exit,
  ):
    self.factor, self.min_s, self.first_s, self.grace_s = factor, min_s, first_s, grace_s
    self._log, self._exit = log, exit
    self._lock = threading.Lock()
    self._unit: tuple[str, str, float] | None = None  # kind, name, start (monotonic)
    self._history: dict[str, collections.deque] = collections.defaultdict(
      lambda: collections.deque(maxlen=200)
    )
    self.last_step = None  # the last train step launched (for the report)
    self._sigterm_at: float | None = None
    self._sigterm_done = False
    self._stop = threading.Event()
    self._rfd, self._wfd = os.pipe()
    os.set_blocking(self._wfd, False)
    self._old_wakeup: int | None = None
    self._thread = threading.Thread(target=self._run, name="recgnn-watchdog", daemon=True)
    self._thread.start()

  @classmethod
  def from_config(cls, tcfg, **kwargs) -> Watchdog:
    """A watchdog with the bounds of a `train` config (`CONFIG_DEFAULTS` for missing keys)."""
    b = {k: float(tcfg.get(k, v)) for k, v in CONFIG_DEFAULTS.items()}
    return cls(
      factor=b["watchdog_factor"],
      min_s=b["watchdog_min_s"],
      first_s=b["watchdog_first_s"],
      grace_s=b["sigterm_grace_s"],
      **kwargs,
    )

  # --------------------------------------------------------------------------- units

  @contextlib.contextmanager
  def unit(self, kind: str, name: str):
    """Watch the enclosed work as one unit of `kind` ("step", "eval", "save", ...)."""
    start = time.monotonic()
    with self._lock:
      outer, self._unit = self._unit, (kind, name, start)
    try:
      yield
    finally:
      with self._lock:
        self._history[kind].append(time.monotonic() - start)
        self._unit = outer

  def bound(self, kind: str) -> float:
    """Seconds a unit of `kind` may take now."""
    seen = self._history[kind]
    if not seen:
      return self.first_s
    return max(self.min_s, self.factor * statistics.median(seen))

  # --------------------------------------------------------------------------- SIGTERM

  def watch_sigterm(self) -> None:
    """Main thread, after the trainer installed its SIGTERM handler: have the signal also
    wake this thread (through the C-level handler, whichever thread receives it)."""
    if threading.current_thread() is not threading.main_thread():
      return
    try:
      self._old_wakeup = signal.set_wakeup_fd(self._wfd, warn_on_full_buffer=False)
    except ValueError:  # not the main thread of the main interpreter
      self._old_wakeup = None

  def sigterm_acknowledged(self) -> None:
    """The loop saw the SIGTERM flag between steps: no grace deadline any more."""
    self._sigterm_done = True

  # --------------------------------------------------------------------------- thread

  def _run(self):
    while not self._stop.is_set():
      ready, _, _ = select.select([self._rfd], [], [], 0.5)
      if ready:
        data = os.read(self._rfd, 64)
        if signal.SIGTERM in data and self._sigterm_at is None:
          self._sigterm_at = time.monotonic()
      now = time.monotonic()
      late = self._sigterm_at is not None and now - self._sigterm_at > self.grace_s
      if late and not self._sigterm_done:
        with self._lock:
          unit = self._unit
        what = f"{unit[1]} has" if unit else "the loop has"
        self._fire(
          f"SIGTERM {now - self._sigterm_at:.0f} s ago and {what} not finished (the "
          "trainer stops between steps); exiting without saving",
          EXIT_SIGTERM,
        )
        return
      with self._lock:
        unit = self._unit
      if unit is None or self.factor <= 0:
        continue
      kind, name, start = unit
      limit = self.bound(kind)
      if now - start > limit:
        seen = self._history[kind]
        how = (
          f"the first {kind} may take {self.first_s:g} s"
          if not seen
          else f"{self.factor:g} x the median {kind} ({statistics.median(seen):.3g} s), at "
          f"least {self.min_s:g} s"
        )
        last = f"; steps launched: {self.last_step}" if self.last_step is not None else ""
        self._fire(
          f"{name} has not finished after {now - start:.0f} s ({how}){last}. A collective "
          "waiting for a device that never arrives looks like this (stacks above); exiting",
          EXIT_HUNG,
        )
        return

  def _fire(self, message: str, code: int) -> None:
    sys.stdout.flush()
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    print(f"Watchdog: {message} with status {code}.", file=sys.stderr, flush=True)
    self._log(f"Watchdog: {message} with status {code}.")
    sys.stdout.flush()
    self._exit(code)

  def close(self) -> None:
    self._stop.set()
    if self._old_wakeup is not None:
      with contextlib.suppress(ValueError):
        signal.set_wakeup_fd(self._old_wakeup)
      self._old_wakeup = None
    self._thread.join(timeout=2)
    for fd in (self._rfd, self._wfd):
      with contextlib.suppress(OSError):
        os.close(fd)


class SigtermFlag:
  """Turns SIGTERM into a flag the loop checks after each step (checkpoint, then exit)."""

  def __init__(self):
    self.received = False
    self._old = None

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      self._old = signal.signal(signal.SIGTERM, self._handle)
    return self

  def _handle(self, signum, frame):
    del signum, frame
    self.received = True

  def __exit__(self, *exc):
    if self._old is not None:
      signal.signal(signal.SIGTERM, self._old)
