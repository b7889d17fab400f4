"""A backend's plan-string options: one frozen `BackendOptions` dataclass per backend, parsed
from a plan string's {name: value} with the type checks and the error messages that name the
valid options (`parse_options` for a backend class, with or without an `Options` class;
`valid_options` for messages). Part of the backend contract (`contract` re-exports it).
"""

from __future__ import annotations

import dataclasses
import inspect
import types
import typing
from typing import Any, ClassVar


def valid_options(cls) -> list[str]:
  """The option names a backend class takes (for error messages): its `Options` fields, or,
  for a backend without an `Options` class, its constructor's keyword parameters."""
  if getattr(cls, "Options", None) is not None:
    return sorted(f.name for f in dataclasses.fields(cls.Options))
  skip = {"self", "spec", "specs", "mesh", "layout", "text", "cls"}
  params = inspect.signature(cls.__init__).parameters.values()
  return sorted(p.name for p in params if p.name not in skip and p.kind != p.VAR_KEYWORD)


@dataclasses.dataclass(frozen=True)
class BackendOptions:
  """Base of a backend's plan-string options: one frozen dataclass per backend, a field (with
  its default and a line of docstring) per option. `parse` is the one way in from a plan
  string's options: an unknown name lists the valid ones, a value of the wrong type names
  the type wanted, and a subclass's `__post_init__` refuses options that conflict (an option
  the others make meaningless is refused with the reason, never accepted and ignored).
  Checks that need the tables or the mesh stay in the backend's constructor.

  A backend declares `Options = MyOptions` and reads `self.options` (set by
  `Backend.__init__` / `TableBackend.__init__`); a backend without one takes no options.
  """

  #: The backend's name in error messages (a plain class attribute, not an option).
  backend: ClassVar[str] = "backend"

  @classmethod
  def parse(cls, options: dict[str, Any]):
    """{name: value} (a plan string's options, `recgnn.planner.parse_backend`) -> the frozen
    options."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(options) - set(names))
    if unknown:
      raise ValueError(
        f"Bad options for backend {cls.backend!r}: unknown option{'s' * (len(unknown) > 1)} "
        f"{', '.join(unknown)}; valid options: {', '.join(sorted(names))}"
      )
    for name, value in options.items():
      if not _has_type(value, hints[name]):
        raise ValueError(
          f"{cls.backend}: option {name}={value!r} must be {_type_name(hints[name])}"
        )
    # A list literal where a tuple is wanted: kept as a tuple (the options are frozen).
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in options.items()})


def _has_type(value, hint) -> bool:
  """Whether a plan-string literal fits an option's annotation (bool is not an int; an int
  is a float; a tuple option takes a tuple or list of its element type)."""
  origin, args = typing.get_origin(hint), typing.get_args(hint)
  if origin in (typing.Union, types.UnionType):
    return any(_has_type(value, a) for a in args)
  if hint is type(None):
    return value is None
  if hint in (int, float):
    return isinstance(value, (int, float) if hint is float else int) and not isinstance(value, bool)
  if origin is tuple:
    return isinstance(value, (tuple, list)) and all(_has_type(v, args[0]) for v in value)
  return isinstance(value, hint)


def _type_name(hint) -> str:
  origin, args = typing.get_origin(hint), typing.get_args(hint)
  if origin in (typing.Union, types.UnionType):
    return " or ".join(_type_name(a) for a in args)
  if origin is tuple:
    return f"a tuple of {getattr(args[0], '__name__', args[0])}"
  return "None" if hint is type(None) else f"{'an' if hint is int else 'a'} {hint.__name__}"


def parse_options(cls, options: dict[str, Any], owner: str):
  """A backend class's options: `cls.Options.parse(options)`, or, for a backend without an
  `Options` class (third-party ones may have none), a refusal of any option."""
  if getattr(cls, "Options", None) is not None:
    return cls.Options.parse(options)
  if options:
    raise ValueError(f"Backend {owner} takes no options; got {sorted(options)}")
  return None
