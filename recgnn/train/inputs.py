"""Feeding the step: `prepare` in stream order with the look-ahead window, the run-ahead of
the input thread, and one packed transfer per batch, split per device.

One copy of each mechanism, shared by the trainer (`input_thread.InputThread`, `setup.Run.feed`),
the backend contract test and the offload tests:
  prepare_stream   every batch of a stream prepared once, in order, each group seeing the
                   ids of the next `lookahead` TRAIN batches (eval batches change no cache)
  run_ahead        the same stream, pulled `depth` items ahead of its consumer: exactly the
                   interleaving of the trainer's input thread (prepare(k + depth) runs before
                   the step of batch k), replayed deterministically
  pack / unpack    a (prepared, batch) pytree of numpy arrays -> one buffer per dtype, shaped
                   [devices, n]: row i holds device i's slice of every batch-major leaf and a
                   copy of every global leaf, so one device_put splits the batch over the mesh
                   and the step slices it apart inside shard_map (no communication).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import numpy as np

from recgnn import hostpool, planner, sharding
from recgnn.embeddings import base

PyTree = Any


@dataclasses.dataclass
class Prepared:
  """One item of a prepared stream."""

  kind: str  # "train" | "eval" | "eval_end" (marks the end of an eval pass; batch is None)
  split: str | None
  batch: dict | None
  prepared: dict[str, PyTree] | None  # {group key: the group's prepared pytree}


def halves(group, ids: dict, upcoming: list[dict], train: bool) -> Callable[[], PyTree]:
  """A group's `prepare` as two halves, each run in stream order (`Backend.prepare_ahead`:
  offload's planning first; the whole of `prepare` first for the other groups) -> the
  second, a callable making the prepared pytree."""
  return group.prepare_ahead(ids, upcoming, train=train)


def plan_one(plan: planner.Plan, batch: dict, upcoming: list[dict], train: bool) -> dict:
  """Every group's first half of `prepare` for one batch (`halves`) -> {group key: its
  second half}. upcoming: the next train batches' ids dicts."""
  out = {}
  for key, group in plan.groups.items():
    ids = {t: batch["ids"][t] for t in group.specs}
    ahead = [{t: u[t] for t in group.specs} for u in upcoming[: group.lookahead]]
    out[key] = halves(group, ids, ahead, train)
  return out


def finish(second: dict | None) -> dict | None:
  """`plan_one`'s second halves run: {group key: the group's prepared pytree}."""
  return None if second is None else {key: f() for key, f in second.items()}


def prepare_one(plan: planner.Plan, batch: dict, upcoming: list[dict], train: bool) -> dict:
  """Every group's `prepare` for one batch. upcoming: the next train batches' ids dicts."""
  return finish(plan_one(plan, batch, upcoming, train))


def plan_stream(plan: planner.Plan, stream: Iterable[tuple[str, str | None, Any]]) -> Iterator:
  """(kind, split, batch) items -> (kind, split, batch, second halves or None), the first
  halves of every group's `prepare` run in order with the look-ahead window (the ids of the
  next `plan.lookahead` train batches of the stream; `plan_one`)."""
  window: collections.deque = collections.deque()
  it = iter(stream)
  exhausted = False

  def refill():
    nonlocal exhausted
    while not exhausted and len(window) < plan.lookahead + 1:
      try:
        window.append(next(it))
      except StopIteration:
        exhausted = True

  refill()
  while window:
    kind, split, batch = window.popleft()
    refill()
    second = None
    if batch is not None:
      upcoming = [w[2]["ids"] for w in window if w[0] == "train"]
      second = plan_one(plan, batch, upcoming, train=kind == "train")
    yield kind, split, batch, second


def prepare_stream(plan: planner.Plan, stream: Iterable[tuple[str, str | None, Any]]) -> Iterator:
  """(kind, split, batch) items -> `Prepared` items, prepared in order with the look-ahead
  window (`plan_stream`, each batch's second halves run before the next batch's first;
  `recgnn.train.plan_ahead` runs the first halves on a thread of their own)."""
  for kind, split, batch, second in plan_stream(plan, stream):
    yield Prepared(kind, split, batch, finish(second))


def stack_call(plan: planner.Plan, prepared: list[dict]) -> list[dict]:
  """The prepared pytrees ({group key: ...}) of one call's k train batches -> the same with
  every leaf one shape across them (each group's `Backend.stack_call`), to stack for a
  `jit_packed(stacked=k)` step."""
  out = [dict(p) for p in prepared]
  for key, group in plan.groups.items():
    for p, g in zip(out, group.stack_call([p[key] for p in prepared])):
      p[key] = g
  return out


