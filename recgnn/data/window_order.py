"""Train order "window" (`train.order=window`): a shuffle within windows of large contiguous
chunks, so a pass reads the data one window at a time (the device feed streams it so when the
data does not fit the devices; the host feed reads the same order, batch for batch).

  used rows    the split's first (n // B) * B rows (the last < B rows are never read, where
               the "pass" order drops a different < B each pass)
  chunks       contiguous runs of C rows of them (C a multiple of B); the last may be shorter
               (still a multiple of B)
  pass e       the full chunks in a permutation drawn from (seed, e), the short one (if any)
               last; consecutive groups of W chunks form the pass's windows (the last one may
               hold fewer)
  window w     its rows (its chunks' rows, in chunk order: local index i * C + offset) in a
               permutation drawn from (seed, e, w); batch j is its rows [j * B, (j + 1) * B),
               sorted by row (as the host feed reads a batch)

Every window but the last of a pass has W * C / B batches; the last has the rest, the same in
every pass, so a step's (pass, window, batch) is arithmetic and the order a function of the
step alone (a resumed run reads what an uninterrupted one would). seed None: file order.
"""

from __future__ import annotations

import functools

import numpy as np


class WindowOrder:
  """The window order of a split of `n` rows starting at row `start`, batches of `batch_size`,
  chunks of `chunk_rows` rows (rounded down to a multiple of the batch, at least one batch),
  `window_chunks` chunks a window."""

  def __init__(
    self, n: int, start: int, batch_size: int, chunk_rows: int, window_chunks: int, seed
  ):
    b = batch_size
    self.batch_size, self.start, self.seed = b, start, seed
    self.batches = n // b  # per pass
    used = self.batches * b
    self.chunk_rows = max(b, chunk_rows // b * b)
    self.num_chunks = -(-used // self.chunk_rows)
    self.window_chunks = max(1, min(window_chunks, self.num_chunks))
    self.window_rows = self.window_chunks * self.chunk_rows  # a full window's rows
    self.window_batches = self.window_rows // b  # a full window's batches
    self.windows = -(-self.num_chunks // self.window_chunks)  # per pass
    self.last_batches = self.batches - (self.windows - 1) * self.window_batches
    self._used = used

  def chunk(self, c: int) -> tuple[int, int]:
    """Rows [lo, hi) of chunk c (rows of the whole dataset)."""
    lo = c * self.chunk_rows
    return self.start + lo, self.start + min(lo + self.chunk_rows, self._used)

  def chunks(self, epoch: int) -> np.ndarray:
    """Pass `epoch`'s chunks in order: int64[num_chunks], the short chunk (if any) last."""
    full = self._used // self.chunk_rows
    if self.seed is None:
      return np.arange(self.num_chunks)
    perm = np.random.default_rng([self.seed, epoch]).permutation(full)
    return np.concatenate([perm, np.arange(full, self.num_chunks)])

  def window_chunk_ids(self, epoch: int, window: int) -> np.ndarray:
    w = self.window_chunks
    return self.chunks(epoch)[window * w : (window + 1) * w]

  def locate(self, step: int) -> tuple[int, int, int]:
    """Step -> (pass, window, batch in the window)."""
    epoch, r = divmod(step, self.batches)
    window, j = divmod(r, self.window_batches)
    return epoch, window, j

  def sequence(self, step: int) -> int:
    """The window step reads, counted over passes: pass * windows + window."""
    epoch, window, _ = self.locate(step)
    return epoch * self.windows + window

  @functools.lru_cache(maxsize=4)  # noqa: B019 (a few windows, the order's lifetime)
  def window(self, epoch: int, window: int) -> tuple[np.ndarray, np.ndarray]:
    """The batches of a window: (rows int64[nb, B] of the whole dataset, each batch sorted;
    local int32[nb, B]: the same rows as indices into the window's chunks laid end to end)."""
    ids = self.window_chunk_ids(epoch, window)
    n = sum(hi - lo for lo, hi in map(self.chunk, ids))
    nb = n // self.batch_size
    if self.seed is None:
      local = np.arange(nb * self.batch_size)
    else:
      local = np.random.default_rng([self.seed, epoch, window + 1]).permutation(n)
      local = local[: nb * self.batch_size]
    local = local.reshape(nb, self.batch_size)
    firsts = np.array([self.chunk(c)[0] for c in ids], np.int64)
    rows = firsts[local // self.chunk_rows] + local % self.chunk_rows
    by_row = np.argsort(rows, axis=1, kind="stable")
    rows = np.take_along_axis(rows, by_row, axis=1)
    return rows, np.take_along_axis(local, by_row, axis=1).astype(np.int32)

  def batch_rows(self, step: int) -> np.ndarray:
    """Rows (of the whole dataset) of train batch `step`: int64[B], sorted."""
    epoch, window, j = self.locate(step)
    return self.window(epoch, window)[0][j]


#: A chunk's bytes by default (`train.feed_chunk_rows` 0): large enough that a transfer runs
#: at the link's rate, small enough that a window of a few fits beside the tables.
CHUNK_BYTES = 256 * 2**20
#: Chunks a window by default (`train.feed_window_chunks`).
WINDOW_CHUNKS = 4


def row_bytes(dataset) -> int:
  """Bytes of one row of a CTR dataset: label int8 + dense float32 + ids int32."""
  return sum(a.dtype.itemsize * int(np.prod(a.shape[1:])) for a in _arrays(dataset))


def _arrays(dataset):
  return dataset.labels, dataset.dense, dataset.sparse


def for_train(tcfg, dataset, seed) -> WindowOrder:
  """The run's window order of `dataset`'s train split: chunks of `train.feed_chunk_rows` rows
  (0 or unset: CHUNK_BYTES of rows), `train.feed_window_chunks` a window. The host feed
  (`train.order=window`) and the device feed build it from the same config, so they agree."""
  rows = int(tcfg.get("feed_chunk_rows", 0) or 0) or CHUNK_BYTES // row_bytes(dataset)
  start = dataset.splits["train"][0]
  n = dataset.split_size("train")
  w = int(tcfg.get("feed_window_chunks", WINDOW_CHUNKS))
  return WindowOrder(n, start, tcfg.batch_size, rows, w, seed)
