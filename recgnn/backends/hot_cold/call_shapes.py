"""hot_cold's k train batches of one call made one shape (`HotCold.stack_call`), so the
trainer stacks them into one scan of k steps (`Layout.steps_per_call`).

Each batch was prepared alone, in stream order, exactly as with one step per call (hot set,
profile, migrations, the rows read, the ring slots). Then, across the call:
  - each stack's cold list is padded to the call's longest (rows zeros, no ring slot: moves
    nothing); a table's "cold_ids" say "not cold" with the list's length, so they follow it;
  - a migration's lists (a table's hot capacity long, or empty) are padded likewise where
    another batch of the call migrates (slots past the hot arrays: read as zeros, dropped);
  - the popular / non-popular split is fixed per call: the smallest popular size P0 of the
    call's batches (a smaller P0 keeps the popular micro-batch popular-only, since every
    batch had at least its own P0 popular examples per device), or the batch run whole when
    any batch of the call runs whole. P0 only shrinks within a hot set, so the call's P0 is
    its last batch's: a call differs from k single steps only where the hot set changes
    inside it (a pick or re-pick planned by a batch that is not a call's last). Keep
    profile_batches and reprofile multiples of k for k steps bit-identical to k calls of one.
Why correct across the call's steps, although all k batches are prepared before the first
runs: a cold row one step writes back and a later step of the call reads again comes from
the device ring of recent write-backs, carried through the scan and sized for a call
(`host_tier.call_ring_steps`; `Recent.check_in_call` refuses a ring too small).
"""

from __future__ import annotations

import numpy as np

from recgnn.backends.hot_cold.geometry import Geometry
from recgnn.backends.hot_cold.micro import pieces
from recgnn.embeddings import host_tier

ABSENT = host_tier.ABSENT
# A migration's lists and their padding: in_rows (row 0: read, then dropped), in_slots and
# out_slots (slot Ha, past the hot arrays), in_src / out_dst (no ring slot).
_MIGRATION = ("in_rows", "in_slots", "out_slots", "in_src", "out_dst")


def one_shape(g: Geometry, prepared: list[dict]) -> list[dict]:
  """prepared: the call's train batches (`Preparer.prepare`'s, in order) -> the same with
  every leaf one shape across them (module docstring)."""
  out = [{**p, "tables": {n: dict(t) for n, t in p["tables"].items()}, "cold": list(p["cold"])}
         for p in prepared]  # fmt: skip
  widened = [False] * len(out)  # (its cold ids moved: its micro-batches' copies must too)
  for stack, names in enumerate(g.stacks):
    widths = [p["cold"][stack]["src"].shape[0] for p in out]
    width = max(widths)
    for i, (p, have) in enumerate(zip(out, widths)):
      if have == width:
        continue
      widened[i] = True
      c = dict(p["cold"][stack])
      c["vals"] = {k: host_tier.widen(v, width, 0) for k, v in c["vals"].items()}
      c["src"], c["dst"] = (host_tier.widen(c[k], width, ABSENT) for k in ("src", "dst"))
      p["cold"][stack] = c
      for n in names:
        t = p["tables"][n]
        t["cold_ids"] = np.where(t["cold_ids"] == have, width, t["cold_ids"]).astype(np.int32)
  for n in g.specs:
    alloc = g.alloc[n]
    fills = dict(zip(_MIGRATION, (0, alloc, alloc, ABSENT, ABSENT)))
    for key in ("in_rows", "out_slots"):
      width = max(p["tables"][n][key].shape[0] for p in out)
      for p in out:
        t = p["tables"][n]
        group = ("in_rows", "in_slots", "in_src") if key == "in_rows" else ("out_slots", "out_dst")
        for k in group:
          t[k] = host_tier.widen(t[k], width, fills[k])
        if key == "in_rows":
          t["in_vals"] = {k: host_tier.widen(v, width, 0) for k, v in t["in_vals"].items()}
  for p in out:
    p["cold"] = tuple(p["cold"])
  return _one_split(g, out, widened)


def _one_split(g: Geometry, prepared: list[dict], widened: list[bool]) -> list[dict]:
  """The call's split: the smallest popular size P0 of its batches, or none (module
  docstring); a batch's micro-batches built again (`micro.pieces`) where its P0 or its cold
  ids changed. A batch's popular examples are those with no cold id."""
  n_dev = g.devices()
  sizes = [p["micro"][0]["idx"].shape[0] // n_dev if "micro" in p else 0 for p in prepared]
  p0 = min(sizes)
  for i, p in enumerate(prepared):
    if sizes[i] == p0 and not (p0 and widened[i]):
      continue
    p.pop("micro", None)
    if p0:
      cold = np.zeros(next(iter(p["tables"].values()))["cold_ids"].shape[0], bool)
      for stack, names in enumerate(g.stacks):
        uc = p["cold"][stack]["src"].shape[0]
        for n in names:
          cold |= (p["tables"][n]["cold_ids"] < uc).any(axis=1)
      p["micro"] = pieces(p0, p["tables"], ~cold.reshape(n_dev, -1), n_dev, cold.size // n_dev)
  return prepared
