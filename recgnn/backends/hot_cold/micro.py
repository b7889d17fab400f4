"""hot_cold's popular / non-popular micro-batches (host side, the input thread): which of each
device's examples run in which micro-batch, and how many are popular.

One concern: the split a train batch's `prepare` hands to the step's micro-batch feature
(recgnn.embeddings.microbatch runs and merges them on the device)."""

from __future__ import annotations

import math

import numpy as np
from absl import logging

MARGIN = 4.0  # popular micro-batch size: the popular count less this many binomial std devs
#: The split-off warning: once per group (its backend string), then a count every this many
#: batches it ran whole (`OffLog`).
OFF_EVERY = 100


class OffLog:
  """The "split off" warning, process-wide: the first batch a group (keyed by its backend
  string: one group per string in a plan) runs whole is logged with the reason, then every
  OFF_EVERY-th such batch as a count, not one line per hot set or per group built. A key, not
  the group instance: the planner times each candidate as a group of its own (before any hot
  set is picked, so nothing is popular) and a finalist's timing builds the plan's groups
  again; a 100-step dlrm_kaggle run with plan=auto logged the warning 129 times."""

  def __init__(self, every: int = OFF_EVERY):
    self.every = every
    self.counts: dict[str, int] = {}

  def note(self, group: str, reason) -> None:
    """One batch of `group` run whole; reason() says why (asked for the first line only)."""
    n = self.counts[group] = self.counts.get(group, 0) + 1
    if n == 1:
      logging.warning(
        "%s: popular / non-popular split off: %s (logged once for this group; a count every "
        "%d batches run whole follows)",
        group, reason(), self.every,
      )  # fmt: skip
    elif n % self.every == 0:
      logging.warning(
        "%s: popular / non-popular split off: %d batches run whole so far (the first's reason "
        "logged above)",
        group, n,
      )  # fmt: skip


OFF_LOG = OffLog()


def _popular_size(cnt: int, b: int) -> int:
  """The popular micro-batch size for a device's popular count cnt of b examples: cnt less
  MARGIN binomial standard deviations, so later batches rarely have fewer (each new size
  recompiles the whole train step, which costs many steps).
  Popular examples past it run in the non-popular micro-batch: the same compute."""
  sd = math.sqrt(cnt * (1 - cnt / b)) if b else 0.0
  return max(0, math.floor(cnt - MARGIN * sd))


def off_reason(h: np.ndarray, b: int, n_dev: int) -> str:
  """Why the popular micro-batch is empty, in words (logged: the split never switches off
  silently). h: bool[n_dev, b], each device's popular examples."""
  counts = h.sum(axis=1)
  cnt, total = int(counts.min()), int(counts.sum())
  where = f"{n_dev} device(s) x {b} examples" if n_dev > 1 else f"{b} examples"
  if total == 0:
    return (
      f"no popular example in the batch ({where}): an example is popular only when all its "
      "ids in the group's tables are hot (no hot set yet, or a budget too small for them)"
    )
  sd = math.sqrt(cnt * (1 - cnt / b)) if b else 0.0
  return (
    f"{total} popular example(s) in {where}, {cnt} on the device with fewest; its popular "
    f"micro-batch size ({cnt} less {MARGIN:g} binomial std devs = {cnt - MARGIN * sd:.1f}) "
    "rounds to 0, and every device runs the same size: batches run whole (same values) "
    "until the next hot set. "
    "More examples per device (a larger batch or fewer devices), fewer tables in the group "
    "or a larger budget make examples popular enough to split"
  )


def split(p0s: dict, tables, popular, n_dev, b, group: str = "hot_cold"):
  """Per device, its first P0 popular examples (in batch order), then the rest (its other
  popular examples, then its non-popular ones), as two micro-batches of P0 and b - P0
  examples (every device the same; no padding). P0 (`_popular_size`) is fixed from the
  first train batch of a hot set and only shrinks, when a batch has fewer popular
  examples on some device: a few step shapes per run. None (run the batch whole) while
  P0 is 0; the popular micro-batch alone when P0 = b. Each micro-batch: {"idx":
  int32[n * Pm] local example index, table: {"hot": int32[n * Pm, L], "cold":
  int32[n * Pm, L] (non-popular only), "count": int32[n * Pm] (mean pooling)}}. group: the
  backend string a batch run whole is counted under (`OFF_LOG`)."""
  h = popular.reshape(n_dev, b)
  cnt = int(h.sum(axis=1).min())
  p0 = p0s.get(b)
  if p0 is None or cnt < p0:
    p0 = p0s[b] = _popular_size(cnt, b)
  if p0 == 0:
    OFF_LOG.note(group, lambda: off_reason(h, b, n_dev))
    return None
  return pieces(p0, tables, h, n_dev, b)


def pieces(p0: int, tables, h: np.ndarray, n_dev: int, b: int) -> tuple:
  """The micro-batches of a popular size p0 > 0 (`split`'s result), h: bool[n_dev, b] each
  device's popular examples (at least p0 on every device)."""
  order = np.argsort(~h, axis=1, kind="stable")  # popular first, each in batch order
  micro = []
  # Every example popular: no non-popular micro-batch (a piece of 0 examples).
  for popular_only, idx in ((True, order[:, :p0]), (False, order[:, p0:]))[: 1 + (p0 < b)]:
    glob = (idx + np.arange(n_dev)[:, None] * b).reshape(-1)
    mb = {"idx": idx.reshape(-1).astype(np.int32)}
    for name, t in tables.items():
      e = {"hot": t["hot_ids"][glob]}
      if not popular_only:  # the popular micro-batch never waits for the host
        e["cold"] = t["cold_ids"][glob]
      if "count" in t:
        e["count"] = t["count"][glob]
      mb[name] = e
    micro.append(mb)
  return tuple(micro)
