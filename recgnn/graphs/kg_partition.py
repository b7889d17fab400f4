"""Self-sufficient partitions of a knowledge graph (Sheikh et al., 2022).

Entities are split into P parts (METIS through `pymetis` on the undirected entity graph,
edge weights = triple multiplicities; `random` as the documented fallback when pymetis is not
installed). Partition p then holds:

  train:  the training triples whose head is in part p (with reciprocal relations every fact
          appears once from each end, so it is trained from both parts it touches)
  core:   the entities whose encoding must be exact: part p and the tails of its triples.
          Negatives are drawn from the core ("negatives from the partition"), so a training
          step on p scores only core rows.
  halo:   the k-hop in-neighbourhood of the core (k = encoder layers) minus the core
  edges:  every message-passing edge whose destination is within k - 1 hops of the core.
          A k-layer encoder over (core + halo, edges) gives every core row exactly its
          whole-graph encoding: the partition is self-sufficient, training it reads no entity
          outside core + halo (tests/test_kg.py checks both).

`nodes` lists core first, then halo; edges and triples are re-indexed into `nodes`.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import scipy.sparse as sp

METHODS = ("metis", "random")


@dataclasses.dataclass
class Partition:
  """One self-sufficient partition; local ids index `nodes`.

  Attributes:
    nodes: int32[n] global entity ids, the core first.
    num_core: core rows are nodes[:num_core].
    triples: int32[t, 3] training triples (local head, relation, local tail).
    edges: int32[e, 3] message-passing edges (local src, relation, local dst).
    edge_index: int64[e] position of each edge in the whole graph's edge list.
  """

  nodes: np.ndarray
  num_core: int
  triples: np.ndarray
  edges: np.ndarray
  edge_index: np.ndarray

  @property
  def num_halo(self) -> int:
    return len(self.nodes) - self.num_core


def assign(
  num_entities: int, triples: np.ndarray, num_parts: int, method: str = "metis", seed: int = 0
) -> np.ndarray:
  """int32[num_entities] part of each entity."""
  if method not in METHODS:
    raise ValueError(f"Unknown partition method {method!r}; available: {', '.join(METHODS)}")
  if num_parts < 1:
    raise ValueError(f"num_parts must be >= 1, got {num_parts}")
  if num_parts == 1:
    return np.zeros(num_entities, np.int32)
  if method == "metis":
    try:
      import pymetis
    except ImportError:
      raise ImportError(
        "partition method 'metis' needs pymetis (pip install pymetis); or set "
        "--config.partition.method=random"
      ) from None
    h, t = triples[:, 0].astype(np.int64), triples[:, 2].astype(np.int64)
    keep = h != t
    a = sp.coo_matrix(
      (np.ones(keep.sum(), np.int64), (h[keep], t[keep])), shape=(num_entities, num_entities)
    )
    a = (a + a.T).tocsr()
    a.sum_duplicates()
    opts = pymetis.Options(seed=seed)
    adjacency = pymetis.CSRAdjacency(a.indptr.astype(np.int64), a.indices.astype(np.int64))
    _, parts = pymetis.part_graph(
      num_parts, adjacency, eweights=a.data.astype(np.int64), options=opts
    )
    return np.asarray(parts, np.int32)
  rng = np.random.default_rng(seed)
  return (rng.permutation(num_entities) % num_parts).astype(np.int32)


def _in_neighbours(nodes_mask: np.ndarray, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
  """Mask of the nodes with an edge into `nodes_mask`, plus the nodes themselves."""
  out = nodes_mask.copy()
  out[src[nodes_mask[dst]]] = True
  return out


def build(
  num_entities: int,
  train: np.ndarray,
  edges: np.ndarray,
  parts: np.ndarray,
  hops: int,
) -> list[Partition]:
  """Self-sufficient partitions.

  Args:
    train: int32[n, 3] training triples (head, relation, tail), reciprocals included.
    edges: int32[e, 3] the encoder's message-passing edges (src, relation, dst).
    parts: int32[num_entities] from `assign`.
    hops: encoder layers (the halo depth).
  """
  src, dst = edges[:, 0], edges[:, 2]
  out = []
  for p in range(int(parts.max()) + 1):
    mine = parts[train[:, 0]] == p
    tp = train[mine]
    core = np.zeros(num_entities, bool)
    core[parts == p] = True
    core[tp[:, 2]] = True
    # need[k]: rows whose layer-(hops - k) output must be exact.
    need = core
    inner = core  # destinations whose in-edges the encoder reads (within hops - 1 of core)
    for k in range(hops):
      if k < hops - 1:
        inner = _in_neighbours(inner, src, dst)
      need = _in_neighbours(need, src, dst)
    halo = need & ~core
    core_ids = np.flatnonzero(core)
    nodes = np.concatenate([core_ids, np.flatnonzero(halo)]).astype(np.int32)
    local = np.full(num_entities, -1, np.int64)
    local[nodes] = np.arange(nodes.size)
    eidx = np.flatnonzero(inner[dst]) if hops else np.zeros(0, np.int64)
    e = edges[eidx]
    le = np.stack([local[e[:, 0]], e[:, 1], local[e[:, 2]]], 1).astype(np.int32)
    lt = np.stack([local[tp[:, 0]], tp[:, 1], local[tp[:, 2]]], 1).astype(np.int32)
    assert (le >= 0).all() and (lt >= 0).all()
    out.append(Partition(nodes, int(core_ids.size), lt, le, eidx.astype(np.int64)))
  return out


def describe(partitions: list[Partition], num_entities: int, num_edges: int) -> str:
  lines = [f"{len(partitions)} self-sufficient partitions (core + halo of {num_entities:,}):"]
  for i, p in enumerate(partitions):
    lines.append(
      f"  part {i}: core {p.num_core:,}, halo {p.num_halo:,} "
      f"({len(p.nodes) / num_entities:.0%} of entities), encoder edges {len(p.edges):,} "
      f"({len(p.edges) / max(num_edges, 1):.0%}), training triples {len(p.triples):,}"
    )
  return "\n".join(lines)
