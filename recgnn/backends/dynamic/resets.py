"""A dynamic table's resets, host side: the rows a batch reuses and their new initial values,
made on the input thread in stream order and carried with the prepared batch.

resets = {"slots": int32[R], "rows": f32[R, D]}: R a power of two >= 8 (0 when the table
can never reuse a row), the padding slots RESET_PAD (out of range: dropped by the scatter);
as made, also "at" int32[R] (where the batch first reads each row), which the inner
backend's `place_resets` reads and drops.
A row's new values are the table's initializer's distribution at the inner table's size
(`uniform`: U(-1/sqrt(capacity), 1/sqrt(capacity)); `normal`: N(0, 1) / sqrt(D); `zeros`),
drawn from numpy's generator seeded with (seed, table, the table's count of resets so far):
the same on every process and mesh, and after a resume.
"""

from __future__ import annotations

import zlib

import numpy as np

from recgnn.embeddings import base

#: The padding slot of a reset list: past any table, dropped by `.at[].set(mode="drop")`.
RESET_PAD = np.iinfo(np.int32).max


def bucket(n: int) -> int:
  """The list length for n resets: 0, or a power of two >= 8 (few step shapes)."""
  return 0 if n == 0 else max(8, 1 << (n - 1).bit_length())


def initial_rows(spec: base.TableSpec, seed: int, first: int, n: int) -> np.ndarray:
  """f32[n, D]: new initial values for resets first .. first + n - 1 of table `spec`."""
  rng = np.random.default_rng([seed, zlib.crc32(spec.name.encode()), first])
  if spec.initializer == "uniform":
    s = 1.0 / np.sqrt(spec.num_rows)
    return rng.uniform(-s, s, (n, spec.dim)).astype(np.float32)
  if spec.initializer == "normal":
    return (rng.standard_normal((n, spec.dim)) / np.sqrt(spec.dim)).astype(np.float32)
  return np.zeros((n, spec.dim), np.float32)


def make(
  spec: base.TableSpec,
  slots: np.ndarray,
  seed: int,
  first: int,
  reuses: bool,
  length: int = -1,
  at: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
  """The resets of one batch: `slots` (the map's resets), their rows, padded to `length`
  (default `bucket(len(slots))`; 0 when the table never `reuses` rows); with `at` (where
  the batch first reads each, `IdMap.map_at`) "at" too, for `Backend.place_resets`."""
  n = len(slots)
  size = (bucket(n) if reuses else 0) if length < 0 else length
  out_slots = np.full(size, RESET_PAD, np.int32)
  out_slots[:n] = slots
  rows = np.zeros((size, spec.dim), np.float32)
  rows[:n] = initial_rows(spec, seed, first, n)
  out = {"slots": out_slots, "rows": rows}
  if at is not None:
    out["at"] = np.full(size, RESET_PAD, np.int32)
    out["at"][:n] = at
  return out


def pad(resets: dict[str, np.ndarray], length: int) -> dict[str, np.ndarray]:
  """The same resets padded to `length` entries (a call's k batches stacked to one shape)."""
  n = resets["slots"].shape[0]
  slots = np.full(length, RESET_PAD, np.int32)
  slots[:n] = resets["slots"]
  rows = np.zeros((length, resets["rows"].shape[1]), np.float32)
  rows[:n] = resets["rows"]
  return {"slots": slots, "rows": rows}
