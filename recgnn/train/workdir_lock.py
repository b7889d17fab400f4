"""One run per workdir: a lock file naming the process that holds it.

`workdir/lock` holds {"pid", "host", "started", "argv"} of the run (process 0 of a run over
many processes: they share the workdir legitimately, and only process 0 writes to it). The
holder keeps an exclusive `flock` on the file for as long as it lives, so:
  - a second run on the same host finds the flock taken and is refused, naming the holder;
  - a run that died (SIGKILL, OOM, power loss) released its flock with its file descriptor:
    the next run takes the lock over, saying whose it was;
  - a lock written on ANOTHER host cannot be checked from here (flock is not reliable across
    network file systems): it is refused, with the file to delete if that run is gone.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket
import sys

LOCK_NAME = "lock"


class WorkdirLocked(RuntimeError):
  """Another live run holds the workdir."""


class WorkdirLock:
  """Exclusive ownership of a workdir while the run lives; `release()` (or process exit)
  gives it up. `took_over`: the holder's record when a stale lock was replaced, else None."""

  def __init__(self, workdir: str, log=print):
    os.makedirs(workdir, exist_ok=True)
    self.path = os.path.join(os.path.abspath(workdir), LOCK_NAME)
    self.took_over: dict | None = None
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      previous = _read(fd)
      host = socket.gethostname()
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except OSError as e:
        if e.errno not in (errno.EAGAIN, errno.EACCES):
          raise
        raise WorkdirLocked(self._refusal(previous, "is running")) from None
      if previous:
        if previous.get("host") != host:
          # Its flock may not be visible from here (network file systems): nothing on this
          # host can tell whether that run is gone.
          fcntl.flock(fd, fcntl.LOCK_UN)
          raise WorkdirLocked(self._refusal(previous, "may be running"))
        # Same host, flock free: the holder died without releasing it (a live holder keeps
        # its flock, and a finished run leaves the file empty).
        self.took_over = previous
        log(
          f"Taking over {self.path} from pid {previous.get('pid')} on {previous.get('host')} "
          f"(started {previous.get('started', '?')}): that process is gone."
        )
      record = {
        "pid": os.getpid(),
        "host": host,
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "argv": sys.argv,
      }
      os.ftruncate(fd, 0)
      os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
      os.fsync(fd)
    except BaseException:
      os.close(fd)
      raise
    self._fd: int | None = fd

  def _refusal(self, holder: dict | None, state: str) -> str:
    holder = holder or {}
    who = f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}"
    since = f", started {holder['started']}" if holder.get("started") else ""
    workdir = os.path.dirname(self.path)
    return (
      f"{workdir} is in use: {who}{since} {state} there ({self.path}). Two runs in one workdir "
      "would overwrite each other's checkpoints. Wait for it to end (or stop it), or use "
      f"another --workdir; if that process is gone (e.g. another host's crashed run), delete "
      f"{self.path}."
    )

  def release(self) -> None:
    if self._fd is None:
      return
    try:
      os.ftruncate(self._fd, 0)  # an empty lock file: nobody holds it
      fcntl.flock(self._fd, fcntl.LOCK_UN)
    finally:
      os.close(self._fd)
      self._fd = None

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.release()


def _read(fd: int) -> dict | None:
  try:
    text = os.pread(fd, 1 << 16, 0).decode()
    return json.loads(text) if text.strip() else None
  except (OSError, ValueError, UnicodeDecodeError):
    return None
