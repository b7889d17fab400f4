"""Click-through-rate prediction with a CTR model of `recgnn.models` by name (DLRM, DLRM-DCNv2,
DeepFM, or one of your own: docs/models.md).

Config keys used (see experiments/dlrm_kaggle.py, experiments/dlrmv2_criteo1tb.py): data.*,
model.bottom/top, embeddings.dim / initializer / optimizer, train.batch_size /
eval_batch_size / shuffle, seed. Optional (defaults keep the DLRM Kaggle behaviour):
  data.schema       "criteo" (the default: the Criteo reader), a JSON file or a dict
                    (recgnn.data.ctr_schema): any TSV / CSV / Parquet at data.path.
  data.num_workers  conversion processes for a schema's files.
  data.multi_hot    {sizes: () | "mlperf" | [ints], distribution: uniform | pareto, seed}:
                    MLPerf's one-hot -> multi-hot expansion (recgnn.data.multihot).
  data.drifting     {seed, batches, batch, born, life, ..., capacity, ids}: the drifting
                    click stream with raw ids (recgnn.data.drifting_ctr; experiments/
                    dynamic_drift.py) in place of data.path / the synthetic default.
  model.name        the model (`recgnn.models.registry`): "dlrm" (the default), "dcn" (DCNv2:
                    model.cross_layers, model.low_rank; 0 = full rank), "deepfm", ...
  model.interaction older configs' key, an alias that wins when set: "dot" (dlrm), "dcn".
  model.dtype       "float32" (default) or "bfloat16": the MLPs' and interaction's compute
                    dtype; params, optimizer and embedding state and the loss stay float32.
  embeddings.pooling "sum" (default) or "mean": how a table's bag is reduced (a schema column's
                    own `pooling` wins).
  train.order       "pass" (default: a permutation of the rows each pass) or "window": a
                    shuffle within windows of chunks (recgnn.data.window_order; the order the
                    device feed streams in; train.feed_chunk_rows, train.feed_window_chunks).
  train.order_shards  1 (default) or S dividing the batch: "pass" in S contiguous shards of
                    the rows, each permuted on its own, every batch 1/S from each
                    (`CTRDataset.batch_rows`): with P processes (S a multiple of P) each
                    holds only its shards' rows under the device feed.
Batches carry ids[t] int32[B, L_t] per table (L_t = 1 one-hot; PAD after a shorter bag); a
raw table's (vocab="raw") are int64[B, L_t] 64-bit keys, which only its dynamic backend reads
(on the host: they never go to a device).
"""

from __future__ import annotations

import dataclasses
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from recgnn import metrics as metrics_lib
from recgnn.data import criteo
from recgnn.embeddings import OptimizerSpec, TableSpec
from recgnn.models import registry as model_registry
from recgnn.train.task import Task


def open_dataset(data) -> tuple[criteo.CriteoDataset, dict | None]:
  """The dataset named by config.data, and the synthetic oracle info (None for real data).

  With no data.path, the embedded synthetic Criteo-format dataset is generated (once; it is
  cached under data.cache_dir) and used. data.multi_hot.sizes expands its one-hot ids into
  MLPerf's multi-hot bags.
  """
  dataset, oracle = _open_one_hot(data)
  mh = data.get("multi_hot", None)
  if mh is not None and mh.get("sizes", ()):
    from recgnn.data import multihot

    recipe = multihot.MultiHotRecipe(
      sizes=multihot.sizes_from(mh.sizes),
      distribution=mh.get("distribution", "uniform"),
      seed=int(mh.get("seed", 0)),
    )
    dataset = multihot.MultiHotDataset(dataset, recipe)
  return dataset, oracle


