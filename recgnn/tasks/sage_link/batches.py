"""The link task's batches, built on the host: a batch's node pairs (its positive edges and
their negatives), the sampled neighbourhoods of their endpoints, and the exclusion of the
batch's positive edges from its own message passing.

A batch is node classification's sampled subgraph (`node_batch.make_batch`: ids, x,
frontier, nbr{l} / mask{l} or src{l} / dst{l} / weight{l}) whose seeds (frontier 0) are the
distinct endpoints of its pairs, plus the pairs:
  pair_src, pair_dst  int32[P]   positions of the endpoints in frontier 0
  label               float32[P] 1 positive, 0 negative
  weight              float32[P] 0 = padding
and in eval batches
  kind                int32[P]   0 positive, 1 fixed negative (ROC-AUC, Hits@K), 2 one of a
                                 positive's own negatives (MRR)
  query               int32[P]   kinds 0 and 2: the positive's index in the split; else -1
"""

from __future__ import annotations

import numpy as np

from recgnn.data.link_split import edge_keys
from recgnn.tasks.node_batch import make_batch

NEGATIVES = ("uniform", "shared", "degree")
POSITIVE, FIXED_NEGATIVE, QUERY_NEGATIVE = 0, 1, 2


def negatives_per_batch(kind: str, batch_size: int, num: int) -> int:
  """Negative pairs of a train batch of `batch_size` positives: uniform / degree: num per
  positive; shared: num nodes shared by the batch, each paired with every positive's source."""
  if kind not in NEGATIVES:
    raise ValueError(f"Unknown negatives.kind {kind!r}; available: {', '.join(NEGATIVES)}")
  if num < 1:
    raise ValueError(f"negatives.num={num}: use an integer >= 1")
  return batch_size * num


def draw_negatives(
  kind: str, pos: np.ndarray, num: int, degree_cdf: np.ndarray, rng: np.random.Generator
) -> np.ndarray:
  """int64[B * num, 2] negative pairs for positives int64[B, 2] (-1 rows: padding; their
  negatives are padding too, marked -1).

  uniform: both endpoints uniform over the nodes (PyG's negative_sampling, OGB's randint;
    not checked against the edges: a sparse graph's random pair is an edge with odds E / N^2).
  degree: the positive's source and a target drawn with probability ~ degree^0.75
    (degree_cdf: float64[N] cumulative, ending at 1).
  shared: `num` targets uniform, drawn once for the batch; every positive's source is paired
    with each (the scores of a [B, num] block).
  """
  n, b = degree_cdf.shape[0], pos.shape[0]
  if kind == "uniform":
    out = rng.integers(0, n, (b * num, 2))
  elif kind == "degree":
    dst = np.minimum(np.searchsorted(degree_cdf, rng.random(b * num), side="right"), n - 1)
    out = np.stack([np.repeat(pos[:, 0], num), dst], axis=1)
  else:
    shared = rng.integers(0, n, num)
    out = np.stack([np.repeat(pos[:, 0], num), np.tile(shared, b)], axis=1)
  pad = np.repeat(pos[:, 0] < 0, num)
  out[pad] = -1
  return out.astype(np.int64)


def degree_cdf(adj, power: float = 0.75) -> np.ndarray:
  """float64[N]: cumulative probabilities of drawing each node ~ degree^power (+1 so a node
  without train edges can still be drawn)."""
  w = (np.diff(adj.indptr) + 1.0) ** power
  c = np.cumsum(w)
  return c / c[-1]


def endpoints(pairs: np.ndarray, size: int) -> np.ndarray:
  """int64[size]: the distinct nodes of pairs int[P, 2] (-1 ignored), ascending, -1 padded."""
  nodes = np.unique(pairs[pairs >= 0])
  if nodes.size > size:
    raise ValueError(f"{nodes.size} distinct endpoints for {size} seed slots")
  return np.pad(nodes, (0, size - nodes.size), constant_values=-1)


