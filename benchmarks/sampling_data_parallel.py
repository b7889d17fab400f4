"""Data-parallel GraphSAGE on simulated devices, and the device sampler's sparse-product path.

Question: does data-parallel GraphSAGE match one device's accuracy, and what does its step move
between devices?

`python benchmarks/sampling.py --sections=data_parallel [flags below]` runs this module (or
run it directly). Parts (--parts, comma list):

  product   the device node-wise sampler on one device, direct CSR reads (the default) vs
            the sparse product P = Q @ A formed first (`DeviceNeighborSampler(materialize=
            True)`): seeds/s and sampled edges/s, k mini-batches per call, round-robin rounds
            after a warm-up call each, median; the two samples checked equal; PyG's
            NeighborLoader in the same rounds where torch is installed (the peers' venv)
  scaling   the data-parallel train step (recgnn/tasks/node_data_parallel.py) on 1, 2, 4, 8
            simulated devices, the same global batch: seeds/s, sampled edges/s, and the bytes
            each device sends per step read from the compiled step's HLO (recgnn.comms),
            with the same bytes at 10x the nodes (flat in N)
  cora      GraphSAGE on Cora (experiments/sage_cora.py, 200 steps), data-parallel on 1 and 8
            devices, test accuracy per seed
  synthetic the same on the synthetic graph (--synthetic_nodes, noisy features: the
            neighbours carry the signal)
  pyg       GraphSAGE on Cora trained by recgnn (data-parallel, 1 and 8 devices) and by PyG
            (GraphSAGE + NeighborLoader, the peers' venv) with the same model (SAGE-mean, 2
            layers, hidden 64, dropout 0.5), fanouts [25, 10], batch 140 (the whole train
            split: one step per epoch), 200 steps, Adam 0.01 with L2 5e-4; eval over every
            neighbour (recgnn: eval fanouts -1; PyG: the full graph): per seed the test
            accuracy and the training throughput (seeds/s, sampled edges/s) of the steps
            after the first call (compilation / warm-up), in the same process

Simulated devices are XLA:CPU devices sharing this machine's cores (2 here, shared with other
jobs): timings across device counts show the step's overheads, not a speed-up; the bytes
between devices are what a real mesh would move.

  python benchmarks/sampling.py --sections=data_parallel --name=sampling_data_parallel
Writes benchmarks/results/NAME.{json,md}.
"""

from __future__ import annotations

import os
import statistics
import time

import harness

harness.simulated_devices(8)  # before jax starts: up to 8 simulated devices
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from peers import sampling_pyg  # noqa: E402  (the PyG contestant)

from experiments import sage_cora, sage_synthetic  # noqa: E402
from recgnn.graphs import device_sampling, sampling, synthetic  # noqa: E402
from recgnn.tasks import node_data_parallel as dp  # noqa: E402

SHARED = (
  "simulated devices are XLA:CPU devices that share this machine's {cpus} cores (with other "
  "jobs: load {load:.1f} at start): timings across device counts are not a speed-up"
)