def _open_one_hot(data):
  from recgnn.data import criteo_synthetic

  if data.get("drifting") is not None:
    from recgnn.data import drifting_ctr

    return drifting_ctr.open_drifting(data)
  cache_dir = os.path.expanduser(data.cache_dir)
  schema = data.get("schema", "criteo")
  if schema != "criteo":
    from recgnn.data import ctr_reader

    if not data.path:
      raise ValueError(
        "data.schema names your own data: give its files with --config.data.path=a.tsv[,b.tsv]"
        " (or leave data.schema='criteo' for the synthetic Criteo default)"
      )
    schema, options = ctr_reader.read_schema_config(data)
    paths = data.path.split(",")
    split = data.get("split", "kaggle")
    source = data.get("source", "memmap")
    if source == "tfds":
      return _open_tfds_schema(data, cache_dir, schema, options, paths, split), None
    if source != "memmap":
      raise ValueError(f"Unknown data.source {source!r}; available: memmap, tfds")
    return ctr_reader.open_ctr(paths, cache_dir, schema, options=options, split=split), None
  reader = criteo.ReaderConfig(
    categorical=data.categorical,
    min_count=data.min_count,
    hash_sizes=tuple(data.hash_sizes) if len(data.hash_sizes) > 1 else data.hash_sizes[0],
    max_bad_lines=data.max_bad_lines,
    max_bad_fraction=data.max_bad_fraction,
  )
  source = data.get("source", "memmap")
  if source == "tfds":
    return open_tfds(data, cache_dir, reader), None
  if source != "memmap":
    raise ValueError(f"Unknown data.source {source!r}; available: memmap, tfds")
  if data.path:
    paths = sorted(data.path.split(",")) if "," in data.path else [data.path]
    return criteo.open_criteo(paths, cache_dir, reader=reader, split=data.split), None
  print(
    "No --config.data.path given: using the embedded synthetic Criteo-format dataset "
    f"({data.synthetic.rows:,} rows, Kaggle cardinalities x {data.synthetic.scale}, "
    f"seed {data.synthetic.seed}; labels from a planted model with a known oracle AUC).",
    flush=True,
  )
  syn = criteo_synthetic.default_synthetic_dataset(
    cache_dir,
    num_rows=data.synthetic.rows,
    scale=data.synthetic.scale,
    seed=data.synthetic.seed,
    reader=reader,
  )
  oracle = {
    "oracle_auc_test": syn.oracle_auc["test"],
    "oracle_auc_valid": syn.oracle_auc["valid"],
    "dense_only_auc_test": criteo_synthetic.dense_only_baseline_auc(syn.dataset),
  }
  return syn.dataset, oracle


class DataTooSmall(ValueError):
  """A dataset (or one of its splits) too small for the run's batches: names the file, its
  row counts and the fix."""


def check_sizes(dataset, config) -> None:
  """Refuse, before anything is allocated, data the run cannot train or evaluate on: no rows
  at all (an empty file, or only malformed lines), a train split smaller than one batch
  (training drops the last partial batch, so it would never see a batch), or an empty
  split that the run evaluates on."""
  t = config.train
  splits = {s: dataset.split_size(s) for s in ("train", "valid", "test")}
  manifest = getattr(dataset, "manifest", {}) or {}
  source = config.data.path or "the synthetic dataset"
  how = config.data.get("split", "kaggle")
  counts = ", ".join(f"{s} {n:,}" for s, n in splits.items())
  bad = int(manifest.get("num_bad_lines", 0) or 0)
  lines = f"{sum(splits.values()):,} rows ({counts}; {bad:,} malformed lines skipped)"
  if sum(splits.values()) == 0:
    why = f"all {bad:,} lines are malformed (see the conversion log)" if bad else "it is empty"
    what = (
      "a Criteo TSV file with rows (label, 13 integer, 26 hex columns, tab-separated)"
      if config.data.get("schema", "criteo") == "criteo"
      else "files with rows of data.schema's columns"
    )
    raise DataTooSmall(
      f"{source}: no rows to train on: {why}. Give {what}, or no data.path for the synthetic "
      "dataset."
    )
  b = int(t.batch_size)
  fix = (
    f"Use --config.train.batch_size={_fit(splits['train'])} or smaller (a multiple of the "
    "device count) with --config.train.steps=N for the run's length, or a bigger file."
  )
  if sum(splits.values()) < b:
    raise DataTooSmall(f"{source}: {lines}: fewer than one batch of train.batch_size={b:,}. {fix}")
  if splits["train"] < b:
    raise DataTooSmall(
      f"{source}: {lines}: the {how} split leaves {splits['train']:,} train rows, fewer than "
      f"one batch of train.batch_size={b:,} (a train step needs a whole batch). {fix}"
    )
  evaluated = set(t.get("final_eval_splits", ("valid", "test")))
  if t.get("eval_every", 0):
    evaluated.add(t.get("eval_split", "valid"))
  empty = sorted(s for s in evaluated if s in splits and splits[s] == 0)
  if empty:
    keep = tuple(s for s in sorted(evaluated) if s not in empty)
    raise DataTooSmall(
      f"{source}: {lines}: the run evaluates on {', '.join(empty)}, which the {how} split "
      "leaves empty (Kaggle: the last seventh of the rows, halved into test and valid). Give "
      f'a bigger file, or leave them out: --config.train.final_eval_splits="{keep}"'
      + (" --config.train.eval_every=0" if t.get("eval_every", 0) else "")
      + "."
    )


