"""Compiled host-side planning kernels (numba): the offload planner's steady-state step for
every table of a group in one call, spread over the cores.

Why compiled: the numpy planner spends most of its time in Python, not in arithmetic
(~50 small numpy calls per table per batch; benchmarks/README.md "Input thread"). One call
per group, a loop per table, removes
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

import os

import numpy as np

from recgnn import hostpool

try:
  import numba
  from numba import njit

  AVAILABLE = True
except ImportError:  # the numpy planner runs instead (same decisions, slower)
  numba = None
  AVAILABLE = False

POLICY_CODES = {"lru": 0, "lfu": 1, "lookahead": 2}
# Keys of offload.Planner.eviction_keys (kept in step with offload.py).
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


# Default: half the cores (at most 8), as the input thread shares them with the step.
# RECGNN_HOSTPLAN_THREADS overrides it.
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
  run at once (the kernels release the GIL) on `hostpool`'s threads (its own per forked
  process). One range: a plain call, no pool."""
  k = max(1, min(_THREADS, num_tables))
  cuts = [int(c) for c in np.linspace(0, num_tables, k + 1).astype(int)]
  hostpool.run(lambda lo, hi: kernel(*args, lo, hi), cuts)


@_jit()
def distinct(ids, sorted_ids, id_off, num_rows, rows, count, bad, t_lo, t_hi):
  """Sorted distinct non-padding ids of tables [t_lo, t_hi) of one batch, written in place.

  ids int64[sum n_t] (table t at id_off[t]:id_off[t + 1]; < 0 = padding); sorted_ids: each
  table's slice sorted (numpy's vectorized sort: numba's is several x slower), or empty to sort
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


# -- the recency log: victims in O(misses + window), not O(C)
#
# Victim selection over every slot's key (numpy's `Planner.admit`: `smallest` over C keys) cost
# O(C) per table per batch.
# For lru and lookahead, the victims are the least recently used slots that the policy does not
# keep (not needed within the window, not hits of the admitted batch), ties to the smaller slot.
# Each table keeps a log of (slot, time) entries appended in time order whenever a slot's
# last_used changes (times only grow), so the least recently used slots are at its head: an
# entry is current while last_used[slot] == its time (every occupied slot has exactly one
# current entry). A selection reads the log from its head by groups of one time (a group's
# candidates taken whole, or the smallest slots of the last one: the `smallest` order), drops
# the stale and taken entries it read, and keeps the skipped ones in order. Free slots are
# counted (`nfree`) and found from a cursor (slots only become free at init / restore).
# The numpy planner's admissions (first batch, after eval, ...) do not keep the log: the
# group's `SteadyPlanner` marks it invalid, and the kernel rebuilds it from the state.

LOG_PER_SLOT = 4  # log entries per cache slot (compacted in place when full)

# A slot's mark, set where the policy keeps it in a call: (gen << MARK_BITS) | code, gen the
# call's time (t_now + 1: it grows with every batch planned), code n_win for the admitted
# batch's hits, w for a row next needed by window batch w, KEPT_ONCE once counted. A mark of
# an earlier call is no mark: nothing is unmarked, so no second pass of row lookups (the
# window is read from each row's stamp, `need`, and marked only for the Belady fallback).
MARK_BITS = 16
KEPT_ONCE = (1 << MARK_BITS) - 1
NO_WINDOW = np.iinfo(np.int64).max  # a window start no row's stamp reaches


@_jit()
def _log_rebuild(so, lo, c, slot_row, last_used, log_slot, log_time):
  """The log of one table from its state: every occupied slot by (last_used, slot).
  -> (entries, free slots, first free slot)."""
  occ = 0
  for s in range(c):
    if slot_row[so + s] >= 0:
      occ += 1
  slots = np.empty(occ, np.int64)
  times = np.empty(occ, np.int64)
  k = 0
  first_free = c
  for s in range(c):
    if slot_row[so + s] >= 0:
      slots[k] = s
      times[k] = last_used[so + s]
      k += 1
    elif first_free == c:
      first_free = s
  order = np.argsort(times, kind="mergesort")  # stable: ties stay in slot order
  for j in range(occ):
    log_slot[lo + j] = slots[order[j]]
    log_time[lo + j] = times[order[j]]
  return occ, c - occ, first_free


@_jit()
def _log_compact(so, lo, head, tail, slot_row, last_used, log_slot, log_time):
  """The current entries of log [head, tail) moved to its start, in order. -> their count."""
  w = 0
  for i in range(head, tail):
    s = log_slot[lo + i]
    tm = log_time[lo + i]
    if slot_row[so + s] >= 0 and last_used[so + s] == tm:
      log_slot[lo + w] = s
      log_time[lo + w] = tm
      w += 1
  return w


@_jit()
def _log_victims(
  so,
  lo,
  head,
  tail,
  k,
  slot_row,
  last_used,
  mark,
  gen,
  need,
  ro,
  start,
  log_slot,
  log_time,
  grp,
  vic,
  nv,
):
  """The k least recently used slots the policy does not keep (not marked in this call,
  mark >> MARK_BITS != gen, and their row not needed by a window batch, need[ro + row] <
  start; start NO_WINDOW: no window, need not read), ties to the smaller slot, appended to
  vic[nv:]; the log's entries read are dropped (stale, taken) or kept in order. grp:
  scratch (the table's slots). -> (the new head, how many taken)."""
  got = 0
  kept = 0  # kept entries, written at [head, head + kept) over the entries read
  i = head
  while i < tail and got < k:
    tm = log_time[lo + i]
    j = i
    g = 0
    while j < tail and log_time[lo + j] == tm:  # one group: candidates into grp
      s = log_slot[lo + j]
      if slot_row[so + s] >= 0 and last_used[so + s] == tm:
        if mark[so + s] >> MARK_BITS != gen and (
          start == NO_WINDOW or need[ro + slot_row[so + s]] < start
        ):
          grp[so + g] = s
          g += 1
        else:  # kept by the policy: stays in the log
          log_slot[lo + head + kept] = s
          log_time[lo + head + kept] = tm
          kept += 1
      j += 1
    if got + g > k:  # the last group: its smallest slots; the rest stays
      part = np.sort(grp[so : so + g])
      take = k - got
      for q in range(g):
        if q < take:
          vic[nv + got + q] = part[q]
        else:
          log_slot[lo + head + kept] = part[q]
          log_time[lo + head + kept] = tm
          kept += 1
      got = k
    else:
      for q in range(g):
        vic[nv + got + q] = grp[so + q]
      got += g
    i = j
  # The kept entries (times <= those read) just before the unread ones (times >= them).
  for q in range(kept - 1, -1, -1):
    log_slot[lo + i - kept + q] = log_slot[lo + head + q]
    log_time[lo + i - kept + q] = log_time[lo + head + q]
  return i - kept, got


# fmt: off
@_jit()
def plan_step(
  ring_ids, ring_rows, ring_n, id_off,  # batches: ids, sorted distinct rows, their counts
  cur, ahead, win,  # ring rows of this batch, the next one, and the window after it
  win_pos, win_new, need,  # the window's stream positions, which enter it now; row stamps
  row_off, slot_off, row_slot, slot_row, last_used, dirty, freq,  # planner state (flat)
  log_off, log_slot, log_time, log_head, log_tail, log_ok, nfree, free_lo,  # recency log
  mark, grp, pos,  # scratch: int64[sum C] (stamped per call, MARK_BITS), int64, int32[sum C]
  evict_pad, t_now, policy, needs_unique,
  out, out_off, cap, stats, t_lo, t_hi,
):  # fmt: on
  """One train batch of every table, the batch having been admitted by the previous step:
  the slots of its ids (+ unique / inverse for row-wise optimizers), its rows marked dirty
  (+ LFU counts); then the next batch admitted at t_now + 1 (`offload.Planner.admit`), its
  exchange written as cap-long lists (the caller keeps the first `Offload._width` entries).

  Batch b's ids of table t: ring_ids[b, id_off[t]:id_off[t + 1]]; its distinct rows:
  ring_rows[b, id_off[t]:][:ring_n[b, t]]. win: int64[W] ring rows of the look-ahead window
  (nearest first; used by policy 2), win_pos int64[W] their positions in the stream
  (consecutive), win_new bool[W] those whose rows are not stamped yet: need int32[sum N],
  each row's latest stamped position, is stamped with them here (a row is needed within the
  window iff need >= win_pos[0]: no pass over the window's rows per call). The recency log
  of table t (lru, lookahead): entries log_off[t] + [log_head[t], log_tail[t]), rebuilt
  first where log_ok[t] is 0.
  out int32, per table at out_off[t]: ids n | (unique n | inverse n) | evict_slots cap |
  evict_rows cap | load_rows cap | load_slots cap | next_from_now cap, padded as
  offload.Offload._pack. next_from_now (each load's position among the "now" exchange's
  write-backs) is 0 throughout, the length of the "now" lists: the steady state has no
  "now" exchange (the batch was admitted by the previous step).
  stats int64[T, 3]: hits, loads, write-backs of the admission.
  """
  n_win = win.shape[0]
  # Rows needed within the window: need >= start (none without a window: lru, lfu).
  start = win_pos[0] if policy == 2 and n_win else NO_WINDOW
  for t in range(t_lo, t_hi):
    a, b = id_off[t], id_off[t + 1]
    n = b - a
    ro, so, lo = row_off[t], slot_off[t], log_off[t]
    c = slot_off[t + 1] - so
    o = out_off[t]
    nr = ring_n[cur, t]
    if policy == 2:  # the batches entering the window: their rows needed up to them
      for w in range(n_win):
        if win_new[w]:
          bw = win[w]
          for j in range(ring_n[bw, t]):
            r = ro + ring_rows[bw, a + j]
            if need[r] < win_pos[w]:
              need[r] = win_pos[w]
    logged = policy != 1
    if not log_ok[t]:
      occ, nfree[t], free_lo[t] = _log_rebuild(so, lo, c, slot_row, last_used, log_slot, log_time)
      log_head[t], log_tail[t] = 0, occ if logged else 0
      log_ok[t] = 1
    # -- this batch: slots; dedup (unique = the distinct rows' slots, in row order;
    # inverse = each id's position among the distinct rows, found through its slot)
    if needs_unique:
      for j in range(n):
        if j < nr:
          s = row_slot[ro + ring_rows[cur, a + j]]
          out[o + n + j] = s
          pos[so + s] = j
        else:
          out[o + n + j] = c
    for i in range(n):
      x = ring_ids[cur, a + i]
      if x >= 0:
        s = row_slot[ro + x]
        out[o + i] = s
        if needs_unique:
          out[o + 2 * n + i] = pos[so + s]
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
    if logged and log_tail[t] + na > log_off[t + 1] - lo:  # full: keep the current entries
      log_tail[t] = _log_compact(so, lo, log_head[t], log_tail[t], slot_row, last_used,
                                 log_slot, log_time)  # fmt: skip
      log_head[t] = 0
    hits = 0
    miss = np.empty(na, np.int64)
    m = 0
    for j in range(na):
      r = ring_rows[ahead, a + j]
      s = row_slot[ro + r]
      if s >= 0:
        if logged and last_used[so + s] != tt:
          log_slot[lo + log_tail[t]] = s
          log_time[lo + log_tail[t]] = tt
          log_tail[t] += 1
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
    # Victims: free slots first (in slot order), then the policy's order over the others.
    vic = np.empty(m, np.int64)
    nv = 0
    s = free_lo[t]
    while nv < m and nfree[t] > 0:
      if slot_row[so + s] < 0:
        vic[nv] = s
        nv += 1
        nfree[t] -= 1
      s += 1
    while s < c and slot_row[so + s] >= 0:
      s += 1
    free_lo[t] = s
    k = m - nv
    if k > 0 and policy == 1:
      nv = _lfu_victims(so, ro, c, k, slot_row, last_used, freq, row_slot, ring_rows, ahead,
                        a, na, vic, nv)  # fmt: skip
    elif k > 0:
      stamp = tt << MARK_BITS  # (this call's marks; earlier calls' are no marks)
      for j in range(na):  # the admitted batch's hits stay (its misses have no slot yet)
        s = row_slot[ro + ring_rows[ahead, a + j]]
        if s >= 0:
          mark[so + s] = stamp | n_win
      log_head[t], got = _log_victims(so, lo, log_head[t], log_tail[t], k, slot_row, last_used,
                                      mark, tt, need, ro, start, log_slot, log_time, grp, vic,
                                      nv)  # fmt: skip
      nv += got
      if nv < m:  # the window does not fit: needed rows go, farthest next use first (Belady)
        for w in range(n_win - 1, -1, -1):  # each needed slot's nearest window batch
          bw = win[w]
          for j in range(ring_n[bw, t]):
            s = row_slot[ro + ring_rows[bw, a + j]]
            if s >= 0 and mark[so + s] != stamp | n_win:
              mark[so + s] = stamp | w
        g = 0
        for w in range(n_win):
          bw = win[w]
          for j in range(ring_n[bw, t]):
            s = row_slot[ro + ring_rows[bw, a + j]]
            if s >= 0 and mark[so + s] == stamp | w:
              grp[so + g] = (n_win - w) * c + s
              g += 1
              mark[so + s] = stamp | KEPT_ONCE  # counted once
        part = np.sort(grp[so : so + g])
        for q in range(m - nv):
          vic[nv + q] = part[q] % c
        nv = m
    vic.sort()
    # Victims in slot order receive the missing rows in row order (as the numpy planner).
    nb = 0
    for j in range(m):
      s = vic[j]
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
      if logged:
        log_slot[lo + log_tail[t]] = s
        log_time[lo + log_tail[t]] = tt
        log_tail[t] += 1
      out[e + 2 * k_cap + j] = r
      out[e + 3 * k_cap + j] = s
    stats[t, 2] = nb


@_jit()
def _lfu_victims(so, ro, c, k, slot_row, last_used, freq, row_slot, ring_rows, ahead, a, na,
                 vic, nv):  # fmt: skip
  """LFU's k victims among the occupied slots (`offload.Planner.eviction_keys`: count, then recency,
  then the smaller slot), the admitted batch's hits kept: O(C) (no log: counts change
  without touching a slot). Appended to vic[nv:]; -> the victims' count."""
  keys = np.empty(c, np.int64)
  for s in range(c):
    r = slot_row[so + s]
    keys[s] = PROTECTED if r < 0 else (freq[ro + r] << 32) | last_used[so + s]
  for j in range(na):
    s = row_slot[ro + ring_rows[ahead, a + j]]
    if s >= 0:
      keys[s] = PROTECTED
  v = np.partition(keys, k - 1)[k - 1]
  below = 0
  for s in range(c):
    if keys[s] < v:
      vic[nv + below] = s
      below += 1
  left = k - below
  for s in range(c):
    if left == 0:
      break
    if keys[s] == v:
      vic[nv + below] = s
      below += 1
      left -= 1
  return nv + below
