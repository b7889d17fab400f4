"""Dynamic tables (`dynamic(...)`, recgnn/backends/dynamic/): what the id map costs per id,
and what a collisionless table buys on a drifting stream at equal memory.

Question 1 (cost): ns per id of the host map (`IdMap.map`, numba, the code `prepare` runs)
at batch 2048 and 65536, for each admission / eviction policy, beside offload's cache
planner (`offload(cache_fraction=0.1)`'s prepare: the closest host-side mechanism) on the
same ids, and beside two device shapes of a lookup-only map (jitted: binary search in sorted
keys; open addressing with 8 vectorised probes) that would still need admission and eviction
decided somewhere (a sort of the batch and sequential decisions).

Question 2 (quality): a drifting synthetic stream (`--days` days; ids born and dying; Zipf
popularity within each day's live ids; label ~ Bernoulli(sigmoid(b + w_id)) with w_id a
planted per-id effect: the oracle AUC is the true probabilities'). A per-id logistic model
(one weight per row + a bias; SGD, progressive validation: each batch scored before it is
trained on, days 2.. reported) with capacity 1/2 and 1/8 of the distinct ids: the dynamic
table (immediate admission, lru; a reused row restarts at 0), the hashing trick (id %
capacity) and a dictionary built on the first day (its most frequent ids; others read a zero
row, untrained). The hashing trick's collision rate beside it (share of distinct ids sharing
a bucket with another). `--seeds` seeds.

  python benchmarks/dynamic_tables.py --quick     # ~1 minute
  python benchmarks/dynamic_tables.py             # ~5 minutes
Writes benchmarks/results/dynamic_tables.{json,md}.
"""

from __future__ import annotations

import os
import time

import harness
import jax
import numpy as np

from recgnn import planner
from recgnn.backends.dynamic import id_map
from recgnn.embeddings import base
from recgnn.train import inputs as inputs_lib

KINDS = ("dynamic", "hashing trick", "first-day dictionary")
POLICIES = [("always", 1, "lru", 0), ("count", 2, "lfu", 0), ("bloom", 2, "ttl", 50)]


def raw_stream(rng, batches: int, batch: int, distinct: int) -> list[np.ndarray]:
  """Zipf ranks over `distinct` ids, each a raw 62-bit value, the popular set drifting."""
  cdf = harness.zipf_cdf(distinct, 1.05)
  raw = rng.integers(1 << 40, 1 << 62, size=distinct + batches * 64)
  return [
    raw[harness.zipf_ranks(rng, cdf, (batch, 1)) + 64 * b].astype(np.int64) for b in range(batches)
  ]


def map_ns_per_id(stream, capacity: int) -> dict:
  out = {}
  for admit, k, evict, ttl in POLICIES:
    m = id_map.IdMap(id_map.Policy(capacity=capacity, admit=admit, k=k, evict=evict, ttl=ttl))
    m.map(stream[0])  # (compiled, warm)
    t0 = time.perf_counter()
    for ids in stream[1:]:
      m.map(ids)
    n = sum(x.size for x in stream[1:])
    out[f"host map {admit}/{evict}"] = (time.perf_counter() - t0) / n * 1e9
  return out


def offload_ns_per_id(stream, capacity: int) -> float:
  """offload(cache_fraction=0.1)'s prepare on the map's rows (ids in [0, capacity))."""
  opt = base.OptimizerSpec(name="sgd", learning_rate=0.1)
  spec = base.TableSpec(name="t", num_rows=capacity, dim=16, optimizer=opt)
  group = planner.make_backend("offload(cache_fraction=0.1, lookahead=2)", spec)
  group.init(jax.random.key(0))
  rows = [(x % capacity).astype(np.int32) for x in stream]
  plan = planner.Plan({group.name: group}, {"t": group.name}, group.mesh)
  items = inputs_lib.prepare_stream(plan, (("train", None, {"ids": {"t": r}}) for r in rows))
  hand_back(group, next(items).prepared[group.name])
  t0 = time.perf_counter()
  n = 0
  for item in items:
    hand_back(group, item.prepared[group.name])  # (no step runs: its write-backs, zeros)
    n += 1
  return (time.perf_counter() - t0) / (n * rows[0].size) * 1e9


def hand_back(group, prepared) -> None:
  """What the step of this batch would hand the host writer (zeros of its shapes), so the
  next prepares find the write-backs they wait for (tests/contract_lib.planned_only)."""
  out = tuple(
    {
      kind: {k: np.zeros_like(v) for k, v in lists[f"{kind}_rows"].items()}
      for kind in ("now", "next")
      if lists[kind].shape[1]
    }
    for lists in prepared["lists"]
  )
  group.after_update(None, out)


