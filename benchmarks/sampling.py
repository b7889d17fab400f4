"""Bulk matrix-based neighbour sampling vs PyG's NeighborLoader, and GraphSAGE training.

Question: how fast is bulk matrix-based sampling against PyG's NeighborLoader, on the host and
on the device, and what does it change in GraphSAGE's accuracy?

Graph: the synthetic power-law graph with planted communities (recgnn.graphs.synthetic),
default 1M nodes / 10M adjacency entries (5M undirected edges, both directions stored),
seeds drawn from its training split.

1. Sampling throughput, sampled edges per second (edges actually drawn, padding excluded):
   recgnn's NeighborSampler with k = 1, 4, 16, 64 mini-batches per sparse product (padded
   frontier sizes fitted as the task fits them), the same with worst-case padding (k = 16)
   and with P = Q @ A materialised by scipy (k = 16), and PyG's NeighborLoader
   (torch-sparse backend, no pyg-lib on this machine) over the same graph with the same
   fanouts and batch size. recgnn samples every frontier node at every layer (the
   destination nodes of a layer are re-sampled as sources of the next, as DGL blocks do);
   PyG samples only the nodes new at each hop, so per batch it draws fewer edges: hence
   edges/s, not batches/s. Methods run in round-robin after a warm-up call each (the first
   call of a size faults its buffers in), median over the rounds.
2. End-to-end training seeds/s of a 2-layer GraphSAGE-mean (64 input features, hidden 128,
   fanouts [15, 10], batch 1024, Adam): recgnn's trainer (`recgnn.train.loop`, sampling on
   its input thread) against PyG's GraphSAGE over NeighborLoader batches (the same size).

3. (--sections=device) Host vs device sampler (recgnn.graphs.device_sampling: the same
   samplers as jitted JAX over a CSR in device memory): sampled edges/s for k = 1..64
   mini-batches per call, node-wise and LADIES, with PyG's NeighborLoader in the same
   round-robin rounds. On a CPU-only machine "device" is XLA:CPU on the same cores.
4. (--sections=split) The graph's rows split over 8 (simulated) devices: collective bytes per
   hop read from the compiled HLO (recgnn.comms) beside the replicated graph (every device
   holds it all, samples its k / 8 batches, moves nothing); the split sample checked equal
   to the 1-device one; GraphSAGE trained on a synthetic graph with the split sampler on an
   8-device mesh against the 1-device sampler on one device (test accuracy).
   (--sections=split_ladies) The same for LADIES (recgnn.graphs.split_sampling.
   SplitLadiesSampler: all-gather of the frontier, reduce-scatter of P = Q @ Ahat's
   entries): bytes per layer from the HLO, the sample checked against the 1-device one, and
   GraphSAGE with LADIES split over 8 devices vs 1 device. With --merge, added to an
   existing NAME.json (the node-wise split's figures kept as they were).
5. (--sections=cora) GraphSAGE on Cora (experiments/sage_cora.py), host vs device sampler,
   test accuracy over 5 seeds.
6. (--sections=data_parallel) benchmarks/sampling_data_parallel.py (its own flags): the
   data-parallel step on 1-8 simulated devices, the device sampler's sparse product.

  python benchmarks/sampling.py            # sections sampling,training: ~5 minutes
  python benchmarks/sampling.py --quick    # 200k nodes, fewer rounds
  python benchmarks/sampling.py --sections=device --name=sampling_device
  python benchmarks/sampling.py --sections=split --name=sampling_split
  python benchmarks/sampling.py --sections=split_ladies --name=sampling_split --merge
  python benchmarks/sampling.py --sections=cora --name=sampling_cora
Writes benchmarks/results/NAME.{json,md} (+ NAME.png for the device section).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time
from typing import Any

# Runnable as `python benchmarks/sampling.py` from a checkout without installing recgnn.
import harness
import numpy as np
from peers import sampling_pyg  # (the PyG contestant)

from recgnn import hostmem
from recgnn.graphs import ladies, sampling, synthetic

RESULTS = harness.RESULTS
TARGET_RATIO = 2.5  # k=16 edges/s over PyG's


def bench_sampling(graph, args) -> dict[str, Any]:
  fanouts, bsz = args.fanouts, args.batch_size
  rng = np.random.default_rng(0)
  train = graph.splits["train"]
  ks = args.ks
  worst = sampling.NeighborSampler(graph.adj, fanouts=fanouts, batch_size=bsz)
  # Padded frontier sizes as the task sets them (`capacities="auto"`): the largest frontier
  # of a trial sample plus 25%. Overflow would be dropped and counted; it is reported.
  caps = sampling.estimate_capacities(worst, rng.choice(train, (4, bsz), replace=False), rng)
  fitted = sampling.NeighborSampler(graph.adj, fanouts=fanouts, batch_size=bsz, capacities=caps)
  product = sampling.NeighborSampler(
    graph.adj, fanouts=fanouts, batch_size=bsz, capacities=caps, materialize=True
  )
  dropped = {}

  def ours(k, sampler):
    def run():
      seeds = rng.choice(train, (k, bsz), replace=False)
      t0 = time.perf_counter()
      blocks = sampler.sample(seeds, rng)
      dt = time.perf_counter() - t0
      dropped[k] = dropped.get(k, 0) + blocks.dropped
      return int(blocks.num_edges.sum()), k, dt

    return run

  methods = {f"recgnn k={k}": ours(k, fitted) for k in ks}
  methods[f"recgnn k={args.product_k}, worst-case padding"] = ours(args.product_k, worst)
  methods[f"recgnn k={args.product_k}, scipy Q@A"] = ours(args.product_k, product)
  peer = sampling_pyg.status()
  if peer is None:
    methods["PyG NeighborLoader"] = sampling_pyg.method(graph, fanouts, bsz, args.pyg_batches)

  out = _round_robin(methods, args.rounds, "sampling")
  for r in out.values():
    r["seeds_per_second"] = r["edges_per_second"] / r["edges_per_batch"] * bsz
  return {
    "methods": out,
    "pyg": peer or "available",
    "frontier_sizes": {"fitted": fitted.sizes, "worst_case": worst.sizes},
    "dropped_neighbours": sum(dropped.values()),
  }


def bench_training(graph_spec, args) -> dict[str, Any]:
  """Seeds/s of recgnn's trainer vs PyG's GraphSAGE on the same graph and sizes."""
  import ml_collections

  from experiments import sage_synthetic
  from recgnn.train import loop

  out: dict[str, Any] = {}
  c = sage_synthetic.get_config()
  c.data.synthetic = ml_collections.ConfigDict(
    {k: v for k, v in vars(graph_spec).items() if k != "split"}
  )
  c.data.synthetic.split = graph_spec.split
  c.model.inputs = "features"
  c.model.hidden = args.hidden
  c.model.dropout = 0.5
  c.sampler.fanouts = tuple(args.train_fanouts)
  c.sampler.batch_size = args.batch_size
  c.sampler.bulk = 16
  c.optimizer.learning_rate = 0.005
  c.train.steps = args.train_steps
  c.train.log_every = args.train_steps // 2  # the second interval excludes compilation
  c.train.final_eval_splits = ()
  with tempfile.TemporaryDirectory() as wd:
    loop.train(c, wd)
    with open(os.path.join(wd, "metrics.jsonl")) as f:
      rows = [json.loads(line) for line in f]
  rates = [r["samples_per_second"] for r in rows if "samples_per_second" in r]
  out["recgnn"] = {"seeds_per_second": rates[-1], "intervals": rates}

  peer = sampling_pyg.status()
  if peer is not None:
    out["PyG"] = f"not run: {peer}"
    return out
  import torch
  import torch.nn.functional as F
  from torch_geometric.nn import GraphSAGE

  graph = synthetic.generate(graph_spec)
  loader = sampling_pyg.endless(
    sampling_pyg.loader(graph, args.train_fanouts, args.batch_size, seed=0, with_features=True)
  )
  torch.manual_seed(0)
  model = GraphSAGE(
    graph.num_features,
    args.hidden,
    num_layers=len(args.train_fanouts),
    out_channels=graph.num_classes,
    dropout=0.5,
  )
  opt = torch.optim.Adam(model.parameters(), lr=0.005)

  def step(batch):
    model.train()
    opt.zero_grad()
    out = model(batch.x, batch.edge_index)[: batch.batch_size]
    loss = F.cross_entropy(out, batch.y[: batch.batch_size])
    loss.backward()
    opt.step()

  for _ in range(3):
    step(next(loader))
  t0 = time.perf_counter()
  n = args.train_steps // 2
  for _ in range(n):
    step(next(loader))
  out["PyG"] = {"seeds_per_second": n * args.batch_size / (time.perf_counter() - t0)}
  return out


# ----------------------------------------------------------------------------- device sampler


def _round_robin(methods: dict, rounds: int, label) -> dict[str, dict]:
  """Each method once to warm up (compilation, first-touch faults), then `rounds` rounds in
  turn; per method the median edges/s. run() -> (edges, batches, seconds)."""
  for run in methods.values():
    run()
  rates: dict[str, list] = {m: [] for m in methods}
  per_batch: dict[str, list] = {m: [] for m in methods}
  for r in range(rounds):
    for name, run in methods.items():
      edges, batches, dt = run()
      rates[name].append(edges / dt)
      per_batch[name].append(edges / batches)
    print(
      f"{label} round {r + 1}/{rounds}: "
      + ", ".join(f"{m} {rates[m][-1] / 1e6:.2f}M" for m in methods),
      flush=True,
    )
  return {
    name: {
      "edges_per_second": statistics.median(v),
      "all_rounds": v,
      "edges_per_batch": statistics.median(per_batch[name]),
    }
    for name, v in rates.items()
  }


def bench_device(graph, args) -> dict[str, Any]:
  """Host vs device samplers, k mini-batches per call, PyG in the same rounds."""
  import jax

  from recgnn.graphs import device_ladies, device_sampling

  fanouts, bsz = args.fanouts, args.batch_size
  rng = np.random.default_rng(0)
  train = graph.splits["train"]
  worst = sampling.NeighborSampler(graph.adj, fanouts=fanouts, batch_size=bsz)
  caps = sampling.estimate_capacities(worst, rng.choice(train, (4, bsz), replace=False), rng)
  kw = dict(fanouts=fanouts, batch_size=bsz, capacities=caps)
  host = sampling.NeighborSampler(graph.adj, **kw)
  t0 = time.perf_counter()
  dev = device_sampling.DeviceNeighborSampler(graph.adj, **kw)
  to_device = time.perf_counter() - t0
  dropped = {"host": 0, "device": 0}
  compile_s = {}

  def host_run(k, sampler):
    def run():
      seeds = rng.choice(train, (k, sampler.batch_size), replace=False)
      t0 = time.perf_counter()
      blocks = sampler.sample(seeds, rng)
      dt = time.perf_counter() - t0
      dropped["host"] += blocks.dropped
      return int(blocks.num_edges.sum()), k, dt

    return run

  def device_run(k, sampler, name):
    key = [jax.random.key(1)]

    def run():
      seeds = rng.choice(train, (k, sampler.batch_size), replace=False).astype(np.int32)
      key[0], sub = jax.random.split(key[0])
      t0 = time.perf_counter()
      out = jax.block_until_ready(sampler.sample_device(seeds, sub))
      dt = time.perf_counter() - t0
      compile_s.setdefault(name, dt)  # the first (warm-up) call compiles
      dropped["device"] += int(out[3])
      return int(out[2].sum()), k, dt

    return run

  methods = {}
  for k in args.device_ks:
    methods[f"node host k={k}"] = host_run(k, host)
    methods[f"node device k={k}"] = device_run(k, dev, f"node device k={k}")
  lk, lsizes = args.ladies_k, args.ladies_sizes
  lhost = ladies.LadiesSampler(graph.adj, layer_sizes=lsizes, batch_size=bsz)
  ldev = device_ladies.DeviceLadiesSampler(graph.adj, layer_sizes=lsizes, batch_size=bsz)
  methods[f"ladies host k={lk}"] = host_run(lk, lhost)
  methods[f"ladies device k={lk}"] = device_run(lk, ldev, f"ladies device k={lk}")
  peer = sampling_pyg.status()
  if peer is None:
    methods["PyG NeighborLoader"] = sampling_pyg.method(graph, fanouts, bsz, args.pyg_batches)
  load_before = os.getloadavg()[0]
  out = _round_robin(methods, args.rounds, "device")
  return {
    "methods": out,
    "pyg": peer or "available",
    "frontier_sizes": host.sizes,
    "ladies": {"k": lk, "layer_sizes": lsizes, "entry_capacities": ldev.entry_capacities},
    "dropped": dropped,
    "first_call_seconds": compile_s,
    "graph_to_device_seconds": to_device,
    "jax_backend": f"{jax.default_backend()} ({jax.devices()[0].device_kind})",
    "load_average": {"before": load_before, "after": os.getloadavg()[0]},
  }


def device_markdown(d: dict, a: dict) -> str:
  m = d["methods"]
  lines = [
    "## Host vs device sampler",
    "",
    f"Device: {d['jax_backend']}. Node-wise fanouts {a['fanouts']}, batch {a['batch_size']}, "
    f"padded frontier sizes {tuple(d['frontier_sizes'])} (capacities='auto'); LADIES layer "
    f"sizes {d['ladies']['layer_sizes']} at k={d['ladies']['k']}. Median of {a['rounds']} "
    f"round-robin rounds after a warm-up call (compilation) each; load average "
    f"{d['load_average']['before']:.1f} before, {d['load_average']['after']:.1f} after. "
    f"Dropped for lack of room: host {d['dropped']['host']}, device {d['dropped']['device']}.",
    "",
    "| sampler | where | k | edges/batch | sampled edges/s | device / host |",
    "|---|---|---:|---:|---:|---:|",
  ]
  for name, v in m.items():
    if name.startswith("PyG"):
      continue
    kind, where, k = name.split()
    host = m.get(f"{kind} host {k}")
    ratio = v["edges_per_second"] / host["edges_per_second"] if host and where == "device" else None
    lines.append(
      f"| {kind} | {where} | {k[2:]} | {v['edges_per_batch']:,.0f} | "
      f"{v['edges_per_second'] / 1e6:.2f}M | {'' if ratio is None else f'{ratio:.2f}x'} |"
    )
  if "PyG NeighborLoader" in m:
    pyg = m["PyG NeighborLoader"]
    lines.append(
      f"| PyG NeighborLoader | host | {a['pyg_batches']} | {pyg['edges_per_batch']:,.0f} | "
      f"{pyg['edges_per_second'] / 1e6:.2f}M | |"
    )
  else:
    lines.append(f"\nPyG could not run: {d['pyg']}")
  lines += [
    "",
    "First (compiling) call, seconds: "
    + ", ".join(f"{k} {v:.1f}" for k, v in d["first_call_seconds"].items())
    + f"; graph to device {d['graph_to_device_seconds']:.2f} s.",
  ]
  return "\n".join(lines) + "\n"


def device_plot(d: dict, path: pathlib.Path) -> None:
  with harness.png(path, figsize=(5.5, 3.6), dpi=120) as (fig, ax):
    for where in ("host", "device"):
      pts = sorted(
        (int(n.split("k=")[1]), v["edges_per_second"] / 1e6)
        for n, v in d["methods"].items()
        if n.startswith(f"node {where} ")
      )
      ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"recgnn {where}")
    if "PyG NeighborLoader" in d["methods"]:
      ax.axhline(d["methods"]["PyG NeighborLoader"]["edges_per_second"] / 1e6, ls="--", c="gray")
      ax.text(1, d["methods"]["PyG NeighborLoader"]["edges_per_second"] / 1e6, " PyG", va="bottom")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("mini-batches per call (k)")
    ax.set_ylabel("sampled edges/s (M)")
    ax.set_title(f"node-wise sampling on {d['jax_backend'].split()[0]}")
    ax.legend()


# ----------------------------------------------------------------------------- split graph


def _sage_config(
  spec, args, *, where: str, split: int, mesh_data: int, seed: int, exchange="reduce_scatter"
):
  import ml_collections

  from experiments import sage_synthetic

  c = sage_synthetic.get_config()
  c.data.synthetic = ml_collections.ConfigDict({k: v for k, v in vars(spec).items()})
  c.model.inputs = "features"
  c.model.hidden = 64
  c.model.dropout = 0.5
  c.sampler.where = where
  c.sampler.split_devices = split
  c.sampler.split_exchange = exchange
  c.sampler.split_capacity = args.split_capacity if exchange == "all_to_all" else 0.0
  c.sampler.fanouts = tuple(args.split_fanouts)
  c.sampler.eval_fanouts = tuple(args.split_fanouts)
  c.sampler.batch_size = 256
  c.sampler.eval_batch_size = 1024
  c.sampler.bulk = 8
  c.optimizer.learning_rate = 0.005
  c.train.steps = args.split_steps
  c.train.log_every = args.split_steps
  c.train.eval_every = 0
  c.train.final_eval_splits = ("test",)
  c.mesh = ml_collections.ConfigDict({"data": mesh_data, "model": 1})
  c.seed = seed
  return c


def _train(c) -> dict:
  from recgnn.train import loop

  t0 = time.perf_counter()
  with tempfile.TemporaryDirectory() as wd:
    r = loop.train(c, wd)
  metrics = r.metrics if hasattr(r, "metrics") else r
  return {
    "test_accuracy": float(metrics["test/accuracy"]),
    "dropped": float(metrics.get("dropped_neighbours", 0.0)),
    "seconds": time.perf_counter() - t0,
  }


def split_graph(args):
  """The synthetic graph of the split sections: (its spec, the graph)."""
  spec = synthetic.SyntheticSpec(
    num_nodes=args.split_nodes,
    num_edges=args.split_edges,
    num_classes=10,
    num_features=args.features,
    # Noisy features: neighbours must carry the signal, so the sampler matters.
    feature_noise=args.split_noise,
    seed=0,
  )
  return spec, synthetic.generate(spec)


def bench_split(args) -> dict[str, Any]:
  import jax

  from recgnn import sharding
  from recgnn.graphs import device_sampling, split_sampling

  if jax.device_count() < 8:
    raise SystemExit(
      f"--sections=split needs 8 devices, found {jax.device_count()}: run it in its own "
      "process (the script sets --xla_force_host_platform_device_count=8 unless XLA_FLAGS "
      "already names a device count)."
    )
  spec, graph = split_graph(args)
  mesh = sharding.make_mesh(1, 8)
  rng = np.random.default_rng(0)
  train = graph.splits["train"]
  fanouts, bsz = args.fanouts, args.batch_size
  worst = sampling.NeighborSampler(graph.adj, fanouts=fanouts, batch_size=bsz)
  caps = sampling.estimate_capacities(
    worst, rng.choice(train, (4, bsz), replace=train.size < 4 * bsz), rng
  )
  kw = dict(fanouts=fanouts, batch_size=bsz, capacities=caps)
  one = device_sampling.DeviceNeighborSampler(graph.adj, **kw)
  split = split_sampling.SplitNeighborSampler(graph.adj, mesh=mesh, **kw)
  a2a = split_sampling.SplitNeighborSampler(graph.adj, mesh=mesh, exchange="all_to_all", **kw)
  fit = split_sampling.SplitNeighborSampler(
    graph.adj, mesh=mesh, exchange="all_to_all", exchange_capacity=args.split_capacity, **kw
  )
  # The split sample is the 1-device sample (same key): checked here on the benchmark graph.
  seeds = split.pad_seeds(rng.choice(train, (8, bsz), replace=train.size < 8 * bsz))
  key = jax.random.key(5)
  a = jax.device_get(one.sample_device(seeds, key))
  check = {}
  for name, sampler in (("reduce_scatter", split), ("all_to_all", a2a), ("all_to_all_fit", fit)):
    b = jax.device_get(sampler.sample_device(seeds, key))
    check[name] = {
      "identical": bool(
        np.array_equal(a[0], b[0])
        and all(np.array_equal(x[f], y[f]) for x, y in zip(a[1], b[1]) for f in ("nbr", "mask"))
      ),
      "dropped": int(b[3]),
    }
  identical = check["reduce_scatter"]["identical"]
  hops = {}
  for k in args.split_ks:
    hs = split.hop_bytes(k)
    rs = split_sampling.replicated_hop_bytes(one, mesh, k)
    xs = a2a.hop_bytes(k)
    fs = fit.hop_bytes(k)
    hops[k] = [
      {
        "split_total_operand_bytes": h["total_operand_bytes"],
        "split_by_op": {op: v["operand_bytes"] for op, v in h["by_op"].items()},
        "all_to_all_total_operand_bytes": x["total_operand_bytes"],
        "all_to_all_fit_total_operand_bytes": y["total_operand_bytes"],
        "replicated_total_operand_bytes": r["total_operand_bytes"],
        "frontier_in": split.sizes[layer],
        "fanout": split.fanouts[layer],
      }
      for layer, (h, r, x, y) in enumerate(zip(hs, rs, xs, fs))
    ]
  out: dict[str, Any] = {
    "graph": graph.describe(),
    "mesh": sharding.describe(mesh),
    "frontier_sizes": split.sizes,
    "identical_to_one_device": identical,
    "exchanges": check,
    "adjacency_bytes": {
      "replicated_per_device": int(graph.adj.indptr.size * 4 + graph.adj.nnz * 4),
      "split_per_device": split.adjacency_bytes_per_device,
    },
    "hops": hops,
  }
  del graph
  runs = []
  for seed in args.split_seeds:
    spec_s = dataclasses.replace(spec, split=tuple(spec.split))
    one_dev = _train(_sage_config(spec_s, args, where="device", split=0, mesh_data=1, seed=seed))
    eight = _train(_sage_config(spec_s, args, where="device", split=8, mesh_data=8, seed=seed))
    eight_a2a = _train(
      _sage_config(
        spec_s, args, where="device", split=8, mesh_data=8, seed=seed, exchange="all_to_all"
      )
    )
    runs.append(
      {"seed": seed, "one_device": one_dev, "split_8": eight, "split_8_all_to_all": eight_a2a}
    )
    print(f"split seed {seed}: 1 device {one_dev}, split over 8 {eight}", flush=True)
  out["training"] = runs
  out["load_average_after"] = os.getloadavg()[0]
  return out


def bench_split_ladies(args) -> dict[str, Any]:
  """LADIES with the graph's rows split over 8 devices: bytes per layer, the sample against
  the 1-device sampler's, and training accuracy split vs 1 device."""
  import jax

  from recgnn import sharding
  from recgnn.graphs import device_ladies, split_sampling

  if jax.device_count() < 8:
    raise SystemExit(f"--sections=split_ladies needs 8 devices, found {jax.device_count()}")
  t_start = time.perf_counter()
  load = os.getloadavg()[0]
  spec, graph = split_graph(args)
  mesh = sharding.make_mesh(1, 8)
  sizes, bsz = list(args.split_ladies_sizes), args.split_ladies_batch
  kw = dict(layer_sizes=sizes, batch_size=bsz)
  one = device_ladies.DeviceLadiesSampler(graph.adj, **kw)
  split = split_sampling.SplitLadiesSampler(graph.adj, mesh=mesh, **kw)
  rng = np.random.default_rng(0)
  train = graph.splits["train"]
  seeds = split.pad_seeds(rng.choice(train, (8, bsz), replace=train.size < 8 * bsz))
  key = jax.random.key(5)
  a = jax.device_get(one.sample_device(seeds, key))
  b = jax.device_get(split.sample_device(seeds, key))
  same = bool(
    np.array_equal(a[0], b[0])
    and all(np.array_equal(x[f], y[f]) for x, y in zip(a[1], b[1]) for f in ("src", "dst"))
  )
  w_rel = max(
    float(np.max(np.abs(x["weight"] - y["weight"]) / np.maximum(np.abs(x["weight"]), 1e-30)))
    for x, y in zip(a[1], b[1])
  )
  hops = {}
  for k in args.split_ks:
    hops[k] = [
      {
        "total_operand_bytes": h["total_operand_bytes"],
        "by_op": {op: v["operand_bytes"] for op, v in h["by_op"].items()},
        "frontier_in": split.sizes[layer],
        "layer_size": split.layer_sizes[layer],
        "entry_capacity": split.entry_capacities[layer],
      }
      for layer, h in enumerate(split.hop_bytes(k))
    ]
  lap = ladies.ladies_matrix(graph.adj)
  out: dict[str, Any] = {
    "graph": graph.describe(),
    "mesh": sharding.describe(mesh),
    "layer_sizes": sizes,
    "batch_size": bsz,
    "frontier_sizes": split.sizes,
    "nodes_and_edges_identical": same,
    "weight_max_relative_difference": w_rel,
    "adjacency_bytes": {
      "replicated_per_device": int(lap.indptr.size * 4 + lap.nnz * 8),
      "split_per_device": split.adjacency_bytes_per_device,
    },
    "hops": hops,
    "load_average_at_start": load,
  }
  del graph
  runs = []
  for seed in args.split_seeds[: args.split_ladies_runs]:
    row = {"seed": seed}
    for name, split_n, data in (("one_device", 0, 1), ("split_8", 8, 8)):
      c = _sage_config(spec, args, where="device", split=split_n, mesh_data=data, seed=seed)
      c.sampler.kind = "ladies"
      c.sampler.layer_sizes = tuple(sizes)
      c.sampler.batch_size = bsz
      c.sampler.eval_batch_size = bsz
      c.train.steps = args.split_ladies_steps
      c.train.log_every = args.split_ladies_steps
      row[name] = _train(c)
    runs.append(row)
    print(f"split ladies seed {seed}: {row}", flush=True)
  out["training"] = runs
  out["training_steps"] = args.split_ladies_steps
  out["load_average_after"] = os.getloadavg()[0]
  out["seconds"] = time.perf_counter() - t_start
  return out


