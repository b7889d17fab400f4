"""Compiled (numba) parsing of TSV / CSV blocks for `ctr_reader`, and the string-key hash.

`parse_block` reads every line of a block in one compiled pass: fields split on a one-byte
delimiter, the label ("0" / "1"), dense decimals, and categorical values turned into keys (a
one-byte bag separator; "string" values hashed by `hash_bytes`, "int" / "hex" integers mod
2^64), with the same checks in the same order as ctr_reader's per-line Python reader, which
stays for what this pass leaves to it: CSV lines holding a quote (reason NEEDS_PYTHON) and
schemas with multi-byte delimiters or separators. Without numba the same functions run as
plain Python (identical results, much slower).

String keys: FNV-1a 64 of the value's bytes, then splitmix64's finalizer (so nearby strings
land far apart under `key % size`); `ctr_schema.string_key` is the same in plain Python.
Dense decimals: [+-]digits[.digits][(e|E)[+-]digits] (also ".5" and "5."), computed as an
integer mantissa times a power of ten (within 2 ulp of Python's float(); the reader stores
float32).
"""

from __future__ import annotations

import numpy as np

try:
  from numba import njit

  AVAILABLE = True
except ImportError:  # plain Python: the same results, slower
  AVAILABLE = False

  def njit(*args, **kwargs):
    del args, kwargs
    return lambda f: f


# Per-line outcome codes (ctr_reader.REASONS maps them to names).
OK, COLUMNS, LABEL, DENSE, CATEGORICAL, BAG_LENGTH, NEEDS_PYTHON = 0, 1, 2, 3, 4, 5, 6
REASONS = {COLUMNS: "columns", LABEL: "label", DENSE: "dense", CATEGORICAL: "categorical",
           BAG_LENGTH: "bag_length"}  # fmt: skip
KIND_CODES = {"string": 0, "int": 1, "hex": 2}

_FNV_OFFSET = np.uint64(0xCBF29CE484222325)
_FNV_PRIME = np.uint64(0x100000001B3)


@njit(cache=True, nogil=True)
def _finalize(z):
  z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
  z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
  return z ^ (z >> np.uint64(31))


@njit(cache=True, nogil=True)
def _hash(buf, lo, hi):
  h = _FNV_OFFSET
  for i in range(lo, hi):
    h = (h ^ np.uint64(buf[i])) * _FNV_PRIME
  return _finalize(h)


@njit(cache=True, nogil=True)
def hash_spans(buf, starts, ends):
  """uint64 keys of the byte spans buf[starts[i]:ends[i]]."""
  out = np.empty(starts.shape[0], np.uint64)
  for i in range(starts.shape[0]):
    out[i] = _hash(buf, starts[i], ends[i])
  return out


def hash_bytes(values: list[bytes]) -> np.ndarray:
  """The string keys of many values at once: uint64[len(values)]."""
  lengths = np.fromiter((len(v) for v in values), np.int64, len(values))
  ends = np.cumsum(lengths)
  buf = np.frombuffer(b"".join(values), np.uint8)
  return hash_spans(buf, ends - lengths, ends)


@njit(cache=True, nogil=True)
def _integer(buf, lo, hi, hexa):
  """(ok, value mod 2^64) of a decimal ("-"? digits) or hex (digits) integer."""
  neg = False
  if not hexa and lo < hi and buf[lo] == 45:  # '-'
    neg = True
    lo += 1
  if lo >= hi:
    return False, np.uint64(0)
  v = np.uint64(0)
  base = np.uint64(16 if hexa else 10)
  for i in range(lo, hi):
    c = buf[i]
    if 48 <= c <= 57:
      d = c - 48
    elif hexa and 97 <= c <= 102:
      d = c - 87
    elif hexa and 65 <= c <= 70:
      d = c - 55
    else:
      return False, np.uint64(0)
    v = v * base + np.uint64(d)
  if neg:
    v = np.uint64(0) - v
  return True, v


