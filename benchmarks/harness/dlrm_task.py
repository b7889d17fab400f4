"""One DLRM task over given tables, for the benchmarks and tests that drive the trainer's own
step (recgnn.train.setup / step) on tables and batches of their choosing, with no dataset.

  GivenTables(config, mesh, specs)   the CTR task's model (DLRM or DCNv2, `config.model`) and
                                     loss over `specs`; batches {dense, label, weight, ids}
  dlrm(specs, mesh, bottom, top)     the same with a minimal config: a DLRM of those MLPs
  config_of(sizes)                   the trainer's config of a peers.dlrm.DlrmConfig /
                                     peers.dcn.DcnConfig (model, SGD for tables and MLPs)
  specs_of(config, rows)             tables C1 .. Cn of `rows` rows, config.embeddings' dim,
                                     optimizer and initializer
  to_batch(b, names)                 a peers batch (dense, labels, bags()) as the task's

Used by dlrm_throughput.py, tier_scaling.py, memory_tiers.py, scaling.py, hot_cold.py and
tests/test_hot_cold_tiers.py: the model and loss are the CTR task's own, so what they time
or inspect is the step `run.py` trains.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import ml_collections
import numpy as np

from recgnn.embeddings import base
from recgnn.tasks import ctr
from recgnn.train.task import Task


class GivenTables(ctr.CTR):
  """The CTR task's model and loss over given tables, without opening a dataset: the caller
  feeds batches ({dense: f32[B, 13], label: f32[B], weight: f32[B], ids: {table: i32[B, L]}})
  to the trainer's step itself. `batches`: those batches, where the caller has them: the
  trainer's build reads one train batch from them to size a host tier's per-batch buffers
  (`train_batches`); without them a plan with such buffers cannot be built."""

  def __init__(self, config: ml_collections.ConfigDict, mesh, specs: Sequence[base.TableSpec]):
    Task.__init__(self, config, mesh)
    self.data, self.oracle = None, None
    self.batches: list[dict] = []
    self.specs = list(specs)
    self.names = [s.name for s in self.specs]
    self.model = ctr.make_model(config.model, self.names)

  def tables(self) -> list[base.TableSpec]:
    return self.specs

  def steps_per_epoch(self):
    return None  # no dataset, no epochs: the run's length is train.steps

  def train_batches(self, start_step=0):
    if not self.batches:
      raise NotImplementedError("GivenTables has no dataset: feed the step batches yourself")
    return (self.batches[k % len(self.batches)] for k in itertools.count(start_step))

  def eval_batches(self, split):
    raise NotImplementedError("GivenTables has no dataset: feed the step batches yourself")


def dlrm(specs: Sequence[base.TableSpec], mesh, bottom, top) -> GivenTables:
  """A DLRM (dot interaction) with MLPs `bottom` and `top` over `specs`."""
  config = ml_collections.ConfigDict({"model": {"bottom": tuple(bottom), "top": tuple(top)}})
  return GivenTables(config, mesh, specs)


def table_names(n: int) -> list[str]:
  return [f"C{t + 1}" for t in range(n)]


def specs_of(config: ml_collections.ConfigDict, rows: Sequence[int]) -> list[base.TableSpec]:
  """Tables C1 .. Cn with rows[i] rows each, config.embeddings' dim, optimizer, initializer."""
  e = config.embeddings
  opt = base.OptimizerSpec(**e.optimizer.to_dict())
  return [
    base.TableSpec(name=n, num_rows=r, dim=e.dim, optimizer=opt, initializer=e.initializer)
    for n, r in zip(table_names(len(rows)), rows)
  ]


def config_of(sizes) -> ml_collections.ConfigDict:
  """The trainer's config of a peers DlrmConfig (a DcnConfig: cross layers too): its MLPs, dim
  and SGD learning rate for tables and MLPs, uniform initial rows, every table dense."""
  c = ml_collections.ConfigDict()
  c.model = {"bottom": sizes.bottom, "top": sizes.top}
  if hasattr(sizes, "cross_layers"):
    c.model.update(name="dcn", cross_layers=sizes.cross_layers, low_rank=sizes.low_rank)
  c.embeddings = {
    "dim": sizes.dim,
    "initializer": "uniform",
    "optimizer": {"name": "sgd", "learning_rate": sizes.learning_rate},
  }
  c.optimizer = {"name": "sgd", "learning_rate": sizes.learning_rate}
  c.embeddings.plan = [(".*", "dense")]
  c.train = {"steps": 1}  # (the benchmark runs its own steps)
  c.seed = 0
  return c


def task_of(config: ml_collections.ConfigDict, sizes, mesh) -> GivenTables:
  """GivenTables over the tables of a peers config (`sizes.rows`: each table's rows)."""
  return GivenTables(config, mesh, specs_of(config, sizes.rows))


def to_batch(b, names: Sequence[str]) -> dict:
  """The task's batch of a peers batch: dense, label, weight (ones) and ids {table: int32[B,
  L_t]} (b.bags())."""
  return {
    "dense": b.dense,
    "label": b.labels,
    "weight": np.ones_like(b.labels),
    "ids": {n: bag.astype(np.int32) for n, bag in zip(names, b.bags())},
  }
