"""Limits on the shape of recgnn/'s code, checked statically (no module is imported, no jax):

- no member access into another object's private names (ruff's SLF001): an object that others
  need to read or drive offers a public method or property for it;
- no function over MAX_FUNCTION_LINES lines (decorators included, nested functions counted on
  their own as well as inside their parent): a long function is split into a helper per step.
  Numba kernels are excepted (splitting one costs a call per step in the compiled loop), and so,
  for a while, are the functions in LONG_FUNCTIONS_FOR_NOW."""

from __future__ import annotations

import ast
import pathlib
import shutil
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "recgnn"
MAX_FUNCTION_LINES = 80
#: Functions allowed over MAX_FUNCTION_LINES for a while ("path:name", the name qualified by
#: its enclosing classes and functions); an entry that is no longer long fails the test.
LONG_FUNCTIONS_FOR_NOW: frozenset[str] = frozenset()


def _ruff() -> list[str] | None:
  """The command that runs ruff: the venv's executable next to this Python, or one on PATH."""
  here = pathlib.Path(sys.executable).parent / "ruff"
  if here.exists():
    return [str(here)]
  found = shutil.which("ruff")
  return [found] if found else None


def test_no_private_member_access():
  ruff = _ruff()
  if ruff is None:
    pytest.skip("ruff is not installed next to this Python nor on PATH")
  out = subprocess.run(
    [*ruff, "check", "--no-cache", "--select", "SLF001", "--output-format", "concise", "recgnn"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    check=False,
  )
  assert out.returncode == 0, out.stdout + out.stderr


def _numba_names(tree: ast.Module) -> set[str]:
  """Names in a module that decorate a function as a numba kernel: those imported from numba,
  and module-level functions whose body uses one (a wrapper such as `_jit()`)."""
  names: set[str] = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "numba":
      names.update(a.asname or a.name for a in node.names)
  wrappers = {
    node.name
    for node in tree.body
    if isinstance(node, ast.FunctionDef)
    and any(isinstance(n, ast.Name) and n.id in names | {"numba"} for n in ast.walk(node))
  }
  return names | wrappers


def _is_numba(decorator: ast.expr, numba_names: set[str]) -> bool:
  """Whether a decorator (`njit`, `njit(...)`, `numba.jit(...)`, `_jit()`) compiles with numba."""
  if isinstance(decorator, ast.Call):
    decorator = decorator.func
  while isinstance(decorator, ast.Attribute):
    decorator = decorator.value
  return isinstance(decorator, ast.Name) and (
    decorator.id == "numba" or decorator.id in numba_names
  )


def long_functions(root: pathlib.Path, limit: int = MAX_FUNCTION_LINES) -> dict[str, int]:
  """{"path:qualified.name": lines} of every function under `root` over `limit` lines, numba
  kernels left out. The lines run from the first decorator to the last line of the body."""
  found: dict[str, int] = {}
  for path in sorted(root.rglob("*.py")):
    tree = ast.parse(path.read_text(), filename=str(path))
    numba_names = _numba_names(tree)
    rel = path.relative_to(root.parent).as_posix()

    def visit(node: ast.AST, prefix: str, rel: str = rel, numba_names: set = numba_names):
      for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
          first = min([child.lineno] + [d.lineno for d in child.decorator_list])
          lines = child.end_lineno - first + 1
          kernel = any(_is_numba(d, numba_names) for d in child.decorator_list)
          if lines > limit and not kernel:
            found[f"{rel}:{prefix}{child.name}"] = lines
          visit(child, f"{prefix}{child.name}.")
        elif isinstance(child, ast.ClassDef):
          visit(child, f"{prefix}{child.name}.")
        else:
          visit(child, prefix)

    visit(tree, "")
  return found


def test_no_long_functions():
  long = long_functions(PACKAGE)
  over = {name: n for name, n in long.items() if name not in LONG_FUNCTIONS_FOR_NOW}
  assert not over, f"functions over {MAX_FUNCTION_LINES} lines (split them by step): {over}"
  stale = sorted(LONG_FUNCTIONS_FOR_NOW - set(long))
  assert not stale, f"no longer over {MAX_FUNCTION_LINES} lines, drop from the list: {stale}"


def test_long_functions_sees_long_ones_and_spares_numba(tmp_path):
  """The checker itself: a long plain function, method and nested function are found; a long
  numba kernel (bare, called, through the module's own wrapper) is not."""
  body = "".join(f"x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
  deep = textwrap.indent(body, "    ")
  body = textwrap.indent(body, "  ")
  pkg = tmp_path / "pkg"
  pkg.mkdir()
  (pkg / "m.py").write_text(
    "from numba import njit\n"
    "def _jit():\n  return njit()\n"
    "def short():\n  return 1\n"
    f"def long():\n{body}"
    f"class C:\n  def meth(self):\n{deep}"
    f"def outer():\n  def inner():\n{deep}"
    f"@njit\ndef k1():\n{body}"
    f"@njit(cache=True)\ndef k2():\n{body}"
    f"@_jit()\ndef k3():\n{body}"
  )
  assert set(long_functions(pkg)) == {
    "pkg/m.py:long",
    "pkg/m.py:C.meth",
    "pkg/m.py:outer",
    "pkg/m.py:outer.inner",
  }