def run_ahead(items: Iterable, depth: int = base.PREFETCH) -> Iterator:
  """Yield `items` in order, having pulled (prepared) `depth` more before yielding each."""
  buf: collections.deque = collections.deque()
  it = iter(items)
  for x in it:
    buf.append(x)
    if len(buf) > depth:
      yield buf.popleft()
  while buf:
    yield buf.popleft()


# ----------------------------------------------------------------------------- packing


def batch_spec(batch: dict, shard: bool) -> PyTree:
  """PartitionSpecs of a task batch: every leaf batch-major when the task shards batches."""
  spec = sharding.BATCH_SPEC if shard else sharding.REPLICATED
  return jax.tree.map(lambda _: spec, batch)


def check_split(tree: PyTree, specs: PyTree, mesh, what: str) -> None:
  """Batch-major leaves must divide over the mesh: a clear error, not a reshape failure."""
  for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(specs, is_leaf=_is_spec)):
    if s == sharding.BATCH_SPEC:
      sharding.check_batch(np.shape(x)[0], mesh, what)


def _is_spec(x) -> bool:
  return isinstance(x, jax.sharding.PartitionSpec)


class PackLayout:
  """The static half of a packed batch: the pytree's structure and, per leaf, where it lives
  (dtype buffer, column offset, per-device shape, split or copied; or -1 and its index among
  the host leaves). The packed step's static argument: jit hashes it at every call and
  `traffic.PerProgram` keys programs by it, so its hash is computed once here, equality
  short-cuts on identity, and a `Packer` hands out one instance per structure (the buffers'
  shapes follow from it and the device count)."""

  __slots__ = ("_hash", "treedef", "where")

  def __init__(self, treedef, where: tuple):
    self.treedef, self.where = treedef, where
    self._hash = hash((treedef, where))

  def __hash__(self):
    return self._hash

  def __eq__(self, other):
    if self is other:
      return True
    return (
      isinstance(other, PackLayout)
      and self._hash == other._hash
      and (self.treedef, self.where) == (other.treedef, other.where)
    )

  def __iter__(self):  # treedef, where = layout
    return iter((self.treedef, self.where))

  def __repr__(self):
    return f"PackLayout({len(self.where)} leaves)"


#: Bytes a packing thread copies at least (`Packer._copy_cuts`).
COPY_CHUNK_BYTES = 1 << 20

#: Makes a packed batch's buffers: [(dtype str, shape)] -> an empty array of each, written
#: whole by the caller (`Packer`, `feeder.Feeder.stack`).
Alloc = Callable[[list], list]


def leaf_signature(leaves: list) -> tuple:
  """What picks a `Packer` besides the tree structure: each leaf's shape and dtype."""
  return tuple([(x.shape, x.dtype) for x in leaves])


