"""What the numbers were measured on: the machine record every results file carries.

  machine_info()     date, host, CPU model and count, load average, Python / numpy / jax
                     versions (jax only where the benchmark imported it), the environment
                     variables that change what is measured, the command line
  cpu_model()        the CPU's model name
  matmul_gflops()    this process's f32 matmul rate through XLA (a compute ceiling)
  load()             the 1-minute load average now

The machine is shared: the load average belongs beside every figure, and only ratios measured
in the same run compare.
"""

from __future__ import annotations

import datetime
import os
import platform
import sys
import time

import numpy as np

# Environment variables that change what is measured; recorded with the results.
ENV_RECORDED = (
  "XLA_FLAGS",
  "GLIBC_TUNABLES",
  "OMP_WAIT_POLICY",
  "OMP_NUM_THREADS",
  "MALLOC_CONF",  # jemalloc's settings (dlrm_throughput --allocators)
  "TCMALLOC_RELEASE_RATE",
  "JAX_PLATFORMS",
  "RECGNN_MALLOC",
  "RECGNN_HOST_THREADS",  # threads of a large batch's read and dedup (recgnn/hostpool.py)
  "RECGNN_HOSTPLAN_THREADS",
)


def load() -> float:
  return os.getloadavg()[0]


def cpu_model() -> str:
  """The CPU's model name (/proc/cpuinfo), else what platform knows."""
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def machine_info() -> dict:
  """What the numbers were measured on (the machine is shared: load average included). jax's
  version, backend and devices only where the benchmark has imported jax."""
  info = {
    "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "host": platform.node(),
    "cpu_model": cpu_model(),
    "python": platform.python_version(),
    "numpy": np.__version__,
    "cpus": len(os.sched_getaffinity(0)),
    "load_avg_at_start": os.getloadavg(),
    "env": {k: os.environ[k] for k in ENV_RECORDED if k in os.environ},
    "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
  }
  jax = sys.modules.get("jax")
  if jax is not None:
    info["jax"] = jax.__version__
    info["jax_backend"] = jax.default_backend()
    info["jax_devices"] = [str(d) for d in jax.devices()]
  return info


def matmul_gflops(n: int = 2048, k: int = 512, m: int = 512, seconds: float = 0.5) -> float:
  """This process's f32 matmul rate through XLA ([n, k] @ [k, m], the Kaggle DLRM MLPs'
  widest shape): GFLOP/s over batches of 10 calls for about `seconds`, after one that
  compiles."""
  import jax

  rng = np.random.default_rng(0)
  a = jax.device_put(rng.normal(size=(n, k)).astype(np.float32))
  b = jax.device_put(rng.normal(size=(k, m)).astype(np.float32))
  f = jax.jit(lambda a, b: a @ b)
  f(a, b).block_until_ready()
  reps, t0 = 0, time.perf_counter()
  while time.perf_counter() - t0 < seconds:
    for _ in range(10):
      out = f(a, b)
    out.block_until_ready()
    reps += 10
  return 2 * n * k * m * reps / (time.perf_counter() - t0) / 1e9