def _fit(rows: int) -> int:
  """The largest power of two <= rows (a batch that splits over 1, 2, 4, 8 devices)."""
  return 1 << max(rows.bit_length() - 1, 0)


def open_tfds(data, cache_dir: str, reader: criteo.ReaderConfig):
  """data.source=tfds: build (once) and open the TFDS dataset whose manual download is
  data.path (a folder, or the train.txt / a day_N file in it): criteo_kaggle for train.txt,
  criteo_terabyte for day_N files."""
  from recgnn.data import pipeline, tfds_builders

  if not data.path:
    raise ValueError(
      "data.source=tfds needs --config.data.path=<folder holding train.txt (Kaggle) or "
      "day_0 .. day_23 (Terabyte)>: the TFDS manual download directory"
    )
  first = data.path.split(",")[0]
  folder = first if os.path.isdir(first) else os.path.dirname(os.path.abspath(first))
  name = "criteo_kaggle" if os.path.exists(os.path.join(folder, "train.txt")) else None
  if name is None and tfds_builders.day_files(folder):
    name = "criteo_terabyte"
  if name is None:
    raise FileNotFoundError(f"{folder} holds neither train.txt nor day_N files")
  data_dir = os.path.expanduser(data.get("tfds_dir", "") or os.path.join(cache_dir, "tfds"))
  print(f"criteo: TFDS {name} in {data_dir} (manual download {folder})", flush=True)
  builder = tfds_builders.build(
    name, data_dir, manual_dir=folder, config=tfds_builders.criteo_config(reader)
  )
  return pipeline.TfdsCriteo(builder, num_threads=int(data.get("read_threads", 8)))


def _open_tfds_schema(data, cache_dir, schema, options, paths, split):
  """data.source=tfds with data.schema: the `ctr` TFDS build of the files (once), via grain."""
  from recgnn.data import pipeline, tfds_builders

  data_dir = os.path.expanduser(data.get("tfds_dir", "") or os.path.join(cache_dir, "tfds"))
  config = tfds_builders.ctr_config(schema, paths, options=options, split=split)
  print(f"{schema.name}: TFDS ctr/{config.name} in {data_dir}", flush=True)
  builder = tfds_builders.build("ctr", data_dir, config=config)
  return pipeline.TfdsCriteo(builder, num_threads=int(data.get("read_threads", 8)))


def _tfds_dataset_type():
  """pipeline.TfdsCriteo if grain / TFDS are importable (they are optional at run time)."""
  try:
    from recgnn.data import pipeline
  except ImportError:
    return ()
  return pipeline.TfdsCriteo


def make_model(model, tables):
  """config.model and the task's table names (in order) -> the flax model the config names
  (`recgnn.models.registry`: model.name, or the alias model.interaction)."""
  return model_registry.build(model, tables)


@dataclasses.dataclass(frozen=True)
class _Init:
  """CTR's `init_params` as a value (`Task.init_fn`): the model (a registered CTR model: a
  flax module, hashable and equal by its fields) and the tables whose embeddings it gets."""

  model: nn.Module
  names: tuple[str, ...]

  def __call__(self, key, batch, embeddings):
    return self.model.init(key, batch["dense"], {n: embeddings[n] for n in self.names})


