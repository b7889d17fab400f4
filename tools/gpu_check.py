"""The GPU check (issue 29): stages that each end within a device command's 10 minutes and
write their results under --out as they finish. Run it through tools/gpu_check.sh.

  bash tools/gpu_check.sh --stage=env --out=DIR             one stage (on a lent GPU
                                                                 machine: --out=$OUT)
  bash tools/gpu_check.sh --stage=env,contract --out=DIR    several, in this order
  bash tools/gpu_check.sh --stage=all --out=DIR             every stage
  bash tools/gpu_check.sh --allow-cpu --stage=S --out=DIR   CPU test mode (small sizes)

Stages (benchmarks/GPU.md: the commands in order, their times, where results go):
  env        install what the image lacks from the carried wheels only (pip --no-deps
             --no-index; the project editable), print exactly what was used; environment
             report (versions, devices, driver) and a probe of host memory (pinned_host
             transfers, a compute_on host gather)
  contract   tests/test_contract.py on the device
  trainer    tests/test_trainer.py on the device
  train      run.py per experiment (dlrm_kaggle cdlrm_kaggle ttrec_kaggle hotline_kaggle):
             samples/s, loss, AUC, offload / hot_cold transfer counters
  trace      profiled steps of cdlrm_kaggle (offload) and hotline_kaggle (hot_cold):
             recgnn.trace_summary per step (kernels, H2D / D2H copies, overlap), the trace
  calibrate  tt's contract=auto cost model fitted on this platform (benchmarks/tt.py levels)
  tiers      issue 42: offload, hot_cold and dense (cdlrm_kaggle, hotline_kaggle,
             dlrm_kaggle) at Kaggle's table sizes, traced: pinned -> pinned copies per step
             (target 0), H2D / D2H copies, busy share, CUDA graph updates (`checks`)
  perf       issues 43, 59: dlrm_kaggle (dense) at batch 2048 f32 (k = 1 and 8 steps per
             call) and 65536 bf16, each with train.feed=device and train.feed=host, steady
             samples/s; the k = 1 runs traced 5 steps (GPU-busy fraction, gaps); the PyTorch
             peer (benchmarks/peers/dlrm.build_pytorch_on: torch.compile, bf16 autocast at
             65536) on the same batches; device / host feed and recgnn / PyTorch ratios and
             the issue's targets printed (`checks`)

Every stage writes DIR/STAGE.json, DIR/STAGE.md and DIR/STAGE.log (trimmed), plus: trace
DIR/trace_EXPERIMENT.trace.json.gz (the Perfetto trace, trimmed to the device's and the
steps' events if large); calibrate's fit is merged into the package with `python
tools/gpu_check.py merge-tt-cost DIR/calibrate.json`. Each stage has a budget
(default 510 s; its subprocesses' limits are cut from what is left, SIGTERM first) and also
installs what is missing, so any stage runs on a fresh machine. Exit status: 0 when every
stage passed (or no GPU without --allow-cpu), 1 when one failed (its files still written),
2 on bad usage.

Also: `detect` (device JSON; exit 3 without a GPU), `merge-tt-cost FILE`, `report DIR`
(one summary.md from a results folder), and the pytest plugin `-p gpu_check` (with
tools/ on PYTHONPATH): per-test progress lines a killed run still leaves, and a mesh
that needs more devices than exist reported as skipped.

Nothing here imports jax or the project at module level: the stages run before the install.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time

NO_GPU = 3  # exit status of `detect` when jax sees no GPU
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGES = ("env", "contract", "trainer", "train", "trace", "calibrate", "tiers", "perf")
EXPERIMENTS = ("dlrm_kaggle", "cdlrm_kaggle", "ttrec_kaggle", "hotline_kaggle")
TRACED = ("cdlrm_kaggle", "hotline_kaggle")
# The tiers stage (issue 42): every table offloaded, hot / cold, dense; at Kaggle's table
# sizes. The memory tiers first: they are what the stage checks, dense the baseline.
TIERS = ("cdlrm_kaggle", "hotline_kaggle", "dlrm_kaggle")
# Its second setting: XLA:GPU's CUDA graphs off (the H100 trace updated them every step).
NO_COMMAND_BUFFER = "--xla_gpu_enable_command_buffer="


def _tree_on_path() -> None:
  """This checkout's recgnn, run.py and experiments importable (before any installed copy):
  the stages run before (or without) the editable install."""
  if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def _benchmarks_on_path() -> None:
  """benchmarks/'s modules (tt.py, the peers) importable by their bare names, as the scripts
  import each other (their harness puts the tree on the path)."""
  _tree_on_path()
  bench = os.path.join(ROOT, "benchmarks")
  if bench not in sys.path:
    sys.path.insert(0, bench)


# A device command may run 10 minutes, machine start and file transfers not counted: a stage
# must end by 9; 510 s leaves a minute for pytest / run.py to answer SIGTERM and for writing.
STAGE_SECONDS = float(os.environ.get("RECGNN_GPU_CHECK_STAGE_SECONDS", "510"))
KILL_GRACE = 20  # seconds between SIGTERM and SIGKILL
LOG_BYTES = 400_000  # a stage log's size limit (head and tail kept)
TRACE_BYTES = 15 << 20  # a returned trace's limit (the device link returns 16 MiB a file)
DETERMINISTIC = "--xla_gpu_deterministic_ops=true"
# What run.py, the trainer and the tests import (module, distribution): checked after install.
IMPORTS = (
  ("jax", "jax"),
  ("jaxlib", "jaxlib"),
  ("flax", "flax"),
  ("optax", "optax"),
  ("orbax.checkpoint", "orbax-checkpoint"),
  ("absl", "absl-py"),
  ("ml_collections", "ml-collections"),
  ("numpy", "numpy"),
  ("scipy", "scipy"),
  ("pymetis", "pymetis"),
  ("tensorboardX", "tensorboardX"),
  ("tensorflow_datasets", "tensorflow-datasets"),
  ("array_record", "array-record"),
  ("grain", "grain"),
  ("numba", "numba"),
  ("sklearn", "scikit-learn"),
  ("pytest", "pytest"),
  ("hypothesis", "hypothesis"),
  ("recgnn", "recgnn"),
  ("experiments", "recgnn"),
)
# Offload counters (recgnn/backends/offload/__init__.py stats()), logged per table as "TABLE/KEY".
OFFLOAD_SUM = (
  "h2d_bytes_per_step",
  "d2h_bytes_per_step",
  "h2d_padded_bytes_per_step",
  "h2d_rows_per_step",
  "d2h_rows_per_step",
  "misses_per_step",
  "plan_ms_per_step",
)
_DEVICES_RE = re.compile(r"needs (\d+) devices; (\d+) available")


# ------------------------------------------------------------------------------ pytest plugin
if "pytest" in sys.modules:  # loaded with `pytest -p gpu_check`
  import pytest

  @pytest.hookimpl(wrapper=True)
  def pytest_runtest_call(item):
    # A safety net for tests that build a mesh without contract.mesh_or_skip.
    try:
      return (yield)
    except ValueError as e:
      m = _DEVICES_RE.search(str(e))
      if m is None:
        raise
      pytest.skip(f"gpu_check: mesh needs {m.group(1)} devices, {m.group(2)} available")

  def pytest_runtest_logreport(report):
    # One line per finished test, flushed: a stage killed at its limit still has them.
    path = os.environ.get("RECGNN_GPU_CHECK_PROGRESS")
    if not path or not (report.when == "call" or report.outcome != "passed"):
      return
    row = {"test": report.nodeid, "outcome": report.outcome, "when": report.when,
           "seconds": round(report.duration, 2)}  # fmt: skip
    if report.skipped and isinstance(report.longrepr, tuple):
      row["reason"] = str(report.longrepr[2])
    elif report.failed:
      row["error"] = str(report.longreprtext)[-3000:]
    with open(path, "a") as f:
      f.write(json.dumps(row) + "\n")

  def pytest_report_header(config):
    import jax

    devs = jax.devices()
    return [f"gpu_check: {len(devs)} x {devs[0].device_kind} ({jax.default_backend()})"]

  def pytest_configure(config):
    want = os.environ.get("RECGNN_GPU_CHECK_EXPECT_PLATFORM")
    if want:
      import jax

      got = jax.default_backend()
      if got != want:
        raise pytest.UsageError(f"gpu_check: tests would run on {got!r}, expected {want!r}")


# ------------------------------------------------------------------------------------ detect
def detect(allow_cpu: bool) -> int:
  """Print the accelerator as JSON. Exit 0 with a GPU (or --allow-cpu), NO_GPU without."""
  import jax

  info: dict = {"jax": jax.__version__}
  with contextlib.suppress(Exception):
    import jaxlib

    info["jaxlib"] = jaxlib.__version__
  try:
    gpus = jax.devices("gpu")
  except RuntimeError as e:  # no GPU backend: "Unknown backend gpu" / "no devices"
    gpus, info["gpu_error"] = [], str(e).splitlines()[0][:300]
  if gpus:
    devs, platform_name = gpus, gpus[0].platform  # "cuda" or "rocm": the JAX_PLATFORMS value
    if platform_name == "gpu":  # jax 0.11 names CUDA devices "gpu"; JAX_PLATFORMS=gpu then
      # also asks for rocm and fails ("Unable to initialize backend 'rocm'", seen on an H100)
      ver = str(getattr(gpus[0].client, "platform_version", "")).lower()
      platform_name = "rocm" if ("rocm" in ver or "hip" in ver) else "cuda"
  elif allow_cpu:
    devs, platform_name = jax.devices("cpu"), "cpu"
  else:
    print(json.dumps({**info, "platform": None, "count": 0}))
    return NO_GPU
  info.update(
    platform=platform_name,
    backend="gpu" if gpus else "cpu",
    count=len(devs),
    kind=devs[0].device_kind,
    devices=[str(d) for d in devs],
  )
  with contextlib.suppress(Exception):  # (not every backend has memory_stats)
    stats = devs[0].memory_stats() or {}
    if "bytes_limit" in stats:
      info["memory_bytes"] = int(stats["bytes_limit"])
  with contextlib.suppress(Exception):
    info["memory_kinds"] = sorted(m.kind for m in devs[0].addressable_memories())
  print(json.dumps(info))
  return 0


def probe() -> int:
  """Host memory on this device, as offload / hot_cold use it: a pinned_host round trip, a
  jitted transfer between memory kinds, and a gather under compute_on("device_host") (XLA:
  GPU's host compute is newer than XLA:CPU's). Prints JSON: each probe ok or its error."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  _tree_on_path()
  from tools import host_table

  out = {}
  x = np.arange(4096, dtype=np.float32).reshape(512, 8)
  idx = np.array([3, 1, 500, 3], np.int32)

  def attempt(name, fn):
    t0 = time.perf_counter()
    try:
      ok = bool(fn())
      out[name] = {"ok": ok, "seconds": round(time.perf_counter() - t0, 3)}
    except Exception as e:  # noqa: BLE001 (the point is to report any failure)
      out[name] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:400]}"}

  dev = jax.devices()[0]
  host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
  devm = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")

  def round_trip():
    h = jax.device_put(x, host)
    return h.sharding.memory_kind == "pinned_host" and np.array_equal(
      np.asarray(jax.device_put(h, devm)), x
    )

  def jitted_transfer():
    h = jax.device_put(x, host)
    f = jax.jit(lambda t: jax.device_put(t, jax.memory.Space.Device) * 2.0)
    return np.array_equal(np.asarray(f(h)), 2 * x)

  def host_gather():
    h = jax.device_put(x, host)
    i = jax.device_put(idx, jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host"))
    f = jax.jit(lambda t, j: jax.device_put(host_table.gather_rows(t, j), jax.memory.Space.Device))
    return np.array_equal(np.asarray(f(h, i)), x[idx])

  def device_compute():
    return float(jax.jit(lambda a: (a @ a.T).sum())(jnp.ones((256, 256)))) == 256.0**3

  attempt("device_compute", device_compute)
  attempt("pinned_host_round_trip", round_trip)
  attempt("jit_transfer_between_memory_kinds", jitted_transfer)
  attempt("compute_on_host_gather", host_gather)
  print(json.dumps(out))
  return 0 if all(v["ok"] for v in out.values()) else 1


# -------------------------------------------------------------------------------- helpers
def _read(path: str) -> str:
  with open(path, errors="replace") as f:
    return f.read()


def _read_jsonl(path: str) -> list[dict]:
  rows = []
  if not os.path.exists(path):
    return rows
  with open(path) as f:
    for line in f:
      line = line.strip()
      if line:
        with contextlib.suppress(json.JSONDecodeError):  # a line cut by a killed run
          rows.append(json.loads(line))
  return rows


def _fmt_bytes(b: float) -> str:
  for unit in ("B", "KiB", "MiB", "GiB"):
    if abs(b) < 1024 or unit == "GiB":
      return f"{b:.0f} {unit}" if unit == "B" else f"{b:.1f} {unit}"
    b /= 1024
  return str(b)


def _slug(text: str) -> str:
  return re.sub(r"[^a-z0-9]+", "_", str(text).lower()).strip("_") or "unknown"


def machine() -> dict:
  info = {
    "host": socket.gethostname(),
    "python": platform.python_version(),
    "executable": sys.executable,
    "cpus": os.cpu_count(),
    "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
  }
  with contextlib.suppress(OSError):
    info["loadavg"] = [round(x, 2) for x in os.getloadavg()]
  with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/meminfo") as f:
    info["memory_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
  return info


def trim(text: str, limit: int = LOG_BYTES) -> str:
  """Head and tail of a long log (the start says what ran, the end how it ended)."""
  if len(text) <= limit:
    return text
  head, tail = text[: limit // 4], text[-(3 * limit // 4) :]
  return f"{head}\n\n[... {len(text) - limit} characters cut by gpu_check ...]\n\n{tail}"


class Stage:
  """One stage's budget, log and result files (DIR/NAME.json, .md, .log)."""

  def __init__(self, ctx: Ctx, name: str):
    self.ctx, self.name = ctx, name
    self.t0 = time.monotonic()
    self.deadline = self.t0 + STAGE_SECONDS
    self.result: dict = {"stage": name, "status": "running", "mode": ctx.mode}
    self.logs: list[str] = []
    self.md: list[str] = []

  def left(self) -> float:
    return self.deadline - time.monotonic()

  def say(self, msg: str) -> None:
    line = f"[gpu_check {time.strftime('%H:%M:%S')} {self.name}] {msg}"
    print(line, flush=True)
    self.logs.append(line)

  def run(self, name: str, argv: list[str], limit: float, env: dict | None = None) -> dict:
    """Run argv (its own process group) with output to WORK/name.log, stopped at `limit`
    seconds or the stage's deadline (SIGTERM, SIGKILL KILL_GRACE s later)."""
    limit = max(1.0, min(limit, self.left() - KILL_GRACE - 5))
    log = os.path.join(self.ctx.work, f"{name}.log")
    self.say(f"{name}: {shlex.join(argv)} (limit {limit:.0f} s; log {log})")
    t0 = time.monotonic()
    timed_out = False
    with open(log, "w") as f:
      proc = subprocess.Popen(
        argv,
        cwd=ROOT,
        env={**self.ctx.env, **(env or {})},
        stdout=f,
        stderr=subprocess.STDOUT,
        start_new_session=True,
      )
      try:
        rc = proc.wait(timeout=limit)
      except subprocess.TimeoutExpired:
        timed_out = True
        self.say(f"{name}: limit reached; SIGTERM")
        with contextlib.suppress(ProcessLookupError):
          os.killpg(proc.pid, signal.SIGTERM)
        try:
          rc = proc.wait(timeout=KILL_GRACE)
        except subprocess.TimeoutExpired:
          with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
          rc = proc.wait()
    seconds = time.monotonic() - t0
    text = _read(log)
    self.logs.append(
      f"----- {name} (exit {rc}, {seconds:.0f} s) -----\n{trim(text, LOG_BYTES // 2)}"
    )
    status = "timeout" if timed_out else ("ok" if rc == 0 else "failed")
    self.say(f"{name}: {status} (exit {rc}, {seconds:.0f} s)")
    return {"status": status, "exit_code": rc, "seconds": round(seconds, 1), "log": log}

  def write(self, status: str | None = None) -> None:
    """(Re)write the stage's files: called as parts finish, so a later failure keeps them."""
    if status:
      self.result["status"] = status
    self.result["seconds"] = round(time.monotonic() - self.t0, 1)
    self.result["device"] = self.ctx.device
    self.result["machine"] = machine()
    out = self.ctx.out
    with open(os.path.join(out, f"{self.name}.json"), "w") as f:
      json.dump(self.result, f, indent=2, sort_keys=True, default=str)
    dev = self.ctx.device
    head = [
      f"# gpu_check {self.name}: {self.result['status']}",
      "",
      f"{dev.get('count', '?')} x {dev.get('kind', '?')} ({dev.get('platform')}), jax "
      f"{dev.get('jax')}, Python {platform.python_version()}, {self.ctx.mode} mode, "
      f"{self.result['seconds']:.0f} s, {self.result['machine']['time_utc']}"
      + (f", load {self.result['machine'].get('loadavg')}" if self.ctx.mode == "cpu" else "")
      + ".",
      "",
    ]
    with open(os.path.join(out, f"{self.name}.md"), "w") as f:
      f.write("\n".join(head + self.md) + "\n")
    with open(os.path.join(out, f"{self.name}.log"), "w") as f:
      f.write(trim("\n".join(self.logs)))


class Ctx:
  """What every stage shares: directories, mode, the device, the subprocess environment."""

  def __init__(self, args):
    self.out = os.path.abspath(args.out)
    # Outside OUT: only a few small files may come back from a lent machine.
    self.work = os.path.abspath(args.work or "/tmp/recgnn_gpu_check")
    self.allow_cpu = args.allow_cpu
    self.wheels = args.wheels
    self.experiments = args.experiments
    os.makedirs(self.out, exist_ok=True)
    os.makedirs(self.work, exist_ok=True)
    self.env = dict(os.environ)
    self.env["PYTHONPATH"] = os.pathsep.join(
      [ROOT, *([self.site] if os.path.isdir(self.site) else []), self.env.get("PYTHONPATH", "")]
    ).rstrip(os.pathsep)
    self.env.pop("JAX_PLATFORMS", None)
    self.device: dict = {}
    self.mode = "gpu"
    self.install_note: dict = {}

  @property
  def site(self) -> str:
    """Where wheels go when the interpreter's own site-packages refuse them (PEP 668, no
    write permission): on PYTHONPATH for every stage."""
    return os.path.join(ROOT, ".gpu-site")


# ---------------------------------------------------------------------------- install
def _dist_of_wheel(path: str) -> tuple[str, str]:
  name, version = os.path.basename(path).split("-")[:2]
  return re.sub(r"[-_.]+", "-", name).lower(), version


def _installed(ctx: Ctx) -> dict[str, str]:
  """{normalized distribution: version} as the stages' interpreter sees them."""
  code = (
    "import json, importlib.metadata as m, re\n"
    "print(json.dumps({re.sub(r'[-_.]+', '-', d.metadata['Name']).lower(): d.version "
    "for d in m.distributions() if d.metadata['Name']}))"
  )
  res = subprocess.run(
    [sys.executable, "-c", code], env=ctx.env, capture_output=True, text=True, check=True
  )
  return json.loads(res.stdout)


def wheel_dir(ctx: Ctx) -> str | None:
  for d in (
    ctx.wheels,
    os.environ.get("RECGNN_WHEELS"),
    os.path.join(ROOT, ".gpu-wheels"),
    os.path.join(ROOT, "shared", "gpu-wheels"),
    os.path.join(os.path.dirname(ROOT), "shared", "gpu-wheels"),
  ):
    if d and os.path.isdir(d):
      return os.path.abspath(d)
  return None


def import_check(ctx: Ctx) -> dict:
  """Each module run.py, the trainer and the tests import: its version, or the error."""
  code = (
    "import importlib, importlib.metadata as m, json, sys\n"
    "out = {}\n"
    f"for mod, dist in {list(IMPORTS)!r}:\n"
    "  try:\n"
    "    x = importlib.import_module(mod)\n"
    "    try: v = m.version(dist)\n"
    "    except Exception: v = getattr(x, '__version__', '?')\n"
    "    out[mod] = {'ok': True, 'version': v, 'file': getattr(x, '__file__', '')}\n"
    "  except Exception as e:\n"
    "    out[mod] = {'ok': False, 'error': f'{type(e).__name__}: {e}'[:300]}\n"
    "print(json.dumps(out))\n"
  )
  res = subprocess.run(
    [sys.executable, "-c", code], env=ctx.env, capture_output=True, text=True, cwd="/"
  )
  try:
    return json.loads(res.stdout.strip().splitlines()[-1])
  except (json.JSONDecodeError, IndexError):
    return {"_": {"ok": False, "error": (res.stderr or res.stdout)[-500:]}}


def install(ctx: Ctx, stage: Stage) -> dict:
  """Install what the interpreter lacks: the wheels of the carried folder whose distribution
  is not installed (pip install --no-deps --no-index FILES: nothing from an index, nothing
  resolved), then the project (editable, no build isolation). Returns what was used."""
  note: dict = {"wheel_dir": wheel_dir(ctx), "installed": [], "already_present": []}
  have = _installed(ctx)
  if note["wheel_dir"]:
    todo = []
    for f in sorted(os.listdir(note["wheel_dir"])):
      if not f.endswith(".whl"):
        continue
      dist, version = _dist_of_wheel(f)
      if dist in have:
        note["already_present"].append(f"{dist}=={have[dist]} (wheel {version} not used)")
      else:
        todo.append(os.path.join(note["wheel_dir"], f))
    note["wheels"] = sorted(f for f in os.listdir(note["wheel_dir"]) if f.endswith(".whl"))
    if todo:
      base = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--no-input"]
      r = stage.run("pip_wheels", [*base, *todo], 240)
      if r["status"] != "ok":
        # The image's site-packages may refuse (externally managed, read-only): a folder on
        # PYTHONPATH instead (only distributions the image lacks, so nothing is shadowed).
        r = stage.run("pip_wheels_target", [*base, "--target", ctx.site, *todo], 240)
        if r["status"] == "ok":
          note["target"] = ctx.site
          ctx.env["PYTHONPATH"] = os.pathsep.join([ROOT, ctx.site, ctx.env["PYTHONPATH"]])
      note["pip_status"] = r["status"]
      used = [f"{d}=={v}" for d, v in map(_dist_of_wheel, todo)]
      note["installed"] = used if r["status"] == "ok" else []
      if r["status"] != "ok":
        note["failed"] = [os.path.basename(t) for t in todo]
  if "recgnn" not in _installed(ctx):
    r = stage.run(
      "pip_project",
      [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--no-build-isolation",
       "--no-input", "-e", ROOT],
      240,
    )  # fmt: skip
    note["project"] = (
      "pip install --no-deps --no-build-isolation -e . (editable)"
      if r["status"] == "ok"
      else "editable install failed (no setuptools?): run from the checkout on PYTHONPATH"
    )
  else:
    note["project"] = "already installed"
  note["imports"] = import_check(ctx)
  note["missing"] = [m for m, v in note["imports"].items() if not v.get("ok")]
  return note


def ensure_env(ctx: Ctx, stage: Stage, verbose: bool) -> bool:
  """Install if anything is missing (once per invocation); detect the device."""
  if not ctx.install_note:
    imports = import_check(ctx)
    if verbose or any(not v.get("ok") for v in imports.values()):
      ctx.install_note = install(ctx, stage)
    else:
      ctx.install_note = {"project": "already installed", "imports": imports, "missing": []}
  note = ctx.install_note
  if note["missing"]:
    stage.say(f"still missing after install: {', '.join(note['missing'])}")
  return not note["missing"]


def detect_device(ctx: Ctx, stage: Stage) -> int:
  """Fill ctx.device / ctx.mode. 0: go on; NO_GPU: no GPU and no --allow-cpu; 1: broken."""
  env = dict(ctx.env)
  r = subprocess.run(
    [sys.executable, os.path.abspath(__file__), "detect"],
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  info = {}
  with contextlib.suppress(json.JSONDecodeError, IndexError):
    info = json.loads(r.stdout.strip().splitlines()[-1])
  if r.returncode == NO_GPU:
    smi = (
      shutil.which("nvidia-smi")
      and subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    )
    if smi and "GPU" in smi:
      stage.say(f"nvidia-smi lists {smi.strip()} but jax sees no GPU: {info}\n{r.stderr[-2000:]}")
      ctx.device = {**info, "nvidia_smi": smi.strip()}
      return 1
    if not ctx.allow_cpu:
      ctx.device = info
      return NO_GPU
    r = subprocess.run(
      [sys.executable, os.path.abspath(__file__), "detect", "--allow-cpu"],
      env=env,
      capture_output=True,
      text=True,
      timeout=300,
    )
    info = json.loads(r.stdout.strip().splitlines()[-1])
  elif r.returncode != 0:
    stage.say(f"could not import jax or list devices (exit {r.returncode}):\n{r.stderr[-3000:]}")
    ctx.device = {"error": r.stderr[-1000:]}
    return 1
  ctx.device = info
  ctx.mode = "cpu" if info.get("platform") == "cpu" else "gpu"
  # Every later process runs on the detected platform only: never a silent CPU fallback.
  ctx.env["JAX_PLATFORMS"] = info["platform"]
  return 0


# ------------------------------------------------------------------------------ stages
def stage_env(ctx: Ctx, st: Stage) -> str:
  note = ctx.install_note
  st.result["install"] = note
  used = note.get("installed", [])
  st.md += [
    "## Install (carried wheels only: pip install --no-deps --no-index)",
    "",
    f"Wheel folder: `{note.get('wheel_dir')}`; project: {note.get('project')}"
    + (f"; into `{note['target']}` (on PYTHONPATH)" if note.get("target") else "")
    + ".",
    "",
    f"Installed ({len(used)}): " + (", ".join(f"`{u}`" for u in used) or "nothing"),
    "",
    f"Already in the image, wheel not used ({len(note.get('already_present', []))}): "
    + (", ".join(note.get("already_present", [])) or "none"),
    "",
    "| module | version | |",
    "|---|---|---|",
  ]
  for mod, v in note.get("imports", {}).items():
    st.md.append(f"| {mod} | {v.get('version', '-')} | {'ok' if v.get('ok') else v.get('error')} |")
  for line in st.md:
    if line.startswith(("Installed", "Already", "Wheel")):
      st.say(line)
  # The environment: versions of every jax / CUDA distribution, the driver, pip's view.
  dists = _installed(ctx)
  st.result["jax_distributions"] = {
    k: v for k, v in dists.items() if k.startswith(("jax", "nvidia-", "libtpu"))
  }
  st.result["distributions"] = dists
  env = {k: v for k, v in os.environ.items() if k.startswith(("XLA_", "JAX_", "CUDA", "NVIDIA"))}
  st.result["environment"] = env
  smi = {}
  if shutil.which("nvidia-smi"):
    for key, argv in (
      ("list", ["nvidia-smi", "-L"]),
      ("query", ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,compute_cap",
                 "--format=csv,noheader"]),
      ("header", ["nvidia-smi"]),
    ):  # fmt: skip
      with contextlib.suppress(Exception):
        smi[key] = subprocess.run(argv, capture_output=True, text=True, timeout=60).stdout.strip()
    if "header" in smi:
      m = re.search(r"CUDA Version:\s*([\d.]+)", smi["header"])
      smi["cuda"] = m.group(1) if m else None
      smi["header"] = "\n".join(smi["header"].splitlines()[:12])
  st.result["nvidia_smi"] = smi
  chk = subprocess.run(
    [sys.executable, "-m", "pip", "check"], env=ctx.env, capture_output=True, text=True
  )
  st.result["pip_check"] = (chk.stdout + chk.stderr).strip()[-3000:]
  r = st.run("probe", [sys.executable, os.path.abspath(__file__), "probe"], 180, ctx.env)
  probes = {}
  with contextlib.suppress(json.JSONDecodeError, IndexError, OSError):
    lines = [x for x in _read(r["log"]).splitlines() if x.startswith("{")]
    probes = json.loads(lines[-1])
  st.result["probes"] = probes or {"error": r}
  st.md += [
    "",
    "## Environment",
    "",
    f"Device: `{json.dumps(ctx.device)}`",
    "",
    "jax distributions: "
    + ", ".join(f"{k} {v}" for k, v in st.result["jax_distributions"].items()),
    "",
    f"Driver: {smi.get('query', 'no nvidia-smi')}; CUDA (driver) {smi.get('cuda', '-')}",
    "",
    f"XLA / JAX environment: `{json.dumps(env)}`",
    "",
    f"`pip check`: {st.result['pip_check'][:500] or 'ok'}",
    "",
    "## Host memory probes (what offload / hot_cold need)",
    "",
  ]
  for k, v in (probes or {}).items():
    st.md.append(f"- {k}: {'ok' if v.get('ok') else 'FAILED ' + str(v.get('error', ''))}")
  ok = not note["missing"] and probes and all(v.get("ok") for v in probes.values())
  return "ok" if ok else "failed"


def _pytest_stage(ctx: Ctx, st: Stage, path: str, cpu_k: str) -> str:
  progress = os.path.join(ctx.work, f"{st.name}.progress.jsonl")
  with contextlib.suppress(FileNotFoundError):
    os.remove(progress)
  args = [sys.executable, "-m", "pytest", path, "-p", "gpu_check", "-rfEs", "-o", "addopts="]
  env = {
    "RECGNN_GPU_CHECK_PROGRESS": progress,
    "RECGNN_GPU_CHECK_EXPECT_PLATFORM": "gpu" if ctx.mode == "gpu" else "cpu",
    "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "tools"), ctx.env["PYTHONPATH"]]),
  }
  if ctx.mode == "gpu":
    # Bit-identical reruns (resume == uninterrupted) need deterministic scatters on a GPU;
    # tests comparing two backends state their own tolerance (tests/contract_lib.py).
    flags = (ctx.env.get("XLA_FLAGS", "") + " " + DETERMINISTIC).strip()
    # XLA aborts on a flag it does not know: try it first, go on without it if refused (the
    # bit-identical tests then skip, saying why).
    chk = subprocess.run(
      [sys.executable, "-c", "import jax, jax.numpy as j; print(j.ones(2).sum())"],
      env={**ctx.env, "XLA_FLAGS": flags}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if chk.returncode == 0:
      env["XLA_FLAGS"] = flags
    else:
      st.say(f"XLA refused {DETERMINISTIC}: {chk.stderr.strip()[-300:]}; running without it")
      st.result["deterministic_flag_refused"] = chk.stderr.strip()[-1000:]
  else:
    args += ["-k", cpu_k]  # CPU test mode: a subset that fits the stage on 2 cores
  st.result["command"] = shlex.join(args)
  st.result["xla_flags"] = env.get("XLA_FLAGS", ctx.env.get("XLA_FLAGS", ""))
  r = st.run(st.name, args, STAGE_SECONDS, env)
  rows = _read_jsonl(progress)
  counts: dict[str, int] = {}
  for x in rows:
    counts[x["outcome"]] = counts.get(x["outcome"], 0) + 1
  reasons: dict[str, int] = {}
  for x in rows:
    if x["outcome"] == "skipped":
      reasons[x.get("reason", "?")] = reasons.get(x.get("reason", "?"), 0) + 1
  failed = [{"test": x["test"], "error": x.get("error", "")[-1500:]} for x in rows
            if x["outcome"] == "failed"]  # fmt: skip
  tail = [ln for ln in _read(r["log"]).splitlines() if ln.strip()][-1:] if r else []
  st.result.update(
    pytest=r, counts=counts, skipped_reasons=reasons, failed=failed, pytest_last_line=tail,
    slowest=sorted(rows, key=lambda x: -x["seconds"])[:8],
  )  # fmt: skip
  st.md += [
    f"`{st.result['command']}`" + (f" with XLA_FLAGS=`{env['XLA_FLAGS']}`" if "XLA_FLAGS" in env
                                   else ""),
    "",
    f"**{counts.get('passed', 0)} passed, {counts.get('failed', 0)} failed, "
    f"{counts.get('skipped', 0)} skipped** (pytest {r['status']}, exit {r['exit_code']}, "
    f"{r['seconds']:.0f} s; last line: {' '.join(tail)})",
    "",
  ]  # fmt: skip
  if reasons:
    st.md += ["Skipped, with reasons:", ""]
    st.md += [f"- {n} x {why}" for why, n in sorted(reasons.items(), key=lambda kv: -kv[1])]
    st.md.append("")
  for f in failed:
    last = [ln for ln in f["error"].splitlines() if ln.strip()][-3:]
    st.md += [f"- FAILED `{f['test']}`: " + " / ".join(x.strip() for x in last)[:600]]
  ok = r["status"] == "ok" and not failed
  return "ok" if ok else ("timeout" if r["status"] == "timeout" else "failed")


def stage_contract(ctx: Ctx, st: Stage) -> str:
  return _pytest_stage(ctx, st, "tests/test_contract.py", "1x1 or refused or numpy")


def stage_trainer(ctx: Ctx, st: Stage) -> str:
  k = "profile_trace or auc_matches or unknown or divide or incompatible or epochs"
  return _pytest_stage(ctx, st, "tests/test_trainer.py", k)


def sizes(ctx: Ctx, traced: bool) -> dict:
  """Run sizes: the GPU's (synthetic 1M rows, batch 2048) or the CPU test mode's."""
  if ctx.mode == "gpu":
    s = {"steps": 300, "log_every": 50, "batch": 2048, "rows": 1_000_000, "cap": 180, "min": 60}
    if traced:  # the window after hotline_kaggle's profiling (84 batches) and migration
      s.update(steps=130, log_every=10, profile="110:115", cap=200)
  else:
    s = {"steps": 20, "log_every": 5, "batch": 512, "rows": 20_000, "cap": 170, "min": 75}
    if traced:
      s.update(steps=14, log_every=7, profile="10:13", cap=200)
  return s


def experiment_args(ctx: Ctx, name: str, s: dict, workdir: str) -> list[str]:
  spec = name
  if name == "hotline_kaggle" and ctx.mode == "cpu":
    spec = "hotline_kaggle:profile=0.005"  # 8 profiled batches: hot set fixed within 20 steps
  args = [
    sys.executable, "run.py", f"--experiment={spec}", f"--workdir={workdir}",
    f"--config.train.steps={s['steps']}", f"--config.train.log_every={s['log_every']}",
    f"--config.train.batch_size={s['batch']}", f"--config.data.synthetic.rows={s['rows']}",
    f"--config.data.cache_dir={os.path.join(ctx.work, 'data_cache')}",
    "--config.train.checkpoint_every=0",
  ]  # fmt: skip
  if name == "cdlrm_kaggle":  # a cache of >= one batch of rows (cdlrm_kaggle's min_rows arg)
    args[2] = f"--experiment=cdlrm_kaggle:min_rows={s['batch']}"
  if s.get("profile"):
    args.append(f"--profile_steps={s['profile']}")
  return args


def throughput(rows: list[dict], profile: tuple[int, int] | None = None) -> dict:
  """samples/s per logged interval; 'steady' = median over the intervals after the first
  (compilation) that do not overlap the profiled steps and compiled no new train-step
  program. Compiles are counted, not avoided: offload's exchange=bucket and hot_cold's
  cold_list=bucket (the defaults the experiments run) give the step a few shapes per run,
  so a later interval may hold a compile (the trainer's cumulative `link/programs` grows in
  it); such intervals are left out of 'steady' and counted in 'compiling_intervals', the
  programs beside the times ('programs')."""
  train = [r for r in rows if "samples_per_second" in r]
  intervals, prev, programs = [], 0, 0.0
  for r in train:
    now = r.get("link/programs", programs)
    intervals.append({
      "steps": [prev, r["step"]], "samples_per_second": r["samples_per_second"],
      "new_programs": int(now - programs),
    })  # fmt: skip
    prev, programs = r["step"], now
  later = [
    iv
    for i, iv in enumerate(intervals)
    if i > 0 and not (profile and iv["steps"][0] < profile[1] and iv["steps"][1] > profile[0])
  ]
  steady = [iv["samples_per_second"] for iv in later if not iv["new_programs"]]
  out: dict = {"intervals": intervals, "programs": int(programs)}
  out["compiling_intervals"] = sum(1 for iv in later if iv["new_programs"])
  if steady:
    out["steady"] = statistics.median(steady)
    out["steady_intervals"] = len(steady)
  elif intervals:  # too few intervals: the last one, compile or profile included
    out["steady"] = intervals[-1]["samples_per_second"]
    out["steady_intervals"] = 0
  if train:
    out["final_loss"] = train[-1].get("loss")
    out["steps"] = train[-1]["step"]
  return out


def backend_stats(rows: list[dict]) -> dict:
  """Per-table backend counters ('TABLE/KEY'; hot_cold's group-wide ones as '(group)'),
  averaged over the logged train intervals after the first (the first holds the cache's
  cold start and hot_cold's profiling); host <-> device transfer totals over the tables."""
  train = [r for r in rows if "samples_per_second" in r]
  use = train[1:] or train
  per_table: dict[str, dict[str, list]] = {}
  for r in use:
    for k, v in r.items():
      table, sep, key = k.partition("/")
      if not sep:  # a group-wide counter (hot_cold's: one group of tables)
        if k in ("step", "loss", "samples_per_second", "steps"):
          continue
        table, key = "(group)", k
      if table in ("valid", "test", "train", "emb") or not isinstance(v, (int, float)):
        continue
      per_table.setdefault(table, {}).setdefault(key, []).append(float(v))
  tables = {t: {k: statistics.fmean(v) for k, v in kv.items()} for t, kv in per_table.items()}
  out: dict = {"tables": tables}
  moved = {t: s for t, s in tables.items() if "h2d_bytes_per_step" in s}
  if moved:
    tot = {k: sum(s.get(k, 0.0) for s in moved.values()) for k in OFFLOAD_SUM}
    tot["tables"] = len(moved)
    hit = [s["hit_rate"] for s in moved.values() if "hit_rate" in s]
    if hit:
      tot["hit_rate_min_table"] = min(hit)
    out["transfers"] = tot
  return out


def _experiment_result(ctx: Ctx, name: str, r: dict, wd: str, profile) -> dict:
  rows = _read_jsonl(os.path.join(wd, "metrics.jsonl"))
  e = {**r, "workdir": wd, "samples_per_second": throughput(rows, profile)}
  e.update(backend_stats(rows))
  evals = {k: v for x in rows for k, v in x.items() if k.startswith(("valid/", "test/"))}
  if evals:
    e["eval"] = evals
  return e


def _train_rows(res: dict) -> list[str]:
  lines = [
    "| experiment | status | s | samples/s (steady) | programs / intervals compiling "
    "| final loss | valid AUC | H2D / step | D2H / step | planning ms / step |",
    "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for name, e in res.items():
    t = e.get("samples_per_second", {})
    tr = e.get("transfers")
    sps = f"{t['steady']:,.0f}" if "steady" in t else "-"
    loss = f"{t['final_loss']:.4f}" if t.get("final_loss") is not None else "-"
    auc = e.get("eval", {}).get("valid/auc")
    auc = f"{auc:.4f}" if auc is not None else "-"
    xfer = (
      [_fmt_bytes(tr["h2d_bytes_per_step"]), _fmt_bytes(tr["d2h_bytes_per_step"]),
       f"{tr['plan_ms_per_step']:.2f}"] if tr else ["-", "-", "-"]
    )  # fmt: skip
    lines.append(
      f"| {name} | {e['status']} | {e['seconds']:.0f} | {sps} | "
      f"{t.get('programs', '-')} / {t.get('compiling_intervals', '-')} | {loss} | {auc} | "
      + " | ".join(xfer)
      + " |"
    )
  return lines


def stage_train(ctx: Ctx, st: Stage) -> str:
  s = sizes(ctx, traced=False)
  names = ctx.experiments or list(EXPERIMENTS)
  st.result["settings"] = s
  res: dict = {}
  st.result["experiments"] = res
  for i, name in enumerate(names):
    wd = os.path.join(ctx.work, f"train_{name}")
    shutil.rmtree(wd, ignore_errors=True)
    # What is left, less a minimum for each experiment after this one (the first also builds
    # the dataset; a fast one leaves its time to the next).
    limit = min(s["cap"] + (60 if i == 0 else 0), st.left() - 10 - s["min"] * (len(names) - i - 1))
    r = st.run(f"train_{name}", experiment_args(ctx, name, s, wd), limit)
    res[name] = _experiment_result(ctx, name, r, wd, None)
    st.md[:] = [
      f"run.py per experiment: {s['steps']} steps, batch {s['batch']}, synthetic "
      f"{s['rows']:,} rows; samples/s: median over logged intervals after the first "
      "(compilation) that compiled no new train-step program (offload's and hot_cold's "
      "bucketed lists give a few shapes per run: those intervals are counted, not timed).",
      "",
      *_train_rows(res),
    ]
    st.write()
  ok = all(e["status"] == "ok" for e in res.values())
  return "ok" if ok else "failed"


def _small_trace(src: str, dst: str) -> str:
  """The trace as it is if small enough to return, else only the device's events, the step
  annotations and XLA's ops (no Python calls), re-compressed."""
  import gzip

  if os.path.getsize(src) <= TRACE_BYTES:
    shutil.copyfile(src, dst)
    return "whole"
  with gzip.open(src, "rt") as f:
    data = json.load(f)
  events = data["traceEvents"] if isinstance(data, dict) else data
  device = {e.get("pid") for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
            and str(e.get("args", {}).get("name", "")).startswith("/device")}  # fmt: skip
  keep = [
    e for e in events
    if e.get("ph") == "M" or e.get("pid") in device or e.get("name") == "train"
    or "hlo_op" in (e.get("args") or {})
  ]  # fmt: skip
  with gzip.open(dst, "wt", compresslevel=9) as f:
    json.dump({"traceEvents": keep}, f)
  if os.path.getsize(dst) > TRACE_BYTES:
    os.remove(dst)
    return "too large even trimmed: not returned"
  return f"trimmed to device events, steps and XLA ops ({len(keep)} of {len(events)} events)"


def _traced_run(
  ctx: Ctx, st: Stage, key: str, name: str, s: dict, extra: list[str], env: dict, limit: float
) -> dict:
  """One experiment run with the profiler on steps s["profile"] and the train step's HLO
  dumped (which XLA ops are the host exchange, where there is one): its result with the
  trace's summary (recgnn.trace_summary) and the trace returned under $OUT (trimmed)."""
  _tree_on_path()
  from recgnn import trace_summary  # stdlib only: importable before jax

  prof = tuple(int(x) for x in s["profile"].split(":"))
  wd = os.path.join(ctx.work, f"trace_{key}")
  hlo = os.path.join(ctx.work, f"hlo_{key}")
  shutil.rmtree(wd, ignore_errors=True)
  shutil.rmtree(hlo, ignore_errors=True)
  flags = f"--xla_dump_to={hlo} --xla_dump_hlo_as_text --xla_dump_hlo_module_re=jit_train_step"
  xla = " ".join(x for x in (ctx.env.get("XLA_FLAGS", ""), env.get("XLA_FLAGS", ""), flags) if x)
  r = st.run(f"trace_{key}", experiment_args(ctx, name, s, wd) + extra, limit,
             {**env, "XLA_FLAGS": xla})  # fmt: skip
  e = _experiment_result(ctx, name, r, wd, prof)
  try:
    summ = trace_summary.summarize(
      trace_summary.load(os.path.join(wd, "profile")),
      trace_summary.host_ops(trace_summary.read_hlo([hlo])),
    )
    e["trace_summary"] = {k: v for k, v in summ.items()}
    dst = os.path.join(ctx.out, f"trace_{key}.trace.json.gz")
    e["trace_returned"] = _small_trace(summ["trace"], dst)
    e["trace_file"] = os.path.basename(dst) if os.path.exists(dst) else None
  except (FileNotFoundError, ValueError, OSError) as err:
    e["trace_summary"] = {"error": f"{type(err).__name__}: {err}"}
  return e


def stage_trace(ctx: Ctx, st: Stage) -> str:
  _tree_on_path()
  from recgnn import trace_summary  # stdlib only: importable before jax

  s = sizes(ctx, traced=True)
  names = ctx.experiments or list(TRACED)
  st.result["settings"] = s
  res: dict = {}
  st.result["experiments"] = res
  for i, name in enumerate(names):
    limit = min(s["cap"] + (60 if i == 0 else 0), st.left() - 20 - s["min"] * (len(names) - i - 1))
    e = _traced_run(ctx, st, name, name, s, [], {}, limit)
    res[name] = e
    md = [
      f"run.py with --profile_steps={s['profile']}: {s['steps']} steps, batch {s['batch']}, "
      f"synthetic {s['rows']:,} rows; XLA's HLO of the train step dumped to find the host "
      "exchange's ops.",
      "",
      *_train_rows(res),
      "",
    ]
    for n, x in res.items():
      ts = x.get("trace_summary", {})
      if "mean" in ts:
        md.append(trace_summary.markdown(ts, title=n))
        md.append(f"Trace returned: `{x.get('trace_file')}` ({x.get('trace_returned')}).")
        tr = x.get("transfers")
        if tr:
          md.append(
            f"Backend counters over the run: H2D {_fmt_bytes(tr['h2d_bytes_per_step'])} per "
            f"step ({_fmt_bytes(tr.get('h2d_padded_bytes_per_step', 0))} padded), D2H "
            f"{_fmt_bytes(tr['d2h_bytes_per_step'])}."
          )
        md.append("")
      else:
        md += [f"{n}: no trace summary: {ts.get('error')}", ""]
    st.md[:] = md
    st.write()
  ok = all(e["status"] == "ok" and "mean" in e.get("trace_summary", {}) for e in res.values())
  return "ok" if ok else "failed"


def _tier_row(key: str, e: dict) -> str:
  t = e.get("samples_per_second", {})
  m = e.get("trace_summary", {}).get("mean")
  sps = f"{t['steady']:,.0f}" if "steady" in t else "-"
  if not m:
    return f"| {key} | {e['status']} | {sps} | - | - | - | - | - |"
  busy = m["busy_us"] / m["span_us"] if m["span_us"] else 0.0
  return (
    f"| {key} | {e['status']} | {sps} | {m['span_us'] / 1e3:.3f} | {m['busy_us'] / 1e3:.3f} "
    f"({100 * busy:.0f}%) | {m['other_copy_count']:.0f} / {_fmt_bytes(m['other_copy_bytes'])} "
    f"| {m['h2d_count']:.0f} / {_fmt_bytes(m['h2d_bytes'])}, {m['d2h_count']:.0f} / "
    f"{_fmt_bytes(m['d2h_bytes'])} | {m['graph_updates']:.0f} ({m['graph_update_us'] / 1e3:.3f} "
    "ms) |"
  )


def tier_checks(ctx: Ctx, res: dict) -> list[str]:
  """Per tiers run: its pinned -> pinned copies per traced step (the trace's MemcpyOther
  events: a host table copied whole; the target is 0) and the feed it used."""
  note = "" if ctx.mode == "gpu" else " (CPU test mode: no device copies to see)"
  out = []
  for key, e in res.items():
    m = e.get("trace_summary", {}).get("mean")
    if not m:
      why = e.get("trace_summary", {}).get("error") or e.get("status")
      out.append(f"{key}: pinned -> pinned copies per step: no trace ({why})")
      continue
    n, size = m["other_copy_count"], _fmt_bytes(m["other_copy_bytes"])
    feed = f"{e.get('feed_used', '?')} feed" + (f", host link per step {_link(e)}" if _link(e)
                                                 else "")  # fmt: skip
    out.append(f"{key}: pinned -> pinned copies per step: {n:g} ({size}) (target 0): "
               f"{'yes' if n == 0 else 'NO'}; {feed}{note}")  # fmt: skip
  return out


def stage_tiers(ctx: Ctx, st: Stage) -> str:
  """Issue 42's check: dense, offload and hot_cold (dlrm_kaggle, cdlrm_kaggle,
  hotline_kaggle) at Kaggle's table sizes (synthetic scale 1.0 on a GPU) and batch 2048,
  steady samples/s and a 5-step trace of each, summarized: the device's busy share of a step,
  pinned -> pinned copies (the whole-table copies of the first H100 run: zero is the
  target), host <-> device copies, CUDA graph updates; then again with XLA's command buffers
  off (NO_COMMAND_BUFFER). The budget is shared: runs that do not fit are marked skipped
  (the second setting's runs before the first's)."""
  s = sizes(ctx, traced=True)
  scale = 1.0 if ctx.mode == "gpu" else 0.01
  settings = [("default", {}), ("no_command_buffer", {"XLA_FLAGS": NO_COMMAND_BUFFER})]
  names = ctx.experiments or list(TIERS)
  # (cdlrm_kaggle's budget is a tenth of its default scale's tables: none here)
  extra = [f"--config.data.synthetic.scale={scale}", "--config.device_memory_budget="]
  st.result["settings"] = {**s, "scale": scale}
  res: dict = {}
  st.result["runs"] = res
  todo = [(setting, env, name) for setting, env in settings for name in names]
  for i, (setting, env, name) in enumerate(todo):
    key = f"{name}/{setting}"
    # Runs in order: each gets at least s["min"] while that is left (else it is skipped),
    # and no more than leaves s["min"] to each later run of the default setting (the second
    # setting's runs take what the first leaves: with a small budget they are skipped).
    later = sum(1 for x in todo[i + 1 :] if x[0] == settings[0][0])
    left = st.left() - 20
    if left < s["min"]:
      res[key] = {"status": "skipped (no time left)", "seconds": 0.0}
      st.say(f"{key}: skipped (no time left)")
      continue
    limit = min(s["cap"] + (60 if i == 0 else 0), max(s["min"], left - s["min"] * later))
    e = _traced_run(ctx, st, key.replace("/", "_"), name, s, extra, env, limit)
    e["feed_used"], e["feed_line"] = feed_used(_read(e["log"]))
    res[key] = e
    st.result["checks"] = tier_checks(ctx, res)
    st.say(st.result["checks"][-1])
    st.md[:] = [
      f"run.py with --profile_steps={s['profile']}: {s['steps']} steps, batch {s['batch']}, "
      f"synthetic {s['rows']:,} rows at Kaggle's cardinalities x {scale}; settings: default, "
      f"and {NO_COMMAND_BUFFER} (XLA:GPU's CUDA graphs off). Per step (the trace's mean over "
      "its whole steps): the step's window, the device busy in it, pinned -> pinned copies "
      "(MemcpyOther: the whole-table copies of the first H100 run; target 0), H2D / D2H "
      "copies, CUDA graph updates.",
      "",
      "| run | status | samples/s (steady) | step ms | busy ms (share) | pinned->pinned n / "
      "bytes | H2D n / bytes, D2H n / bytes | graph updates (ms) |",
      "|---|---|---:|---:|---:|---:|---:|---:|",
      *[_tier_row(k, e) for k, e in res.items()],
      "",
      *[f"- {x}" for x in st.result["checks"]],
    ]
    st.write()
  ran = [e for e in res.values() if not e["status"].startswith("skipped")]
  ok = ran and all(e["status"] == "ok" and "mean" in e.get("trace_summary", {}) for e in ran)
  return "ok" if ok else "failed"


# ------------------------------------------------------------------------------ perf
# Issue 43's GPU targets, checked against what this stage measures.
PERF_TARGETS = {"small": 2_000_000, "large": 10_000_000, "busy": 0.70, "vs_torch": 1.5}
# The feeds compared side by side (train.feed: recgnn/train/device_feed.py), each config run
# with both: the device's (the data placed once, each step gathering its batch there) and
# the host's (batches read and packed on the host, put per call).
FEEDS = ("device", "host")


def perf_sizes(ctx: Ctx) -> dict:
  """The perf stage's runs: dlrm_kaggle (dense tables) at a small and a large batch."""
  if ctx.mode == "gpu":
    return {"small": 2048, "large": 65536, "rows": 1_000_000, "k": (1, 8),
            "steps": {2048: 400, 65536: 100}, "log_every": {2048: 40, 65536: 10},
            "torch_steps": {2048: 60, 65536: 12}, "trace_at": {2048: 200, 65536: 50}}  # fmt: skip
  return {"small": 512, "large": 4096, "rows": 20_000, "k": (1, 8),
          "steps": {512: 32, 4096: 16}, "log_every": {512: 8, 4096: 4},
          "torch_steps": {512: 8, 4096: 4}, "trace_at": {512: 16, 4096: 8}}  # fmt: skip


def perf_args(
  ctx: Ctx, s: dict, batch: int, dtype: str, k: int, wd: str, trace: bool, feed: str = ""
):
  """run.py's arguments for one perf run (feed: train.feed; "" leaves the config's)."""
  steps, log_every = s["steps"][batch], s["log_every"][batch]
  if k > 1:  # whole calls of k steps: every count a multiple of k
    log_every = max(k, log_every // k * k)
    steps = steps // log_every * log_every
  args = [
    sys.executable, "run.py", "--experiment=dlrm_kaggle", f"--workdir={wd}",
    f"--config.train.steps={steps}", f"--config.train.log_every={log_every}",
    f"--config.train.batch_size={batch}", f"--config.data.synthetic.rows={s['rows']}",
    f"--config.data.cache_dir={os.path.join(ctx.work, 'data_cache')}",
    "--config.train.checkpoint_every=0", "--config.train.eval_every=0",
    "--config.train.final_eval_splits=()", f"--config.model.dtype={dtype}",
  ]  # fmt: skip
  if k > 1:
    args.append(f"--config.train.steps_per_call={k}")
  if feed:
    args.append(f"--config.train.feed={feed}")
  if trace:
    a = s["trace_at"][batch] // max(k, 1) * max(k, 1)
    args.append(f"--profile_steps={a}:{a + 5 * max(k, 1)}")
  return args


def perf_runs(s: dict) -> list[tuple[int, str, int, bool, str]]:
  """(batch, dtype, k, traced, feed) of each recgnn run, each config with the device feed
  and then the host feed, the traced ones first (they matter most if the stage runs out of
  time): the large batch's bf16 step, the small batch's f32 step; then the small batch with
  k steps per call (train.steps_per_call)."""
  small, large = s["small"], s["large"]
  configs = [(large, "bfloat16", 1, True), (small, "float32", 1, True)]
  configs += [(small, "float32", k, False) for k in s["k"] if k > 1]
  return [(b, d, k, t, feed) for b, d, k, t in configs for feed in FEEDS]


def perf_name(batch: int, dtype: str, k: int, feed: str) -> str:
  return f"b{batch}_{dtype}_k{k}_{feed}"


def perf_torch_runs(s: dict, mode: str) -> list[tuple[int, str]]:
  """(batch, mode) of the PyTorch peer's runs: on a GPU torch.compile's at each recgnn batch,
  with bf16 autocast at the large one (recgnn's large runs are bf16), the large batch first
  (the figure the device feed is measured against); on CPU eager only."""
  if mode == "gpu":
    return [(s["large"], "compiled_bf16"), (s["small"], "compiled")]
  return [(s["small"], "eager"), (s["large"], "eager")]


def _busy(summary: dict) -> dict:
  """GPU-busy fraction of the step and the gaps, from a trace summary's mean."""
  m = summary["mean"]
  span = m["span_us"] or float("nan")
  return {"busy_fraction": m["busy_us"] / span, "step_ms": span / 1e3,
          "busy_ms": m["busy_us"] / 1e3, "gap_ms": (span - m["busy_us"]) / 1e3,
          "kernels": m["kernels"], "h2d_ms": m["h2d_us"] / 1e3}  # fmt: skip


def _link(e: dict) -> str:
  """The step's host-link bytes per step as the trainer's traffic metrics read them off its
  HLO (`link/...`: the batch's transfer and any host transfer inside the step), or ""."""
  link = e.get("tables", {}).get("link", {})
  if "host_to_device_bytes" not in link:
    return ""
  return (f"{_fmt_bytes(link['host_to_device_bytes'])} to device / "
          f"{_fmt_bytes(link.get('device_to_host_bytes', 0))} to host")  # fmt: skip


_FEED_RE = re.compile(r"^Input: ((device|host) feed.*)$", re.M)


def feed_used(log: str) -> tuple[str, str]:
  """(device | host | ?, the trainer's line saying which feed and why) from a run's log."""
  m = _FEED_RE.findall(log)
  return (m[-1][1], m[-1][0]) if m else ("?", "")


def _perf_line(name: str, e: dict) -> str:
  sps, t = _steady(e), e.get("trace", {})
  busy = f", GPU busy {100 * t['busy_fraction']:.0f}%" if "busy_fraction" in t else ""
  link = f", host link per step {_link(e)}" if _link(e) else ""
  return (f"{name}: {e.get('status')}, {f'{sps:,.0f}' if sps else '-'} samples/s{busy}{link}"
          f" (feed used: {e.get('feed_used', '?')})")  # fmt: skip


def stage_perf(ctx: Ctx, st: Stage) -> str:
  """dlrm_kaggle's throughput at two batches (the small one also with k steps per call),
  each with the device feed and the host feed; the k = 1 runs traced (5 steps,
  recgnn.trace_summary: the GPU-busy fraction and gaps); the PyTorch peer on the same
  batches; the ratios device / host feed and recgnn / PyTorch printed (`checks`)."""
  _tree_on_path()
  from recgnn import trace_summary  # stdlib only

  s = perf_sizes(ctx)
  st.result["settings"] = {k: (v if not isinstance(v, dict) else {str(a): b for a, b in v.items()})
                           for k, v in s.items()}  # fmt: skip
  res: dict = {}
  st.result["recgnn"] = res
  # The PyTorch peer runs last; it gets what the recgnn runs leave, at least this (less the
  # stop's grace, KILL_GRACE + 5 s): a short budget skips the last recgnn run first.
  torch_min = 60
  runs = perf_runs(s)
  for i, (batch, dtype, k, traced, feed) in enumerate(runs):
    name = perf_name(batch, dtype, k, feed)
    wd = os.path.join(ctx.work, f"perf_{name}")
    shutil.rmtree(wd, ignore_errors=True)
    # Runs in order: each needs 30 s (else skipped) and leaves 20 s to each later one where it
    # can (a short budget skips the last runs, not the first).
    left = st.left() - torch_min
    if left < 30:
      res[name] = {"status": "skipped", "why": "the stage's time ran out", "batch": batch,
                   "dtype": dtype, "k": k, "feed": feed}  # fmt: skip
      st.say(f"{name}: skipped (the stage's time ran out)")
      continue
    limit = max(30, left - 20 * (len(runs) - i - 1))
    r = st.run(f"perf_{name}", perf_args(ctx, s, batch, dtype, k, wd, traced, feed), limit)
    log = _read(r["log"])
    prof = None
    if traced:
      a = s["trace_at"][batch] // k * k
      prof = (a, a + 5 * k)
    e = _experiment_result(ctx, name, r, wd, prof)
    e.update(batch=batch, dtype=dtype, k=k, feed=feed)
    e["feed_used"], e["feed_line"] = feed_used(log)
    if traced and r["status"] == "ok":
      try:
        summ = trace_summary.summarize(trace_summary.load(os.path.join(wd, "profile")))
        e["trace"] = {**_busy(summ), "steps": summ["steps"], "windows": summ["windows"]}
        e["trace_md"] = trace_summary.markdown(summ, title=name)
      except (FileNotFoundError, ValueError, OSError) as err:
        e["trace"] = {"error": f"{type(err).__name__}: {err}"}
    res[name] = e
    st.say(_perf_line(name, e))
    st.md[:] = perf_markdown(ctx, s, res, st.result.get("torch"))
    st.write()
  # The PyTorch peer on the same batches (a process of its own: torch and jax apart).
  out = os.path.join(ctx.work, "perf_torch.json")
  with contextlib.suppress(FileNotFoundError):
    os.remove(out)
  peer = perf_torch_runs(s, ctx.mode)
  argv = [sys.executable, os.path.abspath(__file__), "perf-torch", out, "--mode", ctx.mode,
          "--rows", str(s["rows"]), "--cache_dir", os.path.join(ctx.work, "data_cache"),
          "--runs", ",".join(f"{b}:{m}" for b, m in peer),
          "--steps", ",".join(f"{b}:{n}" for b, n in s["torch_steps"].items())]  # fmt: skip
  r = st.run("perf_torch", argv, st.left() - 10)
  torch_res = json.loads(_read(out)) if os.path.exists(out) else {"status": r["status"]}
  st.result["torch"] = torch_res
  st.md[:] = perf_markdown(ctx, s, res, torch_res)
  st.result["checks"] = perf_checks(ctx, s, res, torch_res)
  st.md += ["", *[f"- {x}" for x in st.result["checks"]]]
  for x in st.result["checks"]:
    st.say(x)
  for e in res.values():
    if e.get("trace_md"):
      st.md += ["", e.pop("trace_md")]
  wrong = [n for n, e in res.items() if e.get("status") == "ok" and e.get("feed_used") not in
           (e.get("feed"), "?")]  # fmt: skip
  if wrong:
    st.say(f"runs that did not use the feed asked for: {', '.join(wrong)}")
  # (a run skipped for time is not a failure: its line says so, its ratio is missing)
  done = [e for e in res.values() if e.get("status") != "skipped"]
  ok = done and all(e.get("status") == "ok" for e in done) and not wrong
  return "ok" if ok else "failed"


def _steady(e: dict) -> float | None:
  return e.get("samples_per_second", {}).get("steady")


def perf_markdown(ctx: Ctx, s: dict, res: dict, torch_res: dict | None) -> list[str]:
  lines = [
    f"dlrm_kaggle (26 dense tables, synthetic {s['rows']:,} rows) through run.py, each "
    "config with train.feed=device (the data on the device, each step gathering its batch "
    "there) and train.feed=host (batches read and packed on the host); samples/s: median of "
    "the logged intervals after the first that compiled nothing and held no profiled step. "
    "Traced runs: 5 steps, GPU-busy = device busy / step window (recgnn.trace_summary).",
    "",
    "Host link per step: the trainer's `link/` metrics (its HLO: the batch's or the cursor's "
    "transfer).",
    "",
    "| run | status | feed (used) | samples/s | final loss | host link per step | step ms (traced) "
    "| busy | gap ms |",
    "|---|---|---|---:|---:|---:|---:|---:|---:|",
  ]
  for name, e in res.items():
    sps = _steady(e)
    t = e.get("trace", {})
    loss = e.get("samples_per_second", {}).get("final_loss")
    lines.append(
      f"| {name} | {e.get('status')} | {e.get('feed', '-')} ({e.get('feed_used', '-')}) | "
      f"{f'{sps:,.0f}' if sps else '-'} | {f'{loss:.4f}' if loss is not None else '-'} | "
      f"{_link(e) or '-'} | "
      + (
        f"{t['step_ms']:.3f} | {100 * t['busy_fraction']:.0f}% | {t['gap_ms']:.3f} |"
        if "step_ms" in t
        else "- | - | - |"
      )  # fmt: skip
    )
  if torch_res:
    lines += ["", "PyTorch peer (peers_dlrm.build_pytorch_on: EmbeddingBag sum + sparse SGD, "
              "reference MLPs, dot interaction; batches copied from pinned memory per step), "
              "the same batches:", ""]  # fmt: skip
    if torch_res.get("skipped"):
      lines.append(f"- not run: {torch_res['skipped']}")
    for name, t in torch_res.get("runs", {}).items():
      if "samples_per_s" in t:
        lines.append(f"- {name}: {t['samples_per_s']:,.0f} samples/s (loss {t['final_loss']:.4f})")
      else:
        lines.append(f"- {name}: {t.get('error', 'not run')}")
  return lines


def perf_checks(ctx: Ctx, s: dict, res: dict, torch_res: dict) -> list[str]:
  """The ratios (device feed / host feed per config, recgnn / PyTorch per batch) and issue
  43's GPU targets against this run's figures (on CPU: printed, not targets)."""

  def best(batch, dtype=None, feed=None):
    v = [_steady(e) for e in res.values() if e.get("batch") == batch
         and (dtype is None or e.get("dtype") == dtype)
         and (feed is None or e.get("feed") == feed) and _steady(e)]  # fmt: skip
    return max(v) if v else None

  def fmt(v):
    return f"{v:,.0f}" if v else "-"

  note = "" if ctx.mode == "gpu" else " (CPU test mode: the targets are a GPU's)"
  out = []
  # Device feed / host feed, config by config (the same batch, dtype and k).
  configs = dict.fromkeys((e["batch"], e["dtype"], e["k"]) for e in res.values() if "k" in e)
  for b, d, k in configs:
    pair = {e["feed"]: e for e in res.values() if (e.get("batch"), e.get("dtype"), e.get("k"))
            == (b, d, k) and e.get("feed")}  # fmt: skip
    dev, host = (_steady(pair.get(f, {})) for f in FEEDS)
    ratio = f"{dev / host:.2f}x" if dev and host else "no ratio (a run has no figure)"
    busy = [pair.get(f, {}).get("trace", {}).get("busy_fraction") for f in FEEDS]
    busy = (f"; GPU busy {100 * busy[0]:.0f}% / {100 * busy[1]:.0f}%"
            if all(x is not None for x in busy) else "")  # fmt: skip
    out.append(f"batch {b} {d} k={k}: device feed {fmt(dev)} / host feed {fmt(host)} "
               f"samples/s = {ratio}{busy}")  # fmt: skip
  small, large = best(s["small"]), best(s["large"], "bfloat16")
  for label, v, target in (("small", small, PERF_TARGETS["small"]),
                           ("large", large, PERF_TARGETS["large"])):  # fmt: skip
    b = s[label]
    if v is None:
      out.append(f"batch {b}: no steady figure{note}")
    else:
      out.append(f"batch {b}: {v:,.0f} samples/s (target >= {target:,}): "
                 f"{'yes' if v >= target else 'NO'}{note}")  # fmt: skip
  # The busy target: the large bf16 step with the device feed (else any traced large run).
  traced = sorted((e for e in res.values() if e.get("batch") == s["large"] and "busy_fraction"
                   in e.get("trace", {})), key=lambda e: e.get("feed") != "device")  # fmt: skip
  if traced:
    f = traced[0]["trace"]["busy_fraction"]
    out.append(f"batch {s['large']} bf16, {traced[0].get('feed')} feed: GPU busy {100 * f:.0f}% "
               f"of the step (target >= {100 * PERF_TARGETS['busy']:.0f}%): "
               f"{'yes' if f >= PERF_TARGETS['busy'] else 'NO'}{note}")  # fmt: skip
  # recgnn / PyTorch per batch: each feed's best against the peer's best at that batch.
  peer = torch_res.get("runs", {}) if torch_res else {}
  for b in (s["small"], s["large"]):
    theirs = {n: t["samples_per_s"] for n, t in peer.items() if n.startswith(f"b{b}_")
              and "samples_per_s" in t}  # fmt: skip
    mine = {f: best(b, feed=f) for f in FEEDS}
    if not any(mine.values()):
      continue
    if not theirs:
      out.append(f"batch {b}: no PyTorch figure to compare "
                 f"({(torch_res or {}).get('skipped', 'peer not run')})")  # fmt: skip
      continue
    who = max(theirs, key=theirs.get)
    parts = [f"{f} feed {v / theirs[who]:.2f}" for f, v in mine.items() if v]
    top = max(v for v in mine.values() if v) / theirs[who]
    out.append(f"batch {b}: recgnn / PyTorch {who.split('_', 1)[1]} ({fmt(theirs[who])} "
               f"samples/s) = {', '.join(parts)} (target >= {PERF_TARGETS['vs_torch']}): "
               f"{'yes' if top >= PERF_TARGETS['vs_torch'] else 'NO'}{note}")  # fmt: skip
  return out


def perf_torch(args) -> int:
  """(The perf stage's subprocess.) The PyTorch peer on dlrm_kaggle's batches: the same
  synthetic data (recgnn's reader, seed 0, shuffled as the trainer reads it); the runs
  asked for (BATCH:MODE; modes eager, compiled: torch.compile of the dense part,
  compiled_bf16: that under bf16 autocast; compiled ones on a GPU only), each result written
  as it finishes."""
  out: dict = {"runs": {}}

  def save():
    with open(args.out, "w") as f:
      json.dump(out, f, indent=1)

  try:
    import torch
  except Exception as e:  # noqa: BLE001 (any failure: the peer cannot run here)
    out["skipped"] = f"torch does not import here ({type(e).__name__}: {e})"
    print(out["skipped"], flush=True)
    save()
    return 0
  _benchmarks_on_path()
  from peers import dlrm as peers_dlrm

  from experiments import dlrm_kaggle
  from recgnn.tasks import ctr

  device = "cuda" if args.mode == "gpu" and torch.cuda.is_available() else "cpu"
  out["torch"] = torch.__version__
  out["device"] = torch.cuda.get_device_name() if device == "cuda" else "cpu"
  c = dlrm_kaggle.get_config()
  c.data.synthetic.rows = args.rows
  c.data.cache_dir = args.cache_dir
  data, _ = ctr.open_dataset(c.data)
  cfg = peers_dlrm.DlrmConfig(num_rows=tuple(int(x) for x in data.cardinalities))
  modes = {"eager": (False, False), "compiled": (True, False), "compiled_bf16": (True, True)}
  runs = [(int(b), m) for b, m in (x.split(":") for x in args.runs.split(","))]
  steps_of = {int(b): int(n) for b, n in (x.split(":") for x in args.steps.split(","))}
  if device == "cpu" and any(m != "eager" for _, m in runs):
    out["note"] = "CPU test mode: eager only (torch.compile's CPU build is not what is measured)"
    runs = list(dict.fromkeys((b, "eager") for b, _ in runs))
  batches_of = {}
  for batch in dict.fromkeys(b for b, _ in runs):
    it = data.batches("train", batch, start_step=0, shuffle_seed=c.seed, num_epochs=None)
    batches_of[batch] = []
    for _ in range(min(steps_of[batch], 8)):
      b = next(it)
      ids = [b["ids"][n][:, 0] for n in data.table_names]
      batches_of[batch].append(peers_dlrm.Batch.of(b["dense"], ids, b["label"]))
  for batch, mode in runs:
    name, steps = f"b{batch}_{mode}", steps_of[batch]
    try:
      compiled, bf16 = modes[mode]
      to_inputs, step, sync = peers_dlrm.build_pytorch_on(cfg, device, 0, compiled, bf16)
      inputs = [to_inputs(b) for b in batches_of[batch]]
      r = peers_dlrm.time_steps(step, inputs, batch, warmup=3, reps=3,
                                steps_per_rep=max(1, steps // 3), sync=sync)  # fmt: skip
      r["final_loss"] = float(step(inputs[0]).item())
      out["runs"][name] = r
      print(f"{name}: {r['samples_per_s']:,.0f} samples/s", flush=True)
    except Exception as e:  # noqa: BLE001 (one run failing leaves the others)
      out["runs"][name] = {"error": f"{type(e).__name__}: {e}"}
      print(f"{name}: {type(e).__name__}: {e}", flush=True)
    save()
  return 0


# Small levels beside benchmarks/tt.py's: where a fixed (launch) cost shows against the
# per-product terms. (p_prev, a, r, d, r1, p)
CALIBRATE_EXTRA = [(8, 2, 32, 2, 32, 16), (16, 4, 32, 4, 1, 64), (64, 2, 32, 2, 32, 128)]


def calibrate_run(out: str, reps: int, steps: int) -> int:
  """(In the stage's subprocess.) Time benchmarks/tt.py's levels here; fit; write JSON."""
  _benchmarks_on_path()
  import jax
  import tt as tt_bench  # benchmarks/tt.py

  from recgnn.backends import tt

  args = argparse.Namespace(reps=reps, steps=steps,
                            level_shapes=[*CALIBRATE_EXTRA, *tt_bench.LEVEL_SHAPES])  # fmt: skip
  levels = tt_bench.levels(args)["results"]
  kind = jax.devices()[0].device_kind
  backend = jax.default_backend()
  key = f"{backend}:{kind}"
  source = (
    f"{kind} ({backend}), jax {jax.__version__}, {time.strftime('%Y-%m-%d')}: gpu_check "
    f"calibrate (benchmarks/tt.py levels, {len(levels)} levels, reps {reps} x {steps})"
  )
  fit = tt.fit_cost_model(levels, source=source, platform=key)
  current = tt.cost_model()

  def agree(model):
    return sum(
      tt.level_product(x["p_prev"], x["a"], x["r"], x["slices"], x["d"], x["r1"], x["p"], model)
      == x["faster"]
      for x in levels
    )

  import dataclasses

  entry = {k: v for k, v in dataclasses.asdict(fit).items() if k != "platform"}
  res = {
    "key": key,
    "entry": entry,
    "levels": levels,
    "agree_fitted": agree(fit),
    "agree_current": agree(current),
    "current_platform": current.platform,
    "agree_cpu_model": agree(tt.CPU_COSTS),
  }
  with open(out, "w") as f:
    json.dump(res, f, indent=2)
  print(json.dumps({k: v for k, v in res.items() if k != "levels"}))
  return 0


def stage_calibrate(ctx: Ctx, st: Stage) -> str:
  raw = os.path.join(ctx.work, "calibrate_raw.json")
  with contextlib.suppress(FileNotFoundError):
    os.remove(raw)
  reps, steps = (5, 20) if ctx.mode == "gpu" else (2, 3)
  r = st.run(
    "calibrate",
    [sys.executable, os.path.abspath(__file__), "calibrate-run", raw, str(reps), str(steps)],
    STAGE_SECONDS,
  )
  if not os.path.exists(raw):
    st.md.append(f"calibration did not finish: {r['status']} (exit {r['exit_code']})")
    return "failed"
  res = json.loads(_read(raw))
  st.result.update(res)
  n = len(res["levels"])
  e = res["entry"]
  st.md += [
    f"tt `contract=auto` cost model fitted on `{res['key']}` to {n} timed levels (forward + "
    "vjp of one level, batched vs pairs; benchmarks/tt.py levels plus small ones):",
    "",
    f"- batched ~ {e['batched_fixed_ns']:.0f} ns + P_k x ({e['batched_ns']:.1f} ns + w x "
    f"{e['batched_ns_per_mac']:.2e} ns)",
    f"- pairs ~ {e['pairs_fixed_ns']:.0f} ns + P_(k-1) x S_k x w x {e['pairs_ns_per_mac']:.2e} ns",
    "",
    f"The fitted model picks the faster product at {res['agree_fitted']} of {n} levels; the "
    f"model this platform uses now (`{res['current_platform']}`) at {res['agree_current']}; "
    f"XLA:CPU's at {res['agree_cpu_model']}.",
    "",
    "Use it on this platform: `python tools/gpu_check.py merge-tt-cost calibrate.json` "
    "(into recgnn/backends/tt/tt_cost.json), then commit.",
    "",
    "| P_(k-1) | a | d x r_k | P_k | S_k | batched ms | pairs ms | faster |",
    "|---:|---:|---:|---:|---:|---:|---:|---|",
  ]
  for x in res["levels"]:
    st.md.append(
      f"| {x['p_prev']} | {x['a']} | {x['d']} x {x['r1']} | {x['p']} | {x['slices']} | "
      f"{x['batched_ms']:.4f} | {x['pairs_ms']:.4f} | {x['faster']} |"
    )
  return "ok" if r["status"] == "ok" else "failed"


STAGE_FNS = {
  "env": stage_env,
  "contract": stage_contract,
  "trainer": stage_trainer,
  "train": stage_train,
  "trace": stage_trace,
  "calibrate": stage_calibrate,
  "tiers": stage_tiers,
  "perf": stage_perf,
}


def run_stages(args) -> int:
  names = list(STAGES) if args.stage == "all" else [s for s in args.stage.split(",") if s]
  bad = [s for s in names if s not in STAGE_FNS]
  if bad or not names:
    print(f"gpu_check: unknown stage {bad or names}; available: {', '.join(STAGES)}, all",
          file=sys.stderr)  # fmt: skip
    return 2
  ctx = Ctx(args)
  failed = []
  for name in names:
    st = Stage(ctx, name)
    try:
      if not ctx.device:
        rc = detect_device(ctx, st)
        if rc == NO_GPU:
          st.say(f"no GPU found: {ctx.device}; nothing to check (exit 0). Test mode: --allow-cpu")
          st.md.append("No GPU found; nothing checked. CPU test mode: --allow-cpu.")
          st.write("no gpu")
          return 0
        if rc:
          st.md.append("No usable device: see the log.")
          st.write("failed")
          return 1
        st.say(f"device: {json.dumps(ctx.device)}")
      if not ensure_env(ctx, st, verbose=name == "env") and name != "env":
        st.result["install"] = ctx.install_note
        st.md.append(f"Missing after install: {ctx.install_note['missing']} (see env stage)")
        st.write("failed")
        failed.append(name)
        continue
      status = STAGE_FNS[name](ctx, st)
    except Exception as e:  # noqa: BLE001 (write what the stage has, then go on)
      import traceback

      st.say(f"stage crashed: {type(e).__name__}: {e}\n{traceback.format_exc()}")
      st.md.append(f"Stage crashed: `{type(e).__name__}: {e}` (see the log).")
      status = "failed"
    st.write(status)
    st.say(f"{status} in {st.result['seconds']:.0f} s; wrote {ctx.out}/{name}.{{json,md,log}}")
    if status != "ok":
      failed.append(name)
  if failed:
    print(f"[gpu_check] done with failures: {', '.join(failed)} (results in {ctx.out})")
    return 1
  print(f"[gpu_check] done: {', '.join(names)} passed (results in {ctx.out})")
  return 0


# --------------------------------------------------------------------------- merge, report
def merge_tt_cost(path: str, target: str | None = None, force: bool = False) -> int:
  """Merge a calibrate stage's fit (its calibrate.json) into recgnn/backends/tt/tt_cost.json:
  under 'BACKEND:DEVICE KIND', and under 'BACKEND' too while that has no entry (a fitted GPU
  is a better guess for another GPU than the CPU's constants)."""
  target = target or os.path.join(ROOT, "recgnn", "backends", "tt", "tt_cost.json")
  res = json.loads(_read(path))
  if "key" not in res or "entry" not in res:
    raise SystemExit(f"{path}: not a calibrate stage's result (no 'key' / 'entry')")
  key, entry = res["key"], res["entry"]
  if key.split(":", 1)[0] == "cpu" and not force:
    raise SystemExit(
      f"{path}: a CPU fit (the --allow-cpu test mode's few repetitions). XLA:CPU's constants "
      "are tt.CPU_COSTS, fitted on the reference machine; --force merges this one anyway."
    )
  need = {"batched_ns", "batched_ns_per_mac", "pairs_ns_per_mac", "source"}
  if not need <= entry.keys():
    raise SystemExit(f"{path}: the fit lacks {sorted(need - entry.keys())}")
  cur = json.loads(_read(target)) if os.path.exists(target) else {}
  cur[key] = entry
  print(f"{target}: {key} <- {entry['source']}")
  backend = key.split(":", 1)[0]
  if backend not in cur and backend != key:
    cur[backend] = {**entry, "source": f"{entry['source']} (the {key} fit, for any {backend})"}
    print(f"{target}: {backend} <- the same fit")
  with open(target, "w") as f:
    json.dump(cur, f, indent=2)
    f.write("\n")
  return 0


def report(folder: str) -> int:
  """summary.md in a results folder: every stage's markdown, in stage order."""
  parts = [f"# GPU check results: `{folder}`", ""]
  for name in STAGES:
    md = os.path.join(folder, f"{name}.md")
    if os.path.exists(md):
      parts += [_read(md).replace("# gpu_check", "## gpu_check", 1), ""]
    else:
      parts += [f"## gpu_check {name}: not run", ""]
  with open(os.path.join(folder, "summary.md"), "w") as f:
    f.write("\n".join(parts))
  print(f"wrote {os.path.join(folder, 'summary.md')}")
  return 0


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  sub = p.add_subparsers(dest="cmd", required=True)
  s = sub.add_parser("stage", help="run stages (what gpu_check.sh calls)")
  s.add_argument("--stage", required=True, help=f"comma-separated: {', '.join(STAGES)}; or all")
  s.add_argument("--out", required=True, help="results folder (on a lent GPU machine: $OUT)")
  s.add_argument("--allow-cpu", action="store_true", help="CPU test mode when there is no GPU")
  s.add_argument("--wheels", help="wheel folder [.gpu-wheels, shared/gpu-wheels, ../shared/...]")
  s.add_argument("--work", help="full logs, workdirs, traces, data [/tmp/recgnn_gpu_check]")
  s.add_argument("--experiments", nargs="*", help="train / trace / tiers: these experiments")
  d = sub.add_parser("detect")
  d.add_argument("--allow-cpu", action="store_true")
  sub.add_parser("probe")
  c = sub.add_parser("calibrate-run")
  c.add_argument("out")
  c.add_argument("reps", type=int)
  c.add_argument("steps", type=int)
  m = sub.add_parser("merge-tt-cost")
  m.add_argument("file")
  m.add_argument("--into")
  m.add_argument("--force", action="store_true", help="merge a CPU fit too")
  t = sub.add_parser("perf-torch")
  t.add_argument("out")
  t.add_argument("--mode", default="gpu")
  t.add_argument("--rows", type=int, required=True)
  t.add_argument("--cache_dir", required=True)
  t.add_argument("--runs", required=True, help="BATCH:MODE,... (eager, compiled, compiled_bf16)")
  t.add_argument("--steps", required=True, help="BATCH:STEPS,...")
  r = sub.add_parser("report")
  r.add_argument("folder")
  args = p.parse_args(argv)
  if args.cmd == "detect":
    return detect(args.allow_cpu)
  if args.cmd == "probe":
    return probe()
  if args.cmd == "calibrate-run":
    return calibrate_run(args.out, args.reps, args.steps)
  if args.cmd == "merge-tt-cost":
    return merge_tt_cost(args.file, args.into, args.force)
  if args.cmd == "report":
    return report(args.folder)
  if args.cmd == "perf-torch":
    return perf_torch(args)
  return run_stages(args)


if __name__ == "__main__":
  sys.exit(main())
