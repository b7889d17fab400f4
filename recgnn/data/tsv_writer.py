"""Criteo TSV lines written vectorized (`format_tsv`): every field laid out at a fixed width
padded with NUL bytes, which are then dropped; decimals through 4-digit table lookups, hex
through 2-digit ones. The synthetic generator's writer."""

from __future__ import annotations

import numpy as np

from recgnn.data import criteo


def _digit_tables():
  """Tables of the vectorized decimal formatter (see `format_tsv`)."""
  quad = np.array([int.from_bytes(f"{i:04d}".encode(), "little") for i in range(10_000)], np.uint32)
  # Row r = ndigits + 13 * negative (row 26: missing) of 12-char masks and sign bytes.
  keep = np.zeros((27, 12), np.uint8)
  sign = np.zeros((27, 12), np.uint8)
  for nd in range(1, 10):
    for neg in (0, 1):
      keep[nd + 13 * neg, 12 - nd :] = 0xFF
      sign[nd + 13 * neg, 11 - nd] = ord("-") if neg else 0
  return quad, keep, sign


_QUAD, _KEEP12, _SIGN12 = _digit_tables()
_HEX_PAIR = np.array([int.from_bytes(f"{i:02x}".encode(), "little") for i in range(256)], "<u2")


def format_tsv(
  labels: np.ndarray,
  dense: np.ndarray,
  dense_missing: np.ndarray,
  raw: np.ndarray,
  missing: np.ndarray,
) -> bytes:
  """Criteo TSV lines, vectorized: every field is laid out at a fixed width padded with NUL
  bytes, which are then dropped.

  Args:
    labels: int[n] 0/1. dense: int[n, 13], |x| < 1e9. dense_missing: bool[n, 13].
    raw: uint32[n, 26] hex values. missing: bool[n, 26].
  """
  n = labels.shape[0]
  v = np.abs(dense).astype(np.uint32)
  # 12 zero-padded digits as three 4-digit table lookups, then a mask keeps the significant
  # ones and a sign byte goes before them.
  quads = np.stack([_QUAD[v // 100_000_000], _QUAD[v // 10_000 % 10_000], _QUAD[v % 10_000]], -1)
  ndig = np.ones(v.shape, np.int64)
  for k in range(1, 9):
    ndig += v >= 10**k
  row = np.where(dense_missing, 26, ndig + 13 * (dense < 0))
  dchars = (quads.view(np.uint8).reshape(n, -1, 12) & _KEEP12[row]) | _SIGN12[row]
  hchars = _HEX_PAIR[raw.astype(">u4").view(np.uint8)].view(np.uint8).reshape(n, -1, 8)
  hchars = hchars * ~missing[:, :, None]
  tab = np.full((n, 1), 9, np.uint8)
  cols = [(labels.astype(np.uint8) + 48)[:, None]]
  for k in range(criteo.NUM_DENSE):
    cols += [tab, dchars[:, k]]
  for t in range(criteo.NUM_SPARSE):
    cols += [tab, hchars[:, t]]
  cols.append(np.full((n, 1), 10, np.uint8))
  m = np.concatenate(cols, axis=1).ravel()
  return m[m != 0].tobytes()
