"""The argument after ':' in `--experiment=NAME:ARG`, for the experiments that take options.
(run.py lists no module whose name starts with '_' as an experiment.)"""

from __future__ import annotations

from recgnn.embeddings import base


def parse(arg: str | None, defaults: dict, choices: dict | None = None) -> dict:
  """'key=value,...' (values Python literals or bare words) -> `defaults` updated. A key not
  in defaults, or a value not in choices[key], fails naming what is available."""
  options = dict(defaults)
  if arg:
    _, parsed = base.parse_backend(f"x({arg})")
    unknown = set(parsed) - set(defaults)
    if unknown:
      raise ValueError(f"Unknown option(s) {sorted(unknown)}; available: {', '.join(defaults)}")
    options.update(parsed)
  for key, valid in (choices or {}).items():
    if options[key] not in valid:
      raise ValueError(f"Unknown {key} {options[key]!r}; available: {', '.join(valid)}")
  return options
