"""The step-time model (recgnn.step_model): its arithmetic, and the costs it reads off a
compiled step."""

import contract_lib as contract
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from recgnn import comms
from recgnn import step_model as sm
from recgnn.embeddings import base
from tools import host_table as ht

PROFILE = sm.Profile("test", 1e12, 1e11, 1e10, 1e10, 1e10, 1e-6, "test")


def test_prediction_arithmetic():
  cost = sm.StepCost(
    flops=2e9,  # 2 ms of compute
    device_bytes=1e8,  # 1 ms of memory
    host_bytes=1e7,  # 1 ms of host memory
    xla_bytes_accessed=5e8,  # (for reference only)
    host_to_device_bytes=3e7,  # 3 ms on the link
    device_to_host_bytes=1e7,  # 1 ms the other way, at the same time
    collective_bytes=5e6,  # 0.5 ms
    kernels=100,  # 0.1 ms
  )
  p = sm.predict(cost, PROFILE)
  assert p.device_s == pytest.approx(2e-3 + 1e-4)
  assert p.host_s == pytest.approx(1e-3)
  assert p.host_link_s == pytest.approx(3e-3)
  assert p.serial_s == pytest.approx(2.1e-3 + 1e-3 + 3e-3 + 0.5e-3)
  assert p.overlapped_s == pytest.approx(3e-3)  # the link bounds the step


def test_step_cost_counts_a_matmul_and_no_transfers():
  m, k, n = 256, 512, 128
  lowered = jax.jit(lambda a, b: jnp.tanh(a @ b)).lower(jnp.ones((m, k)), jnp.ones((k, n)))
  cost = sm.step_cost(lowered)
  assert cost.flops >= 2 * m * k * n  # (+ the tanh's elementwise work, by XLA's count)
  assert cost.flops < 2.2 * m * k * n
  assert cost.device_bytes >= 4 * (m * k + k * n + m * n)
  # No gather, scatter or slice: the per-kernel count is XLA's own.
  assert cost.device_bytes == cost.xla_bytes_accessed and cost.host_bytes == 0
  assert cost.host_to_device_bytes == cost.device_to_host_bytes == cost.collective_bytes == 0
  assert cost.kernels >= 1


def test_offloaded_table_costs_link_time_that_dense_does_not():
  spec = base.TableSpec(name="t", num_rows=10_000, dim=16)
  ids = np.random.default_rng(0).integers(0, 10_000, (256, 1)).astype(np.int32)
  preds = {}
  for text in ("dense", "offload(cache_rows=512)"):
    group, lowered = contract.lowered_step(text, spec, ids)
    # (a host tier's rows move with the batch and back after the step: `io`)
    io = contract.host_tier_io(lowered)
    assert (io != (0, 0)) == (text != "dense"), (text, io)
    preds[text] = sm.predict(sm.step_cost(lowered, io=io), sm.H100)
  assert preds["dense"].host_link_s == 0
  # 256 rows of 64 bytes at least, over 50 GB/s
  assert preds["offload(cache_rows=512)"].host_link_s >= 256 * 64 / sm.H100.host_link_bytes_per_s


def test_measured_cpu_profile_is_plausible():
  p = sm.measure_cpu(seconds=0.05)
  assert 1e8 < p.flops_per_s < 1e14 and 1e8 < p.memory_bytes_per_s < 1e13


BIG, DIM, K = 1_000_000, 16, 1024  # a 64 MB table, 1024 rows (64 KB) of it per step


def _table(memory_kind=None):
  dev = jax.devices()[0]
  if memory_kind and memory_kind not in [m.kind for m in dev.addressable_memories()]:
    pytest.skip(f"no {memory_kind} memory on this platform")
  if memory_kind is None:
    return jax.ShapeDtypeStruct((BIG, DIM), jnp.float32)
  # (A host array itself: a ShapeDtypeStruct's memory kind does not reach the traced aval.)
  s = jax.sharding.SingleDeviceSharding(dev, memory_kind=memory_kind)
  return jax.device_put(np.zeros((BIG, DIM), np.float32), s)


def _row_args():
  return jax.ShapeDtypeStruct((K,), jnp.int32), jax.ShapeDtypeStruct((K, DIM), jnp.float32)


