"""Every file of a committed checkpoint with its size and CRC-32, written after Orbax's commit
and checked before a restore (recgnn.train.checkpoint): bit rot or a truncated copy is found
before Orbax reads a byte, and named."""

from __future__ import annotations

import json
import os
import zlib

CHECKSUMS = "recgnn_checksums.json"


def file_checksums(directory: str, known: dict | None = None) -> dict[str, list[int]]:
  """{relative path: [size, crc32]} of every file under `directory` but the checksum file;
  `known`: files whose [size, crc32] their writer computed (taken where the size matches)."""
  out = {}
  for root, _, files in os.walk(directory):
    for name in sorted(files):
      path = os.path.join(root, name)
      rel = os.path.relpath(path, directory)
      if rel == CHECKSUMS:
        continue
      if known and rel in known and known[rel][0] == os.path.getsize(path):
        out[rel] = list(known[rel])  # (a streamed table's: not read a second time)
        continue
      crc = 0
      with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
          crc = zlib.crc32(chunk, crc)
      out[rel] = [os.path.getsize(path), crc]
  return out


def verify_checksums(directory: str) -> str | None:
  """None if `directory`'s files match its checksum file (or it has none), else what differs."""
  path = os.path.join(directory, CHECKSUMS)
  if not os.path.exists(path):
    return None
  try:
    with open(path) as f:
      expected = json.load(f)
  except (OSError, ValueError) as e:
    return f"{CHECKSUMS} unreadable ({e})"
  actual = file_checksums(directory)
  for rel, (size, crc) in sorted(expected.items()):
    if rel not in actual:
      return f"file {rel} missing"
    if actual[rel][0] != size:
      return f"file {rel} has {actual[rel][0]} bytes, {size} when saved"
    if actual[rel][1] != crc:
      return f"file {rel} differs from when it was saved (CRC-32)"
  return None
