"""The `offload` backend (cDLRM): cache hit rate per policy and cache size, step time vs dense.

Question: what hit rate does each cache policy reach per cache size, and what does offload's
step cost against dense?

Two measurements on the same Zipf id stream (one table, `--batch` x `--bag` ids per step):

  hit rate    for each policy (lru, lfu, lookahead) and cache size (1%, 5%, 10%, 25% of the
              rows): the share of the distinct rows of each admitted batch already resident,
              and rows moved host->device / device->host per step. Planner only (host side,
              exactly the code `prepare` runs).
  step time   the jitted train step (pooled lookup -> tiny loss -> grad -> update, state
              donated) of `dense` and of `offload(policy=lru)` at each cache size, timed in
              round-robin in the same process (the machine is shared: compare ratios). The
              offload step includes its cache exchange (write-back + load of the next batch's
              missing rows); `prepare` runs before timing, as the trainer's input thread runs
              it ahead of the step. Its host cost is reported as plan_ms. Timed with
              `exchange=fixed` (lists of a batch's ids whatever the misses: ONE program):
              the default `bucket` sizes the lists by the misses, so its step takes a few
              shapes and could compile inside the timed loop; memory_tiers.py measures what
              bucket moves. The programs each step compiled are counted and reported
              beside the times, with those compiled in the timed reps (0, or a rep holds a
              compile; fixed's on-demand list is empty after the first batch: 2 programs,
              both in the warm-up).

  python benchmarks/offload.py --quick     # ~1 minute
  python benchmarks/offload.py             # ~5 minutes
Writes benchmarks/results/offload.{json,md,png}.
"""

from __future__ import annotations

import itertools
import pathlib
import sys
import time

import harness
import jax
import jax.numpy as jnp
import numpy as np
import sparse_update  # (its loss of pooled rows)

from recgnn import planner
from recgnn.embeddings import base
from recgnn.train import inputs as inputs_lib

RESULTS = harness.RESULTS
POLICIES = ("lru", "lfu", "lookahead")
TARGET_RATIO = 1.3  # offload step at a 5% cache vs dense


def make_batches(args, num: int, seed: int) -> list[np.ndarray]:
  """Zipf ids, P(rank r) ~ r^-exponent, hot rows scattered by ONE permutation for the whole
  stream (a fresh permutation per batch, as harness.zipf_ids draws by default, makes a stream
  with no reuse across batches)."""
  rng = np.random.default_rng(seed)
  cdf = harness.zipf_cdf(args.rows, args.exponent)
  perm = rng.permutation(args.rows).astype(np.int32)
  shape = (args.batch, args.bag)
  return [perm[harness.zipf_ranks(rng, cdf, shape)] for _ in range(num)]


def spec_of(args) -> base.TableSpec:
  opt = base.OptimizerSpec(name=args.optimizer, learning_rate=0.05, initial_accumulator=0.1)
  return base.TableSpec(name="t", num_rows=args.rows, dim=args.dim, optimizer=opt)


def backend_text(fraction: float, policy: str, lookahead: int, exchange: str = "") -> str:
  more = f", exchange={exchange}" if exchange else ""
  return f"offload(cache_fraction={fraction}, policy={policy}, lookahead={lookahead}{more})"


def prepared_stream(group, batches):
  """The group's prepared pytree of each batch, in order, each prepared with its look-ahead
  window from the whole stream: the trainer's own driver (inputs.prepare_stream)."""
  plan = planner.Plan({group.name: group}, {n: group.name for n in group.specs}, group.mesh)
  stream = (("train", None, {"ids": {"t": ids}}) for ids in batches)
  for item in inputs_lib.prepare_stream(plan, stream):
    yield item.prepared[group.name]


def table_stats(group) -> dict:
  """The group's stats of table "t", without the "t/" prefix."""
  return {k.removeprefix("t/"): v for k, v in group.stats().items()}


