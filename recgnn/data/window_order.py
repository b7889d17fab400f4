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
               permutation keyed by (seed, e, w); batch j is its rows [j * B, (j + 1) * B),
               sorted by row (as the host feed reads a batch)

The window's permutation is a keyed Feistel bijection on [0, 4^h) walked back into [0, n)
(`permutation`): integer arithmetic only, so numpy here and XLA on the devices compute the same
one from a few key words, and the device feed uploads no order (only the rows' own bytes).

Every window but the last of a pass has W * C / B batches; the last has the rest, the same in
every pass, so a step's (pass, window, batch) is arithmetic and the order a function of the
step alone (a resumed run reads what an uninterrupted one would). seed None: file order.
"""

from __future__ import annotations

import functools

import numpy as np

#: Feistel rounds of a window's permutation, and the round function's multipliers.
ROUNDS = 4
_M1, _M2 = np.uint32(0x9E3779B1), np.uint32(0x85EBCA6B)


def half_bits(n: int) -> int:
  """h: the Feistel halves' bits for a domain of n (4^h >= n, at most 4n)."""
  return (max(2, int(n - 1).bit_length()) + 1) // 2


def feistel(x, keys, half: int):
  """One pass of the bijection on [0, 4^half) of uint32 `x` (numpy or jax arrays alike):
  ROUNDS rounds keyed by keys uint32[ROUNDS]."""
  mask = np.uint32((1 << half) - 1)
  left, right = x >> np.uint32(half), x & mask
  for r in range(ROUNDS):
    f = (right ^ keys[r]) * _M1
    f = (f ^ (f >> np.uint32(15))) * _M2
    f = f ^ (f >> np.uint32(13))
    left, right = right, left ^ (f & mask)
  return (left << np.uint32(half)) | right


def permutation(n: int, keys) -> np.ndarray:
  """[0, n) permuted (uint32[n]): `feistel` of each i, reapplied while past n (cycle walking:
  a bijection of [0, n), since the walk from i never meets another i's)."""
  half = half_bits(n)
  x = feistel(np.arange(n, dtype=np.uint32), keys, half)
  out = x >= n
  while out.any():
    x[out] = feistel(x[out], keys, half)
    out = x >= n
  return x


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

  def window_rows_of(self, epoch: int, window: int) -> int:
    """Rows of a window (all its chunks')."""
    return sum(hi - lo for lo, hi in map(self.chunk, self.window_chunk_ids(epoch, window)))

  def keys(self, epoch: int, window: int) -> np.ndarray | None:
    """The window's permutation keys, uint32[ROUNDS], drawn from (seed, epoch, window); None
    without a seed (file order)."""
    if self.seed is None:
      return None
    rng = np.random.default_rng([self.seed, epoch, window + 1])
    return rng.integers(0, 2**32, ROUNDS, dtype=np.uint32)

  def ranks(self, epoch: int, window: int) -> np.ndarray:
    """int32[chunks]: each of the window's chunks' rank by row (a batch sorts by rank * C +
    offset, which is by row, in int32 whatever the dataset's size)."""
    return np.argsort(np.argsort(self.window_chunk_ids(epoch, window))).astype(np.int32)

  @functools.lru_cache(maxsize=4)  # noqa: B019 (a few windows, the order's lifetime)
  def window(self, epoch: int, window: int) -> tuple[np.ndarray, np.ndarray]:
    """The batches of a window: (rows int64[nb, B] of the whole dataset, each batch sorted;
    local int32[nb, B]: the same rows as indices into the window's chunks laid end to end)."""
    n, b, c = self.window_rows_of(epoch, window), self.batch_size, self.chunk_rows
    nb = n // b
    keys = self.keys(epoch, window)
    local = np.arange(nb * b) if keys is None else permutation(n, keys)[: nb * b]
    local = local.astype(np.int64).reshape(nb, b)
    key = self.ranks(epoch, window)[local // c].astype(np.int64) * c + local % c
    local = np.take_along_axis(local, np.argsort(key, axis=1), axis=1)
    ids = self.window_chunk_ids(epoch, window)
    firsts = np.array([self.chunk(i)[0] for i in ids], np.int64)
    return firsts[local // c] + local % c, local.astype(np.int32)

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
