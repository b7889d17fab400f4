"""Bytes between devices per train step, by backend and mesh, read from the compiled HLO.

Question: how many bytes does each backend's train step move between devices, per mesh and table
size?

For each table size, backend and (data x model) mesh, the trainer's own jitted train step
(the reference DLRM, `--tables` tables of `--rows` rows, batch `--batch`) is compiled for
that mesh and the collectives of its optimized HLO are summed (`recgnn.comms`): operand
bytes per device per step, by collective and dtype. Compiling needs no table memory (the
state is abstract), so 10M-row tables are counted on this machine too. The claim this
checks: per-step bytes do not depend on the table's rows (no step is O(rows)).

Step times are measured where the state fits (`--max-state-gib` across all simulated
devices): on CPU they are not a scaling claim, the devices share two cores; the bytes are.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/scaling.py
  ... --rows 100000,10000000 --meshes 1x1,8x1,2x4,1x8 --quick

Writes benchmarks/results/scaling.{json,md,png}.
"""

from __future__ import annotations

import pathlib
import time

import harness
from harness import dlrm_task

harness.simulated_devices(8)  # before jax starts

import jax  # noqa: E402
import numpy as np  # noqa: E402
from peers import dlrm as peers_dlrm  # noqa: E402

from recgnn import comms, sharding  # noqa: E402
from recgnn.train import setup as train_setup  # noqa: E402

# tt with pad=full: one shape, so the timed steps do not recompile as capacities grow.
BACKENDS = ("dense", "dense(shard=rows)", "tt(rank=32, pad=full)", "offload(cache_fraction=0.05)")


def parse_mesh(text: str) -> tuple[int, int]:
  d, m = text.lower().split("x")
  return int(d), int(m)


def measure(cfg, backend: str, mesh_shape, batches, args) -> dict:
  """Compile (and, where it fits, time) one configuration."""
  mesh = sharding.make_mesh(*mesh_shape)
  text = backend
  if backend.startswith("offload"):
    text = f"offload(cache_rows={max(args.batch, int(0.05 * cfg.rows[0]))})"
  config = dlrm_task.config_of(cfg)
  config.embeddings.plan = [(".*", text)]
  config.train = {"steps": args.steps}
  config.seed = 0
  task = dlrm_task.task_of(config, cfg, mesh)
  host = [dlrm_task.to_batch(b, task.names) for b in batches]
  task.batches = host  # (a host tier's buffers sized by a train batch of these)
  t0 = time.perf_counter()
  # The trainer's run with an abstract state (shapes and shardings only).
  run = train_setup.build(
    config, mesh=mesh, task=task, example=host[0], key=jax.random.key(0), allocate=False
  )
  plan = run.plan
  per_device = sum(plan.backend_of(n).memory()[n].device_bytes for n in plan.table_group)
  state_bytes = per_device * mesh.size
  run_it = state_bytes <= args.max_state_gib * 2**30
  if run_it:
    t0 = time.perf_counter()
    state = run.init_state()
  else:
    state = run.state
  init_s = time.perf_counter() - t0
  train_step = run.train_step
  # Ahead of the step, in order, as the input thread does (offload plans a cache).
  prepared = [run.prepare(h, [x["ids"] for x in host[i + 1 : i + 2]]) for i, h in enumerate(host)]
  packed = [run.packed(p, h) for p, h in zip(prepared, host)]
  compiled = train_step.lower(state, *packed[0]).compile()
  hlo = comms.compiled_summary(compiled)
  out = {
    "backend": backend,
    "plan_string": text,
    "mesh": f"{mesh_shape[0]}x{mesh_shape[1]}",
    "rows_per_table": cfg.rows[0],
    "tables": cfg.num_tables,
    "bytes_per_step": hlo["total_operand_bytes"],
    "collectives": hlo["by_op"],
    "device_bytes_per_device": per_device,
    "init_seconds": init_s,
  }
  if run_it:
    steps = args.steps
    for i in range(2):  # compile + warm up
      state, m = train_step(state, *packed[i])
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    for i in range(steps):  # in order: each batch's plan was made after the previous one's
      state, m = train_step(state, *packed[2 + i])
    jax.block_until_ready(state)
    out["step_ms"] = 1e3 * (time.perf_counter() - t0) / steps
    out["loss"] = float(m["loss"])
  else:
    out["step_ms"] = None
    out["not_timed"] = (
      f"state {state_bytes / 2**30:.1f} GiB over {mesh.size} simulated devices > "
      f"--max-state-gib {args.max_state_gib}"
    )
  return out