def bench_product(args) -> dict:
  """Direct CSR reads vs the sparse product, one device, k batches per call."""
  spec = synthetic.SyntheticSpec(num_nodes=args.nodes, num_edges=args.edges, num_classes=10, seed=0)
  graph = synthetic.generate(spec)
  rng = np.random.default_rng(0)
  host = sampling.NeighborSampler(graph.adj, fanouts=args.fanouts, batch_size=args.batch_size)
  trial = rng.choice(graph.num_nodes, (4, args.batch_size), replace=False)
  caps = sampling.estimate_capacities(host, trial, rng)
  kw = dict(fanouts=args.fanouts, batch_size=args.batch_size, capacities=caps)
  samplers = {
    "direct": device_sampling.DeviceNeighborSampler(graph.adj, **kw),
    "product": device_sampling.DeviceNeighborSampler(graph.adj, materialize=True, **kw),
  }
  out = {"graph": graph.describe(), "capacities": list(caps), "by_k": {}}
  n = graph.num_nodes
  # PyG's NeighborLoader (where torch is installed: the peers' venv) in the same rounds.
  out["pyg"] = sampling_pyg.status() or "ran"
  for k in args.product_ks:
    seeds = rng.choice(n, (k, args.batch_size), replace=k * args.batch_size > n)
    key = jax.random.key(k)
    first = {}
    for name, s in samplers.items():
      t0 = time.perf_counter()
      first[name] = jax.device_get(s.sample_device(seeds, key))
      print(f"  k={k} {name}: first call (compile) {time.perf_counter() - t0:.1f}s", flush=True)
    same = all(
      np.array_equal(a, b)
      for a, b in zip(jax.tree.leaves(first["direct"]), jax.tree.leaves(first["product"]))
    )
    edges = int(first["direct"][2].sum())
    times = {name: [] for name in samplers}
    pyg, pyg_runs = None, []
    if out["pyg"] == "ran":
      pyg = sampling_pyg.method(graph, args.fanouts, args.batch_size, k)
      pyg()  # warm-up
    for _ in range(args.rounds):
      for name, s in samplers.items():
        t0 = time.perf_counter()
        jax.block_until_ready(s.sample_device(seeds, key))
        times[name].append(time.perf_counter() - t0)
      if pyg is not None:
        pyg_runs.append(pyg())  # (edges, batches, seconds) of k batches
    row = {"same_sample": same, "sampled_edges": edges}
    if pyg_runs:
      e, b, t = (sum(x) for x in zip(*pyg_runs))
      row["pyg"] = {
        "seeds_per_s": b * args.batch_size / t,
        "edges_per_s": e / t,
        "runs_s": [r[2] for r in pyg_runs],
      }
    for name, ts in times.items():
      med = statistics.median(ts)
      row[name] = {
        "median_s": med,
        "runs_s": ts,
        "seeds_per_s": k * args.batch_size / med,
        "edges_per_s": edges / med,
      }
    row["direct_over_product"] = row["product"]["median_s"] / row["direct"]["median_s"]
    out["by_k"][k] = row
    print(f"  k={k}: {row['direct_over_product']:.2f}x direct/product, same={same}", flush=True)
  return out


def synthetic_config(args, num_nodes: int):
  c = sage_synthetic.get_config()
  c.data.synthetic.num_nodes = num_nodes
  c.data.synthetic.num_edges = args.dp_degree * num_nodes
  c.data.synthetic.num_features = args.features
  c.data.synthetic.num_classes = 10
  c.model.inputs = "features"
  c.model.hidden = args.hidden
  c.sampler.fanouts = tuple(args.dp_fanouts)
  c.sampler.batch_size = args.dp_batch
  # Sizes that do not depend on the graph (the bytes are compared across graph sizes).
  c.sampler.capacities = "worst"
  return c


def bench_scaling(args) -> dict:
  """The data-parallel step on 1..8 devices: seeds/s, sampled edges/s, bytes per step."""
  config = synthetic_config(args, args.dp_nodes)
  out = {"by_devices": {}}
  runs = {}
  for n in args.devices:
    t0 = time.perf_counter()
    run = dp.DataParallelSage.from_config(config, n, k=args.dp_k)
    bytes_ = run.step_bytes()
    run.train(args.dp_k)  # compile + first call
    runs[n] = run
    out["by_devices"][n] = {"bytes_per_step": bytes_, "setup_s": time.perf_counter() - t0}
    print(f"  {n} devices: set up in {time.perf_counter() - t0:.1f}s", flush=True)
  times = {n: [] for n in runs}
  edges = {n: [] for n in runs}
  for _ in range(args.rounds):
    for n, run in runs.items():
      t0 = time.perf_counter()
      m = run.train(args.dp_k)
      times[n].append(time.perf_counter() - t0)
      edges[n].append(m["sampled_edges"])
  for n in runs:
    med = statistics.median(times[n])
    seeds = args.dp_k * args.dp_batch
    out["by_devices"][n].update(
      call_s=med,
      runs_s=times[n],
      seeds_per_s=seeds / med,
      edges_per_s=statistics.median(edges[n]) / med,
      per_device_batch=runs[n].per_device,
    )
  big_config = synthetic_config(args, 10 * args.dp_nodes)
  big = dp.DataParallelSage.from_config(big_config, max(args.devices), k=args.dp_k)
  out["bytes_at_10x_nodes"] = big.step_bytes()
  out["param_bytes"] = sum(x.size * 4 for x in jax.tree.leaves(big.state.params))
  return out


def bench_accuracy(what: str, config_of, seeds) -> dict:
  """Test accuracy of `config_of(seed)` data-parallel on 1 and 8 devices, per seed."""
  out = {}
  for n in (1, 8):
    accs = []
    for seed in seeds:
      c = config_of(seed)
      run = dp.DataParallelSage.from_config(c, n, k=8, seed=seed)
      run.train(c.train.steps)
      accs.append(run.evaluate("test")["accuracy"])
      print(f"  {what}, {n} devices, seed {seed}: test accuracy {accs[-1]:.4f}", flush=True)
    out[n] = {"accuracy": accs, "mean": float(np.mean(accs)), "std": float(np.std(accs))}
  out["difference"] = out[8]["mean"] - out[1]["mean"]
  return out


