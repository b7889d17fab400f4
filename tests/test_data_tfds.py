"""TFDS array_record builders (no TensorFlow) and grain pipelines: the same values and batches
as the direct readers, resumable iterator state, per-process shards, and the CLI on a
synthetic Criteo-format train.txt placed as a manual download."""

import gzip
import os
import subprocess
import sys

import numpy as np
import pytest

# Installed with the project (pyproject); absent where it installs with --no-deps (GPU boxes).
pytest.importorskip("tensorflow_datasets")
pytest.importorskip("grain")

from recgnn.data import criteo, criteo_synthetic, kg, ogb, pipeline, planetoid, tfds_builders  # noqa: E402, I001
from recgnn.train import loop  # noqa: E402
from tests.trainer_lib import flip_byte, smoke_config, state_leaves  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROWS = 20_000


@pytest.fixture(scope="module")
def manual(tmp_path_factory):
  """A folder holding a synthetic Criteo-format train.txt (never the real data)."""
  d = tmp_path_factory.mktemp("manual")
  cfg = criteo_synthetic.SyntheticConfig(num_rows=ROWS, scale=0.0002, calibration_rows=5000)
  criteo_synthetic.generate_tsv(str(d / "train.txt"), cfg, progress=None)
  return str(d)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  """`both`'s builds: the TFDS build (tfds/) and the memmap arrays (cache/) of train.txt."""
  return tmp_path_factory.mktemp("data")


@pytest.fixture(scope="module")
def both(manual, data_dir):
  """(TFDS + grain dataset, memmap dataset) of the same train.txt."""
  d = data_dir
  builder = tfds_builders.build("criteo_kaggle", str(d / "tfds"), manual_dir=manual)
  mm = criteo.open_criteo(os.path.join(manual, "train.txt"), str(d / "cache"), progress=None)
  return pipeline.TfdsCriteo(builder, num_threads=4), mm


def _same(x, y):
  for k in ("dense", "label", "weight"):
    np.testing.assert_array_equal(x[k], y[k], err_msg=k)
  assert x["ids"].keys() == y["ids"].keys()
  for k in x["ids"]:
    np.testing.assert_array_equal(x["ids"][k], y["ids"][k], err_msg=k)


def test_kaggle_build_keeps_rows_splits_and_ids(both):
  tf, mm = both
  assert tf.cardinalities == mm.cardinalities
  for split in ("train", "valid", "test"):
    assert tf.split_size(split) == mm.split_size(split)
  start, _ = mm.splits["valid"]
  rows = np.array([0, 7, tf.split_size("valid") - 1])
  _same(tf.read("valid", rows), mm.gather(start + rows))
  assert "tensorflow" not in sys.modules  # array_record + data_source: no TensorFlow
  # The intermediate parse is gone once the build holds the rows.
  assert not os.path.exists(os.path.join(tf.builder.data_dir, "..", "..", "..", "downloads",
                                         "criteo_parse"))  # fmt: skip


def test_grain_batches_equal_memmap_batches_for_the_seed(both):
  tf, mm = both
  per_epoch = mm.num_batches("train", 1024)
  steps = per_epoch + 3  # across an epoch boundary (a new permutation)
  a = tf.batches("train", 1024, shuffle_seed=7, num_epochs=None)
  b = mm.batches("train", 1024, shuffle_seed=7, num_epochs=None)
  for _ in range(steps):
    _same(next(a), next(b))
  assert tf.fast_batches >= steps  # decoded by RecordLayout, not record by record
  # And TFDS's own decoder reads the same rows (the check behind the fast path).
  rows = tf.batch_rows("train", 2, 1024, shuffle_seed=7)
  fast = tf.read("train", rows)
  slow = tf.sources["train"].__getitems__(rows.tolist())
  np.testing.assert_array_equal(fast["dense"], np.stack([e["dense"] for e in slow]))
  np.testing.assert_array_equal(fast["ids"]["C26"][:, 0], [e["sparse"][25] for e in slow])
  # Eval: file order, the last batch padded with weight 0.
  ea = list(tf.batches("test", 1000, drop_remainder=False))
  eb = list(mm.batches("test", 1000, drop_remainder=False))
  assert len(ea) == len(eb) == 2
  for x, y in zip(ea, eb):
    _same(x, y)


