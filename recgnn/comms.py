"""Bytes between devices, counted from a compiled executable's HLO.

XLA's optimized HLO names every collective with its operand shapes and dtypes, e.g.

  %all-gather.3 = f32[2048,16]{1,0} all-gather(f32[256,16]{1,0} %p), replica_groups=...

so what a step sends can be read off the compiled step, exactly and without running it (the
same on CPU as on GPU for the same partitioning). Per collective we count the bytes of its
operands (what each device contributes) and of its result (what each device ends with),
and, from the replica groups, how many devices take part.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re

from recgnn import hlo

COLLECTIVES = (
  "all-gather",
  "all-reduce",
  "reduce-scatter",
  "all-to-all",
  "ragged-all-to-all",
  "collective-permute",
  "collective-broadcast",
)
_DTYPE_BYTES = {
  "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e5m2fnuz": 1,
  "f8e4m3fnuz": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
  "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 1, "u4": 1,
}  # fmt: skip
_SHAPE = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_INSTR = re.compile(
  r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<result>.*?)\s(?P<op>"
  + "|".join(re.escape(c) for c in sorted(COLLECTIVES, key=len, reverse=True))
  + r")(?:-start)?\((?P<args>.*)$"
)
_GROUPS = re.compile(r"replica_groups=(\{\{[^=]*?\}\}|\[[0-9,]+\]<=\[[0-9,]+\][^,\s]*)")


def _bytes(text: str) -> tuple[int, list[str]]:
  """Total bytes and the dtypes of every array shape in `text` (tuples: the sum)."""
  total, dtypes = 0, []
  for dtype, dims in _SHAPE.findall(text):
    if dtype not in _DTYPE_BYTES:
      continue
    n = 1
    for d in filter(None, dims.split(",")):
      n *= int(d)
    total += n * _DTYPE_BYTES[dtype]
    dtypes.append(dtype)
  return total, dtypes


def _group_size(args: str) -> int | None:
  m = _GROUPS.search(args)
  if not m:
    return None
  g = m.group(1)
  if g.startswith("{{"):
    first = g[2:].split("}", 1)[0]
    return len([x for x in first.split(",") if x.strip()])
  # iota form: [num_groups, group_size]<=[...]
  dims = [int(x) for x in g[1 : g.index("]")].split(",")]
  return dims[-1] if len(dims) > 1 else dims[0]


@dataclasses.dataclass
class Collective:
  op: str
  operand_bytes: int
  result_bytes: int
  dtypes: tuple[str, ...]
  group_size: int | None
  line: str = ""  # the HLO instruction (its metadata names the jax scope it came from)


_DEF = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<result>.*?)\s[a-z][\w\-]*\(")
_OPERAND = re.compile(r"%([\w.\-]+)")


def collectives(hlo_text: str) -> list[Collective]:
  """Every collective of an HLO module (async pairs counted once, at their -start).

  Operands are printed by name only in recent XLA, so their shapes come from the
  instructions (and parameters) that define them.
  """
  lines = hlo_text.splitlines()
  shapes = None  # {name: its result's shape}, read only for operands printed by name
  out = []
  for line in lines:
    # (a substring test first: most lines hold no collective, and the regex costs more)
    if not any(c in line for c in COLLECTIVES):
      continue
    if "-done" in line.split("=", 1)[-1].split("(", 1)[0]:
      continue
    m = _INSTR.match(line)
    if not m:
      continue
    args = m.group("args")
    # Operands come before the first "), " attribute list; shapes inside them are inline.
    depth, end = 1, len(args)
    for i, ch in enumerate(args):
      depth += ch == "("
      depth -= ch == ")"
      if depth == 0:
        end = i
        break
    operands = args[:end]
    inline = _bytes(operands)
    if inline[0]:
      operand_bytes, dtypes = inline
    else:
      operand_bytes, dtypes = 0, []
      if shapes is None:
        shapes = {d.group("name"): d.group("result") for d in map(_DEF.match, lines) if d}
      for name in _OPERAND.findall(operands):
        b, dt = _bytes(shapes.get(name, ""))
        operand_bytes += b
        dtypes += dt
    result_bytes, rdt = _bytes(m.group("result"))
    out.append(
      Collective(
        op=m.group("op"),
        operand_bytes=operand_bytes,
        result_bytes=result_bytes,
        dtypes=tuple(sorted(set(dtypes or rdt))),
        group_size=_group_size(args),
        line=line,
      )
    )
  return out


def summary(hlo_text: str, skip_scope: str | None = None) -> dict:
  """{"total_operand_bytes", "by_op": {op: {"count", "operand_bytes", "result_bytes",
  "dtypes"}}} of one executable: per device, per call (one step). Collectives over groups
  of one device are left out. skip_scope: collectives whose jax scope (op_name metadata)
  contains it are left out too and counted under "skipped" (e.g. a fallback branch that a
  step takes only sometimes)."""
  by_op: dict[str, dict] = collections.defaultdict(
    lambda: {"count": 0, "operand_bytes": 0, "result_bytes": 0, "dtypes": set()}
  )
  skipped = 0
  for c in collectives(hlo_text):
    if c.group_size == 1:  # a collective over one device (a 1 x 1 mesh) moves nothing
      continue
    if skip_scope and skip_scope in c.line:
      skipped += c.operand_bytes
      continue
    d = by_op[c.op]
    d["count"] += 1
    d["operand_bytes"] += c.operand_bytes
    d["result_bytes"] += c.result_bytes
    d["dtypes"].update(c.dtypes)
  by_op = {k: {**v, "dtypes": sorted(v["dtypes"])} for k, v in sorted(by_op.items())}
  return {
    "total_operand_bytes": sum(v["operand_bytes"] for v in by_op.values()),
    "by_op": by_op,
    "skipped_operand_bytes": skipped,
  }


def compiled_summary(compiled) -> dict:
  """`summary` of a `jax.jit(...).lower(...).compile()` result."""
  return summary(compiled.as_text())


# ------------------------------------------------------------------------- the host link

# Ops that only rename a value (placement constraints, shard_map's shape changes, tuples):
# the value stays where it is.
_PASS_THROUGH = ("Sharding", "xla.sdy.GlobalToLocalShape", "xla.sdy.LocalToGlobalShape",
                 "SPMDFullToShardShape", "SPMDShardToFullShape")  # fmt: skip


def _passes_through(target: str | None) -> bool:
  """Custom calls that only annotate a value (placement, Shardy's shardings and shard_map
  shapes): it stays in the memory it is in."""
  return target in _PASS_THROUGH or (target or "").startswith("xla.sdy.")


@dataclasses.dataclass(frozen=True)
class Transfer:
  """One array crossing the host link: `direction` "to_host" or "to_device"; `value`: the
  instruction whose result crosses; `bytes`: summed over the devices that move it."""

  direction: str
  value: str
  computation: str
  bytes: int


@dataclasses.dataclass(frozen=True)
class HostLink:
  """What one execution of a step moves between host memory and device memory, read off its
  HLO: the operands of host computations (XLA compute type "host", `compute_on`) that live in
  device memory go to the host; host-resident values (host computations' results, arguments
  placed in `pinned_host` memory) that device code reads come to the device. Bytes are summed
  over every device of the mesh (a transfer inside a shard_map body counts once per device of
  its manual axes); `per_device` divides by the mesh's size."""

  to_host_bytes: int
  to_device_bytes: int
  devices: int
  transfers: tuple[Transfer, ...]

  @property
  def bytes(self) -> int:
    return self.to_host_bytes + self.to_device_bytes

  @property
  def per_device(self) -> float:
    return self.bytes / max(1, self.devices)

  def as_dict(self) -> dict:
    return {
      "to_host_bytes": self.to_host_bytes,
      "to_device_bytes": self.to_device_bytes,
      "bytes_per_device": self.per_device,
      "transfers": len(self.transfers),
    }


