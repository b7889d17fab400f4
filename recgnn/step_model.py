"""A step-time model from what a compiled step says, for machines this one is not.

On this CPU host memory and device memory are one RAM, so a measured step cannot say what an
offloaded table costs on a GPU, whose host link is ~60x slower than its HBM. The compiled step
does say what it moves and computes; a device profile says how fast each part goes:

  compute      flops / peak flop rate          (XLA's cost analysis of the compiled step)
  memory       bytes accessed / memory bandwidth (the same analysis)
  host link    max(bytes to host, bytes to device) / link bandwidth per direction
               (recgnn.comms.host_link: the two directions run at once)
  collectives  operand bytes / interconnect bandwidth per direction (recgnn.comms.summary)
  launches     kernels in the compiled entry computation x a per-kernel overhead

predicted serially (nothing overlaps: the sum) and with full overlap (the slowest part bounds
the step); a real step lies between, nearer the second where transfers have no data
dependency on the compute (what issue 24 of the memory tiers builds). The device part is a
roofline on totals, max(compute, memory): optimistic for a step of many small kernels, which
the launch term covers only in part. Per-device figures throughout.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from recgnn import comms, hlo


@dataclasses.dataclass(frozen=True)
class Profile:
  """A device's speeds. flops_per_s: the step's dtype (f32 here); bandwidths in bytes/s per
  direction; launch_s: fixed cost per kernel (launch + tail)."""

  name: str
  flops_per_s: float
  memory_bytes_per_s: float
  host_link_bytes_per_s: float
  interconnect_bytes_per_s: float
  launch_s: float
  source: str  # where the numbers come from


# H100 SXM from NVIDIA's datasheet: FP32 67 TFLOP/s (non-tensor; TF32 tensor cores ~495 dense,
# bf16 ~990 dense), HBM3 3.35 TB/s; PCIe Gen5 x16 ~64 GB/s per direction nominal (~50 measured
# for pinned host memory); NVLink 4 900 GB/s both directions (450 per direction). Launch: ~4 us
# per kernel without CUDA graphs (XLA:GPU uses them for small steps, so an upper figure).
H100 = Profile(
  name="h100",
  flops_per_s=67e12,
  memory_bytes_per_s=3.0e12,
  host_link_bytes_per_s=50e9,
  interconnect_bytes_per_s=450e9,
  launch_s=4e-6,
  source="datasheet figures (f32 non-tensor peak; HBM ~3 TB/s; PCIe 5 ~50 GB/s; NVLink 450)",
)
PROFILES = {"h100": H100}


def measure_cpu(seconds: float = 0.3) -> Profile:
  """This machine's profile, measured now: an f32 matmul's flop rate and a large copy's
  bandwidth (host link and interconnect are the same RAM here: the copy bandwidth too)."""
  n = 1024
  a = jnp.ones((n, n), jnp.float32)
  mm = jax.jit(lambda a: a @ a)
  mm(a).block_until_ready()
  flops = _rate(lambda: mm(a).block_until_ready(), 2.0 * n**3, seconds)
  big = jnp.ones((32 * 1024 * 1024 // 4,), jnp.float32)  # 32 MiB: past the caches
  cp = jax.jit(lambda x: x * 1.0)
  cp(big).block_until_ready()
  bw = _rate(lambda: cp(big).block_until_ready(), 2.0 * big.nbytes, seconds)  # read + write
  return Profile(
    name="cpu",
    flops_per_s=flops,
    memory_bytes_per_s=bw,
    host_link_bytes_per_s=bw,
    interconnect_bytes_per_s=bw,
    launch_s=0.0,  # XLA:CPU runs the step's kernels as calls in one thread: no launches
    source=f"measured now: {n}^3 f32 matmul, 32 MiB copy",
  )


def _rate(fn, work: float, seconds: float) -> float:
  times = []
  end = time.perf_counter() + seconds
  while time.perf_counter() < end or len(times) < 3:
    t = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t)
  return work / float(np.median(times))


@dataclasses.dataclass(frozen=True)
class StepCost:
  """What one execution of a step does, per device."""

  flops: float
  bytes_accessed: float
  host_to_device_bytes: float
  device_to_host_bytes: float
  collective_bytes: float
  kernels: int

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


def step_cost(lowered, compiled=None) -> StepCost:
  """The cost of a `jax.jit(...).lower(...)` step (compiled here unless given)."""
  compiled = compiled if compiled is not None else lowered.compile()
  ca = compiled.cost_analysis()
  ca = ca[0] if isinstance(ca, list) else ca  # (a list of one per program in older jax)
  link = comms.host_link_of(lowered)
  text = compiled.as_text()
  module = hlo.parse(text)
  # Kernels: the entry computation's instructions that run code (fusions, custom calls,
  # collectives, library calls), not the ones that only name buffers.
  naming = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "copy-done"}
  kernels = sum(i.op not in naming for i in module.computations[module.entry])
  devices = max(1, link.devices)
  return StepCost(
    flops=float(ca.get("flops", 0.0)),
    bytes_accessed=float(ca.get("bytes accessed", 0.0)),
    host_to_device_bytes=link.to_device_bytes / devices,
    device_to_host_bytes=link.to_host_bytes / devices,
    collective_bytes=float(comms.summary(text)["total_operand_bytes"]),
    kernels=kernels,
  )


@dataclasses.dataclass(frozen=True)
class Prediction:
  """Seconds per step on `profile`: each part, and the serial and overlapped totals."""

  profile: str
  compute_s: float
  memory_s: float
  host_link_s: float
  collective_s: float
  launch_s: float

  @property
  def device_s(self) -> float:
    return max(self.compute_s, self.memory_s) + self.launch_s

  @property
  def serial_s(self) -> float:
    return self.device_s + self.host_link_s + self.collective_s

  @property
  def overlapped_s(self) -> float:
    return max(self.device_s, self.host_link_s, self.collective_s)

  def as_dict(self) -> dict:
    return {
      **dataclasses.asdict(self),
      "device_s": self.device_s,
      "serial_s": self.serial_s,
      "overlapped_s": self.overlapped_s,
    }


def predict(cost: StepCost, profile: Profile) -> Prediction:
  return Prediction(
    profile=profile.name,
    compute_s=cost.flops / profile.flops_per_s,
    memory_s=cost.bytes_accessed / profile.memory_bytes_per_s,
    host_link_s=max(cost.host_to_device_bytes, cost.device_to_host_bytes)
    / profile.host_link_bytes_per_s,
    collective_s=cost.collective_bytes / profile.interconnect_bytes_per_s,
    launch_s=cost.kernels * profile.launch_s,
  )
