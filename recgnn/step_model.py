"""A step-time model from what a compiled step says, for machines this one is not.

On a CPU host memory and device memory are one RAM, so a step timed there cannot say what an
offloaded table costs on a GPU, whose host link is ~60x slower than its HBM. The compiled step
does say what it moves and computes; a device profile says how fast each part goes:

  compute      flops / peak flop rate          (XLA's cost analysis of the compiled step)
  memory       bytes the device's kernels touch / memory bandwidth (`memory_access`: XLA's
               count per kernel, but a gather or scatter charged the rows it touches, and
               host computations left out)
  host         bytes the host computations touch (gathers / scatters over host tables,
               `compute_on`) / host memory bandwidth: work on the host's CPU, apart
  host link    max(bytes to host, bytes to device) / link bandwidth per direction
               (recgnn.comms.host_link: the two directions run at once)
  collectives  operand bytes / interconnect bandwidth per direction (recgnn.comms.summary)
  launches     the device's kernels (host computations are not launches) x a per-kernel
               overhead

predicted serially (nothing overlaps: the sum) and with full overlap (the slowest part bounds the
step; host computations run on the host's cores beside the device); a real step lies between, nearer
the second where transfers have no data dependency on the compute (as the host tiers' transfers,
which travel with the batch). The device part is a roofline on totals, max(compute, memory):
optimistic for a step of many small kernels, which the launch term covers only in part. Per-device
figures throughout.
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
  direction; host_memory_bytes_per_s: the host's memory, for host computations' gathers and
  scatters; launch_s: fixed cost per kernel (launch + tail)."""

  name: str
  flops_per_s: float
  memory_bytes_per_s: float
  host_memory_bytes_per_s: float
  host_link_bytes_per_s: float
  interconnect_bytes_per_s: float
  launch_s: float
  source: str  # where the numbers come from