def test_gather_and_scatter_cost_the_rows_they_touch_not_the_table():
  """A sparse lookup + update on a device table: O(rows touched), where XLA:CPU's own count
  charges the table (a fused gather reads it whole; the scatter reads and writes it)."""

  def step(table, idx, g):
    rows = ht.gather_rows(table, idx)
    return ht.scatter_rows(table, idx, rows - 0.1 * g)

  cost = sm.step_cost(jax.jit(step, donate_argnums=0).lower(_table(), *_row_args()))
  table, rows = BIG * DIM * 4, K * DIM * 4
  assert cost.xla_bytes_accessed >= table  # (what the model no longer charges)
  # The gather reads K rows and writes them, the update reads them, g, and writes K rows;
  # indices twice: a small multiple of the rows, nowhere near the table.
  assert 3 * rows <= cost.device_bytes <= 8 * rows + 4 * 4 * K, cost
  assert cost.host_bytes == 0


def test_host_gather_is_host_work_and_link_time_not_device_memory():
  """The same step with the table in host memory and its gather a host computation: the
  prediction is the device step's (same kernels, minus the gather) plus the host link (bytes
  from the HLO, recgnn.comms.host_link_of) plus the host's own gather, never the host table
  read at HBM speed (64 MB at 3 TB/s: 21 us, against ~1.4 us of link)."""

  def on_device(table, idx, x):
    return (ht.gather_rows(table, idx) * x).sum()

  def on_host(table, idx, x):
    rows = ht.host_compute(ht.gather_rows, table, jax.device_put(idx, jax.memory.Space.Host))
    return (jax.device_put(rows, jax.memory.Space.Device) * x).sum()

  dense_lowered = jax.jit(on_device).lower(_table(), *_row_args())
  host_lowered = jax.jit(on_host).lower(_table("pinned_host"), *_row_args())
  dense, host = sm.step_cost(dense_lowered), sm.step_cost(host_lowered)
  link = comms.host_link_of(host_lowered)
  rows = K * DIM * 4
  assert (link.to_device_bytes, link.to_host_bytes) == (rows, K * 4)  # rows in, ids out
  # The host's gather: the ids and the rows it reads and writes, not the table.
  assert 2 * rows <= host.host_bytes <= 2 * rows + 2 * K * 4, host
  # The device no longer gathers: it reads the rows that arrived (no more than before).
  assert host.device_bytes <= dense.device_bytes
  assert host.xla_bytes_accessed >= BIG * DIM * 4  # (XLA:CPU's count: the whole host table)
  p_dense, p_host = sm.predict(dense, sm.H100), sm.predict(host, sm.H100)
  link_s = max(link.to_device_bytes, link.to_host_bytes) / sm.H100.host_link_bytes_per_s
  host_s = host.host_bytes / sm.H100.host_memory_bytes_per_s
  assert p_host.host_link_s == link_s and p_host.host_s == host_s
  assert p_host.memory_s <= p_dense.memory_s
  expected = p_dense.serial_s + link_s + host_s
  # (The device step has one kernel fewer to launch: the gather; hence no lower bound.)
  assert link_s + host_s < p_host.serial_s <= 1.25 * expected, (p_host, expected)
  assert p_host.overlapped_s <= 1.25 * max(p_dense.serial_s, link_s, host_s)
  # XLA's own count of the same step, at HBM speed, is what this test refuses.
  assert host.xla_bytes_accessed / sm.H100.memory_bytes_per_s > 1.25 * expected
  # Before XLA inlines it (and on platforms that keep it), the host computation is a call
  # of compute type host: its body is host work whole.
  pre = sm.memory_access(host_lowered.compiler_ir("hlo").as_hlo_text())
  assert pre.host_kernels >= 1 and 2 * rows <= pre.host_bytes < BIG * DIM * 4
  assert pre.device_bytes < BIG * DIM * 4


def test_a_fused_slice_reads_only_what_it_keeps():
  """(a + b)[:, 9] fused into one kernel reads one column of a and b, not all of them
  (XLA:CPU duplicates such adds into every slice's fusion; its count charges each whole)."""
  n, m = 2048, 27 * 16
  x = jax.ShapeDtypeStruct((n, m), jnp.float32)
  cost = sm.step_cost(jax.jit(lambda a, b: (a + b)[:, 144:160] * 2.0).lower(x, x))
  kept = n * 16 * 4
  assert cost.device_bytes == 3 * kept, cost  # a's and b's columns read, the result written
  assert cost.xla_bytes_accessed >= 2 * n * m * 4
