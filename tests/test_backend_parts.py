"""Classes are composed of objects, not mixins (docs/architecture.md, "How a backend is
composed"; issue 41): a static check of all of recgnn/ (no module imported, no jax).

Every class there has at most one base: a backend's front derives from the contract's
`Backend` / `TableBackend` alone and holds its parts (layout, preparer, device step, state)
as attributes, and a task's front from `Task` alone, holding its options, data, batch maker and
losses (`tasks/link_prediction/task.py`). Before issue 41,
`HotCold(HotSetPlanning, HostTier, DeviceSteps, Backend)`,
`Sharded(Routing, CodecExchange, Update, Backend)` and
`LinkPrediction(Batches, Losses, Task)` were halves reading each other's attributes through
`self`.

The one exemption: an exception class may derive from several exception types (it holds no
state and reads no attributes; deriving from both is what lets callers catch it as either,
e.g. `planetoid.MalformedDataError(pickle.UnpicklingError, ValueError)`)."""

from __future__ import annotations

import ast
import pathlib

RECGNN = pathlib.Path(__file__).resolve().parents[1] / "recgnn"
EXCEPTION_SUFFIXES = ("Error", "Exception", "Warning")


def classes_with_bases(root: pathlib.Path) -> dict[str, list[str]]:
  """{"file.py:Class": [its bases, as written]} for every class under root."""
  out = {}
  for path in sorted(root.rglob("*.py")):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.ClassDef):
        out[f"{path.relative_to(root)}:{node.name}"] = [ast.unparse(b) for b in node.bases]
  return out


def is_exception(bases: list[str]) -> bool:
  """Every base names an exception type (by the name's last part: `pickle.UnpicklingError`)."""
  return all(b.rsplit(".", 1)[-1].endswith(EXCEPTION_SUFFIXES) for b in bases)


def mixed_classes(root: pathlib.Path) -> dict[str, list[str]]:
  """The classes under root built from several bases (exception classes aside)."""
  found = classes_with_bases(root)
  return {k: v for k, v in found.items() if len(v) > 1 and not is_exception(v)}


def test_no_class_is_built_from_mixins():
  found = classes_with_bases(RECGNN)
  for name in ("backends/hot_cold/backend.py:HotCold", "tasks/link_prediction/task.py:"):
    assert any(k.startswith(name) for k in found), f"the scan did not reach {name}"
  mixed = mixed_classes(RECGNN)
  assert not mixed, (
    f"classes built from several bases in recgnn/: {mixed}; compose the parts as objects "
    "the front class holds (docs/architecture.md, 'How a backend is composed')"
  )


def test_the_check_sees_a_mixin(tmp_path):
  """The scan reads every base (the check can fail), in every folder below the root, and
  exempts exception classes only."""
  (tmp_path / "x.py").write_text("class A(B, C, base.Backend):\n  pass\n")
  (tmp_path / "tasks").mkdir()
  (tmp_path / "tasks" / "t.py").write_text(
    "class T(Batches, Losses, Task):\n  pass\n"
    "class E(pickle.UnpicklingError, ValueError):\n  pass\n"
    "class S(Task):\n  pass\n"
  )
  assert classes_with_bases(tmp_path) == {
    "tasks/t.py:E": ["pickle.UnpicklingError", "ValueError"],
    "tasks/t.py:S": ["Task"],
    "tasks/t.py:T": ["Batches", "Losses", "Task"],
    "x.py:A": ["B", "C", "base.Backend"],
  }
  assert mixed_classes(tmp_path) == {
    "tasks/t.py:T": ["Batches", "Losses", "Task"],
    "x.py:A": ["B", "C", "base.Backend"],
  }
