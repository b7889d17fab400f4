"""Text files read in blocks of whole lines: byte ranges cut after a newline, and each range
read into a padded buffer (so 8-byte loads of the compiled parsers never leave it). Shared by
the Criteo TSV parser (`criteo`) and the generic text format (`ctr_formats.TextFormat`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np

from recgnn.data.bad_lines import MalformedDataError

PAD_BYTES = 8  # slack before and after a block, so 8-byte loads never leave the buffer


def block_ranges(path: str, block_bytes: int) -> Iterator[tuple[int, int]]:
  """Byte ranges [start, stop) of about `block_bytes` each, cut after a newline.

  A line longer than `block_bytes` is an error (not a line-per-record text file, or raise
  block_bytes).
  """
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    start = 0
    while start < size:
      stop = start + block_bytes
      if stop >= size:
        yield start, size
        return
      f.seek(stop)
      scanned = 0
      while True:  # to the end of the line that holds byte stop - 1
        piece = f.read(1 << 16)
        found = piece.find(b"\n")
        if found >= 0:
          stop += scanned + found + 1
          break
        scanned += len(piece)
        if not piece or scanned > block_bytes:
          if not piece:  # the last line has no newline: it ends the file
            stop = size
            break
          raise MalformedDataError(
            f"{path}: no newline in {scanned:,} bytes after byte {stop:,}: not a TSV / CSV "
            f"file with one record per line (or a line longer than block_bytes={block_bytes}; "
            "raise the reader's block_bytes)"
          )
      yield start, stop
      start = stop


def read_range(path: str, start: int, stop: int) -> tuple[np.ndarray, int]:
  """Bytes [start, stop) of a file as a padded block: (uint8[PAD + size + PAD], size).

  A last line without its newline gets one.
  """
  n = stop - start
  buf = np.zeros(PAD_BYTES + n + 1 + PAD_BYTES, np.uint8)
  with open(path, "rb") as f:
    f.seek(start)
    got = f.readinto(memoryview(buf)[PAD_BYTES : PAD_BYTES + n])
  if got != n:
    raise OSError(f"{path}: read {got} bytes at {start}, expected {n} (file changed?)")
  if n and buf[PAD_BYTES + n - 1] != 10:
    buf[PAD_BYTES + n] = 10
    n += 1
  return buf, n


def iter_blocks(path: str, block_bytes: int) -> Iterator[tuple[np.ndarray, int, int]]:
  """Read a file in blocks of whole lines: yields (buf, size, end offset)."""
  for start, stop in block_ranges(path, block_bytes):
    buf, size = read_range(path, start, stop)
    yield buf, size, stop
