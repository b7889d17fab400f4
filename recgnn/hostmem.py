"""Host memory behaviour of the process.

glibc returns freed blocks above its mmap threshold (32 MiB at most) to the OS, so a jitted
step whose XLA temporaries exceed that (a DLRM step at batch 2048: 44 MiB) maps fresh pages
and faults them in on every step: measured ~11k page faults and 28% of the step's CPU time
(benchmarks/dlrm_throughput.py --profile), and 3x slower bulk graph sampling.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_done = False


def keep_freed_memory(mmap_threshold_bytes: int = 1 << 30) -> bool:
  """Make glibc malloc keep and reuse freed memory below `mmap_threshold_bytes`.

  Blocks smaller than the threshold come from the heap and stay there when freed (no trim),
  so per-step temporaries are reused without page faults; larger blocks (big tables) are
  still mmapped. Process-wide, idempotent; returns False where libc is not glibc.
  """
  global _done
  if _done:
    return True
  try:
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    ok = libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold_bytes) == 1
    ok = ok and libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1
  except (OSError, AttributeError, TypeError):
    return False
  _done = ok
  return ok