def host_link(hlo_text: str, host_params: set[int] | frozenset[int] = frozenset()) -> HostLink:
  """The host-link traffic of the program in `hlo_text` (pre-optimization HLO:
  `lowered.compiler_ir("hlo").as_hlo_text()`; compiled HLO differs by platform, e.g. XLA:CPU
  inlines host computations). host_params: the entry parameters placed in host memory
  (`host_link_of` reads them from the lowered module). What the program asks to move, before
  XLA's host-offload passes (which may merge or drop copies, never add array bytes)."""
  module = hlo.parse(hlo_text)
  devices = 1
  for n in module.mesh.values():
    devices *= n
  walk = _HostLinkWalk(module)
  entry_params = [f"param:{i}" if i in host_params else False for i in range(_num_params(module))]
  walk.computation(module.entry, entry_params, 1)
  transfers = walk.transfers
  return HostLink(
    to_host_bytes=sum(t.bytes for t in transfers if t.direction == "to_host"),
    to_device_bytes=sum(t.bytes for t in transfers if t.direction == "to_device"),
    devices=devices,
    transfers=tuple(transfers),
  )


def _on_host(res) -> bool:
  """Whether a residency (an origin string: host; False: device) is on the host."""
  return isinstance(res, str)


@dataclasses.dataclass
class _Scope:
  """One computation being walked: its name, its parameters' residencies, the devices each
  of its transfers counts for (scale), its instructions by name and the residencies so far."""

  comp: str
  params: list
  scale: int
  by_name: dict
  where: dict = dataclasses.field(default_factory=dict)

  def of(self, name: str):
    return self.where.get(name, False)


