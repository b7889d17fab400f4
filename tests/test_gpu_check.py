"""tools/gpu_check.py's pieces that need no GPU: a stage's time limit, its result files,
merging a calibration into the package, the metrics it reads back."""

import argparse
import gzip
import importlib.util
import json
import os
import sys
import time

import pytest

# Loaded from its file: benchmarks/ on sys.path would shadow names (data, tt, sampling).
_PATH = os.path.join(os.path.dirname(os.path.dirname(__file__)), "tools", "gpu_check.py")
_spec = importlib.util.spec_from_file_location("gpu_check", _PATH)
gpu_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_check)


def _ctx(tmp_path):
  args = argparse.Namespace(out=str(tmp_path / "out"), work=str(tmp_path / "work"),
                            allow_cpu=True, wheels=None, experiments=None)  # fmt: skip
  ctx = gpu_check.Ctx(args)
  ctx.device = {"platform": "cpu", "kind": "cpu", "count": 1, "jax": "x"}
  ctx.mode = "cpu"
  return ctx


@pytest.mark.serial  # a 2 s limit enforced within 10 s
def test_stage_limit_stops_a_command_and_files_are_written(tmp_path, monkeypatch):
  monkeypatch.setattr(gpu_check, "KILL_GRACE", 2)
  st = gpu_check.Stage(_ctx(tmp_path), "probe")
  t0 = time.monotonic()
  r = st.run("sleeper", [sys.executable, "-c", "import time; print('hi', flush=True); "
                         "time.sleep(60)"], limit=2)  # fmt: skip
  assert r["status"] == "timeout" and time.monotonic() - t0 < 10
  assert "hi" in gpu_check._read(r["log"])
  ok = st.run("quick", [sys.executable, "-c", "print('done')"], limit=30)
  assert ok["status"] == "ok" and ok["exit_code"] == 0
  st.md.append("body")
  st.write("ok")
  out = tmp_path / "out"
  assert sorted(os.listdir(out)) == ["probe.json", "probe.log", "probe.md"]
  assert json.loads((out / "probe.json").read_text())["status"] == "ok"
  assert "sleeper" in (out / "probe.log").read_text() and "body" in (out / "probe.md").read_text()


def test_merge_tt_cost(tmp_path):
  entry = {"batched_fixed_ns": 1.0, "batched_ns": 2.0, "batched_ns_per_mac": 0.1,
           "pairs_fixed_ns": 3.0, "pairs_ns_per_mac": 0.01, "pairs_max_floats": 8,
           "source": "H100 fit"}  # fmt: skip
  fit = tmp_path / "calibrate.json"
  fit.write_text(json.dumps({"key": "gpu:NVIDIA H100", "entry": entry, "levels": []}))
  target = tmp_path / "tt_cost.json"
  target.write_text(json.dumps({"_doc": "d"}))
  gpu_check.merge_tt_cost(str(fit), str(target))
  got = json.loads(target.read_text())
  assert got["gpu:NVIDIA H100"] == entry and got["_doc"] == "d"
  assert got["gpu"]["pairs_ns_per_mac"] == 0.01 and "for any gpu" in got["gpu"]["source"]
  # A second GPU kind keeps the first as the backend's entry.
  fit.write_text(json.dumps({"key": "gpu:H200", "entry": {**entry, "source": "H200"}}))
  gpu_check.merge_tt_cost(str(fit), str(target))
  got = json.loads(target.read_text())
  assert got["gpu:H200"]["source"] == "H200" and "H100" in got["gpu"]["source"]
  fit.write_text(json.dumps({"key": "cpu:cpu", "entry": entry}))
  with pytest.raises(SystemExit, match="CPU fit"):
    gpu_check.merge_tt_cost(str(fit), str(target))
  fit.write_text(json.dumps({"key": "gpu:x", "entry": {"batched_ns": 1.0}}))
  with pytest.raises(SystemExit, match="lacks"):
    gpu_check.merge_tt_cost(str(fit), str(target))


def test_metrics_read_back():
  rows = [
    {"step": 5, "loss": 0.6, "samples_per_second": 100.0, "C1/h2d_bytes_per_step": 9.0},
    {"step": 10, "loss": 0.5, "samples_per_second": 300.0, "C1/h2d_bytes_per_step": 4.0,
     "C1/d2h_bytes_per_step": 2.0, "C2/h2d_bytes_per_step": 6.0, "h2d_bytes_per_step": 50.0},
    {"step": 15, "loss": 0.4, "samples_per_second": 500.0, "valid/auc": 0.7},
  ]  # fmt: skip
  t = gpu_check.throughput(rows)
  assert t["steady"] == 400.0 and t["steady_intervals"] == 2 and t["final_loss"] == 0.4
  s = gpu_check.backend_stats(rows)
  # After the first interval: C1 4, C2 6 and hot_cold's group-wide 50 bytes per step.
  assert s["transfers"]["h2d_bytes_per_step"] == 60.0 and s["transfers"]["tables"] == 3
  assert "valid" not in s["tables"]


