"""Host memory behaviour of the process.

XLA:CPU allocates a jitted step's temporaries with malloc on every execution (a DLRM step:
one block of tens of MB). Three glibc behaviours hand those pages back to the kernel after
each step, so the next step faults them in again (the figures: docs/running.md,
"Measurements behind the host-side code"):

1. Blocks above the mmap threshold (32 MiB at most by default) are mmapped and unmapped.
2. XLA runs on its own threads, whose malloc arenas are 64 MiB "heaps". A block that does not
   fit the thread's current heap gets a new heap, and when it is freed the whole heap is
   unmapped (glibc's heap_trim deletes an emptied heap whatever M_TRIM_THRESHOLD says; only a
   top pad of a heap's size keeps it). Whether a run lands there depends on what its heaps
   held when the first step ran, so a step can run at two speeds.
3. A block larger than a thread heap (HEAP_MAX_SIZE, 64 MiB) never fits one: glibc mmaps it
   whatever the mmap threshold, and unmaps it on free, until every thread allocates from the
   main arena (glibc.malloc.arena_max=1), which grows by brk without a size limit. That is
   `keep_freed_memory(arenas=1)`, not the default: one arena makes XLA:CPU's threads share
   one malloc lock, which slows a step whose temporaries stay under 64 MiB.

`keep_freed_memory()` sets the knobs against 1. and 2. (and 3. with arenas=1): no mmap,
munmap, mprotect or page fault in the step loop of a step under 64 MiB. The arena limit acts
on threads that have not yet allocated, so it belongs at process start, before jax starts
its threads (run.py calls keep_freed_memory there, and the trainer again, harmlessly).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
# glibc's HEAP_MAX_SIZE on 64-bit (2 x the 32 MiB DEFAULT_MMAP_THRESHOLD_MAX): a top pad of a
# whole heap makes heap_trim keep every thread heap it has made.
_HEAP_MAX_SIZE = 64 << 20
_done = False


def keep_freed_memory(mmap_threshold_bytes: int = 1 << 30, arenas: int | None = None) -> bool:
  """Make glibc malloc keep and reuse freed memory below `mmap_threshold_bytes`.

  Blocks smaller than the threshold come from the heaps and stay there when freed (no trim,
  and thread heaps are never unmapped), so per-step temporaries are reused without page
  faults; larger blocks (big tables) are still mmapped. The cost: up to 64 MiB of address
  space (not memory: pages are committed only when touched) beyond what a heap holds.
  arenas: the most malloc arenas (glibc.malloc.arena_max; 0 leaves glibc's default of 8 per core):
  with 1 every thread that allocates after this call uses the main arena, which has no 64 MiB limit
  per block (3. above); the price is one lock for all threads' mallocs. None: the environment's
  RECGNN_MALLOC_ARENAS, else 0 (so `RECGNN_MALLOC_ARENAS=1 python run.py ...` trains a DCNv2-size
  step without the faults). Process-wide, idempotent; returns False where libc is not glibc.
  """
  global _done
  if _done:
    return True
  if arenas is None:
    arenas = int(os.environ.get("RECGNN_MALLOC_ARENAS", "0") or 0)
  try:
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    ok = libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold_bytes) == 1
    ok = ok and libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1
    ok = ok and libc.mallopt(_M_TOP_PAD, _HEAP_MAX_SIZE) == 1
    if arenas:
      ok = ok and libc.mallopt(_M_ARENA_MAX, arenas) == 1
  except (OSError, AttributeError, TypeError):
    return False
  _done = ok
  return ok


# ----------------------------------------------------------------------------- allocator

ALLOCATOR_ENV = "RECGNN_MALLOC"  # auto (default) | glibc | tcmalloc | jemalloc | a .so path
_ACTIVE_ENV = "RECGNN_MALLOC_ACTIVE"  # set in the re-executed process: the library in use
# What each library is called by the dynamic linker, and the settings that make it keep freed
# memory (the point: a step's temporaries reused without page faults).
_LIBRARIES = {
  "tcmalloc": (("libtcmalloc_minimal.so.4", "tcmalloc_minimal", "tcmalloc"),
               {"TCMALLOC_RELEASE_RATE": "0"}),
  "jemalloc": (("libjemalloc.so.2", "jemalloc"),
               {"MALLOC_CONF": "dirty_decay_ms:-1,muzzy_decay_ms:-1"}),
}  # fmt: skip
# Where benchmarks/get_allocators.sh unpacks them (a checkout without root access).
_LOCAL_DIR = os.path.join(
  os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".allocators"
)


def find_allocator(name: str) -> str | None:
  """The shared library of allocator `name` (tcmalloc, jemalloc): the checkout's .allocators/
  (benchmarks/get_allocators.sh), else the dynamic linker's cache; None if neither has it."""
  files, _ = _LIBRARIES[name]
  local = os.path.join(_LOCAL_DIR, files[0])
  if os.path.exists(local):
    return local
  for f in files[1:]:
    found = ctypes.util.find_library(f)
    if found:
      return found
  return None


def preload_allocator(argv: list[str] | None = None) -> str:
  """Run this process under a maintained allocator: called first thing by run.py, before jax
  loads. RECGNN_MALLOC=auto (default) re-executes the process (same pid, same arguments) with
  tcmalloc preloaded when it is found (`find_allocator`), else keeps glibc's malloc (with
  `keep_freed_memory`); `tcmalloc` / `jemalloc` / a path insist (an error if missing);
  `glibc` never preloads. Returns what the process runs with, for the log.

  Why: tcmalloc told to keep freed memory runs a step under 64 MiB of temporaries as fast as
  glibc with `keep_freed_memory`, and one over it (3. above) without the page faults, with no
  shared malloc lock: the one setting that serves both (docs/running.md)."""
  active = os.environ.get(_ACTIVE_ENV)
  if active:
    return active
  choice = os.environ.get(ALLOCATOR_ENV, "auto") or "auto"
  if choice == "glibc":
    return "glibc"
  if choice in ("auto", *_LIBRARIES):
    name = "tcmalloc" if choice == "auto" else choice
    lib = find_allocator(name)
    settings = _LIBRARIES[name][1]
  elif os.path.exists(choice):
    name, lib, settings = os.path.basename(choice), choice, {}
  else:
    raise SystemExit(
      f"{ALLOCATOR_ENV}={choice!r}: use auto, glibc, {', '.join(_LIBRARIES)} or the path of an "
      "allocator's shared library"
    )
  if lib is None:
    if choice == "auto":
      return "glibc (no tcmalloc found: bash benchmarks/get_allocators.sh installs one locally)"
    raise SystemExit(
      f"{ALLOCATOR_ENV}={choice}: no {name} library in .allocators/ or on the linker's path; "
      "run bash benchmarks/get_allocators.sh, or give its path"
    )
  env = {**settings, **os.environ}  # the user's own settings win
  env["LD_PRELOAD"] = ":".join(x for x in (lib, os.environ.get("LD_PRELOAD", "")) if x)
  env[_ACTIVE_ENV] = f"{name} ({lib})"
  argv = sys.argv if argv is None else argv
  os.execve(sys.executable, [sys.executable, *argv], env)
  raise AssertionError("unreachable")  # execve does not return