class Packer:
  """`pack` for one tree structure, leaf shapes and dtypes: the layout and each leaf's slot
  computed once, so a batch costs one buffer per dtype and one copy per leaf (no specs, no
  checks, no layout built per batch)."""

  def __init__(self, treedef, leaves: list, spec_leaves: list, devices: int):
    if len(spec_leaves) != len(leaves):
      raise ValueError(f"pack: {len(leaves)} leaves but {len(spec_leaves)} specs")
    self.devices = devices
    on_device = [x for x, s in zip(leaves, spec_leaves) if s is not sharding.HOST_SPEC]
    self.dtypes = sorted({x.dtype.str for x in on_device})
    widths = dict.fromkeys(self.dtypes, 0)
    where, slots, hosts = [], [], 0
    for i, (x, s) in enumerate(zip(leaves, spec_leaves)):
      if s is sharding.HOST_SPEC:
        where.append((-1, hosts, x.shape, False))  # (-1: the host leaves, their index)
        hosts += 1
        continue
      d = x.dtype.str
      split = s == sharding.BATCH_SPEC
      # Device i's examples are rows [i*b, (i+1)*b): contiguous, so a reshape splits them.
      local = (x.shape[0] // devices,) + x.shape[1:] if split else x.shape
      n = x.size // devices if split else x.size
      k = self.dtypes.index(d)
      where.append((k, widths[d], local, split))
      slots.append((i, k, widths[d], widths[d] + n, (devices, n) if split else (1, n)))
      widths[d] += n
    self.widths = [widths[d] for d in self.dtypes]
    self.slots = tuple(slots)
    # Bytes each slot copies (all devices' rows), for cutting a large batch's copies.
    self._bytes = [(b - a) * devices * np.dtype(self.dtypes[k]).itemsize for _, k, a, b, _ in slots]
    self._cuts: dict[int, list[int]] = {}  # threads() -> cuts of `slots` (`_copy_cuts`)
    self.host = tuple(i for i, s in enumerate(spec_leaves) if s is sharding.HOST_SPEC)
    self.layout = PackLayout(treedef, tuple(where))

  def __call__(self, leaves: list, alloc: Alloc | None = None) -> tuple[list, list]:
    """Leaves (numpy, this packer's shapes) -> (one [devices, n] buffer per dtype, the host
    leaves). alloc: where the buffers are made (default new arrays; a worker's slot)."""
    shapes = [(d, (self.devices, w)) for d, w in zip(self.dtypes, self.widths)]
    bufs = alloc(shapes) if alloc is not None else [np.empty(s, d) for d, s in shapes]

    def copy(lo: int, hi: int) -> None:
      for i, k, a, b, shape in self.slots[lo:hi]:
        bufs[k][:, a:b] = leaves[i].reshape(shape)  # (a (1, n) row: copied to every device)

    hostpool.run(copy, self._copy_cuts())
    return bufs, [leaves[i] for i in self.host]

  def _copy_cuts(self) -> list[int]:
    """Contiguous runs of `slots` of about equal bytes, one per hostpool thread, each at least
    COPY_CHUNK_BYTES: numpy's copies release the GIL, so a large batch's (a 65536-row batch's:
    ~11 MB) are made by several threads; a small one's in one run."""
    k = hostpool.threads()
    if k not in self._cuts:
      total = sum(self._bytes)
      n = max(1, min(k, total // COPY_CHUNK_BYTES, len(self.slots)))
      cuts, run = [0], 0
      for j, size in enumerate(self._bytes):  # (cut where the running bytes pass i / n)
        run += size
        if len(cuts) < n and run >= total * len(cuts) / n:
          cuts.append(j + 1)
      if cuts[-1] != len(self.slots):
        cuts.append(len(self.slots))
      self._cuts[k] = cuts
    return self._cuts[k]


def pack(tree: PyTree, specs: PyTree, devices: int) -> tuple[tuple[list, list], PackLayout]:
  """A pytree of numpy arrays -> ((one [devices, n] buffer per dtype, the host leaves), static
  layout).

  specs: a PartitionSpec per leaf (BATCH_SPEC: axis 0 split over the devices; REPLICATED:
  copied to each), or HOST_SPEC (the leaf as it is, for pinned host memory: `put`). A batch
  and its prepared ids are ~100 small arrays; one device_put each costs more than the step on
  CPU (docs/running.md), hence one buffer per dtype; the host
  leaves are a few index lists (one per host-table stack), put one by one. A caller packing
  many batches of one structure keeps its `Packer` (`feeder.Feeder` does).
  """
  leaves, treedef = jax.tree.flatten(tree)
  leaves = [np.asarray(x) for x in leaves]
  packer = Packer(treedef, leaves, jax.tree.leaves(specs, is_leaf=_is_spec), devices)
  return packer(leaves), packer.layout


def unpack(buffers, layout, mesh) -> PyTree:
  """Inverse of `pack`, inside jit: each device slices its own row (free in XLA); the host
  leaves are the jitted function's arguments as they are (in host memory)."""
  treedef, where = layout
  buffers, host = buffers
  dev = [w for w in where if w[0] >= 0]
  out_specs = tuple(sharding.BATCH_SPEC if split else sharding.REPLICATED for *_, split in dev)

  @functools.partial(
    jax.shard_map,
    mesh=mesh,
    in_specs=(sharding.BATCH_SPEC,) * len(buffers),
    out_specs=out_specs,
    check_vma=False,  # global leaves are identical copies on every device
  )
  def local(*bufs):
    return tuple(
      jax.lax.slice(bufs[i][0], (off,), (off + int(np.prod(shape)),)).reshape(shape)
      for i, off, shape, _ in dev
    )

  sliced = iter(local(*buffers) if dev else ())
  return jax.tree.unflatten(treedef, [host[w[1]] if w[0] < 0 else next(sliced) for w in where])


# A call's k stacked batches: axis 0 the call's steps, axis 1 the devices.
STACKED_SPEC = jax.sharding.PartitionSpec(None, sharding.BATCH)


def put(buffers: tuple[list, list], mesh, local: bool = False) -> tuple[list, list]:
  """The one host -> device transfer of a batch: row i of each buffer to device i; the host
  leaves to pinned host memory (a copy within the host). With many processes, each
  transfers only the rows of its own devices; `local`: the buffers hold only those rows
  ([local devices, n], from a process-local slice of the batch; never host leaves: they
  are replicated, which a process-local batch refuses)."""
  buffers, host = buffers
  # [devices, n] buffers, or a call's k batches stacked ([k, devices, n]: `Feeder.stack`)
  stacked = bool(buffers) and buffers[0].ndim == 3
  sh = sharding.named(mesh, STACKED_SPEC if stacked else sharding.BATCH_SPEC)
  hs = sharding.named(mesh, sharding.HOST_SPEC)
  if local:
    if host:  # (Feeder.pack refuses them first: every leaf of a local batch is batch-major)
      raise ValueError(f"a process-local batch cannot carry {len(host)} host leaves")
    lead = (buffers[0].shape[0],) if stacked else ()
    return [
      jax.make_array_from_process_local_data(sh, b, lead + (mesh.size,) + b.shape[-1:])
      for b in buffers
    ], []
  if jax.process_count() == 1:
    return jax.device_put(buffers, sh), jax.device_put(host, hs)
  return (
    [jax.make_array_from_callback(b.shape, sh, lambda idx, b=b: b[idx]) for b in buffers],
    [jax.make_array_from_callback(h.shape, hs, lambda idx, h=h: h[idx]) for h in host],
  )


# ----------------------------------------------------------------------------- processes

INPUT_MODES = ("auto", "local", "global")


def device_block(owners: list[int], process: int, count: int) -> int | None:
  """owners: the process of each device of the mesh, in the order the batch is split over
  them. -> b if `process`'s devices are exactly the b-th of `count` equal contiguous blocks
  (then its examples are the b-th contiguous slice of every batch), else None."""
  if len(owners) % count:
    return None
  per = len(owners) // count
  mine = [i for i, o in enumerate(owners) if o == process]
  if len(mine) != per or mine[0] % per or mine != list(range(mine[0], mine[0] + per)):
    return None
  return mine[0] // per


def choose_layout(
  task, rules, specs, mesh, setting: str = "auto"
) -> tuple[base.Layout, tuple[int, int] | None, str]:
  """How batches reach the embedding backends, decided BEFORE the plan is built (every backend
  receives the layout at construction): from the task's `shard_batch` and
  `reads_process_slice`, the plan rules' declared capabilities (`planner.capabilities_of`, nothing
  constructed) and the mesh's device order.

  -> (the `base.Layout`; (index, count) for `Task.process_shard` when each process reads and
  prepares only its own slice of every batch, else None; a line saying which and why): a task
  reading process slices asks it in its constructor (`Task.input_layout`), `setup.build` before
  the plan. With `setting="auto"` the slice is used when the task, every backend and the mesh's
  device order allow it; "local" refuses (ValueError, the reasons) when they do not; "global"
  never uses it.
  """
  if setting not in INPUT_MODES:
    raise ValueError(f"train.process_input={setting!r}; valid: {', '.join(INPUT_MODES)}")
  split = bool(task.shard_batch)
  k = int(getattr(task, "batches_per_call", 1))
  whole = base.Layout(split_batch=split, steps_per_call=k)
  count = jax.process_count()
  if count == 1:
    return whole, None, "one process: it reads every batch"
  if setting == "global":
    return whole, None, "every process reads the whole batch (train.process_input=global)"
  why = []
  if not task.reads_process_slice:
    why.append(f"{type(task).__name__} reads whole batches")
  if not split:
    why.append("the task's batches are replicated over the devices, not split")
  for text in planner.assign_rules(rules, specs):
    if planner.capabilities_of(text).plans_globally:
      why.append(f"backend {text!r}: its prepare plans over the whole batch")
  owners = [d.process_index for d in mesh.devices.flat]
  index = device_block(owners, jax.process_index(), count)
  if index is None:
    why.append("this process's devices are not one contiguous block of the mesh")
  if why:
    if setting == "local":
      raise ValueError(
        "train.process_input=local, but processes cannot read only their slice of each "
        f"batch: {'; '.join(why)}. Use train.process_input=auto (or global)."
      )
    return whole, None, "every process reads the whole batch: " + "; ".join(why)
  return (
    base.Layout(split_batch=split, process_local=True, steps_per_call=k),
    (index, count),
    f"each process reads and prepares only its 1/{count} of every batch (this one: slice "
    f"{index}, {len(owners) // count} devices)",
  )