def test_grain_state_resumes_mid_epoch(both):
  tf, _ = both
  it = tf.batches("train", 512, shuffle_seed=1, num_epochs=None)
  for _ in range(5):
    next(it)
  state = it.get_state()
  assert state == pipeline.state_at(5)
  expect = [next(it) for _ in range(3)]
  resumed = tf.batches("train", 512, shuffle_seed=1, num_epochs=None, state=state)
  for x in expect:
    _same(next(resumed), x)


def test_records_of_another_layout_fall_back_to_tfds_decoding(both):
  """A batch whose records differ from the first one's layout (here: one byte of a field
  tag changed) is refused by RecordLayout.view, so it is never decoded at wrong offsets."""
  tf, _ = both
  layout = tf._layout["train"]
  recs = tf._raw["train"].__getitems__([0, 1, 2])
  assert layout.view(recs) is not None
  bad = bytearray(recs[1])
  bad[int(layout.fixed[3])] ^= 1
  assert layout.view([recs[0], bytes(bad), recs[2]]) is None
  assert layout.view([recs[0], recs[1] + b"x", recs[2]]) is None


def test_process_shards_partition_the_global_batch(both):
  tf, _ = both
  whole = tf.batch("train", 3, 1024, shuffle_seed=2)
  parts = [tf.batch("train", 3, 1024, shuffle_seed=2, shard=(i, 4)) for i in range(4)]
  for k in ("dense", "label"):
    np.testing.assert_array_equal(np.concatenate([p[k] for p in parts]), whole[k])
  np.testing.assert_array_equal(np.concatenate([p["ids"]["C3"] for p in parts]), whole["ids"]["C3"])


def _smoke(cache_dir, **data):
  return smoke_config(cache_dir, rows=None, data=data, checkpoint_every=5)


_leaves = state_leaves


def test_trainer_tfds_equals_memmap_and_resumes_from_grain_state(manual, both, data_dir, tmp_path):
  """The same run through both paths gives identical params; a tfds run stopped mid-epoch
  resumes from the grain state in its checkpoint to the same end. (The runs read `both`'s
  builds, made with the smoke experiment's reader settings: built and checked once.)"""
  cache = str(data_dir / "cache")
  mm = loop.train(_smoke(cache, path=os.path.join(manual, "train.txt")), str(tmp_path / "m"))
  tf_cfg = _smoke(cache, path=manual, source="tfds", tfds_dir=str(data_dir / "tfds"))
  wd = str(tmp_path / "t")
  part = loop.train(tf_cfg, wd, stop_after=7)  # checkpoints at 5 and 7 (mid-epoch)
  assert part.metrics["step"] == 7
  from recgnn.train import checkpoint

  meta = checkpoint.Checkpointer(wd).metadata(7)
  assert meta["data_state"] == pipeline.state_at(7)
  resumed = loop.train(tf_cfg, wd, resume=True)
  for x, y in zip(_leaves(mm.state), _leaves(resumed.state)):
    np.testing.assert_array_equal(x, y)
  assert resumed.metrics["test/auc"] == mm.metrics["test/auc"]


