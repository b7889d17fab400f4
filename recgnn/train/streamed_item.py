"""The checkpoint item `streamed`: tables exported as `streamed.StreamedTable` (offload's SSD
level: bigger than host RAM), written a chunk at a time into the checkpoint and read back the
same way; the other tables stay in Orbax's `state` item.

An Orbax item of its own so that Orbax's commit covers it: Orbax writes every item into the
checkpoint's temporary directory and renames the directory when all are complete, so a kill
during the stream leaves no checkpoint (and the next run removes the temporary). Each table is
a folder `<index>` of the item (recgnn.embeddings.streamed: .npy files + their file_check
manifest); the meta's table entry says `"stored": "streamed"` and its folder. One process
(the SSD level's limit): process 0 writes.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import orbax.checkpoint as ocp

from recgnn.embeddings import streamed

ITEM = "streamed"


class StreamedTablesHandler(ocp.CheckpointHandler):
  """Writes / opens the `streamed` item's tables (a blocking save: Orbax runs it in a thread
  and commits the checkpoint after it)."""

  def save(self, directory, args: StreamedSave):
    if jax.process_index() == 0:
      for folder, table in args.tables.items():
        table.write(os.path.join(os.fspath(directory), folder))

  def restore(self, directory, args: StreamedRestore):
    """{folder: streamed.TableReader} (each verified by its manifest: a damaged file raises,
    naming it)."""
    return {f: streamed.TableReader(os.path.join(os.fspath(directory), f)) for f in args.folders}


@ocp.args.register_with_handler(StreamedTablesHandler, for_save=True)
@dataclasses.dataclass
class StreamedSave(ocp.args.CheckpointArgs):
  tables: dict  # {folder: streamed.StreamedTable}


@ocp.args.register_with_handler(StreamedTablesHandler, for_restore=True)
@dataclasses.dataclass
class StreamedRestore(ocp.args.CheckpointArgs):
  folders: tuple = ()


def split(exported: dict, meta: dict, arrays: dict, streams: dict) -> None:
  """Sort a group's export into `arrays` ({table: its arrays}, Orbax's `state`) and `streams`
  ({folder: StreamedTable}, this item); the meta of a streamed table names its folder."""
  for name, x in exported.items():
    if isinstance(x, streamed.StreamedTable):
      folder = str(len(streams))
      streams[folder] = x
      meta[name].update(stored=ITEM, folder=folder)
    else:
      arrays[name] = x


def logical(group, names, arrays: dict, readers: dict, meta: dict) -> dict:
  """{table: its "rows" form for `group.import_`}: the Orbax arrays, or a streamed table's
  reader (`reads_streams`) or its arrays placed as `logical_target` says (O(table): a
  backend that holds the whole table)."""
  out = {}
  for n in names:
    if meta[n].get("stored") != ITEM:
      out[n] = arrays[n]
      continue
    reader = readers[meta[n]["folder"]]
    if group.reads_streams():
      out[n] = reader
    else:
      target = group.logical_target()[n]
      out[n] = {k: jax.device_put(v, target[k].sharding) for k, v in reader.arrays().items()}
  return out
