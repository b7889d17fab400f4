"""Where the device feed's rows live and how a step finds its examples there.

  Replicated   one process: every device holds all the rows; a step's rows are the order's
               (train) or first + arange (eval), read as they are.
  PerProcess   P processes under jax.distributed: each process holds only the rows its own
               devices read, on each of them. With train.order_shards = S (a multiple of P)
               process p's slice of every train batch comes from shards [p S/P, (p+1) S/P),
               one contiguous range of the train split; each eval split is cut into P
               contiguous blocks, process p's slice of eval batch i the i-th run of its block.
               A device's copy: [its train range, each eval split's block padded to the
               longest], so the step maps a row to its place there with one offset per
               process (static tables, no communication).

Both give `gather` (in `shard_map`) the same contract: rows int32[B] index the device's own
copy (`local`), valid bool[B] marks padding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from recgnn import sharding


class Replicated:
  """All rows on every device (one process; the streamed windows too, `feed_stream`): eval
  cursors (first row, split stop)."""

  def __init__(self, rows, mesh):
    self.rows, self.mesh = rows, mesh

  def place(self) -> dict:
    repl = sharding.named(self.mesh, sharding.REPLICATED)
    return sharding.put({k: np.asarray(v) for k, v in self.rows.arrays().items()}, repl)

  @staticmethod
  def nbytes(rows) -> int:
    return rows.nbytes

  def spec(self, data):
    return jax.tree.map(lambda _: sharding.REPLICATED, data)

  @staticmethod
  def local(data):
    return data

  @staticmethod
  def train_rows(rows):
    return rows

  def eval_rows(self, cursor):
    first = cursor[0] + jnp.arange(self.rows.eval_batch_size, dtype=jnp.int32)
    valid = first < cursor[1]
    return jnp.minimum(first, cursor[1] - 1), valid

  def eval_cursors(self, split: str):
    """[(cursor, the batch's rows in the dataset: for host-read ids)] of `split`."""
    size = self.rows.eval_batch_size
    return [
      ((lo, hi), np.arange(lo, min(lo + size, hi))) for lo, hi in self.rows.eval_cursors(split)
    ]


class PerProcess:
  """Each process's own rows on its devices (P processes, `rows.shards` a multiple of P, the
  processes' devices contiguous blocks of the batch). Eval cursors (run start, split index)."""

  def __init__(self, rows, mesh, index: int, count: int):
    self.rows, self.mesh, self.count = rows, mesh, count
    self.train_lo, self.train_len = _train_range(rows, index, count)
    self.splits = _eval_splits(rows)
    self.blocks = [-(-_size(rows, s) // count) for s in self.splits]  # rows per block
    self.offsets = np.cumsum([self.train_len] + self.blocks)[:-1].astype(np.int32)
    lengths = [
      [_block(rows, s, b, p)[1] for p in range(count)] for s, b in zip(self.splits, self.blocks)
    ]
    self.lengths = np.array(lengths, np.int32)  # [split, process]
    # train: a position's row minus its process's range start (the order holds dataset rows)
    per = rows.batch_size // count
    starts = np.array([_train_range(rows, p, count)[0] for p in range(count)], np.int32)
    self.train_shift = np.repeat(starts, per)
    self.index = index

  @staticmethod
  def nbytes(rows) -> int:
    """Bytes of one process's copy (on each of its devices; every process's is as long)."""
    layout = PerProcess(rows, None, 0, jax.process_count())  # (index math only, no arrays)
    return (layout.train_len + sum(layout.blocks)) * rows.row_bytes

  def process_arrays(self, index: int) -> dict:
    """Process `index`'s copy: {name: [R, ...]} (its train range, then each eval split's
    block padded to the split's block length)."""
    out = {}
    for k, a in self.rows.arrays().items():
      parts = [a[self.train_lo : self.train_lo + self.train_len]]
      for s, blk in zip(self.splits, self.blocks):
        lo, n = _block(self.rows, s, blk, index)
        part = np.zeros((blk,) + a.shape[1:], a.dtype)
        part[:n] = a[lo : lo + n]
        parts.append(part)
      out[k] = np.concatenate(parts)
    return out

  def place(self) -> dict:
    """[devices, R, ...] arrays split over the batch's devices: each device's slice its
    process's copy."""
    arrays = self.process_arrays(self.index)
    s = sharding.named(self.mesh, sharding.BATCH_SPEC)
    devices = self.mesh.devices.size

    def one(a):
      shards = [jax.device_put(a[None], d) for d in s.addressable_devices]
      return jax.make_array_from_single_device_arrays((devices,) + a.shape, s, shards)

    return {k: one(a) for k, a in arrays.items()}

  def spec(self, data):
    return jax.tree.map(lambda _: sharding.BATCH_SPEC, data)

  @staticmethod
  def local(data):
    return jax.tree.map(lambda a: a[0], data)

  def train_rows(self, rows):
    return rows - jnp.asarray(self.train_shift)

  def eval_rows(self, cursor):
    e, count = self.rows.eval_batch_size, self.count
    q = cursor[0] + jnp.arange(e, dtype=jnp.int32) % (e // count)  # within the block
    proc = jnp.arange(e, dtype=jnp.int32) // (e // count)
    valid = q < jnp.asarray(self.lengths)[cursor[1], proc]
    last = jnp.asarray(np.maximum(np.array(self.blocks, np.int32), 1) - 1)[cursor[1]]
    return jnp.asarray(self.offsets)[cursor[1]] + jnp.minimum(q, last), valid

  def eval_cursors(self, split: str):
    """[(cursor, None)] of `split`: its blocks' runs of eval_batch_size / P rows."""
    i, per = self.splits.index(split), self.rows.eval_batch_size // self.count
    return [((lo, i), None) for lo in range(0, self.blocks[i], per)]


def _size(rows, split: str) -> int:
  lo, hi = rows.split_range(split)
  return hi - lo


def _eval_splits(rows) -> list[str]:
  return [s for s in rows.dataset.splits if s != "train"]


def _train_range(rows, index: int, count: int) -> tuple[int, int]:
  """(first row, rows) of process `index`'s shards of the train split."""
  start, stop = rows.split_range("train")
  m = (stop - start) // rows.shards
  per = rows.shards // count
  return start + index * per * m, per * m


def _block(rows, split: str, blk: int, index: int) -> tuple[int, int]:
  """(first row, rows) of process `index`'s block of `split` (blocks of blk rows)."""
  start, stop = rows.split_range(split)
  lo = min(start + index * blk, stop)
  return lo, min(blk, stop - lo)
