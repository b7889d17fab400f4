"""Orbax checkpoints that reshard: each table in its logical form, whatever its placement.

A checkpoint holds
  state/train    step, dense params, their optax state, the run key (replicated)
  state/tables   {table: logical arrays}: "rows" backends (dense, offload, ...) as
                 {"rows": f32[S, D], slot: f32[S]} with S = base.aligned_rows(N), kept in the
                 placement they had (a row-sharded table is written shard by shard, never
                 gathered); compressed backends in their own format (TT: the cores)
  meta           JSON: each table's format, backend, rows and dim; the mesh it was saved on
so a run saved on 8 devices resumes on 1 or 4, or with another "rows" backend for a table
(dense -> offload, dense -> dense(shard=rows)): restore reads each table straight into the
placement the NEW plan wants (Orbax reads only the chunks each device needs).

Orbax writes each checkpoint into a temporary directory and renames it when complete, so an
interrupted save never leaves a half-written checkpoint that `latest_step` would pick up.
Backends are synced (caches written back) by the caller before saving.
"""

from __future__ import annotations

import os

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

from recgnn import sharding
from recgnn.embeddings import base


class IncompatibleCheckpoint(ValueError):
  """A checkpoint that cannot be restored into the current plan (says which table, why)."""


def _train_part(state) -> dict:
  return {"step": state.step, "params": state.params, "opt_state": state.opt_state,
          "key": state.key}  # fmt: skip


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

  def save(self, state, step: int, plan: base.Plan, wait: bool = True) -> None:
    """Save a synced TrainState: the dense part and every table's logical form."""
    tables, meta = {}, {}
    for key, group in plan.groups.items():
      exported = group.export(state.emb[key])
      for name, arrays in exported.items():
        spec = group.specs[name]
        tables[name] = arrays
        meta[name] = {
          "format": group.logical_format(name),
          "backend": group.describe(name),
          "num_rows": spec.num_rows,
          "dim": spec.dim,
          "slots": list(spec.optimizer.slot_names()),
        }
    payload = {"train": _train_part(state), "tables": tables}
    info = {"tables": meta, "mesh": sharding.describe(plan.mesh)}
    self.manager.save(
      step,
      args=ocp.args.Composite(state=ocp.args.StandardSave(payload), meta=ocp.args.JsonSave(info)),
      force=True,
    )
    if wait:
      self.manager.wait_until_finished()
    logging.info("Saved checkpoint %d in %s", step, self.directory)

  def metadata(self, step: int | None = None) -> dict:
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"No checkpoint in {self.directory}")
    return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

  def restore(self, state, plan: base.Plan, step: int | None = None):
    """Restore into `state`'s structure: the dense part as `state` places it, each table
    into the placement of `plan` (which may differ from the one that saved it)."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"No checkpoint in {self.directory}")
    meta = self.metadata(step)
    saved = meta["tables"]
    where = f"checkpoint {step} in {self.directory} (saved on mesh {meta.get('mesh', '?')})"
    missing = [n for n in plan.table_group if n not in saved]
    if missing:
      raise IncompatibleCheckpoint(f"{where} has no table(s) {missing}; it has {sorted(saved)}")
    tables_target = {}
    for group in plan.groups.values():
      target = group.logical_target()
      for name in group.specs:
        spec, s = group.specs[name], saved[name]
        if (s["num_rows"], s["dim"]) != (spec.num_rows, spec.dim):
          raise IncompatibleCheckpoint(
            f"{where}: table {name!r} has {s['num_rows']} x {s['dim']} rows x dim; this run's "
            f"is {spec.num_rows} x {spec.dim}"
          )
        fmt = group.logical_format(name)
        if s["format"] != fmt:
          raise IncompatibleCheckpoint(
            f"{where}: table {name!r} was saved by {s['backend']!r} (format {s['format']!r}); "
            f"{group.describe(name)!r} reads format {fmt!r}. Row backends (dense, "
            "dense(shard=rows), offload) restore from one another; a compressed table only "
            "into the same backend and shape."
          )
        if s.get("slots", []) != list(spec.optimizer.slot_names()):
          raise IncompatibleCheckpoint(
            f"{where}: table {name!r} has optimizer slots {s.get('slots')}; this run's "
            f"optimizer {spec.optimizer.name!r} has {list(spec.optimizer.slot_names())}"
          )
        tables_target[name] = target[name]
    train_target = jax.tree.map(ocp.utils.to_shape_dtype_struct, _train_part(state))
    payload = self.manager.restore(
      step,
      args=ocp.args.Composite(
        state=ocp.args.StandardRestore({"train": train_target, "tables": tables_target})
      ),
    )["state"]
    emb = {
      key: group.import_({n: payload["tables"][n] for n in group.specs})
      for key, group in plan.groups.items()
    }
    t = payload["train"]
    return state.replace(
      step=t["step"], params=t["params"], opt_state=t["opt_state"], key=t["key"], emb=emb
    )

  def check_artifacts(self, arrays: dict, resume: bool) -> None:
    """Save the task's artifacts beside the checkpoints (process 0); on resume, refuse
    artifacts that differ from the saved ones (the checkpoint would mean something else)."""
    if not arrays:
      return
    path = os.path.join(self.directory, "artifacts.npz")
    if resume and os.path.exists(path):
      with np.load(path) as saved:
        for k, v in arrays.items():
          if k not in saved or saved[k].shape != np.shape(v) or not np.array_equal(saved[k], v):
            raise IncompatibleCheckpoint(
              f"{path}: artifact {k!r} differs from this run's (e.g. another node order or "
              "graph): resuming would mix two runs. Use a fresh --workdir."
            )
      return
    if jax.process_index() == 0:
      os.makedirs(self.directory, exist_ok=True)
      tmp = path + ".tmp.npz"
      np.savez(tmp, **{k: np.asarray(v) for k, v in arrays.items()})
      os.replace(tmp, path)  # never half-written

  def close(self):
    self.manager.wait_until_finished()
    self.manager.close()
