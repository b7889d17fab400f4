"""A daemon thread that serves an object's job queue while the object lives, and ends with it.

Why: a thread whose target is a bound method (`target=self._run`) holds its object, so the
object is never collected: its host arrays, its last job (a write-back's arrays) and its files
stay until the process ends. Host tiers start such a thread per group (the write-backs, the
SSD level's reads ahead); a process that builds many groups (a notebook, a sweep, a test
suite) kept every one of them: one test process had 94 idle writer threads after two test
files (test_offload, test_hot_cold), each holding its group's host tables. Here the thread
holds its owner only weakly, and never while it waits for a job; a finalizer wakes it when
the owner is collected, and it exits.
"""

from __future__ import annotations

import queue
import threading
import weakref


def serve(owner: object, jobs: queue.Queue, method: str, name: str) -> threading.Thread:
  """Start a daemon thread that calls `getattr(owner, method)(job)` for each job put on
  `jobs`, in order, marking each `jobs.task_done()` (so `jobs.join()` waits for them). A None
  job ends it; one is put when `owner` is collected. The method handles its own errors: one
  that escapes ends the thread."""
  ref = weakref.ref(owner)
  weakref.finalize(owner, jobs.put, None)
  thread = threading.Thread(target=_loop, args=(ref, jobs, method), name=name, daemon=True)
  thread.start()
  return thread


def _loop(ref: weakref.ref, jobs: queue.Queue, method: str) -> None:
  while True:
    job = jobs.get()
    try:
      if job is None or not _run(ref, method, job):
        return
    finally:
      job = None  # (not held while waiting for the next one)
      jobs.task_done()


def _run(ref: weakref.ref, method: str, job) -> bool:
  """One job on the owner, which is held only for the call. False: the owner is gone."""
  owner = ref()
  if owner is None:
    return False
  getattr(owner, method)(job)
  return True
