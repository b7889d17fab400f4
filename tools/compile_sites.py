"""Where a pytest run's XLA compile requests come from: a pytest plugin and its summary.

    RECGNN_COMPILE_SITES=/tmp/sites PYTHONPATH=tools python -m pytest -p compile_sites
    python tools/compile_sites.py /tmp/sites [--top=30]

The plugin turns on jax's `jax_log_compiles` and reads its "Finished XLA compilation of
jit(NAME) in T s" records with a logging handler, keyed by NAME and the three innermost
frames of recgnn/ or tests/ code on the stack; each process (the workers, not the processes
tests start) writes its counts to the directory at exit. A hit of the persistent cache is
logged as a compile too (~0.01-0.07 s), a program the process already holds is not: on a
warm cache it counts the programs each run loads, on a cold one those it compiles. tests/
README.md ("Library code run op by op") has what it found: eager programs of library code.
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import re
import sys
import traceback

ENV = "RECGNN_COMPILE_SITES"
_RECORD = re.compile(r"Finished XLA compilation of jit\((\w+)\) in ([0-9.e-]+) s")


class _Handler(logging.Handler):
  def __init__(self):
    super().__init__(logging.DEBUG)
    self.count: collections.Counter = collections.Counter()
    self.seconds: collections.Counter = collections.Counter()

  def emit(self, record):
    m = _RECORD.search(record.getMessage())
    if not m:
      return
    ours = [
      f for f in traceback.extract_stack()
      if ("/recgnn/" in f.filename or "/tests/" in f.filename) and __file__ != f.filename
    ]  # fmt: skip
    site = " < ".join(f"{os.path.basename(f.filename)}:{f.lineno}:{f.name}" for f in ours[:-4:-1])
    key = f"{m.group(1)}\t{site}"
    self.count[key] += 1
    self.seconds[key] += float(m.group(2))


def _install(directory: str) -> None:
  import jax

  jax.config.update("jax_log_compiles", True)
  handler = _Handler()
  for name in ("jax._src.dispatch", "jax._src.interpreters.pxla", "jax._src.compiler"):
    log = logging.getLogger(name)
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
  os.makedirs(directory, exist_ok=True)

  @atexit.register
  def _write():
    with open(os.path.join(directory, f"sites_{os.getpid()}.tsv"), "w") as f:
      for key, n in handler.count.most_common():
        f.write(f"{n}\t{handler.seconds[key]:.3f}\t{key}\n")


if os.environ.get(ENV) and "pytest" in sys.modules:
  _install(os.environ[ENV])


def main(argv: list[str]) -> None:
  top = next((int(a.split("=", 1)[1]) for a in argv if a.startswith("--top=")), 30)
  directory = next(a for a in argv if not a.startswith("--"))
  count: collections.Counter = collections.Counter()
  seconds: collections.Counter = collections.Counter()
  for name in os.listdir(directory):
    with open(os.path.join(directory, name)) as f:
      for line in f:
        n, s, op, site = line.rstrip("\n").split("\t")
        count[(op, site)] += int(n)
        seconds[(op, site)] += float(s)
  print(f"{sum(count.values())} compile requests, {sum(seconds.values()):.1f} s")
  by_op: collections.Counter = collections.Counter()
  for (op, _), n in count.items():
    by_op[op] += n
  print("by program:", ", ".join(f"{op} {n}" for op, n in by_op.most_common(12)))
  for (op, site), n in count.most_common(top):
    print(f"{n:6d} {seconds[(op, site)]:7.2f} s  {op} <- {site}")


if __name__ == "__main__":
  main(sys.argv[1:])