def markdown(payload: dict) -> str:
  a = payload["args"]
  lines = [
    "# Bytes between devices per train step (from the compiled HLO)",
    "",
    f"Reference DLRM, {a['tables']} tables x dim {a['dim']}, batch {a['batch']}, Zipf ids; "
    "bytes = operands of every collective of one step, per device (what each device "
    "contributes). Step times on simulated CPU devices sharing 2 cores: not a scaling claim.",
    "",
    "| backend | mesh | rows / table | bytes / step | collectives | table bytes / device "
    "| step ms |",
    "|---|---|---:|---:|---|---:|---:|",
  ]
  for r in payload["results"]:
    ops = ", ".join(
      f"{k} x{v['count']} {v['operand_bytes']:,} B ({'/'.join(v['dtypes'])})"
      for k, v in r["collectives"].items()
    )
    ms = f"{r['step_ms']:.1f}" if r["step_ms"] is not None else "not run"
    lines.append(
      f"| `{r['backend']}` | {r['mesh']} | {r['rows_per_table']:,} | {r['bytes_per_step']:,} "
      f"| {ops or 'none'} | {r['device_bytes_per_device'] / 2**20:,.1f} MiB | {ms} |"
    )
  lines += ["", "Same bytes at every table size (per backend and mesh):", ""]
  for k, v in payload["rows_independent"].items():
    lines.append(f"- `{k}`: {'yes' if v else 'NO'}")
  lines += ["", f"Measured {payload['machine']['date_utc']}; `{payload['machine']['command']}`."]
  return "\n".join(lines) + "\n"


def plot(payload: dict, path: pathlib.Path) -> None:
  res = [r for r in payload["results"] if r["rows_per_table"] == min(payload["args"]["rows"])]
  meshes = list(dict.fromkeys(r["mesh"] for r in res))
  backends = list(dict.fromkeys(r["backend"] for r in res))
  with harness.png(path, figsize=(8, 4), dpi=110) as (fig, ax):
    w = 0.8 / len(backends)
    for i, b in enumerate(backends):
      ys = [
        next((r["bytes_per_step"] for r in res if r["backend"] == b and r["mesh"] == m), 0) / 1024
        for m in meshes
      ]
      ax.bar(np.arange(len(meshes)) + i * w, ys, w, label=b)
    ax.set_xticks(np.arange(len(meshes)) + w * (len(backends) - 1) / 2, meshes)
    ax.set_xlabel("mesh (data x model)")
    ax.set_ylabel("KiB per device per step")
    ax.set_title(
      f"Collective bytes per train step, from the HLO ({payload['args']['tables']} tables, "
      f"batch {payload['args']['batch']})\nthe same at every table size: "
      + ", ".join(f"{r:,} rows" for r in payload["args"]["rows"]),
      fontsize=10,
    )
    ax.legend(fontsize=8)


def main(argv=None):
  p = harness.flags.parser(__doc__)
  p.add_argument("--rows", default="100000,10000000", help="rows per table, comma-separated")
  p.add_argument("--tables", type=int, default=8)
  p.add_argument("--dim", type=int, default=16)
  p.add_argument("--batch", type=int, default=2048)
  p.add_argument("--meshes", default="1x1,8x1,2x4,1x8")
  p.add_argument("--backends", default=";".join(BACKENDS), help="';'-separated plan strings")
  p.add_argument("--steps", type=int, default=10, help="timed steps per configuration")
  p.add_argument("--max-state-gib", type=float, default=4.0)
  p.add_argument("--quick", action="store_true", help="rows 1000,100000; 3 timed steps")
  p.add_argument("--name", default="scaling")
  args = p.parse_args(argv)
  if args.quick:
    args.rows, args.steps = "1000,100000", 3
  rows = [int(x) for x in args.rows.split(",")]
  meshes = [parse_mesh(m) for m in args.meshes.split(",")]
  backends = [b.strip() for b in args.backends.split(";") if b.strip()]
  machine = harness.machine_info()
  results = []
  for r in rows:
    cfg = peers_dlrm.DlrmConfig(num_rows=r, num_tables=args.tables, dim=args.dim)
    batches = peers_dlrm.make_batches(cfg, args.batch, args.steps + 3, 1.05, seed=0)
    for b in backends:
      for m in meshes:
        res = measure(cfg, b, m, batches, args)
        results.append(res)
        ms = f"{res['step_ms']:.1f} ms" if res["step_ms"] is not None else "not timed"
        print(
          f"{b:<28} {res['mesh']:>4} rows {r:>11,}: {res['bytes_per_step']:>10,} B/step  {ms}",
          flush=True,
        )
  same = {}
  for b in backends:
    for m in meshes:
      name = f"{m[0]}x{m[1]}"
      vals = {x["bytes_per_step"] for x in results if x["backend"] == b and x["mesh"] == name}
      same[f"{b} @ {name}"] = len(vals) == 1
  args_d = {**vars(args), "rows": rows, "backends": backends}
  payload = {"machine": machine, "args": args_d, "results": results, "rows_independent": same}
  harness.write_results(args.name, payload, markdown(payload))
  try:
    plot(payload, harness.RESULTS / f"{args.name}.png")
    print(f"wrote {harness.RESULTS / args.name}.png")
  except ImportError:
    print("matplotlib not installed (pip install -e '.[bench]'): no PNG")


if __name__ == "__main__":
  main()
