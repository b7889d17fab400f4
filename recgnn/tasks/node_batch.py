"""The node tasks' mini-batch: one sampled subgraph as the model's batch, built on the host
(`node_classification`, the trainer's input thread) or on the device (`node_data_parallel`,
inside the data-parallel step), so both build it one way."""

from __future__ import annotations

import numpy as np

from recgnn.embeddings import OptimizerSpec, TableSpec
from recgnn.train.task import Batch

#: The node-id table's name (model.inputs embeddings | both): batch["ids"][TABLE].
TABLE = "node"


def make_batch(
  inputs: str, nodes, layers, seeds, features, labels, *, id_multiple: int = 1, xp=np
) -> Batch:
  """One sampled mini-batch as the model's batch, on the host (xp = numpy: the trainer's
  input thread) or on the device (xp = jax.numpy, inside the data-parallel step: the samples
  never leave the device).

  Args:
    inputs: model.inputs (features | embeddings | both).
    nodes: int32[n_L] the deepest frontier (-1 = padding); layers: its Blocks layers.
    seeds: int[n_0] (-1 = padding); features float32[N, F] (None without features);
    labels int[N] (-1 = unlabelled).
    id_multiple: the node-id bags are padded to a multiple of it (split ids, see the module).
  Returns:
    {"ids": {TABLE: int32[n_L', 1]} or {}, "x": float32[n_L, F], "frontier": int32[n_L],
    "nbr{l}" / "mask{l}" (or "src{l}" / "dst{l}" / "weight{l}"), "labels": int32[n_0],
    "node": int32[n_0], "weight": float32[n_0]}.
  """
  # "ids" always present (empty without tables): the trainer's input thread reads it.
  batch: Batch = {"ids": {}}
  valid = nodes >= 0
  if inputs != "embeddings":
    batch["x"] = xp.where(valid[:, None], features[xp.where(valid, nodes, 0)], 0.0)
  if inputs != "features":
    pad = -(-nodes.shape[0] // id_multiple) * id_multiple - nodes.shape[0]
    batch["ids"] = {TABLE: xp.pad(nodes.astype(xp.int32), (0, pad), constant_values=-1)[:, None]}
  batch["frontier"] = nodes.astype(xp.int32)
  for depth, layer in enumerate(layers):
    for key, v in layer.items():
      batch[f"{key}{depth}"] = v
  lab = xp.where(seeds >= 0, labels[xp.maximum(seeds, 0)], -1)
  batch["labels"] = xp.maximum(lab, 0).astype(xp.int32)
  batch["node"] = seeds.astype(xp.int32)  # the seeds' ids (-1: padding), for predictions
  batch["weight"] = (lab >= 0).astype(xp.float32)
  return batch


#: model.inputs: the node features, the learned node table's rows, or both.
INPUTS = ("features", "embeddings", "both")


def check_inputs(inputs: str, graph_name: str, features) -> str:
  """model.inputs checked against INPUTS and the graph (`features` None: it has none)."""
  if inputs not in INPUTS:
    raise ValueError(f"Unknown model.inputs {inputs!r}; available: {', '.join(INPUTS)}")
  if inputs != "embeddings" and features is None:
    raise ValueError(
      f"Graph {graph_name} has no node features; set --config.model.inputs=embeddings"
    )
  return inputs


def node_tables(inputs: str, num_nodes: int, embeddings) -> list[TableSpec]:
  """The learned node table (TABLE: one row per node, config.embeddings' dim, optimizer and
  initializer, default normal), or none when the model reads features only."""
  if inputs == "features":
    return []
  return [
    TableSpec(
      name=TABLE,
      num_rows=num_nodes,
      dim=int(embeddings.dim),
      optimizer=OptimizerSpec(**dict(embeddings.optimizer)),
      initializer=embeddings.get("initializer", "normal"),
      pooling="sum",
    )
  ]


def model_inputs(inputs: str, batch: Batch, embeddings, xp=np):
  """The model's input rows float32[n_L, F (+ D)]: the batch's features x, the node table's
  pooled rows (those past the frontier are the mesh split's padding, dropped), or both
  concatenated, as model.inputs says."""
  parts = []
  if inputs != "embeddings":
    parts.append(batch["x"])
  if inputs != "features":
    parts.append(embeddings[TABLE][: batch["frontier"].shape[0]])
  return parts[0] if len(parts) == 1 else xp.concatenate(parts, axis=-1)