def split_ladies_markdown(s: dict) -> str:
  adj = s["adjacency_bytes"]
  lines = [
    "## LADIES with the graph split over 8 devices: bytes per layer",
    "",
    f"{s['graph']}. Mesh {s['mesh']}; layer sizes {s['layer_sizes']}, batch "
    f"{s['batch_size']}, padded frontiers {tuple(s['frontier_sizes'])}. Ahat per device: "
    f"replicated {_human(adj['replicated_per_device'])}, split "
    f"{_human(adj['split_per_device'])} (its rows, plus the N row lengths every device "
    "keeps). Load average {:.1f} at start, {:.1f} after.".format(
      s["load_average_at_start"], s["load_average_after"]
    ),
    "",
    "Per layer: all-gather the frontier (k/8 batches per device), then each device reads "
    "the entries of P = Q @ Ahat in the rows it owns and a reduce-scatter hands each device "
    "its own batches' entries (column + 1 as int32, value as float32; one owner per entry, "
    "so every sum is exact); the column norms, the weighted draw and the edges are then "
    "computed locally with the 1-device keys. C_l = the 1-device entry capacity (the n_l "
    "longest rows of Ahat). The replicated graph moves nothing.",
    "",
    "Checked on one call of 8 batches against the 1-device sampler, same key: nodes and "
    f"edges identical **{s['nodes_and_edges_identical']}**; edge weights max relative "
    f"difference {s['weight_max_relative_difference']:.2g}"
    + (
      " (bit for bit here; the tests allow an ulp: XLA may fuse the same arithmetic "
      "differently in the two programs, and did on the test graph)."
      if s["weight_max_relative_difference"] == 0
      else " (the same arithmetic, fused differently by XLA in the two programs)."
    ),
    "",
    "| k | layer | frontier n_l | drawn s_l | entries C_l | all-gather | reduce-scatter | "
    "total | replicated |",
    "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  lines += _per_hop(
    s,
    lambda h: (
      f"{h['frontier_in']:,} | {h['layer_size']} | {h['entry_capacity']:,} | "
      f"{_gather_scatter(h['by_op'])} | {_human(h['total_operand_bytes'])} | 0 B"
    ),
  )
  lines += _training_table(
    s,
    f"GraphSAGE (features, hidden 64, LADIES {s['layer_sizes']}, batch {s['batch_size']}, "
    f"{s['training_steps']} steps) on the graph above: device LADIES on 1 device (mesh "
    "1x1) vs the graph split over 8 devices (mesh 8x1).",
    "| seed | 1 device: test acc | split over 8 | difference |",
    lambda r: "",
  )
  return "\n".join(lines) + "\n"


