"""The step model's H100 prediction beside what a GPU trace measured, for the same runs.

Question: how well does recgnn.step_model predict the steps a GPU trace measured?

`tools/gpu_check.sh --stage=trace` profiles steps (110:115 by default) of `cdlrm_kaggle`
(offload) and `hotline_kaggle` (hot_cold) on a GPU and summarizes each trace
(`recgnn.trace_summary`: kernel time, kernels, host <-> device copies, other copies, the step's
span). This script rebuilds each of those runs here (the experiment, batch size, synthetic
rows and steps the trace stage used, from its `trace.json`), trains up to the first profiled
step on this CPU, compiles the train step of each profiled step and puts
`recgnn.step_model`'s H100 prediction (serial and overlapped; compute / device memory / host
memory / host link / launches) beside the trace's measurement of the same step. The HLO is
XLA:CPU's, not XLA:GPU's: its kernel count and fusions differ (the prediction's launch term
counts XLA:CPU's kernels), which the table shows beside the GPU's.

  python benchmarks/gpu_vs_model.py                            # results/gpu_h100
  python benchmarks/gpu_vs_model.py --results=benchmarks/results/gpu_h200 --name=gpu_vs_model_h200

Writes benchmarks/results/gpu_vs_model.{json,md} (`--name`). A few minutes on 2 cores (the
runs' data, 1M synthetic rows, is built once in a temporary cache).
"""

from __future__ import annotations

import json
import pathlib
import re
import tempfile

import harness
import jax

import run as run_py  # (the repository's run.py: its experiment loader)
from recgnn import comms, step_model
from recgnn.train import setup as train_setup


def experiment_spec(name: str, batch: int) -> str:
  """The experiment string the trace stage ran (tools/gpu_check.py experiment_args)."""
  return f"cdlrm_kaggle:min_rows={batch}" if name == "cdlrm_kaggle" else name


def predicted(name: str, settings: dict, profile: tuple[int, int], cache_dir: str) -> list[dict]:
  """Train `name` as the trace stage did up to the first profiled step; then, per profiled
  step, the compiled step's cost and its H100 prediction."""
  config = run_py.load_config(experiment_spec(name, settings["batch"]))
  config.train.batch_size = settings["batch"]
  config.data.synthetic.rows = settings["rows"]
  config.data.cache_dir = cache_dir
  config.train.checkpoint_every = 0
  run = train_setup.build(config)
  it = run.task.train_batches(0)
  stream = [("train", None, next(it)) for _ in range(profile[1])]
  state = run.state
  out = []
  for k, (_, packed) in enumerate(run.feed(stream)):
    if k >= profile[0]:
      lowered = run.train_step.lower(state, *packed)
      cost = step_model.step_cost(lowered)
      p = step_model.predict(cost, step_model.H100)
      link = comms.host_link_of(lowered)
      out.append({
        "step": k,
        "kernels": cost.kernels,
        "host_to_device_bytes": link.to_device_bytes,
        "device_to_host_bytes": link.to_host_bytes,
        "serial_ms": 1e3 * p.serial_s,
        "overlapped_ms": 1e3 * p.overlapped_s,
        "parts_ms": {
          k: 1e3 * getattr(p, k)
          for k in ("compute_s", "memory_s", "host_s", "host_link_s", "launch_s")
        },
      })  # fmt: skip
    state, _ = run.train_step(state, *packed)
    if k % 20 == 0:
      print(f"[{name}] step {k} of {profile[1]}", flush=True)
  return out


def host_side(trace_path: pathlib.Path) -> dict:
  """What the trace says beyond `trace_summary`'s means, per step of the step program (its
  executions: `GpuExecutable::ExecuteThunks` on the launching thread): that thread's time in
  the executable, in CUDA-graph launches (`command_buffer::execute`) and waiting for host
  computations (`...call-done`); the pinned -> pinned copies (`MemcpyOther`): count and
  bytes."""
  import gzip

  with gzip.open(trace_path, "rt") as f:
    events = json.load(f)["traceEvents"]
  runs = [e for e in events if e.get("ph") == "X" and e["name"].endswith("ExecuteThunks")]
  if not runs:
    return {}
  out = {"executions": len(runs), "execute_ms": 0.0, "graph_launch_ms": 0.0, "host_wait_ms": 0.0}
  for r in runs:
    t0, t1 = r["ts"], r["ts"] + r["dur"]
    out["execute_ms"] += r["dur"] / 1e3
    for e in events:
      if e.get("ph") != "X" or (e["pid"], e["tid"]) != (r["pid"], r["tid"]) or e is r:
        continue
      if t0 <= e["ts"] and e["ts"] + e.get("dur", 0) <= t1:
        if e["name"] == "command_buffer::execute":
          out["graph_launch_ms"] += e["dur"] / 1e3
        elif e["name"].endswith("call-done") or ".call-done." in e["name"]:
          out["host_wait_ms"] += e["dur"] / 1e3
  copies = [e for e in events if e.get("ph") == "X" and e["name"] == "MemcpyOther"]
  sizes = [
    int(m.group(1))
    for e in copies
    if (m := re.search(r"size:(\d+)", str((e.get("args") or {}).get("memcpy_details", ""))))
  ]
  n = len(runs)
  out.update(
    {k: v / n for k, v in out.items() if k.endswith("_ms")},
    other_copies=len(copies) / n,
    other_copy_bytes=sum(sizes) / n,
    other_copy_ms=sum(e["dur"] for e in copies) / 1e3 / n,
  )
  return out


