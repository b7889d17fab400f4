"""A reader of XLA's HLO text: computations, their instructions, operands and callees.

For the questions a step's program answers before it runs: which bytes cross the host link
(`recgnn.comms.host_link`), and whether one value depends on another (a transfer that must be
free to overlap compute has no path from that compute: `Module.depends`).

HLO text prints each computation's instructions in post order (a definition before its uses),
one per line:

  [ROOT] name = SHAPE op(operand, ...), attribute=..., to_apply=callee, ...

with operands as bare names (pre-optimization HLO, `lowered.compiler_ir("hlo")`) or with their
shapes (`f32[64,8]{1,0} %name`, compiled HLO); both are read.
"""

from __future__ import annotations

import dataclasses
import re

_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*(?:\([^)]*\)\s*->\s*.*)?\{\s*$")
_NAME = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_CALLEE = re.compile(
  r"\b(?:to_apply|calls|body|condition|true_computation|false_computation)=%?([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_INDEX = re.compile(r"\bindex=(\d+)")
MESH_AXES = re.compile(r'"(\w+)"=(\d+)')
_SHAPE = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")

DTYPE_BYTES = {
  "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e5m2fnuz": 1,
  "f8e4m3fnuz": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
  "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 1, "u4": 1,
}  # fmt: skip


def shape_bytes(text: str) -> int:
  """Bytes of every array shape in `text` (a tuple shape: the sum; layouts ignored)."""
  total = 0
  for dtype, dims in _SHAPE.findall(text):
    if dtype in DTYPE_BYTES:
      n = 1
      for d in filter(None, dims.split(",")):
        n *= int(d)
      total += n * DTYPE_BYTES[dtype]
  return total


def shape_elements(text: str) -> int:
  """Elements of every array shape in `text` (a tuple shape: the sum; any dtype)."""
  total = 0
  for _, dims in _SHAPE.findall(text):
    n = 1
    for d in filter(None, dims.split(",")):
      n *= int(d)
    total += n
  return total


def _closing(text: str, start: int) -> int:
  """Index of the bracket closing the one at text[start] ((, [ or {)."""
  depth = 0
  for i in range(start, len(text)):
    c = text[i]
    if c in "([{":
      depth += 1
    elif c in ")]}":
      depth -= 1
      if depth == 0:
        return i
  raise ValueError(f"unbalanced brackets in HLO line: {text[:120]}")


def _split_top(text: str) -> list[str]:
  """Split at commas outside brackets (shapes like f32[64,8]{1,0} hold commas)."""
  out, depth, cur = [], 0, []
  for c in text:
    if c in "([{":
      depth += 1
    elif c in ")]}":
      depth -= 1
    if c == "," and depth == 0:
      out.append("".join(cur))
      cur = []
    else:
      cur.append(c)
  if "".join(cur).strip():
    out.append("".join(cur))
  return out


@dataclasses.dataclass(frozen=True)
class Instr:
  """One HLO instruction. shape: its result shape as printed (a tuple: "(f32[2], s32[])")."""

  name: str
  shape: str
  op: str
  operands: tuple[str, ...]
  callees: tuple[str, ...]
  attrs: str  # everything after the operand list
  root: bool

  @property
  def bytes(self) -> int:
    return shape_bytes(self.shape)

  @property
  def parameter(self) -> int | None:
    return int(self.operands[0]) if self.op == "parameter" else None

  @property
  def index(self) -> int | None:
    """get-tuple-element's index."""
    m = _INDEX.search(self.attrs)
    return int(m.group(1)) if m else None

  def attr(self, key: str) -> str | None:
    """A frontend / backend attribute's value: key="value" or key=value."""
    m = re.search(rf'\b{re.escape(key)}=(?:"((?:[^"\\]|\\.)*)"|([^,\s}}]+))', self.attrs)
    return None if m is None else (m.group(1) if m.group(1) is not None else m.group(2))


def parse_instr(line: str) -> Instr | None:
  m = _NAME.match(line)
  if m is None:
    return None
  rest = line[m.end() :]
  if rest.startswith("("):  # a tuple shape
    end = _closing(rest, 0)
    shape, rest = rest[: end + 1], rest[end + 1 :].lstrip()
  else:
    shape, _, rest = rest.partition(" ")
    # (a layout with memory space, e.g. {1,0:S(5)}, has no space inside)
  paren = rest.find("(")
  if paren < 0:
    return None
  op = rest[:paren].strip()
  end = _closing(rest, paren)
  operands = []
  for item in _split_top(rest[paren + 1 : end]):
    item = item.strip()
    if not item:
      continue
    token = item.split()[-1].lstrip("%")  # "f32[2]{0} %x" or "x"
    operands.append(token)
  attrs = rest[end + 1 :]
  callees = _CALLEE.findall(attrs)
  for group in _BRANCHES.findall(attrs):
    callees += [c.strip().lstrip("%") for c in group.split(",") if c.strip()]
  return Instr(m.group(2), shape, op, tuple(operands), tuple(callees), attrs, bool(m.group(1)))


@dataclasses.dataclass
class Module:
  """Parsed HLO module: computations by name (instructions in post order) and the entry's
  name; `mesh`: the Shardy mesh axes and their sizes, where the header names them."""

  computations: dict[str, list[Instr]]
  entry: str
  header: str
  mesh: dict[str, int]

  def instrs(self, computation: str | None = None) -> dict[str, Instr]:
    return {i.name: i for i in self.computations[computation or self.entry]}

  def root(self, computation: str) -> Instr:
    return next(i for i in self.computations[computation] if i.root)

  def ancestors(self, name: str, computation: str | None = None) -> set[str]:
    """Every instruction of `computation` that `name` uses, transitively, through operands."""
    by_name = self.instrs(computation)
    seen, todo = set(), [name]
    while todo:
      for op in by_name[todo.pop()].operands:
        if op in by_name and op not in seen:
          seen.add(op)
          todo.append(op)
    return seen

  def depends(self, a: str, b: str, computation: str | None = None) -> bool:
    """Whether instruction `a` uses `b`'s value, transitively (a data dependency: `a` cannot
    start before `b` is done)."""
    return b in self.ancestors(a, computation)


def parse(text: str) -> Module:
  computations: dict[str, list[Instr]] = {}
  entry, current, header = None, None, text.split("\n", 1)[0]
  for line in text.splitlines():
    stripped = line.strip()
    if current is None:
      m = _HEADER.match(stripped)
      if m and not stripped.startswith("HloModule"):
        current = m.group(1)
        computations[current] = []
        if stripped.startswith("ENTRY"):
          entry = current
      continue
    if stripped == "}":
      current = None
      continue
    instr = parse_instr(line)
    if instr is not None:
      computations[current].append(instr)
  if entry is None:
    raise ValueError("no ENTRY computation in this HLO text")
  meshes = re.search(r"#sdy\.mesh<\[([^\]]*)\]", header)
  mesh = {k: int(v) for k, v in MESH_AXES.findall(meshes.group(1))} if meshes else {}
  return Module(computations, entry, header, mesh)
