"""What a checkpoint of a dynamic table needs from the past: the id maps as they were after
the last train step that ran, not as the input thread has left them.

The input thread prepares (and so maps) up to PREFETCH x steps_per_call + lookahead batches
ahead of the step; a checkpoint of the state after step s must hold the maps after batch s.
`History` keeps two snapshots of every map (taken at train batches that are multiples of
`every`, a number larger than that run-ahead, so one of them is at or before any step the
state can be at) and the train batches' raw ids since the older one; `at(s)` replays them on
a copy of the snapshot. Cost: a copy of the maps every `every` batches, and up to 2 x
`every` batches' ids; `at` runs on a checkpoint only.
"""

from __future__ import annotations

import numpy as np

from recgnn.backends.dynamic import id_map


class History:
  """Snapshots and the raw ids since them, for `at(step)`. Called in stream order."""

  def __init__(self, maps: dict[str, id_map.IdMap], every: int, step: int = 0):
    self.maps, self.every = maps, every
    self.snaps: list[tuple[int, dict[str, dict]]] = [(step, self._copy())]
    self.ids: dict[int, dict[str, np.ndarray]] = {}

  def _copy(self) -> dict[str, dict]:
    return {n: m.arrays() for n, m in self.maps.items()}

  def before_train(self, step: int, ids: dict[str, np.ndarray]) -> None:
    """Train batch `step` (its index in the stream of train batches) is about to be mapped."""
    if step % self.every == 0 and step != self.snaps[-1][0]:
      self.snaps = [*self.snaps[-1:], (step, self._copy())]
    first = self.snaps[0][0]
    self.ids = {s: x for s, x in self.ids.items() if s >= first}
    self.ids[step] = {n: np.array(x, np.int64, copy=True) for n, x in ids.items()}

  def at(self, step: int) -> dict[str, dict[str, np.ndarray]]:
    """{table: the map's arrays after `step` train batches}."""
    older = [(s, a) for s, a in self.snaps if s <= step]
    if not older:
      raise RuntimeError(
        f"dynamic: no snapshot of the id maps at or before step {step} (kept: "
        f"{[s for s, _ in self.snaps]}); the input ran further ahead than {self.every} batches"
      )
    first, arrays = older[-1]
    out = {}
    for n, a in arrays.items():
      m = id_map.IdMap(self.maps[n].policy, {k: v.copy() for k, v in a.items()})
      for s in range(first, step):
        m.map(self.ids[s][n], train=True)
      out[n] = m.arrays()
    return out
