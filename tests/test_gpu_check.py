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


def _perf_result(batch, dtype, k, sps, feed, busy=None):
  e = {"status": "ok", "batch": batch, "dtype": dtype, "k": k, "feed": feed,
       "feed_used": feed, "samples_per_second": {"steady": sps, "final_loss": 0.5}}  # fmt: skip
  if busy is not None:
    e["trace"] = {"busy_fraction": busy, "step_ms": 1.0, "gap_ms": 1.0 - busy}
  return e


def test_perf_stage_runs_both_feeds_and_the_peer(tmp_path):
  """The perf stage's plan: every config (2048 at k = 1 and 8, 65536 bf16) with the device
  feed and the host feed, the k = 1 ones traced first; the PyTorch peer compiled at both
  batches; run.py's arguments (train.feed; k: counts rounded to whole calls)."""
  ctx = _ctx(tmp_path)
  ctx.mode = "gpu"
  s = gpu_check.perf_sizes(ctx)
  runs = gpu_check.perf_runs(s)
  assert runs == [
    (65536, "bfloat16", 1, True, "device"), (65536, "bfloat16", 1, True, "host"),
    (2048, "float32", 1, True, "device"), (2048, "float32", 1, True, "host"),
    (2048, "float32", 8, False, "device"), (2048, "float32", 8, False, "host"),
  ]  # fmt: skip
  assert gpu_check.perf_torch_runs(s, "gpu") == [(65536, "compiled_bf16"), (2048, "compiled")]
  assert {b for b, _ in gpu_check.perf_torch_runs(s, "cpu")} == {s["small"], s["large"]}
  host = gpu_check.perf_args(ctx, s, 65536, "bfloat16", 1, "/w", trace=False, feed="host")
  assert "--config.train.feed=host" in host and "--config.model.dtype=bfloat16" in host
  args = gpu_check.perf_args(ctx, s, 2048, "float32", 8, "/w", trace=True, feed="device")
  assert "--config.train.steps_per_call=8" in args and "--config.train.feed=device" in args
  steps = int(next(a for a in args if a.startswith("--config.train.steps=")).split("=")[1])
  log = int(next(a for a in args if a.startswith("--config.train.log_every=")).split("=")[1])
  assert steps % 8 == 0 and log % 8 == 0 and steps % log == 0
  prof = next(a for a in args if a.startswith("--profile_steps="))
  a, b = (int(x) for x in prof.split("=")[1].split(":"))
  assert a % 8 == 0 and b - a == 40  # 5 calls of 8 steps
  assert gpu_check.feed_used("x\nInput: device feed: the data on the devices\ny") == (
    "device", "device feed: the data on the devices")  # fmt: skip
  assert gpu_check.feed_used("Input: host feed: CPU devices")[0] == "host"
  assert gpu_check.feed_used("nothing")[0] == "?"


def test_perf_checks_print_the_ratios_and_targets(tmp_path):
  """perf_checks: device / host feed per config (with the traced busy shares), each GPU
  target met or not, recgnn / PyTorch per batch for each feed (else why not)."""
  ctx = _ctx(tmp_path)
  ctx.mode = "gpu"
  s = gpu_check.perf_sizes(ctx)
  res = {
    "a": _perf_result(65536, "bfloat16", 1, 12e6, "device", busy=0.75),
    "b": _perf_result(65536, "bfloat16", 1, 1.2e6, "host", busy=0.1),
    "c": _perf_result(2048, "float32", 1, 2.5e6, "device", busy=0.4),
    "d": _perf_result(2048, "float32", 1, 1.25e6, "host", busy=0.15),
    "e": _perf_result(2048, "float32", 8, 3e6, "device"),
    "f": {"status": "skipped", "batch": 2048, "dtype": "float32", "k": 8, "feed": "host"},
  }
  peer = {"runs": {"b2048_compiled": {"samples_per_s": 0.25e6, "final_loss": 0.5},
                   "b65536_compiled_bf16": {"samples_per_s": 7e6, "final_loss": 0.5}}}  # fmt: skip
  checks = gpu_check.perf_checks(ctx, s, res, peer)
  assert ("batch 65536 bfloat16 k=1: device feed 12,000,000 / host feed 1,200,000 samples/s "
          "= 10.00x; GPU busy 75% / 10%") in checks  # fmt: skip
  assert (
    "batch 2048 float32 k=1: device feed 2,500,000 / host feed 1,250,000 samples/s = 2.00x"
    "; GPU busy 40% / 15%" in checks
  )
  assert any(c.startswith("batch 2048 float32 k=8: device feed 3,000,000 / host feed -") and
             "no ratio" in c for c in checks)  # fmt: skip
  assert "batch 2048: 3,000,000 samples/s (target >= 2,000,000): yes" in checks
  assert "batch 65536: 12,000,000 samples/s (target >= 10,000,000): yes" in checks
  assert any("device feed: GPU busy 75%" in c and c.endswith("yes") for c in checks)
  assert ("batch 65536: recgnn / PyTorch compiled_bf16 (7,000,000 samples/s) = device feed "
          "1.71, host feed 0.17 (target >= 1.5): yes") in checks  # fmt: skip
  assert (
    "batch 2048: recgnn / PyTorch compiled (250,000 samples/s) = device feed 12.00, host "
    "feed 5.00 (target >= 1.5): yes" in checks
  )
  checks = gpu_check.perf_checks(ctx, s, res, {"skipped": "torch does not import"})
  assert any(c.startswith("batch 65536: no PyTorch figure") for c in checks)
  res["a"]["tables"] = {"link": {"host_to_device_bytes": 8.0, "device_to_host_bytes": 0.0}}
  md = "\n".join(gpu_check.perf_markdown(ctx, s, res, {"skipped": "torch does not import"}))
  assert "| a | ok | device (device) | 12,000,000 | 0.5000 | 8 B to device / 0 B to host |" in md
  assert "not run: torch does not" in md


def test_tier_checks_count_pinned_copies(tmp_path):
  """The tiers stage's checks: pinned -> pinned copies per traced step, target 0."""
  ctx = _ctx(tmp_path)
  ctx.mode = "gpu"
  mean = {"other_copy_count": 0.0, "other_copy_bytes": 0.0}
  res = {
    "cdlrm_kaggle/default": {"status": "ok", "trace_summary": {"mean": mean}, "feed_used": "host"},
    "hotline_kaggle/default": {"status": "ok", "feed_used": "host", "trace_summary": {
      "mean": {"other_copy_count": 52.0, "other_copy_bytes": 18.7e6}}},
    "dlrm_kaggle/default": {"status": "failed", "trace_summary": {"error": "no trace"}},
  }  # fmt: skip
  c = gpu_check.tier_checks(ctx, res)
  assert c[0] == ("cdlrm_kaggle/default: pinned -> pinned copies per step: 0 (0 B) (target 0): "
                  "yes; host feed")  # fmt: skip
  assert c[1].startswith("hotline_kaggle/default: pinned -> pinned copies per step: 52 (17.8 MiB)")
  assert "NO" in c[1] and "no trace (no trace)" in c[2]