@pytest.mark.slow
@pytest.mark.long  # (the trainer on TFDS: test_trainer_tfds_equals_memmap..., default run)
def test_cli_dlrm_kaggle_trains_from_a_manual_train_txt(manual, tmp_path):
  cmd = [
    sys.executable, "run.py", "--experiment=dlrm_kaggle", f"--workdir={tmp_path / 'wd'}",
    "--config.data.source=tfds", f"--config.data.path={manual}",
    f"--config.data.cache_dir={tmp_path / 'cache'}", "--config.train.steps=3",
    "--config.train.log_every=1", "--config.train.checkpoint_every=0",
    "--config.train.eval_batch_size=2048", "--config.train.final_eval_splits=('test',)",
  ]  # fmt: skip
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  assert "TFDS criteo_kaggle" in out.stdout and "array_record, grain" in out.stdout
  assert "step       3/3" in out.stdout and "test/auc" in out.stdout


def test_terabyte_days_one_per_worker_equal_memmap(tmp_path, monkeypatch):
  days = []
  for d in range(3):
    cfg = criteo_synthetic.SyntheticConfig(
      num_rows=900 + 100 * d, scale=0.0002, seed=d, calibration_rows=2000
    )
    p = str(tmp_path / "manual" / f"day_{d}")
    os.makedirs(os.path.dirname(p), exist_ok=True)
    criteo_synthetic.generate_tsv(p, cfg, progress=None)
    days.append(p)
  reader = criteo.ReaderConfig(categorical="hash", hash_sizes=5000)
  monkeypatch.setattr(tfds_builders.CriteoTerabyte, "num_workers", 2)  # 3 days, 2 processes
  b = tfds_builders.build(
    "criteo_terabyte", str(tmp_path / "tfds"), manual_dir=str(tmp_path / "manual"),
    config=tfds_builders.criteo_config(reader),
  )  # fmt: skip
  tf = pipeline.TfdsCriteo(b, num_threads=2)
  mm = criteo.open_criteo(days, str(tmp_path / "cache"), reader=reader, split="last_file",
                          progress=None)  # fmt: skip
  for split in ("train", "valid", "test"):
    n = mm.split_size(split)
    assert tf.split_size(split) == n
    start, _ = mm.splits[split]
    rows = np.arange(n)
    _same(tf.read(split, rows), mm.gather(start + rows))


def _graphs_equal(a, b):
  assert a.num_nodes == b.num_nodes and a.num_classes == b.num_classes
  assert (a.adj != b.adj).nnz == 0
  np.testing.assert_array_equal(a.labels, b.labels)
  for s in ("train", "valid", "test"):
    np.testing.assert_array_equal(a.splits[s], b.splits[s])
  if a.features is None:
    assert b.features is None
  else:
    np.testing.assert_array_equal(a.features, b.features)


def _nc_graph(**data):
  """The node task's graph for a data config (data.source=tfds selects the builders)."""
  import ml_collections

  from recgnn.data import graph_loading as loading

  return loading.load_raw_graph(ml_collections.ConfigDict(data))


def test_planetoid_builder_round_trips_cora(tmp_path):
  g = _nc_graph(source="tfds", name="cora", tfds_dir=str(tmp_path))
  _graphs_equal(g, planetoid.load("cora"))


def _tiny_ogb(root) -> None:
  """A 30-node graph in the OGB raw layout under `root`."""
  rng = np.random.default_rng(0)
  n = 30
  files = {
    "raw/edge.csv.gz": "".join(f"{a},{b}\n" for a, b in rng.integers(0, n, (80, 2))),
    "raw/node-label.csv.gz": "".join(f"{x}\n" for x in rng.integers(0, 3, n)),
    "raw/node-feat.csv.gz": "".join(f"{a!r},{b!r}\n" for a, b in rng.normal(size=(n, 2)).tolist()),
    "split/time/train.csv.gz": "".join(f"{i}\n" for i in range(10)),
    "split/time/valid.csv.gz": "".join(f"{i}\n" for i in range(10, 20)),
    "split/time/test.csv.gz": "".join(f"{i}\n" for i in range(20, 25)),
  }
  for name, text in files.items():
    os.makedirs(os.path.dirname(root / name), exist_ok=True)
    with gzip.open(root / name, "wt") as f:
      f.write(text)


