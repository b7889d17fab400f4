"""The backend registry's table: `register_backend`, a class decorator that writes a backend
class under its name. The contract knows nothing of where backends live: looking a name up,
after loading the built-in backends and the installed entry points, is the planner's
(`recgnn.planner.backend_class`)."""

from __future__ import annotations

import re

from recgnn.embeddings.contract import Backend
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