# H100 SXM from NVIDIA's datasheet: FP32 67 TFLOP/s (non-tensor; TF32 tensor cores ~495 dense, bf16
# ~990 dense), HBM3 3.35 TB/s; PCIe Gen5 x16 ~64 GB/s per direction nominal (~50 in practice for
# pinned host memory); NVLink 4 900 GB/s both directions (450 per direction). Launch: ~4 us per
# kernel without CUDA graphs (XLA:GPU uses them for small steps, so an upper figure).
# Host memory: an assumption, not a measurement: one socket of a DGX H100 host (8 channels of
# DDR5-4800, 307 GB/s peak), about half of it for scattered 64-byte rows.
H100 = Profile(
  name="h100",
  flops_per_s=67e12,
  memory_bytes_per_s=3.0e12,
  host_memory_bytes_per_s=150e9,
  host_link_bytes_per_s=50e9,
  interconnect_bytes_per_s=450e9,
  launch_s=4e-6,
  source="datasheet figures (f32 non-tensor peak; HBM ~3 TB/s; PCIe 5 ~50 GB/s; NVLink 450); "
  "host memory 150 GB/s assumed",
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
    host_memory_bytes_per_s=bw,
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
  """What one execution of a step does, per device.

  device_bytes: bytes the device's kernels read and write in its memory (HBM on a GPU), by
  `memory_access`; host_bytes: the same for the host computations (`compute_on` regions:
  gathers and scatters over host tables), which run on the host's CPU and memory, not the
  device's; xla_bytes_accessed: XLA's own total, for reference (it counts both, and a gather
  or scatter as touching its whole table)."""

  flops: float
  device_bytes: float
  host_bytes: float
  xla_bytes_accessed: float
  host_to_device_bytes: float
  device_to_host_bytes: float
  collective_bytes: float
  kernels: int

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


# Instructions that only name or re-view buffers: no kernel, no memory traffic.
_NAMING = frozenset(
  {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "copy-done", "after-all",
   "partition-id", "replica-id", "opt-barrier"}
)  # fmt: skip
# Instructions that run other computations' kernels (their bodies are walked, each once).
_CONTROL = frozenset({"call", "while", "conditional", "async-start", "async-done"})
_VIEWS = frozenset({"bitcast", "reshape", "copy"})  # (copy: only inside a fusion's body)
# Operations that read their operands whole whatever part of their result is used (inside a
# fusion; the others pass the fraction of their result that is needed on to their operands).
_WHOLE = frozenset(
  {"dot", "convolution", "reduce", "reduce-window", "sort", "custom-call", "fusion", "scatter",
   "select-and-scatter", "dynamic-update-slice", "concatenate", "pad", "broadcast", "iota",
   "rng", "fft", "cholesky", "triangular-solve", "call", "map"}
)  # fmt: skip


def is_host(ins: hlo.Instr) -> bool:
  """Whether a compiled instruction runs on the host: XLA's compute type "host", jax's
  `compute_on` scope in its op_name (XLA:CPU inlines host computations, keeping only that
  metadata on the fused gathers / scatters), or a result in host memory space (S(5))."""
  if ins.attr("_xla_compute_type") == "host":
    return True
  if "compute_on" in (ins.attr("op_name") or "").split("/"):
    return True
  return ":S(5)" in ins.shape


@dataclasses.dataclass(frozen=True)
class MemoryAccess:
  """Bytes the kernels of a compiled step touch, split by where they run (per device)."""

  device_bytes: int
  host_bytes: int
  device_kernels: int
  host_kernels: int


def memory_access(compiled_text: str, kernels: list | None = None) -> MemoryAccess:
  """Bytes read and written by every kernel of a compiled HLO module (per device), as XLA's
  cost analysis counts them (each kernel reads its operands and writes its result), except
  where a kernel touches only rows of an operand, as a GPU does:

    gather / dynamic-slice of an operand   the rows read (the result's bytes), not the table
    scatter / dynamic-update-slice         in place (the result aliases the table): the
                                           updated rows read and written, not the table twice

  so a sparse lookup + update costs O(rows touched), never O(rows of the table) (XLA:CPU's
  cost analysis charges a fused gather its whole table, the scatter twice). Kernels that run
  on the host (`is_host`) are counted apart: their traffic is on the host's memory.
  Computations called by call / while / conditional are walked once each time they are
  called (a while body: once, as XLA's analysis counts it). `kernels`, a list, receives
  (on_host, bytes, instruction) of every kernel counted: which ones make the totals
  (`host_kernels` lists the host ones, largest first)."""
  module = hlo.parse(compiled_text)
  totals = {True: [0, 0], False: [0, 0]}  # host? -> [bytes, kernels]

  def walk(comp: str, on_host: bool):
    by_name = module.instrs(comp)
    for ins in module.computations[comp]:
      if ins.op in _NAMING:
        continue
      if ins.op in _CONTROL and ins.callees:
        for callee in ins.callees:  # (a host call's body runs on the host whole)
          walk(callee, on_host or is_host(ins))
        continue
      operands = [by_name[o].bytes if o in by_name else 0 for o in ins.operands]
      operands, result = _row_access(module, ins, operands, ins.bytes)
      t = totals[on_host or is_host(ins)]
      t[0] += sum(operands) + result
      t[1] += 1
      if kernels is not None:
        kernels.append((on_host or is_host(ins), sum(operands) + result, ins))

  walk(module.entry, False)
  return MemoryAccess(
    device_bytes=totals[False][0],
    host_bytes=totals[True][0],
    device_kernels=totals[False][1],
    host_kernels=totals[True][1],
  )


def host_kernels(compiled_text: str) -> list[tuple[int, str, str, str]]:
  """The host computations' kernels of a compiled step, largest first: (bytes touched, op,
  shape, jax op_name), as `memory_access` charges them. What to shrink when the host term
  of a prediction is large."""
  kernels: list = []
  memory_access(compiled_text, kernels)
  out = [(b, i.op, i.shape, i.attr("op_name") or "") for host, b, i in kernels if host]
  return sorted(out, key=lambda k: -k[0])


def _updated(ins: hlo.Instr) -> int:
  """How many leading operands of a scatter / dynamic-update-slice are the updated arrays."""
  return (len(ins.operands) - 1) // 2 if ins.op == "scatter" else 1


def _row_access(module: hlo.Module, ins: hlo.Instr, operands: list[int], result: int):
  """(bytes read per operand, bytes written) of one kernel, charged by what it touches
  (`memory_access`). Inside a fusion, the fraction of each value that the fused code needs is
  propagated from the root back to the parameters: a slice / gather / dynamic-slice needs
  (its result / its operand) of the operand, a same-sized operation (elementwise, a view, a
  transpose) passes the fraction on, anything else (reductions, dots, broadcasts) reads its
  operands whole; an in-place scatter / dynamic-update-slice at the root needs and writes the
  updated rows of its table only."""
  operands = list(operands)
  if ins.op != "fusion":
    body, root = [ins], ins
  else:
    body, root = module.computations[ins.callees[0]], module.root(ins.callees[0])
  by_name = {i.name: i for i in body}

  def size(name: str, k: int) -> int:  # (k: the name's position in the kernel's operands)
    return by_name[name].bytes if name in by_name else operands[k]

  roots = [by_name.get(o) for o in root.operands] if root.op == "tuple" else [root]
  in_place: dict[str, float] = {}  # root update -> updated bytes / table bytes
  for r in roots:
    if r is None or r.op not in ("scatter", "dynamic-update-slice"):
      continue
    n = _updated(r)
    first = n + 1 if r.op == "scatter" else 1  # (scatter: inputs, indices, updates)
    upd = sum(size(u, first + j) for j, u in enumerate(r.operands[first : first + n]))
    table = sum(size(t, j) for j, t in enumerate(r.operands[:n]))
    if table > 0:
      in_place[r.name] = min(1.0, upd / table)
      result -= r.bytes - upd
  if ins.op != "fusion":
    if ins.op in ("gather", "dynamic-slice", "slice") and operands:
      operands[0] = min(operands[0], result)
    elif ins.name in in_place:
      for k in range(_updated(ins)):
        operands[k] = int(operands[k] * in_place[ins.name])
    return operands, result

  need: dict[str, float] = {root.name: 1.0}
  for u in reversed(body):
    f = need.get(u.name, 0.0)
    if f == 0.0:
      continue
    for k, o in enumerate(u.operands):
      src = by_name.get(o)
      if src is None:
        continue
      if u.op == "tuple":
        frac = f
      elif k == 0 and u.op in ("slice", "gather", "dynamic-slice") and src.bytes:
        frac = f * u.bytes / src.bytes
      elif u.name in in_place and k < _updated(u):
        frac = in_place[u.name]
      elif u.op not in _WHOLE and hlo.shape_elements(src.shape) == hlo.shape_elements(u.shape):
        frac = f  # elementwise, a view, a transpose: the same part of the operand
      else:
        frac = 1.0  # read whole (a reduction, a dot, a broadcast, a slice's indices, ...)
      need[o] = max(need.get(o, 0.0), min(1.0, frac))
  for i in body:
    if i.op == "parameter" and i.parameter < len(operands):
      operands[i.parameter] = int(operands[i.parameter] * need.get(i.name, 0.0))
  return operands, result


def step_cost(lowered, compiled=None, io: tuple[int, int] = (0, 0)) -> StepCost:
  """The cost of a `jax.jit(...).lower(...)` step (compiled here unless given). io: bytes
  (to the device, to the host) the step's arguments and results move besides its state, all
  devices together (a host tier's rows, read for the batch and returned for the host writer:
  recgnn.train.traffic.step_io of a trainer's step); added to what crosses the link inside
  the step (`comms.host_link_of`)."""
  compiled = compiled if compiled is not None else lowered.compile()
  ca = compiled.cost_analysis()
  ca = ca[0] if isinstance(ca, list) else ca  # (a list of one per program in older jax)
  link = comms.host_link_of(lowered)
  text = compiled.as_text()
  access = memory_access(text)
  devices = max(1, link.devices)
  return StepCost(
    flops=float(ca.get("flops", 0.0)),
    device_bytes=float(access.device_bytes),
    host_bytes=float(access.host_bytes),
    xla_bytes_accessed=float(ca.get("bytes accessed", 0.0)),
    host_to_device_bytes=(link.to_device_bytes + io[0]) / devices,
    device_to_host_bytes=(link.to_host_bytes + io[1]) / devices,
    collective_bytes=float(comms.summary(text)["total_operand_bytes"]),
    # Kernels the device launches (host computations are not device launches).
    kernels=access.device_kernels,
  )


@dataclasses.dataclass(frozen=True)
class Prediction:
  """Seconds per step on `profile`: each part, and the serial and overlapped totals."""

  profile: str
  compute_s: float
  memory_s: float
  host_s: float  # host computations (host memory), beside the device's work
  host_link_s: float
  collective_s: float
  launch_s: float

  @property
  def device_s(self) -> float:
    return max(self.compute_s, self.memory_s) + self.launch_s

  @property
  def serial_s(self) -> float:
    return self.device_s + self.host_s + self.host_link_s + self.collective_s

  @property
  def overlapped_s(self) -> float:
    return max(self.device_s, self.host_s, self.host_link_s, self.collective_s)

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
    memory_s=cost.device_bytes / profile.memory_bytes_per_s,
    host_s=cost.host_bytes / profile.host_memory_bytes_per_s,
    host_link_s=max(cost.host_to_device_bytes, cost.device_to_host_bytes)
    / profile.host_link_bytes_per_s,
    collective_s=cost.collective_bytes / profile.interconnect_bytes_per_s,
    launch_s=cost.kernels * profile.launch_s,
  )
