"""Test setup, before jax is imported anywhere: 8 simulated CPU devices and a persistent XLA
compilation cache shared by the whole suite, its workers and the processes tests start; the
run's compile time summed at the end; a lock for tests that need the machine to themselves.
tests/README.md says how the suite runs and what it costs."""

import contextlib
import fcntl
import gc
import os
import tempfile

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# The persistent compilation cache. Tests compile the same programs again and again (the
# trainer's step for one config in a resume, a crash and an equality check; the contract's
# steps per backend and mesh), and every run of the suite compiles what the last one did:
# XLA's compile is most of the suite's time (the summary at the end says how much). jax reads
# these variables at import, and so does every `run.py` / python process a test starts, which
# inherits them. The cache lives outside the checkout, keyed by jax on the program, the jax
# and XLA versions and the flags. Not jax's bounded cache (`jax_compilation_cache_max_size`):
# it sizes the whole directory under a file lock at every write, which at the suite's ~2,600
# entries cost ~0.2 s per write with the other worker waiting; `_prune_cache` bounds it once
# per run instead. A worker that reads an entry another is still writing fails its zlib check
# and compiles (jax warns). RECGNN_TEST_XLA_CACHE=DIR moves it, =off turns it off.
CACHE_ENV = "RECGNN_TEST_XLA_CACHE"
CACHE_MAX_BYTES = 2 << 30
_cache = os.environ.get(CACHE_ENV) or os.path.join(
  os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "recgnn", "xla-tests"
)
if _cache.lower() != "off":
  os.environ[CACHE_ENV] = _cache
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _cache)
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

# XLA:CPU's LLVM backend at -O0: half the compile time of a trainer test (measured: 58 -> 31 s
# of compile in tests/test_node_tables.py's every-backend test) for programs whose run time,
# at the tests' shapes, is a small part of it. XLA's HLO passes, what the HLO-reading tests
# inspect, are the same; every program of a run, its subprocesses' too, is built so.
# RECGNN_TEST_XLA_OPT=default keeps XLA's level.
_opt = os.environ.get("RECGNN_TEST_XLA_OPT", "0")
if _opt not in ("0", "default"):
  raise ValueError(f"RECGNN_TEST_XLA_OPT={_opt!r}: use 0 (the default) or default (XLA's level)")
if _opt == "0":
  os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"


def _prune_cache(path: str, max_bytes: int = CACHE_MAX_BYTES) -> None:
  """Oldest-written entries removed until the directory holds at most `max_bytes`."""
  try:
    entries = [e for e in os.scandir(path) if e.is_file()]
  except OSError:
    return
  stats = sorted((e.stat().st_mtime, e.stat().st_size, e.path) for e in entries)
  total = sum(size for _, size, _ in stats)
  for _, size, name in stats:
    if total <= max_bytes:
      break
    with contextlib.suppress(OSError):
      os.remove(name)
      total -= size


if _cache.lower() != "off" and not os.environ.get("PYTEST_XDIST_WORKER"):
  _prune_cache(_cache)  # once per run, before the workers start

from recgnn import xla_env  # noqa: E402

xla_env.relax_simulated_device_timeouts()

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", False)


# ----------------------------------------------------------------------------- workers
# `-n auto` (pyproject's addopts) asks this hook: two workers on a CPU-only run (measured on
# 2 cores: tests/README.md), none where jax runs on an accelerator (one device, which
# workers would share and whose memory each would preallocate).
def pytest_xdist_auto_num_workers(config):
  if os.environ.get("JAX_PLATFORMS", "cpu") != "cpu":
    return 0
  return min(2, os.cpu_count() or 1)


# The garbage collector. Tracing and lowering allocate many short-lived objects, and at
# CPython's default thresholds (700, 10, 10) each worker collected ~3,100 times in
# tests/test_steps_per_call.py alone (3.2-3.7 s of its ~51 s in one process), most of each
# older collection walking what the imports made. Once collection is done those are moved
# out of the collector's sight (they live to the end anyway), and the youngest generation is
# collected every 10,000 allocations: 464 collections, 0.8 s; the file's user CPU time 34.8 s
# against 36.8-41.8 s at the defaults (2026-12-02, `-n 0`, runs interleaved, collections
# timed by gc.callbacks; tests/README.md), peak memory the same (792 vs 798 MB).
def pytest_collection_finish(session):
  gc.freeze()
  gc.set_threshold(10_000, 10, 10)


# Tests marked `serial` (timing bounds, many processes) run alone: a reader-writer lock over
# the run's workers, every test a reader and a serial one the writer, so a serial test starts
# only when no other test runs and none starts until it ends. A turnstile taken before either
# keeps readers from overtaking a waiting writer. Without workers it does nothing.
_LOCK_DIR = tempfile.gettempdir()  # (the machine's: every worker's, before `_contained_tmp`)


