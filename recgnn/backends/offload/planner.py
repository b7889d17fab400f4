"""Compiled host-side planning kernels (numba): the offload planner's steady-state step for
every table of a group in one call, spread over the cores.

Why compiled: the numpy planner spends most of its time in Python, not in arithmetic
(~50 small numpy calls per table per batch, 26 tables: ~8 ms per batch of 2048, 13k Python
calls; benchmarks/README.md "Input thread"). One call per group, a loop per table, removes
the Python and releases the GIL, so `over_tables` can run ranges of tables on several cores
at once (`set_threads`; by default half the cores: the input thread shares them with
the step).

The kernels make exactly the decisions of `offload.Planner` (same victims, same slots, same
order): tests/test_offload.py compares every prepared array of a stream against it.

Layout: a group's per-table arrays are slices of flat arrays, `off[t]:off[t + 1]`:
  ids     int64, each table's ids of one batch, flattened (-1 = padding)
  rows    int64, each table's sorted distinct rows of one batch
  row_slot int32[sum N], slot_row / last_used int64[sum C], dirty bool[sum C]: planner state
  freq    int64[sum N] (LFU counts; empty for the other policies)
"""

from __future__ import annotations

import concurrent.futures
import os

import numpy as np

try:
  import numba
  from numba import njit

  AVAILABLE = True
except ImportError:  # the numpy planner runs instead (same decisions, slower)
  numba = None
  AVAILABLE = False

POLICY_CODES = {"lru": 0, "lfu": 1, "lookahead": 2}
# Keys of offload.Planner._keys (kept in step with offload.py).
PROTECTED = np.iinfo(np.int64).max
NEEDED = np.int64(1) << 62
FAR = np.int64(1) << 40


def enabled() -> bool:
  """Whether the compiled planner runs (numba installed and RECGNN_HOSTPLAN != 0)."""
  return AVAILABLE and os.environ.get("RECGNN_HOSTPLAN", "1") != "0"


def _jit(**kw):
  def wrap(f):
    if not AVAILABLE:
      return f
    return njit(nogil=True, cache=True, **kw)(f)

  return wrap


