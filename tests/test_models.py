"""The CTR model registry (recgnn/models/registry.py): a model by `model.name`, the older
`model.interaction` as an alias, an unknown name listing the valid ones; every registered model
takes its embeddings by table name; DeepFM against a numpy reference and trained; and the
trainer refusing micro-batches for a task whose loss is not a per-example mean."""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from benchmarks.harness import dlrm_task
from recgnn import planner, sharding
from recgnn.embeddings import base
from recgnn.models import dcn, deepfm, dlrm, registry
from recgnn.train import loop
from recgnn.train import step as step_lib
from tests.trainer_lib import smoke_config

TABLES = ("t2", "t10", "t1")  # a task's order: not the sorted one


def _model_config(**kw) -> ml_collections.ConfigDict:
  c = {"bottom": (16, 4), "top": (8, 1), "cross_layers": 1, "low_rank": 2, **kw}
  return ml_collections.ConfigDict(c)


def test_registry_finds_models_by_name_and_the_old_interaction_alias():
  found = registry.available()
  assert {"dcn", "deepfm", "dlrm"} <= set(found) and found == sorted(found)
  assert not {"graphsage", "kge", "rgcn", "registry"} & set(found)  # no CTR_MODEL
  kinds = {"dlrm": dlrm.DLRM, "dcn": dcn.DCN, "deepfm": deepfm.DeepFM}
  for name, cls in kinds.items():
    model = registry.build(_model_config(name=name), TABLES)
    assert type(model) is cls and model.tables == TABLES
  assert type(registry.build(_model_config(), TABLES)) is dlrm.DLRM  # neither key: dlrm
  assert type(registry.build(_model_config(interaction="dot"), TABLES)) is dlrm.DLRM
  # An old config built on one whose name is the default: the alias, when set, decides.
  old = registry.build(_model_config(name="dlrm", interaction="dcn"), TABLES)
  assert type(old) is dcn.DCN
  # Equal configs give equal (hashable) models: the trainer's shared init program.
  assert registry.build(_model_config(name="deepfm"), TABLES) == model
  assert hash(registry.build(_model_config(name="deepfm"), TABLES)) == hash(model)


def test_an_unknown_model_lists_the_valid_ones():
  valid = ", ".join(registry.available())  # (dcn, deepfm, dlrm and any of your own)
  for name in ("fm2", "graphsage", "../dlrm"):  # no module; a module without CTR_MODEL; no name
    with pytest.raises(
      ValueError, match=rf"Unknown model.name '{re.escape(name)}'; available: {valid}\."
    ):
      registry.build(_model_config(name=name), TABLES)
  with pytest.raises(ValueError, match=r"model.interaction 'dcnv2'.*dot \(dlrm\), dcn \(dcn\)"):
    registry.build(_model_config(interaction="dcnv2"), TABLES)


@pytest.mark.parametrize("name", ["dlrm", "dcn", "deepfm"])
def test_models_take_embeddings_by_table_name(name):
  """The same logits whatever the dict's key order (a dict through jit comes back sorted);
  a missing or unexpected table is refused naming both lists."""
  rng = np.random.default_rng(0)
  dense = jnp.asarray(rng.normal(size=(5, 13)), jnp.float32)
  emb = {t: jnp.asarray(rng.normal(size=(5, 4)), jnp.float32) for t in TABLES}
  model = registry.build(_model_config(name=name), TABLES)

  @jax.jit
  def both(emb):
    params = model.init(jax.random.key(0), dense, emb)
    return model.apply(params, dense, emb), model.apply(params, dense, dict(reversed(emb.items())))

  a, b = both(emb)
  assert a.shape == (5,) and a.dtype == jnp.float32
  np.testing.assert_array_equal(a, b)
  with pytest.raises(ValueError, match=r"tables are \['t2', 't10', 't1'\].*\['t1', 't2'\]"):
    jax.eval_shape(model.init, jax.random.key(0), dense, {t: emb[t] for t in ("t1", "t2")})


