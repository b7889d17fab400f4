"""The step-time model (recgnn.step_model): its arithmetic, and the costs it reads off a
compiled step."""

import contract_lib as contract
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from recgnn import step_model as sm
from recgnn.embeddings import base

PROFILE = sm.Profile("test", 1e12, 1e11, 1e10, 1e10, 1e-6, "test")


def test_prediction_arithmetic():
  cost = sm.StepCost(
    flops=2e9,  # 2 ms of compute
    bytes_accessed=1e8,  # 1 ms of memory
    host_to_device_bytes=3e7,  # 3 ms on the link
    device_to_host_bytes=1e7,  # 1 ms the other way, at the same time
    collective_bytes=5e6,  # 0.5 ms
    kernels=100,  # 0.1 ms
  )
  p = sm.predict(cost, PROFILE)
  assert p.device_s == pytest.approx(2e-3 + 1e-4)
  assert p.host_link_s == pytest.approx(3e-3)
  assert p.serial_s == pytest.approx(2.1e-3 + 3e-3 + 0.5e-3)
  assert p.overlapped_s == pytest.approx(3e-3)  # the link bounds the step


def test_step_cost_counts_a_matmul_and_no_transfers():
  m, k, n = 256, 512, 128
  lowered = jax.jit(lambda a, b: jnp.tanh(a @ b)).lower(jnp.ones((m, k)), jnp.ones((k, n)))
  cost = sm.step_cost(lowered)
  assert cost.flops >= 2 * m * k * n  # (+ the tanh's elementwise work, by XLA's count)
  assert cost.flops < 2.2 * m * k * n
  assert cost.bytes_accessed >= 4 * (m * k + k * n + m * n)
  assert cost.host_to_device_bytes == cost.device_to_host_bytes == cost.collective_bytes == 0
  assert cost.kernels >= 1


def test_offloaded_table_costs_link_time_that_dense_does_not():
  spec = base.TableSpec(name="t", num_rows=10_000, dim=16)
  ids = np.random.default_rng(0).integers(0, 10_000, (256, 1)).astype(np.int32)
  preds = {}
  for text in ("dense", "offload(cache_rows=512)"):
    group, lowered = contract.lowered_step(text, spec, ids)
    if text != "dense" and not group.members["t"].host.offloaded:
      pytest.skip("no pinned_host memory on this platform")
    preds[text] = sm.predict(sm.step_cost(lowered), sm.H100)
  assert preds["dense"].host_link_s == 0
  # 256 rows of 64 bytes at least, over 50 GB/s
  assert preds["offload(cache_rows=512)"].host_link_s >= 256 * 64 / sm.H100.host_link_bytes_per_s


def test_measured_cpu_profile_is_plausible():
  p = sm.measure_cpu(seconds=0.05)
  assert 1e8 < p.flops_per_s < 1e14 and 1e8 < p.memory_bytes_per_s < 1e13