class _HostLinkWalk:
  """The transfers of a module, found by walking its computations from the entry.

  A host-resident value is tracked by its origin (the host computation, placement or entry
  parameter that made it), so one buffer seen under several names (barriers, reshapes,
  calls) is read by the device once per scale; device-resident values are False."""

  def __init__(self, module: hlo.Module):
    self.module = module
    self.transfers: list[Transfer] = []
    self.fetched: set[tuple[str, int]] = set()

  def computation(self, comp: str, params: list, scale: int):
    """Residency of each value of `comp`, given its parameters'; returns the root's (a tuple
    for a tuple)."""
    s = _Scope(comp, params, scale, self.module.instrs(comp))
    for ins in self.module.computations[comp]:
      s.where[ins.name] = self._residency(ins, s)
    return s.of(self.module.root(comp).name)

  def _send(self, s: _Scope, name: str) -> None:
    self.transfers.append(Transfer("to_host", name, s.comp, s.by_name[name].bytes * s.scale))

  def _fetch(self, s: _Scope, name: str) -> None:
    res = s.of(name)
    if _on_host(res) and (res, s.scale) not in self.fetched:
      self.fetched.add((res, s.scale))
      self.transfers.append(Transfer("to_device", name, s.comp, s.by_name[name].bytes * s.scale))

  def _residency(self, ins: hlo.Instr, s: _Scope):
    """Where `ins`'s result lives, recording the transfers it makes."""
    if ins.op == "parameter":
      return s.params[ins.parameter] if ins.parameter < len(s.params) else False
    if ins.op == "call" and ins.attr("_xla_compute_type") == "host":
      for op in ins.operands:
        if not _on_host(s.of(op)):
          self._send(s, op)
      return ins.name
    if ins.op == "custom-call" and ins.attr("custom_call_target") == ("annotate_device_placement"):
      return self._placement(ins, s)
    if ins.op == "custom-call" and _passes_through(ins.attr("custom_call_target")):
      res = [s.of(o) for o in ins.operands]
      return res[0] if len(res) == 1 else tuple(res)
    if ins.op == "tuple":
      return tuple(s.of(o) for o in ins.operands)
    if ins.op in ("opt-barrier", "reshape", "bitcast"):
      # An ordering barrier, or a new view of the same bytes: the value stays where it is.
      return s.of(ins.operands[0])
    if ins.op == "get-tuple-element":
      res = s.of(ins.operands[0])
      if isinstance(res, tuple):
        return res[ins.index]
      return f"{res}#{ins.index}" if _on_host(res) else False  # a host tuple's own buffer
    if ins.op == "call" and len(ins.callees) == 1:
      return self._call(ins, s)
    for op in ins.operands:
      self._fetch(s, op)
    return False

  def _placement(self, ins: hlo.Instr, s: _Scope):
    """An annotate_device_placement: to the host (sent unless there already), or back."""
    src = ins.operands[0]
    if ins.attr("_xla_buffer_placement") not in ("pinned_host", "unpinned_host"):
      self._fetch(s, src)
      return False
    if _on_host(s.of(src)):
      return s.where[src]
    self._send(s, src)
    return ins.name

  def _call(self, ins: hlo.Instr, s: _Scope):
    """A call of one computation (a shard_map body runs on each of its manual devices)."""
    callee = ins.callees[0]
    inner = s.scale
    if callee.startswith("xla.sdy.manual_computation_body"):
      inner = s.scale * _manual_devices(self.module, s.by_name, ins)
    args = [s.of(o) for o in ins.operands]
    # shard_map's GlobalToLocalShape hands the body one tuple: its elements are the
    # body's parameters.
    if len(args) == 1 and isinstance(args[0], tuple):
      args = list(args[0])
    return self.computation(callee, args, inner)