def _mean(rows: list[dict], key) -> float:
  vals = [key(r) for r in rows]
  return sum(vals) / len(vals) if vals else float("nan")


def main() -> None:
  ap = harness.flags.parser(__doc__)
  ap.add_argument("--results", default="benchmarks/results/gpu_h100", help="a gpu_check folder")
  ap.add_argument("--name", default="gpu_vs_model")
  ap.add_argument("--experiments", default=None, help="comma list (default: the trace's)")
  ap.add_argument("--quick", action="store_true", help="smoke run: the trace's first experiment")
  args = ap.parse_args()
  trace = json.loads((pathlib.Path(args.results) / "trace.json").read_text())
  s = trace["settings"]
  profile = tuple(int(x) for x in s["profile"].split(":"))
  names = args.experiments.split(",") if args.experiments else list(trace["experiments"])
  names = names[:1] if args.quick else names
  device = trace.get("device", {}).get("kind", "a GPU")
  rows, sides = [], []
  payload = {"machine": harness.machine_info(), "gpu_results": args.results}
  payload["settings"], payload["experiments"] = s, {}
  with tempfile.TemporaryDirectory() as tmp:
    for name in names:
      measured = trace["experiments"][name]["trace_summary"]
      tfile = trace["experiments"][name].get("trace_file")
      side = host_side(pathlib.Path(args.results) / tfile) if tfile else {}
      pred = predicted(name, s, profile, tmp)
      payload["experiments"][name] = {"measured": measured, "host_side": side, "predicted": pred}
      sides.append([
        name,
        f"{side.get('execute_ms', float('nan')):.2f}",
        f"{side.get('graph_launch_ms', float('nan')):.2f}",
        f"{side.get('host_wait_ms', float('nan')):.2f}",
        f"{side.get('other_copies', float('nan')):.0f} x "
        f"{side.get('other_copy_bytes', 0) / max(side.get('other_copies', 0), 1) / 1024:.1f} KiB",
        f"{side.get('other_copy_ms', float('nan')):.2f}",
      ])  # fmt: skip
      m = measured["mean"]
      rows.append([
        name,
        f"{_mean(pred, lambda r: r['serial_ms']):.3f} / "
        f"{_mean(pred, lambda r: r['overlapped_ms']):.3f}",
        " / ".join(
          f"{_mean(pred, lambda r, k=k: r['parts_ms'][k]):.3f}"
          for k in ("compute_s", "memory_s", "host_s", "host_link_s", "launch_s")
        ),
        f"{m['busy_us'] / 1e3:.3f}",
        f"{m.get('other_copy_us', 0.0) / 1e3:.3f}",
        f"{m['span_us'] / 1e3:.2f}",
        f"{_mean(pred, lambda r: r['kernels']):.0f} / {m['kernels']:.0f}",
        f"{_mean(pred, lambda r: r['host_to_device_bytes']) / 1024:.1f} / "
        f"{_mean(pred, lambda r: r['device_to_host_bytes']) / 1024:.1f}",
        f"{m['h2d_bytes'] / 1024:.1f} / {m['d2h_bytes'] / 1024:.1f}",
      ])  # fmt: skip
  md = "\n".join([
    f"# The step model's H100 prediction beside the measured {device} trace",
    "",
    f"`{payload['machine']['command']}`, jax {jax.__version__} here, "
    f"{payload['machine']['date_utc']}; the trace: `{args.results}/trace.md` "
    f"(steps {s['profile']} of {s['steps']}, batch {s['batch']}, synthetic {s['rows']:,} rows). "
    "Predicted: means over the same steps' programs compiled here (XLA:CPU's HLO). Measured: "
    "the trace's means per step (kernels busy: the union of kernel time on the GPU; other "
    "copies: pinned host -> pinned host copies inside the step, which the model does not count; "
    "span: the host's step annotation, host work included). Link bytes: predicted = the step "
    "program's own transfers; measured = every copy in the step, the batch's input transfer "
    "included.",
    "",
    harness.md_table(
      [
        "experiment",
        "predicted ms serial / overlapped",
        "predicted ms compute / memory / host / link / launches",
        "measured kernels busy ms",
        "measured other copies ms",
        "measured step span ms",
        "kernels predicted (XLA:CPU) / measured",
        "link KiB predicted in / out",
        "link KiB measured in / out",
      ],
      rows,
    ),
    "",
    "The trace's step program beyond the means, per execution (from the returned trace: "
    "`host_side`): the launching thread's time in the executable, in CUDA-graph launches "
    "(`command_buffer::execute`) and waiting for host computations (`call-done`); the "
    "pinned -> pinned copies (`MemcpyOther`).",
    "",
    harness.md_table(
      [
        "experiment",
        "executable ms",
        "graph launches ms",
        "host computation waits ms",
        "pinned -> pinned copies",
        "their ms",
      ],
      sides,
    ),
    "",
  ])  # fmt: skip
  harness.write_results(args.name, payload, md)


if __name__ == "__main__":
  main()