def exclude_edges(nodes: np.ndarray, layers, banned: np.ndarray, num_nodes: int):
  """The sampled layers without the edges whose undirected key (`edge_keys`) is in `banned`:
  a node-wise layer's mask cleared there, a LADIES layer's weight zeroed (its other weights
  are left as drawn).

  nodes: int32[n_L] the deepest frontier; layers: one mini-batch's layers (no leading k).
  """
  out = []
  for layer in layers:
    src, dst = layer_edges(nodes, layer)
    hit = np.isin(np.minimum(src, dst) * num_nodes + np.maximum(src, dst), banned)
    layer = dict(layer)
    if "mask" in layer:
      layer["mask"] = layer["mask"] & ~hit
    else:
      layer["weight"] = np.where(hit, 0, layer["weight"]).astype(layer["weight"].dtype)
    out.append(layer)
  return tuple(out)


def layer_edges(nodes: np.ndarray, layer):
  """(src, dst) int64 arrays of a layer's slots, global ids (-1 where a slot's node is
  padding), shaped as the layer's mask or weight: dst aggregates from src."""
  ids = np.asarray(nodes, np.int64)
  if "nbr" in layer:
    n_dst = layer["nbr"].shape[0]
    src = ids[layer["nbr"]]
    dst = np.broadcast_to(ids[:n_dst, None], src.shape)
    return src, dst
  return ids[layer["src"]], ids[layer["dst"]]


def message_keys(nodes: np.ndarray, layers, num_nodes: int) -> np.ndarray:
  """int64[]: the undirected keys of every edge a batch's message passing uses (a node-wise
  slot whose mask is set, a LADIES edge of non-zero weight), over all layers."""
  keys = []
  for layer in layers:
    src, dst = layer_edges(nodes, layer)
    used = layer["mask"] if "mask" in layer else layer["weight"] != 0
    used = used & (src >= 0) & (dst >= 0)
    keys.append((np.minimum(src, dst) * num_nodes + np.maximum(src, dst))[used])
  return np.unique(np.concatenate(keys)) if keys else np.zeros(0, np.int64)


def pair_batch(
  inputs: str,
  nodes: np.ndarray,
  layers,
  seeds: np.ndarray,
  pairs: np.ndarray,
  label: np.ndarray,
  features,
  *,
  id_multiple: int,
) -> dict:
  """One batch (module docstring) from a sampled subgraph whose frontier 0 is `seeds`
  (`endpoints`' output) and pairs int64[P, 2] (-1 rows: padding) with labels float32[P]."""
  # make_batch reads node labels at the seeds: a link batch has none (zeros, no copy).
  no_labels = np.broadcast_to(np.zeros(1, np.int32), (int(max(seeds.max(initial=0), 0)) + 1,))
  batch = make_batch(inputs, nodes, layers, seeds, features, no_labels, id_multiple=id_multiple)
  for key in ("labels", "node", "weight"):
    del batch[key]
  valid = pairs[:, 0] >= 0
  n_valid = int(np.count_nonzero(seeds >= 0))
  pos = np.searchsorted(seeds[:n_valid], np.maximum(pairs, 0))
  pos = np.where(valid[:, None], pos, 0).astype(np.int32)
  batch["pair_src"], batch["pair_dst"] = pos[:, 0], pos[:, 1]
  batch["label"] = label.astype(np.float32)
  batch["weight"] = valid.astype(np.float32)
  return batch


def split_pairs(pos: np.ndarray, neg: np.ndarray, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
  """A step's (positives int64[B, 2], negatives int64[M, 2]) in n parts of B / n positives
  and their M / n negatives (negatives are drawn positive-major: part j's are its own
  positives')."""
  b, m = len(pos) // n, len(neg) // n
  return [(pos[j * b : (j + 1) * b], neg[j * m : (j + 1) * m]) for j in range(n)]


def stack_parts(parts: list[dict]) -> dict:
  """n part batches (same shapes) as one data-parallel batch: every leaf stacked on a
  leading axis n, the node ids concatenated (int32[n * n_L, 1]: part j's rows j-th), and
  "part" int32[n] marking it."""
  batch = {k: np.stack([p[k] for p in parts]) for k in parts[0] if k != "ids"}
  batch["ids"] = {t: np.concatenate([p["ids"][t] for p in parts]) for t in parts[0]["ids"]}
  batch["part"] = np.arange(len(parts), dtype=np.int32)
  return batch


def banned_keys(pos: np.ndarray, num_nodes: int) -> np.ndarray:
  """int64[]: the keys of a batch's positive edges (a pair and its reverse share one)."""
  return np.unique(edge_keys(pos[pos[:, 0] >= 0], num_nodes))
