"""The host ops of compiled HLO (recgnn.trace_summary's `--hlo`): which instructions of a
module move data between host and device memory or compute on the host, and their bytes.

On XLA:CPU memory-space transfers compile to nothing, so the host side of an offload exchange
(`compute_on("device_host")`) is known only from the HLO: ops marked
`_xla_compute_type="host"` (or named under compute_on) that gather / slice from host memory
stand in for H2D, those that scatter / update into it for D2H. A module compiled again for a
new shape reuses op names with other meanings, so every compilation is kept apart
(`HostOps.resolver` matches an execution to its compilation).
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import os
import re
from collections.abc import Iterable, Sequence

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
                "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}  # fmt: skip


def _shape_bytes(shape: str) -> int:
  """Bytes of an HLO array shape such as f32[256,1,8]{2,1,0} (0 for tuples and unknowns)."""
  m = re.match(r"([a-z]+\d*)\[([\d,]*)\]", shape)
  if not m or m.group(1) not in _DTYPE_BYTES:
    return 0
  n = 1
  for d in filter(None, m.group(2).split(",")):
    n *= int(d)
  return n * _DTYPE_BYTES[m.group(1)]


def _op_kind(name: str, line: str) -> str | None:
  """'h2d' / 'd2h' / 'host' for an HLO instruction line that moves or computes on host data,
  None for device work."""
  m = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$", line)
  if not m:
    return None
  rhs = m.group(2)
  op = re.search(r"\s([a-z][\w\-]*)\(", rhs)
  opcode = op.group(1) if op else ""
  if opcode in ("copy-start", "copy"):
    # Memory space 5 is host memory (S(5) in a layout): dest first in copy-start's tuple.
    result, _, operands = rhs.partition(f"{opcode}(")
    dst_host, src_host = "S(5)" in result, "S(5)" in operands.split(")")[0]
    if dst_host and not src_host:
      return "d2h"
    if src_host and not dst_host:
      return "h2d"
  # Host computations: XLA's frontend attribute, or jax's op name under compute_on (a host
  # gather that XLA:CPU fused keeps the metadata, not the attribute).
  op_name = re.search(r'op_name="([^"]*)"', line)
  op_name = op_name.group(1) if op_name else ""
  if '_xla_compute_type="host"' not in line and "compute_on" not in op_name:
    return None
  text = f"{name} {opcode} {op_name.rsplit('/', 1)[-1]}".lower()
  if "scatter" in text or "dynamic-update-slice" in text or "dynamic_update_slice" in text:
    return "d2h"
  if "gather" in text or "dynamic-slice" in text or "dynamic_slice" in text:
    return "h2d"
  return "host"


@dataclasses.dataclass
class HostOps:
  """The host ops of compiled HLO modules: per module name, one {op: kind or None} per
  compilation (a module is compiled again when a shape changes; its op names then repeat
  with other meanings), kind 'h2d' | 'd2h' | 'host'."""

  compilations: dict[str, list[dict[str, str | None]]] = dataclasses.field(default_factory=dict)
  sizes: dict[str, list[dict[str, int]]] = dataclasses.field(default_factory=dict)  # alike

  def resolver(self, events: Sequence[dict]):
    """kind(event) -> str | None. An execution (events sharing `run_id`) is matched to the
    compilation of its module holding the most of the op names it ran; without run ids, an
    op counts only where every compilation of its module agrees."""
    executed = collections.defaultdict(set)
    for e in events:
      a = e.get("args") or {}
      if "hlo_op" in a and "run_id" in a:
        executed[(str(a.get("hlo_module", "")), str(a["run_id"]))].add(str(a["hlo_op"]))
    chosen = {}
    for (module, run), names in executed.items():
      comps = self.compilations.get(module)
      if comps:
        best = max(range(len(comps)), key=lambda i, n=names: len(n & comps[i].keys()))
        chosen[(module, run)] = {
          op: (k, self.sizes[module][best].get(op, 0)) for op, k in comps[best].items()
        }
    merged = {}
    for module, comps in self.compilations.items():
      kinds = collections.defaultdict(set)
      for ops, sizes in zip(comps, self.sizes[module]):
        for op, kind in ops.items():
          kinds[op].add((kind, sizes.get(op, 0)))
      merged[module] = {op: next(iter(k)) for op, k in kinds.items() if len(k) == 1}

    def kind(e: dict) -> tuple[str | None, int]:
      a = e.get("args") or {}
      module, op = str(a.get("hlo_module", "")), str(a.get("hlo_op", ""))
      ops = chosen.get((module, str(a.get("run_id"))), merged.get(module, {}))
      return ops.get(op, (None, 0))

    return kind

  def __bool__(self) -> bool:
    return bool(self.compilations)


def host_ops(hlo_texts: Iterable[str]) -> HostOps:
  """The host ops of compiled HLO texts (after optimizations), per module and compilation."""
  out = HostOps()
  for text in hlo_texts:
    m = re.search(r"^HloModule\s+([\w.\-]+)", text, re.M)
    module = m.group(1) if m else ""
    ops, shapes, operands = {}, {}, {}
    for line in text.splitlines():
      mm = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\S+)\s+[a-z][\w\-]*\(([^)]*)\)", line)
      if mm:
        name = mm.group(1)
        shapes[name] = _shape_bytes(mm.group(2))
        operands[name] = re.findall(r"%([\w.\-]+)", mm.group(3))
        ops[name] = _op_kind(name, line)
    out.compilations.setdefault(module, []).append(ops)
    # Bytes an exchange op moves: a gather's result, a scatter's updates (its last operand).
    sizes = {}
    for name, kind in ops.items():
      if kind == "h2d":
        sizes[name] = shapes.get(name, 0)
      elif kind == "d2h":
        sizes[name] = shapes.get(operands[name][-1], 0) if operands.get(name) else 0
    out.sizes.setdefault(module, []).append(sizes)
  return out


def read_hlo(paths: Sequence[str]) -> list[str]:
  """HLO texts from files or XLA dump directories (their *after_optimizations.txt)."""
  texts = []
  for p in paths:
    files = (
      sorted(glob.glob(os.path.join(p, "**", "*after_optimizations.txt"), recursive=True))
      if os.path.isdir(p)
      else [p]
    )
    for f in files:
      with open(f, errors="replace") as fh:
        texts.append(fh.read())
  return texts
