"""Can the contract tests fail? Plant a one-ulp bug in one backend's update and run them.

  python tests/planted_bug.py                     # offload, the contract's exactness tests
  python tests/planted_bug.py --backend=hot_cold
  python tests/planted_bug.py --backend=sharded   # sharded(kind=table), the exact placement

The bug: every row the backend's sparse update changes comes out one float32 ulp above the
right value (`jnp.nextafter` toward +inf), in that backend's module only (dense, the
reference, is untouched): the shared update it calls (`base.sparse_sgd_or_adagrad`, or
sharded's `row_sharded.update`) as that module sees it. The exactness tests compare bit for
bit on CPU, so they must fail with the bug and pass without it; the script runs both in fresh
processes (no workers, the persistent compilation cache as the suite has it) and exits 1
unless both hold.

As a pytest plugin (`-p tests.planted_bug`, with RECGNN_PLANT_ULP_BUG=<backend>) it plants the
bug at import; without the variable it does nothing. Not collected as a test file
and not in CI: a check of the suite, run by hand after changing the contract tests.
"""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys

ENV = "RECGNN_PLANT_ULP_BUG"
# backend -> (its module that calls the shared sparse update, the name it imports the update's
# module by, the update's name there, the contract tests' -k filter)
TARGETS = {
  "offload": (
    "recgnn.backends.offload.device_step", "base", "sparse_sgd_or_adagrad",
    "test_matches_dense and offload",
  ),
  "hot_cold": (
    "recgnn.backends.hot_cold.device", "base", "sparse_sgd_or_adagrad",
    "test_matches_dense and hot_cold",
  ),
  "sharded": (
    "recgnn.backends.sharded.step", "row_sharded", "update",
    "test_matches_dense and sharded and table",
  ),
}  # fmt: skip


class _OneUlpHigh:
  """A shared module as one backend module sees it, its sparse update `fn` one ulp off."""

  def __init__(self, module, fn: str):
    self._module, self._fn = module, fn

  def __getattr__(self, name):
    got = getattr(self._module, name)
    if name != self._fn:
      return got

    def one_ulp_high(spec, table, *args, **kwargs):
      import jax.numpy as jnp

      new, slots = got(spec, table, *args, **kwargs)
      return jnp.where(new != table, jnp.nextafter(new, jnp.inf), new), slots

    return one_ulp_high


def _plant(target: str) -> None:
  module_name, attr, fn, _ = TARGETS[target]
  module = importlib.import_module(module_name)
  setattr(module, attr, _OneUlpHigh(getattr(module, attr), fn))


if os.environ.get(ENV):  # imported as a plugin with the bug asked for
  _plant(os.environ[ENV])


def _run(backend: str, planted: bool) -> int:
  selection = TARGETS[backend][-1]
  env = dict(os.environ)
  env.pop(ENV, None)
  if planted:
    env[ENV] = backend
  cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", "-x",
         "-p", "tests.planted_bug", "tests/test_contract.py", "-k", selection]  # fmt: skip
  print(("planted: " if planted else "clean:   ") + " ".join(cmd[1:]), flush=True)
  out = subprocess.run(cmd, env=env, capture_output=True, text=True)
  tail = [x for x in out.stdout.splitlines() if " passed" in x or " failed" in x]
  print("   ", tail[-1] if tail else out.stdout[-500:] + out.stderr[-500:], flush=True)
  return out.returncode


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--backend", default="offload", choices=sorted(TARGETS))
  a = p.parse_args()
  os.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  clean, planted = _run(a.backend, False), _run(a.backend, True)
  ok = clean == 0 and planted != 0
  print(
    f"{a.backend}: clean run {'passed' if clean == 0 else 'FAILED'}, planted one-ulp bug "
    f"{'caught' if planted != 0 else 'NOT CAUGHT'}: {'ok' if ok else 'the suite cannot see it'}"
  )
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
