"""What each compiled train step moves: host-link and collective bytes, read off its HLO.

The trainer keeps one `StepTraffic`: after every step it is shown the step function and its
arguments; a program it has not seen (the first step, a re-jit after a group re-planned its
shapes, new packed shapes such as a bucketed exchange list's) is lowered again (jax's caches
make that, and its compile, a lookup) and read once:

  host_to_device_bytes / device_to_host_bytes   per step, summed over the devices of the
                                                mesh: the batch's transfer (with the host
                                                tiers' rows) / the host tiers' rows back
                                                (`step_io`), plus any transfer inside the
                                                step (recgnn.comms.host_link_of)
  collective_bytes_per_device                   recgnn.comms.summary of the compiled step:
                                                operand bytes of its collectives, per device

A step that runs k steps per call (`Task.steps_per_call`: a lax.scan) has its loop body read
once: its collective bytes are then one scanned step's plus the call's own. These are what the
program asks to move, the same on every platform (on a CPU host and device memory are one
RAM, so no timing there can tell them).

The program is keyed by the step function and its static packed layout (the last argument,
an `inputs.PackLayout`: the buffers' shapes follow from it), never by a walk of the
arguments: a step whose layout is the previous step's object costs two identity checks, any
other a dict lookup by the layout's cached hash (the trainer's main thread runs this every
step; a walk of ~100 leaves would cost it over a hundred Python calls per step).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from recgnn import comms

KEYS = ("host_to_device_bytes", "device_to_host_bytes", "collective_bytes_per_device")


def _nbytes(tree) -> int:
  avals = [getattr(x, "_aval", x) for x in jax.tree.leaves(tree)]  # (ArgInfo holds its aval)
  return sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in avals)


def step_io(lowered) -> tuple[int, int]:
  """(bytes in, bytes out) of a packed step f(state, buffers, layout) -> (state, metrics[,
  to_host]) over the host link, besides the state: the batch's one transfer (ids, features
  and the host tiers' rows read for it: `buffers`, every batch of a call of k; step inputs
  placed once are not counted) and the rows the host tiers take back (the third output of a
  plan with a host tier, `host_handoff.hand_to_host`). Per call."""
  (args, _) = lowered.args_info
  out = lowered.out_info
  into = _nbytes(args[1]) if len(args) >= 2 else 0
  back = _nbytes(out[2]) if isinstance(out, tuple) and len(out) == 3 else 0
  return into, back


def program_traffic(lowered) -> dict[str, int]:
  """{KEYS: bytes} of one `jax.jit(...).lower(...)` step: its batch's transfer and its host
  tiers' rows (`step_io`), plus any transfer inside the step (`comms.host_link_of`: none in
  this project's steps, whose host tiers work outside them)."""
  link = comms.host_link_of(lowered)
  into, out = step_io(lowered)
  collectives = comms.summary(lowered.compile().as_text())
  return {
    "host_to_device_bytes": int(link.to_device_bytes) + into,
    "device_to_host_bytes": int(link.to_host_bytes) + out,
    "collective_bytes_per_device": int(collectives["total_operand_bytes"]),
  }


class PerProgram:
  """`read(lowered)` of each compiled program a jitted step runs, computed once per program
  (the step function and its static packed layout pick the program)."""

  def __init__(self, read: Callable[[Any], Any]):
    self.read = read
    self._fn: Callable | None = None
    self._seen: dict[Any, Any] = {}  # packed layout -> read
    self._layout: Any = None  # the last step's
    self.programs = 0  # distinct programs read, over the run (re-jits included)
    self.current: Any = None  # the last step's
    self._new: list[tuple[int, Any]] = []  # read since the last `take_new`

  def observe(self, step_fn, state, args: tuple[Any, ...]) -> Any:
    """`read` of `step_fn(state, *args)`'s program (state: any state of the run's shapes, e.g.
    the one the step returned; it is only lowered, never donated). args[-1]: the static
    packed layout (hashable), which with `step_fn` picks the program."""
    layout = args[-1]
    if step_fn is self._fn and layout is self._layout:  # the previous step's program
      return self.current
    if step_fn is not self._fn:  # a re-jit: its programs are new ones
      self._fn, self._seen = step_fn, {}
    self._layout = layout
    if layout not in self._seen:
      self._seen[layout] = self.read(step_fn.lower(state, *args))
      self.programs += 1
      self._new.append((self.programs, self._seen[layout]))
    self.current = self._seen[layout]
    return self.current

  def take_new(self) -> list[tuple[int, Any]]:
    """(number, value) of the programs read since the last call (each once), to log."""
    new, self._new = self._new, []
    return new


class StepTraffic(PerProgram):
  """The trainer's: `program_traffic` of every train-step program (module docstring)."""

  def __init__(self):
    super().__init__(program_traffic)

  def scalars(self) -> dict[str, float]:
    """The last step's figures as metrics ("link/..." keys) and `link/programs`, the programs
    compiled so far (an interval in which it grew holds a compile); {} before any step."""
    if self.current is None:
      return {}
    return {**{f"link/{k}": float(v) for k, v in self.current.items()},
            "link/programs": float(self.programs)}  # fmt: skip


def describe(traffic: dict[str, int]) -> str:
  """One log line's worth."""
  return (
    f"host link {traffic['host_to_device_bytes'] / 1e6:.3f} MB to device / "
    f"{traffic['device_to_host_bytes'] / 1e6:.3f} MB to host per step (all devices), "
    f"collectives {traffic['collective_bytes_per_device'] / 1e6:.3f} MB per device"
  )
