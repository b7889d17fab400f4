"""The device feed's streamed mode: train data larger than the devices' budget uploaded a window
of chunks at a time (`window_order`'s order), so the step still gathers its batch on the devices
by index and the host still does O(1) per call.

  on the devices   S window slots of rows (`data`: {"label", "dense", "sparse"} of S * W * C
                   rows, replicated) and their batches' orders (`orders`: int32[S, W * C / B,
                   B], indices into `data`); S = 2 (the window read and the next one, uploaded
                   meanwhile), 3 where a call of k steps can cross a pass's short last window
  background       one thread uploads, in order, each window's chunks (contiguous slices of the
                   dataset's arrays: the record's own bytes, no host gather), at most AHEAD of
                   them staged on the devices and not yet written into a slot; a window's order
                   is made on the devices from its keys (`window_order.permutation`'s, a few
                   words), the numpy order's value for value
  per call         `ensure_steps` (main thread): the windows the call reads resident (waiting for
                   their uploads only when the link is behind), staged chunks written into free
                   slots (an on-device copy, the old slot's buffer donated: it runs after every
                   step already dispatched that reads it)
  eval             each eval batch's rows (a contiguous slice, padded to the eval batch) uploaded
                   on the same thread as the input thread reaches it; the step reads it at (0, n)

A slot's window g (counted over passes: pass * windows + window) is written only when no step
still to be dispatched reads the window it replaces (g - S below the lowest window read by the
call being dispatched). Bytes uploaded are counted here (`report`): the trainer's link metric
reads the compiled step, which does not see these transfers.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np

from recgnn import sharding
from recgnn.data import window_order

#: Uploads (a window's order or one chunk) staged on the devices ahead of their slot.
AHEAD = 2
#: Eval batches the input thread may have uploaded ahead of the loop: its two queues' depths
#: (2 x PREFETCH) and the items in its threads' hands, rounded up.
EVAL_AHEAD = 8


def slots_for(order: window_order.WindowOrder, k: int) -> tuple[int, str | None]:
  """(window slots a call of k steps needs, or why no number does)."""
  if order.windows == 1 or k <= min(order.window_batches, order.last_batches):
    return 2, None
  if k <= order.window_batches:
    return 3, None  # (a call may read a full window, the short last one and the next pass's)
  return 0, (
    f"train.steps_per_call={k} is more than a window's {order.window_batches} batches "
    "(raise train.feed_chunk_rows or train.feed_window_chunks)"
  )


def device_bytes(rows, order: window_order.WindowOrder, slots: int) -> int:
  """Bytes a streamed feed holds per device: its slots, the staged uploads, the orders (and
  the uint32 temporaries of making one), and the eval batches in flight."""
  rb = rows.row_bytes
  need = slots * order.window_rows * rb + AHEAD * order.chunk_rows * rb
  need += (slots + 4) * order.window_batches * order.batch_size * 4
  return need + (EVAL_AHEAD + 1) * rows.eval_batch_size * rb


def window_for(tcfg, rows) -> window_order.WindowOrder | None:
  """The window order `rows` would stream in under this config (None: rows that do not)."""
  if not hasattr(rows, "dataset"):
    return None
  return window_order.for_train(tcfg, rows.dataset, rows.seed)


def check_fits(rows, order, k, plan_bytes: int, budget: int) -> str | None:
  """None when streaming `rows` in `order` fits beside the plan in `budget` bytes per device,
  else why not (the figures)."""
  slots, why = slots_for(order, k)
  if why:
    return why
  need = device_bytes(rows, order, slots)
  if plan_bytes + need <= budget:
    return None
  return (
    f"even streamed ({slots} windows of {order.window_chunks} chunks of "
    f"{order.chunk_rows:,} rows: {need / 2**20:,.1f} MiB per device) beside the plan "
    f"({plan_bytes / 2**20:,.1f} MiB) they exceed {budget / 2**20:,.1f} MiB per device"
  )


def _zeros(mesh, shapes):
  """Arrays of zeros of `shapes` (jax.ShapeDtypeStruct leaves) made on the devices (nothing
  crosses the link), replicated."""
  repl = sharding.named(mesh, sharding.REPLICATED)
  make = functools.partial(jax.tree.map, lambda s: jnp.zeros(s.shape, s.dtype), shapes)
  return jax.jit(make, out_shardings=repl)()


@functools.partial(jax.jit, donate_argnums=0)
def _write(data, chunk, at):
  """data's rows [at, at + len(chunk)) set to chunk (every leaf), data donated."""
  return jax.tree.map(lambda d, c: jax.lax.dynamic_update_slice_in_dim(d, c, at, 0), data, chunk)


