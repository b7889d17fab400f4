"""Helpers of benchmarks/gpu_check.sh (run that, not this).

  python benchmarks/gpu_check.py detect [--allow-cpu]   JSON of the accelerator; exit 3: no GPU
  python benchmarks/gpu_check.py deps                   project dependencies not installed
  python benchmarks/gpu_check.py collect --work DIR --out DIR [--device-json F] ...
                                                        results JSON + markdown from the stages
  pytest -p gpu_check ...                               (benchmarks/ on PYTHONPATH) the plugin:
      a test whose mesh needs more devices than the machine has (sharding.make_mesh's
      "needs N devices; M available") is reported as skipped, not failed, and the header
      names the platform the tests run on.

Nothing here imports jax at module level: `deps` and `collect` work without it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import socket
import statistics
import sys
import time
import xml.etree.ElementTree as ET

NO_GPU = 3  # exit status of `detect` when jax sees no GPU
EXPERIMENTS = ("dlrm_kaggle", "ttrec_kaggle", "cdlrm_kaggle")
# Offload counters (recgnn/embeddings/offload.py stats()), logged per table as "TABLE/KEY".
OFFLOAD_SUM = (
  "h2d_bytes_per_step",
  "d2h_bytes_per_step",
  "h2d_padded_bytes_per_step",
  "h2d_rows_per_step",
  "d2h_rows_per_step",
  "misses_per_step",
  "plan_ms_per_step",
)
_DEVICES_RE = re.compile(r"needs (\d+) devices; (\d+) available")


# ------------------------------------------------------------------------------ pytest plugin
if "pytest" in sys.modules:  # loaded with `pytest -p gpu_check`
  import pytest

  @pytest.hookimpl(wrapper=True)
  def pytest_runtest_call(item):
    try:
      return (yield)
    except ValueError as e:
      m = _DEVICES_RE.search(str(e))
      if m is None:
        raise
      pytest.skip(f"gpu_check: mesh needs {m.group(1)} devices, {m.group(2)} available")

  def pytest_report_header(config):
    import jax

    devs = jax.devices()
    return [f"gpu_check: {len(devs)} x {devs[0].device_kind} ({jax.default_backend()})"]

  def pytest_configure(config):
    want = os.environ.get("RECGNN_GPU_CHECK_EXPECT_PLATFORM")
    if want:
      import jax

      got = jax.default_backend()
      if got != want:
        raise pytest.UsageError(f"gpu_check: tests would run on {got!r}, expected {want!r}")


# ------------------------------------------------------------------------------------ detect
def detect(allow_cpu: bool) -> int:
  """Print the accelerator as JSON. Exit 0 with a GPU (or --allow-cpu), NO_GPU without."""
  import jax

  info: dict = {"jax": jax.__version__}
  try:
    import jaxlib

    info["jaxlib"] = jaxlib.__version__
  except Exception:  # noqa: BLE001
    pass
  try:
    gpus = jax.devices("gpu")
  except RuntimeError as e:  # no GPU backend: "Unknown backend gpu" / "no devices"
    gpus, info["gpu_error"] = [], str(e).splitlines()[0][:300]
  if gpus:
    devs, platform_name = gpus, gpus[0].platform  # "cuda" or "rocm": the JAX_PLATFORMS value
  elif allow_cpu:
    devs, platform_name = jax.devices("cpu"), "cpu"
  else:
    print(json.dumps({**info, "platform": None, "count": 0}))
    return NO_GPU
  info.update(
    platform=platform_name,
    backend="gpu" if gpus else "cpu",
    count=len(devs),
    kind=devs[0].device_kind,
    devices=[str(d) for d in devs],
  )
  try:
    stats = devs[0].memory_stats() or {}
    if "bytes_limit" in stats:
      info["memory_bytes"] = int(stats["bytes_limit"])
  except Exception:  # noqa: BLE001 (not every backend has memory_stats)
    pass
  print(json.dumps(info))
  return 0


# -------------------------------------------------------------------------------------- deps
def missing_dependencies(pyproject: str = "pyproject.toml", extra=()) -> list[str]:
  """Names of pyproject's [project] dependencies (and `extra`) with no installed
  distribution."""
  from importlib import metadata

  with open(pyproject, "rb") as f:
    text = f.read().decode()
  try:
    import tomllib

    deps = tomllib.loads(text)["project"]["dependencies"]
  except ImportError:  # Python 3.10: the list is simple enough to read with a regex
    block = re.search(r"^dependencies\s*=\s*\[(.*?)^\]", text, re.S | re.M).group(1)
    deps = re.findall(r'"([^"]+)"', block)
  out = []
  for d in [*deps, *extra]:
    name = re.split(r"[\s<>=!~;\[]", d.strip(), maxsplit=1)[0]
    try:
      metadata.version(name)
    except metadata.PackageNotFoundError:
      out.append(name)
  return out


# ----------------------------------------------------------------------------------- collect
def _read(path: str) -> str:
  with open(path, errors="replace") as f:
    return f.read()


def _read_jsonl(path: str) -> list[dict]:
  rows = []
  if not os.path.exists(path):
    return rows
  with open(path) as f:
    for line in f:
      line = line.strip()
      if line:
        with contextlib.suppress(json.JSONDecodeError):  # a line cut by a killed run
          rows.append(json.loads(line))
  return rows


def throughput(rows: list[dict], profile: tuple[int, int] | None) -> dict:
  """samples/s per logged interval; 'steady' = median over the intervals after the first
  (compilation) that do not overlap the profiled steps."""
  train = [r for r in rows if "samples_per_second" in r]
  intervals, prev = [], 0
  for r in train:
    intervals.append({"steps": [prev, r["step"]], "samples_per_second": r["samples_per_second"]})
    prev = r["step"]
  steady = [
    iv["samples_per_second"]
    for i, iv in enumerate(intervals)
    if i > 0 and not (profile and iv["steps"][0] < profile[1] and iv["steps"][1] > profile[0])
  ]
  out: dict = {"intervals": intervals}
  if steady:
    out["steady"] = statistics.median(steady)
    out["steady_intervals"] = len(steady)
  elif intervals:  # too few intervals: the last one, compile or profile included
    out["steady"] = intervals[-1]["samples_per_second"]
    out["steady_intervals"] = 0
  if train:
    out["final_loss"] = train[-1].get("loss")
    out["steps"] = train[-1]["step"]
  return out


def backend_stats(rows: list[dict]) -> dict:
  """Per-table backend counters ('TABLE/KEY'), averaged over the logged train intervals after
  the first (the first holds the cache's cold start); offload totals over the tables."""
  train = [r for r in rows if "samples_per_second" in r]
  use = train[1:] or train
  per_table: dict[str, dict[str, float]] = {}
  for r in use:
    for k, v in r.items():
      table, sep, key = k.partition("/")
      if not sep or table in ("valid", "test", "train") or not isinstance(v, (int, float)):
        continue
      per_table.setdefault(table, {}).setdefault(key, []).append(float(v))
  tables = {t: {k: statistics.fmean(v) for k, v in kv.items()} for t, kv in per_table.items()}
  out: dict = {"tables": tables}
  offload = {t: s for t, s in tables.items() if "h2d_bytes_per_step" in s}
  if offload:
    tot = {k: sum(s.get(k, 0.0) for s in offload.values()) for k in OFFLOAD_SUM}
    hit = [s["hit_rate"] for s in offload.values() if "hit_rate" in s]
    rows_h2d = tot["h2d_rows_per_step"]
    tot["h2d_prefetched_fraction"] = (
      sum(
        s.get("h2d_prefetched_fraction", 1.0) * s.get("h2d_rows_per_step", 0.0)
        for s in offload.values()
      )
      / rows_h2d
      if rows_h2d
      else 1.0
    )
    # Hit rate over all tables: misses / (hits + misses) needs hits; hits = misses * h / (1 - h).
    hits = sum(
      s["misses_per_step"] * s["hit_rate"] / (1 - s["hit_rate"])
      for s in offload.values()
      if "hit_rate" in s and s["hit_rate"] < 1
    )
    looked = hits + tot["misses_per_step"]
    if looked:
      tot["hit_rate"] = hits / looked
    if hit:
      tot["hit_rate_min_table"] = min(hit)
    tot["tables"] = len(offload)
    out["offload"] = tot
  return out


def trace_files(workdir: str) -> list[dict]:
  root = os.path.join(workdir, "profile")
  found = []
  for d, _, files in os.walk(root):
    for f in sorted(files):
      p = os.path.join(d, f)
      found.append({"path": os.path.abspath(p), "bytes": os.path.getsize(p)})
  return found


def contract_summary(work: str) -> dict:
  out: dict = {}
  status = os.path.join(work, "contract.status")
  if os.path.exists(status):
    out.update(json.loads(_read(status)))
  else:
    return {"status": "not run"}
  xml = os.path.join(work, "contract.xml")
  if os.path.exists(xml):
    root = ET.parse(xml).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is not None:
      for k in ("tests", "failures", "errors", "skipped"):
        out[k] = int(suite.get(k, 0))
      out["time_s"] = float(suite.get("time", 0))
      failed, for_devices = [], 0
      for case in suite.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
          failed.append(f"{case.get('classname')}::{case.get('name')}")
        sk = case.find("skipped")
        if sk is not None and "gpu_check: mesh needs" in (sk.get("message") or ""):
          for_devices += 1
      out["failed"] = failed
      out["skipped_for_devices"] = for_devices
  if "tests" in out:
    passed = out["tests"] - out["failures"] - out["errors"] - out["skipped"]
    out["summary"] = (
      f"{passed} passed, {out['failures']} failed, {out['errors']} errors, "
      f"{out['skipped']} skipped in {out['time_s']:.0f} s"
    )
  log = os.path.join(work, "contract.log")
  if os.path.exists(log):
    lines = [
      ln.strip()
      for ln in _read(log).splitlines()
      if re.search(r"\d+ (passed|failed|skipped|deselected|error)", ln) or "no tests ran" in ln
    ]
    if lines:  # pytest's own line, when the verbosity printed one
      out["pytest_line"] = lines[-1].strip("= ")
    elif "summary" not in out:  # no junit XML either (pytest did not start): its last words
      tail = [ln for ln in _read(log).splitlines() if ln.strip()]
      out["summary"] = tail[-1][:300] if tail else "no output"
  return out


def experiment_summary(work: str, name: str, profile) -> dict:
  wd = os.path.join(work, name)
  status = os.path.join(work, f"{name}.status")
  if not os.path.exists(status):
    return {"status": "not run"}
  out = json.loads(_read(status))
  rows = _read_jsonl(os.path.join(wd, "metrics.jsonl"))
  out["workdir"] = os.path.abspath(wd)
  out["log"] = os.path.abspath(os.path.join(work, f"{name}.log"))
  out["samples_per_second"] = throughput(rows, profile)
  out.update(backend_stats(rows))
  evals = {k: v for r in rows for k, v in r.items() if k.startswith(("valid/", "test/"))}
  if evals:
    out["eval"] = evals
  files = trace_files(wd)
  out["trace"] = {
    "dir": os.path.abspath(os.path.join(wd, "profile")),
    "files": files,
    "perfetto": [f["path"] for f in files if f["path"].endswith(".trace.json.gz")],
  }
  return out


def machine() -> dict:
  info = {
    "host": socket.gethostname(),
    "python": platform.python_version(),
    "cpus": os.cpu_count(),
    "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
  }
  with contextlib.suppress(OSError):
    info["loadavg"] = os.getloadavg()
  return info


def _fmt_bytes(b: float) -> str:
  for unit in ("B", "KiB", "MiB", "GiB"):
    if abs(b) < 1024 or unit == "GiB":
      return f"{b:.0f} {unit}" if unit == "B" else f"{b:.1f} {unit}"
    b /= 1024
  return str(b)


def markdown(res: dict) -> str:
  dev = res["device"]
  s = res["settings"]
  lines = [
    f"# GPU check: {dev.get('kind', '?')}",
    "",
    f"`bash benchmarks/gpu_check.sh` ({res['mode']} mode), {res['machine']['time_utc']}: "
    f"{dev.get('count', '?')} x {dev.get('kind', '?')} ({dev.get('platform')}), "
    f"jax {dev.get('jax')}, jaxlib {dev.get('jaxlib', '?')}, Python {res['machine']['python']}, "
    f"{res['machine']['cpus']} CPUs.",
    f"Training: {s['steps']} steps each, synthetic rows {s['rows'] or 'experiment default'}, "
    f"log every {s['log_every']}, profile steps {s['profile_steps']}.",
    "",
  ]
  if res.get("install"):
    lines += [f"Install: {res['install']}", ""]
  c = res["contract"]
  lines += ["## Contract tests (`tests/test_contract.py`)", ""]
  if c.get("status") == "not run":
    lines += ["not run", ""]
  else:
    lines.append(
      f"{c.get('status')}: {c.get('summary', '?')} ({c.get('seconds', 0):.0f} s"
      + (f"; pytest: {c['pytest_line']}" if c.get("pytest_line") else "")
      + (
        f"; {c['skipped_for_devices']} skipped: mesh needs more devices"
        if c.get("skipped_for_devices")
        else ""
      )
      + ")"
    )
    for f in c.get("failed", [])[:20]:
      lines.append(f"- failed: `{f}`")
    lines.append("")
  lines += [
    "## Training",
    "",
    "samples/s: median over the logged intervals after the first (compilation) that do not "
    "overlap the profiled steps.",
    "",
    "| experiment | status | samples/s | final loss | valid AUC | h2d / step | d2h / step "
    "| h2d padded / step | hit rate | prefetched | trace |",
    "|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for name, e in res["experiments"].items():
    if e.get("status") == "not run":
      lines.append(f"| {name} | not run |" + " |" * 9)
      continue
    t = e.get("samples_per_second", {})
    o = e.get("offload")
    sps = f"{t['steady']:,.0f}" if "steady" in t else "-"
    loss = f"{t['final_loss']:.4f}" if t.get("final_loss") is not None else "-"
    auc = e.get("eval", {}).get("valid/auc")
    auc = f"{auc:.4f}" if auc is not None else "-"
    if o:
      off = [
        _fmt_bytes(o["h2d_bytes_per_step"]),
        _fmt_bytes(o["d2h_bytes_per_step"]),
        _fmt_bytes(o["h2d_padded_bytes_per_step"]),
        f"{o['hit_rate']:.3f}" if "hit_rate" in o else "-",
        f"{o['h2d_prefetched_fraction']:.3f}",
      ]
    else:
      off = ["-"] * 5
    trace = e.get("trace", {}).get("perfetto") or []
    trace = (
      f"`{trace[0]}`"
      if trace
      else ("-" if not e.get("trace", {}).get("files") else f"`{e['trace']['dir']}`")
    )
    lines.append(
      f"| {name} | {e['status']} | {sps} | {loss} | {auc} | " + " | ".join(off) + f" | {trace} |"
    )
  lines.append("")
  per_interval = [
    f"- {name}: " + ", ".join(f"{iv['steps'][1]}: {iv['samples_per_second']:,.0f}" for iv in ivs)
    for name, e in res["experiments"].items()
    if (ivs := e.get("samples_per_second", {}).get("intervals"))
  ]
  if per_interval:
    lines += ["samples/s per logged interval (at step: rate since the previous log):", ""]
    lines += [*per_interval, ""]
  for name, e in res["experiments"].items():
    o = e.get("offload")
    if not o:
      continue
    t = e.get("samples_per_second", {})
    bw = o["h2d_padded_bytes_per_step"] * t.get("steady", 0) / max(s["batch_size"], 1)
    lines += [
      f"{name}: {o['tables']} offloaded tables, pinned host -> device "
      f"{_fmt_bytes(o['h2d_bytes_per_step'])} per step "
      f"({_fmt_bytes(o['h2d_padded_bytes_per_step'])} padded, "
      f"{_fmt_bytes(bw)}/s at the steady rate), device -> host "
      f"{_fmt_bytes(o['d2h_bytes_per_step'])} per step; host planning "
      f"{o['plan_ms_per_step']:.1f} ms per step (input thread); lowest table hit rate "
      f"{o.get('hit_rate_min_table', float('nan')):.3f}.",
      "",
    ]
  failed = [n for n, e in res["experiments"].items() if e.get("status") not in ("ok", "not run")]
  for n in failed:
    e = res["experiments"][n]
    lines.append(f"- {n}: {e['status']} (exit {e.get('exit_code')}); log `{e.get('log')}`")
  if failed:
    lines.append("")
  lines.append("Raw numbers (every interval, every table's counters): the JSON beside this file.")
  return "\n".join(lines) + "\n"


def collect(args) -> int:
  device = json.loads(_read(args.device_json)) if args.device_json else {}
  profile = tuple(int(x) for x in args.profile_steps.split(":")) if args.profile_steps else None
  install = os.path.join(args.work, "install.txt")
  res = {
    "mode": args.mode,
    "device": device,
    "machine": machine(),
    "settings": {
      "steps": args.steps,
      "log_every": args.log_every,
      "profile_steps": args.profile_steps,
      "rows": args.rows,
      "batch_size": args.batch_size,
    },
    "install": _read(install).strip() if os.path.exists(install) else "",
    "contract": contract_summary(args.work),
    "experiments": {n: experiment_summary(args.work, n, profile) for n in args.experiments},
  }
  os.makedirs(args.out, exist_ok=True)
  slug = re.sub(r"[^a-z0-9]+", "_", str(device.get("kind", "unknown")).lower()).strip("_")
  stem = os.path.join(args.out, f"gpu_check_{slug}" if args.mode == "gpu" else "gpu_check_cpu")
  with open(stem + ".json", "w") as f:
    json.dump(res, f, indent=2, sort_keys=True)
  md = markdown(res)
  with open(stem + ".md", "w") as f:
    f.write(md)
  print(md)
  print(f"Wrote {stem}.json and {stem}.md")
  return 0


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  sub = p.add_subparsers(dest="cmd", required=True)
  d = sub.add_parser("detect")
  d.add_argument("--allow-cpu", action="store_true")
  dp = sub.add_parser("deps")
  dp.add_argument("--extra", nargs="*", default=[], help="more distributions to check")
  c = sub.add_parser("collect")
  c.add_argument("--work", required=True, help="the script's work dir (logs, status, workdirs)")
  c.add_argument("--out", required=True, help="where gpu_check_<device>.{json,md} go")
  c.add_argument("--device-json")
  c.add_argument("--mode", default="gpu", choices=("gpu", "cpu"))
  c.add_argument("--experiments", nargs="+", default=list(EXPERIMENTS))
  c.add_argument("--steps", type=int, default=0)
  c.add_argument("--log-every", type=int, default=0)
  c.add_argument("--profile-steps", default="")
  c.add_argument("--rows", type=int, default=0)
  c.add_argument("--batch-size", type=int, default=2048)
  args = p.parse_args(argv)
  if args.cmd == "detect":
    return detect(args.allow_cpu)
  if args.cmd == "deps":
    print(" ".join(missing_dependencies(extra=args.extra)))
    return 0
  return collect(args)


if __name__ == "__main__":
  sys.exit(main())
