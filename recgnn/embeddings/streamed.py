"""A table's logical "rows" form written and read a chunk at a time: the checkpoint of a table
bigger than host RAM (offload's SSD level) must never hold the whole table.

`StreamedTable` is what a backend's `export` gives for such a table in place of its arrays:
the shape, and `produce(sink)`, which calls sink(first, {"rows": f32[n, D], slot: f32[n]})
for consecutive chunks covering rows [0, S) (S = aligned_rows(N): the "rows" form's shape),
each at most CHUNK_BYTES of records (the backend reads its row file that way). `write` puts
it in a folder (the checkpoint's `streamed` item, inside Orbax's temporary directory: the
checkpoint is committed by Orbax's rename, never half-written):

  rows.npy        f32[S, D]   (numpy's .npy format: readable by np.load(mmap_mode="r"))
  <slot>.npy      f32[S]      one per optimizer slot
  streamed.json   S, D, the slots, recgnn.data.file_check's records of the .npy files
                  (bytes and the head's SHA-256) and their CRC-32s, written last

`TableReader` opens such a folder, verified first (file_check: a truncated or foreign file is
refused naming it), and reads any rows [first, first + n) with one read per file: `chunk`
for a backend that imports a chunk at a time (`Backend.reads_streams`), `arrays` (O(table))
for one that holds the table anyway.
"""

from __future__ import annotations

import dataclasses
import os
import zlib
from collections.abc import Callable

import numpy as np

from recgnn.data import file_check

# The most bytes one chunk of a streamed table holds (a chunk's records in the row file, or
# its arrays): a checkpoint's save and restore hold O(CHUNK_BYTES + the host cache), never
# O(table). 16 MiB: sequential reads at the disk's speed (8 MiB per call, row_file); a save
# holds a few chunks at once (the read, its column copies), 64 MiB took 0.5 GiB over the
# training's RSS (benchmarks/ssd_tier.py --checkpoint).
CHUNK_BYTES = 16 << 20
MANIFEST = "streamed.json"

Sink = Callable[[int, dict], None]