_POOL: concurrent.futures.ThreadPoolExecutor | None = None
# Default: half the cores (at most 8), as the input thread shares them with the step; one on
# this 2-core machine. RECGNN_HOSTPLAN_THREADS overrides it.
_THREADS = int(os.environ.get("RECGNN_HOSTPLAN_THREADS", "0")) or max(
  1, min(8, (os.cpu_count() or 2) // 2)
)


def set_threads(n: int | None) -> int:
  """Cores the kernels may use (None: every core of the machine); returns the number set."""
  global _THREADS
  _THREADS = max(1, int(n)) if n is not None else (os.cpu_count() or 1)
  return _THREADS


def threads() -> int:
  return _THREADS


def over_tables(kernel, num_tables: int, *args) -> None:
  """kernel(*args, t_lo, t_hi) over every table, split into `threads()` contiguous ranges
  run at once (the kernels release the GIL). One range: a plain call, no pool."""
  global _POOL
  k = min(_THREADS, num_tables)
  if k <= 1:
    kernel(*args, 0, num_tables)
    return
  if _POOL is None or _POOL._max_workers < k - 1:
    _POOL = concurrent.futures.ThreadPoolExecutor(k - 1, thread_name_prefix="hostplan")
  cuts = np.linspace(0, num_tables, k + 1).astype(int)
  futures = [_POOL.submit(kernel, *args, cuts[i], cuts[i + 1]) for i in range(1, k)]
  kernel(*args, cuts[0], cuts[1])
  for f in futures:
    f.result()


@_jit()
def distinct(ids, sorted_ids, id_off, num_rows, rows, count, bad, t_lo, t_hi):
  """Sorted distinct non-padding ids of tables [t_lo, t_hi) of one batch, written in place.

  ids int64[sum n_t] (table t at id_off[t]:id_off[t + 1]; < 0 = padding); sorted_ids: each
  table's slice sorted (numpy's vectorized sort: numba's is ~6x slower), or empty to sort
  here. Writes rows (table t's distinct rows from id_off[t]), count[t] (how many) and
  bad[t] (an id >= num_rows[t] of table t, else -1).
  """
  for t in range(t_lo, t_hi):
    a, b = id_off[t], id_off[t + 1]
    s = sorted_ids[a:b] if sorted_ids.shape[0] else np.sort(ids[a:b])
    k = 0
    bad[t] = -1
    for x in s:
      if x < 0:
        continue
      if x >= num_rows[t]:
        bad[t] = x
        break
      if k == 0 or x != rows[a + k - 1]:
        rows[a + k] = x
        k += 1
    count[t] = k


# fmt: off
@_jit()
def plan_step(
  ring_ids, ring_rows, ring_n, id_off,  # batches: ids, sorted distinct rows, their counts
  cur, ahead, win,  # ring rows of this batch, the next one, and the window after it
  row_off, slot_off, row_slot, slot_row, last_used, dirty, freq,  # planner state (flat)
  evict_pad, t_now, policy, needs_unique,
  out, out_off, cap, stats, t_lo, t_hi,
):  # fmt: on
  """One train batch of every table, the batch having been admitted by the previous step:
  the slots of its ids (+ unique / inverse for row-wise optimizers), its rows marked dirty
  (+ LFU counts); then the next batch admitted at t_now + 1 (`offload.Planner.admit`), its
  exchange written as cap-long lists (the caller keeps the first `Offload._width` entries).

  Batch b's ids of table t: ring_ids[b, id_off[t]:id_off[t + 1]]; its distinct rows:
  ring_rows[b, id_off[t]:][:ring_n[b, t]]. win: int64[W] ring rows of the look-ahead window
  (nearest first; used by policy 2).
  out int32, per table at out_off[t]: ids n | (unique n | inverse n) | evict_slots cap |
  evict_rows cap | load_rows cap | load_slots cap | next_from_now cap, padded as
  offload.Offload._pack. next_from_now (each load's position among the "now" exchange's
  write-backs) is 0 throughout, the length of the "now" lists: the steady state has no
  "now" exchange (the batch was admitted by the previous step).
  stats int64[T, 3]: hits, loads, write-backs of the admission.
  """
  n_win = win.shape[0]
  for t in range(t_lo, t_hi):
    a, b = id_off[t], id_off[t + 1]
    n = b - a
    ro, so = row_off[t], slot_off[t]
    c = slot_off[t + 1] - so
    o = out_off[t]
    nr = ring_n[cur, t]
    # -- this batch: slots; dedup (unique = the distinct rows' slots, in row order;
    # inverse = each id's position among the distinct rows, found through its slot)
    if needs_unique:
      pos = np.empty(c, np.int32)
      for j in range(n):
        if j < nr:
          s = row_slot[ro + ring_rows[cur, a + j]]
          out[o + n + j] = s
          pos[s] = j
        else:
          out[o + n + j] = c
    for i in range(n):
      x = ring_ids[cur, a + i]
      if x >= 0:
        s = row_slot[ro + x]
        out[o + i] = s
        if needs_unique:
          out[o + 2 * n + i] = pos[s]
      else:
        out[o + i] = c
        if needs_unique:
          out[o + 2 * n + i] = nr
    for j in range(nr):
      r = ring_rows[cur, a + j]
      dirty[so + row_slot[ro + r]] = True
      if policy == 1:
        freq[ro + r] += 1
    # -- admit the next batch at t_now + 1
    tt = t_now + 1
    e = o + (3 * n if needs_unique else n)
    k_cap = cap[t]
    for j in range(k_cap):
      out[e + j] = c
      out[e + k_cap + j] = evict_pad[t]
      out[e + 2 * k_cap + j] = 0
      out[e + 3 * k_cap + j] = c
      out[e + 4 * k_cap + j] = 0
    na = ring_n[ahead, t]
    hits = 0
    miss = np.empty(na, np.int64)
    m = 0
    for j in range(na):
      r = ring_rows[ahead, a + j]
      s = row_slot[ro + r]
      if s >= 0:
        last_used[so + s] = tt
        hits += 1
      else:
        miss[m] = r
        m += 1
    stats[t, 0] = hits
    stats[t, 1] = m
    stats[t, 2] = 0
    if m == 0:
      continue
    nfree = 0
    for s in range(c):
      if slot_row[so + s] < 0:
        nfree += 1
    victim = np.zeros(c, np.bool_)
    if nfree >= m:
      got = 0
      for s in range(c):
        if got == m:
          break
        if slot_row[so + s] < 0:
          victim[s] = True
          got += 1
    else:
      keys = np.empty(c, np.int64)
      nxt = np.full(c, -1, np.int64)
      if policy == 2:
        for w in range(n_win - 1, -1, -1):
          bw = win[w]
          for j in range(ring_n[bw, t]):
            s = row_slot[ro + ring_rows[bw, a + j]]
            if s >= 0:
              nxt[s] = w
      for s in range(c):
        r = slot_row[so + s]
        if r < 0:
          keys[s] = PROTECTED
          victim[s] = True  # free slots are taken first
        elif policy == 0:
          keys[s] = last_used[so + s]
        elif policy == 1:
          keys[s] = (freq[ro + r] << 32) | last_used[so + s]
        elif nxt[s] >= 0:
          keys[s] = NEEDED + (FAR - nxt[s])
        else:
          keys[s] = last_used[so + s]
      for j in range(na):
        s = row_slot[ro + ring_rows[ahead, a + j]]
        if s >= 0:
          keys[s] = PROTECTED
      k = m - nfree
      v = np.partition(keys, k - 1)[k - 1]
      below = 0
      for s in range(c):
        if keys[s] < v:
          victim[s] = True
          below += 1
      left = k - below
      for s in range(c):
        if left == 0:
          break
        if keys[s] == v:
          victim[s] = True
          left -= 1
    # Victims in slot order receive the missing rows in row order (as the numpy planner).
    j = 0
    nb = 0
    for s in range(c):
      if not victim[s]:
        continue
      old = slot_row[so + s]
      if old >= 0:
        if dirty[so + s]:
          out[e + nb] = s
          out[e + k_cap + nb] = old
          nb += 1
        row_slot[ro + old] = -1
      r = miss[j]
      slot_row[so + s] = r
      row_slot[ro + r] = s
      last_used[so + s] = tt
      dirty[so + s] = False
      out[e + 2 * k_cap + j] = r
      out[e + 3 * k_cap + j] = s
      j += 1
    stats[t, 2] = nb
