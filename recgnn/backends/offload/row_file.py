"""`RowFile`: one table's rows and optimizer state on disk, one fixed-size record per row
(offload's SSD level, `storage=ssd:DIR`).

Layout: a HEADER_BYTES (64 KiB) header (b"RECGNN-ROWS\\n", then JSON: version, rows, dim, slots,
dtype, record bytes, layout), then row r's record at HEADER_BYTES + r * record:
float32[dim] (the row) then float32 per optimizer slot, zero-padded to `record` bytes.
Padded to the device's logical block size under io=direct (O_DIRECT: a row is one aligned
read of `record` bytes, and the disk reads exactly that); under io=buffered to 4 bytes (the
kernel reads whole 4 KiB pages: a 260-byte row costs a page, `posix_fadvise(RANDOM)` only
stops the read-ahead).

Verified before use, with the CTR caches' mechanism (recgnn.data.file_check: the file's size
and the sha256 of its head, recorded in a manifest `<file>.json` once the file is whole): a
truncated file, a header overwritten, another table's file, are refused naming the file and
the fix (`verify`, at every export and before the file is adopted); a read that comes back
short says so (never zeros read as rows).

The file is scratch space, not the truth: a checkpoint holds the logical tables (`export`
streams the file into it a chunk at a time: recgnn.embeddings.streamed), and a resume writes
a new file from it; so a kill -9 at any point leaves nothing to repair. Each process names
its files by its pid; files of processes no longer alive are removed when a new one is made
in the same directory.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import json
import mmap
import os
import shutil

import numpy as np

from recgnn.data import file_check
from recgnn.embeddings import streamed

MAGIC = b"RECGNN-ROWS\n"
VERSION = 1
# The header fills the bytes the manifest's head checksum covers (file_check.HEAD_BYTES: the
# rows after it change, the header never), a multiple of any logical block size (O_DIRECT's
# records stay aligned).
HEADER_BYTES = file_check.HEAD_BYTES
SUFFIX = ".rows"
IO_MODES = ("direct", "buffered")
# Rows per read / write call of the pool, and the pool's threads: the disk's queue depth is
# what a random-read SSD needs filled: 32 threads read fastest in benchmarks/ssd_io.py
# (docs/backends/offload.md).
CHUNK_ROWS = 256
SEQUENTIAL = 8 << 20  # bytes per read of a whole-file pass (a checkpoint's stream)
THREADS = 32

_POOL: concurrent.futures.ThreadPoolExecutor | None = None

# A pread / pwrite per row in a compiled loop (numba, nogil: the pool's threads run it in
# parallel without the GIL; Python's os.preadv per row holds it between calls, which costs
# more than the disk). None without numba.
try:
  import ctypes

  from numba import njit

  _libc = ctypes.CDLL(None, use_errno=True)
  _pread, _pwrite = _libc.pread, _libc.pwrite
  for _f in (_pread, _pwrite):
    _f.argtypes = [ctypes.c_int, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int64]
    _f.restype = ctypes.c_ssize_t

  @njit(nogil=True)
  def _rows_io(fd, rows, rec, header, base, write, status):  # pragma: no cover (compiled)
    """Records rows[i] <-> memory base + i * rec; status: (-1, 0), or (i, bytes) of the first
    short transfer."""
    for i in range(rows.shape[0]):
      off = header + rows[i] * rec
      got = _pwrite(fd, base + i * rec, rec, off) if write else _pread(fd, base + i * rec, rec, off)
      if got != rec:
        status[0], status[1] = i, got
        return
    status[0] = -1

except (ImportError, OSError):  # pragma: no cover
  _rows_io = None


def _pool() -> concurrent.futures.ThreadPoolExecutor:
  global _POOL
  if _POOL is None:
    _POOL = concurrent.futures.ThreadPoolExecutor(THREADS, thread_name_prefix="recgnn row io")
  return _POOL


def _aligned(nbytes: int, align: int = 4096) -> np.ndarray:
  """uint8[nbytes] whose address is a multiple of `align` (O_DIRECT's buffers must be): an
  anonymous mmap, page-aligned."""
  if nbytes == 0:
    return np.zeros(0, np.uint8)
  return np.frombuffer(mmap.mmap(-1, nbytes), np.uint8)


_BLOCKS: dict[str, int] = {}


def logical_block(path: str) -> int:
  """The block size O_DIRECT reads of `path`'s directory must align to: 512 where a 512-byte
  direct read works there, else 4096 (probed once per directory)."""
  if path not in _BLOCKS:
    _BLOCKS[path] = _probe_block(path)
  return _BLOCKS[path]


def _probe_block(path: str) -> int:
  probe = os.path.join(path, f".recgnn-probe-{os.getpid()}")
  fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
  try:
    os.ftruncate(fd, 8192)
    os.close(fd)
    fd = os.open(probe, os.O_RDONLY | os.O_DIRECT)
    buf = _aligned(4096)
    try:
      os.preadv(fd, [memoryview(buf)[:512]], 512)
      return 512
    except OSError as e:
      if e.errno != errno.EINVAL:
        raise
      return 4096
  finally:
    os.close(fd)
    os.unlink(probe)


def record_bytes(dim: int, slots: int, io: str, directory: str) -> int:
  """A row's bytes in its file: float32 row + slots, padded to the logical block under
  io=direct (512 or 4096: `logical_block`, probed in the directory if it exists, else 512),
  to 4 bytes under io=buffered."""
  logical = 4 * (dim + slots)
  if io != "direct":
    return logical
  block = logical_block(directory) if os.path.isdir(directory) else 512
  return -(-logical // block) * block


def _runs(rows: np.ndarray) -> list[tuple[int, int, int]]:
  """Sorted distinct rows -> [(first row, count, position in rows)] of consecutive runs,
  cut at CHUNK_ROWS (one pread / pwrite each)."""
  if rows.shape[0] == 0:
    return []
  cut = np.flatnonzero(np.diff(rows) != 1) + 1
  starts = np.concatenate([[0], cut])
  ends = np.concatenate([cut, [rows.shape[0]]])
  out = []
  for a, b in zip(starts.tolist(), ends.tolist()):
    for s in range(a, b, CHUNK_ROWS):
      out.append((int(rows[s]), min(CHUNK_ROWS, b - s), s))
  return out


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def remove_stale(directory: str) -> None:
  """Remove row files (and manifests) left by processes no longer alive (a kill -9)."""
  for name in os.listdir(directory):
    head, _, rest = name.partition(".pid")
    pid = rest.split(".", 1)[0]
    if not pid.isdigit() or SUFFIX not in rest or int(pid) == os.getpid() or _alive(int(pid)):
      continue
    with contextlib.suppress(FileNotFoundError):
      os.unlink(os.path.join(directory, name))


def make_dir(d: str) -> None:
  """Make the row files' directory; refuse one that cannot be made or written (the fix)."""
  try:
    os.makedirs(d, exist_ok=True)
  except OSError as e:
    raise ValueError(
      f"offload: storage=ssd:{d}: cannot create the directory ({e.strerror}); give a "
      "writable directory on a local SSD"
    ) from e
  if not os.access(d, os.W_OK | os.X_OK):
    raise ValueError(
      f"offload: storage=ssd:{d} is not writable by this user; give a writable directory"
    )


def check_space(d: str, files: list[RowFile]) -> None:
  """Refuse a directory short of the files' bytes (the numbers, and the fix)."""
  make_dir(d)
  need = sum(f.size - (os.path.getsize(f.path) if os.path.exists(f.path) else 0) for f in files)
  free = shutil.disk_usage(d).free
  if free < need:
    what = ", ".join(f"{f.table!r} {f.num_rows:,} rows x {f.record} B" for f in files)
    raise ValueError(
      f"offload: storage=ssd:{d} has {free:,} bytes free ({free / 2**30:.2f} GiB); the row "
      f"files need {need:,} bytes ({need / 2**30:.2f} GiB: the rows and their optimizer "
      f"state, {what}): free space "
      "there, or point storage= at a larger disk"
    )


class RowFile:
  """One table's records on disk (see the module docstring).

  directory: where (made if missing); table: the table's name; num_rows, dim, slots: the
  rows, their width and the optimizer slot names (one float32 each); io: "direct" or
  "buffered". The file is created (sized, its records zero) and its manifest written by
  `create`; reads and writes take sorted distinct rows and float32[n, record / 4] records."""

  def __init__(self, directory, table, num_rows, dim, slots, io="direct", tag=""):
    if io not in IO_MODES:
      raise ValueError(f"offload: unknown io {io!r}; available: {', '.join(IO_MODES)}")
    self.directory, self.table, self.io = directory, table, io
    make_dir(directory)
    self.num_rows, self.dim, self.slots = int(num_rows), int(dim), tuple(slots)
    self.logical_bytes = 4 * (self.dim + len(self.slots))
    self.record = record_bytes(self.dim, len(self.slots), io, directory)
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in table)
    self.path = os.path.join(directory, f"{safe}{tag}.pid{os.getpid()}{SUFFIX}")
    self.size = HEADER_BYTES + self.num_rows * self.record
    self.manifest: dict | None = None
    self._fd: int | None = None
    self.bytes_read = 0  # (the records this process asked for: compare /proc/self/io)
    self.bytes_written = 0

  @property
  def floats(self) -> int:
    """float32 per record (the row, its slots, the padding)."""
    return self.record // 4

  def header(self) -> bytes:
    meta = {
      "version": VERSION,
      "table": self.table,
      "rows": self.num_rows,
      "dim": self.dim,
      "slots": list(self.slots),
      "dtype": "float32",
      "record_bytes": self.record,
      "layout": "row-major records: row then slots, zero-padded",
    }
    text = MAGIC + json.dumps(meta, sort_keys=True).encode() + b"\n"
    if len(text) > HEADER_BYTES:
      raise ValueError(f"offload: table name {self.table!r} too long for a row file header")
    return text.ljust(HEADER_BYTES, b" ")

  # -- creation and verification

  def create(self, fill) -> None:
    """Write the file: header, then every record from `fill(first, count) -> float32[count,
    floats]` in chunks (O(chunk) memory), then the manifest (after an fsync: a manifest
    never describes a file not yet on disk)."""
    self.close(remove=True)
    remove_stale(self.directory)
    check_space(self.directory, [self])
    tmp = self.path + ".tmp"
    with open(tmp, "wb") as f:
      f.write(self.header())
      chunk = streamed.chunk_rows(self.record)  # (a restore's reads: the same bound)
      for a in range(0, self.num_rows, chunk):
        n = min(chunk, self.num_rows - a)
        f.write(np.ascontiguousarray(fill(a, n), np.float32).tobytes())
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, self.path)
    self.manifest = {
      "files": {os.path.basename(self.path): {"bytes": self.size,
                                              "head_sha256": file_check.head_sha256(self.path)}}
    }  # fmt: skip
    with open(self.path + ".json", "w") as f:
      json.dump(self.manifest, f)
    self.verify()
    self._open()

  def verify(self) -> None:
    """Refuse the file if it is not the one `create` wrote: size and head checksum against
    the manifest (file_check.check_files), and the header's fields against this table."""
    why = None
    if self.manifest is None:
      why = "no manifest records it (it was not written by this run)"
    else:
      why = file_check.check_files(
        self.directory, self.manifest, names=(os.path.basename(self.path),)
      )
    if why is None:
      with open(self.path, "rb") as f:
        head = f.read(HEADER_BYTES)
      if head != self.header():
        why = f"{self.path}'s header does not describe table {self.table!r} as this run has it"
    if why is not None:
      raise RuntimeError(
        f"offload: the row file of table {self.table!r} is damaged: {why}. It is scratch "
        "space: the checkpoint holds the tables. Rerun with --resume (a new row file is "
        "written from the latest checkpoint); if this repeats, check the disk."
      )

  def _open(self) -> None:
    flags = os.O_RDWR | (os.O_DIRECT if self.io == "direct" else 0)
    self._fd = os.open(self.path, flags)
    if self.io == "buffered":
      os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_RANDOM)

  def close(self, remove: bool = False) -> None:
    if self._fd is not None:
      os.close(self._fd)
      self._fd = None
    if remove:
      for p in (self.path, self.path + ".json"):
        with contextlib.suppress(FileNotFoundError):
          os.unlink(p)

  # -- rows

  def _io(self, rows: np.ndarray, buf: np.ndarray, write: bool) -> None:
    """Read (write) records rows (sorted, distinct) into (from) buf uint8[n, record], through
    the thread pool: the disk sees up to THREADS requests at once (its queue depth is what
    a random read needs). Compiled (`_rows_io`: a pread / pwrite per row, without the GIL)
    where numba is installed, else os.preadv / pwritev per run of consecutive rows."""
    fd = self._fd
    if fd is None:
      raise RuntimeError(f"offload: the row file {self.path} is not open (call create first)")
    rec, n = self.record, rows.shape[0]
    if _rows_io is not None:
      rows = np.ascontiguousarray(rows, np.int64)
      parts = max(1, min(THREADS, n // 32))
      cuts = np.linspace(0, n, parts + 1).astype(np.int64)
      base = buf.ctypes.data

      def part(i):
        a, b = int(cuts[i]), int(cuts[i + 1])
        status = np.zeros(2, np.int64)
        _rows_io(fd, rows[a:b], rec, HEADER_BYTES, base + a * rec, write, status)
        if status[0] >= 0:
          self._short(int(status[1]), rec, HEADER_BYTES + int(rows[a + status[0]]) * rec)

      list(_pool().map(part, range(parts))) if parts > 1 else part(0)
    else:
      flat = memoryview(buf.reshape(-1))

      def one(run):
        first, k, at = run
        view = flat[at * rec : (at + k) * rec]
        off = HEADER_BYTES + first * rec
        got = os.pwritev(fd, [view], off) if write else os.preadv(fd, [view], off)
        if got != k * rec:
          self._short(got, k * rec, off)

      runs = _runs(rows)
      list(_pool().map(one, runs)) if len(runs) > 2 else [one(r) for r in runs]
    if write:
      self.bytes_written += n * rec
    else:
      self.bytes_read += n * rec

  def _short(self, got: int, want: int, off: int):
    raise RuntimeError(
      f"offload: the row file {self.path} returned {got} of {want} bytes at offset {off} "
      "(truncated?). It is scratch space: rerun with --resume (a new row file is written "
      "from the latest checkpoint)."
    )

  def buffer(self, n: int) -> np.ndarray:
    """An aligned uint8[n, record] for `read` / `write` (O_DIRECT needs aligned memory)."""
    return _aligned(n * self.record).reshape(n, self.record)

  def read(self, rows: np.ndarray, buf: np.ndarray) -> None:
    self._io(rows, buf, write=False)

  def write(self, rows: np.ndarray, buf: np.ndarray) -> None:
    self._io(rows, buf, write=True)

  def read_all(self, first: int, n: int) -> np.ndarray:
    """float32[n, floats]: records first .. first + n - 1, read sequentially in SEQUENTIAL
    byte chunks (a checkpoint's stream, n = streamed.chunk_rows: far faster than a row at a
    time)."""
    if self._fd is None:
      raise RuntimeError(f"offload: the row file {self.path} is not open (call create first)")
    buf = self.buffer(n)
    flat, rec = memoryview(buf.reshape(-1)), self.record
    step = max(1, SEQUENTIAL // rec)
    for a in range(0, n, step):
      k = min(step, n - a)
      off = HEADER_BYTES + (first + a) * rec
      got = os.preadv(self._fd, [flat[a * rec : (a + k) * rec]], off)
      if got != k * rec:
        self._short(got, k * rec, off)
    self.bytes_read += n * rec
    return buf.view(np.float32)
