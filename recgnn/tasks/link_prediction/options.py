"""The link-prediction task's option values and the checks of its config that several of its
modules share (see the package docstring for the config)."""

from __future__ import annotations

TABLE = "entity"
SCORINGS = ("1vsall", "sampled")
NEGATIVES = ("uniform", "type", "partition")
ENCODERS = ("none", "rgcn")
REGULARIZERS = ("none", "n3", "l2")
DEFAULT_NEGATIVES = 256  # negatives.num=0 under sampled scoring


def check_choice(name: str, value, valid) -> None:
  if value not in valid:
    raise ValueError(f"Unknown {name} {value!r}; available: {', '.join(valid)}")


def negative_options(neg, scoring: str, encoder: str, num_parts: int) -> tuple[str, int, bool]:
  """config.negatives -> (kind, num, shared). Only sampled scoring draws negatives: under
  1vsall every candidate row is scored, so a negatives option set there would be ignored and
  is refused instead. Unset: kind "" (uniform; partition when partitioned), num 0 (256)."""
  kind, num, shared = neg.get("kind", ""), int(neg.get("num", 0)), bool(neg.get("shared", False))
  if scoring != "sampled":
    given = [f"{k}={v!r}" for k, v in (("kind", kind), ("num", num), ("shared", shared)) if v]
    if given:
      raise ValueError(
        f"negatives.{', negatives.'.join(given)}: train.scoring={scoring} scores every "
        "candidate entity and draws no negatives; leave negatives unset (kind='', num=0, "
        "shared=False) or set --config.train.scoring=sampled"
      )
    return "", 0, False
  kind = kind or ("partition" if num_parts else "uniform")
  check_choice("negatives.kind", kind, NEGATIVES)
  if kind == "partition" and not num_parts:
    raise ValueError("negatives.kind=partition needs --config.partition.num_parts > 0")
  if num_parts and kind != "partition":
    raise ValueError(
      "partitioned training draws negatives from the partition: "
      "set --config.negatives.kind=partition"
    )
  if shared and (kind == "type" or encoder == "none"):
    raise ValueError(
      "negatives.shared needs an encoder (model.encoder=rgcn) and uniform or partition "
      "negatives; set --config.negatives.shared=False"
    )
  return kind, num or DEFAULT_NEGATIVES, shared
