"""The backend registry's table: `register_backend`, a class decorator that writes a backend
class under its name. The contract knows nothing of where backends live: looking a name up,
after loading the built-in backends and the installed entry points, is the planner's
(`recgnn.planner.backend_class`)."""

from __future__ import annotations

import ast
import re
from collections.abc import Sequence
from typing import Any

import jax

from recgnn.embeddings.contract import Backend, Layout, valid_options
from recgnn.embeddings.group import TableGroup
from recgnn.embeddings.specs import TableSpec
from recgnn.embeddings.table_backend import TableBackend

#: name -> class, written by `register_backend`, read by `recgnn.planner`.
REGISTRY: dict[str, type] = {}


def register_backend(name: str):
  """Class decorator: register a `Backend` (a group of tables) or a `TableBackend` (one
  table; grouped by `TableGroup`) under `name`, the word a plan string starts with.

    @register_backend("toy")
    class Toy(TableBackend): ...
  """
  if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
    raise ValueError(f"Backend name {name!r} is not an identifier")

  def register(cls):
    if not (isinstance(cls, type) and issubclass(cls, (Backend, TableBackend))):
      raise TypeError(f"@register_backend({name!r}): {cls!r} is not a Backend or TableBackend")
    old = REGISTRY.get(name)
    if old is not None and old.__qualname__ != cls.__qualname__:
      raise ValueError(f"Backend {name!r} is already registered ({old.__module__}.{old.__name__})")
    cls.name = name
    REGISTRY[name] = cls
    return cls

  return register


_BACKEND_RE = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(?:\((.*)\))?\s*$", re.S)


def parse_backend(text: str) -> tuple[str, dict[str, Any]]:
  """'tt(rank=32, kernel=prefix)' -> ('tt', {'rank': 32, 'kernel': 'prefix'}).

  Option values are Python literals; bare words are strings. `_` separators allowed in ints.
  """
  m = _BACKEND_RE.match(text)
  if not m:
    raise ValueError(f"Cannot parse backend {text!r}; expected NAME or NAME(key=value, ...)")
  name, args = m.group(1), (m.group(2) or "").strip()
  options: dict[str, Any] = {}
  if args:
    try:
      call = ast.parse(f"f({args})", mode="eval").body
    except SyntaxError as e:
      raise ValueError(f"Cannot parse options of backend {text!r}: {e.msg}") from None
    if call.args:
      raise ValueError(f"Backend {text!r}: options must be key=value")
    for kw in call.keywords:
      v = kw.value
      options[kw.arg] = v.id if isinstance(v, ast.Name) else ast.literal_eval(v)
  return name, options


def construct(
  cls: type,
  text: str,
  specs: Sequence[TableSpec],
  mesh: jax.sharding.Mesh,
  layout: Layout,
  options: dict[str, Any],
) -> Backend:
  """The group of `specs` for backend class `cls` (registered) with these parsed options: a
  `Backend` as it is, a `TableBackend` in its group class (`TableGroup` by default). The
  planner's `make_group` checks the layout and the protocols around it; a backend that wraps
  another (`dynamic`) builds its inner group here too."""
  try:
    if issubclass(cls, TableBackend):
      return (cls.group_class(specs, options) or TableGroup)(
        cls, specs, mesh, layout, text, **options
      )
    return cls(specs, mesh, layout, text=text, **options)
  except TypeError as e:
    raise ValueError(
      f"Bad options for backend {text!r}: {e}; valid options: "
      f"{', '.join(valid_options(cls)) or 'none'}"
    ) from None