def prepare_all(backend, batches, n):
  """prepare the first n batches in order (see `prepared_stream`).
  Returns (prepared, host seconds per batch)."""
  t0 = time.perf_counter()
  with harness.prepare_without_steps():  # (see `hit_rates`)
    out = list(itertools.islice(prepared_stream(backend, batches), n))
  return out, (time.perf_counter() - t0) / n


def hit_rates(args, batches, key) -> list[dict]:
  """Hit rates of every policy and cache size over the stream, prepared with no step run:
  the reads of rows a step would have written back do not wait for write-backs that never
  come (`harness.prepare_without_steps`; they hung until the writer's bound). The counts
  do not depend on the rows' values; the step times replay the prepared batches likewise
  (stale host rows: timing only)."""
  spec = spec_of(args)
  rows = []
  for fraction in args.fractions:
    for policy in POLICIES:
      b = planner.make_backend(backend_text(fraction, policy, args.lookahead), spec)
      b.init(key)
      with harness.prepare_without_steps():
        for i, _ in enumerate(prepared_stream(b, batches)):
          if i + 1 == args.warmup_batches:
            b.stats()  # the cache is warm: count from here
      s = table_stats(b)
      cache_rows = b.members["t"].cache_rows
      rows.append({"fraction": fraction, "cache_rows": cache_rows, "policy": policy, **s})
      print(f"  hit rate {policy:>9} cache {fraction:>5.0%}: {s['hit_rate']:.3f}", flush=True)
  # The ceiling: a cache holding every row misses only first touches (compulsory misses).
  b = planner.make_backend(backend_text(1.0, "lru", args.lookahead), spec)
  b.init(key)
  with harness.prepare_without_steps():
    for i, _ in enumerate(prepared_stream(b, batches)):
      if i + 1 == args.warmup_batches:
        b.stats()
  cache_rows = b.members["t"].cache_rows
  rows.append({"fraction": 1.0, "cache_rows": cache_rows, "policy": "all rows", **table_stats(b)})
  return rows


def make_step(backend):
  """The jitted train step (its `_cache_size()`: the programs it compiled)."""

  def step(state, inputs):
    prepared, target = inputs
    pooled, residuals = backend.lookup(state, prepared)
    g = jax.grad(sparse_update._loss_of_pooled)(pooled["t"], target)
    # The rows for the host (evictions) split off and dropped: the batches were prepared
    # before any step ran, so no write-back could be read anyway (timing only).
    return base.split_to_host(backend.update(state, prepared, residuals, {"t": g}))[0]

  return jax.jit(step, donate_argnums=0)


def ordered_runner(fn, state, inputs, warmup: int = 0):
  """Like harness.jitted_runner but never wraps around: offload plans are a sequence.
  `run.programs`: [programs fn compiled by the end of the warm-up, by the last call]."""
  box = {"state": state, "i": 0}

  def run(k: int):
    st = box["state"]
    for _ in range(k):
      st = fn(st, inputs[box["i"]])
      box["i"] += 1
    box["state"] = jax.block_until_ready(st)
    if box["i"] <= warmup:
      run.programs[0] = fn._cache_size()
    run.programs[1] = fn._cache_size()

  run.programs = [0, 0]
  return run