def _per_hop(s: dict, cells) -> list[str]:
  """A table row `| k | hop | cells(h) |` per batch count k and hop h of s["hops"]."""
  hops = [(k, i, h) for k, per_k in s["hops"].items() for i, h in enumerate(per_k)]
  return [f"| {k} | {i} | {cells(h)} |" for k, i, h in hops]


def _gather_scatter(by: dict) -> str:
  """The all-gather and reduce-scatter cells of a hop's bytes by collective."""
  return f"{_human(by.get('all-gather', 0))} | {_human(by.get('reduce-scatter', 0))}"


def _training_table(s: dict, intro: str, header: str, extra) -> list[str]:
  """The test accuracies of s["training"] (1 device vs split over 8, per seed; nothing
  without a training run), `extra(r)` appended to each seed's row for more columns."""
  t = s.get("training") or []
  if not t:
    return []
  lines = ["", intro, "", header, "|" + "---:|" * (header.count("|") - 1)]
  for r in t:
    a1, a8 = r["one_device"]["test_accuracy"], r["split_8"]["test_accuracy"]
    lines.append(f"| {r['seed']} | {a1:.4f} | {a8:.4f} | {a8 - a1:+.4f} |{extra(r)}")
  return lines


def _human(b: float) -> str:
  for unit, size in (("MiB", 2**20), ("KiB", 2**10)):
    if b >= size:
      return f"{b / size:.2f} {unit}"
  return f"{b:.0f} B"