def test_intervals_that_compiled_are_left_out_and_counted():
  """A bucketed exchange list can give the step a new shape after the first interval: the
  interval whose `link/programs` grew holds a compile, left out of 'steady' and counted."""
  rows = [
    {"step": 5, "samples_per_second": 100.0, "link/programs": 1.0},
    {"step": 10, "samples_per_second": 300.0, "link/programs": 1.0},
    {"step": 15, "samples_per_second": 50.0, "link/programs": 2.0},  # compiled
    {"step": 20, "samples_per_second": 500.0, "link/programs": 2.0},
  ]
  t = gpu_check.throughput(rows)
  assert t["steady"] == 400.0 and t["steady_intervals"] == 2
  assert t["compiling_intervals"] == 1 and t["programs"] == 2


def test_large_trace_is_trimmed_to_device_events(tmp_path, monkeypatch):
  events = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
            {"ph": "X", "pid": 1, "tid": 1, "name": "k", "ts": 0, "dur": 1},
            {"ph": "X", "pid": 2, "tid": 1, "name": "train", "ts": 0, "dur": 1},
            *({"ph": "X", "pid": 2, "tid": 2, "name": f"$py{i}", "ts": i, "dur": 1}
              for i in range(2000))]  # fmt: skip
  src = tmp_path / "t.trace.json.gz"
  with gzip.open(src, "wt") as f:
    json.dump({"traceEvents": events}, f)
  assert gpu_check._small_trace(str(src), str(tmp_path / "a.json.gz")) == "whole"
  monkeypatch.setattr(gpu_check, "TRACE_BYTES", 100)
  how = gpu_check._small_trace(str(src), str(tmp_path / "b.json.gz"))
  assert "too large" in how  # even trimmed, over 100 bytes
  monkeypatch.setattr(gpu_check, "TRACE_BYTES", os.path.getsize(src) - 1)
  how = gpu_check._small_trace(str(src), str(tmp_path / "c.json.gz"))
  with gzip.open(tmp_path / "c.json.gz", "rt") as f:
    kept = json.load(f)["traceEvents"]
  assert "trimmed" in how and [e["name"] for e in kept] == ["process_name", "k", "train"]


def _perf_result(batch, dtype, k, sps, busy=None):
  e = {"status": "ok", "batch": batch, "dtype": dtype, "k": k,
       "samples_per_second": {"steady": sps, "final_loss": 0.5}}  # fmt: skip
  if busy is not None:
    e["trace"] = {"busy_fraction": busy, "step_ms": 1.0, "gap_ms": 1.0 - busy}
  return e


def test_perf_stage_runs_and_checks_name_each_target(tmp_path):
  """The perf stage (issue 43): its runs (traced ones first, k > 1 at the small batch), its
  run.py arguments (k: counts rounded to whole calls), and its checks: each GPU target met
  or not, the PyTorch ratio only where the peer ran (else why not)."""
  ctx = _ctx(tmp_path)
  ctx.mode = "gpu"
  s = gpu_check.perf_sizes(ctx)
  runs = gpu_check.perf_runs(s)
  assert runs[:2] == [(2048, "float32", 1, True, ""), (65536, "bfloat16", 1, True, "")]
  assert (2048, "float32", 8, False, "") in runs and (65536, "float32", 1, False, "") in runs
  assert runs[-1] == (65536, "bfloat16", 1, False, "host")  # dense's dedup: the host's
  host = gpu_check.perf_args(ctx, s, 65536, "bfloat16", 1, "/w", trace=False, dedup="host")
  assert '--config.embeddings.plan=((".*", "dense(dedup=host)"),)' in host
  args = gpu_check.perf_args(ctx, s, 2048, "bfloat16", 8, "/w", trace=True)
  assert "--config.train.steps_per_call=8" in args and "--config.model.dtype=bfloat16" in args
  steps = int(next(a for a in args if a.startswith("--config.train.steps=")).split("=")[1])
  log = int(next(a for a in args if a.startswith("--config.train.log_every=")).split("=")[1])
  assert steps % 8 == 0 and log % 8 == 0 and steps % log == 0
  prof = next(a for a in args if a.startswith("--profile_steps="))
  a, b = (int(x) for x in prof.split("=")[1].split(":"))
  assert a % 8 == 0 and b - a == 40  # 5 calls of 8 steps
  res = {
    "a": _perf_result(2048, "float32", 1, 2.5e6, busy=0.4),
    "b": _perf_result(65536, "bfloat16", 1, 9e6, busy=0.75),
    "c": {**_perf_result(65536, "bfloat16", 1, 6e6), "dedup": "host"},
  }
  peer = {"runs": {"b2048_eager": {"samples_per_s": 1e6, "final_loss": 0.5},
                   "b2048_compiled": {"samples_per_s": 2e6, "final_loss": 0.5}}}  # fmt: skip
  checks = gpu_check.perf_checks(ctx, s, res, peer)
  assert "batch 2048: 2,500,000 samples/s (target >= 2,000,000): yes" in checks
  assert "batch 65536: 9,000,000 samples/s (target >= 10,000,000): NO" in checks
  assert any("GPU busy 75%" in c and c.endswith("yes") for c in checks)
  assert "batch 65536 bf16: dedup auto 9,000,000 vs host 6,000,000 samples/s (1.50x)" in checks
  assert "batch 2048: recgnn / best PyTorch = 1.25 (target >= 1.5): NO" in checks
  assert any(c.startswith("batch 65536: no PyTorch figure") for c in checks)
  md = "\n".join(gpu_check.perf_markdown(ctx, s, res, {"skipped": "torch does not import"}))
  assert "| a | ok | 2,500,000 |" in md and "not run: torch does not import" in md