def device_ns_per_id(stream, capacity: int) -> dict:
  """Lookup-only device maps (no admission / eviction), jitted, x64 keys."""
  import jax.numpy as jnp

  jax.config.update("jax_enable_x64", True)
  keys = np.unique(np.concatenate(stream).reshape(-1))[:capacity]
  sorted_keys = jnp.asarray(np.sort(keys))
  h = 1 << (2 * capacity - 1).bit_length()
  table = np.full(h, -1, np.int64)
  for x in keys.tolist():  # (host build: linear probing on the low bits of a mix)
    i = (x * 0x9E3779B97F4A7C15 >> 20) & (h - 1)
    while table[i] != -1:
      i = (i + 1) & (h - 1)
    table[i] = x
  table = jnp.asarray(table)

  @jax.jit
  def search(ids):
    i = jnp.searchsorted(sorted_keys, ids)
    return jnp.where(sorted_keys[jnp.minimum(i, capacity - 1)] == ids, i, -1)

  @jax.jit
  def probe(ids):
    home = (ids * jnp.int64(-7046029254386353131) >> 20) & (h - 1)
    at = (home[:, None] + jnp.arange(8)) & (h - 1)
    hit = table[at] == ids[:, None]
    return jnp.where(hit.any(1), at[jnp.arange(ids.shape[0]), hit.argmax(1)], -1)

  out = {}
  for name, fn in (
    ("device sorted keys (lookup only)", search),
    ("device 8-probe hash (lookup only)", probe),
  ):
    batches = [jnp.asarray(x.reshape(-1)) for x in stream]
    fn(batches[0]).block_until_ready()
    t0 = time.perf_counter()
    for b in batches[1:]:
      fn(b).block_until_ready()
    out[name] = (time.perf_counter() - t0) / sum(b.size for b in batches[1:]) * 1e9
  jax.config.update("jax_enable_x64", False)
  return out