def bench_pyg(args) -> dict:
  """recgnn data-parallel vs PyG GraphSAGE + NeighborLoader on Cora (see the module)."""
  out: dict = {"pyg": sampling_pyg.status() or "ran", "recgnn": {}, "PyG": {}}
  for n in args.pyg_devices:
    rows = []
    for seed in args.pyg_seeds:
      c = cora_config(seed)
      run = dp.DataParallelSage.from_config(c, n, k=args.dp_k, seed=seed)
      run.train(args.dp_k)  # the first call compiles
      steps = c.train.steps - args.dp_k
      calls, edges = -(-steps // args.dp_k), 0.0
      t0 = time.perf_counter()
      for _ in range(calls):
        edges += run.train(args.dp_k)["sampled_edges"]
      dt = time.perf_counter() - t0
      acc = run.evaluate("test")["accuracy"]
      done = calls * args.dp_k
      rows.append(
        {"seed": seed, "test_accuracy": acc, "steps_timed": done,
         "seeds_per_s": done * run.task.batch_size / dt, "edges_per_s": edges / dt}
      )  # fmt: skip
      print(f"  recgnn {n} devices, seed {seed}: {rows[-1]}", flush=True)
    out["recgnn"][n] = rows
  if out["pyg"] != "ran":
    return out
  import torch
  import torch.nn.functional as F
  from torch_geometric.data import Data
  from torch_geometric.loader import NeighborLoader
  from torch_geometric.nn import GraphSAGE

  c = cora_config(0)
  task = dp.nc.NodeClassification(c, dp.sharding.make_mesh(1, 1))
  g = task.graph
  coo = g.adj.tocoo()
  # Row v of adj aggregates from column u: PyG's message direction is u -> v.
  edge_index = torch.from_numpy(np.stack([coo.col, coo.row]).astype(np.int64))
  data = Data(
    x=torch.from_numpy(np.asarray(g.features, np.float32)),
    y=torch.from_numpy(np.maximum(g.labels, 0).astype(np.int64)),
    edge_index=edge_index,
    num_nodes=g.num_nodes,
  )
  train = torch.from_numpy(task.train_nodes.astype(np.int64))
  test = torch.from_numpy(task._labelled("test").astype(np.int64))
  rows = []
  for seed in args.pyg_seeds:
    torch.manual_seed(seed)
    loader = NeighborLoader(
      data, num_neighbors=list(c.sampler.fanouts), batch_size=task.batch_size,
      input_nodes=train, shuffle=True,
    )  # fmt: skip
    model = GraphSAGE(
      g.features.shape[1], c.model.hidden, num_layers=len(c.sampler.fanouts),
      out_channels=g.num_classes, dropout=c.model.dropout,
    )  # fmt: skip
    opt = torch.optim.Adam(
      model.parameters(), lr=c.optimizer.learning_rate, weight_decay=c.optimizer.weight_decay
    )
    batches = sampling_pyg.endless(loader)

    def step(batches=batches, model=model, opt=opt):
      batch = next(batches)
      model.train()
      opt.zero_grad()
      logits = model(batch.x, batch.edge_index)[: batch.batch_size]
      F.cross_entropy(logits, batch.y[: batch.batch_size]).backward()
      opt.step()
      return int(batch.edge_index.shape[1])

    for _ in range(args.dp_k):  # as recgnn's first call
      step()
    done = c.train.steps - args.dp_k
    t0 = time.perf_counter()
    edges = sum(step() for _ in range(done))
    dt = time.perf_counter() - t0
    model.eval()
    with torch.no_grad():
      pred = model(data.x, data.edge_index).argmax(-1)
    acc = float((pred[test] == data.y[test]).float().mean())
    rows.append(
      {"seed": seed, "test_accuracy": acc, "steps_timed": done,
       "seeds_per_s": done * task.batch_size / dt, "edges_per_s": edges / dt}
    )  # fmt: skip
    print(f"  PyG, seed {seed}: {rows[-1]}", flush=True)
  out["PyG"][1] = rows
  return out


def cora_config(seed: int):
  c = sage_cora.get_config()
  c.seed = seed
  return c


def accuracy_config(args, seed: int):
  """The synthetic accuracy graph: noisy features (the task needs the neighbours), the
  scaling part's sampler, `--synthetic_steps` steps."""
  c = synthetic_config(args, args.synthetic_nodes)
  c.data.synthetic.feature_noise = args.synthetic_noise
  c.sampler.capacities = "auto"
  c.train.steps = args.synthetic_steps
  c.seed = seed
  return c


def markdown(payload, shared: str) -> str:
  lines = [
    "# Data-parallel GraphSAGE on simulated devices",
    "",
    f"{payload['machine']['date_utc']}, {payload['machine']['cpu_model']}; {shared}.",
    "",
  ]
  if "product" in payload:
    p = payload["product"]
    a = payload["args"]
    lines += [
      f"## Device sampler: direct CSR reads vs sparse product ({p['graph']}; fanouts "
      f"{a['fanouts']}, batch {a['batch_size']}, fitted capacities {p['capacities']})",
      "",
      harness.md_table(
        [
          "k",
          "direct seeds/s",
          "direct edges/s",
          "product seeds/s",
          "product edges/s",
          "direct speed-up",
          "same sample",
          "PyG seeds/s",
          "PyG edges/s",
        ],  # fmt: skip
        [
          (
            k,
            f"{r['direct']['seeds_per_s']:,.0f}",
            f"{r['direct']['edges_per_s']:,.0f}",
            f"{r['product']['seeds_per_s']:,.0f}",
            f"{r['product']['edges_per_s']:,.0f}",
            f"{r['direct_over_product']:.2f}x",
            r["same_sample"],
            f"{r['pyg']['seeds_per_s']:,.0f}" if "pyg" in r else "-",
            f"{r['pyg']['edges_per_s']:,.0f}" if "pyg" in r else "-",
          )
          for k, r in p["by_k"].items()
        ],
      ),
      "",
      f"PyG NeighborLoader (k batches per timed unit, the same rounds): {p['pyg']}. It "
      "samples only the nodes new at each hop, recgnn every frontier node: compare edges/s.",
      "",
    ]
  if "scaling" in payload:
    s = payload["scaling"]
    a = payload["args"]
    lines += [
      f"## Data-parallel train step ({a['dp_nodes']:,} nodes, {a['features']} features, "
      f"fanouts {a['dp_fanouts']}, global batch {a['dp_batch']}, k = {a['dp_k']} steps per "
      "call)",
      "",
      harness.md_table(
        [
          "devices",
          "seeds/device/step",
          "seeds/s",
          "sampled edges/s",
          "bytes/device/step",
          "collectives",
        ],  # fmt: skip
        [
          (
            n,
            r["per_device_batch"],
            f"{r['seeds_per_s']:,.0f}",
            f"{r['edges_per_s']:,.0f}",
            f"{r['bytes_per_step']['total_operand_bytes']:,}",
            ", ".join(f"{op} x{v['count']}" for op, v in r["bytes_per_step"]["by_op"].items())
            or "none",
          )
          for n, r in s["by_devices"].items()
        ],
      ),
      "",
      f"Dense params: {s['param_bytes']:,} bytes. At 10x the nodes, {max(a['devices'])} "
      f"devices: {s['bytes_at_10x_nodes']['total_operand_bytes']:,} bytes per device per step.",
      "",
    ]
  if "pyg" in payload:
    q = payload["pyg"]
    table = []
    for system in ("recgnn", "PyG"):
      for n, rows in q[system].items():
        accs = [r["test_accuracy"] for r in rows]
        table.append(
          (
            f"{system} data-parallel" if system == "recgnn" else "PyG + NeighborLoader",
            n,
            ", ".join(f"{x:.4f}" for x in accs),
            f"{np.mean(accs):.4f} +- {np.std(accs):.4f}",
            f"{np.median([r['seeds_per_s'] for r in rows]):,.0f}",
            f"{np.median([r['edges_per_s'] for r in rows]):,.0f}",
          )
        )
    lines += [
      "## GraphSAGE on Cora: recgnn vs PyG (fanouts [25, 10], batch 140, 200 steps, Adam "
      "0.01, L2 5e-4, hidden 64, dropout 0.5)",
      "",
      harness.md_table(
        [
          "system",
          "devices",
          "test accuracy per seed",
          "mean +- std",
          "seeds/s (median)",
          "sampled edges/s (median)",
        ],  # fmt: skip
        table,
      ),
      "",
      f"PyG: {q['pyg']}. Throughput over the steps after the first call (compilation, "
      "warm-up). PyG samples only the nodes new at each hop, recgnn every frontier node "
      "(more edges per batch for the same fanouts): compare seeds/s. Simulated devices share "
      "the same cores: 8 devices are not 8x the compute.",
      "",
    ]
  a = payload["args"]
  titles = {
    "cora": "Cora test accuracy, data-parallel (200 steps, global batch 140)",
    "synthetic": f"Synthetic graph test accuracy, data-parallel ({a['synthetic_nodes']:,} "
    f"nodes, feature noise {a['synthetic_noise']}, {a['synthetic_steps']} steps, global "
    f"batch {a['dp_batch']})",
  }
  for part, title in titles.items():
    if part not in payload:
      continue
    c = payload[part]
    lines += [
      f"## {title}",
      "",
      harness.md_table(
        ["devices", "per seed", "mean +- std"],
        [
          (
            n,
            ", ".join(f"{x:.4f}" for x in c[n]["accuracy"]),
            f"{c[n]['mean']:.4f} +- {c[n]['std']:.4f}",
          )  # fmt: skip
          for n in (1, 8)
        ],
      ),
      "",
      f"8 - 1 devices: {c['difference']:+.4f}.",
      "",
    ]
  return "\n".join(lines)


def main(argv=None):
  p = harness.flags.parser(__doc__)
  p.add_argument("--parts", default="product,scaling,cora")
  p.add_argument("--name", default="sampling_data_parallel")
  p.add_argument("--nodes", type=int, default=200_000, help="product: graph nodes")
  p.add_argument("--edges", type=int, default=2_000_000, help="product: adjacency entries")
  p.add_argument("--fanouts", type=int, nargs="+", default=[15, 10, 5])
  p.add_argument("--batch_size", type=int, default=1024)
  p.add_argument("--product_ks", type=int, nargs="+", default=[1, 4])
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4, 8])
  p.add_argument("--dp_nodes", type=int, default=20_000)
  p.add_argument("--dp_degree", type=int, default=10, help="adjacency entries per node")
  p.add_argument("--dp_fanouts", type=int, nargs="+", default=[10, 5])
  p.add_argument("--dp_batch", type=int, default=512)
  p.add_argument("--dp_k", type=int, default=4)
  p.add_argument("--features", type=int, default=64)
  p.add_argument("--hidden", type=int, default=64)
  p.add_argument("--cora_seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
  p.add_argument("--synthetic_nodes", type=int, default=20_000)
  p.add_argument("--synthetic_noise", type=float, default=4.0, help="feature noise std")
  p.add_argument("--synthetic_steps", type=int, default=200)
  p.add_argument("--synthetic_seeds", type=int, nargs="+", default=[0, 1])
  p.add_argument("--pyg_seeds", type=int, nargs="+", default=[0, 1, 2])
  p.add_argument("--pyg_devices", type=int, nargs="+", default=[1, 8])
  p.add_argument(
    "--quick", action="store_true", help="smoke run, not figures: small graphs, 1 round, 1 seed"
  )
  args = p.parse_args(argv)
  if args.quick:
    args.parts, args.nodes, args.edges, args.rounds = "product,scaling,cora", 20_000, 200_000, 1
    args.devices, args.dp_nodes, args.cora_seeds = [1, 2], 2_000, [0]
  parts = args.parts.split(",")
  unknown = set(parts) - {"product", "scaling", "cora", "synthetic", "pyg"}
  if unknown:
    raise SystemExit(
      f"unknown --parts {sorted(unknown)}; use product, scaling, cora, synthetic, pyg"
    )
  machine = harness.machine_info()
  shared = SHARED.format(cpus=machine["cpus"], load=machine["load_avg_at_start"][0])
  print(shared, flush=True)
  payload = {"args": vars(args), "machine": machine}
  if "product" in parts:
    payload["product"] = bench_product(args)
  if "scaling" in parts:
    payload["scaling"] = bench_scaling(args)
  if "cora" in parts:
    payload["cora"] = bench_accuracy("Cora", cora_config, args.cora_seeds)
  if "synthetic" in parts:
    config_of = lambda seed: accuracy_config(args, seed)  # noqa: E731
    payload["synthetic"] = bench_accuracy("synthetic", config_of, args.synthetic_seeds)
  if "pyg" in parts:
    payload["pyg"] = bench_pyg(args)
  payload["load_avg_at_end"] = os.getloadavg()
  harness.write_results(args.name, payload, markdown(payload, shared))


if __name__ == "__main__":
  main()
