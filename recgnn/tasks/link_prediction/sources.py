"""Where the link-prediction task's knowledge graph comes from (data.source: files | tfds |
planted) and the encoder's message graph built from its training triples."""

from __future__ import annotations

import os

import ml_collections
import numpy as np

from recgnn.data import kg as kg_lib
from recgnn.tasks.link_prediction.options import check_choice

SOURCES = ("files", "tfds", "planted")


def load_kg(d: ml_collections.ConfigDict) -> kg_lib.KG:
  """The KG of config.data (source, path, reciprocal, max_bad_lines, tfds_dir, planted)."""
  source = d.get("source", "files")
  reciprocal = bool(d.get("reciprocal", True))
  if source == "files":
    return kg_lib.load(
      d.get("path", "") or None,
      reciprocal=reciprocal,
      max_bad_lines=int(d.get("max_bad_lines", 100)),
    )
  if source == "tfds":
    # The fb15k237 array_record build (of data.path's triples, or the bundled ones), built
    # once under data.tfds_dir; the same ids and names as the files.
    from recgnn.data import tfds_builders

    data_dir = os.path.expanduser(d.get("tfds_dir", "") or "~/.cache/recgnn/tfds")
    builder = tfds_builders.build("fb15k237", data_dir, manual_dir=d.get("path", "") or None)
    return tfds_builders.load_kg(builder, reciprocal=reciprocal)
  if source == "planted":
    # A synthetic KG with planted communities (small partition halos; kg_lib.planted).
    return kg_lib.planted(**dict(d.get("planted", {})), reciprocal=reciprocal)
  raise ValueError(f"Unknown data.source {source!r}; available: {', '.join(SOURCES)}")


def message_graph(kg: kg_lib.KG, norm: str = "degree") -> dict[str, np.ndarray]:
  """The encoder's edges int32[E, 3] (src, rel, dst): every training triple and its reverse
  (under the reciprocal relation id), with whole-graph norms f32[E] 1 / c_dst, c_dst =
  in-degree of dst over all relations (model.rgcn.norm = degree), or c_{dst, rel} per
  relation (= relation, Schlichtkrull et al.'s choice; on FB15k-237 a hub then sums one mean
  per relation type, up to hundreds, and DistMult scores blow up)."""
  check_choice("model.rgcn.norm", norm, ("degree", "relation"))
  t = kg.splits["train"]
  R = kg.num_base_relations
  edges = np.concatenate([t, np.stack([t[:, 2], t[:, 1] + R, t[:, 0]], 1)]).astype(np.int32)
  key = edges[:, 2].astype(np.int64)
  if norm == "relation":
    key = key * (2 * R) + edges[:, 1]
  _, inv, cnt = np.unique(key, return_inverse=True, return_counts=True)
  return {"edges": edges, "norm": (1.0 / cnt[inv]).astype(np.float32)}