def split_markdown(s: dict, a: dict) -> str:
  adj = s["adjacency_bytes"]
  lines = [
    "## Graph split over 8 devices: bytes per hop",
    "",
    f"{s['graph']}. Mesh {s['mesh']}; fanouts {a['fanouts']}, batch {a['batch_size']}, "
    f"padded frontiers {tuple(s['frontier_sizes'])}. Adjacency per device: replicated "
    f"{_human(adj['replicated_per_device'])}, split "
    f"{_human(adj['split_per_device'])}. Split sample identical to the 1-device "
    f"sample for the same key: **{s['identical_to_one_device']}**.",
    "",
    "Bytes each device sends per hop (collective operands in the compiled HLO, "
    "recgnn.comms). reduce_scatter: all-gather the frontier (k/8 batches per device), "
    "reduce-scatter the candidates (k x n_l x f_l int32). all_to_all: each device asks the "
    "owners for its own batches' rows and gets their neighbours back (two all-to-alls), "
    f"with room for every row (exact) or {a['split_capacity']}x an even share s + 4 sqrt(s) "
    "per device pair (fit). The replicated graph samples each device's k/8 batches locally.",
    "",
    "Checked on one call of 8 batches, against the 1-device sample: "
    + "; ".join(
      f"{n}: identical {v['identical']}, dropped {v['dropped']}"
      for n, v in s.get("exchanges", {}).items()
    )
    + ".",
    "",
    "| k | hop | frontier n_l | fanout | reduce_scatter: all-gather | reduce-scatter | "
    "total | all_to_all exact | all_to_all fit | replicated |",
    "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  lines += _per_hop(
    s,
    lambda h: (
      f"{h['frontier_in']:,} | {h['fanout']} | {_gather_scatter(h['split_by_op'])} | "
      f"{_human(h['split_total_operand_bytes'])} | "
      f"{_human(h.get('all_to_all_total_operand_bytes', 0))} | "
      f"{_human(h.get('all_to_all_fit_total_operand_bytes', 0))} | "
      f"{_human(h['replicated_total_operand_bytes'])}"
    ),
  )

  def all_to_all(r):
    x = r.get("split_8_all_to_all", {})
    acc, dropped = x.get("test_accuracy", float("nan")), x.get("dropped", float("nan"))
    return f" {acc:.4f} (dropped {dropped:.0f}) |"

  lines += _training_table(
    s,
    f"GraphSAGE (features, hidden 64, fanouts {a['split_fanouts']}, batch 256, "
    f"{a['split_steps']} steps) on the graph above (features with noise std "
    f"{a['split_noise']}): device sampler on 1 device (mesh 1x1) vs the graph split over "
    "8 devices (mesh 8x1).",
    "| seed | 1 device: test acc | split over 8 (reduce_scatter) | difference | "
    "split over 8 (all_to_all fit) |",
    all_to_all,
  )
  t = s.get("training") or []
  if t:
    m1 = statistics.mean(r["one_device"]["test_accuracy"] for r in t)
    m8 = statistics.mean(r["split_8"]["test_accuracy"] for r in t)
    verdict = "met" if abs(m8 - m1) <= 0.01 else "NOT met"
    lines.append(f"\nMean {m1:.4f} vs {m8:.4f}: within 0.01 **{verdict}** ({m8 - m1:+.4f}).")
  return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- Cora


