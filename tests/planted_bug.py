"""Can the contract tests fail? Plant a one-ulp bug in one backend's update and run them.

  python tests/planted_bug.py                      # offload, the contract's exactness tests
  python tests/planted_bug.py --backend=hot_cold   # hot_cold's cold rows (its host tier)
  python tests/planted_bug.py --backend=hot_cold_hot   # hot_cold's hot rows (row-sharded)
  python tests/planted_bug.py --backend=sharded    # sharded(kind=table), the exact placement
  python -m pytest -m long tests/test_planted_bug.py   # every target, as a test

The bug: every row the backend's sparse update changes comes out one float32 ulp above the
right value (`jnp.nextafter` toward +inf), in that backend's module only (dense, the
reference, is untouched): the shared update it calls (`base.sparse_sgd_or_adagrad` for
offload's rows and hot_cold's cold rows, `row_sharded.update` for sharded's rows and
hot_cold's hot rows) as that module sees it. The exactness tests compare bit for bit on CPU,
so they must fail with the bug and pass without it; the script runs both in fresh processes
(no workers, the persistent compilation cache as the suite has it) and says ok only when the
clean run passed and the planted run failed in the exactness tests themselves, each failure
an assertion (a planted run that fails otherwise, an import error of the plant or a test
erroring, is not "caught").

As a pytest plugin (`-p tests.planted_bug`, with RECGNN_PLANT_ULP_BUG=<target>) it plants the
bug at import; without the variable it does nothing. Not collected as a test file; run by
tests/test_planted_bug.py under the `long` marker (minutes: not in the default run).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import re
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
  "hot_cold_hot": (
    "recgnn.backends.hot_cold.device", "row_sharded", "update",
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


# The tests whose failure counts as the bug caught: the contract's exactness comparisons.
EXACTNESS = "tests/test_contract.py::test_matches_dense["


@dataclasses.dataclass
class Outcome:
  """One pytest run's outcome, from its -rA summary lines."""

  returncode: int
  passed: list[str]
  failed: list[str]  # node ids
  errors: list[str]
  raised: set[str]  # what the failures raised (each traceback's last line: `file:line: Type`)
  tail: str  # the output's end, for the message

  def failed_in_exactness(self) -> bool:
    """Failed, and only in exactness tests, by assertions (not an error or an import)."""
    return (
      self.returncode != 0
      and bool(self.failed)
      and not self.errors
      and self.raised == {"AssertionError"}
      and all(f.startswith(EXACTNESS) for f in self.failed)
    )


def run(backend: str, planted: bool) -> Outcome:
  """The contract's exactness tests of `backend` in a fresh process, the bug planted or not."""
  selection = TARGETS[backend][-1]
  env = dict(os.environ)
  env.pop(ENV, None)
  env.pop("PYTEST_XDIST_WORKER", None)  # (a child of a test worker is a run of its own)
  if planted:
    env[ENV] = backend
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  cmd = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-n", "0",
         "-x", "-p", "tests.planted_bug", "tests/test_contract.py", "-k", selection]  # fmt: skip
  print(("planted: " if planted else "clean:   ") + " ".join(cmd[1:]), flush=True)
  out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=root)
  lines = out.stdout.splitlines()
  pick = lambda word: [x.split(" ")[1] for x in lines if x.startswith(word + " ")]  # noqa: E731
  raised = set(re.findall(r"^\S+\.py:\d+: (\w+)$", out.stdout, re.M))
  got = Outcome(out.returncode, pick("PASSED"), pick("FAILED"), pick("ERROR"), raised,
                (out.stdout[-1500:] + out.stderr[-1500:]).strip())  # fmt: skip
  print(f"    {len(got.passed)} passed, {len(got.failed)} failed, {len(got.errors)} errors")
  return got


def check(backend: str) -> tuple[bool, str]:
  """(ok, what happened): ok when the clean run passed and the planted one failed in the
  exactness tests only."""
  clean, planted = run(backend, False), run(backend, True)
  clean_ok = clean.returncode == 0 and bool(clean.passed) and not clean.failed
  ok = clean_ok and planted.failed_in_exactness()
  said = (
    f"{backend}: clean run {'passed' if clean_ok else 'FAILED'} ({len(clean.passed)} tests), "
    f"planted one-ulp bug {'caught' if planted.failed_in_exactness() else 'NOT CAUGHT'} "
    f"(failed: {planted.failed or 'none'}, raising {sorted(planted.raised)}; errors: "
    f"{planted.errors or 'none'})"
  )
  if not ok:
    said += "\n--- clean run's end:\n" + clean.tail + "\n--- planted run's end:\n" + planted.tail
  return ok, said


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--backend", default="offload", choices=sorted(TARGETS))
  a = p.parse_args()
  ok, said = check(a.backend)
  print(said + (": ok" if ok else ": the suite cannot see it"))
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
