"""Test setup: 8 simulated CPU devices, set before jax is imported anywhere."""

import os

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from recgnn import xla_env  # noqa: E402

xla_env.relax_simulated_device_timeouts()

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)