def chunk_rows(row_bytes: int) -> int:
  """Rows per chunk of `row_bytes` each (at least 1)."""
  return max(1, CHUNK_BYTES // max(1, int(row_bytes)))


def _npy_header(shape: tuple[int, ...]) -> bytes:
  import io

  buf = io.BytesIO()
  np.lib.format.write_array_header_1_0(
    buf, {"descr": np.lib.format.dtype_to_descr(np.dtype(np.float32)), "fortran_order": False,
          "shape": shape}
  )  # fmt: skip
  return buf.getvalue()


@dataclasses.dataclass(frozen=True)
class StreamedTable:
  """One table's "rows" form, produced a chunk at a time (see the module docstring).

  rows: S; dim: D; slots: the optimizer slot names; produce(sink): the chunks, in order."""

  rows: int
  dim: int
  slots: tuple[str, ...]
  produce: Callable[[Sink], None]

  def keys(self) -> tuple[str, ...]:
    return ("rows", *self.slots)

  def write(self, folder: str) -> int:
    """The table as .npy files + its manifest in `folder` (made) -> the bytes written."""
    os.makedirs(folder, exist_ok=True)
    names = {k: f"{k}.npy" for k in self.keys()}
    files = {k: open(os.path.join(folder, n), "wb") for k, n in names.items()}  # noqa: SIM115
    # Each file's CRC-32 as written (the checkpoint's checksums take it: no second pass
    # over the table's bytes; a restore compares the disk's bytes with it).
    crc = dict.fromkeys(files, 0)
    done = [0]

    def put(k: str, data) -> None:
      files[k].write(data)
      crc[k] = zlib.crc32(data, crc[k])

    try:
      for k in files:
        put(k, _npy_header((self.rows, self.dim) if k == "rows" else (self.rows,)))

      def sink(first: int, chunk: dict) -> None:
        if first != done[0]:
          raise RuntimeError(f"streamed table: chunk at row {first}, expected {done[0]}")
        n = chunk["rows"].shape[0]
        for k in files:
          put(k, memoryview(np.ascontiguousarray(chunk[k], np.float32)).cast("B"))
        done[0] += n

      self.produce(sink)
      if done[0] != self.rows:
        raise RuntimeError(f"streamed table: {done[0]} rows produced of {self.rows}")
      for f in files.values():
        f.flush()
        os.fsync(f.fileno())
        # (written and on disk: its page cache is dropped, the host's RAM is the caches')
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
      for f in files.values():
        f.close()
    manifest = {"rows": self.rows, "dim": self.dim, "slots": list(self.slots),
                "files": file_check.file_records(folder, names.values()),
                "crc32": {names[k]: c for k, c in crc.items()}}  # fmt: skip
    file_check.write_manifest(os.path.join(folder, MANIFEST), manifest)
    return sum(r["bytes"] for r in manifest["files"].values())

  def count(self, f: Callable[[dict], int]) -> int:
    """sum of f(chunk) over the chunks (e.g. non-finite values), O(chunk) memory."""
    total = [0]
    self.produce(lambda first, chunk: total.__setitem__(0, total[0] + int(f(chunk))))
    return total[0]


def written_checksums(directory: str) -> dict[str, list[int]]:
  """{path relative to `directory`: [bytes, CRC-32]} of the .npy files of every streamed
  table under it, as their writer computed them (from the manifests)."""
  out = {}
  for root, _, names in os.walk(directory):
    if MANIFEST in names and (m := file_check.read_manifest(os.path.join(root, MANIFEST))):
      for name, c in (m.get("crc32") or {}).items():
        rel = os.path.relpath(os.path.join(root, name), directory)
        out[rel] = [m["files"][name]["bytes"], c]
  return out


class TableReader:
  """A `StreamedTable.write` folder, verified on opening (file_check), read by rows.

  rows, dim, slots: as written; `chunk(first, n)`, `arrays()`."""

  def __init__(self, folder: str):
    self.folder = folder
    manifest = file_check.read_manifest(os.path.join(folder, MANIFEST))
    why = (
      f"{os.path.join(folder, MANIFEST)} is missing or unreadable"
      if manifest is None
      else file_check.check_files(folder, manifest)
    )
    if why is not None:
      raise ValueError(f"streamed table in {folder} refused: {why}")
    self.rows, self.dim = int(manifest["rows"]), int(manifest["dim"])
    self.slots = tuple(manifest["slots"])
    self._at = {}  # key -> (path, byte offset of row 0)
    for k in ("rows", *self.slots):
      path = os.path.join(folder, f"{k}.npy")
      with open(path, "rb") as f:
        np.lib.format.read_magic(f)
        shape, _, dtype = np.lib.format.read_array_header_1_0(f)
        want = (self.rows, self.dim) if k == "rows" else (self.rows,)
        if tuple(shape) != want or dtype != np.float32:
          raise ValueError(f"streamed table: {path} holds {dtype}{shape}, expected float32{want}")
        self._at[k] = (path, f.tell())

  def chunk(self, first: int, n: int) -> dict[str, np.ndarray]:
    """{"rows": f32[n', D], slot: f32[n']} of rows [first, first + n') (n' = n, or fewer at
    the end): one read per file."""
    n = max(0, min(n, self.rows - first))
    out = {}
    for k, (path, at) in self._at.items():
      width = self.dim if k == "rows" else 1
      with open(path, "rb") as f:
        f.seek(at + 4 * first * width)
        x = np.fromfile(f, np.float32, n * width)
      if x.shape[0] != n * width:
        raise ValueError(f"streamed table: {path} ended early at row {first}")
      out[k] = x.reshape(n, self.dim) if k == "rows" else x
    return out

  def arrays(self) -> dict[str, np.ndarray]:
    """The whole "rows" form (O(table): for a backend that holds it), read a chunk at a time."""
    out = {"rows": np.empty((self.rows, self.dim), np.float32)}
    out.update({k: np.empty(self.rows, np.float32) for k in self.slots})
    step = chunk_rows(4 * (self.dim + len(self.slots)))
    for a in range(0, self.rows, step):
      for k, v in self.chunk(a, step).items():
        out[k][a : a + v.shape[0]] = v
    return out