def bench_cora(args) -> dict[str, Any]:
  """experiments/sage_cora.py with sampler.where host vs device, seeds alternating."""
  from experiments import sage_cora

  runs = []
  for seed in args.cora_seeds:
    row = {"seed": seed}
    for where in ("host", "device"):
      c = sage_cora.get_config()
      c.sampler.where = where
      c.seed = seed
      c.train.eval_every = 0
      c.train.final_eval_splits = ("test",)
      row[where] = _train(c)
    runs.append(row)
    print(f"cora seed {seed}: {row}", flush=True)
  host = [r["host"]["test_accuracy"] for r in runs]
  dev = [r["device"]["test_accuracy"] for r in runs]
  return {
    "runs": runs,
    "host_mean": statistics.mean(host),
    "device_mean": statistics.mean(dev),
    "host_std": statistics.pstdev(host),
    "device_std": statistics.pstdev(dev),
    "load_average_after": os.getloadavg()[0],
  }


def cora_markdown(c: dict) -> str:
  diff = c["device_mean"] - c["host_mean"]
  verdict = "met" if abs(diff) <= 0.01 else "NOT met"
  lines = [
    "## GraphSAGE on Cora: host vs device sampler",
    "",
    "experiments/sage_cora.py (fanouts [25, 10], batch 140, 200 steps; eval with every "
    "neighbour), `--config.sampler.where=host|device`, test accuracy.",
    "",
    "| seed | host | device |",
    "|---:|---:|---:|",
  ]
  for r in c["runs"]:
    lines.append(
      f"| {r['seed']} | {r['host']['test_accuracy']:.4f} | {r['device']['test_accuracy']:.4f} |"
    )
  lines += [
    f"| mean +- std | {c['host_mean']:.4f} +- {c['host_std']:.4f} | "
    f"{c['device_mean']:.4f} +- {c['device_std']:.4f} |",
    "",
    f"Device - host: {diff:+.4f}; within 0.01: **{verdict}**.",
  ]
  return "\n".join(lines) + "\n"


