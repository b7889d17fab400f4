"""The argument after ':' in `--experiment=NAME:ARG`: one parser for every experiment.
(run.py lists no module whose name starts with '_' as an experiment.)

ARG is comma-separated items, each `key=value` or a bare value:
  kge_fb15k237:rotate                      a bare value fills the next `positional` key
  rgcn_fb15k237_partitioned:4,parallel     a bare word naming a bool key sets it to True
  hotline_kaggle:budget=0.01,tables=10     key=value, typed by the key's default
  ttrec_kaggle:rank=16,cache_rows=10000    with `rest`, keys without a default are kept as
                                           text for a backend, which checks them itself
A key without a default (and no `rest`), a value that does not parse as its default's type
or is not among its choices, or a malformed item fails naming the experiment, the item and
what is valid. An experiment without options refuses any ARG (it would be ignored).
"""

from __future__ import annotations

from collections.abc import Sequence

_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


def split_items(arg: str) -> list[str]:
  """'a=1,b=(2, 3),c="x,y"' -> ['a=1', 'b=(2, 3)', 'c="x,y"']: commas inside quotes or
  brackets do not split."""
  items, depth, quote, cur = [], 0, "", []
  for ch in arg:
    if quote:
      quote = "" if ch == quote else quote
    elif ch in "'\"":
      quote = ch
    elif ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
    elif ch == "," and depth == 0:
      items.append("".join(cur).strip())
      cur = []
      continue
    cur.append(ch)
  items.append("".join(cur).strip())
  if quote or depth:
    raise ValueError(f"unbalanced quotes or brackets in {arg!r}")
  return items


def _typed(key: str, text: str, default):
  """`text` as the type of `default` (text unquoted; None or str defaults: the text)."""
  text = text.strip()
  if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
    text = text[1:-1]
  if isinstance(default, bool):
    if text.lower() in _TRUE + _FALSE:
      return text.lower() in _TRUE
    raise ValueError(f"{key}={text!r} is not a bool (true / false)")
  for kind in (int, float):
    if isinstance(default, kind):
      try:
        return kind(text)
      except ValueError:
        raise ValueError(f"{key}={text!r} is not {kind.__name__}") from None
  return text


def parse(
  arg: str | None,
  defaults: dict,
  choices: dict | None = None,
  *,
  name: str = "experiment",
  positional: Sequence[str] = (),
  rest: bool = False,
  usage: str | None = None,
) -> dict:
  """ARG -> `defaults` updated (see the module docstring). `choices[key]`: its valid values;
  `positional`: the keys bare values fill, in order; `rest`: keep keys without a default as
  text (for a backend's own parser); `usage`: what the errors list as valid (default: the
  keys and their defaults)."""
  options = dict(defaults)
  valid = usage or (
    ", ".join(f"{k}={v!r}" for k, v in defaults.items()) if defaults else "no options"
  )
  where = f"{name}:{arg}"
  if arg is not None and str(arg).strip():
    try:
      items = split_items(str(arg))
    except ValueError as e:
      raise ValueError(f"{where}: {e}; available: {valid}") from None
    slots = list(positional)
    for item in items:
      key, sep, value = item.partition("=")
      key = key.strip()
      if not item or (sep and not key):
        raise ValueError(f"{where}: malformed item {item!r}; available: {valid}")
      if not sep:  # a bare value: a bool key's name, else the next positional key's value
        if isinstance(defaults.get(key), bool):
          options[key] = True
          continue
        if not slots:
          raise ValueError(f"{where}: unknown option {item!r}; available: {valid}")
        key, value = slots.pop(0), item
      elif key in slots:
        slots.remove(key)
      if key in defaults:
        try:
          options[key] = _typed(key, value, defaults[key])
        except ValueError as e:
          raise ValueError(f"{where}: {e}; available: {valid}") from None
      elif rest:
        options[key] = value.strip()
      else:
        raise ValueError(f"{where}: unknown option {key!r}; available: {valid}")
  for key, allowed in (choices or {}).items():
    if options[key] not in allowed:
      raise ValueError(
        f"{where}: unknown {key} {options[key]!r}; available: {', '.join(map(str, allowed))}"
      )
  return options
