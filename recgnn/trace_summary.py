"""Per-step summary of an XLA profiler trace: device compute, host<->device copies, overlap.

  python -m recgnn.trace_summary WORKDIR/profile               # newest *.trace.json.gz under it
  python -m recgnn.trace_summary TRACE.json.gz --hlo HLO_DUMP_DIR --json summary.json

Reads the Chrome / Perfetto trace JSON that `jax.profiler` writes (`--profile_steps` of
run.py: WORKDIR/profile/plugins/profile/*/HOST.trace.json.gz) and reports, for each profiled
train step (the trainer's `StepTraceAnnotation("train", step_num=k)`) and on average:

  busy_us      time the device computes (union of its kernels / XLA ops, copies excluded)
  kernel_us    sum of those kernels' durations (> busy_us when kernels run concurrently)
  h2d_us       time host -> device copies run (union of their intervals), with their count
               and bytes where the trace records them
  d2h_us       the same, device -> host
  *_overlap_us the part of the copy time during which the device also computes (interval
               intersection across streams): copies hidden behind compute cost no step time

What counts as what:
  - XLA:GPU (CUDA / CUPTI): the device's processes (`/device:GPU:N`), their stream lines
    (`Stream #...`; the derived lines "XLA Ops", "Steps", ... repeat the same time and are
    skipped). Copies by CUPTI's names: MemcpyH2D / MemcpyD2H (also "HtoD" / "DtoH" spellings
    and `memcpy_details` args); D2D / P2P copies and memsets are "other copies"; everything
    else on a stream is a kernel.
  - XLA:CPU has no device and no copies: the "device" is XLA's own ops (events with an
    `hlo_op` arg) on the host threads. Memory-space transfers compile to nothing there, and
    the host side of an offload exchange (`compute_on("device_host")`: the gather of missing
    rows from the host table, the scatter of evicted rows into it) runs as ordinary ops.
    Given the compiled HLO (`--hlo`: XLA_FLAGS=--xla_dump_to=DIR --xla_dump_hlo_as_text, or
    `jax.jit(f).lower(...).compile().as_text()`), ops marked `_xla_compute_type="host"` that
    gather / slice from host memory stand in for H2D and those that scatter / update into it
    for D2H (`copies_from` says which source the figures come from). On a GPU the same ops
    are reported as host_gather / host_scatter beside the real copies.

Steps: a window per execution of the train step's XLA module on the device (`--step_module`,
default the trainer's jit_train_step; its ops share a `run_id`), from its first op to the next
execution's; device work is counted in the window it starts in (clipped to it). The host
dispatches ahead of the device, so a trace can hold executions of steps dispatched before it
started: they are numbered back from the annotated steps, and one caught only in part is
marked partial and left out of the mean. Without run ids (they come from XLA's annotations;
a trace may lack them), the windows run from one host step annotation to the next.

The per-step summary of a trace, from reading it through interval arithmetic to the report
and its CLI; which HLO ops are host ops is recgnn.trace_hlo's (re-exported here).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import gzip
import json
import os
import re
import statistics
import sys
from collections.abc import Iterable, Sequence

from recgnn.trace_hlo import HostOps, host_ops, read_hlo  # noqa: F401 (the CLI's and callers')

Interval = tuple[float, float]

# Derived lines of a device process (tsl's trace viewer conversion): they repeat the time of
# the stream lines' kernels, so counting them would double it.
DERIVED_LINES = (
  "XLA Ops",
  "XLA Modules",
  "Steps",
  "Framework Ops",
  "Framework Name Scope",
  "Source code",
  "XLA TraceMe",
  "TensorFlow Ops",
  "TensorFlow Name Scope",
  "Launch Stats",
  "Async XLA Ops",
)
_H2D = re.compile(
  r"memcpy\s*h(ost)?\s*_?2\s*_?d|memcpy\s*h(ost)?\s*_?to\s*_?d|\bhtod\b|\bh2d\b", re.I
)
_D2H = re.compile(
  r"memcpy\s*d(evice)?\s*_?2\s*_?h|memcpy\s*d(evice)?\s*_?to\s*_?h|\bdtoh\b|\bd2h\b", re.I
)
_OTHER_COPY = re.compile(r"memcpy|memset", re.I)
_SIZE = re.compile(r"(?:size|num_bytes|bytes)\s*[:=]\s*(\d+)", re.I)


# ----------------------------------------------------------------------------- reading
@dataclasses.dataclass
class Trace:
  events: list[dict]  # complete events ("ph": "X"), ts / dur in microseconds
  processes: dict  # pid -> name
  threads: dict  # (pid, tid) -> name
  path: str


def find_trace(path: str) -> str:
  """A trace file from a file or a directory (the newest *.trace.json.gz under it, else the
  newest perfetto_trace.json.gz)."""
  if os.path.isfile(path):
    return path
  if not os.path.isdir(path):
    raise FileNotFoundError(f"no trace at {path!r} (give a *.trace.json.gz or a directory)")
  for pattern in ("*.trace.json.gz", "perfetto_trace.json.gz", "*.trace.json", "*.json.gz"):
    found = glob.glob(os.path.join(path, "**", pattern), recursive=True)
    if found:
      return max(found, key=os.path.getmtime)
  raise FileNotFoundError(
    f"no *.trace.json.gz under {path!r}: profile with run.py --profile_steps=START:STOP "
    "(or jax.profiler.start_trace(dir, create_perfetto_trace=True))"
  )


def load(path: str) -> Trace:
  path = find_trace(path)
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rt") as f:
    data = json.load(f)
  raw = data["traceEvents"] if isinstance(data, dict) else data
  processes, threads, events = {}, {}, []
  for e in raw:
    ph = e.get("ph")
    if ph == "M":
      if e.get("name") == "process_name":
        processes[e.get("pid")] = str(e.get("args", {}).get("name", ""))
      elif e.get("name") == "thread_name":
        threads[(e.get("pid"), e.get("tid"))] = str(e.get("args", {}).get("name", ""))
    elif ph == "X" and "ts" in e:
      events.append(e)
  return Trace(events, processes, threads, path)


# ---------------------------------------------------------------------------- intervals
def union(intervals: Iterable[Interval]) -> list[Interval]:
  out: list[list[float]] = []
  for a, b in sorted(intervals):
    if b <= a:
      continue
    if out and a <= out[-1][1]:
      out[-1][1] = max(out[-1][1], b)
    else:
      out.append([a, b])
  return [(a, b) for a, b in out]


def length(merged: Sequence[Interval]) -> float:
  return sum(b - a for a, b in merged)


def intersect(x: Sequence[Interval], y: Sequence[Interval]) -> list[Interval]:
  """Intersection of two merged (sorted, disjoint) interval lists."""
  out, i, j = [], 0, 0
  while i < len(x) and j < len(y):
    a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
    if a < b:
      out.append((a, b))
    if x[i][1] < y[j][1]:
      i += 1
    else:
      j += 1
  return out


# --------------------------------------------------------------------------- classify
def _is_device_process(name: str) -> bool:
  return bool(re.match(r"/device:(GPU|TPU)", name)) or "GPU" in name.split(" ")[0]


def _copy_kind(e: dict) -> str | None:
  name = e.get("name", "")
  args = e.get("args") or {}
  details = " ".join(str(args[k]) for k in args if "memcpy" in k.lower() or k == "kind")
  if _H2D.search(name) or re.search(r"htod|host_?to_?device|h2d", details, re.I):
    return "h2d"
  if _D2H.search(name) or re.search(r"dtoh|device_?to_?host|d2h", details, re.I):
    return "d2h"
  if _OTHER_COPY.search(name) or details:
    return "other_copy"
  return None


def _bytes(e: dict) -> int:
  args = e.get("args") or {}
  for k in ("bytes", "num_bytes", "size", "bytes_transferred"):
    if k in args:
      try:
        return int(args[k])
      except (TypeError, ValueError):
        pass
  for v in args.values():
    m = _SIZE.search(str(v))
    if m:
      return int(m.group(1))
  return 0


@dataclasses.dataclass
class Classified:
  platform: str  # "gpu" (device processes found) or "cpu"
  device: list[tuple[str, dict]]  # (category, event): compute / h2d / d2h / other_copy
  host: list[tuple[str, dict]]  # host ops of the exchange: h2d / d2h / host (from the HLO)
  steps: list[tuple[int, float]]  # (step_num, start us) of the step annotations


def classify(trace: Trace, hlo: HostOps | None = None, step_name: str = "train") -> Classified:
  kind_of = (hlo or HostOps()).resolver(trace.events)
  device_pids = {pid for pid, n in trace.processes.items() if _is_device_process(n)}
  stream_threads = {
    k for k, n in trace.threads.items() if k[0] in device_pids and n.startswith("Stream")
  }
  device, host, steps = [], [], []
  for e in trace.events:
    pid, key = e.get("pid"), (e.get("pid"), e.get("tid"))
    args = e.get("args") or {}
    if e.get("name") == step_name and "step_num" in args and pid not in device_pids:
      steps.append((int(args["step_num"]), float(e["ts"])))
      continue
    if pid in device_pids:
      tname = trace.threads.get(key, "")
      if stream_threads and key not in stream_threads:
        continue
      if not stream_threads and tname in DERIVED_LINES:
        continue
      device.append((_copy_kind(e) or "compute", e))
      continue
    if "hlo_op" not in args:
      continue
    kind, nbytes = kind_of(e)
    if nbytes and "bytes" not in args:  # the size the HLO gives a host gather / scatter
      e = {**e, "args": {**args, "bytes": nbytes}}
    if device_pids:
      # A GPU run: XLA ops on the host are the host computations (compute_on), not the
      # device's work; the named ones are the exchange's gather / scatter.
      if kind is not None:
        host.append((kind, e))
    elif kind is not None:
      host.append((kind, e))
    else:
      device.append((_copy_kind(e) or "compute", e))
  steps.sort(key=lambda s: s[1])
  return Classified("gpu" if device_pids else "cpu", device, host, steps)


# ---------------------------------------------------------------------------- summary
def _clip(events: Iterable[dict], lo: float, hi: float) -> list[Interval]:
  out = []
  for e in events:
    a = float(e["ts"])
    b = a + float(e.get("dur", 0.0))
    a, b = max(a, lo), min(b, hi)
    if b > a:
      out.append((a, b))
  return out


def _in(events: Iterable[dict], lo: float, hi: float) -> list[dict]:
  return [e for e in events if lo <= float(e["ts"]) < hi]


def _windows(every: list[dict], steps: list, end: float, step_module: str):
  """[(step, start, stop, partial)]: one window per execution of the step's XLA module on the
  device (its ops share a run_id), else per host step annotation; and how they were made.

  The host dispatches ahead, so the device may still run steps dispatched before the trace
  started: runs are numbered back from the annotated steps (the last runs are theirs), and
  a run caught only in part (fewer ops than the typical run) is marked partial and left out
  of the mean.
  """
  runs: dict[str, list[float]] = {}
  pattern = re.compile(step_module)
  for e in every:
    a = e.get("args") or {}
    if "run_id" in a and pattern.search(str(a.get("hlo_module", ""))):
      r = runs.setdefault(str(a["run_id"]), [float(e["ts"]), 0.0, 0])
      r[0] = min(r[0], float(e["ts"]))
      r[1] = max(r[1], float(e["ts"]) + float(e.get("dur", 0.0)))
      r[2] += 1
  if runs:
    order = sorted(runs.values())
    typical = statistics.median(r[2] for r in order)
    nums = [s[0] for s in steps]
    last = nums[-1] if nums else len(order) - 1
    out = []
    for i, (lo, _, n) in enumerate(order):
      hi = order[i + 1][0] if i + 1 < len(order) else end
      out.append((last - (len(order) - 1 - i), lo, hi, n < 0.9 * typical))
    return out, f"executions of the XLA module /{step_module}/ on the device (run_id)"
  starts = [s for s in steps if s[1] < end]
  if starts:
    return [
      (num, t, starts[i + 1][1] if i + 1 < len(starts) else end, False)
      for i, (num, t) in enumerate(starts)
    ], "host step annotations (no run ids of the step module in the trace)"
  return [(None, min(float(e["ts"]) for e in every), end, False)], "the whole trace"


def _copy_events(c, by: dict, host_by: dict) -> tuple[list, list, str]:
  """(h2d events, d2h events, where they came from): the device's copies, or on XLA:CPU
  (no copies) the exchange's host ops standing in for them."""
  has_copies = bool(by["h2d"] or by["d2h"])
  if c.platform == "gpu" or has_copies:
    copies_from = "copy events (MemcpyH2D / MemcpyD2H)" if has_copies else "none in the trace"
    return by["h2d"], by["d2h"], copies_from
  copies_from = (
    "host ops of the exchange (XLA:CPU has no copies: the host gather stands in for H2D, "
    "the host scatter for D2H; from the HLO)"
    if c.host
    else "none (XLA:CPU has no copies; give --hlo for the host ops of an offload exchange)"
  )
  return host_by["h2d"], host_by["d2h"], copies_from


