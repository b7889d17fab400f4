"""A converted CTR dataset as rows the device feed holds on the devices and gathers by index.

The device feed (`recgnn.train.device_feed`) places `arrays()` on the devices once and, inside
each jitted step, gathers the batch of a row list with `gather`: the same batch, value for
value, as `CTRDataset.gather` of those rows on the host (labels int8 -> float32, padding rows
zeros with weight 0 and ids MISSING_ID, PAD after it in a bag). Orders are the dataset's own
(`CTRDataset.batch_rows`): a pass's permutation drawn from (seed, epoch), each batch's rows
sorted, so the two feeds give the same batches.

Raw tables (`CTRDataset.raw_tables`: 64-bit ids in raw_ids.npy) are not among the arrays the
devices hold: only a dynamic table takes them, and it maps them to rows on the host
(`host_ids` reads them there), so no int64 id reaches a device.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from recgnn.data.ctr_dataset import CTRDataset, raw_batch
from recgnn.data.ctr_schema import MISSING_ID, PAD


class CTRRows:
  """`dataset`'s arrays and a run's orders for the device feed: train batches of
  `batch_size` rows (shuffled per pass with `seed`, None: in file order), eval batches of
  `eval_batch_size` (the last one padded); `shards`: train.order_shards
  (`CTRDataset.batch_rows`).

  arrays: {"label": int8[N], "dense": float32[N, F], "sparse": int32[N, S]}; table t's ids
  are columns [offset_t, offset_t + L_t) of `sparse` (L_t its bag length), t one of
  `tables` (the dataset's `id_tables`: every table but the raw ones).
  window: the train order when it is "window" (`window_order.WindowOrder`: train.order=window,
  or the device feed streaming data larger than the devices), else None (`train_order`'s).
  """

  window = None

  def __init__(
    self, dataset: CTRDataset, batch_size: int, eval_batch_size: int, seed, shards: int = 1
  ):
    self.dataset, self.shards = dataset, shards
    self.batch_size, self.eval_batch_size, self.seed = batch_size, eval_batch_size, seed
    self.tables = tuple(dataset.id_tables)
    self.bags = dataset.bags_of(self.tables)
    self.offsets = tuple(int(x) for x in np.cumsum((0,) + self.bags[:-1]))

  def arrays(self) -> dict[str, np.ndarray]:
    d = self.dataset
    return {"label": d.labels, "dense": d.dense, "sparse": d.sparse}

  @property
  def nbytes(self) -> int:
    """Bytes of `arrays()`: what one copy on a device holds."""
    return sum(int(a.nbytes) for a in self.arrays().values())

  @property
  def row_bytes(self) -> int:
    """Bytes of one row of `arrays()` (label, dense features, ids)."""
    return self.nbytes // max(len(self.dataset.labels), 1)

  def split_range(self, split: str) -> tuple[int, int]:
    """Rows [start, stop) of `split`."""
    start = self.dataset.splits[split][0]
    return start, start + self.dataset.split_size(split)

  @property
  def train_batches(self) -> int:
    """Train batches per pass (the last partial one dropped, as the host feed drops it)."""
    return self.dataset.num_batches("train", self.batch_size)

  def train_order(self, epoch: int) -> np.ndarray:
    """Pass `epoch`'s train rows, batch after batch: int32[train_batches, batch_size], row k
    `CTRDataset.batch_rows` of batch k (its rows sorted within each of the `shards`' parts,
    as the host feed reads them)."""
    b, nb, s = self.batch_size, self.train_batches, self.shards
    start, _ = self.split_range("train")
    perms = self.dataset.shard_permutations("train", self.seed, epoch, s)[:, : nb * (b // s)]
    parts = np.sort(perms.reshape(s, nb, b // s), axis=2)  # [shard, batch, its part]
    return (parts.transpose(1, 0, 2).reshape(nb, b) + start).astype(np.int32)

  def eval_cursors(self, split: str) -> list[tuple[int, int]]:
    """(first row, the split's stop) of each eval batch of `split`: batch i holds rows
    [first, first + eval_batch_size), those at or past stop padding."""
    start, stop = self.split_range(split)
    return [(lo, stop) for lo in range(start, stop, self.eval_batch_size)]

  def max_ids(self) -> dict[str, int]:
    """The largest id of each table over every row (ids in [PAD, max]): checked against the
    tables' sizes once, before the arrays are placed."""
    sparse = np.asarray(self.dataset.sparse)
    top = sparse.max(axis=0) if len(sparse) else np.zeros(sparse.shape[1], np.int32)
    return {t: int(top[o : o + b].max()) for t, o, b in zip(self.tables, self.offsets, self.bags)}

  def host_ids(self, rows: np.ndarray, tables, batch_size: int | None = None) -> dict:
    """The ids of `tables` of `rows` (sorted, all valid), read on the host: {table:
    int32[B, L_t]} (a raw table's int64[B, L_t]), padded to `batch_size` rows as `gather`
    pads (the memory tiers' planning and the dynamic maps need a batch's ids ahead of its
    step)."""
    rows = np.asarray(rows, np.int64)
    b = len(rows) if batch_size is None else batch_size
    d = self.dataset
    raw = [t for t in d.raw_tables if t in tables]
    out = raw_batch(d.raw_ids, rows, b, d.raw_tables, d.bags_of(d.raw_tables)) if raw else {}
    out = {t: out[t] for t in raw}
    if len(rows) and rows[-1] - rows[0] == len(rows) - 1:  # (contiguous: a slice)
      sparse = self.dataset.sparse[int(rows[0]) : int(rows[0]) + len(rows)]
    else:
      sparse = self.dataset.sparse[rows]
    for t, o, bag in zip(self.tables, self.offsets, self.bags):
      if t in tables:
        ids = np.full((b, bag), PAD, np.int32)
        ids[:, 0] = MISSING_ID
        ids[: len(rows)] = sparse[:, o : o + bag]
        out[t] = ids
    return out

  def gather(self, arrays: dict, rows, valid) -> dict:
    """Inside jit: rows int32[B] (clamped into the arrays), valid bool[B] -> the batch
    {"dense": f32[B, F], "label": f32[B], "weight": f32[B], "ids": {table: int32[B, L_t]}},
    invalid rows padding as `CTRDataset.gather` pads them."""
    label = jnp.where(valid, arrays["label"][rows].astype(jnp.float32), 0.0)
    dense = jnp.where(valid[:, None], arrays["dense"][rows], 0.0)
    sparse = arrays["sparse"][rows]
    ids = {}
    for t, o, b in zip(self.tables, self.offsets, self.bags):
      pad = jnp.full((b,), PAD, jnp.int32).at[0].set(MISSING_ID)
      ids[t] = jnp.where(valid[:, None], sparse[:, o : o + b], pad[None, :])
    return {"dense": dense, "label": label, "weight": valid.astype(jnp.float32), "ids": ids}
