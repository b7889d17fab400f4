"""Files the project writes and reads back, verified before use: the one mechanism.

Whoever writes a set of files records each one's bytes and the SHA-256 of its first
HEAD_BYTES (`file_records`) in a manifest written after them; whoever reads them back calls
`check_files` first, which stats each file and hashes its head: a truncated copy, a
half-written file, another build's file or a damaged header is caught in O(files) (a stat and
64 KiB read each), never read as data. The caller then refuses the files naming the path and
the fix, or rebuilds them where their source is at hand.

Users: the CTR memmap caches (`ctr_cache`: the manifest's "files"), the generated synthetic
Criteo data (`criteo_synthetic`: its description's "files"), the graph caches of
`graph_loading` (node orders, eigenvector inits: a sidecar manifest per file,
`write_sidecar` / `sidecar_problem`) and the TFDS builds of `tfds_builders` (a manifest in
each build's folder). The import path `recgnn.data.file_check` is stable: other tiers (e.g.
on-disk row files) reuse it.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from typing import Any

HEAD_BYTES = 1 << 16  # the bytes of each file whose checksum a manifest records
SIDECAR = ".manifest.json"  # `write_sidecar`'s file beside the one it describes


def head_sha256(path: str) -> str:
  """The hex SHA-256 of the first HEAD_BYTES of `path`."""
  with open(path, "rb") as f:
    return hashlib.sha256(f.read(HEAD_BYTES)).hexdigest()


def file_records(folder: str, names: Iterable[str]) -> dict[str, dict[str, Any]]:
  """{name: {"bytes", "head_sha256"}} of the files `names` (relative to `folder`): what a
  manifest records when they are written and `check_files` compares before they are read."""
  out = {}
  for name in names:
    path = os.path.join(folder, name)
    out[name] = {"bytes": os.path.getsize(path), "head_sha256": head_sha256(path)}
  return out


def check_files(
  folder: str, manifest: dict[str, Any], names: Iterable[str] | None = None
) -> str | None:
  """None if every file `names` (default: every file the manifest's "files" records) under
  `folder` has the bytes and head checksum the manifest recorded, else what differs, naming
  the file (never read as data)."""
  want = manifest.get("files")
  if not isinstance(want, dict) or not want:
    return "its manifest records no file sizes (written before they were checked)"
  for name in want if names is None else names:
    f = os.path.join(folder, name)
    if not os.path.isfile(f):
      return f"{f} is missing"
    size, rec = os.path.getsize(f), want.get(name)
    if not isinstance(rec, dict):
      return f"{f} is not in its manifest"
    if size != rec.get("bytes"):
      return f"{f} has {size:,} bytes where its manifest records {rec.get('bytes') or 0:,}"
    if head_sha256(f) != rec.get("head_sha256"):
      return f"{f}'s first bytes differ from what its manifest records (another file?)"
  return None


def read_manifest(path: str) -> dict[str, Any] | None:
  """The JSON object at `path`, or None when it is missing or not a JSON object (a damaged
  or half-written manifest is no manifest: what it describes is not trusted)."""
  try:
    with open(path) as f:
      manifest = json.load(f)
  except (OSError, ValueError):
    return None
  return manifest if isinstance(manifest, dict) else None


def write_manifest(path: str, manifest: dict[str, Any]) -> None:
  """`manifest` as JSON at `path`, through a temporary file renamed into place (a crash
  leaves the old manifest or none, never half of one)."""
  tmp = f"{path}.{os.getpid()}.tmp"
  with open(tmp, "w") as f:
    json.dump(manifest, f, indent=1)
  os.replace(tmp, path)


def write_sidecar(path: str, key: Any) -> None:
  """Record the single file `path` (written just before, completely) in `path`.manifest.json
  with `key`, what it was made from (a later `sidecar_problem` with another key: stale)."""
  folder, name = os.path.split(os.path.abspath(path))
  write_manifest(path + SIDECAR, {"key": key, "files": file_records(folder, [name])})


def sidecar_problem(path: str, key: Any) -> str | None:
  """None if `path` is what its sidecar manifest records (the same `key`, its bytes and head
  checksum), else why not (the caller rebuilds the file or refuses it)."""
  if not os.path.exists(path):
    return f"{path} does not exist"
  manifest = read_manifest(path + SIDECAR)
  if manifest is None:
    return f"{path} has no readable manifest {path + SIDECAR}"
  if manifest.get("key") != key:
    return f"{path} was made from other inputs (its manifest's key differs)"
  folder, name = os.path.split(os.path.abspath(path))
  return check_files(folder, manifest, [name])
