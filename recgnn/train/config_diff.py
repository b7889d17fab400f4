"""Which config keys differ between a checkpoint's run and this one (the message of a refused
resume names them, in the user's words): the keys that only change how a run proceeds left
out, two spellings of the same plan read as equal."""

from __future__ import annotations

from recgnn import planner

# Keys whose change on resume is expected (how long, how often, on which devices): not
# listed when explaining a refused resume.
_RUN_KEYS = ("train.", "mesh.", "device_memory_budget")


def config_differences(saved: dict, current: dict, prefix: str = "") -> list[tuple]:
  """[(dotted key, saved value, current value)] of the config leaves that differ, the keys
  that only change how a run proceeds (train.*, mesh.*) left out."""
  out = []
  for k in sorted(set(saved) | set(current)):
    key = f"{prefix}{k}"
    if key.startswith(_RUN_KEYS):
      continue
    a, b = saved.get(k, "absent"), current.get(k, "absent")
    if isinstance(a, dict) and isinstance(b, dict):
      out += config_differences(a, b, key + ".")
    elif a != b and not (key == "embeddings.plan" and _same_plan(a, b)):
      out.append((key, a, b))
  return out


def _same_plan(a, b) -> bool:
  """Two configs' plans read as the same rules (`planner.rules_of`: plan=auto is
  ((".*", "auto"),))."""
  try:
    return planner.rules_of(a) == planner.rules_of(b)
  except ValueError:
    return False
