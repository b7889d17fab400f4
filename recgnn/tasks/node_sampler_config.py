"""The samplers a node task's config asks for (config.sampler; the keys are documented in
node_classification's docstring): frontier capacities (worst | auto | sizes per layer, auto
estimated from a trial sample), host / device / split-graph placement, steps per call, and
whether the node ids are split over the mesh (embeddings.split_ids). Used by the
node-classification task and its data-parallel sampling (node_data_parallel)."""

from __future__ import annotations

import jax
import ml_collections
import numpy as np
import scipy.sparse as sp

from recgnn import planner, sharding
from recgnn.graphs import samplers, sampling

SAMPLERS = ("node", "ladies")


def parse_capacities(value, option: str):
  """sampler.`option` -> None (worst case), "auto", or a tuple of frontier sizes (the config
  holds them as text, "100,150" or "(100, 150)": the option's type is the default's str)."""
  if value is None or value in ("worst", "auto"):
    return None if value == "worst" else value
  text = value if isinstance(value, str) else ",".join(map(str, value))
  try:
    sizes = tuple(int(x) for x in text.strip("()[] ").split(",") if x.strip())
  except ValueError:
    sizes = ()
  if not sizes or min(sizes) <= 0:
    raise ValueError(
      f"sampler.{option}={value!r}: use auto, worst or frontier sizes > 0 per layer, e.g. '100,150'"
    )
  return sizes


def steps_per_call(s) -> int:
  """sampler.steps_per_call: an integer >= 1 (refused otherwise)."""
  k = s.get("steps_per_call", 1)
  if isinstance(k, bool) or not isinstance(k, int) or k < 1:
    raise ValueError(f"sampler.steps_per_call={k!r}: use an integer >= 1")
  return k


def split_ids(config) -> bool:
  """embeddings.split_ids: true | false | auto (default: true when a plan rule names a
  backend that declares it needs batch-split ids, `Capabilities.needs_split_ids`: sharded).
  Split ids put collectives in every step (each device's share fetched, then gathered for
  the subgraph); XLA:CPU with simulated devices hung at such a collective in some trainer
  runs here, so they are not the default where replicated ids serve (dense, tt, offload,
  hot_cold)."""
  emb = config.get("embeddings", None)
  mode = str(emb.get("split_ids", "auto") if emb is not None else "auto").lower()
  if mode in ("true", "1"):
    return True
  if mode in ("false", "0"):
    return False
  if mode != "auto":
    raise ValueError(f"Unknown embeddings.split_ids {mode!r}; available: auto, true, false")
  plan = emb.get("plan", ()) if emb is not None else ()
  return any(planner.capabilities_of(str(rule[1])).needs_split_ids for rule in plan)


def make_sampler(
  s: ml_collections.ConfigDict,
  adj: sp.csr_matrix,
  mesh: jax.sharding.Mesh,
  seed: int,
  fanouts,
  batch_size: int,
  capacities,
  trial_nodes: np.ndarray,
  option: str,
  where: str | None = None,
  split_mesh: jax.sharding.Mesh | None = None,
):
  """The sampler of `fanouts` and `capacities` (the value of sampler.`option`: worst | auto
  | sizes per layer), at `where` (None: sampler.where). split_mesh: the mesh whose devices
  the graph's rows are split over (default: with sampler.split_devices = D > 1, a 1 x D mesh
  of the trainer's first D devices). s: config.sampler; adj: the graph's CSR; mesh: the
  trainer's; seed: the trial sample's (capacities=auto)."""
  capacities = parse_capacities(capacities, option)
  where = where or s.get("where", "host") or "host"
  split = int(s.get("split_devices", 0) or 0)
  if split > 1 and where != "device":
    raise ValueError("sampler.split_devices needs --config.sampler.where=device")
  # The sampler's own 1 x split mesh over the first `split` devices of the trainer's: it
  # splits the adjacency's rows, not the batch, so its shape is the sampler's choice.
  mesh = sharding.make_mesh(1, split, devices=mesh.devices.flat) if split > 1 else None
  mesh = split_mesh or mesh

  def make(caps=None):
    return samplers.make(
      adj,
      s.kind,
      where,
      batch_size=batch_size,
      fanouts=fanouts,
      layer_sizes=s.get("layer_sizes", None),
      capacities=caps,
      mesh=mesh,
      exchange=s.get("split_exchange", "reduce_scatter") or "reduce_scatter",
      exchange_capacity=s.get("split_capacity", None) or None,
    )

  if s.kind == "ladies":
    # LADIES' frontiers are the seeds plus each layer's drawn nodes: their padded sizes
    # are exact (no estimate to make, nothing dropped), so worst and auto are the same and
    # sizes of one's own would be ignored.
    if capacities not in (None, "auto"):
      raise ValueError(
        f"sampler.{option}={capacities!r}: sampler.kind=ladies pads its frontiers to the "
        "seeds plus sampler.layer_sizes exactly; set the sizes there and leave "
        f"sampler.{option} at worst or auto"
      )
    return make()
  sampler = make()
  if capacities is None:
    return sampler
  if capacities == "auto":
    rng = np.random.default_rng([seed, 7])
    # Four batches of distinct seeds (repeats would shrink the frontiers measured).
    few = len(trial_nodes) < batch_size
    trial = np.stack([rng.choice(trial_nodes, batch_size, replace=few) for _ in range(4)])
    capacities = sampling.estimate_capacities(sampler, trial, rng)
  return make(list(capacities))