def cost(args) -> list[dict]:
  rows = []
  for batch in (2048, 65536):
    n = max(8, args.ids // batch)
    stream = raw_stream(np.random.default_rng(0), n, batch, args.distinct)
    figures = map_ns_per_id(stream, args.capacity)
    figures["offload prepare (planner + rows, cache 10%)"] = offload_ns_per_id(
      stream[: min(n, 40)], args.capacity
    )
    figures.update(device_ns_per_id(stream[: min(n, 40)], args.capacity))
    for what, ns in figures.items():
      rows.append({"batch": batch, "what": what, "ns_per_id": ns})
      print(f"  batch {batch:>6} {what:>36}: {ns:7.1f} ns/id", flush=True)
  return rows


def _sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


class Table:
  """One contestant: raw ids -> rows (-1: unknown, reads 0 and is not trained)."""

  def __init__(self, kind: str, capacity: int, first_day: list[np.ndarray] | None = None):
    self.kind, self.capacity = kind, capacity
    if kind == "dynamic":
      self.map = id_map.IdMap(id_map.Policy(capacity=capacity, evict="lru"))
    if kind == "first-day dictionary":
      ids, counts = np.unique(np.concatenate(first_day), return_counts=True)
      keep = ids[np.argsort(-counts, kind="stable")[:capacity]]
      self.keys = np.sort(keep)

  def rows(self, ids: np.ndarray, w: np.ndarray) -> np.ndarray:
    if self.kind == "dynamic":
      rows, resets = self.map.map(ids)
      w[resets] = 0.0  # (a reused row restarts from its initial value)
      return rows
    if self.kind == "hashing trick":
      return (ids % self.capacity).astype(np.int64)
    at = np.minimum(np.searchsorted(self.keys, ids), self.keys.size - 1)
    return np.where(self.keys[at] == ids, at, -1)


def progressive_auc(table: Table, batches, lr: float = 0.5) -> float:
  """Per-id logistic regression, each batch scored before it is trained on; AUC of days 1+."""
  from recgnn import metrics

  w, bias, labels, scores = np.zeros(table.capacity), 0.0, [], []
  for day, ids, y, _ in batches:
    rows = table.rows(ids, w)
    known = rows >= 0
    logit = bias + np.where(known, w[np.maximum(rows, 0)], 0.0)
    p = _sigmoid(logit)
    if day >= 1:
      labels.append(y)
      scores.append(p)
    g = p - y
    bias -= 0.05 * g.mean()
    np.add.at(w, rows[known], -lr * g[known])
  return metrics.auc(np.concatenate(labels), np.concatenate(scores))


def collision_rate(batches, capacity: int) -> float:
  """Share of the stream's distinct ids whose bucket (id % capacity) holds another id too."""
  ids = np.unique(np.concatenate([b[1] for b in batches]))
  _, inv, counts = np.unique(ids % capacity, return_inverse=True, return_counts=True)
  return float((counts[inv] > 1).mean())


def quality(args) -> list[dict]:
  from recgnn import metrics
  from recgnn.data import drifting_stream

  out = []
  for seed in range(args.seeds):
    kw = dict(days=args.days, batches=args.day_batches, batch=2048, born=args.born)
    batches = list(drifting_stream.stream(seed, **kw))
    distinct = len(np.unique(np.concatenate([b[1] for b in batches])))
    later = [b for b in batches if b[0] >= 1]
    oracle = metrics.auc(
      np.concatenate([b[2] for b in later]), np.concatenate([b[3] for b in later])
    )
    first_day = [b[1] for b in batches if b[0] == 0]
    for share in (2, 8):
      cap = distinct // share
      row = {"seed": seed, "distinct": distinct, "capacity": cap, "share": f"1/{share}",
             "oracle_auc": oracle, "hash_collision_rate": collision_rate(batches, cap)}  # fmt: skip
      for kind in KINDS:
        row[kind] = progressive_auc(Table(kind, cap, first_day), batches)
      out.append(row)
      shown = (*KINDS, "oracle_auc", "hash_collision_rate")
      text = ", ".join(f"{k} {row[k]:.4f}" for k in shown)
      print(f"  seed {seed} capacity 1/{share}: {text}", flush=True)
  return out


def markdown(payload) -> str:
  cost_rows = [(r["batch"], r["what"], f"{r['ns_per_id']:.1f}") for r in payload["cost"]]
  q = payload["quality"]
  kinds = KINDS
  qual_rows = []
  for share in ("1/2", "1/8"):
    rs = [r for r in q if r["share"] == share]
    cells = [f"{np.mean([r[k] for r in rs]):.4f} ± {np.std([r[k] for r in rs]):.4f}" for k in kinds]
    diff = [r["dynamic"] - r["hashing trick"] for r in rs]
    cells.append(
      f"{np.mean(diff):+.4f} ± {np.std(diff):.4f} ({sum(d > 0 for d in diff)}/{len(diff)})"
    )
    qual_rows.append([share, rs[0]["capacity"], *cells,
                      f"{np.mean([r['hash_collision_rate'] for r in rs]):.3f}",
                      f"{np.mean([r['oracle_auc'] for r in rs]):.4f}"])  # fmt: skip
  m, a = payload["machine"], payload["args"]
  return "\n".join([
    "# Dynamic tables: the id map's cost and AUC on a drifting stream", "",
    f"Command: `python benchmarks/dynamic_tables.py {' '.join(payload['argv'])}`; load "
    f"{m.get('load_avg_at_start')} at start, {m.get('load_avg_at_end')} at end; "
    f"{m.get('cpu_model')}, {m.get('cpus')} CPUs.", "",
    "## Cost per id (lower is better)", "",
    f"One table, bag 1; {a['ids']:,} ids per batch size drawn Zipf(1.05) over {a['distinct']:,} "
    f"raw 62-bit ids (64 new ones per batch); capacity {a['capacity']:,} rows (offload: the "
    "map's rows, cache 10%, lookahead 2, its whole prepare: planner, exchange lists, host "
    "rows; device shapes: jitted on XLA:CPU with x64 keys, lookups only).", "",
    harness.md_table(["batch", "what", "ns / id"], cost_rows), "",
    f"## Progressive-validation AUC, days 1+ (mean ± std over {len(q) // 2} seeds)", "",
    f"`recgnn.data.drifting_stream`: {a['days']} days x {a['day_batches']} batches of 2048, "
    f"{a['born']:,} ids born a day, each alive 3 days; per-id logistic model, SGD, each batch "
    "scored before it is trained on.", "",
    harness.md_table(["capacity / distinct", "capacity", *kinds, "dynamic - hashing (paired; "
                      "seeds above 0)", "hash collision rate", "oracle AUC"], qual_rows), "",
    "The seeds' streams differ (their oracle AUCs spread as much), so the paired difference "
    "per seed is the comparison; the collision rate is the share of the stream's distinct "
    "ids whose bucket (id % capacity) holds another id too.", "",
  ])  # fmt: skip


def main():
  p = harness.flags.parser(__doc__)
  p.add_argument("--quick", action="store_true")
  p.add_argument("--capacity", type=int, default=1 << 20)
  p.add_argument("--distinct", type=int, default=4_000_000)
  p.add_argument("--ids", type=int, default=4_000_000)
  p.add_argument("--seeds", type=int, default=3)
  p.add_argument("--days", type=int, default=8)
  p.add_argument("--day_batches", type=int, default=20)
  p.add_argument("--born", type=int, default=20_000)
  args = p.parse_args()
  if args.quick:
    args.ids, args.days, args.day_batches, args.born = 1_000_000, 5, 10, 10_000
  payload = harness.record(args)
  payload["cost"] = cost(args)
  payload["quality"] = quality(args)
  payload["machine"]["load_avg_at_end"] = os.getloadavg()
  harness.write_results("dynamic_tables", payload, markdown(payload))


if __name__ == "__main__":
  main()
