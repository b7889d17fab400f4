"""Mesh axis names, mesh construction and batch placement. Use these constants, never strings.

The mesh is (DATA, MODEL). The batch is split over BOTH axes (every device gets B / n
examples); dense params are replicated; a model-parallel table is split over MODEL and
replicated over DATA (TorchRec's 2D parallelism). 1 x 1 is the single-device case.
"""

from __future__ import annotations

import functools
import threading

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

P = PartitionSpec
DATA = "data"  # data-parallel axis: replicas of the model-parallel tables
MODEL = "model"  # model-parallel axis: tables (or their rows) are split over it
BATCH = (DATA, MODEL)  # the batch axis spans every device of the mesh
BATCH_SPEC = P(BATCH)  # a batch-major array: axis 0 split over every device
REPLICATED = P()


class _HostSpec:
  """The placement of an input leaf that only host computations read (a host table's index
  list): replicated in pinned host memory, put there by the input transfer, so it never
  crosses the host link to the device and back (`Backend.prepared_spec`; `named`). A marker,
  not a PartitionSpec (jax forbids subclassing one): a pytree leaf, equal to no spec."""

  def __repr__(self) -> str:
    return "HOST_SPEC"


HOST_SPEC = _HostSpec()
HOST_MEMORY = "pinned_host"  # the memory kind of HOST_SPEC leaves


def make_mesh(data: int = 1, model: int | None = None, devices=None) -> jax.sharding.Mesh:
  """A (DATA, MODEL) mesh with Auto axes over the first data * model devices.

  Auto axes let XLA partition a gather on a row-sharded table (with Explicit axes, the
  default of jax.make_mesh, `jnp.take` then needs an out_sharding; docs/architecture.md).
  `model=None` puts every device not taken by `data` on MODEL.
  """
  devices = jax.devices() if devices is None else list(devices)
  n = len(devices)
  if data < 1 or (model is not None and model < 1):
    raise ValueError(f"mesh axes must be >= 1, got data={data} model={model}")
  if model is None:
    if n % data:
      raise ValueError(f"mesh data={data} does not divide the {n} devices; set mesh.model too")
    model = n // data
  if data * model > n:
    raise ValueError(
      f"mesh {data}x{model} (data x model) needs {data * model} devices; {n} available "
      f"({jax.default_backend()}). On CPU, simulate more with "
      "XLA_FLAGS=--xla_force_host_platform_device_count=N set before jax is imported."
    )
  grid = np.asarray(devices[: data * model], dtype=object).reshape(data, model)
  return jax.sharding.Mesh(grid, (DATA, MODEL), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def mesh_from_config(cfg) -> jax.sharding.Mesh:
  """config.mesh {data, model}: data=0 (the default) means every device not on MODEL;
  model=-1 means every device not on DATA (pure model parallelism with data=0)."""
  model = int(cfg.get("model", 1) or 1)
  data = int(cfg.get("data", 0) or 0)
  if model < 0:
    n = jax.device_count()
    if n % max(data, 1):
      raise ValueError(f"mesh.data={data} does not divide the {n} devices")
    model = n // max(data, 1)
  if data == 0:
    n = jax.device_count()
    if n % model:
      raise ValueError(f"mesh.model={model} does not divide the {n} devices")
    data = n // model
  return make_mesh(data, model)


def mesh_shape(mesh: jax.sharding.Mesh) -> tuple[int, int]:
  return mesh.shape[DATA], mesh.shape[MODEL]


def describe(mesh: jax.sharding.Mesh) -> str:
  d, m = mesh_shape(mesh)
  kinds = sorted({dev.device_kind for dev in mesh.devices.flat})
  return f"{d}x{m} (data x model) over {mesh.size} {'/'.join(kinds)} device(s)"


def named(mesh: jax.sharding.Mesh, spec, memory_kind: str | None = None):
  """NamedSharding of a PartitionSpec, or of HOST_SPEC (replicated, pinned host memory)."""
  if spec is HOST_SPEC:
    return NamedSharding(mesh, REPLICATED, memory_kind=HOST_MEMORY)
  return NamedSharding(mesh, spec, memory_kind=memory_kind)


def put(tree, shardings):
  """device_put that also works across processes: every process passes the same host value
  (a deterministic init) and each places the shards of its own devices. Leaves already
  placed as asked are returned as they are."""

  def one(x, s):
    if isinstance(x, jax.core.Tracer):  # under jit / eval_shape: a sharding constraint
      return jax.device_put(x, s)
    if isinstance(x, jax.Array) and x.sharding == s:
      return x
    if s.is_fully_addressable:
      return jax.device_put(x, s)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, s, lambda idx: host[idx])

  if isinstance(shardings, jax.sharding.Sharding):
    return jax.tree.map(lambda x: one(x, shardings), tree)
  return jax.tree.map(one, tree, shardings)


