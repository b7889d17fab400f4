"""`sharded` and its all-to-all codecs: bytes per step, codec throughput, and test AUC.

Question: how many all-to-all bytes does each codec save, how fast does it encode, and what does
it cost in test AUC?

Sections (--sections, comma-separated):
  bytes  the all-to-all bytes each device sends per step (lookup + update of the Kaggle
         model's 26 tables, dim 16, batch --batch), read from the compiled HLO (recgnn.comms;
         the f32 fallback of `eb` is its own named scope and left out), per codec and mesh.
  codec  encode + decode throughput (GB/s of f32 input) of each codec on one device's
         message ([k, b, W], the Kaggle group on a 1 x 8 mesh).
  auc    `dlrm_sharded` trained --epochs on the synthetic default on 8 simulated devices
         (1 x 8), per codec and --seeds; test AUC and logloss, the fallbacks of `eb`, and the
         bytes per step actually sent (fallback steps counted at f32).

  python benchmarks/sharded.py                       # all sections
  python benchmarks/sharded.py --sections=auc --seeds=0,1,2 --epochs=1

Writes benchmarks/results/sharded.{json,md,png} (PNG: test AUC against all-to-all bytes).
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time

import harness

harness.simulated_devices(8)  # before jax starts

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from recgnn import comms, planner, sharding  # noqa: E402
from recgnn.backends import sharded  # noqa: E402
from recgnn.embeddings import base, codecs  # noqa: E402

ROOT = harness.ROOT
RESULTS = harness.RESULTS
CODECS = ("none", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "int8", "eb")
# The AUC runs: (label, backend options). Fixed bounds bracket what the adaptive rule picks.
RUNS = (
  ("none", "codec=none"),
  ("int8", "codec=int8"),
  ("eb adaptive", "codec=eb"),  # bounds from each iteration's own ranges (bound=current)
  ("eb ema", "codec=eb, bound=ema"),  # bounds from the EMA of past iterations
  ("eb ema h1", "codec=eb, bound=ema, headroom=1.0"),
  ("eb fixed 2e-3/2e-6", "codec=eb, fwd_eb=2e-3, bwd_eb=2e-6"),
  ("eb fixed 1e-2/1e-5", "codec=eb, fwd_eb=1e-2, bwd_eb=1e-5"),
  ("bf16", "codec=bf16"),
  # Code widths (issue 27): the tolerance rule (bound = rel * each table's RMS) with
  # widths planned from it every 100 steps, and its schedule (rel for 200 steps, then a
  # ramp over 400 to 3 rel).
  ("eb widths rms 0.1", "codec=eb, bound=rms, rel=0.1, widths=auto, replan=100"),
  ("eb widths rms 0.3", "codec=eb, bound=rms, rel=0.3, widths=auto, replan=100"),
  ("eb widths rms 1.0", "codec=eb, bound=rms, rel=1.0, widths=auto, replan=100"),
  (
    "eb widths sched 0.1-0.3",
    "codec=eb, bound=rms, rel=0.1, warmup=200, ramp=400, late=3.0, widths=auto, replan=100",
  ),
  # Block-wise steps (issue 27): the table's bound fills the narrow codes (bound=current),
  # and each block of `block` values steps at that step * 2^-j, following its own range;
  # a one-byte header per block.
  ("eb block w4 b32", "codec=eb, widths=4, block=32"),
  ("eb block w4 b16", "codec=eb, widths=4, block=16"),
  ("eb block f4 b2 b32", "codec=eb, fwd_widths=4, bwd_widths=2, block=32"),
  ("eb block f4 b2 b16", "codec=eb, fwd_widths=4, bwd_widths=2, block=16"),
  ("eb block f8 b2 b32", "codec=eb, fwd_widths=8, bwd_widths=2, block=32"),
)


def kaggle_specs(scale: float = 0.01, dim: int = 16) -> list[base.TableSpec]:
  from recgnn.data import criteo

  opt = base.OptimizerSpec(name="rowwise_adagrad", learning_rate=0.05)
  return [
    base.TableSpec(name=f"C{i + 1}", num_rows=max(int(c * scale), 2), dim=dim, optimizer=opt)
    for i, c in enumerate(criteo.KAGGLE_CARDINALITIES)
  ]


def _step(group):
  def step(state, prepared):
    pooled, residuals = group.lookup(state, prepared)
    return group.update(state, prepared, residuals, pooled)  # any gradient of the right shape

  return step


def section_bytes(args) -> list[dict]:
  specs = kaggle_specs()
  rng = np.random.default_rng(0)
  ids = {s.name: rng.integers(0, s.num_rows, (args.batch, 1)).astype(np.int32) for s in specs}
  out = []
  for mesh_text in args.meshes.split(","):
    d, m = (int(x) for x in mesh_text.split("x"))
    mesh = sharding.make_mesh(d, m)
    for codec in CODECS:
      group = planner.make_group(f"sharded(codec={codec})", specs, mesh)
      state = group.init(jax.random.key(0))  # host-initialised (20 MB at scale 0.01)
      prepared = group.prepare(ids)
      split = sharding.named(mesh, sharding.BATCH_SPEC)
      placed = jax.tree.map(
        lambda x, s=split: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), prepared
      )
      hlo = jax.jit(_step(group)).lower(state, placed).compile().as_text()
      s = comms.summary(hlo, skip_scope=sharded.FALLBACK_SCOPE)
      a2a = s["by_op"].get("all-to-all", {"operand_bytes": 0, "dtypes": []})
      wire = group.wire_bytes(args.batch)
      out.append(
        {
          "mesh": mesh_text,
          "codec": codec,
          "all_to_all_bytes": a2a["operand_bytes"],
          "all_to_all_dtypes": a2a["dtypes"],
          "payload_bytes": wire["fwd"] + wire["bwd"],
          "bits_per_value": group.codecs["fwd"].bits_per_value(),
          "other_collective_bytes": s["total_operand_bytes"] - a2a["operand_bytes"],
          "fallback_bytes_if_taken": s["skipped_operand_bytes"],
        }
      )
      print(f"bytes {mesh_text} {codec:>9}: all-to-all {a2a['operand_bytes']:>9,} B/device/step")
  return out


def section_codec(args) -> list[dict]:
  specs = kaggle_specs()
  group = planner.make_group("sharded", specs, sharding.make_mesh(1, 8))
  dims = group.geometry.segment_dims()
  rng = np.random.default_rng(0)
  b = args.batch // 8
  segs = [jnp.asarray(rng.standard_normal((8, b, d)).astype(np.float32) * 0.05) for d in dims]
  nbytes = sum(s.size * 4 for s in segs)
  bounds = jnp.full((8, 1, len(dims)), 1e-3, jnp.float32)
  out = []
  for name in CODECS:
    codec = codecs.Codec(name, dims)

    def roundtrip(segs, bounds, codec=codec):
      payload, ok = codec.encode(segs, bounds)
      return codec.decode(payload, bounds), ok

    f = jax.jit(roundtrip)
    sec = harness.time_calls(lambda f=f: f(segs, bounds), args.repeats)["median_s"]
    out.append(
      {"codec": name, "message_bytes": nbytes, "seconds": sec, "gb_per_s": nbytes / sec / 1e9}
    )
    print(f"codec {name:>9}: {nbytes / sec / 1e9:6.2f} GB/s encode+decode ({nbytes:,} B message)")
  return out


def _train(label, options, seed, args) -> tuple[dict, float]:
  """One `dlrm_sharded` run in a subprocess (8 simulated devices): results.json and seconds.

  A subprocess per run, and one retry: on these 2 shared cores XLA:CPU's simulated devices
  have hung at a collective now and then (see recgnn/xla_env.py); a run that stops making
  progress for --stall_s is killed and started again in a fresh workdir."""
  import subprocess

  name = f"{label.replace(' ', '_').replace('/', '_')}_s{seed}"
  for attempt in range(2):  # a finished run in --workdir is read, not trained again
    wd = pathlib.Path(args.workdir) / f"{name}_try{attempt}"
    if (wd / "results.json").exists():
      return _finished(wd)
  if args.finished_only:
    return None
  for attempt in range(2):
    wd = pathlib.Path(args.workdir) / f"{name}_try{attempt}"
    cmd = [
      sys.executable, str(ROOT / "run.py"), f"--experiment=dlrm_sharded:{options}",
      f"--workdir={wd}", f"--config.seed={seed}", f"--config.train.epochs={args.epochs}",
      "--config.train.checkpoint_every=0", "--config.train.log_every=25",
      "--config.train.final_eval_splits=('test',)",
    ]  # fmt: skip
    if args.cache_dir:
      cmd.append(f"--config.data.cache_dir={args.cache_dir}")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    t = time.time()
    wd.parent.mkdir(parents=True, exist_ok=True)
    log = open(str(wd) + ".log", "w")  # noqa: SIM115 (open while the run lasts)
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    metrics = wd / "metrics.jsonl"
    last, seen = time.time(), 0
    while proc.poll() is None:
      time.sleep(5)
      size = metrics.stat().st_size if metrics.exists() else 0
      if size != seen:
        last, seen = time.time(), size
      elif time.time() - last > args.stall_s:
        proc.kill()
        print(f"  {name}: no progress for {args.stall_s} s, killed (attempt {attempt})", flush=True)
        break
    proc.wait()
    log.close()
    if proc.returncode == 0 and (wd / "results.json").exists():
      (wd / "seconds").write_text(f"{time.time() - t:.1f}")
      return _finished(wd)
  raise RuntimeError(f"{name}: failed twice; see {wd}.log")


def _finished(wd: pathlib.Path) -> tuple[dict, dict, float]:
  """results.json, the last train log line (bytes per step at the train batch) and seconds."""
  res = json.loads((wd / "results.json").read_text())
  lines = [json.loads(x) for x in (wd / "metrics.jsonl").read_text().splitlines() if x.strip()]
  last = [m for m in lines if "fwd_bytes_per_step" in m][0]  # a train step's line
  took = float((wd / "seconds").read_text()) if (wd / "seconds").exists() else float("nan")
  return res, last, took


def section_auc(args) -> list[dict]:
  out = []
  runs = [r for r in RUNS if not args.runs or r[0] in args.runs.split(",")]
  for seed in (int(s) for s in args.seeds.split(",")):
    for label, options in runs:
      done = _train(label, options, seed, args)
      if done is None:  # --finished_only: not run in --workdir
        print(f"auc seed {seed} {label:>20}: not in {args.workdir}, skipped", flush=True)
        continue
      res, logged, took = done
      steps = int(res["step"])
      sent = f32 = 0.0
      for d in ("fwd", "bwd"):
        wire = logged[f"{d}_bytes_per_step"]
        bits = logged[f"{d}_bits_per_value"]
        full = wire * 32 / bits  # the message in f32
        # widths=auto: the widths change with the plans; the run's mean coded bits per value.
        mean_bits = res.get(f"emb/sharded/{d}/mean_bits_per_value")
        if mean_bits:
          wire = full * mean_bits / 32
        # Segments resent as f32 on fallback steps: their values per vector, summed over steps.
        resent = res.get(f"emb/sharded/{d}/fallback_values", 0) / max(steps, 1)
        if resent:
          vectors = wire * 8 / (bits * logged[f"{d}_values_per_vector"])  # per device, step
          sent += resent * vectors * 4
        sent += wire
        f32 += full
      row = {
        "run": label,
        "options": options,
        "seed": seed,
        "steps": steps,
        "test_auc": float(res["test/auc"]),
        "test_logloss": float(res["test/logloss"]),
        "seconds": took,
        "fwd_fallbacks": res.get("emb/sharded/fwd/fallbacks"),
        "bwd_fallbacks": res.get("emb/sharded/bwd/fallbacks"),
        "payload_bytes_per_step": sent,
        "fwd_fallback_values": res.get("emb/sharded/fwd/fallback_values"),
        "bwd_fallback_values": res.get("emb/sharded/bwd/fallback_values"),
        "f32_bytes_per_step": f32,
        "width_changes": res.get("emb/sharded/fwd/width_changes"),
      }
      for d in ("fwd", "bwd"):
        if f"emb/sharded/{d}/mean_bits_per_value" in res:
          row[f"{d}_mean_bits"] = res[f"emb/sharded/{d}/mean_bits_per_value"]
      for d in ("fwd", "bwd"):
        b = [v for k, v in res.items() if k.startswith(f"emb/sharded/{d}/bound/")]
        if b:
          row[f"{d}_bound_median"] = float(np.median(b))
      out.append(row)
      print(
        f"auc seed {seed} {label:>20}: test AUC {row['test_auc']:.5f} logloss "
        f"{row['test_logloss']:.5f} bytes/step {sent:,.0f} ({took:.0f} s)",
        flush=True,
      )
  return out


def summarize(auc_rows):
  by = {}
  for r in auc_rows:
    by.setdefault(r["run"], []).append(r)
  # vs none over the SAME seeds (a one-seed row against the mean of three would mix the
  # seeds' spread into its delta).
  none = {r["seed"]: r["test_auc"] for r in by.get("none", [])}
  out = []
  for label, rows in by.items():
    auc = np.mean([r["test_auc"] for r in rows])
    same = [none[r["seed"]] for r in rows if r["seed"] in none]
    base_auc = float(np.mean(same)) if len(same) == len(rows) else None
    out.append(
      {
        "run": label,
        "seeds": len(rows),
        "mean_test_auc": float(auc),
        "std_test_auc": float(np.std([r["test_auc"] for r in rows])),
        "delta_vs_none": None if base_auc is None else float(auc - base_auc),
        "bytes_per_step": float(np.mean([r["payload_bytes_per_step"] for r in rows])),
        "ratio_vs_f32": float(
          rows[0]["f32_bytes_per_step"] / np.mean([r["payload_bytes_per_step"] for r in rows])
        ),
      }
    )
  return out


def markdown(payload) -> str:
  lines = [f"# sharded: all-to-all codecs ({payload['when']}, load {payload['load']})", ""]
  if payload.get("command"):
    lines += [f"`{payload['command']}`", ""]
  if payload.get("bytes"):
    lines += [
      "## Bytes per device per step, from the compiled HLO",
      "",
      f"26 Kaggle tables x0.01, dim 16, batch {payload['batch']}, one lookup + update.",
      "",
      "| mesh | codec | all-to-all bytes | dtypes | bits/value | other collectives |",
      "|---|---|---:|---|---:|---:|",
    ]
    for r in payload["bytes"]:
      lines.append(
        f"| {r['mesh']} | {r['codec']} | {r['all_to_all_bytes']:,} "
        f"| {', '.join(r['all_to_all_dtypes'])} | {r['bits_per_value']:.1f} "
        f"| {r['other_collective_bytes']:,} |"
      )
    lines.append("")
  if payload.get("codec"):
    lines += [
      "## Encode + decode throughput (this CPU, one jit, median)",
      "",
      "| codec | GB/s |",
      "|---|---:|",
    ]
    lines += [f"| {r['codec']} | {r['gb_per_s']:.2f} |" for r in payload["codec"]]
    lines.append("")
  if payload.get("summary"):
    lines += [
      f"## Test AUC, dlrm_sharded on 1 x 8 simulated devices, {payload['epochs']} epoch(s)",
      "",
      "The synthetic default (planted model); batch 2048; payload = both all-to-alls; "
      f"started {payload.get('auc_when', '?')} at load {payload.get('auc_load', '?')}.",
      "",
      "| run | seeds | mean test AUC | std | vs none (same seeds) | payload bytes/step "
      "| x fewer than f32 |",
      "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in payload["summary"]:
      d = "" if r["delta_vs_none"] is None else f"{r['delta_vs_none']:+.5f}"
      lines.append(
        f"| {r['run']} | {r['seeds']} | {r['mean_test_auc']:.5f} | {r['std_test_auc']:.5f} | {d} "
        f"| {r['bytes_per_step']:,.0f} | {r['ratio_vs_f32']:.2f} |"
      )
    lines += [
      "",
      "Per run:",
      "",
      "| run | seed | test AUC | logloss | fwd / bwd fallbacks | s |",
      "|---|---:|---:|---:|---|---:|",
    ]
    for r in payload["auc"]:
      lines.append(
        f"| {r['run']} | {r['seed']} | {r['test_auc']:.5f} | {r['test_logloss']:.5f} "
        f"| {r['fwd_fallbacks']} / {r['bwd_fallbacks']} | {r['seconds']:.0f} |"
      )
  return "\n".join(lines) + "\n"


def plot(payload, path):
  with harness.png(path, figsize=(6, 4), dpi=120) as (fig, ax):
    for r in payload["summary"]:
      ax.errorbar(r["bytes_per_step"] / 1e3, r["mean_test_auc"], yerr=r["std_test_auc"], fmt="o")
      ax.annotate(r["run"], (r["bytes_per_step"] / 1e3, r["mean_test_auc"]), fontsize=7)
    ax.set_xlabel("all-to-all payload per device per step (kB, fwd + bwd)")
    ax.set_ylabel("test AUC (mean of seeds)")
    ax.set_title("dlrm_sharded, 1 x 8 simulated devices")


def main(argv=None):
  p = harness.flags.parser(__doc__)
  p.add_argument("--sections", default="bytes,codec,auc")
  p.add_argument("--meshes", default="1x8,2x4")
  p.add_argument("--batch", type=int, default=2048)
  p.add_argument("--repeats", type=int, default=20)
  p.add_argument("--seeds", default="0,1,2")
  p.add_argument("--epochs", type=float, default=1.0)
  p.add_argument("--runs", default="", help="comma-separated labels of RUNS (default: all)")
  p.add_argument("--workdir", default="/tmp/recgnn_sharded_bench")
  p.add_argument("--cache_dir", default="")
  p.add_argument("--stall_s", type=float, default=300, help="kill a run silent this long")
  p.add_argument(
    "--finished_only",
    action="store_true",
    help="summarize the runs already finished in --workdir; train none",
  )
  p.add_argument("--out", default=str(RESULTS / "sharded"))
  p.add_argument(
    "--quick",
    action="store_true",
    help="smoke run, not figures: bytes and codec on 2x4, batch 256, 2 repeats",
  )
  args = p.parse_args(argv)
  if args.quick:
    args.sections, args.meshes, args.repeats, args.batch = "bytes,codec", "2x4", 2, 256
  sections = set(args.sections.split(","))
  payload = {
    "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    "load": os.getloadavg()[0],
    "batch": args.batch,
    "epochs": args.epochs,
    "devices": jax.device_count(),
    "command": "python benchmarks/sharded.py " + " ".join(sys.argv[1:] if argv is None else argv),
  }
  out = pathlib.Path(args.out)
  if out.with_suffix(".json").exists():  # keep sections not rerun
    old = json.loads(out.with_suffix(".json").read_text())
    payload.update({k: old[k] for k in ("bytes", "codec", "auc", "summary") if k in old})
    if "auc" not in sections and "epochs" in old:  # the kept AUC rows' settings
      payload.update({k: old[k] for k in ("epochs", "auc_load", "auc_when") if k in old})
  if "bytes" in sections:
    payload["bytes"] = section_bytes(args)
  if "codec" in sections:
    payload["codec"] = section_codec(args)
  if "auc" in sections:
    payload["auc_load"], payload["auc_when"] = payload["load"], payload["when"]
    payload["auc"] = section_auc(args)
    payload["summary"] = summarize(payload["auc"])
  harness.write_results(out.name, payload, markdown(payload), out.parent)
  if payload.get("summary"):
    plot(payload, out.with_suffix(".png"))


if __name__ == "__main__":
  main()
