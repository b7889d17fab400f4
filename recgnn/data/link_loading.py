"""The link split a link task's config.data names.

data.source      ogbl: an OGB linkproppred folder (data.path, data.split; its own edges and
                 negatives, `recgnn.data.ogbl`); any node-graph source (planetoid, synthetic,
                 ogb, tfds: `graph_loading.load_raw_graph`) split at random
                 (`link_split.random_link_split`: data.val, data.test, data.split_seed)
data.features    true (default): the graph's node features, if it has any; false: drop them
                 (train on learned node embeddings alone)
"""

from __future__ import annotations

import dataclasses

import ml_collections

from recgnn.data import graph_loading, link_split

SOURCES = ("ogbl", "planetoid", "synthetic", "ogb", "tfds")


def load_link_split(data: ml_collections.ConfigDict) -> link_split.LinkSplit:
  if data.source not in SOURCES:
    raise ValueError(f"Unknown data.source {data.source!r}; available: {', '.join(SOURCES)}")
  if data.source == "ogbl":
    from recgnn.data import ogbl

    if not data.get("path", None):
      raise ValueError(
        "data.source=ogbl needs --config.data.path=<unpacked OGB linkproppred dataset folder>"
      )
    split = ogbl.load(data.path, split=data.get("split", None) or None)
  else:
    graph = graph_loading.load_raw_graph(data)
    split = link_split.random_link_split(
      graph.name,
      graph.adj,
      graph.features,
      val=float(data.get("val", 0.05)),
      test=float(data.get("test", 0.1)),
      seed=int(data.get("split_seed", 0)),
    )
  if not data.get("features", True) and split.features is not None:
    split = dataclasses.replace(split, features=None)
  return split
