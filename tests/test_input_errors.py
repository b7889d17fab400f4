"""Errors of the data or the plan reach the user as one line naming the fix, exit 2, wherever
they are raised: in the plan (an offload cache smaller than a batch's distinct rows, known
from the batch's shape), on the input thread, in the input worker process."""

import os
import subprocess
import sys

import pytest

from tests.trainer_lib import xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A run.py whose dense groups' prepare fails on the third batch with a user error (a
# ValueError naming a fix), in whichever process runs it (the worker forks this one).
PLANTED = """
import sys
from recgnn.embeddings.group import TableGroup
real, seen = TableGroup.prepare, [0]
def prepare(self, ids, upcoming=(), *, train=True):
  seen[0] += 1
  if seen[0] == 3:
    raise ValueError("planted: the third batch is bad; use --config.data.path=good.tsv")
  return real(self, ids, upcoming, train=train)
TableGroup.prepare = prepare
sys.argv = ["run.py", *sys.argv[1:]]
import run
run.cli()
"""


def _run(args, cache_dir, tmp_path, code=None):
  argv = [sys.executable, "-c", code, *args] if code else [sys.executable, "run.py", *args]
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT, "XLA_FLAGS": xla_flags(1)}
  common = [f"--workdir={tmp_path / 'wd'}", f"--config.data.cache_dir={cache_dir}",
            "--config.data.synthetic.rows=20000", "--config.train.steps=8"]  # fmt: skip
  return subprocess.run(
    argv + common, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
  )


def _one_line(out, *needles):
  assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-3000:]
  lines = [x for x in out.stderr.splitlines() if x.strip() and "WARNING" not in x]
  assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
  for n in needles:
    assert n in lines[0], lines[0]


def test_an_offload_cache_smaller_than_a_batch_is_refused_before_training(ctr_cache, tmp_path):
  """docs/backends/offload.md's SSD example without its min_cache_rows: a 1% cache of the
  smoke run's tables cannot hold a batch's distinct ids (at most min(256 x 1, the table's
  rows)); refused at plan time for the plan's first such table, naming the rows it needs."""
  plan = ("(('C(3|4|10)', \"offload(cache_fraction=0.01, host_cache=0.05, "
          f"storage='ssd:{tmp_path / 'rows'}')\"), ('.*', 'dense'))")  # fmt: skip
  out = _run(["--experiment=smoke", f"--config.embeddings.plan={plan}"], ctr_cache, tmp_path)
  _one_line(out, "table 'C3'", "can touch 256 distinct rows", "min_cache_rows=256")
  assert "step " not in out.stdout  # (before the first step)


@pytest.mark.parametrize("workers", [0, 1], ids=["thread", "worker"])
def test_an_error_in_prepare_is_one_line(ctr_cache, tmp_path, workers):
  """A user error raised by a group's prepare mid-run, on the input thread or in the worker
  process: one line with the fix, exit 2 (--verbose shows the traceback)."""
  args = ["--experiment=smoke", f"--config.train.input_workers={workers}"]
  out = _run(args, ctr_cache, tmp_path, code=PLANTED)
  _one_line(out, "ValueError: planted: the third batch is bad", "good.tsv", "input side")
