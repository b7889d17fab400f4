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


@pytest.mark.parametrize("mesh_shape", [(1, 1), (8, 1), (2, 4)])
@pytest.mark.parametrize("layout", ["fuse=True", "fuse=False", "shard=rows"])
@pytest.mark.parametrize(
  "opt,pooling,bags",
  [(ADAGRAD, "sum", (1, 1, 1)), (SGD, "mean", (3, 1, 5)), (ADAGRAD, "mean", (3, 1, 5))],
  ids=["adagrad-onehot", "sgd-multihot-mean", "adagrad-multihot-mean"],
)
def test_dedup_on_device_trains_as_dedup_on_host(mesh_shape, layout, opt, pooling, bags):
  """dense(dedup=device): the ids go to the step as read (padding < 0 included, no unique /
  inverse), padding is mapped and the batch deduped in the step (a fused group: one sort of
  every table's ids): the same lookups, tables and optimizer state bit for bit as the host's
  dedup (dedup=host, this CPU's default); fused, one array per table, rows over MODEL."""
  mesh = mesh_or_skip(*mesh_shape)
  specs = _specs(opt, pooling)
  batches = _batches(specs, bags, steps=4)
  device = _train(f"dense(dedup=device, {layout})", specs, batches, mesh)
  host = _train(f"dense(dedup=host, {layout})", specs, batches, mesh)
  assert type(device[0]) is type(host[0]) is (FusedDense if layout == "fuse=True" else TableGroup)
  prepared = device[0].prepare(batches[0])
  for n, p in prepared.items():  # as read: nothing computed per table on the host
    assert set(p["rows"]) == {"ids"}, n
    np.testing.assert_array_equal(p["rows"]["ids"], batches[0][n])
  assert "unique" in host[0].prepare(batches[0])["T0"]["rows"] or opt is SGD
  for step, (a, b) in enumerate(zip(device[1], host[1], strict=True)):
    for n in a:
      np.testing.assert_array_equal(a[n], b[n], err_msg=f"lookup of {n} at step {step}")
  for n in host[2]:
    np.testing.assert_array_equal(device[2][n], host[2][n], err_msg=f"table {n}")
    for k in host[3][n]:
      np.testing.assert_array_equal(device[3][n][k], host[3][n][k], err_msg=f"{n}/{k}")


def test_dedup_option_resolves_and_refuses():
  """auto: the host's dedup on CPU devices (the faster there); an unknown value names the
  valid ones; dedup=host with process-local input is refused (a slice is not the batch)."""
  mesh = mesh_or_skip(1, 1)
  group = planner.make_group("dense", _specs(ADAGRAD), mesh)
  assert not group.dedup_on_device and all(m.dedup == "host" for m in group.members.values())
  with pytest.raises(ValueError, match="auto, host, device"):
    planner.make_group("dense(dedup=gpu)", _specs(ADAGRAD), mesh)
  local = base.Layout(process_local=True)
  group = planner.make_group("dense", _specs(ADAGRAD), mesh, local)
  assert group.dedup_on_device
  with pytest.raises(ValueError, match="process-local"):
    planner.make_group("dense(dedup=host)", _specs(ADAGRAD), mesh, local)


def test_group_dedup_cuts_each_tables_own_dedup_out_of_one_sort():
  """`FusedDense._group_dedup` (one sort for the group) gives each table exactly what its
  own `device_dedup` gives (shifted to fused rows): the same distinct rows, then only the
  filler (a neighbour's row kept in a table's list would be written twice by the update's
  scatter: on a GPU in either order), and the same inverse at every non-padding id."""
  mesh = mesh_or_skip(1, 1)
  specs = _specs(ADAGRAD, "mean")
  group = planner.make_group("dense(dedup=device)", specs, mesh)
  # (each table's own dedup jitted: op by op, jnp.unique compiled ~10 programs per shape)
  own = jax.jit(base.device_dedup, static_argnums=1)
  for ids in _batches(specs, (3, 1, 5), steps=3, seed=4):
    prepared = group.prepare(ids)
    got = jax.jit(group._group_dedup)(prepared)
    for n, x in ids.items():
      mapped = np.where(x < 0, group.rows[n], x)
      unique, inverse = (np.asarray(a) for a in own(mapped, group.rows[n]))
      want = np.where(unique >= group.rows[n], group.total, unique + group.offsets[n])
      np.testing.assert_array_equal(got[n][0], want, err_msg=n)
      np.testing.assert_array_equal(np.asarray(got[n][1])[x >= 0], inverse[x >= 0], err_msg=n)


def test_dedup_on_device_is_one_sort_of_the_group_in_the_cuda_lowering():
  """What a GPU runs (lowered for CUDA here, no GPU needed): dense(dedup=device)'s update of
  a fused group of 26 tables sorts once (not once per table) and cuts the tables' runs with
  a handful of gathers (not one per table); its prepared batch is the ids alone, a third of
  the host dedup's bytes over the host link."""
  import re

  mesh = mesh_or_skip(1, 1)
  specs = _specs(ADAGRAD, rows=tuple(range(40, 66)))
  b = 128
  ids = {s.name: np.zeros((b, 1), np.int32) for s in specs}
  sizes = {}
  for mode in ("host", "device"):
    group = planner.make_group(f"dense(dedup={mode})", specs, mesh)
    state = {"table": jax.ShapeDtypeStruct((group.total, 8), np.float32),
             "accum": jax.ShapeDtypeStruct((group.total,), np.float32)}  # fmt: skip
    prepared = group.prepare(ids)
    grads = {s.name: jax.ShapeDtypeStruct((b, 8), np.float32) for s in specs}
    residuals = {s.name: () for s in specs}
    lowered = jax.jit(group.update).trace(state, prepared, residuals, grads)
    text = lowered.lower(lowering_platforms=("cuda",)).as_text()
    sorts, gathers = len(re.findall(r"stablehlo\.sort", text)), len(re.findall(r"gather", text))
    sizes[mode] = sum(x.nbytes for x in jax.tree.leaves(prepared))
    if mode == "device":
      assert sorts == 1, sorts
      assert gathers < len(specs), gathers
    else:
      assert sorts == 0, sorts
  assert sizes["device"] * 3 == sizes["host"]
