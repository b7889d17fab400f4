"""A one-hot CTR batch gathered from the converted arrays in one compiled pass (numba,
`nogil`): the rows' labels, dense features and ids copied into the batch's arrays (ids
transposed, one [B] row per table), padding rows left as `padded_batch` fills them.

Why: the input thread reads a batch for every step; numpy's fancy-index gathers, the
int8 -> float32 label copy and the ids' transpose are several passes holding the GIL
between them, against the thread that launches the steps. One pass without
the GIL is also fewer bytes touched. Without numba the same function runs as Python
(identical results, slow): `AVAILABLE` says which, and `ctr_dataset` then keeps numpy.

A large batch is read by several threads at once (`recgnn.hostpool`), each a contiguous
range of its positions: a random row read waits on memory, not on arithmetic, so threads keep
more of those misses in flight.
"""

from __future__ import annotations

from recgnn import hostpool

try:
  from numba import njit

  AVAILABLE = True
except ImportError:  # pragma: no cover (numba is a dependency)
  AVAILABLE = False

  def njit(*args, **kwargs):
    del args, kwargs
    return lambda f: f


# Fewest rows a thread's chunk gets: below it the pool's round trip costs more than the split
# saves, so a batch under 2 x this is one plain call (docs/running.md, "Measurements behind the
# host-side code").
MIN_ROWS_PER_CHUNK = 4096


def gather_one_hot(labels, dense, sparse, rows, out_label, out_dense, out_weight, out_ids):
  """Rows `rows` (int64[n], any order) of labels int8[N], dense float32[N, D] and sparse
  int32[N, S] into out_label float32[B], out_dense float32[B, D], out_weight float32[B]
  (1 for the n rows) and out_ids int32[S, B] (transposed), positions 0..n-1; split over
  `hostpool.threads()` when each chunk has MIN_ROWS_PER_CHUNK rows."""
  args = (labels, dense, sparse, rows)
  outs = (out_label, out_dense, out_weight, out_ids)
  cuts = hostpool.chunks(rows.shape[0], MIN_ROWS_PER_CHUNK)
  hostpool.run(lambda lo, hi: gather_rows(*args, lo, hi, *outs), cuts)


@njit(cache=True, nogil=True)
def gather_rows(labels, dense, sparse, rows, lo, hi, out_label, out_dense, out_weight, out_ids):
  """`gather_one_hot` of rows[lo:hi] only, into positions lo..hi-1."""
  # (views, then a loop from 0: the one-call loop's code; `range(lo, hi)` over the whole
  # arrays is slower per row)
  rows, out_label, out_weight = rows[lo:hi], out_label[lo:hi], out_weight[lo:hi]
  out_dense, out_ids = out_dense[lo:hi], out_ids[:, lo:hi]
  d = dense.shape[1]
  s = sparse.shape[1]
  for i in range(rows.shape[0]):
    r = rows[i]
    out_label[i] = labels[r]
    out_weight[i] = 1.0
    for j in range(d):
      out_dense[i, j] = dense[r, j]
    for t in range(s):
      out_ids[t, i] = sparse[r, t]
