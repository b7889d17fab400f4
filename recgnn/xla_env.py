"""XLA flags for simulated CPU devices; imports nothing heavy, so it can run before jax.

With --xla_force_host_platform_device_count=N every simulated device runs its share of a
step on the same few cores, and a collective waits for all N. XLA:CPU aborts the process
when one participant is 40 s late (measured here: an 8-device DLRM step on 2 busy cores),
so for simulated devices the limits are raised unless the user set them.

And simulated devices run with jax's CPU async dispatch off (JAX_CPU_ENABLE_ASYNC_DISPATCH,
unless set): with it on, `dlrm_kaggle` on 8 simulated devices hung at its first all-gather
in 3 of 3 runs here (gdb: 5 devices' threads inside the all-gather, 3 launches blocked on
PjRt's per-device in-flight semaphore in CpuPjRtRawLoadedExecutable::Execute; the same with
2 processes x 4 devices); with it off the same run trained to the end.

That was not the whole story (issue 30): with async dispatch off, multi-device programs are
still launched asynchronously (a collective launch waits on the previous one), and 8-device
runs still hung when a step was launched while the previous one ran (k devices in the
all-gather, the others' launches blocked on the in-flight slot held by their part of the
previous step, which never started). `sharding.OneInFlight` launches one multi-device step
at a time on CPU devices; with it, no hang in repeated runs (tools/hang_check.py).
"""

from __future__ import annotations

import os

_SIMULATED = "--xla_force_host_platform_device_count"
_TIMEOUTS = {
  "--xla_cpu_collective_call_terminate_timeout_seconds": "1800",
  "--xla_cpu_collective_call_warn_stuck_timeout_seconds": "300",
}


def relax_simulated_device_timeouts() -> None:
  """When devices are simulated: generous collective timeouts in XLA_FLAGS, and jax's CPU
  async dispatch off (unless the user set JAX_CPU_ENABLE_ASYNC_DISPATCH)."""
  flags = os.environ.get("XLA_FLAGS", "")
  if _SIMULATED not in flags:
    return
  extra = [f"{k}={v}" for k, v in _TIMEOUTS.items() if k not in flags]
  if extra:
    os.environ["XLA_FLAGS"] = " ".join([flags, *extra]).strip()
  os.environ.setdefault("JAX_CPU_ENABLE_ASYNC_DISPATCH", "false")