def _graph_updates(trace: Trace) -> list[dict]:
  """XLA:GPU's CUDA graph updates on the launching thread: host time per step, counted per
  step window."""
  devices = {pid for pid, n in trace.processes.items() if _is_device_process(n)}
  return [
    e for e in trace.events
    if e.get("name") == "command_buffer::update" and e.get("pid") not in devices and "ts" in e
  ]  # fmt: skip


def _step_row(window: tuple, by: dict, host_by: dict, h2d, d2h, updates, gpu: bool) -> dict:
  """One step's figures: window (step number, start, end, partial) -> the row of `per_step`."""
  num, lo, hi, partial = window
  compute = by["compute"]
  busy = union(_clip(compute, lo, hi))
  row = {"step": num, "start_us": lo, "span_us": hi - lo, "busy_us": length(busy)}
  row["partial"] = partial
  row["kernel_us"] = sum(b - a for a, b in _clip(compute, lo, hi))
  row["kernels"] = len(_in(compute, lo, hi))
  copies = []
  for name, evs in (("h2d", h2d), ("d2h", d2h)):
    iv = union(_clip(evs, lo, hi))
    copies += iv
    row[f"{name}_us"] = length(iv)
    row[f"{name}_count"] = len(_in(evs, lo, hi))
    row[f"{name}_bytes"] = sum(_bytes(e) for e in _in(evs, lo, hi))
    row[f"{name}_overlap_us"] = length(intersect(iv, busy))
  allc = union(copies)
  row["copy_us"] = length(allc)
  row["copy_overlap_us"] = length(intersect(allc, busy))
  row["other_copy_us"] = length(union(_clip(by["other_copy"], lo, hi)))
  # (pinned -> pinned and other copies: a host table copied whole shows up here)
  row["other_copy_count"] = len(_in(by["other_copy"], lo, hi))
  row["other_copy_bytes"] = sum(_bytes(e) for e in _in(by["other_copy"], lo, hi))
  row["graph_updates"] = len(_in(updates, lo, hi))
  row["graph_update_us"] = sum(b - a for a, b in _clip(updates, lo, hi))
  if gpu:
    for name in ("h2d", "d2h", "host"):
      row[f"host_{name}_ops_us"] = length(union(_clip(host_by[name], lo, hi)))
  return row


