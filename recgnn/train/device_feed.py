"""The device feed (`train.feed=device`): the training data on the devices, each step
gathering its batch there by index, so the host does O(1) per call whatever the batch size.

  placed once      the task's rows (`Task.device_rows`: CTR's labels, dense features and ids),
                   replicated on every device: a step reads any row without communication
  per pass         the epoch's order, int32[batches, B] (the host feed's batches, row for
                   row), made on a background thread ahead of its pass and placed; the device
                   keeps two passes' (a call of k steps may cross into the next pass)
  per call         a cursor per step, int32[2]: (pass slot, batch) for a train step, (first
                   row, split stop) for an eval batch; packed and put as the host feed packs
  in the step      rows = order[slot, batch] (or first + arange); each device gathers its
                   examples' rows (`shard_map`, no communication); groups that declare
                   `Capabilities.prepares_on_device` prepare their ids there (dense, sharded)

Groups that prepare on the host (tt, offload, hot_cold: cache plans, prefix trees, host
tiers) get their tables' ids read on the host from the same rows (`CTRRows.host_ids`: ids
only, not whole batches), prepared in stream order by the input thread as with the host feed,
and packed beside the cursor; labels, dense features and every other id come from the devices.

Data larger than the devices' budget streams (`feed_stream`): windows of large chunks uploaded
ahead by a background thread, the train order then `window_order`'s (the host feed's under
train.order=window); the step reads the resident windows as it reads the whole data here.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np

from recgnn import planner, sharding
from recgnn.embeddings import base
from recgnn.train import feed_rows, feed_stream, inputs
from recgnn.train import feeder as feeder_lib
from recgnn.train import step as step_lib
from recgnn.train.input_thread import InputThread
from recgnn.train.task import Task

FEEDS = ("auto", "device", "host")


def host_groups(plan: planner.Plan) -> list[str]:
  """Keys of the groups whose ids the host reads and prepares under the device feed."""
  return [k for k, g in plan.groups.items() if not g.capabilities.prepares_on_device]


def choose(task: Task, rules, specs, mesh, setting: str) -> tuple[bool, object, str]:
  """Whether the run uses the device feed, decided before the plan is built (its layout says
  `ids_on_device`): -> (device, the task's rows or None, a line saying which and why).

  "auto" takes it on accelerators when the task's data can live on the devices, this is one
  process, and every group of the plan prepares its ids on the device; "device" also with
  groups that prepare on the host (their ids read on the host), and on CPU devices; "host"
  never. Whether the data fits the devices is checked once the plan's bytes are known
  (`check_fits`)."""
  if setting not in FEEDS:
    raise ValueError(f"train.feed={setting!r}; valid: {', '.join(FEEDS)}")
  if setting == "host":
    return False, None, "host feed (train.feed=host): batches read and packed on the host"
  if setting == "auto" and mesh.devices.flat[0].platform == "cpu":
    return False, None, "host feed: CPU devices (train.feed=device puts the data on them)"
  rows = task.device_rows()
  why = [rows] if isinstance(rows, str) else []
  texts = sorted(planner.assign_rules(rules, specs))
  on_host = [t for t in texts if not planner.capabilities_of(t).prepares_on_device]
  if jax.process_count() > 1 and not why:
    why += _processes_why(rows, mesh, on_host)
  if setting == "auto" and on_host:
    why.append(
      f"backends {on_host} prepare their ids on the host (train.feed=device reads "
      "only their ids there)"
    )
  if why:
    if setting == "device":
      raise ValueError(f"train.feed=device, but {'; '.join(why)}. Use train.feed=auto or host.")
    return False, None, "host feed: " + "; ".join(why)
  how = "device feed: the data on the devices, each step gathers its batch there"
  if on_host:
    how += f" (ids of {', '.join(on_host)} read and prepared on the host)"
  return True, rows, how


def _processes_why(rows, mesh, on_host) -> list[str]:
  """Why P > 1 processes cannot each hold only their own rows (`feed_rows.PerProcess`)."""
  count, why = jax.process_count(), []
  if rows.shards % count:
    why.append(
      f"{count} processes read train.order_shards={rows.shards}'s batches from every row "
      f"(train.order_shards={count} lets each hold only its own shards' rows)"
    )
  if rows.window is not None:
    why.append(f"{count} processes: train.order=window streams in one process")
  if on_host:
    why.append(f"{count} processes: backends {on_host} prepare their ids on the host")
  if _process_block(mesh) is None:
    why.append("this process's devices are not one contiguous block of the batch")
  return why


def _process_block(mesh) -> int | None:
  owners = [d.process_index for d in mesh.devices.flat]
  return inputs.device_block(owners, jax.process_index(), jax.process_count())


def placement_for(rows, mesh):
  """Where the rows live (`feed_rows`): all on every device, or with several processes each
  process's own on its devices."""
  if jax.process_count() == 1:
    return feed_rows.Replicated(rows, mesh)
  return feed_rows.PerProcess(rows, mesh, _process_block(mesh), jax.process_count())


def check_fits(rows, plan_bytes: int, budget: int | None, mesh) -> str | None:
  """None when a copy of `rows` fits beside the plan on every device, else why not (the
  figures). budget: bytes per device (None: the device's own memory where jax reports it;
  XLA:CPU's simulated devices share the host's RAM, so there a quarter of it over them)."""
  one = jax.process_count() == 1
  need = feed_rows.Replicated.nbytes(rows) if one else feed_rows.PerProcess.nbytes(rows)
  if budget is None:
    budget = _device_memory(mesh)
  if budget is None or plan_bytes + need <= budget:
    return None
  return (
    f"the data ({need / 2**20:,.1f} MiB per device) and the plan "
    f"({plan_bytes / 2**20:,.1f} MiB) exceed {budget / 2**20:,.1f} MiB per device"
  )


def _device_memory(mesh) -> int | None:
  device = mesh.devices.flat[0]
  if device.platform == "cpu":
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return ram // (4 * len(jax.local_devices()))
  stats = device.memory_stats() or {}
  return stats.get("bytes_limit")


def check_ids(rows, specs) -> None:
  """Every id within its table (sharded's host prepare checks each batch; here once)."""
  for t, top in rows.max_ids().items():
    if t in specs and top >= specs[t].num_rows:
      raise ValueError(
        f"the data's ids of table {t!r} reach {top}, past its {specs[t].num_rows:,} rows"
      )


class Orders:
  """Each pass's train order (`rows.train_order`), made on a background thread one pass
  ahead, kept on the host (for the host-prepared groups' ids) and on the devices: a
  [2, batches, B] array whose slot e % 2 holds pass e (`ensure`, main thread)."""

  def __init__(self, rows, mesh):
    self.rows, self.mesh = rows, mesh
    self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="orders")
    self._lock = threading.Lock()
    self._host: dict[int, concurrent.futures.Future] = {}
    self._slots = [-1, -1]
    nb, b = rows.train_batches, rows.batch_size
    self.device = sharding.put(np.zeros((2, nb, b), np.int32), self._replicated())

  def _replicated(self):
    return sharding.named(self.mesh, sharding.REPLICATED)

  def host(self, epoch: int) -> np.ndarray:
    """Pass `epoch`'s order (int32[batches, B]); the next pass's starts being made."""
    with self._lock:
      for e in (epoch, epoch + 1):
        if e not in self._host:
          self._host[e] = self._pool.submit(self.rows.train_order, e)
      for e in [e for e in self._host if e < epoch - 1]:
        del self._host[e]
      future = self._host[epoch]
    return future.result()

  def cursor(self, step: int) -> tuple[int, int]:
    """(pass slot, batch) of train step `step`."""
    e, b = divmod(step, self.rows.train_batches)
    return e % 2, b

  def batch_rows(self, step: int) -> np.ndarray:
    e, b = divmod(step, self.rows.train_batches)
    return self.host(e)[b]

  def ensure_steps(self, first: int, last: int) -> None:
    """The passes of steps first..last (one call) resident."""
    nb = self.rows.train_batches
    self.ensure(first // nb, last // nb)

  def ensure(self, first: int, last: int) -> None:
    """Passes first..last (at most two in a row) resident in their slots."""
    for e in range(first, last + 1):
      if self._slots[e % 2] != e:
        order = sharding.put(self.host(e), self._replicated())
        # (several XLA:CPU devices: launched after the step before it, as steps are)
        set_slot = sharding.OneInFlight(_set_slot, self.mesh)
        self.device = set_slot(self.device, order, e % 2)
        self._slots[e % 2] = e

  def close(self) -> None:
    self._pool.shutdown(wait=False, cancel_futures=True)


@functools.partial(jax.jit, donate_argnums=0, static_argnums=2)
def _set_slot(orders, order, slot):
  return orders.at[slot].set(order)


def gather(mesh, rows_source, placement, data, rows, valid):
  """The batch of `rows` (int32[B] into each device's copy, `feed_rows`), each device
  gathering its own examples' rows from its copy of `data`: batch-split leaves, no
  communication."""

  @functools.partial(
    jax.shard_map,
    mesh=mesh,
    in_specs=(placement.spec(data), sharding.BATCH_SPEC, sharding.BATCH_SPEC),
    out_specs=sharding.BATCH_SPEC,
    check_vma=False,
  )
  def local(data, rows, valid):
    return rows_source.gather(placement.local(data), rows, valid)

  return local(data, rows, valid)


def fed_step(step_fn, plan: planner.Plan, rows_source, placement, train: bool):
  """step_fn(state, prepared, batch) -> f(state, prepared, batch, inputs) over the device
  feed's packed (host groups' prepared, {"cursor": int32[2]}) and inputs {"data", "orders"}:
  the batch gathered on the devices (where `placement` keeps its rows), the other groups'
  ids prepared there."""
  on_device = [k for k in plan.groups if k not in host_groups(plan)]

  def fn(state, prepared, batch, inputs):
    cursor = batch["cursor"]
    data = inputs["data"]
    if train:
      rows = placement.train_rows(inputs["orders"][cursor[0], cursor[1]])
      valid = jnp.ones(rows.shape, bool)
    else:
      rows, valid = placement.eval_rows(cursor)
    full = gather(plan.mesh, rows_source, placement, data, rows, valid)
    ids = full.pop("ids")
    prepared = dict(prepared)
    for key in on_device:
      group = plan.groups[key]
      prepared[key] = group.prepare_on_device({t: ids[t] for t in group.specs})
    return step_fn(state, prepared, full)

  return fn


def stream(feed, start, total, k, eval_every, eval_split, final):
  """The items `input_thread.stream` yields, for `feed` (a DeviceFeed): (kind, split, batch)
  with batch {"cursor": int32[2], "ids": the host-prepared groups' ids (`host_tables`)}."""
  rows, orders, host_tables = feed.rows, feed.orders, feed.host_tables
  for s in range(start, total, k):
    for step in range(s, s + k):
      ids = rows.host_ids(orders.batch_rows(step), host_tables) if host_tables else {}
      yield "train", None, {"cursor": np.array(orders.cursor(step), np.int32), "ids": ids}
    if eval_every and (s + k) % eval_every == 0 and s + k < total:
      yield from _eval_pass(feed, eval_split)
  for split in final:
    yield from _eval_pass(feed, split)


def _eval_pass(feed, split: str):
  """One eval pass's items: the cursors of `feed.eval_cursors` (lazily: a streamed feed
  queues each batch's upload as its cursor is made), host-read ids beside them."""
  for cursor, host_rows in feed.eval_cursors(split):
    ids = {}
    if feed.host_tables:
      ids = feed.rows.host_ids(host_rows, feed.host_tables, feed.rows.eval_batch_size)
    yield "eval", split, {"cursor": np.array(cursor, np.int32), "ids": ids}
  yield "eval_end", split, None


class Counts:
  """What the input thread's packing asks of a task, for cursor batches: every train item
  counts `batch_size` examples."""

  def __init__(self, batches_per_call: int, batch_size: int):
    self.batches_per_call, self._size = batches_per_call, batch_size

  def num_examples(self, batch) -> int:
    del batch
    return self._size


class DeviceFeed:
  """A run's device feed: its rows placed on the devices (replicated), the pass orders, and
  the host half: the plan of the groups that prepare on the host and the feeder that packs
  their prepared ids beside each step's cursor. Rows with a window order (`rows.window`)
  stream instead (`feed_stream.Stream` in place of the data and `Orders`; k: steps per call)."""

  def __init__(self, rows, plan: planner.Plan, k: int = 1):
    self.rows, self.mesh = rows, plan.mesh
    self.data = None
    self.placement = placement_for(rows, plan.mesh)
    if getattr(rows, "window", None) is not None:
      self.orders = feed_stream.Stream(rows, plan.mesh, k)
    else:
      self.data = self.placement.place()
      self.orders = Orders(rows, plan.mesh)
    keys = host_groups(plan)
    self.host_plan = planner.Plan(
      groups={k: plan.groups[k] for k in keys},
      table_group={t: k for t, k in plan.table_group.items() if k in keys},
      mesh=plan.mesh,
      # (the cursors are the same in every process: packed whole, not as process slices)
      layout=dataclasses.replace(plan.layout, process_local=False),
    )
    self.host_tables = tuple(self.host_plan.table_group)
    self.feeder = feeder_lib.Feeder(self.host_plan, _replicated_spec)

  def train_inputs(self) -> dict:
    """The train step's inputs now: the rows and the resident passes' orders."""
    if self.data is None:
      return self.orders.inputs(train=True)
    return {"data": self.data, "orders": self.orders.device}

  def eval_inputs(self) -> dict:
    """The eval step's inputs now: the rows (streamed: the current eval batch's)."""
    return self.orders.inputs(train=False) if self.data is None else {"data": self.data}

  def eval_cursors(self, split: str):
    """[(cursor, the batch's dataset rows or None)] of `split`'s eval batches."""
    if self.data is None:
      return self.orders.eval_cursors(split)
    return self.placement.eval_cursors(split)

  def report(self) -> dict:
    """The feed's own uploads (streamed: `Stream.report`), else {}."""
    return self.orders.report() if self.data is None else {}

  def input(self, task: Task, start: int, total: int, eval_every: int, eval_split, final):
    """The loop's input for steps [start, total) (`DeviceInput`)."""
    k = task.batches_per_call
    if k > self.rows.train_batches:
      raise ValueError(
        f"train.steps_per_call={k} is more than a pass's {self.rows.train_batches} batches"
      )
    if self.data is None:
      self.orders.start(start, total)
    items = stream(self, start, total, k, eval_every, eval_split, final)
    return DeviceInput(self, items, start, k)

  def close(self) -> None:
    self.orders.close()


def _replicated_spec(batch):
  return jax.tree.map(lambda _: sharding.REPLICATED, batch)


class DeviceInput:
  """The loop's input under the device feed (`input_thread.InputThread`'s interface): the
  cursors, and the host-prepared groups' ids, prepared and packed ahead on the input thread;
  `get` (main thread) makes the passes the next call reads resident first."""

  def __init__(self, feed: DeviceFeed, items, start: int, k: int):
    self._feed, self._step, self._k = feed, start, k
    counts = Counts(k, feed.rows.batch_size)
    self._thread = InputThread(items, feed.host_plan, feed.feeder, base.PREFETCH, task=counts)
    self.worker = None

  @property
  def busy_seconds(self) -> float:
    return self._thread.busy_seconds

  def get(self):
    item = self._thread.get()
    if item is not None and item.kind == "train":
      self._feed.orders.ensure_steps(self._step, self._step + self._k - 1)
      self._step += self._k
    elif item is not None and item.kind == "eval" and self._feed.data is None:
      self._feed.orders.next_eval()
    return item

  def close(self) -> None:
    self._thread.close()


def jit_steps(task, plan, tx, shardings, feed: DeviceFeed):
  """`jit_steps` under the device feed: the shared steps over cursor batches."""
  train = fed_step(step_lib.make_train_step(task, plan, tx), plan, feed.rows, feed.placement, True)
  train_step = step_lib.jit_packed(
    train, plan, shardings, donate_state=True, out_state=True, name="train_step",
    step_inputs=feed.train_inputs(), stacked=task.batches_per_call, inputs_of=feed.train_inputs,
  )  # fmt: skip
  evals = fed_step(step_lib.make_eval_step(task, plan), plan, feed.rows, feed.placement, False)
  eval_step = step_lib.jit_packed(
    evals, plan, shardings, donate_state=False, out_state=False, name="eval_step",
    step_inputs=feed.eval_inputs(), inputs_of=feed.eval_inputs,
  )  # fmt: skip
  return train_step, eval_step


def layout_for(tcfg, task, rules, specs, layout, mesh):
  """(layout with `ids_on_device` set, the task's rows or None, a line saying which feed)."""
  setting = tcfg.get("feed", "auto")
  on, rows, how = choose(task, rules, specs, mesh, setting)
  return dataclasses.replace(layout, ids_on_device=on), rows, how


def fits(tcfg, rows, plan_bytes, budget, mesh) -> str | None:
  """None when the device feed's rows fit beside the plan, whole or streamed (`rows.window`
  then set: data larger than the budget whose window of chunks fits streams, and so does
  train.order=window); with train.feed=auto why not (the host feed is then used); with
  train.feed=device refused before allocating."""
  window = getattr(rows, "window", None)
  why = None if window is not None else check_fits(rows, plan_bytes, budget, mesh)
  if why and rows.shards > 1:  # (a window order would not be the sharded order asked for)
    why += f"; train.order_shards={rows.shards} is not streamed (train.order_shards=1 is)"
  elif why and jax.process_count() == 1:  # (streaming runs in one process)
    window = feed_stream.window_for(tcfg, rows)
  if window is not None:
    budget = _device_memory(mesh) if budget is None else budget
    k = int(tcfg.get("steps_per_call", 1))
    streamed = feed_stream.check_fits(rows, window, k, plan_bytes, budget or 2**62)
    if streamed is None:
      rows.window = window
      return None
    why = f"{why}; {streamed}" if why else streamed
  if why and tcfg.get("feed", "auto") == "device":
    raise planner.PlanDoesNotFit(
      f"train.feed=device: {why}. Use train.feed=host (or auto), or a smaller plan."
    )
  return why


def describe(rows, how: str) -> str:
  """The feed's log line, with the streamed windows where `rows` stream."""
  order = getattr(rows, "window", None)
  if order is None:
    return how
  return (
    f"{how}; streamed in windows of {order.window_chunks} chunks of {order.chunk_rows:,} rows "
    f"(train order: window, {order.windows} windows a pass)"
  )
