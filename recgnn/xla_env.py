"""XLA flags for simulated CPU devices; imports nothing heavy, so it can run before jax.

With --xla_force_host_platform_device_count=N every simulated device runs its share of a
step on the same few cores, and a collective waits for all N. XLA:CPU aborts the process
when one participant is 40 s late (measured here: an 8-device DLRM step on 2 busy cores),
so for simulated devices the limits are raised unless the user set them. And each device's
share of a step runs single-threaded: with Eigen's multi-threading on, the 8 devices' matmuls
compete for one intra-op pool while 7 of them block in a collective, and a run was seen to
hang at its first all-gather (the 8th participant never arrived); the devices themselves are
the parallelism.
"""

from __future__ import annotations

import os

_SIMULATED = "--xla_force_host_platform_device_count"
_TIMEOUTS = {
  "--xla_cpu_collective_call_terminate_timeout_seconds": "1800",
  "--xla_cpu_collective_call_warn_stuck_timeout_seconds": "300",
  "--xla_cpu_multi_thread_eigen": "false",
}


def relax_simulated_device_timeouts() -> None:
  """Append generous collective timeouts to XLA_FLAGS when devices are simulated."""
  flags = os.environ.get("XLA_FLAGS", "")
  if _SIMULATED not in flags:
    return
  extra = [f"{k}={v}" for k, v in _TIMEOUTS.items() if k not in flags]
  if extra:
    os.environ["XLA_FLAGS"] = " ".join([flags, *extra]).strip()
