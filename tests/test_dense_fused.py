"""`dense`'s fused tables (recgnn/backends/dense_fused.py) against one array per table
(`dense(fuse=False)`): the same lookups, the same tables bit for bit after SGD and row-wise
Adagrad steps, on 1x1, 8x1 and 2x4 meshes, one-hot and multi-hot bags of different lengths
with mean pooling; checkpoints (export / import_) interchangeable; when tables fuse."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from contract_lib import grads_for, mesh_or_skip, put_prepared

from recgnn import planner
from recgnn.backends.dense_fused import FusedDense
from recgnn.embeddings import base
from recgnn.embeddings.group import TableGroup

B = 64
ADAGRAD = base.OptimizerSpec(name="rowwise_adagrad", learning_rate=0.05, initial_accumulator=0.1)
SGD = base.OptimizerSpec(name="sgd", learning_rate=0.1)


def _specs(opt, pooling="sum", rows=(50, 300, 7), dim=8):
  return [
    base.TableSpec(name=f"T{i}", num_rows=r, dim=dim, optimizer=opt, pooling=pooling)
    for i, r in enumerate(rows)
  ]


def _batches(specs, bags, steps, seed=0):
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(steps):
    ids = {}
    for s, bag in zip(specs, bags, strict=True):
      x = rng.integers(0, s.num_rows, (B, bag))
      x[rng.random((B, bag)) < 0.2] = base.PAD  # padding slots (and whole empty bags)
      x[:4, 0] = 3  # a repeated row: the update sums its duplicates
      ids[s.name] = x
    out.append(ids)
  return out


def _train(text, specs, batches, mesh):
  """(group, [pooled per step], final tables, exported state) of `steps` SGD / Adagrad steps."""
  group = planner.make_group(text, specs, mesh)
  state = group.init(jax.random.key(0))
  lookup = jax.jit(group.lookup)
  update = jax.jit(group.update, donate_argnums=0)
  pooled_steps = []
  for step, ids in enumerate(batches):
    prepared = put_prepared(group, group.prepare(ids), mesh)
    pooled, residuals = lookup(state, prepared)
    pooled_steps.append({n: np.asarray(v) for n, v in pooled.items()})
    grads = {n: grads_for(step, v) for n, v in pooled.items()}
    state = update(state, prepared, residuals, grads)
  exported = jax.tree.map(np.asarray, group.export(state))
  return group, pooled_steps, group.tables(state), exported, state


@pytest.mark.parametrize("mesh_shape", [(1, 1), (8, 1), (2, 4)])
@pytest.mark.parametrize(
  "opt,pooling,bags",
  [(ADAGRAD, "sum", (1, 1, 1)), (SGD, "sum", (1, 1, 1)), (ADAGRAD, "mean", (3, 1, 5))],
  ids=["adagrad-onehot", "sgd-onehot", "adagrad-multihot-mean"],
)
def test_fused_tables_train_as_one_array_per_table(mesh_shape, opt, pooling, bags):
  mesh = mesh_or_skip(*mesh_shape)
  specs = _specs(opt, pooling)
  batches = _batches(specs, bags, steps=4)
  fused = _train("dense", specs, batches, mesh)
  plain = _train("dense(fuse=False)", specs, batches, mesh)
  assert isinstance(fused[0], FusedDense) and type(plain[0]) is TableGroup
  for step, (a, b) in enumerate(zip(fused[1], plain[1], strict=True)):
    for n in a:
      np.testing.assert_array_equal(a[n], b[n], err_msg=f"lookup of {n} at step {step}")
  for n in fused[2]:
    assert fused[2][n].shape == (fused[0].specs[n].num_rows, 8)
    np.testing.assert_array_equal(fused[2][n], plain[2][n], err_msg=f"table {n}")
    for k in plain[3][n]:
      np.testing.assert_array_equal(fused[3][n][k], plain[3][n][k], err_msg=f"{n}/{k}")
  # The rows the batches touched changed (the steps did something to compare).
  first = _train("dense", specs, batches[:0], mesh)[2]
  assert all(not np.array_equal(first[n], fused[2][n]) for n in first)


def test_checkpoints_move_between_fused_and_per_table_arrays():
  """export() is per table in both layouts (what a checkpoint holds): a fused group imports
  a per-table group's export and the other way round, equal."""
  mesh = mesh_or_skip(2, 4)
  specs = _specs(ADAGRAD)
  batches = _batches(specs, (1, 1, 1), steps=2)
  fused, _, f_tables, f_export, f_state = _train("dense", specs, batches, mesh)
  plain, _, p_tables, p_export, p_state = _train("dense(fuse=False)", specs, batches, mesh)
  into_plain = plain.import_(fused.export(f_state))
  into_fused = fused.import_(plain.export(p_state))
  for n in specs:
    n = n.name
    np.testing.assert_array_equal(plain.tables(into_plain)[n], f_tables[n])
    np.testing.assert_array_equal(fused.tables(into_fused)[n], p_tables[n])
  assert jax.tree.structure(into_fused) == jax.tree.structure(f_state)
  assert len(jax.tree.leaves(f_state)) == 2  # the group's table and its Adagrad slot


def test_which_tables_fuse():
  mesh = mesh_or_skip(2, 4)
  assert isinstance(planner.make_group("dense", _specs(SGD), mesh), FusedDense)
  for text, specs in [
    ("dense(fuse=False)", _specs(SGD)),
    ("dense(shard=rows)", _specs(SGD)),  # rows over the model axis: one array per table
    ("dense", _specs(SGD)[:1]),  # one table: nothing to fuse
    ("dense", [*_specs(SGD), _wide()]),  # two dims
    ("dense", [*_specs(SGD)[:2], *_specs(ADAGRAD)[2:]]),  # two optimizers
  ]:
    assert type(planner.make_group(text, specs, mesh)) is TableGroup, text


def _wide():
  return base.TableSpec(name="wide", num_rows=20, dim=16, optimizer=SGD)
