"""Orbax checkpoints of the whole TrainState (dense params, optimizer, every table's state).

Orbax writes each checkpoint into a temporary directory and renames it when complete, so an
interrupted save never leaves a half-written checkpoint that `latest_step` would pick up.
Backends are synced (caches written back) by the caller before saving.
"""

from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp
from absl import logging


class Checkpointer:
  """Saves and restores TrainStates under `workdir/checkpoints/<step>`."""

  def __init__(self, workdir: str, max_to_keep: int = 2):
    self.directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
    self.manager = ocp.CheckpointManager(
      self.directory,
      options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
    )

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, state, step: int, wait: bool = True) -> None:
    self.manager.save(step, args=ocp.args.StandardSave(state), force=True)
    if wait:
      self.manager.wait_until_finished()
    logging.info("Saved checkpoint %d in %s", step, self.directory)

  def restore(self, abstract_state, step: int | None = None):
    """Restore into the structure, shapes, dtypes and shardings of `abstract_state`."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"No checkpoint in {self.directory}")
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
    return self.manager.restore(step, args=ocp.args.StandardRestore(target))

  def close(self):
    self.manager.wait_until_finished()
    self.manager.close()