def _num_params(module: hlo.Module) -> int:
  params = [i.parameter for i in module.computations[module.entry] if i.op == "parameter"]
  return 1 + max(params, default=-1)


def _manual_devices(module: hlo.Module, by_name: dict, call: hlo.Instr) -> int:
  """Devices running a shard_map body: the product of its manual axes' sizes (named on the
  GlobalToLocalShape that feeds the call)."""
  for op in call.operands:
    src = by_name.get(op)
    while src is not None and src.op == "get-tuple-element":
      src = by_name.get(src.operands[0])
    axes = src.attr("xla.sdy.manual_axes") if src is not None else None
    if axes:
      n = 1
      for axis in re.findall(r'\\"(\w+)\\"|"(\w+)"', axes):
        n *= module.mesh.get(axis[0] or axis[1], 1)
      return n
  return 1


def host_params_of(lowered) -> set[int]:
  """Entry parameters of a `jax.jit(...).lower(...)` result that live in host memory (the
  StableHLO main function's `mhlo.memory_kind` per argument)."""
  return _host_params(lowered.as_text())


def _host_params(text: str) -> set[int]:
  main = re.search(r"func\.func public @main\((.*?)\)\s*->", text, re.S)
  if main is None:
    return set()
  out = set()
  for i, arg in enumerate(re.split(r"(?=%arg\d+:)", main.group(1))[1:]):
    if 'memory_kind = "pinned_host"' in arg or 'memory_kind = "unpinned_host"' in arg:
      out.add(i)
  return out


# What makes a value host-resident in `host_link`'s walk besides a host parameter: a placement
# in host memory, a host computation (their StableHLO spellings name them alike).
_HOST_MARKS = ("annotate_device_placement", "_xla_compute_type")
_STABLEHLO_MESH = re.compile(r"sdy\.mesh @\w+ = <\[([^\]]*)\]>")


def host_link_of(lowered) -> HostLink:
  """`host_link` of a `jax.jit(...).lower(...)` result.

  A program with no host parameter, no placement in host memory and no host computation
  moves nothing over the link: that is read off its StableHLO text, without converting the
  module to HLO (a conversion costs a noticeable part of a small step's first call, and the
  trainer reads every step program it compiles)."""
  text = lowered.as_text()
  params = _host_params(text)
  if params or any(mark in text for mark in _HOST_MARKS):
    return host_link(lowered.compiler_ir("hlo").as_hlo_text(), params)
  mesh = _STABLEHLO_MESH.search(text)
  devices = math.prod(int(n) for _, n in hlo.MESH_AXES.findall(mesh.group(1))) if mesh else 1
  return HostLink(to_host_bytes=0, to_device_bytes=0, devices=devices, transfers=())
