"""Data too small for the run, refused before anything is allocated with one line naming the
file, its row counts and the fix: an empty file, a file shorter than one batch, a train split
smaller than one batch, a file of malformed lines only, an empty eval split. On generated
Criteo-format files (never real Criteo data)."""

import os
import subprocess
import sys

import pytest

from recgnn.data import criteo_synthetic as cs
from recgnn.tasks import ctr
from recgnn.train import loop
from tests.trainer_lib import smoke_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def lines(tmp_path_factory):
  """2,071 generated Criteo TSV lines (the size of the file in issue 30)."""
  path = str(tmp_path_factory.mktemp("gen") / "train.txt")
  config = cs.SyntheticConfig(num_rows=2071, scale=1e-3, seed=5, calibration_rows=10_000)
  cs.generate_tsv(path, config, lambda *_: None)
  with open(path) as f:
    return f.readlines()


def _file(tmp_path, text: str) -> str:
  path = str(tmp_path / "train.txt")
  with open(path, "w") as f:
    f.write(text)
  return path


def _config(tmp_path, path, batch_size=2048, **train):
  c = smoke_config(str(tmp_path / "cache"), rows=None, data={"path": path}, **train)
  c.train.batch_size = batch_size
  return c


def _refusal(config, workdir) -> str:
  with pytest.raises(ctr.DataTooSmall) as e:
    loop.train(config, str(workdir))
  assert e.value.during_setup  # run.py prints it as one line, exit status 2
  assert not os.path.exists(os.path.join(workdir, "checkpoints"))
  return str(e.value)


def test_empty_file(tmp_path):
  path = _file(tmp_path, "")
  msg = _refusal(_config(tmp_path, path), tmp_path / "wd")
  assert msg.startswith(f"{path}: no rows to train on: it is empty"), msg


def test_only_malformed_lines(tmp_path, lines):
  bad = ["\t".join(line.split("\t")[:-1]) + "\n" for line in lines[:20]]  # 39 columns
  path = _file(tmp_path, "".join(bad))
  msg = _refusal(_config(tmp_path, path), tmp_path / "wd")
  assert msg.startswith(f"{path}: no rows to train on: all 20 lines are malformed"), msg


def test_file_shorter_than_one_batch(tmp_path, lines):
  path = _file(tmp_path, "".join(lines[:100]))
  msg = _refusal(_config(tmp_path, path), tmp_path / "wd")
  assert path in msg and "100 rows (train " in msg, msg
  assert "fewer than one batch of train.batch_size=2,048" in msg
  # The fix it names: a batch the train split holds (a power of two), and train.steps.
  assert "--config.train.batch_size=64 or smaller" in msg and "train.steps" in msg, msg


def test_train_split_smaller_than_one_batch(tmp_path, lines):
  """2,071 rows: the Kaggle split's train part is 1,776 rows < one batch of 2,048 (the run
  died with "does not know its train split's size"); the batch it names then trains."""
  path = _file(tmp_path, "".join(lines))
  msg = _refusal(_config(tmp_path, path), tmp_path / "wd")
  assert "2,071 rows (train 1,776, valid 147, test 148; 0 malformed lines skipped)" in msg, msg
  assert "leaves 1,776 train rows, fewer than one batch of train.batch_size=2,048" in msg
  assert "--config.train.batch_size=1024 or smaller" in msg
  res = loop.train(_config(tmp_path, path, batch_size=1024, steps=2), str(tmp_path / "ok"))
  assert res.metrics["step"] == 2


def test_empty_eval_split(tmp_path, lines):
  """13 rows: the Kaggle split's last seventh (1 row) is all test, valid is empty."""
  path = _file(tmp_path, "".join(lines[:13]))
  config = _config(tmp_path, path, batch_size=8, final_eval_splits=("valid", "test"))
  msg = _refusal(config, tmp_path / "wd")
  assert "the run evaluates on valid, which the kaggle split leaves empty" in msg, msg
  assert "--config.train.final_eval_splits=\"('test',)\"" in msg


def test_epochs_of_a_task_without_batches_names_the_batch():
  class Tiny:
    def steps_per_epoch(self):
      return 0

  with pytest.raises(ValueError, match="less than one batch.*train.batch_size"):
    loop.training_length(smoke_config("/nonexistent", epochs=1.0, steps=0).train, Tiny())


def test_cli_prints_one_line_and_exits_2(tmp_path, lines):
  """The command line: the message alone on stderr (no traceback), exit status 2;
  --verbose shows the traceback."""
  path = _file(tmp_path, "".join(lines[:100]))
  cmd = [
    sys.executable,
    "run.py",
    "--experiment=smoke",
    f"--workdir={tmp_path / 'wd'}",
    f"--config.data.path={path}",
    f"--config.data.cache_dir={tmp_path / 'cache'}",
  ]
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 2, out.stderr[-3000:]
  last = out.stderr.strip().splitlines()
  assert "Traceback" not in out.stderr and len(last) == 1, out.stderr[-3000:]
  assert last[0].startswith(f"DataTooSmall: {path}: 100 rows"), last
  out = subprocess.run([*cmd, "--verbose"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)  # fmt: skip
  assert out.returncode != 0 and "Traceback" in out.stderr