@njit(cache=True, nogil=True)
def _decimal(buf, lo, hi):
  """(ok, value) of [+-]digits[.digits][(e|E)[+-]digits]; an empty field is (True, 0)."""
  if lo >= hi:
    return True, 0.0
  i = lo
  sign = 1.0
  if buf[i] == 45 or buf[i] == 43:
    sign = -1.0 if buf[i] == 45 else 1.0
    i += 1
  mant = 0.0
  digits = 0
  scale = 0
  while i < hi and 48 <= buf[i] <= 57:
    mant = mant * 10.0 + (buf[i] - 48)
    digits += 1
    i += 1
  if i < hi and buf[i] == 46:  # '.'
    i += 1
    while i < hi and 48 <= buf[i] <= 57:
      mant = mant * 10.0 + (buf[i] - 48)
      digits += 1
      scale -= 1
      i += 1
  if digits == 0:
    return False, 0.0
  if i < hi and (buf[i] == 101 or buf[i] == 69):  # 'e' / 'E'
    i += 1
    esign = 1
    if i < hi and (buf[i] == 45 or buf[i] == 43):
      esign = -1 if buf[i] == 45 else 1
      i += 1
    e = 0
    ed = 0
    while i < hi and 48 <= buf[i] <= 57:
      e = min(e * 10 + (buf[i] - 48), 100000)
      ed += 1
      i += 1
    if ed == 0:
      return False, 0.0
    scale += esign * e
  if i != hi:
    return False, 0.0
  v = sign * mant * 10.0**scale if scale >= 0 else sign * mant / 10.0 ** (-scale)
  if not np.isfinite(v):
    return False, 0.0
  return True, v


@njit(cache=True, nogil=True)
def parse_block(
  buf, line_starts, line_ends, delim, quote, ncols, label_col, dense_cols, cat_cols, kinds,
  bags, seps, overflow_error, offsets,
):  # fmt: skip
  """Parse lines buf[line_starts[i]:line_ends[i]] (no newline, no CR).

  Returns (reason int8[n], labels int8[n], dense float64[n, D], raw uint64[n, S],
  state uint8[n, S]); rows with reason != OK hold garbage. quote: a byte that sends the line
  to Python (CSV's '"'), or -1.
  """
  n = line_starts.shape[0]
  nd = dense_cols.shape[0]
  nc = cat_cols.shape[0]
  s = offsets[nc]
  reason = np.zeros(n, np.int8)
  labels = np.zeros(n, np.int8)
  dense = np.zeros((n, nd), np.float64)
  raw = np.zeros((n, s), np.uint64)
  state = np.zeros((n, s), np.uint8)
  fs = np.empty(ncols, np.int64)
  fe = np.empty(ncols, np.int64)
  for r in range(n):
    lo, hi = line_starts[r], line_ends[r]
    # Fields.
    k = 0
    start = lo
    bad = False
    for i in range(lo, hi + 1):
      if i < hi and quote >= 0 and buf[i] == quote:
        reason[r] = NEEDS_PYTHON
        bad = True
        break
      if i == hi or buf[i] == delim:
        if k >= ncols:
          reason[r] = COLUMNS
          bad = True
          break
        fs[k] = start
        fe[k] = i
        k += 1
        start = i + 1
    if bad:
      continue
    if k != ncols:
      reason[r] = COLUMNS
      continue
    a, b = fs[label_col], fe[label_col]
    if b - a != 1 or (buf[a] != 48 and buf[a] != 49):
      reason[r] = LABEL
      continue
    labels[r] = buf[a] - 48
    for j in range(nd):
      ok, v = _decimal(buf, fs[dense_cols[j]], fe[dense_cols[j]])
      if not ok:
        bad = True
        break
      dense[r, j] = v
    if bad:
      reason[r] = DENSE
      continue
    for t in range(nc):
      a, b = fs[cat_cols[t]], fe[cat_cols[t]]
      o = offsets[t]
      bag = bags[t]
      # Items: split on the separator (bag > 1), empty items skipped.
      count = 0
      p = a
      for i in range(a, b + 1):
        if i == b or (bag > 1 and buf[i] == seps[t]):
          if i > p:
            count += 1
          p = i + 1
      if count == 0:
        state[r, o] = 1  # EMPTY
        for q in range(o + 1, o + bag):
          state[r, q] = 2  # PADDED
        continue
      if count > bag and overflow_error[t]:
        reason[r] = BAG_LENGTH
        break
      m = 0
      p = a
      for i in range(a, b + 1):
        if m == bag:
          break
        if i == b or (bag > 1 and buf[i] == seps[t]):
          if i > p:
            if kinds[t] == 0:
              raw[r, o + m] = _hash(buf, p, i)
            else:
              ok, v = _integer(buf, p, i, kinds[t] == 2)
              if not ok:
                reason[r] = CATEGORICAL
                break
              raw[r, o + m] = v
            m += 1
          p = i + 1
      if reason[r] != OK:
        break
      for q in range(o + m, o + bag):
        state[r, q] = 2
  return reason, labels, dense, raw, state