class CTR(Task):
  """A CTR model (DLRM, DCNv2, DeepFM, ...) on CTR data: dense features, one-hot or multi-hot
  tables, a binary label."""

  reads_process_slice = True  # memmap and TFDS sources read only a process's rows
  steps_per_call_key = "train.steps_per_call"

  def __init__(self, config, mesh):
    super().__init__(config, mesh)
    self.data, self.oracle = open_dataset(config.data)
    check_sizes(self.data, config)
    self.names = list(self.data.table_names)
    # ids per example of each table (the batches' ids[t] are int32 or int64 [B, L_t]).
    self.bag_lengths = tuple(getattr(self.data, "bag_lengths", (1,) * len(self.names)))
    self.model = make_model(config.model, self.names)
    # train.steps_per_call = k: k batches per call of the train step, one transfer, one
    # lax.scan over the k optimizer steps (Task.batches_per_call).
    k = config.train.get("steps_per_call", 1)
    if not isinstance(k, int) or k < 1:
      raise ValueError(f"train.steps_per_call={k!r}: use an integer >= 1")
    self.steps_per_call = self.batches_per_call = k
    # With many processes, each may read only its slice of every batch (decided from the
    # config, the mesh and these tables: the trainer's layout is the same decision).
    self.process_shard = self.input_layout()[1] or (0, 1)

  def poolings(self) -> list[str]:
    """Each table's pooling: the schema column's own, else embeddings.pooling (sum)."""
    default = self.config.embeddings.get("pooling", "sum")
    schema = getattr(self.data, "manifest", {}).get("schema") or {}
    own = {c["name"]: c.get("pooling", "") for c in schema.get("categorical", ())}
    return [own.get(n) or default for n in self.names]

  def raw_tables(self) -> set[str]:
    """The tables whose ids are raw 64-bit keys (a schema column's vocab="raw", or every table
    of the Criteo reader's categorical="raw": `CTRDataset.raw_tables`): dynamic tables only."""
    return set(getattr(self.data, "raw_tables", ()))

  def tables(self) -> list[TableSpec]:
    e = self.config.embeddings
    opt = OptimizerSpec(**e.optimizer.to_dict())
    raw = self.raw_tables()
    return [
      TableSpec(
        name=n,
        num_rows=int(c),
        dim=e.dim,
        optimizer=opt,
        initializer=e.initializer,
        pooling=p,
        raw_ids=n in raw,
      )  # fmt: skip
      for n, c, p in zip(self.names, self.data.cardinalities, self.poolings())
    ]

  def _logits(self, params, batch, embeddings):
    return self.model.apply(params, batch["dense"], {n: embeddings[n] for n in self.names})

  def init_params(self, key, batch, embeddings):
    return self.init_fn()(key, batch, embeddings)

  def init_fn(self) -> _Init:
    return _Init(self.model, tuple(self.names))

  def loss(self, params, batch, embeddings, key):
    del key  # the CTR models have no dropout
    logits = self._logits(params, batch, embeddings)
    w = batch["weight"]
    ll = optax.sigmoid_binary_cross_entropy(logits, batch["label"])
    return jnp.sum(ll * w) / jnp.maximum(jnp.sum(w), 1.0), {}

  def predict(self, params, batch, embeddings):
    score = jax.nn.sigmoid(self._logits(params, batch, embeddings))
    return {"score": score, "label": batch["label"], "weight": batch["weight"]}

  def metrics(self, outputs):
    cat = {k: np.concatenate([o[k] for o in outputs]) for k in outputs[0]}
    y, p, w = cat["label"], cat["score"], cat["weight"]
    return {
      "auc": metrics_lib.auc(y, p, w),
      "logloss": metrics_lib.logloss(y, p, w),
      "accuracy": metrics_lib.accuracy(y, p, w),
    }

  def train_batches(self, start_step=0):
    t = self.config.train
    extra = {}
    if isinstance(getattr(self.data, "base", self.data), _tfds_dataset_type()):
      state = getattr(self, "_data_state", None)
      if state is not None and state != self.data_state(start_step):
        raise ValueError(
          f"the checkpoint's input state {state} is not that of step {start_step}: the "
          "checkpoint and the data do not belong together; use a fresh --workdir"
        )
      extra["state"] = state
    order = self.window_order()
    if order is not None:
      return self._window_batches(order, start_step)
    shards = self.order_shards()
    if shards > 1:
      extra["shards"] = shards
    return self.data.batches(
      "train",
      t.batch_size,
      start_step=start_step,
      shuffle_seed=self.config.seed if t.shuffle else None,
      num_epochs=None,
      shard=self.process_shard,
      **extra,
    )

  def order_shards(self) -> int:
    """train.order_shards (default 1): the pass order's shards (`CTRDataset.batch_rows`)."""
    from recgnn.data import ctr_dataset

    t = self.config.train
    shards = t.get("order_shards", 1)
    if not isinstance(shards, int) or shards < 1 or t.batch_size % shards:
      raise ValueError(
        f"train.order_shards={shards!r}: use an integer >= 1 dividing train.batch_size "
        f"({t.batch_size})"
      )
    if shards > 1 and (
      t.get("order", "pass") != "pass" or not isinstance(self.data, ctr_dataset.CTRDataset)
    ):
      raise ValueError(
        f"train.order_shards={shards} shards train.order=pass over data.source=memmap "
        "without data.multi_hot; use train.order_shards=1"
      )
    return shards

  def window_order(self):
    """The train order under train.order=window (`window_order.WindowOrder`), else None."""
    from recgnn.data import ctr_dataset, window_order

    t = self.config.train
    setting = t.get("order", "pass")
    if setting not in ("pass", "window"):
      raise ValueError(f"train.order={setting!r}; valid: pass, window")
    if setting == "pass":
      return None
    if not isinstance(self.data, ctr_dataset.CTRDataset):
      raise ValueError("train.order=window reads data.source=memmap without data.multi_hot")
    return window_order.for_train(t, self.data, self.config.seed if t.shuffle else None)

  def _window_batches(self, order, step):
    from recgnn.data.ctr_dataset import process_rows

    while True:
      rows = order.batch_rows(step)
      yield self.data.read("train", *process_rows(rows, len(rows), self.process_shard))
      step += 1

  def data_state(self, step):
    """source=tfds: the grain iterator's state after `step` batches (in the checkpoint)."""
    if isinstance(getattr(self.data, "base", self.data), _tfds_dataset_type()):
      from recgnn.data import pipeline

      return pipeline.state_at(step)
    return None

  def restore_data_state(self, state, step):
    del step
    self._data_state = state

  def forkable_input(self):
    # The memmap and synthetic sources gather with numpy / numba; tfds's grain iterator runs
    # threads of its own, which a forked child would not have.
    if isinstance(getattr(self.data, "base", self.data), _tfds_dataset_type()):
      return "data.source=tfds: its grain iterator's threads do not survive a fork"
    return ""

  def device_rows(self):
    from recgnn.data import ctr_dataset, ctr_rows

    if not isinstance(self.data, ctr_dataset.CTRDataset):  # (tfds, multi-hot expansion)
      return (
        f"{type(self.data).__name__} data is read on the host (the device feed takes "
        "data.source=memmap without data.multi_hot)"
      )
    t = self.config.train
    seed = self.config.seed if t.shuffle else None
    rows = ctr_rows.CTRRows(self.data, t.batch_size, t.eval_batch_size, seed, self.order_shards())
    rows.window = self.window_order()
    return rows

  def steps_per_epoch(self):
    return self.data.num_batches("train", self.config.train.batch_size)

  def eval_batches(self, split):
    return self.data.batches(
      split, self.config.train.eval_batch_size, drop_remainder=False, shard=self.process_shard
    )

  def describe(self):
    lines = [self.data.describe()]
    if self.oracle:
      lines.append(
        "Synthetic planted model: oracle AUC (true click probabilities) on test "
        f"{self.oracle['oracle_auc_test']:.4f}; a model given only the dense features: "
        f"{self.oracle['dense_only_auc_test']:.4f}"
      )
    return "\n".join(lines)

  def final_report(self, results):
    if not self.oracle or "test/auc" not in results:
      return {}
    oracle = self.oracle["oracle_auc_test"]
    print(
      f"test AUC {results['test/auc']:.4f}  |  oracle AUC {oracle:.4f} "
      f"(gap {oracle - results['test/auc']:.4f})  |  dense-features-only AUC "
      f"{self.oracle['dense_only_auc_test']:.4f}",
      flush=True,
    )
    return {
      "test/oracle_auc": oracle,
      "test/dense_only_auc": self.oracle["dense_only_auc_test"],
      "test/auc_gap_to_oracle": oracle - results["test/auc"],
    }


TASK = CTR
