"""Bulk matrix-based neighbour sampling vs PyG's NeighborLoader, and GraphSAGE training.

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

  python benchmarks/sampling.py            # ~5 minutes on 2 busy cores
  python benchmarks/sampling.py --quick    # 200k nodes, fewer rounds
Writes benchmarks/results/sampling.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np

# Runnable as `python benchmarks/sampling.py` from a checkout without installing recgnn.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from recgnn import hostmem  # noqa: E402
from recgnn.graphs import sampling, synthetic  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
TARGET_RATIO = 2.5  # k=16 edges/s over PyG's


def pyg_status() -> str | None:
  """None when PyG's NeighborLoader can run here, else why not."""
  try:
    import torch  # noqa: F401
    import torch_geometric  # noqa: F401
    import torch_sparse  # noqa: F401
  except Exception as e:  # noqa: BLE001 (any import failure means: no peer)
    return f"{type(e).__name__}: {e}"
  return None


def pyg_loader(graph, fanouts, batch_size, seed, with_features=False):
  import torch
  from torch_geometric.data import Data
  from torch_geometric.loader import NeighborLoader

  coo = graph.adj.tocoo()
  # Row v of adj aggregates from column u: PyG's message direction is u -> v.
  edge_index = torch.from_numpy(np.stack([coo.col, coo.row]).astype(np.int64))
  data = Data(edge_index=edge_index, num_nodes=graph.num_nodes)
  if with_features:
    data.x = torch.from_numpy(graph.features)
    data.y = torch.from_numpy(graph.labels.astype(np.int64))
  torch.manual_seed(seed)
  return NeighborLoader(
    data,
    num_neighbors=list(fanouts),
    batch_size=batch_size,
    input_nodes=torch.from_numpy(graph.splits["train"]),
    shuffle=True,
  )


def _endless(loader):
  while True:
    yield from loader


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
  peer = pyg_status()
  if peer is None:
    it = _endless(pyg_loader(graph, fanouts, bsz, seed=0))

    def pyg():
      t0 = time.perf_counter()
      edges = 0
      for _ in range(args.pyg_batches):
        edges += int(next(it).edge_index.shape[1])
      return edges, args.pyg_batches, time.perf_counter() - t0

    methods["PyG NeighborLoader"] = pyg

  for run in methods.values():  # warm-up: first-touch page faults, imports, thread pools
    run()
  rates: dict[str, list] = {m: [] for m in methods}
  per_batch: dict[str, list] = {m: [] for m in methods}
  for r in range(args.rounds):
    for name, run in methods.items():
      edges, batches, dt = run()
      rates[name].append(edges / dt)
      per_batch[name].append(edges / batches)
    print(
      f"round {r + 1}/{args.rounds}: "
      + ", ".join(f"{m} {rates[m][-1] / 1e6:.2f}M" for m in methods),
      flush=True,
    )
  out = {
    name: {
      "edges_per_second": statistics.median(v),
      "all_rounds": v,
      "edges_per_batch": statistics.median(per_batch[name]),
      "seeds_per_second": statistics.median(v) / statistics.median(per_batch[name]) * bsz,
    }
    for name, v in rates.items()
  }
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

  peer = pyg_status()
  if peer is not None:
    out["PyG"] = f"not run: {peer}"
    return out
  import torch
  import torch.nn.functional as F
  from torch_geometric.nn import GraphSAGE

  graph = synthetic.generate(graph_spec)
  loader = _endless(
    pyg_loader(graph, args.train_fanouts, args.batch_size, seed=0, with_features=True)
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


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
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
  args = p.parse_args()
  if args.quick:
    args.nodes, args.edges, args.rounds, args.train_steps = 200_000, 2_000_000, 2, 20
    args.ks = [1, 16]

  load = os.getloadavg()[0]
  retained = hostmem.keep_freed_memory()
  spec = synthetic.SyntheticSpec(num_nodes=args.nodes, num_edges=args.edges, num_classes=10, seed=0)
  t0 = time.perf_counter()
  graph = synthetic.generate(spec)
  print(graph.describe(), f"({time.perf_counter() - t0:.1f}s)", flush=True)
  payload: dict[str, Any] = {
    "args": vars(args),
    "graph": graph.describe(),
    "graph_features": args.features,
    "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load "
    f"average {load:.1f} at start, malloc keeps freed buffers: {retained}, "
    f"{datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
  }
  payload["sampling"] = bench_sampling(graph, args)
  methods = payload["sampling"]["methods"]
  if "PyG NeighborLoader" in methods and f"recgnn k={16}" in methods:
    payload["ratio_k16"] = (
      methods["recgnn k=16"]["edges_per_second"] / methods["PyG NeighborLoader"]["edges_per_second"]
    )
  del graph
  if not args.skip_training:
    train_spec = synthetic.SyntheticSpec(
      num_nodes=args.nodes,
      num_edges=args.edges,
      num_classes=10,
      num_features=args.features,
      seed=0,
    )
    payload["training"] = bench_training(train_spec, args)
  RESULTS.mkdir(parents=True, exist_ok=True)
  (RESULTS / f"{args.name}.json").write_text(json.dumps(payload, indent=2) + "\n")
  md = markdown(payload)
  (RESULTS / f"{args.name}.md").write_text(md)
  print(md)


if __name__ == "__main__":
  main()
