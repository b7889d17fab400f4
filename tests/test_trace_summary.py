"""recgnn.trace_summary: per-step device time, host<->device copies and their overlap with
compute, from the profiler's Chrome trace. A hand-built trace in XLA:GPU's form pins the
classification and the interval arithmetic; a real CPU trace of a tiny profiled offload run
checks the CPU path (host gather / scatter ops of the exchange, found from the compiled HLO)
against the backend's own transfer counters."""

import gzip
import json

import contract_lib as contract
import jax
import pytest

from recgnn import planner, trace_summary
from recgnn.embeddings import base
from recgnn.train import inputs


def _gpu_trace(path):
  """Two steps on one GPU: a compute stream, a copy stream, and a derived "XLA Ops" line that
  repeats the kernels (must not be counted twice)."""
  gpu, host = 1, 2
  compute, copies, xla_ops, py = 10, 11, 12, 20

  def x(pid, tid, name, ts, dur, **args):
    return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur, "args": args}

  def meta(pid, tid, kind, name):
    e = {"ph": "M", "pid": pid, "name": kind, "args": {"name": name}}
    if tid is not None:
      e["tid"] = tid
    return e

  events = [
    meta(gpu, None, "process_name", "/device:GPU:0"),
    meta(host, None, "process_name", "/host:CPU"),
    meta(gpu, compute, "thread_name", "Stream #7(Compute)"),
    meta(gpu, copies, "thread_name", "Stream #13(MemcpyH2D,MemcpyD2H)"),
    meta(gpu, xla_ops, "thread_name", "XLA Ops"),
    meta(host, py, "thread_name", "python"),
    x(host, py, "train", 0, 30, step_num="5"),
    x(host, py, "train", 200, 30, step_num="6"),
    x(gpu, compute, "loop_fusion", 0, 100, hlo_op="fusion.1"),
    x(gpu, compute, "gemm", 150, 100, hlo_op="dot.2"),  # spans both windows: split 50 / 50
    x(gpu, xla_ops, "fusion.1", 0, 100),  # derived: ignored
    x(gpu, copies, "MemcpyH2D", 50, 120, memcpy_details="kind_src:pinned size:4096"),
    x(gpu, copies, "MemcpyD2H", 260, 20, memcpy_details="size:1024"),
    x(gpu, copies, "MemcpyD2D", 255, 5),  # neither direction
  ]
  with gzip.open(path, "wt") as f:
    json.dump({"traceEvents": events}, f)


def test_gpu_trace_copies_and_overlap(tmp_path):
  _gpu_trace(tmp_path / "host.trace.json.gz")
  s = trace_summary.summarize(trace_summary.load(str(tmp_path)))
  assert s["platform"] == "gpu" and s["steps"] == 2
  a, b = s["per_step"]
  assert (a["step"], b["step"]) == (5, 6)
  # Window [0, 200): kernels [0, 100) and [150, 200); H2D [50, 170): 50 + 20 us under compute.
  assert a["busy_us"] == 150 and a["kernel_us"] == 150 and a["kernels"] == 2
  assert a["h2d_us"] == 120 and a["h2d_overlap_us"] == 70 and a["h2d_bytes"] == 4096
  assert a["d2h_us"] == 0 and a["h2d_count"] == 1
  # Window [200, 280): the gemm's tail [200, 250); D2H [260, 280) overlaps nothing.
  assert b["busy_us"] == 50 and b["kernels"] == 0  # (the gemm started in the window before)
  assert b["d2h_us"] == 20 and b["d2h_overlap_us"] == 0 and b["d2h_bytes"] == 1024
  assert b["other_copy_us"] == 5 and b["h2d_us"] == 0
  assert s["mean"]["copy_us"] == (120 + 20) / 2
  assert s["mean"]["copy_overlap_fraction"] == pytest.approx(70 / 140)
  md = trace_summary.markdown(s)
  assert "| 5 |" in md and "50% of the copy time overlaps compute" in md


def test_interval_arithmetic():
  u = trace_summary.union([(5, 7), (0, 2), (1, 3), (7, 8), (9, 9)])
  assert u == [(0, 3), (5, 8)]
  assert trace_summary.intersect(u, [(2, 6), (7.5, 20)]) == [(2, 3), (5, 6), (7.5, 8)]
  assert trace_summary.length(u) == 6


def test_missing_trace_names_the_flag(tmp_path):
  with pytest.raises(FileNotFoundError, match="--profile_steps"):
    trace_summary.load(str(tmp_path))


def test_cpu_trace_of_an_offload_run(tmp_path):
  """A profiled offload run on XLA:CPU, every step loading and evicting rows: since its rows
  move with the batch and back after the step (issue 42), its steps hold no host gather or
  scatter (they held one per exchange and array: the H100 trace's copies)."""
  opt = base.OptimizerSpec(name="rowwise_adagrad", learning_rate=0.1, initial_accumulator=0.1)
  spec = base.TableSpec(name="t", num_rows=1000, dim=8, optimizer=opt)
  # A 64-row cache for batches touching ~100 distinct rows: every step loads and evicts.
  group = planner.make_backend("offload(cache_rows=128, policy=lookahead, lookahead=2)", spec)
  mesh = group.mesh
  plan = planner.Plan({group.name: group}, {spec.name: group.name}, mesh)
  batches = contract.zipf_ids(seed=4, num_batches=8, batch=64, bag=2, num_rows=1000)
  state = group.init(jax.random.key(0))
  lookup = jax.jit(group.lookup)
  update = jax.jit(group.update, donate_argnums=0)
  stream = [("train", None, {"ids": {"t": b}}) for b in batches]
  first, stop = 4, 7  # steps profiled: [first, stop), after the compilations
  hlo, padded = [], []
  for step, item in enumerate(inputs.run_ahead(inputs.prepare_stream(plan, stream), 0)):
    prepared = contract.put_prepared(group, item.prepared[group.name], mesh)
    if step == first:
      jax.block_until_ready(state)
      group.stats()  # reset the counters: what follows is the profiled steps'
      jax.profiler.start_trace(str(tmp_path / "profile"), create_perfetto_trace=True)
    with jax.profiler.StepTraceAnnotation("train", step_num=step):
      pooled, residuals = lookup(state, prepared)
      grads = {"t": contract.grads_for(step, pooled["t"])}
      if first <= step < stop and not hlo:
        hlo = [f.lower(state, prepared, *a).compile().as_text()
               for f, a in ((lookup, ()), (update, (residuals, grads)))]  # fmt: skip
      state = group.after_update(update(state, prepared, residuals, grads))
    if step == stop - 1:
      jax.block_until_ready(state)
      jax.profiler.stop_trace()
      padded = group.stats()["t/h2d_padded_bytes_per_step"]
  s = trace_summary.summarize(
    trace_summary.load(str(tmp_path / "profile")), trace_summary.host_ops(hlo)
  )
  assert s["platform"] == "cpu" and s["steps"] == stop - first
  assert padded > 0  # (rows did move: with the batch, and back after the step)
  ops = trace_summary.host_ops(hlo)  # (the host ops' sizes, per module: none)
  assert all(not d for sizes in ops.sizes.values() for d in sizes), ops.sizes
  for row in s["per_step"]:
    assert row["h2d_count"] == 0 and row["d2h_count"] == 0, row
    assert row["busy_us"] <= row["kernel_us"] + 1e-6, row
  # (dispatch is asynchronous: on a loaded machine one step's kernels can all run in the next
  # step's window, leaving a step with none; the profiled steps together always have some)
  assert sum(row["busy_us"] for row in s["per_step"]) > 0, s["per_step"]
