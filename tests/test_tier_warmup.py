"""The memory tiers' step signatures while their caches warm up (a realistic Zipf stream,
dlrm_kaggle-like: three 500k-row tables, 2048 ids each per batch, 1 % device budgets).

Each distinct shape of a prepared batch is a train-step program (one compile of the whole
step: ~1-3 s for a DLRM step on CPU, against a step of ~0.1 s). The host-link lists are sized
by `host_cache.ListSizer`: a warming offload cache used to shrink its lists a bucket at a
time as the misses fell (a compile each), hot_cold's profile phase followed its needs through
a few lengths, and groups shrank at steps of their own (one compile per group).

One stream through four groups at once (`four_groups`, module-scoped): each group prepares
apart (the groups share nothing but the step), so a group's column of the signatures is what
it gives alone, and the one-group tests read theirs from it. The tables are zeros (a plan
never reads a value; drawing 12 tables of 500k rows at the suite's XLA -O0 took longer
than the plans).
"""

from __future__ import annotations

import contract_lib as contract
import jax
import numpy as np
import pytest

from recgnn import planner
from recgnn.backends.offload import cache_plan
from recgnn.embeddings import base

STEPS, BATCH, ROWS, TABLES = 300, 2048, 500_000, 3


@pytest.fixture(scope="module")
def stream():
  return [contract.zipf_ids(i, STEPS + 8, BATCH, 1, ROWS) for i in range(TABLES)]


def _signatures(texts, stream):
  """Prepare STEPS train batches through each group (its look-ahead given) -> per step, the
  tuple of each group's prepared leaves' shapes."""
  groups = []
  for j, text in enumerate(texts):
    specs = [base.TableSpec(name=f"g{j}t{i}", num_rows=ROWS, dim=16) for i in range(TABLES)]
    group = planner.make_group(text, specs, planner.default_mesh())
    with base.shapes_only():
      group.init(jax.random.key(0))
    groups.append((group, specs))
  sigs = []
  for k in range(STEPS):
    row = []
    for j, (group, specs) in enumerate(groups):

      def batch(m, specs=specs, j=j):
        return {s.name: stream[(i + j) % TABLES][m] for i, s in enumerate(specs)}

      ahead = [batch(m) for m in range(k + 1, k + 1 + group.lookahead)]
      p = group.prepare(batch(k), ahead, train=True)
      contract.planned_only(group, p)  # (a host tier: as if its step ran)
      row.append(tuple(np.shape(x) for x in jax.tree.leaves(p)))
    sigs.append(tuple(row))
  return sigs


TEXTS = [
  "offload(cache_fraction=0.01)",
  "offload(cache_fraction=0.02)",
  "hot_cold(budget=0.01)",
  "hot_cold(budget=0.02, split=False)",
]


@pytest.fixture(scope="module")
def four_groups(stream):
  """Per step, each of TEXTS' groups' prepared shapes (one stream through all four)."""
  return _signatures(TEXTS, stream)


@pytest.mark.parametrize(
  "text, most",
  [
    # the first batch (its own on-demand list), the cold cache's (the cap), the warm one's
    ("offload(cache_fraction=0.01)", 3),
    # the profile (every id cold: the batch's ids), the pick's migration step, then the
    # steady needs, which may straddle a bucket boundary (two lengths: the bytes follow)
    ("hot_cold(budget=0.01)", 4),
  ],
)
def test_a_group_settles_in_a_few_step_programs(four_groups, text, most):
  j = TEXTS.index(text)  # (its column of the four groups' run: what it gives alone)
  sigs = [row[j] for row in four_groups]
  firsts = [k for k in range(STEPS) if sigs[k] not in sigs[:k]]
  print(f"{text}: {len(firsts)} step signatures over {STEPS} steps, new at steps {firsts}")
  assert len(firsts) <= most, firsts


def test_groups_shrink_together(four_groups):
  """Four host-tier groups in one step: their lists shrink only at the shared decision
  points (every PATIENCE steps from the first), so a shrink recompiles the step once for all
  of them, and the step takes a few programs, not one per group per change."""
  texts, sigs = TEXTS, four_groups
  firsts = [k for k in range(STEPS) if sigs[k] not in sigs[:k]]
  print(f"4 groups: {len(firsts)} step signatures over {STEPS} steps, new at {firsts}")
  for j in range(len(texts)):
    for k in range(1, STEPS):
      old, new = sigs[k - 1][j], sigs[k][j]
      if old == new or len(old) != len(new) or k == 1 or _migration(old, new):
        continue  # (the first batch's on-demand list is empty from the second on)
      if all(np.prod(a) <= np.prod(b) for a, b in zip(new, old)):  # a sizer shrank
        assert (k + 1) % cache_plan.PATIENCE == 0, (texts[j], k)
  # the first batch, the pick (migration and after), a shrink or two for all
  assert len(firsts) <= 2 + 2 * 2, firsts


def _migration(old, new) -> bool:
  """A step that enters or leaves hot_cold's migration (its rows in / out, empty on other
  steps), whose next batch's lists start over (`ListSizer.reset`)."""
  return any((np.prod(a) == 0) != (np.prod(b) == 0) for a, b in zip(old, new))
