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
import re

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
  shapes = {}
  for line in hlo_text.splitlines():
    d = _DEF.match(line)
    if d:
      shapes[d.group("name")] = d.group("result")
  out = []
  for line in hlo_text.splitlines():
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
