"""The CTR model registry: `config.model.name` names a module of `recgnn.models` whose
`CTR_MODEL` builds the model. One file per model, found by its module's name (as tasks are
found in `recgnn.tasks`); a module without `CTR_MODEL` (graphsage, kge, rgcn) is no CTR model.

  CTR_MODEL(model, tables) -> flax.linen.Module
      model: the config's `model` section (a ConfigDict; read what the model needs, with
      defaults for optional keys); tables: the task's table names, in the task's order.
  module(dense f32[B, Dd], embeddings {table: f32[B, D_t]}) -> logits f32[B]
      the pooled embeddings by table name, one entry per name of `tables` (a dict that went
      through jit comes back with sorted keys: a model that concatenates keeps its own order,
      e.g. `tables`', never the dict's). Params float32; the logits float32.

The module must compare equal to another only where both give the same params and outputs
(a flax module is a dataclass, hashable and equal by its fields): the trainer shares one
compiled init program between builds with equal models (`Task.init_fn`).

`model.interaction`, the key of configs before `model.name`, is an alias that names the model
when set: "dot" -> dlrm, "dcn" -> dcn.
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
from collections.abc import Sequence
from typing import Any

PACKAGE = "recgnn.models"
#: model.interaction (older configs) -> model.name.
ALIASES = {"dot": "dlrm", "dcn": "dcn"}
#: The model of a config that names none (neither model.name nor model.interaction).
DEFAULT = "dlrm"


def _module(name: str) -> Any | None:
  """The module `recgnn.models.<name>` if it exists and declares CTR_MODEL, else None."""
  if not name.isidentifier() or importlib.util.find_spec(f"{PACKAGE}.{name}") is None:
    return None
  module = importlib.import_module(f"{PACKAGE}.{name}")
  return module if hasattr(module, "CTR_MODEL") else None


def available() -> list[str]:
  """The registered CTR model names: the modules of `recgnn.models` that declare CTR_MODEL
  (imports them: all are small)."""
  spec = importlib.util.find_spec(PACKAGE)
  names = [m.name for m in pkgutil.iter_modules(spec.submodule_search_locations)]
  return sorted(n for n in names if _module(n) is not None)


def model_name(model) -> str:
  """The model a config's `model` section names: model.interaction's alias when that key is
  set (non-empty), else model.name, else DEFAULT."""
  interaction = model.get("interaction", "") or ""
  if interaction:
    if interaction not in ALIASES:
      aliases = ", ".join(f"{k} ({v})" for k, v in ALIASES.items())
      raise ValueError(
        f"Unknown model.interaction {interaction!r} (the older key of model.name); available: "
        f"{aliases}. Or set model.name to one of {', '.join(available())}."
      )
    return ALIASES[interaction]
  return model.get("name", "") or DEFAULT


def build(model, tables: Sequence[str]):
  """The flax module `model` (a config's `model` section) names, for these tables (in the
  task's order); an unknown name lists the valid ones."""
  name = model_name(model)
  module = _module(name)
  if module is None:
    raise ValueError(
      f"Unknown model.name {name!r}; available: {', '.join(available())}. A model of your own "
      f"is one file, {PACKAGE.replace('.', '/')}/<name>.py, with a CTR_MODEL (docs/models.md)."
    )
  return module.CTR_MODEL(model, tuple(tables))