def step_times(args, batches, key) -> tuple[dict, dict]:
  spec = spec_of(args)
  n_steps = args.warmup + args.reps * args.steps_per_rep
  assert len(batches) >= n_steps, "not enough batches"
  targets = [
    jnp.asarray(np.random.default_rng(i).normal(size=(args.batch, args.dim)), jnp.float32)
    for i in range(4)
  ]
  runners, plan_ms, contestants = {}, {}, {"dense": "dense"}
  for fraction in args.fractions:
    # exchange=fixed: one step shape, no compile inside the timed loop (module docstring).
    text = backend_text(fraction, "lru", args.lookahead, exchange="fixed")
    contestants[f"offload {fraction:.0%}"] = text
  for name, text in contestants.items():
    b = planner.make_backend(text, spec)
    state = b.init(key)
    prepared, per = prepare_all(b, batches, n_steps)
    plan_ms[name] = 1e3 * per
    inputs = [(p, targets[i % 4]) for i, p in enumerate(prepared)]
    runners[name] = ordered_runner(make_step(b), state, inputs, args.warmup)
    print(f"  prepared {name}: {plan_ms[name]:.2f} ms/step on the host", flush=True)
  timing = harness.interleaved_timing(runners, args.warmup, args.reps, args.steps_per_rep)
  for name, run in runners.items():  # (compiled in the timed reps: 0, or a rep holds one)
    timing[name]["programs"] = run.programs[1]
    timing[name]["programs_compiled_timed"] = run.programs[1] - run.programs[0]
  return timing, plan_ms


def markdown(payload: dict) -> str:
  a = payload["config"]
  lines = [
    "# offload (cDLRM): hit rate and step time",
    "",
    f"One table of {a['rows']:,} rows x {a['dim']} ({a['optimizer']}), batches of "
    f"{a['batch']} x {a['bag']} Zipf({a['exponent']}) ids, look-ahead {a['lookahead']}. "
    f"CPU, {payload['machine']['cpus']} cores shared (load average at start "
    f"{payload['machine'].get('loadavg', '?')}). Command: `{payload['command']}`",
    "",
    "## Hit rate (distinct rows of each batch already resident) by policy and cache size",
    "",
    "| cache | rows | " + " | ".join(POLICIES) + " | h2d rows/step (lru) | d2h rows/step (lru) |",
    "|---|---|" + "---|" * len(POLICIES) + "---|---|",
  ]
  by = {(r["fraction"], r["policy"]): r for r in payload["hit_rate"]}
  ceiling = by[(1.0, "all rows")]["hit_rate"]
  for f in a["fractions"]:
    cells = [f"{by[(f, p)]['hit_rate']:.3f}" for p in POLICIES]
    lru = by[(f, "lru")]
    lines.append(
      f"| {f:.0%} | {lru['cache_rows']:,} | "
      + " | ".join(cells)
      + f" | {lru['h2d_rows_per_step']:.0f} | {lru['d2h_rows_per_step']:.0f} |"
    )
  lines += [
    "",
    f"Ceiling (a cache of every row, only first touches miss, over the same "
    f"{a['hit_batches'] - a['warmup_batches']} batches after {a['warmup_batches']} warm-up "
    f"batches): {ceiling:.3f}.",
  ]
  lines += [
    "",
    "## Train-step time (lookup + grad + update, jitted, state donated), "
    "offload(policy=lru, exchange=fixed)",
    "",
    "| backend | step ms (median) | vs dense (median of per-rep ratios) | plan ms/step "
    "(input thread) | programs (compiled in the timed reps) |",
    "|---|---|---|---|---|",
  ]
  for name, t in payload["step"].items():
    lines.append(
      f"| {name} | {t['step_ms']:.3f} | {payload['ratio'][name]:.2f}x | "
      f"{payload['plan_ms'][name]:.2f} | {t.get('programs', '-')} "
      f"({t.get('programs_compiled_timed', '-')}) |"
    )
  r = payload["ratio_5pct"]
  if r is not None:
    verdict = "meets" if r <= TARGET_RATIO else "MISSES"
    lines += ["", f"Step at a 5% cache / dense step: **{r:.2f}x** ({verdict} <= {TARGET_RATIO})."]
  return "\n".join(lines) + "\n"