def _mean_row(whole: list[dict]) -> dict:
  """The mean of every figure over the whole steps, and the fraction of copy time overlapped."""
  keys = [k for k in whole[0] if k not in ("step", "start_us", "partial")]
  mean = {k: sum(r[k] for r in whole) / len(whole) for k in keys}
  mean["copy_overlap_fraction"] = (
    mean["copy_overlap_us"] / mean["copy_us"] if mean["copy_us"] else None
  )
  return mean


def summarize(
  trace: Trace,
  hlo: HostOps | None = None,
  step_name: str = "train",
  step_module: str = "train_step",
) -> dict:
  """The per-step and mean figures (microseconds, bytes) described in the module docstring.
  step_module: a regex of the train step's XLA module name (the trainer's: jit_train_step)."""
  c = classify(trace, hlo, step_name)
  by = collections.defaultdict(list)
  for cat, e in c.device:
    by[cat].append(e)
  host_by = collections.defaultdict(list)
  for cat, e in c.host:
    host_by[cat].append(e)
  h2d, d2h, copies_from = _copy_events(c, by, host_by)
  updates = _graph_updates(trace)
  every = [e for _, e in c.device] + [e for _, e in c.host]
  if not every:
    raise ValueError(
      f"{trace.path}: no device work in the trace (no XLA op or device stream events)"
    )
  end = max(float(e["ts"]) + float(e.get("dur", 0.0)) for e in every)
  windows, how = _windows(every, c.steps, end, step_module)
  gpu = c.platform == "gpu"
  rows = [_step_row(w, by, host_by, h2d, d2h, updates, gpu) for w in windows]
  whole = [r for r in rows if not r["partial"]] or rows
  return {
    "trace": trace.path,
    "platform": c.platform,
    "copies_from": copies_from,
    "steps": len(whole),
    "windows": how,
    "per_step": rows,
    "mean": _mean_row(whole),
    "events": {cat: len(v) for cat, v in by.items()}
    | {f"host_{k}": len(v) for k, v in host_by.items()},
  }


