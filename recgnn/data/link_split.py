"""Link-prediction splits of a homogeneous graph: which edges train, which are held out, and
the fixed negative pairs every evaluation scores against.

`random_link_split` follows PyG's `RandomLinkSplit` defaults (undirected, 5 % validation and
10 % test edges, one negative pair per held-out edge, fixed), seeded with numpy so a split is
a function of the graph and the seed alone. OGB's linkproppred splits come with their own
edges and negatives (`recgnn.data.ogbl`).

Edges are undirected pairs int64[E, 2] with u < v; the message-passing graph of a split
holds both directions of its edges (`LinkSplit.message_adj`).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import scipy.sparse as sp

from recgnn.graphs import store

#: What the test split's message passing sees besides the train edges: PyG's RandomLinkSplit
#: adds the validation edges (test_data.edge_index = train + val); OGB's examples use train
#: edges only for ddi.
TEST_MESSAGES = ("train_valid", "train")


def edge_keys(edges: np.ndarray, num_nodes: int) -> np.ndarray:
  """int64[E]: one key per undirected pair, min(u, v) * N + max(u, v) (a pair and its reverse
  share it)."""
  e = np.asarray(edges, np.int64).reshape(-1, 2)
  return np.minimum(e[:, 0], e[:, 1]) * num_nodes + np.maximum(e[:, 0], e[:, 1])


def undirected_edges(adj: sp.csr_matrix) -> np.ndarray:
  """int64[E, 2]: the pairs u < v of a (symmetric or not) adjacency, each once, sorted."""
  coo = adj.tocoo()
  u, v = coo.row.astype(np.int64), coo.col.astype(np.int64)
  keep = u != v
  n = adj.shape[0]
  keys = np.unique(np.minimum(u, v)[keep] * n + np.maximum(u, v)[keep])
  return np.stack([keys // n, keys % n], axis=1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinkSplit:
  """A homogeneous graph split for link prediction.

  Attributes:
    name: for logs.
    num_nodes: N.
    train, valid, test: int64[E_s, 2] positive pairs of each split (train: the message graph
      and the training targets; valid / test: never in a training step's message graph).
    valid_neg, test_neg: int64[M_s, 2] fixed negative pairs (ROC-AUC and Hits@K score the
      split's positives against them).
    test_target_neg: optional int64[E_test, K] per-positive negative targets (OGB citation2's
      `target_node_neg`): MRR ranks each test positive among its own K; None: drawn seeded.
    valid_target_neg: the same for valid.
    features: float32[N, F] or None (feature-less graphs train learned node embeddings).
    test_messages: one of TEST_MESSAGES.
  """

  name: str
  num_nodes: int
  train: np.ndarray
  valid: np.ndarray
  test: np.ndarray
  valid_neg: np.ndarray
  test_neg: np.ndarray
  features: np.ndarray | None = None
  valid_target_neg: np.ndarray | None = None
  test_target_neg: np.ndarray | None = None
  test_messages: str = "train_valid"

  def __post_init__(self):
    n = self.num_nodes
    for field in ("train", "valid", "test", "valid_neg", "test_neg"):
      e = getattr(self, field)
      if e.ndim != 2 or e.shape[1] != 2:
        raise ValueError(f"LinkSplit {self.name!r}: {field} must be int[E, 2], got {e.shape}")
      if e.size and (e.min() < 0 or e.max() >= n):
        raise ValueError(f"LinkSplit {self.name!r}: {field} has node ids outside [0, {n})")
    if self.features is not None and self.features.shape[0] != n:
      raise ValueError(f"LinkSplit {self.name!r}: features have {self.features.shape[0]} rows")
    if self.test_messages not in TEST_MESSAGES:
      raise ValueError(
        f"Unknown test_messages {self.test_messages!r}; available: {', '.join(TEST_MESSAGES)}"
      )

  def positives(self, split: str) -> np.ndarray:
    return {"train": self.train, "valid": self.valid, "test": self.test}[split]

  def negatives(self, split: str) -> np.ndarray:
    return {"valid": self.valid_neg, "test": self.test_neg}[split]

  def target_negatives(self, split: str) -> np.ndarray | None:
    return {"valid": self.valid_target_neg, "test": self.test_target_neg}[split]

  def message_edges(self, split: str) -> np.ndarray:
    """int64[E, 2]: the edges message passing sees when `split` is scored (train and valid:
    the train edges; test: train (+ valid under test_messages=train_valid))."""
    if split == "test" and self.test_messages == "train_valid":
      return np.concatenate([self.train, self.valid])
    return self.train

  def message_adj(self, split: str) -> sp.csr_matrix:
    """CSR [N, N], both directions of `message_edges(split)`."""
    e = self.message_edges(split)
    return store.csr_from_edges(e[:, 0], e[:, 1], self.num_nodes, undirected=True)

  def describe(self) -> str:
    return (
      f"{self.name}: {self.num_nodes:,} nodes, {len(self.train):,} train / "
      f"{len(self.valid):,} valid / {len(self.test):,} test edges, negatives "
      f"{len(self.valid_neg):,} / {len(self.test_neg):,}, "
      f"{'no features' if self.features is None else f'{self.features.shape[1]} features'}"
    )


def sample_negative_pairs(
  num_nodes: int, count: int, forbidden: np.ndarray, rng: np.random.Generator
) -> np.ndarray:
  """int64[count, 2]: distinct pairs u < v, no self-loop, none in `forbidden` (int64 keys of
  `edge_keys`), uniform over the allowed pairs (PyG's `negative_sampling`, by rejection)."""
  forbidden = np.unique(forbidden)
  free = num_nodes * (num_nodes - 1) // 2 - forbidden.size
  if count > free:
    raise ValueError(f"{count} negative pairs asked of a graph with {free} non-edges")
  got = np.zeros(0, np.int64)
  while got.size < count:
    want = 2 * (count - got.size) + 64
    u, v = rng.integers(0, num_nodes, (2, want))
    keys = np.minimum(u, v) * num_nodes + np.maximum(u, v)
    keys = keys[(u != v) & ~np.isin(keys, forbidden)]
    # First occurrences in draw order, so the result does not depend on how many were drawn.
    merged = np.concatenate([got, keys])
    _, first = np.unique(merged, return_index=True)
    got = merged[np.sort(first)]
  got = got[:count]
  return np.stack([got // num_nodes, got % num_nodes], axis=1)


def random_link_split(
  name: str,
  adj: sp.csr_matrix,
  features: np.ndarray | None,
  *,
  val: float = 0.05,
  test: float = 0.1,
  seed: int = 0,
) -> LinkSplit:
  """PyG's RandomLinkSplit(num_val=val, num_test=test, is_undirected=True) in numpy: the
  undirected edges permuted by `seed`, the first int(val E) validation, the next int(test E)
  test, the rest train; as many fixed negative pairs as positives in valid and test, drawn
  from the non-edges of the whole graph."""
  if val < 0 or test < 0 or val + test >= 1:
    raise ValueError(f"link split fractions val={val}, test={test}: need >= 0 and sum < 1")
  edges = undirected_edges(adj)
  n = adj.shape[0]
  rng = np.random.default_rng([seed, 62])
  perm = rng.permutation(len(edges))
  n_val, n_test = int(val * len(edges)), int(test * len(edges))
  v, t, tr = np.split(edges[perm], [n_val, n_val + n_test])
  neg = sample_negative_pairs(n, n_val + n_test, edge_keys(edges, n), rng)
  return LinkSplit(
    name=name,
    num_nodes=n,
    train=tr,
    valid=v,
    test=t,
    valid_neg=neg[:n_val],
    test_neg=neg[n_val:],
    features=features,
  )