def device_permutation(n: int, keys):
  """`window_order.permutation` in XLA (inside jit): uint32[n], the same values."""
  half = window_order.half_bits(n)
  x = window_order.feistel(jnp.arange(n, dtype=jnp.uint32), keys, half)

  def walk(x):
    return jnp.where(x >= n, window_order.feistel(x, keys, half), x)

  return jax.lax.while_loop(lambda x: jnp.any(x >= n), walk, x)


@functools.partial(jax.jit, donate_argnums=0, static_argnames=("n", "nb", "b", "c"))
def _write_order(orders, keys, ranks, first, slot, *, n, nb, b, c):
  """orders[slot, :nb] = a window's batches (`WindowOrder.window`'s local indices, made here
  from its keys; keys None: file order) + first (the slot's first row), orders donated."""
  if keys is None:
    local = jnp.arange(nb * b, dtype=jnp.int32)
  else:
    local = device_permutation(n, keys)[: nb * b].astype(jnp.int32)
  local = local.reshape(nb, b)
  key = ranks[local // c] * c + local % c
  _, local = jax.lax.sort((key, local), dimension=1, num_keys=1)
  return jax.lax.dynamic_update_slice(orders, (local + first)[None], (slot, 0, 0))


class Stream:
  """A run's streamed train rows (`rows.window`'s order) and eval batches on the devices, with
  the interface of `device_feed.Orders`: `cursor` / `batch_rows` of a step (input thread),
  `ensure_steps` before a call (main thread), `eval_cursors` / `next_eval`, `inputs`."""

  def __init__(self, rows, mesh, k: int):
    self.rows, self.mesh, self.order = rows, mesh, rows.window
    self.slots, why = slots_for(self.order, k)
    if why:
      raise ValueError(why)
    o, arrays = self.order, rows.arrays()
    self._arrays = arrays
    self._repl = sharding.named(mesh, sharding.REPLICATED)
    # (several XLA:CPU devices: launched after the step before them, as the steps are)
    self._launch = functools.partial(sharding.OneInFlight, mesh=mesh)
    cap = self.slots * o.window_rows
    self.data = _zeros(mesh, _rows_like(arrays, cap))
    self.orders = _zeros(
      mesh, jax.ShapeDtypeStruct((self.slots, o.window_batches, o.batch_size), jnp.int32)
    )
    self.eval_data = _zeros(mesh, _rows_like(arrays, rows.eval_batch_size))
    self._devices = mesh.devices.size
    self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="feed_stream")
    self._lock = threading.Lock()
    self._evals: collections.deque = collections.deque()
    self.train_bytes = self.eval_bytes = self.samples = 0
    self.start(0, 1)

  def start(self, first: int, end: int) -> None:
    """Steps [first, end) are read next (a run's start, or its resumption): uploads from the
    window of `first`, none past the window of end - 1."""
    self._queue: collections.deque = collections.deque()  # (g, i, future), submitted in order
    self._next = (self.order.sequence(first), -1)  # the next upload: window g's order (-1)
    self._resident = [-1] * self.slots  # the window complete in each slot
    self._low = self.order.sequence(first)
    self._last = self.order.sequence(max(end - 1, first))

  # -- the input thread's side -------------------------------------------------------------

  def cursor(self, step: int) -> tuple[int, int]:
    """(slot, batch in it) of train step `step`."""
    return self.order.sequence(step) % self.slots, self.order.locate(step)[2]

  def batch_rows(self, step: int) -> np.ndarray:
    return self.order.batch_rows(step)

  def eval_cursors(self, split: str):
    """`split`'s eval batches, lazily: (cursor (0, its rows), its dataset rows), batch
    [lo, min(lo + E, hi))'s upload queued as its cursor is made."""
    for lo, hi in self.rows.eval_cursors(split):
      stop = min(lo + self.rows.eval_batch_size, hi)
      self._evals.append(self._pool.submit(self._upload_eval, lo, stop))
      yield (0, stop - lo), np.arange(lo, stop)

  # -- the main thread's side -------------------------------------------------------------

  def inputs(self, train: bool) -> dict:
    if train:
      return {"data": self.data, "orders": self.orders}
    return {"data": self.eval_data}

  def next_eval(self) -> None:
    """The next eval batch's rows (uploaded in the order `eval_cursors` made them) current."""
    self.eval_data = self._evals.popleft().result()

  def ensure_steps(self, first: int, last: int) -> None:
    """Steps first..last (one call) read resident windows; more uploads started."""
    g0, g1 = self.order.sequence(first), self.order.sequence(last)
    self._low = g0
    self.samples += (last - first + 1) * self.order.batch_size
    for g in range(g0, g1 + 1):
      while self._resident[g % self.slots] != g:
        self._install_head(wait=True)
    self._pump()

  def _pump(self) -> None:
    """Write the finished uploads that have a free slot; keep AHEAD uploads in flight."""
    while self._queue and self._queue[0][2].done() and self._free(self._queue[0][0]):
      self._install_head(wait=False)
    while len(self._queue) < AHEAD and self._free(self._next[0]) and self._next[0] <= self._last:
      self._submit()

  def _free(self, g: int) -> bool:
    """Whether window g's slot holds nothing a call still to be dispatched reads."""
    return g - self.slots < self._low

  def _submit(self) -> None:
    g, i = self._next
    self._queue.append((g, i, self._pool.submit(self._upload, g, i)))
    n = len(self.order.window_chunk_ids(*divmod(g, self.order.windows)))
    self._next = (g, i + 1) if i + 1 < n else (g + 1, -1)

  def _install_head(self, wait: bool) -> None:
    if not self._queue:
      self._submit()
    g, i, future = self._queue.popleft()
    value = future.result() if wait else future.result(timeout=0)
    slot = g % self.slots
    if i < 0:  # (the window's order: its slot's old window is gone from here on)
      self._resident[slot] = -1
      self._write_order(g, slot, value)
      return
    at = slot * self.order.window_rows + i * self.order.chunk_rows
    self.data = self._launch(_write)(self.data, value, np.int32(at))
    if i == len(self.order.window_chunk_ids(*divmod(g, self.order.windows))) - 1:
      self._resident[slot] = g

  def _write_order(self, g: int, slot: int, value) -> None:
    """Window g's order made on the devices into `slot` (its keys and chunk ranks, `value`,
    cross the link: counted)."""
    o, (keys, ranks) = self.order, value
    n = o.window_rows_of(*divmod(g, o.windows))
    first = np.int32(slot * o.window_rows)
    self.orders = self._launch(_write_order)(
      self.orders, keys, ranks, first, np.int32(slot),
      n=n, nb=n // o.batch_size, b=o.batch_size, c=o.chunk_rows,
    )  # fmt: skip
    with self._lock:
      self.train_bytes += (_nbytes((keys, ranks)) + 8) * self._devices

  # -- the upload thread -------------------------------------------------------------------

  def _put(self, host) -> object:
    out = jax.device_put(host, self._repl)
    jax.block_until_ready(out)
    return out

  def _upload(self, g: int, i: int):
    """Window g's order's keys and chunk ranks (i = -1: host arrays, a few words) or its chunk
    i's rows (on the devices)."""
    epoch, window = divmod(g, self.order.windows)
    if i < 0:
      return self.order.keys(epoch, window), self.order.ranks(epoch, window)
    lo, hi = self.order.chunk(self.order.window_chunk_ids(epoch, window)[i])
    host = {n: np.ascontiguousarray(a[lo:hi]) for n, a in self._arrays.items()}
    out = self._put(host)
    with self._lock:
      self.train_bytes += _nbytes(host) * self._devices
    return out

  def _upload_eval(self, lo: int, stop: int):
    e = self.rows.eval_batch_size
    host = {}
    for n, a in self._arrays.items():
      host[n] = np.zeros((e,) + a.shape[1:], a.dtype)
      host[n][: stop - lo] = a[lo:stop]
    out = self._put(host)
    with self._lock:
      self.eval_bytes += _nbytes(host) * self._devices
    return out

  def report(self) -> dict:
    """The feed's own host-to-device bytes: train (windows' rows and orders, every device's
    copy) and per train sample per device (beside the record's bytes), eval."""
    with self._lock:
      train, evals = self.train_bytes, self.eval_bytes
    return {
      "feed/host_to_device_bytes": train,
      "feed/host_to_device_bytes_per_sample": train / self._devices / max(self.samples, 1),
      "feed/record_bytes": self.rows.row_bytes,
      "feed/eval_host_to_device_bytes": evals,
    }

  def close(self) -> None:
    self._pool.shutdown(wait=False, cancel_futures=True)


def _rows_like(arrays: dict, n: int) -> dict:
  return {k: jax.ShapeDtypeStruct((n,) + a.shape[1:], a.dtype) for k, a in arrays.items()}


def _nbytes(tree) -> int:
  return sum(int(np.asarray(x).nbytes) for x in jax.tree.leaves(tree))