def _fmt_bytes(b: float) -> str:
  for unit in ("B", "KiB", "MiB"):
    if b < 1024:
      return f"{b:.0f} {unit}" if unit == "B" else f"{b:.1f} {unit}"
    b /= 1024
  return f"{b:.2f} GiB"


def markdown(s: dict, title: str = "") -> str:
  m = s["mean"]
  frac = m.get("copy_overlap_fraction")
  lines = [
    f"### Trace summary{': ' + title if title else ''}",
    "",
    f"`{s['trace']}` ({s['platform']}; copies from {s['copies_from']}): {s['steps']} whole "
    f"step(s), windows from {s['windows']}. Mean per step: device busy {m['busy_us'] / 1e3:.3f} ms "
    f"({m['kernel_us'] / 1e3:.3f} ms of kernels), H2D {m['h2d_us'] / 1e3:.3f} ms "
    f"({m['h2d_count']:.0f} copies, {_fmt_bytes(m['h2d_bytes'])}), D2H "
    f"{m['d2h_us'] / 1e3:.3f} ms ({m['d2h_count']:.0f}, {_fmt_bytes(m['d2h_bytes'])}); "
    + (
      f"{100 * frac:.0f}% of the copy time overlaps compute."
      if frac is not None
      else "no copy time."
    ),
    "",
    "| step | window ms | busy ms | kernels | H2D ms (n) | H2D overlapped ms | D2H ms (n) "
    "| D2H overlapped ms |",
    "|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for r in s["per_step"]:
    lines.append(
      f"| {r['step']}{' (partial)' if r['partial'] else ''} | {r['span_us'] / 1e3:.3f} "
      f"| {r['busy_us'] / 1e3:.3f} | {r['kernels']} "
      f"| {r['h2d_us'] / 1e3:.3f} ({r['h2d_count']}) | {r['h2d_overlap_us'] / 1e3:.3f} "
      f"| {r['d2h_us'] / 1e3:.3f} ({r['d2h_count']}) | {r['d2h_overlap_us'] / 1e3:.3f} |"
    )
  return "\n".join(lines) + "\n"


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("trace", help="a *.trace.json[.gz] or a directory holding one (newest)")
  p.add_argument("--hlo", nargs="*", default=[], help="compiled HLO text files / XLA dump dirs")
  p.add_argument("--step_name", default="train", help="host annotation of a step")
  p.add_argument("--step_module", default="train_step", help="regex: the step's XLA module")
  p.add_argument("--json", help="also write the summary here")
  args = p.parse_args(argv)
  s = summarize(load(args.trace), host_ops(read_hlo(args.hlo)), args.step_name, args.step_module)
  print(markdown(s))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(s, f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())