def test_ogb_builder_round_trips_the_raw_layout(tmp_path):
  root = tmp_path / "ogbn_tiny"
  _tiny_ogb(root)
  g = _nc_graph(source="tfds", path=str(root), tfds_dir=str(tmp_path / "tfds"))
  _graphs_equal(g, ogb.load(str(root)))


def test_a_damaged_build_is_built_again_from_its_source(tmp_path):
  """A shard cut to half its bytes, then a flipped byte in dataset_info.json (which the TFDS
  constructor reads first): each time the next `build` builds the planetoid build again
  (new files, the same graph), never reading the damaged one."""
  data_dir = str(tmp_path / "tfds")
  ref = tfds_builders.load_graph(tfds_builders.build("planetoid", data_dir, config="cora"))
  folder = tfds_builders.variant_dir("planetoid", data_dir, "cora")
  assert tfds_builders.build_problem(folder) is None
  shard = next(os.path.join(folder, f) for f in os.listdir(folder) if "-train.array_record" in f)
  size = os.path.getsize(shard)
  with open(shard, "r+b") as f:
    f.truncate(size // 2)
  assert "has" in tfds_builders.build_problem(folder) and shard in tfds_builders.build_problem(
    folder
  )
  again = tfds_builders.build("planetoid", data_dir, config="cora")
  assert os.path.getsize(shard) == size and tfds_builders.build_problem(folder) is None
  _graphs_equal(tfds_builders.load_graph(again), ref)
  flip_byte(os.path.join(folder, "dataset_info.json"), 10)
  assert "dataset_info.json's first bytes differ" in tfds_builders.build_problem(folder)
  third = tfds_builders.build("planetoid", data_dir, config="cora")
  assert tfds_builders.build_problem(folder) is None
  _graphs_equal(tfds_builders.load_graph(third), ref)
  assert sorted(os.listdir(os.path.dirname(folder))) == ["1.0.0"]  # nothing left aside


def test_a_damaged_build_without_its_source_is_refused_naming_the_file(tmp_path):
  """An OGB build whose source folder is gone and whose shard is damaged: refused naming the
  shard and the fix, and the damaged build is left where it was (not deleted)."""
  root = tmp_path / "ogbn_tiny"
  _tiny_ogb(root)
  data_dir = str(tmp_path / "tfds")
  config = tfds_builders.ogb_config_for(str(root))
  tfds_builders.build("ogb_node", data_dir, manual_dir=str(root), config=config)
  folder = tfds_builders.variant_dir("ogb_node", data_dir, config)
  shard = next(os.path.join(folder, f) for f in os.listdir(folder) if "-test.array_record" in f)
  flip_byte(shard, 0)
  import shutil

  shutil.rmtree(root)
  with pytest.raises(ValueError, match=r"-test\.array_record.*first bytes differ.*Fix: give"):
    tfds_builders.build("ogb_node", data_dir, manual_dir=str(root), config=config)
  assert os.path.exists(shard) and "first bytes differ" in tfds_builders.build_problem(folder)


def test_fb15k237_builder_keeps_triples_and_names(tmp_path):
  manual = tmp_path / "kg"
  manual.mkdir()
  rng = np.random.default_rng(0)
  for s, n in (("train", 300), ("valid", 40), ("test", 40)):
    rows = rng.integers(0, 50, (n, 3))
    (manual / f"{s}.txt").write_text("".join(f"e{h}\tr{r % 7}\te{t}\n" for h, r, t in rows))
  b = tfds_builders.build("fb15k237", str(tmp_path / "tfds"), manual_dir=str(manual))
  ref = kg.load(str(manual))
  got = tfds_builders.load_kg(b)
  assert got.entities == ref.entities and got.relations == ref.relations
  assert got.num_relations == ref.num_relations  # reciprocals, as kg.load
  for s in kg.SPLITS:
    np.testing.assert_array_equal(got.splits[s], ref.splits[s])