def plot(payload: dict, path: pathlib.Path) -> None:
  with harness.png(path, ncols=2, figsize=(10, 4), dpi=120) as (fig, (ax1, ax2)):
    fr = payload["config"]["fractions"]
    for p in POLICIES:
      hr = [
        r["hit_rate"]
        for f in fr
        for r in payload["hit_rate"]
        if (r["fraction"], r["policy"]) == (f, p)
      ]
      ax1.plot([100 * f for f in fr], hr, marker="o", label=p)
    ceiling = [r["hit_rate"] for r in payload["hit_rate"] if r["policy"] == "all rows"][0]
    ax1.axhline(ceiling, color="gray", ls=":", label="every row cached")
    ax1.set_xscale("log")
    ax1.set_xlabel("cache size (% of rows)")
    ax1.set_ylabel("hit rate (distinct rows per batch)")
    ax1.set_title("Hit rate on Zipf ids")
    ax1.legend()
    ax1.grid(alpha=0.3)
    names = list(payload["step"])
    ms = [payload["step"][n]["step_ms"] for n in names]
    ax2.bar(names, ms, color=["gray"] + ["C0"] * (len(names) - 1))
    ax2.axhline(ms[0] * TARGET_RATIO, color="red", ls="--", lw=1, label=f"{TARGET_RATIO}x dense")
    ax2.set_ylabel("train step (ms, median)")
    ax2.set_title("Step time: dense vs offload(lru)")
    ax2.legend()


def main(argv=None):
  ap = harness.flags.parser(__doc__)
  ap.add_argument("--rows", type=int, default=2_000_000)
  ap.add_argument("--dim", type=int, default=16)
  ap.add_argument("--batch", type=int, default=4096)
  ap.add_argument("--bag", type=int, default=1)
  ap.add_argument("--exponent", type=float, default=1.05)
  ap.add_argument("--optimizer", default="rowwise_adagrad", choices=base.OPTIMIZERS)
  ap.add_argument("--lookahead", type=int, default=8)
  ap.add_argument("--fractions", type=float, nargs="+", default=[0.01, 0.05, 0.10, 0.25])
  ap.add_argument("--hit_batches", type=int, default=400, help="batches per hit-rate run")
  ap.add_argument("--warmup_batches", type=int, default=100, help="excluded from hit rates")
  ap.add_argument("--warmup", type=int, default=5)
  ap.add_argument("--reps", type=int, default=15)
  ap.add_argument("--steps_per_rep", type=int, default=100)
  ap.add_argument("--quick", action="store_true")
  ap.add_argument("--out", default="offload")
  args = ap.parse_args(argv)
  if args.quick:
    args.rows, args.hit_batches, args.warmup_batches = 500_000, 80, 20
    args.reps, args.steps_per_rep = 5, 10
  import os

  command = "python benchmarks/offload.py " + " ".join(argv if argv is not None else sys.argv[1:])
  machine = {**harness.machine_info(), "loadavg": os.getloadavg()[0]}
  key = jax.random.key(0)
  n_steps = args.warmup + args.reps * args.steps_per_rep
  batches = make_batches(args, max(args.hit_batches, n_steps) + args.lookahead, seed=1)
  print("hit rates ...", flush=True)
  hits = hit_rates(args, batches[: args.hit_batches], key)
  print("step times ...", flush=True)
  timing, plan_ms = step_times(args, batches, key)
  # Reps are interleaved, so rep r of every contestant saw about the same machine load: the
  # median of per-rep ratios is steadier than a ratio of medians on this shared machine.
  dense = np.asarray(timing["dense"]["per_rep_ms"])
  ratios = {n: float(np.median(np.asarray(t["per_rep_ms"]) / dense)) for n, t in timing.items()}
  ratio = ratios.get("offload 5%")
  payload = {
    "command": command.strip(),
    "config": vars(args),
    "machine": machine,
    "hit_rate": hits,
    "step": timing,
    "plan_ms": plan_ms,
    "ratio": ratios,
    "ratio_5pct": ratio,
    "target_ratio": TARGET_RATIO,
  }
  harness.write_results(args.out, payload, markdown(payload))
  if harness.can_plot():
    plot(payload, RESULTS / f"{args.out}.png")
  else:
    print("no plot (matplotlib not installed): pip install matplotlib")


if __name__ == "__main__":
  main()
