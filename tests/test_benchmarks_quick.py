"""Every benchmark's `--quick` form runs to completion (nothing in a benchmark waits forever:
its default sections hung once, on write-backs no step would make). The runs are `long`
(minutes each, not in the default run: `python -m pytest -m long tests/test_benchmarks_quick.py`);
each writes its results under a temporary folder ($RECGNN_BENCH_RESULTS), never over the
checked-in ones. That every benchmark has a --quick is checked in the default run."""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Scripts under benchmarks/ that run (their own `__main__`); dlrm_profile is a module of
# dlrm_throughput (its --profile), not a script.
BENCHMARKS = sorted(
  p.stem for p in (ROOT / "benchmarks").glob("*.py") if "__main__" in p.read_text()
)
# Those that print their table and write no results file unless asked (--out).
PRINTS_ONLY = {"ssd_io"}
# Known to refuse, saying why (strict: one that starts to pass must leave this list).
REFUSES = {
  "hot_cold": "prepares every batch before replaying the steps: not ported to the host tier's "
  "write-backs (it says so and exits 1); tier_scaling.py and memory_tiers.py time hot_cold",
}
CASES = [
  pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=REFUSES[n])) if n in REFUSES else n
  for n in BENCHMARKS
]
LIMIT_S = 1200  # per benchmark: a quick form takes ~1-5 minutes on 2 loaded cores


def test_every_benchmark_has_a_quick_form():
  missing = [
    n for n in BENCHMARKS
    if '"--quick"' not in (text := (ROOT / "benchmarks" / f"{n}.py").read_text())
    and 'DEFINE_bool("quick"' not in text
    and "flags.add_output(" not in text  # (the harness's output flags: --name, --quick)
  ]  # fmt: skip
  assert not missing, f"benchmarks without --quick: {missing}"
  assert len(BENCHMARKS) >= 20, BENCHMARKS


@pytest.mark.long
@pytest.mark.timeout(LIMIT_S + 60)  # (over the suite's 900 s: the run's own bound ends it first)
@pytest.mark.parametrize("name", CASES)
def test_quick_form_runs_to_completion(name, tmp_path):
  out = tmp_path / "results"
  env = {**os.environ, "RECGNN_BENCH_RESULTS": str(out), "PYTHONPATH": str(ROOT)}
  env.pop("PYTEST_XDIST_WORKER", None)
  cmd = [sys.executable, str(ROOT / "benchmarks" / f"{name}.py"), "--quick"]
  try:
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=LIMIT_S)
  except subprocess.TimeoutExpired as e:
    pytest.fail(f"{name} --quick still running after {LIMIT_S} s: {str(e.stdout)[-2000:]}")
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  if name not in PRINTS_ONLY:
    assert out.is_dir() and any(out.iterdir()), (
      f"{name} --quick wrote no results: {proc.stdout[-2000:]}"
    )