def test_deepfm_is_first_order_plus_fm_plus_deep():
  """DeepFM's logit against numpy: a linear term over the dense features and embeddings, the
  pairwise dot products of the fields (the bottom MLP's output and the embeddings), and the
  deep MLP over the fields concatenated."""
  rng = np.random.default_rng(1)
  dense = rng.normal(size=(6, 13)).astype(np.float32)
  embs = {t: rng.normal(size=(6, 4)).astype(np.float32) for t in TABLES}
  model = deepfm.DeepFM(bottom=(16, 4), top=(8, 1), tables=TABLES)
  p = jax.jit(model.init)(jax.random.key(0), dense, embs)["params"]
  got = jax.jit(model.apply)({"params": p}, dense, embs)

  def mlp(x, layers, relu_last):
    for i, layer in enumerate(layers):
      x = x @ np.asarray(layer["kernel"], np.float64) + np.asarray(layer["bias"], np.float64)
      if relu_last or i < len(layers) - 1:
        x = np.maximum(x, 0)
    return x

  x = mlp(dense, [p["bottom"][f"Dense_{i}"] for i in range(2)], True)
  fields = [x, *(embs[t] for t in TABLES)]
  first = mlp(np.concatenate([dense, *(embs[t] for t in TABLES)], 1), [p["first_order"]], False)
  pairs = sum((fields[f] * fields[g]).sum(1) for f in range(4) for g in range(f + 1, 4))
  deep = mlp(np.concatenate(fields, 1), [p["top"][f"Dense_{i}"] for i in range(2)], False)
  np.testing.assert_allclose(got, first[:, 0] + pairs + deep[:, 0], rtol=1e-4, atol=1e-4)


def test_deepfm_trains_above_the_dense_only_baseline(ctr_cache, tmp_path):
  """The trainer's smoke run with model.name=deepfm on the synthetic data (Criteo's 26 tables:
  the oracle's dense-only AUC is the Criteo reader's): the loss falls and the test AUC beats a
  model given the dense features only."""
  c = smoke_config(ctr_cache, steps=64, log_every=16)
  c.model.name = "deepfm"
  res = loop.train(c, str(tmp_path))
  with open(tmp_path / "metrics.jsonl") as f:
    losses = [r["loss"] for r in map(json.loads, f) if "loss" in r]
  assert losses[-1] < losses[0]
  assert res.metrics["test/auc"] > res.metrics["test/dense_only_auc"] + 0.03  # 0.658, 0.595


class _SummedLoss(dlrm_task.GivenTables):
  """A task whose loss is a sum over the batch, not a per-example mean."""

  loss_is_per_example_mean = False


@pytest.mark.parametrize("flag", [False, True])
def test_micro_batches_are_refused_for_a_loss_that_is_no_per_example_mean(flag):
  """hot_cold(split=True) splits each batch into micro-batches whose losses the step
  recombines by weight: refused, naming the fix, for a task that declares its loss is not a
  per-example mean (before anything is traced); split=False and a mean loss are accepted."""
  opt = base.OptimizerSpec(name="sgd", learning_rate=0.1)
  specs = [base.TableSpec(name=n, num_rows=100, dim=4, optimizer=opt) for n in ("a", "b")]
  mesh = sharding.make_mesh(1, 1)
  config = ml_collections.ConfigDict({"model": {"bottom": (8, 4), "top": (8, 1)}})
  task = (_SummedLoss if not flag else dlrm_task.GivenTables)(config, mesh, specs)

  def plan(text):
    group = planner.make_group(text, specs, mesh)
    return planner.Plan({group.name: group}, {s.name: group.name for s in specs}, mesh)

  split = plan("hot_cold(budget=0.3, profile_batches=2)")
  if flag:
    assert callable(step_lib.make_train_step(task, split, optax.sgd(0.1)))
  else:
    with pytest.raises(ValueError, match=r"not a per-example mean.*use hot_cold\(split=False\)"):
      step_lib.make_train_step(task, split, optax.sgd(0.1))
  whole = plan("hot_cold(budget=0.3, profile_batches=2, split=False)")
  assert callable(step_lib.make_train_step(task, whole, optax.sgd(0.1)))
