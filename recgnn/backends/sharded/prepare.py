"""sharded's host-side preparer (the input thread): a batch's ids -> its prepared pytree.

One concern: the per-batch host work, which for model-parallel tables is little: the ids
checked and cast (the routing is the step's, on the devices), the mean pooling's counts, and
the batch size `stats` reports the wire bytes at. `Preparer` is an object the `Sharded` front
holds (recgnn/backends/sharded/backend.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from recgnn import sharding
from recgnn.embeddings import base


class Preparer:
  """ids -> {"ids": {table: int32[B, L]}, "count": {table: int32[B]} (mean pooling)}, every
  leaf split with the batch. process_local: each process prepares its slice of the batch."""

  def __init__(self, specs: dict[str, base.TableSpec], process_local: bool):
    self._specs, self._process_local = specs, process_local
    self.batch = 0  # the last prepared train batch's global size (for `stats`)

  def prepare(self, ids, train: bool):
    out = {"ids": {}, "count": {}}
    for n, s in self._specs.items():
      x = np.asarray(ids[n])
      # Out-of-range ids would be dropped silently by the gathers: refuse them here.
      if x.size and (x.max() >= s.num_rows or x.min() < base.PAD):
        raise ValueError(f"sharded: table {n!r} got ids outside [-1, {s.num_rows})")
      out["ids"][n] = x.astype(np.int32)
      if train:  # the global batch (a process-local slice is 1 / processes of it)
        self.batch = x.shape[0] * (jax.process_count() if self._process_local else 1)
      if s.pooling == "mean":
        out["count"][n] = np.sum(x >= 0, axis=1).astype(np.int32)
    return out

  def prepare_on_device(self, ids):
    """`prepare` inside the step (the device feed checked the ids' range when it placed
    them): the same arrays as jax arrays."""
    out = {"ids": {}, "count": {}}
    for n, s in self._specs.items():
      x = ids[n].astype(jnp.int32)
      out["ids"][n] = x
      # (static; the train step is traced before any eval step: the train batch's size)
      self.batch = self.batch or x.shape[0]
      if s.pooling == "mean":
        out["count"][n] = jnp.sum(x >= 0, axis=1, dtype=jnp.int32)
    return out

  @staticmethod
  def prepared_spec(prepared):
    return jax.tree.map(lambda _: sharding.BATCH_SPEC, prepared)
