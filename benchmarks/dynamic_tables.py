"""Dynamic tables (`dynamic(...)`, recgnn/backends/dynamic/): what the id map costs per id.

Ns per id of the host map (`IdMap.map`, numba, the code `prepare` runs)
at batch 2048 and 65536, for each admission / eviction policy, beside offload's cache
planner (`offload(cache_fraction=0.1)`'s prepare: the closest host-side mechanism) on the
same ids, and beside two device shapes of a lookup-only map (jitted: binary search in sorted
keys; open addressing with 8 vectorised probes) that would still need admission and eviction
decided somewhere (a sort of the batch and sequential decisions).

What a dynamic table buys in AUC on a drifting stream, through the trainer:
benchmarks/dynamic_drift.py.

  python benchmarks/dynamic_tables.py --quick     # seconds
  python benchmarks/dynamic_tables.py             # ~10 s on 2 quiet cores
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
  first = next(items).prepared[group.name]
  group.after_update(None, group.planned_to_host(first))  # (no step runs: zeros written back)
  t0 = time.perf_counter()
  n = 0
  for item in items:
    group.after_update(None, group.planned_to_host(item.prepared[group.name]))
    n += 1
  return (time.perf_counter() - t0) / (n * rows[0].size) * 1e9


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


def markdown(payload) -> str:
  cost_rows = [(r["batch"], r["what"], f"{r['ns_per_id']:.1f}") for r in payload["cost"]]
  m, a = payload["machine"], payload["args"]
  return "\n".join([
    "# Dynamic tables: the id map's cost per id", "",
    f"Command: `python benchmarks/dynamic_tables.py {' '.join(payload['argv'])}`; load "
    f"{m.get('load_avg_at_start')} at start, {m.get('load_avg_at_end')} at end; "
    f"{m.get('cpu_model')}, {m.get('cpus')} CPUs.", "",
    "## Cost per id (lower is better)", "",
    f"One table, bag 1; {a['ids']:,} ids per batch size drawn Zipf(1.05) over {a['distinct']:,} "
    f"raw 62-bit ids (64 new ones per batch); capacity {a['capacity']:,} rows (offload: the "
    "map's rows, cache 10%, lookahead 2, its whole prepare: planner, exchange lists, host "
    "rows; device shapes: jitted on XLA:CPU with x64 keys, lookups only).", "",
    harness.md_table(["batch", "what", "ns / id"], cost_rows), "",
  ])  # fmt: skip


def main():
  p = harness.flags.parser(__doc__)
  p.add_argument("--quick", action="store_true")
  p.add_argument("--capacity", type=int, default=1 << 20)
  p.add_argument("--distinct", type=int, default=4_000_000)
  p.add_argument("--ids", type=int, default=4_000_000)
  args = p.parse_args()
  if args.quick:
    args.ids = 1_000_000
  payload = harness.record(args)
  payload["cost"] = cost(args)
  payload["machine"]["load_avg_at_end"] = os.getloadavg()
  harness.write_results("dynamic_tables", payload, markdown(payload))


if __name__ == "__main__":
  main()
