"""Orbax checkpoints that reshard: each table in its logical form, whatever its placement.

A checkpoint holds
  state/train    step, dense params, their optax state, the run key (replicated)
  state/tables   {table: logical arrays}: "rows" backends (dense, offload, ...) as
                 {"rows": f32[S, D], slot: f32[S]} with S = base.aligned_rows(N), kept in the
                 placement they had (a row-sharded table is written shard by shard, never
                 gathered); compressed backends in their own format (TT: the cores)
  streamed       tables exported a chunk at a time (bigger than host RAM: offload's SSD
                 level), .npy files written and read back in bounded chunks (streamed_item)
  meta           JSON: each table's format, backend, rows and dim; the mesh it was saved on
so a run saved on 8 devices resumes on 1 or 4, or with another "rows" backend for a table
(dense -> offload, dense -> dense(shard=rows)): restore reads each table straight into the
placement the NEW plan wants (Orbax reads only the chunks each device needs).

Crash safety:
  - Orbax writes each checkpoint into `<step>.orbax-checkpoint-tmp-*` and renames it when
    complete, so a run killed mid-save (SIGKILL, power loss) leaves no checkpoint that
    `latest_step` would pick up; the leftover temporaries are removed when the next run opens
    the directory.
  - A save that fails (a full disk: OSError ENOSPC) removes its temporary directory and raises
    CheckpointWriteError naming the previous checkpoint, which the failed save never touched
    (Orbax deletes old checkpoints only after a new one is committed).
  - After the commit, process 0 writes `<step>/recgnn_checksums.json` (CRC-32 and size of every
    file). Restore verifies them; a checkpoint whose files differ (bit rot, a truncated copy) or
    that Orbax cannot read is refused with a message naming it, moved to `corrupt/<step>` and
    the next older one is used. A checkpoint without the file (killed between the commit and
    the checksums) is complete by Orbax's rename and is restored unverified.
  - `refuse_existing` stops a run that would start from step 0 in a workdir holding another
    run's checkpoints (Orbax would fail at the first save with StepAlreadyExistsError).

Resuming with another configuration: before anything is read, `restore` compares the
checkpoint with this run (the shape of every dense param and optimizer-state leaf, from Orbax's
array metadata; each table's rows, dim, format and optimizer slots; and, for checkpoints that
carry it, the config keys that differ). A mismatch raises IncompatibleCheckpoint naming every
differing key with both values, and the checkpoint stays where it is: a changed config is not a
damaged file. Only a checkpoint that fails its checksums or that Orbax cannot read is moved
to `corrupt/`.
Backends are synced (caches written back) by the caller before saving.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
import zipfile

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath

from recgnn import planner, sharding
from recgnn.data import file_check
from recgnn.embeddings import streamed
from recgnn.train import streamed_item
from recgnn.train.checksums import CHECKSUMS, file_checksums, verify_checksums
from recgnn.train.config_diff import config_differences

ARTIFACTS_KEY = "artifacts v1"  # (artifacts.npz's manifest: its bytes and head checksum)
TMP_MARK = ".orbax-checkpoint-tmp"


def _state_handler() -> ocp.PyTreeCheckpointHandler:
  """The handler of the `state` item: Orbax's standard one, except that in a single process
  a replicated array is written from one replica's shard, not sliced over its replicas.

  Orbax's default on CPU (replica-parallel) has each replica write a slice of a replicated
  array: every host writes part of it, which saves bytes per host when there are several.
  In one process every replica is local, so the slices only split the copies to host into
  an eager `slice` program per array shape and replica: a first save of a small model on 8
  devices compiled ~100 of them (tests/README.md). Several processes keep Orbax's default
  (None: on where JAX_PLATFORMS is not a GPU's). The arrays' files are the same either way
  (a replicated array is one array on disk); no `array_metadatas` folder is written (Orbax's
  per-host array metadata, which this handler's restore does not read)."""
  one_process = jax.process_count() == 1
  arrays = ocp.type_handlers.ArrayHandler(use_replica_parallel=False if one_process else None)
  registry = ocp.type_handlers.create_type_handler_registry(
    (int, ocp.type_handlers.ScalarHandler()),
    (float, ocp.type_handlers.ScalarHandler()),
    (np.number, ocp.type_handlers.ScalarHandler()),
    (np.ndarray, ocp.type_handlers.NumpyHandler()),
    (jax.Array, arrays),
    (str, ocp.type_handlers.StringHandler()),
  )
  return ocp.PyTreeCheckpointHandler(type_handler_registry=registry)


class IncompatibleCheckpoint(ValueError):
  """A checkpoint that does not fit this run (another model, table or optimizer shape): says
  which keys differ, with both values. The checkpoint is left in place."""


class NoCheckpoint(FileNotFoundError):
  """--resume in a workdir without a checkpoint to resume."""


class CorruptCheckpoint(ValueError):
  """A checkpoint whose files do not match their checksums or cannot be read."""


class CheckpointWriteError(OSError):
  """A save that failed (e.g. a full disk); the previous checkpoint is intact."""


class WorkdirHasCheckpoints(FileExistsError):
  """A fresh run (no --resume) in a workdir that already holds checkpoints."""


def checkpoint_dir(workdir: str) -> str:
  return os.path.abspath(os.path.join(workdir, "checkpoints"))


def committed_steps(workdir: str) -> list[int]:
  """Steps of the complete checkpoints under `workdir` (sorted), without opening Orbax."""
  d = checkpoint_dir(workdir)
  if not os.path.isdir(d):
    return []
  return sorted(int(n) for n in os.listdir(d) if n.isdigit() and os.path.isdir(os.path.join(d, n)))


def refuse_existing(workdir: str, resume: bool) -> None:
  """Raise WorkdirHasCheckpoints when a run without --resume would start over another run's
  checkpoints: its first save would collide with them, and resuming later would mix runs."""
  steps = committed_steps(workdir)
  if steps and not resume:
    raise WorkdirHasCheckpoints(
      f"{checkpoint_dir(workdir)} already holds checkpoints (steps {steps}) of an earlier run. "
      "Pass --resume to continue it, or give a fresh --workdir to start a new run (or delete "
      "that directory)."
    )


def _leaf_shapes(tree) -> dict[str, tuple]:
  """{'params/bottom/Dense_0/kernel': (13, 32), ...}: every array leaf's shape by a path that
  reads the same for a live TrainState part and for Orbax's metadata of a saved one (which
  stores tuples as lists and named tuples as dicts). A PRNG key counts as its raw data."""
  out = {}
  for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    parts = []
    for k in path:
      for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
          parts.append(str(getattr(k, attr)))
          break
    shape = tuple(getattr(x, "shape", np.shape(x)))
    if jax.dtypes.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key):
      shape = tuple(jax.random.key_data(x).shape)
    out["/".join(parts)] = shape
  return out


def _show(v) -> str:
  if isinstance(v, tuple):
    return "(" + ", ".join(map(str, v)) + ("," if len(v) == 1 else "") + ")"
  return str(v)


def _train_part(state) -> dict:
  return {"step": state.step, "params": state.params, "opt_state": state.opt_state,
          "key": state.key}  # fmt: skip


class Checkpointer:
  """Saves and restores TrainStates under `workdir/checkpoints/<step>`."""

  def __init__(self, workdir: str, max_to_keep: int = 2, config: dict | None = None):
    """config: the run's config (JSON-able), saved in each checkpoint's meta so that a resume
    with another config can name the keys that differ."""
    self.directory = checkpoint_dir(workdir)
    self.config = config
    self.restored_step: int | None = None
    if jax.process_index() == 0:
      self._remove_temporaries()
    self.manager = ocp.CheckpointManager(
      self.directory,
      options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
      item_handlers={
        "state": _state_handler(),
        "meta": ocp.JsonCheckpointHandler(),
        streamed_item.ITEM: streamed_item.StreamedTablesHandler(),
      },
    )

  def _remove_temporaries(self, step: int | None = None) -> None:
    """Delete what interrupted saves left (`<step>.orbax-checkpoint-tmp-*`): never a complete
    checkpoint, and a later save of the same step must not find it."""
    if not os.path.isdir(self.directory):
      return
    for name in os.listdir(self.directory):
      head, mark, _ = name.partition(TMP_MARK)
      if mark and head.isdigit() and (step is None or int(head) == step):
        shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(
    self, state, step: int, plan: planner.Plan, wait: bool = True, data_state: dict | None = None
  ) -> None:
    """Save a synced TrainState: the dense part and every table's logical form; `data_state`
    (the input pipeline's iterator state, JSON) goes into the meta item."""
    tables, meta, streams = {}, {}, {}
    for key, group in plan.groups.items():
      exported = group.export(state.emb[key])
      for name in exported:
        spec = group.specs[name]
        meta[name] = {
          "format": group.logical_format(name),
          "backend": group.describe(name),
          "num_rows": spec.num_rows,
          "dim": spec.dim,
          "slots": list(spec.optimizer.slot_names()),
        }
      streamed_item.split(exported, meta, tables, streams)  # (tables bigger than host RAM)
    payload = {"train": _train_part(state), "tables": tables}
    info = {"tables": meta, "mesh": sharding.describe(plan.mesh)}
    if self.config is not None:
      info["config"] = self.config
    extras = {k: e for k, g in plan.groups.items() if (e := g.extras(state.emb[k]))}
    if extras:
      info["group_extras"] = extras
    if data_state is not None:
      info["data_state"] = data_state
    previous = self.latest_step()
    try:
      items = {"state": ocp.args.PyTreeSave(payload), "meta": ocp.args.JsonSave(info)}
      if streams:
        items[streamed_item.ITEM] = streamed_item.StreamedSave(streams)
      self.manager.save(step, args=ocp.args.Composite(**items), force=True)
      if wait:
        self.manager.wait_until_finished()
    except OSError as e:
      # The half-written temporary would hold the space a retry needs.
      if jax.process_index() == 0:
        self._remove_temporaries(step)
      kept = f"checkpoint {previous} is intact" if previous is not None else "no earlier checkpoint"
      full = " (the disk is full)" if e.errno == errno.ENOSPC else ""
      raise CheckpointWriteError(
        e.errno,
        f"Could not write checkpoint {step} in {self.directory}{full}: {e}. {kept}; free "
        "space (or fix the error) and rerun with --resume to continue from it.",
      ) from e
    if wait:
      self.write_checksums(step)
    logging.info("Saved checkpoint %d in %s", step, self.directory)

  def write_checksums(self, step: int) -> None:
    """Process 0 records every file's CRC-32 in the committed checkpoint (atomic rename)."""
    if jax.process_index() != 0:
      return
    d = os.path.join(self.directory, str(step))
    sums = file_checksums(d, streamed.written_checksums(d))
    tmp = os.path.join(d, CHECKSUMS + ".tmp")
    with open(tmp, "w") as f:
      json.dump(sums, f)
    os.replace(tmp, os.path.join(d, CHECKSUMS))

  def metadata(self, step: int | None = None) -> dict:
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"No checkpoint in {self.directory}")
    return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

  def restore(self, state, plan: planner.Plan, step: int | None = None, log=print):
    """Restore the newest readable checkpoint (or `step`) into `state`'s structure: the dense
    part as `state` places it, each table into the placement of `plan` (which may differ
    from the one that saved it).

    Each checkpoint is first checked against this run (`differences`): one that does not fit
    raises IncompatibleCheckpoint at once, naming every differing key, and stays in place. A
    checkpoint that fails its checksums or that Orbax cannot read is reported through `log`,
    moved to `checkpoints/corrupt/` and the next older one is tried; the step used is
    `self.restored_step`.
    """
    steps = [step] if step is not None else sorted(self.manager.all_steps(), reverse=True)
    if not steps:
      raise NoCheckpoint(f"No checkpoint in {self.directory}")
    refused = []
    for s in steps:
      where = os.path.join(self.directory, str(s))
      why = verify_checksums(where)
      if why is None:
        try:
          saved = self._saved_layout(s)
        except Exception as e:  # noqa: BLE001 (its metadata cannot be read: unusable)
          why = f"unreadable ({type(e).__name__}: {str(e)[:300]})"
        else:
          diffs = self.differences(state, plan, saved[0], _leaf_shapes(saved[1]))
          if diffs:
            raise IncompatibleCheckpoint(self._mismatch_message(s, saved[0], diffs))
          try:
            restored = self._restore_step(state, plan, s, saved[0])
          except IncompatibleCheckpoint:
            raise
          except Exception as e:  # noqa: BLE001 (the shapes fit, so a failure means: unusable)
            why = f"unreadable ({type(e).__name__}: {str(e)[:300]})"
          else:
            self.restored_step = s
            return restored
      refused.append(f"checkpoint {s} ({where}): {why}")
      log(f"Refusing corrupted checkpoint {s} in {where}: {why}; trying the previous one")
      self._quarantine(s)
    raise CorruptCheckpoint(
      "No usable checkpoint: " + "; ".join(refused) + ". Start again with a fresh --workdir."
    )

  def _saved_layout(self, step: int) -> tuple[dict, dict[str, tuple]]:
    """(meta, {dense leaf path: shape}) of checkpoint `step`, from its JSON meta and Orbax's
    array metadata (no array is read). Raises if either cannot be read."""
    meta = self.metadata(step)
    path = epath.Path(self.directory) / str(step) / "state"
    tree = ocp.StandardCheckpointHandler().metadata(path)
    return meta, tree["train"]

  def differences(self, state, plan: planner.Plan, meta: dict, dense: dict[str, tuple]) -> list:
    """[(key, checkpoint's value, this run's value)] for everything that makes checkpoint
    (`meta`, its dense leaf shapes `dense`) unfit for `state` and `plan`: each table's rows,
    dim, format and optimizer slots, every dense param / optimizer-state leaf's shape, and the
    leaves only one side has. Empty: it restores."""
    out = []
    saved = meta["tables"]
    for group in plan.groups.values():
      for name, spec in group.specs.items():
        if name not in saved:
          out.append((f"table {name}", "absent", f"{spec.num_rows} x {spec.dim}"))
          continue
        s = saved[name]
        # Rows and dim apart: a changed embeddings.dim then reads as one entry for all tables.
        if s["num_rows"] != spec.num_rows:
          out.append((f"table {name} rows", s["num_rows"], spec.num_rows))
        if s["dim"] != spec.dim:
          out.append((f"table {name} dim", s["dim"], spec.dim))
        fmt = group.logical_format(name)
        if s["format"] != fmt:
          out.append((f"table {name} format", f"{s['format']!r} ({s['backend']})",
                      f"{fmt!r} ({group.describe(name)})"))  # fmt: skip
        slots = list(spec.optimizer.slot_names())
        if s.get("slots", []) != slots:
          out.append((f"table {name} optimizer slots", s.get("slots"),
                      f"{slots} ({spec.optimizer.name})"))  # fmt: skip
    mine = _leaf_shapes(_train_part(state))
    for key in sorted(set(dense) | set(mine)):
      a, b = dense.get(key, "absent"), mine.get(key, "absent")
      if a != b:
        out.append((key, a, b))
    return out

  def _mismatch_message(self, step: int, meta: dict, diffs: list) -> str:
    def show(items):
      text = "; ".join(f"{k}: checkpoint {_show(a)}, this run {_show(b)}" for k, a, b in items[:8])
      return text + (f"; and {len(items) - 8} more" if len(items) > 8 else "")

    keys = []
    if self.config is not None and "config" in meta:
      keys = config_differences(meta["config"], self.config)
    # The config keys first (the cause, in the user's words), then what differs in the arrays,
    # params before their optimizer state.
    diffs = sorted(diffs, key=lambda d: (not d[0].startswith("table"), "opt_state" in d[0]))
    # One entry for the tables that differ in the same way: "tables C1, C2 optimizer slots".
    merged: dict[tuple, list] = {}
    for k, a, b in diffs:
      name, what = k.split(" ", 2)[1:] if k.startswith("table ") else (None, k)
      merged.setdefault((what, _show(a), _show(b)), [a, b, []])[2].append(name)
    diffs = []
    for (what, *_), (a, b, names) in merged.items():
      if names[0] is not None:
        what = f"{'table' if len(names) == 1 else 'tables'} {', '.join(names)} {what}"
      diffs.append((what, a, b))
    cause = f"config {show(keys)}. It differs in " if keys else ""
    hint = ""
    if any(k.endswith("format") for k, *_ in diffs):
      hint = (
        " Row backends (dense, dense(shard=rows), offload) restore from one another; a "
        "compressed table only into the same backend and shape."
      )
    workdir = os.path.dirname(self.directory)
    return (
      f"Checkpoint {step} in {self.directory} was saved by another configuration: {cause}"
      f"{show(diffs)}.{hint} The checkpoints are untouched: resume with the configuration "
      f"that saved them ({os.path.join(workdir, 'config.json')}), or train this configuration "
      "in a fresh --workdir."
    )

  def _quarantine(self, step: int) -> None:
    """Move a refused checkpoint to corrupt/<step>-<time> (kept for inspection, out of the
    way of the save that will write this step again)."""
    if jax.process_index() == 0:
      dest = os.path.join(self.directory, "corrupt", f"{step}-{int(time.time())}")
      os.makedirs(os.path.dirname(dest), exist_ok=True)
      os.replace(os.path.join(self.directory, str(step)), dest)
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils

      multihost_utils.sync_global_devices(f"recgnn: quarantined checkpoint {step}")
    self.manager.reload()

  def _restore_step(self, state, plan: planner.Plan, step: int, meta: dict):
    """Read checkpoint `step` (already checked against this run by `differences`)."""
    saved, tables_target = meta["tables"], {}
    for group in plan.groups.values():
      target = group.logical_target()
      tables_target.update({n: target[n] for n in group.specs if "folder" not in saved[n]})
    train_target = jax.tree.map(ocp.utils.to_shape_dtype_struct, _train_part(state))
    target = {"train": train_target, "tables": tables_target}
    restore_args = ocp.checkpoint_utils.construct_restore_args(target)
    items = {"state": ocp.args.PyTreeRestore(target, restore_args=restore_args)}
    if folders := tuple(saved[n]["folder"] for n in saved if "folder" in saved[n]):
      items[streamed_item.ITEM] = streamed_item.StreamedRestore(folders)
    got = self.manager.restore(step, args=ocp.args.Composite(**items))
    payload, readers = got["state"], got.get(streamed_item.ITEM, {})
    emb = {
      k: g.import_(streamed_item.logical(g, g.specs, payload["tables"], readers, saved))
      for k, g in plan.groups.items()
    }
    for key, extras in meta.get("group_extras", {}).items():
      if key in plan.groups:
        emb[key] = plan.groups[key].restore_extras(emb[key], extras)
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
      differs = None  # (the first artifact that differs)
      try:  # (its manifest first where one was written; then a read that may still fail)
        sidecar = os.path.exists(path + file_check.SIDECAR)
        if sidecar and (bad := file_check.sidecar_problem(path, ARTIFACTS_KEY)) is not None:
          raise ValueError(bad)
        with np.load(path) as saved:
          for k, v in arrays.items():
            if k not in saved or saved[k].shape != np.shape(v) or not np.array_equal(saved[k], v):
              differs = k
              break
      except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise IncompatibleCheckpoint(
          f"{path} is damaged ({e}): this run's artifacts (e.g. its node order) cannot be checked"
          " against the checkpoints'. Restore it from a copy, or delete it to resume unchecked."
        ) from None
      if differs is not None:
        raise IncompatibleCheckpoint(
          f"{path}: artifact {differs!r} differs from this run's (e.g. another node order or "
          "graph): resuming would mix two runs. Use a fresh --workdir."
        )
      return
    if jax.process_index() == 0:
      os.makedirs(self.directory, exist_ok=True)
      tmp = path + ".tmp.npz"
      np.savez(tmp, **{k: np.asarray(v) for k, v in arrays.items()})
      os.replace(tmp, path)  # never half-written
      file_check.write_sidecar(path, ARTIFACTS_KEY)

  def close(self):
    self.manager.wait_until_finished()
    self.manager.close()
