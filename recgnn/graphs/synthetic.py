"""Synthetic power-law graphs with planted communities as labels (degree-corrected SBM).

Each node i has a community c_i (its label) and a weight theta_i from a Pareto law, so that
degrees follow a power law. Each edge picks its first endpoint with probability
proportional to theta; its second endpoint is, with probability `homophily`, a node of the
same community (again proportional to theta within it), else any node. This is Chung-Lu with
community-biased endpoints, i.e. a degree-corrected stochastic block model, and it is fully
vectorized: 1M nodes / 10M adjacency entries take a few seconds on one core.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from recgnn.graphs import store


@dataclasses.dataclass(frozen=True, kw_only=True)
class SyntheticSpec:
  """A synthetic graph.

  Attributes:
    num_nodes: nodes.
    num_edges: target adjacency entries (both directions counted; the undirected graph has
      about half as many edges; duplicates and self-loops are dropped, so a few % fewer).
    num_classes: planted communities, the labels (sizes uniform at random).
    homophily: probability an edge stays within its community (1/num_classes = no signal).
    power_law_exponent: of the degree distribution (Pareto tail index + 1), > 2.
    max_weight_ratio: caps theta at this multiple of its minimum, which caps the largest
      degree (a hub the size of the graph makes every mini-batch touch it).
    num_features: 0 for none; else float32 features = community centroid + Gaussian noise.
    feature_noise: noise std relative to the centroids' unit norm.
    split: train/valid/test fractions of the nodes.
    seed: everything is deterministic given it.
  """

  num_nodes: int = 10_000
  num_edges: int = 100_000
  num_classes: int = 10
  homophily: float = 0.8
  power_law_exponent: float = 2.5
  max_weight_ratio: float = 1000.0
  num_features: int = 0
  feature_noise: float = 1.0
  split: tuple[float, float, float] = (0.1, 0.05, 0.1)
  seed: int = 0

  def __post_init__(self):
    if self.num_nodes < 2 or self.num_edges < 1 or self.num_classes < 1:
      raise ValueError(f"need num_nodes >= 2, num_edges >= 1, num_classes >= 1; got {self}")
    if not 0.0 <= self.homophily <= 1.0:
      raise ValueError(f"homophily must be in [0, 1], got {self.homophily}")
    if self.power_law_exponent <= 2.0:
      raise ValueError(
        f"power_law_exponent must be > 2 (finite mean degree), got {self.power_law_exponent}"
      )


def generate(spec: SyntheticSpec) -> store.Graph:
  """Draw the graph described by `spec`."""
  rng = np.random.default_rng(spec.seed)
  n, c = spec.num_nodes, spec.num_classes
  labels = rng.integers(0, c, n).astype(np.int32)
  # Pareto(alpha) tail with alpha = exponent - 1 gives P(deg = k) ~ k^-exponent.
  theta = (1.0 - rng.random(n)) ** (-1.0 / (spec.power_law_exponent - 1.0))
  theta = np.minimum(theta, spec.max_weight_ratio)

  # Nodes sorted by community, with the cumulative weight in that order: drawing "a node of
  # community k proportional to theta" is a searchsorted into k's slice of the cumsum.
  order = np.argsort(labels, kind="stable")
  cum = np.cumsum(theta[order])
  total = cum[-1]
  bounds = np.searchsorted(labels[order], np.arange(c + 1))  # community k: order[b[k]:b[k+1]]
  mass_before = np.concatenate([[0.0], cum])[bounds]  # cumulative weight before each community

  # Each undirected draw gives two adjacency entries.
  m = spec.num_edges // 2
  # Sorted queries make searchsorted cache-friendly (several x faster); sorting iid
  # uniforms does not change the multiset of endpoints, and the other draws are independent.
  src = order[np.minimum(np.searchsorted(cum, np.sort(rng.random(m)) * total, side="right"), n - 1)]
  inside = rng.random(m) < spec.homophily
  k = labels[src]
  lo, hi = mass_before[k], mass_before[k + 1]
  target = np.where(inside, lo + rng.random(m) * (hi - lo), rng.random(m) * total)
  by_target = np.argsort(target)
  dst = np.empty(m, np.int64)
  dst[by_target] = order[np.minimum(np.searchsorted(cum, target[by_target], side="right"), n - 1)]

  adj = store.csr_from_edges(src, dst, n, undirected=True)
  features = None
  if spec.num_features:
    centroids = rng.standard_normal((c, spec.num_features)).astype(np.float32)
    centroids /= np.linalg.norm(centroids, axis=1, keepdims=True)
    noise = rng.standard_normal((n, spec.num_features), dtype=np.float32)
    noise *= np.float32(spec.feature_noise / np.sqrt(spec.num_features))
    features = centroids[labels] + noise
  return store.Graph(
    name=f"synthetic-{n}",
    adj=adj,
    labels=labels,
    num_classes=c,
    splits=store.random_split(n, spec.split, spec.seed + 1),
    features=features,
  )
