"""benchmarks/dlrm_throughput.py --model=dcnv2 --check: recgnn's DCNv2 train step and TorchRec's
DLRM_DCN (where the peers are installed) have the same parameters and give the same logits on
identical weights, before and after one SGD step on MLPerf's multi-hot bags."""

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(
  importlib.util.find_spec("torchrec") is None or importlib.util.find_spec("fbgemm_gpu") is None,
  reason="needs the peers (benchmarks/peers/install.sh)",
)
def test_dcnv2_recgnn_matches_torchrec_dlrm_dcn():
  # A subprocess: the benchmark puts benchmarks/ on sys.path, whose module names (data, tt,
  # sampling) would shadow others in this session. 26 tables: bags of 1 to 100 ids.
  cmd = [sys.executable, "benchmarks/dlrm_throughput.py", "--model=dcnv2", "--check"]
  cmd += ["--rows=1000", "--batch=64", "--low-rank=8"]
  out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  assert "same model: yes" in out.stdout