def replicate(x, mesh: jax.sharding.Mesh):
  """Inside jit: constrain a pytree to be replicated on every device (an all-gather where
  it was split). Used to gather a batch's (ids, pooled grads) for a replicated table."""
  sh = NamedSharding(mesh, REPLICATED)
  return jax.tree.map(lambda a: jax.lax.with_sharding_constraint(a, sh), x)


def check_batch(batch_size: int, mesh: jax.sharding.Mesh, what: str = "batch") -> None:
  """A batch is split evenly over every device: refuse sizes that do not divide."""
  if batch_size % mesh.size:
    lo = batch_size // mesh.size * mesh.size
    raise ValueError(
      f"{what} size {batch_size} does not divide over the {mesh.size} devices of the mesh "
      f"{describe(mesh)}; use a multiple of {mesh.size} (e.g. {max(lo, mesh.size)} or "
      f"{lo + mesh.size})."
    )


# ----------------------------------------------------------------------------- launches


class OneInFlight:
  """At most one multi-device computation in flight on XLA:CPU: each call waits for the
  previous call's outputs before it launches.

  XLA:CPU (jaxlib 0.10) deadlocks now and then when a multi-device program is launched while
  the previous one still runs: k devices wait in the step's all-gather while the others'
  launches block on their one in-flight slot (PjRt's per-device semaphore), held by their
  part of the previous step, which never starts (the runs: docs/multi-device.md). On CPU the
  devices share the same cores, so waiting costs only the host work that would have
  overlapped the step; on GPU / TPU (or one CPU device) calls pass straight through.
  """

  _lock = threading.Lock()
  _last: list = []  # the previous call's output leaves (shared by every wrapped function)

  def __init__(self, fn, mesh: jax.sharding.Mesh):
    self._fn = fn
    self._active = needs_one_in_flight(mesh)
    functools.update_wrapper(self, fn)

  def __call__(self, *args, **kwargs):
    if not self._active:
      return self._fn(*args, **kwargs)
    with OneInFlight._lock:
      wait(OneInFlight._last)
      out = self._fn(*args, **kwargs)
      OneInFlight._last = jax.tree.leaves(out)
      return out

  def __getattr__(self, name):  # .lower(), .trace(), ... of the jitted function
    return getattr(self._fn, name)


def needs_one_in_flight(mesh: jax.sharding.Mesh) -> bool:
  """Whether programs on `mesh` must run one at a time: several CPU devices of this process
  (simulated with --xla_force_host_platform_device_count, or a process's share of a
  multi-process CPU run)."""
  local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
  return len(local) > 1 and local[0].platform == "cpu"


def wait(leaves) -> None:
  """Block until every array in `leaves` is computed (deleted ones, e.g. donated since, are
  skipped: their computation has been waited for by whoever consumed them)."""
  for x in leaves:
    if isinstance(x, jax.Array) and not x.is_deleted():
      x.block_until_ready()