def markdown(p: dict[str, Any]) -> str:
  a = p["args"]
  s = p["sampling"]["methods"]
  lines = [
    "# Bulk matrix-based sampling vs PyG NeighborLoader",
    "",
    f"Synthetic power-law graph: {p['graph']}. Fanouts {a['fanouts']}, batch "
    f"{a['batch_size']}, seeds from the training split. Sampled edges/s = edges drawn "
    f"(padding excluded) per second; median over {a['rounds']} round-robin rounds after one "
    f"warm-up call each. {p['machine']}.",
    "",
    f"Padded frontier sizes {tuple(p['sampling']['frontier_sizes']['fitted'])} (the task's "
    f"`capacities='auto'`: largest of a trial sample + 25%; neighbours dropped for lack of "
    f"room in all timed calls: {p['sampling']['dropped_neighbours']}); worst case, which "
    f"never drops: {tuple(p['sampling']['frontier_sizes']['worst_case'])}.",
    "",
    "| sampler | mini-batches per call | edges/batch | sampled edges/s | seeds/s |",
    "|---|---:|---:|---:|---:|",
  ]
  for name, m in s.items():
    k = name.split("k=")[1].split()[0].rstrip(",") if "k=" in name else str(a["pyg_batches"])
    lines.append(
      f"| {name} | {k} | {m['edges_per_batch']:,.0f} | {m['edges_per_second'] / 1e6:.2f}M | "
      f"{m['seeds_per_second']:,.0f} |"
    )
  if "PyG NeighborLoader" in s:
    pyg = s["PyG NeighborLoader"]["edges_per_second"]
    lines += ["", "recgnn / PyG, sampled edges/s:"]
    for name, m in s.items():
      if name.startswith("recgnn"):
        lines.append(f"- {name}: **{m['edges_per_second'] / pyg:.2f}x**")
    ratio = p["ratio_k16"]
    verdict = "met" if ratio >= TARGET_RATIO else "NOT met"
    lines.append(f"\nTarget k=16 >= {TARGET_RATIO}x PyG: **{verdict}** ({ratio:.2f}x).")
  else:
    lines.append(f"\nPyG NeighborLoader could not run here: {p['sampling']['pyg']}")
  lines += [
    "",
    "PyG samples only the nodes new at each hop; recgnn re-samples every frontier node at "
    "each layer (layer-wise blocks), so it draws more edges per batch for the same fanouts.",
  ]
  t = p.get("training")
  if t:
    lines += [
      "",
      f"## End-to-end training, 2-layer GraphSAGE-mean, fanouts {a['train_fanouts']}, "
      f"hidden {a['hidden']}, {p['graph_features']} features, batch {a['batch_size']}",
      "",
      "| system | seeds/s |",
      "|---|---:|",
      f"| recgnn trainer, bulk k=16 | {t['recgnn']['seeds_per_second']:,.0f} |",
    ]
    if isinstance(t.get("PyG"), dict):
      lines.append(f"| PyG GraphSAGE + NeighborLoader | {t['PyG']['seeds_per_second']:,.0f} |")
      r = t["recgnn"]["seeds_per_second"] / t["PyG"]["seeds_per_second"]
      lines.append(f"\nrecgnn / PyG: **{r:.2f}x**")
    else:
      lines.append(f"\nPyG: {t.get('PyG')}")
  return "\n".join(lines) + "\n"


