"""A GIL-free kernel run over contiguous chunks of its work on several threads of this process.

Why: the input side's compiled kernels (the one-hot batch read, data/batch_gather.py; the
stacked dedup, embeddings/kernels.py; the offload planner) release the GIL, and a large
batch's work splits into independent ranges (rows of a batch, tables of a group) whose
outputs are disjoint. One thread per range is how a many-core host reads and prepares a large
batch in a fraction of one core's time: random reads of memmapped rows are memory-latency
bound, so more threads keep more cache misses in flight.

Threads: `threads()` is decided once per process: $RECGNN_HOST_THREADS when set (1: every
kernel one plain call), else half the CPUs this process may run on
(`os.sched_getaffinity`), at most `MAX_DEFAULT_THREADS`: 8 on a 16-core host, 1 on a
2-core one. Half, as the offload planner's threads: the input shares the cores with the
step's host threads (and on a shared machine with others), and a chunk waiting for a busy
core costs more than the split gains (docs/running.md, "Measurements behind the host-side
code"). Callers decide how many chunks pay (a minimum of work per chunk, set per kernel),
`chunks` cuts the work. (The offload planner cuts its tables by its own count,
RECGNN_HOSTPLAN_THREADS, and only `run`s.)

Fork: the trainer forks its input worker (train/input_worker.py) after the parent may have
used the pool; a thread does not survive fork, so a child must not submit to its parent's
pool (its work would never run). The pool is kept per process id: a forked child makes its
own at its first chunked call.
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Callable, Sequence

ENV = "RECGNN_HOST_THREADS"
MAX_DEFAULT_THREADS = 8
# Threads are started on demand (an idle one is reused first), so this only bounds callers
# that chunk at once (the input worker's read and prepare, the planner) beyond `threads()`.
_MAX_WORKERS = 64

_threads: int | None = None
_pools: dict[int, concurrent.futures.ThreadPoolExecutor] = {}


def threads() -> int:
  """Threads a chunked kernel may use in this process (see the module docstring)."""
  global _threads
  if _threads is None:
    _threads = _decide()
  return _threads


def _decide() -> int:
  raw = os.environ.get(ENV, "").strip()
  if raw and raw != "0":
    try:
      n = int(raw)
    except ValueError:
      raise ValueError(f"${ENV}={raw!r}: expected a thread count (1 = no threads)") from None
    if n < 1:
      raise ValueError(f"${ENV}={raw!r}: expected a thread count >= 1 (0 or unset: auto)")
    return n
  try:
    cpus = len(os.sched_getaffinity(0))
  except AttributeError:  # (not Linux)
    cpus = os.cpu_count() or 1
  return max(1, min(MAX_DEFAULT_THREADS, cpus // 2))


def set_threads(n: int | None) -> int:
  """Override `threads()` in this process (and children forked after); None decides again
  from the environment. Returns the previous value (for tests and benchmarks to restore)."""
  global _threads
  old = threads()
  _threads = None if n is None else max(1, int(n))
  return old


def chunks(n: int, min_per_chunk: int) -> list[int]:
  """Cuts 0 = c_0 < c_1 < ... < c_k = n of n items into k near-equal contiguous chunks: k =
  `threads()`, fewer so that each chunk has >= min_per_chunk items, at least 1. [0, n] is
  one chunk: a plain call."""
  k = max(1, min(threads(), n // max(1, min_per_chunk)))
  q, r = divmod(n, k)
  return [i * q + min(i, r) for i in range(k + 1)]


def run(fn: Callable[[int, int], object], cuts: Sequence[int]) -> None:
  """fn(cuts[i], cuts[i + 1]) for every chunk, at once: the first on the calling thread, the
  others on this process's pool; returns when all are done (raising the first error). fn
  must release the GIL to gain anything, and its chunks must write disjoint outputs."""
  if len(cuts) <= 2:
    if len(cuts) == 2:
      fn(cuts[0], cuts[1])
    return
  pool = _pool()
  futures = [pool.submit(fn, cuts[i], cuts[i + 1]) for i in range(1, len(cuts) - 1)]
  try:
    fn(cuts[0], cuts[1])
  finally:  # (never leave chunks writing into arrays the caller is about to drop)
    concurrent.futures.wait(futures)
  for f in futures:
    f.result()


def _pool() -> concurrent.futures.ThreadPoolExecutor:
  pid = os.getpid()
  pool = _pools.get(pid)
  if pool is None:
    for stale in [p for p in _pools if p != pid]:  # a parent's: its threads did not fork
      del _pools[stale]
    made = concurrent.futures.ThreadPoolExecutor(_MAX_WORKERS, thread_name_prefix="recgnn host")
    pool = _pools.setdefault(pid, made)  # (two first callers at once: one pool wins)
    if pool is not made:
      made.shutdown(wait=False)
  return pool
