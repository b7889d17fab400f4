"""XLA flags for simulated CPU devices; imports nothing heavy, so it can run before jax.

With --xla_force_host_platform_device_count=N every simulated device runs its share of a
step on the same few cores, and a collective waits for all N. XLA:CPU aborts the process
when one participant is 40 s late, which a step of many simulated devices on a few busy cores
can be, so for simulated devices the limits are raised unless the user set them.

And simulated devices run with jax's CPU async dispatch off (JAX_CPU_ENABLE_ASYNC_DISPATCH,
unless set): with it on, multi-device steps hang at a collective (some devices' threads
inside it, the others' launches blocked on PjRt's per-device in-flight semaphore).

With async dispatch off, multi-device programs are still launched asynchronously, and a step
launched while the previous one runs can deadlock the same way: `sharding.OneInFlight`
launches one multi-device step at a time on CPU devices (docs/multi-device.md;
tools/hang_check.py).
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
