"""The task contract: what the shared trainer needs from a problem (CTR prediction, node
classification, ...). The trainer owns it; a task (`recgnn.tasks.<name>`) implements it and
the trainer finds the task by its config name (`setup.load_task`), never by an import.

The trainer (`recgnn.train.setup` builds, `recgnn.train.loop` runs) owns the embedding
backends, the optax optimizer of the dense params, the jitted steps, checkpoints, profiling
and logging. A task owns its data, model, loss and metrics. A task never sees a backend: it
receives pooled embeddings.

A batch is a dict of numpy arrays with static shapes (pad the last batch and mark the padding
with a zero in "weight") and one reserved key:
  batch["ids"] = {table_name: int32[B, L]}   ids of each table's bags, -1 = padding
The trainer turns those into pooled embeddings {table_name: float32[B, D]} (pooling from the
table's spec) and passes them to `loss` / `predict`; everything else in the batch is the
task's own.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import ml_collections
import numpy as np

from recgnn import planner, sharding
from recgnn.embeddings import TableSpec, base
from recgnn.train import inputs

Batch = dict[str, Any]
PyTree = Any

#: The splits evaluated at the end of a run when `train.final_eval_splits` is not set (the
#: trainer runs them; a task checks its data has rows for them).
FINAL_EVAL_SPLITS: tuple[str, ...] = ("valid", "test")


class Task(abc.ABC):
  """One learning problem. Constructed with the experiment's whole (locked) config and the
  trainer's mesh (the one its plan and steps use; a task never builds a mesh of its own, so
  the two cannot disagree)."""

  def __init__(self, config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh):
    self.config = config
    self.mesh = mesh

  @abc.abstractmethod
  def tables(self) -> list[TableSpec]:
    """The embedding tables (may be empty). Their names are the keys of batch['ids']."""

  @abc.abstractmethod
  def init_params(self, key: jax.Array, batch: Batch, embeddings: dict[str, jax.Array]) -> PyTree:
    """Dense (non-embedding) params, from one example batch."""

  def init_fn(self) -> Callable[[jax.Array, Batch, dict[str, jax.Array]], PyTree] | None:
    """`init_params` as a hashable value (e.g. a frozen dataclass of the flax model, itself
    hashable) that compares equal to another task's only where the two give the same params
    from the same arguments. The trainer jits it as a static argument of one function, so
    builds in one process with equal ones share one compiled program (jax's cache) instead of
    tracing, lowering and loading it again for each build (a sweep, a resume, a test
    suite's many runs). None (the default): `init_params` jitted per build."""
    return None

  @abc.abstractmethod
  def loss(
    self,
    params: PyTree,
    batch: Batch,
    embeddings: dict[str, jax.Array],
    key: jax.Array,
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Training loss (a scalar; a mean over the batch's weighted examples unless
    `loss_is_per_example_mean` says otherwise) and scalar aux metrics. Pure and jit-able;
    `key` for dropout."""

  #: Whether `loss` is a per-example mean, sum_i w_i l_i / max(sum_i w_i, 1) (w_i: example i's
  #: batch["weight"], else 1; l_i: a function of example i's inputs and the params only), and
  #: its aux metrics too. A group that splits each batch into micro-batches
  #: (`hot_cold(split=True)`, `Capabilities.splits_batch`) runs the loss per micro-batch and
  #: recombines them by their weights, exact only then: the trainer refuses that plan for a
  #: task that says False (a loss over the batch as a whole: in-batch negatives, a batch-level
  #: regularizer, a sum).
  loss_is_per_example_mean: bool = True

  @abc.abstractmethod
  def predict(self, params: PyTree, batch: Batch, embeddings: dict[str, jax.Array]) -> PyTree:
    """Eval outputs for one batch (a dict of arrays, e.g. scores, labels, weight). Jit-able."""

  @abc.abstractmethod
  def metrics(self, outputs: list[dict[str, np.ndarray]]) -> dict[str, float]:
    """Host side: the eval metrics from every eval batch's `predict` outputs."""

  @abc.abstractmethod
  def train_batches(self, start_step: int = 0) -> Iterator[Batch]:
    """Training batches from step `start_step` on, deterministic given the config's seed,
    so that a resumed run sees exactly the batches an uninterrupted one would. One batch per
    call of the train step: `steps_per_call` steps' worth (`start_step` a multiple of it)."""

  @abc.abstractmethod
  def eval_batches(self, split: str) -> Iterable[Batch]:
    """Eval batches of `split` ('valid' or 'test')."""

  def num_examples(self, batch: Batch) -> int:
    """Examples in a batch, for samples/s: by default the length of batch["weight"]."""
    if "weight" in batch:
      return int(np.shape(batch["weight"])[0])
    raise NotImplementedError(
      f"{type(self).__name__}: give batches a 'weight' or override num_examples"
    )

  #: Whether batches are split over the devices of the mesh (axis 0 of every leaf, B / n
  #: examples per device). False: every device gets the whole batch (e.g. one sampled
  #: subgraph per step), and the embeddings are looked up on every device.
  shard_batch: bool = True

  def batch_spec(self, batch: Batch) -> Any:
    """A PartitionSpec per leaf of a batch (its `ids` aside: those follow `shard_batch`):
    `sharding.BATCH_SPEC` for a batch-major leaf (axis 0 split over the devices),
    `sharding.REPLICATED` for one every device needs whole (e.g. a subgraph's edges). By
    default every leaf by `shard_batch`; a task whose batches mix the two overrides it."""
    spec = sharding.BATCH_SPEC if self.shard_batch else sharding.REPLICATED
    return jax.tree.map(lambda _: spec, batch)

  #: Whether `train_batches` / `eval_batches` honour `process_shard`: with many processes,
  #: each then reads only its own contiguous slice of every batch (B / processes examples,
  #: the examples of its devices) instead of the whole batch.
  reads_process_slice: bool = False
  #: (index, count): the slice of every batch this process reads. A task that reads process
  #: slices sets it in its constructor, from `input_layout()`; nothing changes it afterwards.
  process_shard: tuple[int, int] = (0, 1)

  def input_layout(
    self, mesh: jax.sharding.Mesh | None = None
  ) -> tuple[base.Layout, tuple[int, int] | None, str]:
    """How this task's batches reach the embedding backends, from what the task received at
    construction: the config's plan rules and `train.process_input`, the mesh (or `mesh`),
    its tables, `shard_batch` and `reads_process_slice` (`inputs.choose_layout`). ->
    (the Layout every backend receives; (index, count) of this process's slice when each
    process reads only its own, else None; a line saying which and why)."""
    return inputs.choose_layout(
      self,
      planner.rules_of(self.config.embeddings.plan),
      self.tables(),
      self.mesh if mesh is None else mesh,
      self.config.train.get("process_input", "auto"),
    )

  def artifacts(self) -> dict[str, np.ndarray]:
    """Arrays a run's results depend on beyond the config (e.g. the node permutation of a
    relabelled graph): the trainer saves them beside the checkpoints (artifacts.npz) and
    refuses to resume a run whose artifacts differ."""
    return {}

  def data_state(self, step: int) -> dict | None:
    """The train input pipeline's iterator state (JSON) when `step` batches have been used,
    saved in the checkpoint; None for pipelines that restart from `start_step` alone."""
    del step
    return None

  def restore_data_state(self, state: dict | None, step: int) -> None:
    """Resume: the iterator state saved with the checkpoint of `step` (None if none), for the
    next `train_batches(step)`."""
    del state, step

  def forkable_input(self) -> str:
    """ "" when `train_batches` / `eval_batches` run host code only (numpy, memmaps, numba:
    no threads of their own, no device or XLA call), so the trainer may read them in a
    forked worker process (`recgnn.train.input_worker`); else why not (a log line). By
    default not: a task says so once it is known to hold."""
    return f"{type(self).__name__}'s batches are read on the trainer's thread (Task.forkable_input)"

  def device_rows(self) -> Any:
    """The task's data as rows the device feed places on the devices (`train.feed`,
    recgnn.train.device_feed): an object with `arrays()`, `nbytes`, `gather`, the train
    `batch_size`, `train_batches`, `train_order(epoch)`, `eval_batch_size`,
    `eval_cursors(split)`, `host_ids` and `max_ids` (recgnn.data.ctr_rows.CTRRows), giving
    the batches `train_batches` / `eval_batches` give; or a line saying why the batches are
    read on the host (the default)."""
    return f"{type(self).__name__} reads its batches on the host"

  def steps_per_epoch(self) -> int | None:
    """Train steps of one pass over the train split (for `train.epochs`), None if unknown."""
    return None

  #: Train steps one call of the train step runs (`train_step`'s own step may scan several
  #: over one train batch, e.g. data-parallel GraphSAGE's bulk k-step sampling): each item of
  #: `train_batches` is one call, the loop counts this many steps per item, and every step
  #: it acts at (logs, checkpoints, evals, the end) must be a multiple of it.
  steps_per_call: int = 1
  #: The config key that sets `steps_per_call` (named in the loop's errors).
  steps_per_call_key: str = ""
  #: Train batches (items of `train_batches`) one call of the trainer's shared step takes:
  #: k > 1 (CTR's train.steps_per_call) stacks k host batches, each prepared and packed as
  #: alone, into one transfer ([k, devices, n] buffers), and the step scans its k optimizer
  #: steps over them (`step.jit_packed(stacked=k)`); steps_per_call is then k too. 1: a
  #: batch per call (which may itself hold several steps, as data-parallel GraphSAGE's).
  batches_per_call: int = 1

  #: What one example is called in throughput logs ("samples", "edges", "nodes").
  example_unit: str = "samples"

  def example_batch(self) -> Batch:
    """One batch with the shapes of eval batches, used to initialise the dense params.
    By default the first 'valid' batch; override for tasks without a 'valid' split."""
    return next(iter(self.eval_batches("valid")))

  def step_inputs(self) -> dict[str, Any]:
    """Arrays every train step reads besides its batch, e.g. the graph each device samples
    its own mini-batches from: `setup.build` places them once (`setup.place_inputs`: numpy
    arrays replicated on every device, device arrays, e.g. a graph's rows split over the
    mesh, as they are) and each step receives them as an argument, so they are neither sent
    with every batch nor baked into the program as constants. By default none."""
    return {}

  def train_step(self, plan: planner.Plan, tx) -> Any:
    """None (the default): the trainer's shared step (`recgnn.train.step.make_train_step`:
    lookup of the prepared ids, `loss`, optax, the groups' updates). A task whose batches are
    built on the device (data-parallel GraphSAGE samples there) returns its own pure step
    `(state, prepared, batch, step_inputs) -> (state, metrics)` over the same TrainState,
    with metrics["loss"]; the trainer jits, checkpoints, logs and evaluates it as any other
    (eval keeps the shared eval step)."""
    del plan, tx
    return None

  def describe(self) -> str:
    """Lines printed before training (dataset, sizes, baselines)."""
    return ""

  def final_report(self, results: dict[str, float]) -> dict[str, float]:
    """Extra numbers to report beside the final metrics (e.g. oracle AUC). Host side."""
    del results
    return {}