def _lock_paths() -> tuple[str, str] | None:
  uid = os.environ.get("PYTEST_XDIST_TESTRUNUID")
  if not uid:
    return None
  stem = os.path.join(_LOCK_DIR, f"recgnn-pytest-{uid}")
  return f"{stem}.turnstile", f"{stem}.lock"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  paths = _lock_paths()
  if paths is None:
    yield
    return
  serial = item.get_closest_marker("serial") is not None
  with open(paths[0], "a") as turnstile, open(paths[1], "a") as lock:
    fcntl.flock(turnstile, fcntl.LOCK_EX)
    fcntl.flock(lock, fcntl.LOCK_EX if serial else fcntl.LOCK_SH)
    fcntl.flock(turnstile, fcntl.LOCK_UN)
    try:
      yield
    finally:
      fcntl.flock(lock, fcntl.LOCK_UN)


# ----------------------------------------------------------------------------- where the time goes
# Every test's share of JAX's own compile phases (trace to jaxpr, lower to MLIR, XLA's
# backend compile), from jax.monitoring's duration events, attached to the test's report
# (so pytest-xdist carries it from the workers) and summed at the end of the run: what a
# persistent compilation cache or shared fixtures could save, beside what the run cost.
import time  # noqa: E402

from jax import monitoring  # noqa: E402

_PHASES = {
  "/jax/core/compile/jaxpr_trace_duration": "trace",
  "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
  "/jax/core/compile/backend_compile_duration": "compile",
}
_spent = dict.fromkeys(_PHASES.values(), 0.0)


def _on_duration(event: str, seconds: float, **_) -> None:
  phase = _PHASES.get(event)
  if phase is not None:
    _spent[phase] += seconds


monitoring.register_event_duration_secs_listener(_on_duration)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
  before = dict(_spent) if call.when == "setup" else getattr(item, "_jax_before", None)
  if call.when == "setup":
    item._jax_before = before
  outcome = yield
  if call.when == "teardown" and before is not None:
    report = outcome.get_result()
    report.user_properties.extend((f"jax_{k}_s", _spent[k] - before[k]) for k in _spent)


_totals: dict[str, float] = {}
_by_test: dict[str, float] = {}
_t0 = time.perf_counter()


def pytest_runtest_logreport(report):
  for k, v in report.user_properties:
    if isinstance(k, str) and k.startswith("jax_"):
      _totals[k] = _totals.get(k, 0.0) + v
      if k == "jax_compile_s":
        _by_test[report.nodeid] = v


def pytest_terminal_summary(terminalreporter):
  if not _totals:
    return
  tr = terminalreporter
  wall = time.perf_counter() - _t0
  parts = ", ".join(f"{k[4:-2]} {v:,.0f} s" for k, v in sorted(_totals.items()))
  tr.write_sep("=", "JAX compile phases (summed over tests and workers)")
  tr.write_line(f"{parts}; the run took {wall:,.0f} s wall")
  top = sorted(_by_test.items(), key=lambda kv: -kv[1])[:10]
  for nodeid, s in top:
    tr.write_line(f"{s:7.1f} s XLA compile  {nodeid}")


@pytest.fixture(scope="session", autouse=True)
def _contained_tmp(tmp_path_factory):
  """Temporary files of the code under test (and of the processes a test starts: TMPDIR)
  in this worker's pytest directory, which pytest removes after 3 runs: TFDS leaves an empty
  `tmp*tfds` folder per deliberately damaged build, and code that makes its own temporary
  workdir may leave it; a run left hundreds in /tmp."""
  d = str(tmp_path_factory.mktemp("tmp"))
  old_env, old_dir = os.environ.get("TMPDIR"), tempfile.tempdir
  os.environ["TMPDIR"], tempfile.tempdir = d, d
  yield
  tempfile.tempdir = old_dir
  if old_env is None:
    os.environ.pop("TMPDIR", None)
  else:
    os.environ["TMPDIR"] = old_env


@pytest.fixture(scope="session")
def ctr_cache(tmp_path_factory):
  """One data cache for the CTR tests of this process (each xdist worker has its own): the
  synthetic Criteo-format files and their converted arrays are written once, not once per
  test module (a few seconds each). Entries are keyed by the data's config, so tests with
  other rows / schemas / bags share it safely; a test that damages a cache makes its own."""
  return str(tmp_path_factory.mktemp("ctr_cache"))


_fast_init_chunk = None


@pytest.fixture
def fast_table_init(monkeypatch):
  """Opt-in: tables drawn by their init program compiled at XLA's own optimisation level
  instead of the suite's -O0 (`recgnn.embeddings.specs._init_chunk`: a 65k-row chunk of
  threefry draws per table, ~7x slower at -O0; a 1M-row table was most of a test's time).
  Its values differ from -O0's by an ulp, so only for tests whose every run (and every run
  they compare with) is in this process: not with a subprocess's tables."""
  global _fast_init_chunk
  from recgnn.embeddings import specs

  if _fast_init_chunk is None:
    _fast_init_chunk = jax.jit(
      specs._init_chunk.__wrapped__,
      static_argnums=(3, 4, 5),
      compiler_options={"xla_backend_optimization_level": 2},
    )
  monkeypatch.setattr(specs, "_init_chunk", _fast_init_chunk)
