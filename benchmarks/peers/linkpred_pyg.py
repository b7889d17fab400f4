"""The PyG contestant of benchmarks/linkpred.py, run in the peers venv (Python 3.11, torch,
PyG: benchmarks/peers/install.sh) as its own process: GraphSAGE link prediction on a split
the benchmark wrote (.npz), the same encoder (2 SAGE-mean layers, ReLU between), decoder
(dot), negatives (one uniform pair per positive: LinkNeighborLoader's binary negatives),
fanouts, batch, optimizer and steps as recgnn's run; eval over the full graph (train edges
for valid, train + valid for test, as PyG's RandomLinkSplit). Prints one JSON line:
{"test_roc_auc", "test_hits@20", "edges_per_second", ...}.

  .peers-venv/bin/python benchmarks/peers/linkpred_pyg.py SPLIT.npz --steps 200 --seed 0
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def _auc(pos: np.ndarray, neg: np.ndarray) -> float:
  scores = np.concatenate([pos, neg])
  order = scores.argsort(kind="stable")
  ranks = np.empty(scores.size)
  ranks[order] = np.arange(1, scores.size + 1)
  # Ties: average ranks.
  _, inv, counts = np.unique(scores, return_inverse=True, return_counts=True)
  sums = np.bincount(inv, weights=ranks)
  ranks = (sums / counts)[inv]
  return float((ranks[: pos.size].sum() - pos.size * (pos.size + 1) / 2) / (pos.size * neg.size))


def _hits(pos: np.ndarray, neg: np.ndarray, k: int) -> float:
  if neg.size < k:
    return 1.0
  return float(np.mean(pos > np.sort(neg)[-k]))


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("split")
  p.add_argument("--steps", type=int, default=200)
  p.add_argument("--batch", type=int, default=512)
  p.add_argument("--hidden", type=int, default=128)
  p.add_argument("--out", type=int, default=64)
  p.add_argument("--fanouts", default="25,10")
  p.add_argument("--lr", type=float, default=0.01)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--threads", type=int, default=0)
  a = p.parse_args()

  import torch
  from torch_geometric.data import Data
  from torch_geometric.loader import LinkNeighborLoader
  from torch_geometric.nn import SAGEConv

  if a.threads:
    torch.set_num_threads(a.threads)
  torch.manual_seed(a.seed)
  s = np.load(a.split)
  x = torch.from_numpy(s["x"])

  def both(e):
    e = torch.from_numpy(e.astype(np.int64)).t()
    return torch.cat([e, e.flip(0)], 1)

  train = torch.from_numpy(s["train"].astype(np.int64)).t()
  data = Data(x=x, edge_index=both(s["train"]), num_nodes=x.shape[0])

  class Net(torch.nn.Module):
    def __init__(self):
      super().__init__()
      self.c1 = SAGEConv(x.shape[1], a.hidden)
      self.c2 = SAGEConv(a.hidden, a.out)

    def forward(self, h, ei):
      return self.c2(self.c1(h, ei).relu(), ei)

  model = Net()
  opt = torch.optim.Adam(model.parameters(), lr=a.lr)
  loader = LinkNeighborLoader(
    data, num_neighbors=[int(f) for f in a.fanouts.split(",")], edge_label_index=train,
    neg_sampling_ratio=1.0, batch_size=a.batch, shuffle=True,
  )  # fmt: skip
  bce = torch.nn.functional.binary_cross_entropy_with_logits
  step, timed_from, t0, edges = 0, 5, None, 0
  while step < a.steps:
    for b in loader:
      if step == timed_from:
        t0, edges = time.perf_counter(), 0
      model.train()
      opt.zero_grad()
      h = model(b.x, b.edge_index)
      src, dst = b.edge_label_index
      score = (h[src] * h[dst]).sum(-1)
      pos = b.edge_label > 0.5
      loss = bce(score[pos], torch.ones(int(pos.sum()))) + bce(
        score[~pos], torch.zeros(int((~pos).sum()))
      )
      loss.backward()
      opt.step()
      edges += int(pos.sum())
      step += 1
      if step >= a.steps:
        break
  seconds = time.perf_counter() - t0

  model.eval()
  out = {"steps": step, "edges_per_second": edges / seconds, "train_seconds": seconds}
  with torch.no_grad():
    for split, msg in (("valid", s["train"]), ("test", np.concatenate([s["train"], s["valid"]]))):
      h = model(x, both(msg)).numpy()
      pos, neg = (np.sum(h[e[:, 0]] * h[e[:, 1]], -1) for e in (s[split], s[f"{split}_neg"]))
      out[f"{split}_roc_auc"] = _auc(pos, neg)
      out[f"{split}_hits@20"] = _hits(pos, neg, 20)
  print(json.dumps(out))


if __name__ == "__main__":
  main()
