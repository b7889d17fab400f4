"""Many processes over jax.distributed (one per host, or several on one machine on CPU).

Every process runs the same program over the GLOBAL mesh (all processes' devices); each
process transfers only the rows of each batch that its own devices hold, and only process 0
writes metrics, TensorBoard scalars, results and the config. Orbax saves checkpoints from
all processes together (each writes the shards it holds).

On CPU, collectives between processes go over gloo (TCP): the same code runs two processes
on one machine, e.g. 2 processes x 4 simulated devices = an 8-device mesh (docs/multi-device.md).
"""

from __future__ import annotations

import os

import jax

ENV = {"coordinator": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES",
       "process_id": "JAX_PROCESS_ID"}  # fmt: skip


def initialize(
  coordinator: str | None = None,
  num_processes: int | None = None,
  process_id: int | None = None,
  *,
  timeout_s: int = 120,
  heartbeat_s: int = 30,
) -> bool:
  """Join the run's processes (flags, else JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
  JAX_PROCESS_ID). Returns False (nothing to do) for a single process.

  Bounded waits, so a run never hangs on a missing peer: a process that cannot reach the
  coordinator fails after `timeout_s`; a peer that dies is noticed by the coordination
  service within `heartbeat_s` (and its collectives fail at once when its sockets close).
  """
  coordinator = coordinator or os.environ.get(ENV["coordinator"]) or None
  n = num_processes if num_processes else int(os.environ.get(ENV["num_processes"], "0") or 0)
  pid = process_id if process_id is not None and process_id >= 0 else None
  if pid is None and os.environ.get(ENV["process_id"], "") != "":
    pid = int(os.environ[ENV["process_id"]])
  if not coordinator and n <= 1:
    return False
  missing = [k for k, v in (("coordinator address", coordinator), ("process id", pid)) if v is None]
  if missing or n <= 1:
    raise ValueError(
      f"Many processes need a coordinator address, the process count (> 1) and this "
      f"process's id; missing: {', '.join(missing) or 'num_processes'}. Pass "
      "--coordinator_address=HOST:PORT --num_processes=N --process_id=I (or set "
      f"{', '.join(ENV.values())})."
    )
  if not 0 <= pid < n:
    raise ValueError(f"process_id {pid} out of range for {n} processes")
  # Collectives between CPU processes go over gloo (the default of recent jax; explicit so
  # an environment that changed it does not turn a mesh over processes into an error).
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  try:
    jax.distributed.initialize(
      coordinator_address=coordinator,
      num_processes=n,
      process_id=pid,
      initialization_timeout=timeout_s,
      heartbeat_timeout_seconds=heartbeat_s,
      shutdown_timeout_seconds=timeout_s,
    )
  except Exception as e:  # noqa: BLE001 (re-raised with the fix)
    raise RuntimeError(
      f"process {pid}/{n}: could not join the run at coordinator {coordinator} within "
      f"{timeout_s} s ({type(e).__name__}: {e}). Start every process with the same "
      "--coordinator_address and --num_processes, process 0 first, and check the port is "
      "free and reachable."
    ) from e
  return True


def is_main() -> bool:
  """Whether this process writes logs, metrics and results (process 0)."""
  return jax.process_index() == 0


def describe() -> str:
  if jax.process_count() == 1:
    return "1 process"
  return (
    f"process {jax.process_index()} of {jax.process_count()} "
    f"({jax.local_device_count()} local / {jax.device_count()} devices)"
  )
