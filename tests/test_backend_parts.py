"""Backends are composed of objects by phase, not mixins (docs/architecture.md, "How a backend
is composed"): a static check of recgnn/backends (no module imported, no jax).

Every class there has at most one base: a backend's front derives from the contract's
`Backend` / `TableBackend` alone and holds its parts (layout, preparer, device step, state)
as attributes; before issue 41, `HotCold(HotSetPlanning, HostTier, DeviceSteps, Backend)` and
`Sharded(Routing, CodecExchange, Update, Backend)` were halves reading each other's
attributes through `self`."""

from __future__ import annotations

import ast
import pathlib

BACKENDS = pathlib.Path(__file__).resolve().parents[1] / "recgnn" / "backends"


def classes_with_bases(root: pathlib.Path) -> dict[str, list[str]]:
  """{"file.py:Class": [its bases, as written]} for every class under root."""
  out = {}
  for path in sorted(root.rglob("*.py")):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.ClassDef):
        out[f"{path.relative_to(root)}:{node.name}"] = [ast.unparse(b) for b in node.bases]
  return out


def test_no_backend_class_is_built_from_mixins():
  found = classes_with_bases(BACKENDS)
  assert any(k.endswith(":HotCold") for k in found), "the scan found no backend"
  mixed = {k: v for k, v in found.items() if len(v) > 1}
  assert not mixed, (
    f"classes built from several bases in recgnn/backends: {mixed}; compose the parts as "
    "objects the front class holds (docs/architecture.md, 'How a backend is composed')"
  )


def test_the_check_sees_a_mixin(tmp_path):
  """The scan reads every base (the check can fail)."""
  (tmp_path / "x.py").write_text("class A(B, C, base.Backend):\n  pass\n")
  assert classes_with_bases(tmp_path) == {"x.py:A": ["B", "C", "base.Backend"]}
