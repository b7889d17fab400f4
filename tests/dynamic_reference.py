"""A plain-Python dynamic id map: the reference `recgnn.backends.dynamic.id_map.IdMap` is
checked against (tests/test_dynamic_map.py). Dicts and linear scans, no hashing tricks: the
same decisions by definition, in stream order.

Eviction order: the least (primary, secondary, row) among rows not seen in this batch, with
(last, count) for lru / ttl and (count, last) for lfu. Free rows are a stack (row 0 first;
rows freed by ttl pushed in eviction order). count(k) counts exactly (the window is cleared
when the pending ids would pass half of its size, as the compiled map does); bloom is not
modelled here (its estimate is at least the exact count: tested apart).
"""

from __future__ import annotations

import numpy as np


class ReferenceMap:
  def __init__(self, capacity, admit="always", k=1, evict="lru", ttl=0, pending_cells=8):
    self.c, self.admit, self.k, self.evict, self.ttl = capacity, admit, k, evict, ttl
    self.rows: dict[int, int] = {}  # id -> row
    self.key = [-1] * capacity
    self.count = [0] * capacity
    self.last = [0] * capacity
    self.used = [False] * capacity
    self.free = list(range(capacity - 1, -1, -1))
    self.pending: dict[int, int] = {}
    self.pending_cells = pending_cells
    self.step = 0
    self.admitted = self.evicted = self.rejected = 0

  def _order(self, r):
    if self.evict == "lfu":
      return (self.count[r], self.last[r], r)
    return (self.last[r], self.count[r], r)

  def _drop(self, r):
    del self.rows[self.key[r]]
    self.key[r] = -1
    self.evicted += 1

  def _admit(self, x):
    if self.admit == "always":
      return True
    if 2 * (len(self.pending) + 1) > self.pending_cells:
      self.pending.clear()
    self.pending[x] = self.pending.get(x, 0) + 1
    if self.pending[x] >= self.k:
      del self.pending[x]
      return True
    return False

  def map(self, ids, train=True):
    ids = np.asarray(ids).reshape(-1)
    out, resets = [], []
    if train and self.evict == "ttl":
      old = sorted(
        (self._order(r), r) for r in self.rows.values() if self.last[r] < self.step - self.ttl
      )
      for _, r in old:
        self._drop(r)
        self.free.append(r)
    for x in ids.tolist():
      if x == -1:
        out.append(-1)
        continue
      if x in self.rows:
        r = self.rows[x]
        out.append(r)
        if train:
          self.count[r] += 1
          self.last[r] = self.step
        continue
      if not train:  # (eval / look-ahead: reads only, counts nothing)
        out.append(-1)
        continue
      if not self._admit(x):
        out.append(-1)
        self.rejected += 1
        continue
      if self.free:
        r = self.free.pop()
      elif self.evict != "none":
        cands = [r for r in self.rows.values() if self.last[r] < self.step]
        r = min(cands, key=self._order) if cands else -1
        if r >= 0:
          self._drop(r)
      else:
        r = -1
      if r < 0:
        out.append(-1)
        self.rejected += 1
        continue
      self.rows[x], self.key[r] = r, x
      self.count[r], self.last[r] = 1, self.step
      if self.used[r]:
        resets.append(r)
      self.used[r] = True
      self.admitted += 1
      out.append(r)
    if train:
      self.step += 1
    return np.asarray(out, np.int32), np.asarray(resets, np.int32)