def payload_machine(load: float, retained=None) -> str:
  kept = "" if retained is None else f", malloc keeps freed buffers: {retained}"
  return (
    f"{harness.cpu_model()}, {os.cpu_count()} CPUs, load average "
    f"{load:.1f} at start{kept}, "
    f"{datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}"
  )


def main():
  if "--sections=data_parallel" in sys.argv[1:]:
    # Its own module and flags (before jax is imported: it sets the simulated devices).
    import sampling_data_parallel  # benchmarks/sampling_data_parallel.py

    return sampling_data_parallel.main([a for a in sys.argv[1:] if a != "--sections=data_parallel"])
  p = harness.flags.parser(__doc__)
  p.add_argument("--nodes", type=int, default=1_000_000)
  p.add_argument("--edges", type=int, default=10_000_000, help="adjacency entries")
  p.add_argument("--fanouts", type=int, nargs="+", default=[15, 10, 5])
  p.add_argument("--batch_size", type=int, default=1024)
  p.add_argument("--ks", type=int, nargs="+", default=[1, 4, 16, 64])
  p.add_argument("--product_k", type=int, default=16)
  p.add_argument("--pyg_batches", type=int, default=4, help="PyG batches per timed unit")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--train_fanouts", type=int, nargs="+", default=[15, 10])
  p.add_argument("--hidden", type=int, default=128)
  p.add_argument("--features", type=int, default=64)
  p.add_argument("--train_steps", type=int, default=60)
  p.add_argument("--skip_training", action="store_true")
  p.add_argument("--quick", action="store_true")
  p.add_argument("--name", default="sampling")
  p.add_argument(
    "--sections", default="sampling,training", help="comma list of sampling, training, "
    "device, split, cora"
  )  # fmt: skip
  p.add_argument("--device_ks", type=int, nargs="+", default=[1, 4, 16, 64])
  p.add_argument("--ladies_k", type=int, default=4)
  p.add_argument("--ladies_sizes", type=int, nargs="+", default=[512, 512])
  p.add_argument("--split_nodes", type=int, default=20_000)
  p.add_argument("--split_edges", type=int, default=200_000)
  p.add_argument("--split_ks", type=int, nargs="+", default=[8, 64])
  p.add_argument("--split_fanouts", type=int, nargs="+", default=[10, 5])
  p.add_argument("--split_steps", type=int, default=200)
  p.add_argument("--split_noise", type=float, default=4.0, help="feature noise std")
  p.add_argument(
    "--split_capacity", type=float, default=1.25, help="all_to_all: x an even share per pair"
  )
  p.add_argument("--split_seeds", type=int, nargs="+", default=[0, 1])
  p.add_argument("--split_ladies_sizes", type=int, nargs="+", default=[512, 512])
  p.add_argument("--split_ladies_batch", type=int, default=256)
  p.add_argument("--split_ladies_steps", type=int, default=200)
  p.add_argument("--split_ladies_runs", type=int, default=1, help="seeds of --split_seeds")
  p.add_argument("--merge", action="store_true", help="add these sections to an existing NAME.json")
  p.add_argument("--cora_seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
  args = p.parse_args()
  sections = set(args.sections.split(","))
  known = {"sampling", "training", "device", "split", "split_ladies", "cora"}
  unknown = sections - known
  if unknown:
    raise SystemExit(f"unknown --sections {sorted(unknown)}; use {', '.join(sorted(known))}")
  if args.skip_training:
    sections.discard("training")
  if sections & {"split", "split_ladies"}:
    harness.simulated_devices(8)  # the split graph needs 8 devices (simulated on CPU)
  if args.quick:
    args.nodes, args.edges, args.rounds, args.train_steps = 200_000, 2_000_000, 2, 20
    args.ks = [1, 16]
    args.device_ks = [1, 16]

  load = os.getloadavg()[0]
  retained = hostmem.keep_freed_memory()
  spec = synthetic.SyntheticSpec(num_nodes=args.nodes, num_edges=args.edges, num_classes=10, seed=0)
  graph = None
  if sections & {"sampling", "device"}:
    t0 = time.perf_counter()
    graph = synthetic.generate(spec)
    print(graph.describe(), f"({time.perf_counter() - t0:.1f}s)", flush=True)
  payload: dict[str, Any] = {
    "args": {**vars(args), "sections": sorted(sections)},
    "graph": graph.describe() if graph is not None else None,
    "graph_features": args.features,
    "machine": payload_machine(load, retained),
  }
  if "sampling" in sections:
    payload["sampling"] = bench_sampling(graph, args)
    methods = payload["sampling"]["methods"]
    if "PyG NeighborLoader" in methods and f"recgnn k={16}" in methods:
      payload["ratio_k16"] = (
        methods["recgnn k=16"]["edges_per_second"]
        / methods["PyG NeighborLoader"]["edges_per_second"]
      )
  if "device" in sections:
    payload["device"] = bench_device(graph, args)
  del graph
  if "split" in sections:
    payload["split"] = bench_split(args)
  if "split_ladies" in sections:
    payload["split_ladies"] = bench_split_ladies(args)
  if "cora" in sections:
    payload["cora"] = bench_cora(args)
  if "training" in sections:
    train_spec = synthetic.SyntheticSpec(
      num_nodes=args.nodes,
      num_edges=args.edges,
      num_classes=10,
      num_features=args.features,
      seed=0,
    )
    payload["training"] = bench_training(train_spec, args)
  RESULTS.mkdir(parents=True, exist_ok=True)
  previous = RESULTS / f"{args.name}.json"
  if args.merge and previous.exists():
    # The sections run now replace theirs; the others (and their args, machine line) stay.
    old = json.loads(previous.read_text())
    added = {k: v for k, v in payload.items() if k in known}
    payload = {**old, **added}
    payload.setdefault("merged", []).append(
      {"sections": sorted(added), "args": vars(args), "machine": payload_machine(load)}
    )
  parts = []
  if "sampling" in payload:
    parts.append(markdown(payload))
  else:
    present = ", ".join(k for k in sorted(known) if k in payload)
    parts.append(f"# Bulk sampling: {present}\n\n{payload['machine']}.\n")
  if "device" in payload:
    parts.append(device_markdown(payload["device"], payload["args"]))
    device_plot(payload["device"], RESULTS / f"{args.name}.png")
  if "split" in payload:
    parts.append(split_markdown(payload["split"], payload["args"]))
  if "split_ladies" in payload:
    parts.append(split_ladies_markdown(payload["split_ladies"]))
  if "cora" in payload:
    parts.append(cora_markdown(payload["cora"]))
  harness.write_results(args.name, payload, "\n".join(parts), RESULTS)


if __name__ == "__main__":
  main()
