"""`Feeder`: a prepared batch packed for the step (`inputs.Packer`, one per signature) and
put on the devices; a call's k batches stacked into one transfer.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from recgnn import planner, sharding
from recgnn.train import inputs
from recgnn.train.train_state import device_batch


class Feeder:
  """Packs (prepared, batch) for the step: the specs of every leaf, checked and cached.

  Specs, checks and the packed layout depend only on the tree's structure and its leaves'
  shapes and dtypes (a group's `prepared_spec` reads keys, never values), so they are
  computed once per such signature (`inputs.Packer`, kept here) and each batch costs a
  flatten, the signature and one copy per leaf. Every batch of one signature carries the same
  `inputs.PackLayout` object: jit's static-argument lookup and the trainer's traffic reader
  then cost a hash already computed and an identity check."""

  #: Packers kept (distinct signatures: a train and an eval batch shape, bucketed list
  #: lengths); the cache restarts past this rather than grow without bound.
  MAX_PACKERS = 512

  def __init__(self, plan: planner.Plan, batch_spec=None):
    """The layout is the plan's (`plan.layout`, given to every backend at construction):
    split_batch says whether the embedding ids are batch-major, process_local whether
    batches are this process's slice, for its devices only. batch_spec(batch): the
    PartitionSpec of every other batch leaf (`Task.batch_spec`), else all by split_batch."""
    self.plan, self.batch_spec = plan, batch_spec
    self.shard_batch = plan.layout.split_batch
    self.local = plan.layout.process_local
    self._packers: dict[tuple, inputs.Packer] = {}

  def specs(self, prepared, batch):
    p = {k: self.plan.groups[k].prepared_spec(v) for k, v in prepared.items()}
    if self.batch_spec is not None:
      return p, self.batch_spec(batch)
    return p, inputs.batch_spec(batch, self.shard_batch)

  def __call__(self, prepared, batch, what: str = "batch"):
    """-> (device buffers, layout): one transfer, split over the mesh."""
    buffers, layout = self.pack(prepared, batch, what)
    return self.put(buffers), layout

  def pack(self, prepared, batch, what: str = "batch", alloc: inputs.Alloc | None = None):
    """-> (host buffers, layout): everything but the transfer (host work only, so the
    trainer runs it on its input thread or worker). alloc: where the buffers are made
    (`inputs.Packer`)."""
    tree = (prepared, device_batch(batch))
    leaves, treedef = jax.tree.flatten(tree)
    leaves = [x if type(x) is np.ndarray else np.asarray(x) for x in leaves]
    key = (treedef, inputs.leaf_signature(leaves))
    packer = self._packers.get(key)
    if packer is None:  # a new signature: specs and checks once
      if len(self._packers) >= self.MAX_PACKERS:
        self._packers.clear()
      packer = self._packers[key] = self._packer(tree, treedef, leaves, what)
    return packer(leaves, alloc), packer.layout

  def _packer(self, tree, treedef, leaves, what: str) -> inputs.Packer:
    specs = self.specs(*tree)
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    mesh = self.plan.mesh
    if not self.local:
      inputs.check_split(tree, specs, mesh, what)
      return inputs.Packer(treedef, leaves, spec_leaves, mesh.size)
    # A process-local slice: a leaf every device needs whole would differ between
    # processes, so every leaf must be batch-major (the groups promised it).
    flat = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, P))[0]
    whole = [jax.tree_util.keystr(k) for k, s in flat if s != sharding.BATCH_SPEC]
    if whole:
      raise ValueError(
        f"process-local {what}: leaves {whole[:6]} are not batch-major; they would differ "
        "between processes. Use train.process_input=global."
      )
    for x in leaves:
      sharding.check_batch(np.shape(x)[0] * jax.process_count(), mesh, what)
    return inputs.Packer(treedef, leaves, spec_leaves, mesh.size // jax.process_count())

  def pack_call(
    self, batches: list, alloc: inputs.Alloc | None = None
  ) -> tuple[tuple[list, list], inputs.PackLayout]:
    """The k (prepared, batch) of one call's train batches, each prepared alone in stream
    order -> `stack`'s output: every group's `stack_call` makes their prepared leaves one
    shape (a host tier's lists padded to the call's widest), then each is packed."""
    prepared = inputs.stack_call(self.plan, [p for p, _ in batches])
    packed = [self.pack(p, b, "train batch") for p, (_, b) in zip(prepared, batches)]
    return self.stack(packed, alloc)

  def stack(
    self, packed: list, alloc: inputs.Alloc | None = None
  ) -> tuple[tuple[list, list], inputs.PackLayout]:
    """k `pack` outputs of one call's train batches -> ((buffers [k, devices, n] per dtype,
    no host leaves), their one layout): the input of a `jit_packed(stacked=k)` step, one
    transfer for the k batches. alloc: where the buffers are made (`inputs.Packer`)."""
    layout = packed[0][1]
    if any(p[1] is not layout for p in packed):
      raise ValueError(
        "the train batches of one call differ in structure or shapes; k steps per call "
        "(train.steps_per_call) needs batches of one shape (drop the remainder)"
      )
    if packed[0][0][1]:  # (no backend of this project prepares such leaves)
      raise ValueError(
        f"k steps per call cannot stack {len(packed[0][0][1])} pinned-host-memory leaves "
        "(a backend's prepared leaves with sharding.HOST_SPEC): use train.steps_per_call=1"
      )
    first = packed[0][0][0]
    shapes = [(b.dtype.str, (len(packed), *b.shape)) for b in first]
    bufs = alloc(shapes) if alloc is not None else [np.empty(s, d) for d, s in shapes]
    for i, out in enumerate(bufs):
      np.stack([p[0][0][i] for p in packed], out=out)
    return (bufs, []), layout

  def put(self, buffers):
    """The host -> device transfer of `pack`'s (or `stack`'s) buffers."""
    return inputs.put(buffers, self.plan.mesh, local=self.local)
