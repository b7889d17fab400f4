"""The process's environment, set before jax is imported: which tree's recgnn is imported, and
how many simulated CPU devices XLA makes.

  tree_on_path()          this checkout (or $RECGNN_BENCH_TREE, a --against child's tree)
                          first on sys.path: its recgnn, experiments and run.py, not an
                          installed copy's (the harness calls it when imported)
  simulated_devices(n)    XLA:CPU with n devices, the collective timeouts of recgnn.xla_env

Nothing here imports jax: XLA reads its flags once, when jax first initialises a backend.
"""

from __future__ import annotations

import os
import pathlib
import sys

#: The checkout this harness belongs to (benchmarks/harness/ -> the repository root).
ROOT = pathlib.Path(__file__).resolve().parents[2]
#: A child process measuring another tree (an --against commit's `git archive`) names that
#: tree here, so that its recgnn is the one imported (benchmarks/host_path.py).
TREE_VAR = "RECGNN_BENCH_TREE"
SIMULATED = "--xla_force_host_platform_device_count"


def tree() -> str:
  """The tree whose recgnn this process measures: $RECGNN_BENCH_TREE, else this checkout."""
  return os.environ.get(TREE_VAR) or str(ROOT)


def tree_on_path() -> str:
  """Put `tree()` first on sys.path (once) and return it: `python benchmarks/x.py` has only
  benchmarks/ there, and an editable install of another checkout must not win."""
  t = tree()
  if not sys.path or sys.path[0] != t:
    if t in sys.path:
      sys.path.remove(t)
    sys.path.insert(0, t)
  return t


def jax_initialised() -> bool:
  """Whether jax has already created a backend (after which XLA_FLAGS changes nothing)."""
  if "jax" not in sys.modules:
    return False
  from jax._src import xla_bridge  # jax is imported already: this costs nothing

  return xla_bridge.backends_are_initialized()


def simulated_devices(n: int) -> int:
  """XLA:CPU with `n` devices in this process, unless XLA_FLAGS already sets a count (the
  caller's choice wins); with simulated devices, recgnn.xla_env's generous collective
  timeouts and async dispatch off. Returns the count in effect.

  Call it before the first jax computation: afterwards XLA has read its flags, and this
  refuses rather than leave a benchmark on the wrong number of devices."""
  flags = os.environ.get("XLA_FLAGS", "")
  if SIMULATED not in flags:
    if jax_initialised():
      raise RuntimeError(
        f"harness.simulated_devices({n}): jax already initialised its backend; call it before "
        "the first jax computation (at the top of the script), or set XLA_FLAGS="
        f"{SIMULATED}={n} in the environment"
      )
    os.environ["XLA_FLAGS"] = f"{flags} {SIMULATED}={n}".strip()
  from recgnn import xla_env  # stdlib only: safe before jax

  xla_env.relax_simulated_device_timeouts()
  value = os.environ["XLA_FLAGS"].split(f"{SIMULATED}=")[1].split()[0]
  return int(value)
