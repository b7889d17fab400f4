"""Train-step time vs table size: the `dense` backend's sparse update against a naive step.

Question: is the dense backend's step free of O(rows) work (flat from 1M to 10M rows), unlike
autodiff through the table?

The rule this checks (docs/architecture.md): no step costs O(rows in a table). Both steps look
up the same batch of ids in one table, take a tiny loss and update the table with SGD:

  dense   recgnn's `dense` backend (contract v2, a group of one table): pooled lookup ->
          loss -> grad w.r.t. the pooled rows -> `backend.update` (unpooled: a scatter-add
          of the B * L row gradients), state donated.
  naive   the table is a param: jax.grad of the loss w.r.t. the whole table (a table-sized
          cotangent) and optax.sgd over all of it, params and optimizer state donated.

One table, `--lookups` one-hot ids per example all into it (default 2048 x 26 = 53,248 ids
per step, the id count of a DLRM Kaggle batch), ids uniform over the rows. Reports the median
step time per size and step(largest) / step(smallest) per variant; the target for `dense` is
<= 1.3, the naive step grows with the table.

  python benchmarks/sparse_update.py            # 10K, 1M, 10M rows (~2 minutes)
  python benchmarks/sparse_update.py --quick    # 10K, 100K, 1M rows, fewer repetitions
Writes benchmarks/results/sparse_update.{json,md}.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

# Runnable as `python benchmarks/sparse_update.py` from a checkout without installing recgnn.
import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax

from recgnn import planner
from recgnn.embeddings import base

TARGET_RATIO = 1.3


# ----------------------------------------------------------------------------- the two steps


def _loss_of_pooled(pooled: jax.Array, target: jax.Array) -> jax.Array:
  """A tiny loss over pooled rows float32[B, D]: squared error."""
  return jnp.mean((pooled - target) ** 2)


def _loss_of_rows(rows: jax.Array, target: jax.Array) -> jax.Array:
  """The same loss over looked-up rows float32[B, L, D], sum-pooled."""
  return _loss_of_pooled(jnp.sum(rows, axis=1), target)


def make_dense_step(backend: base.Backend):
  """(state, (prepared, target)) -> state: recgnn's sparse path, jitted with state donated.
  `backend` is a group of one table named "t"."""

  def step(state, inputs):
    prepared, target = inputs
    pooled, residuals = backend.lookup(state, prepared)
    g = jax.grad(_loss_of_pooled)(pooled["t"], target)
    return backend.update(state, prepared, residuals, {"t": g})

  return jax.jit(step, donate_argnums=0)


def make_naive_step(tx: optax.GradientTransformation):
  """(state, (ids, target)) -> state, state = (table, opt_state): autodiff through the gather."""

  def step(state, inputs):
    table, opt_state = state
    ids, target = inputs
    g = jax.grad(lambda t: _loss_of_rows(jnp.take(t, ids, axis=0), target))(table)
    updates, opt_state = tx.update(g, opt_state, table)
    return optax.apply_updates(table, updates), opt_state

  return jax.jit(step, donate_argnums=0)


def make_ids(args, rng, num_rows: int) -> np.ndarray:
  shape = (args.batch, args.lookups)
  if args.ids == "zipf":
    return harness.zipf_ids(rng, num_rows, shape, args.zipf_exponent)
  return rng.integers(0, num_rows, shape, dtype=np.int64)


def build_runners(num_rows: int, args, rng: np.random.Generator) -> dict[str, Callable]:
  """The dense and (up to --naive-max-rows) naive steps on one table of `num_rows` rows."""
  spec = base.TableSpec(
    name="t",
    num_rows=num_rows,
    dim=args.dim,
    optimizer=base.OptimizerSpec(name="sgd", learning_rate=args.lr),
  )
  backend = planner.make_backend("dense", spec)
  ids = [make_ids(args, rng, num_rows) for _ in range(args.num_batches)]
  targets = [
    jax.device_put(rng.normal(size=(args.batch, args.dim)).astype(np.float32)) for _ in ids
  ]
  # Host-side `prepare` is off the step's path (the input pipeline does it); transfers done.
  prepared = [jax.device_put(backend.prepare({"t": i})) for i in ids]
  runners = {
    "dense": harness.jitted_runner(
      make_dense_step(backend), backend.init(jax.random.key(0)), list(zip(prepared, targets))
    )
  }
  if num_rows <= args.naive_max_rows:
    tx = optax.sgd(args.lr)
    table = jnp.asarray(base.init_table(base.table_key(jax.random.key(0), "t"), spec))
    runners["naive"] = harness.jitted_runner(
      make_naive_step(tx),
      (table, tx.init(table)),
      [(jax.device_put(i.astype(np.int32)), t) for i, t in zip(ids, targets)],
    )
  if args.torch:
    runners["torch"] = torch_runner(num_rows, args, ids, [np.asarray(t) for t in targets])
  return runners


def torch_available() -> bool:
  try:
    import torch  # noqa: F401
  except Exception:
    return False
  return True


def torch_runner(num_rows: int, args, ids, targets) -> Callable[[int], Any]:
  """Reference: the same step in PyTorch, nn.EmbeddingBag(sum, sparse=True) + torch.optim.SGD.

  Each example's L ids are one bag, so the bag's sum is the pooled sum of the tiny loss.
  """
  import torch

  torch.manual_seed(0)
  emb = torch.nn.EmbeddingBag(num_rows, args.dim, mode="sum", sparse=True)
  opt = torch.optim.SGD(emb.parameters(), lr=args.lr)
  inputs = [(torch.from_numpy(i), torch.from_numpy(t)) for i, t in zip(ids, targets)]
  pos = [0]

  def run(k: int):
    for _ in range(k):
      i, t = inputs[pos[0] % len(inputs)]
      pos[0] += 1
      opt.zero_grad(set_to_none=True)
      loss = ((emb(i) - t) ** 2).mean()
      loss.backward()
      opt.step()

  return run


def check_same_update(args) -> float:
  """Both steps are the same SGD: max |dense - naive| table difference after 3 steps (small)."""
  n = 1000
  spec = base.TableSpec(
    name="t", num_rows=n, dim=args.dim, optimizer=base.OptimizerSpec(learning_rate=args.lr)
  )
  backend = planner.make_backend("dense", spec)
  rng = np.random.default_rng(1)
  tx = optax.sgd(args.lr)
  dstep, nstep = make_dense_step(backend), make_naive_step(tx)
  state = backend.init(jax.random.key(0))
  # The group's table starts from its name's key (base.table_key): the same rows here.
  table = jnp.asarray(base.init_table(base.table_key(jax.random.key(0), "t"), spec))
  nstate = (table, tx.init(table))
  for _ in range(3):
    ids = rng.integers(0, n, (64, args.lookups))
    target = jnp.asarray(rng.normal(size=(64, args.dim)).astype(np.float32))
    state = dstep(state, (backend.prepare({"t": ids}), target))
    nstate = nstep(nstate, (jnp.asarray(ids, jnp.int32), target))
  return float(np.max(np.abs(backend.tables(state)["t"] - np.asarray(nstate[0]))))


def _cpu_ms(t: dict) -> float:
  return t["cpu_user_ms_per_step"] + t["cpu_system_ms_per_step"]


def _cells(t: dict) -> list[str]:
  return [f"{t['step_ms']:.2f}", f"{_cpu_ms(t):.2f}", f"{t['minor_faults_per_step']:,.0f}"]


def markdown(payload: dict) -> str:
  a, m, s = payload["config"], payload["machine"], payload["summary"]
  rows = payload["results"]
  dist = "uniform" if a["ids"] == "uniform" else f"Zipf (exponent {a['zipf_exponent']})"
  lines = [
    "# Sparse update: train-step time vs table size",
    "",
    f"One table, dim {a['dim']}, batch {a['batch']} x {a['lookups']} one-hot lookups "
    f"({a['batch'] * a['lookups']:,} ids/step, {dist}), SGD lr {a['lr']}. Median over "
    f"{a['reps']} repetitions ({a['steps_per_rep']} steps each for dense, "
    f"{a['naive_steps_per_rep']} for naive) after {a['warmup']} warmup steps, every size and "
    f"variant timed in round-robin. {m['jax_backend']}, {m['cpus']} CPUs, load average "
    f"{m['load_avg_at_start'][0]:.1f} at start, {m['date_utc']}.",
    "",
    "Wall ms/step is what a user sees but on a loaded machine also includes waiting for a "
    "core; CPU ms/step (user + system, all threads) and page faults/step are the work done.",
    "",
    "| rows | table | dense: wall ms/step | dense: CPU ms/step | dense: faults/step "
    "| naive: wall ms/step | naive: CPU ms/step | naive: faults/step | naive / dense (wall) |",
    "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for r in rows:
    d = r["dense"]["step_ms"]
    cells = [f"{r['num_rows']:,}", f"{r['table_mib']:,.1f} MiB", *_cells(r["dense"])]
    if "naive" in r:
      cells += [*_cells(r["naive"]), f"{r['naive']['step_ms'] / d:.1f}x"]
    else:
      cells += ["not run", "", "", ""]
    lines.append("| " + " | ".join(cells) + " |")
  if any("torch" in r for r in rows):
    lines += [
      "",
      "Reference, the same step in PyTorch (nn.EmbeddingBag(sum, sparse=True) + "
      "torch.optim.SGD), timed in the same round-robin:",
      "",
      "| rows | wall ms/step | CPU ms/step | faults/step |",
      "|---:|---:|---:|---:|",
      *[
        f"| {r['num_rows']:,} | " + " | ".join(_cells(r["torch"])) + " |"
        for r in rows
        if "torch" in r
      ],
    ]
  big, small = f"{rows[-1]['num_rows']:,}", f"{rows[0]['num_rows']:,}"
  naive = s.get("naive_ratio")
  lines += [
    "",
    f"step({big}) / step({small}), wall time (CPU time in brackets):",
    f"- dense backend: **{s['dense_ratio']:.2f}** ({s['dense_cpu_ratio']:.2f}); target <= "
    f"{TARGET_RATIO}: {'met' if s['dense_target_met'] else 'NOT met'}",
    f"- naive: **{naive:.1f}** ({s['naive_cpu_ratio']:.1f})"
    if naive is not None
    else "- naive: not run at every size",
  ]
  if s.get("torch_ratio") is not None:
    lines.append(
      f"- PyTorch EmbeddingBag(sparse=True) + SGD, for reference: {s['torch_ratio']:.2f} "
      f"({s['torch_cpu_ratio']:.2f})"
    )
  if s.get("dense_ratio_top_two") is not None:
    prev = f"{rows[-2]['num_rows']:,}"
    nv2 = s.get("naive_ratio_top_two")
    lines += [
      "",
      f"step({big}) / step({prev}), the two largest sizes: dense "
      f"{s['dense_ratio_top_two']:.2f} ({s['dense_cpu_ratio_top_two']:.2f})"
      + (f", naive {nv2:.1f}" if nv2 is not None else ""),
    ]
  lines += [
    "",
    f"Dense and naive apply the same SGD: max |table difference| after 3 steps = "
    f"{payload['same_update_max_abs_diff']:.2e}.",
    "",
  ]
  return "\n".join(lines)


def main(argv=None):
  p = harness.flags.parser(__doc__)
  p.add_argument("--rows", default="10000,1000000,10000000", help="table sizes, comma-separated")
  p.add_argument("--dim", type=int, default=16)
  p.add_argument("--batch", type=int, default=2048)
  p.add_argument("--lookups", type=int, default=26, help="one-hot ids per example")
  p.add_argument("--ids", choices=("uniform", "zipf"), default="uniform", help="id distribution")
  p.add_argument("--zipf-exponent", type=float, default=1.05)
  p.add_argument("--lr", type=float, default=0.1)
  p.add_argument("--num-batches", type=int, default=4, help="distinct id batches cycled over")
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--reps", type=int, default=7)
  p.add_argument("--steps-per-rep", type=int, default=20)
  p.add_argument("--naive-steps-per-rep", type=int, default=2)
  p.add_argument("--naive-max-rows", type=int, default=10_000_000, help="skip naive above this")
  p.add_argument(
    "--torch",
    action=argparse.BooleanOptionalAction,
    default=None,
    help="also time PyTorch's EmbeddingBag(sparse=True) + SGD (default: if torch imports)",
  )
  p.add_argument("--quick", action="store_true", help="10K/100K/1M rows, 3 reps")
  p.add_argument("--name", default="", help="results file stem (default sparse_update[_zipf])")
  args = p.parse_args(argv)
  if args.quick:
    args.rows, args.reps, args.steps_per_rep, args.warmup = "10000,100000,1000000", 3, 5, 2
  args.name = args.name or ("sparse_update" if args.ids == "uniform" else "sparse_update_zipf")
  if args.torch is None:
    args.torch = torch_available()
  if args.torch:
    import torch

    torch.set_num_threads(len(os.sched_getaffinity(0)))
  sizes = sorted(int(float(s)) for s in args.rows.split(","))

  rng = np.random.default_rng(0)
  machine = harness.machine_info()
  runners, steps = {}, {}
  for n in sizes:
    for variant, run in build_runners(n, args, rng).items():
      runners[(n, variant)] = run
      steps[(n, variant)] = args.naive_steps_per_rep if variant == "naive" else args.steps_per_rep
  # All sizes and both variants are timed in round-robin, so load changes hit them alike.
  timing = harness.interleaved_timing(runners, args.warmup, args.reps, steps)
  results = []
  for n in sizes:
    r = {"num_rows": n, "table_mib": n * args.dim * 4 / 2**20}
    for variant in ("dense", "naive", "torch"):
      if (n, variant) in timing:
        r[variant] = timing[(n, variant)]
    results.append(r)
  del runners

  def ratio(variant, a, b, key="step_ms"):
    if variant in a and variant in b:
      if key == "cpu":
        return _cpu_ms(a[variant]) / _cpu_ms(b[variant])
      return a[variant][key] / b[variant][key]
    return None

  first, last = results[0], results[-1]
  summary = {
    "dense_ratio": ratio("dense", last, first),
    "naive_ratio": ratio("naive", last, first),
    "dense_cpu_ratio": ratio("dense", last, first, "cpu"),
    "naive_cpu_ratio": ratio("naive", last, first, "cpu"),
    "torch_ratio": ratio("torch", last, first),
    "torch_cpu_ratio": ratio("torch", last, first, "cpu"),
  }
  if len(results) >= 3:
    # Between the two largest sizes (by default both far beyond the caches) an O(rows) term
    # would show undiluted by cache effects.
    summary["dense_ratio_top_two"] = ratio("dense", last, results[-2])
    summary["naive_ratio_top_two"] = ratio("naive", last, results[-2])
    summary["dense_cpu_ratio_top_two"] = ratio("dense", last, results[-2], "cpu")
  summary["dense_target_met"] = summary["dense_ratio"] <= TARGET_RATIO
  payload = {
    "benchmark": "sparse_update",
    "config": dict(vars(args)),
    "machine": machine,
    "results": results,
    "summary": summary,
    "same_update_max_abs_diff": check_same_update(args),
  }
  harness.write_results(args.name, payload, markdown(payload))
  return payload


if __name__ == "__main__":
  main()
