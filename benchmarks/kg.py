"""Knowledge-graph link prediction on FB15k-237: quality, training throughput, eval time,
and partitioned vs whole-graph R-GCN training.

Question: how good (filtered MRR) and how fast is KGE and R-GCN training on FB15k-237, on the
whole graph and on self-sufficient partitions?

Sections (--sections, comma-separated):
  kge        train `kge_fb15k237:DECODER` (--decoder) with the trainer: filtered test MRR /
             Hits@k, wall time, edges/s, valid MRR at every eval, then the full filtered
             test evaluation timed on its own (jitted predict over every test batch, second
             pass, so compilation is excluded)
  kge_rescan recompute a finished kge run's step-rate figures from --kge_workdir
  parallel   FB15k-237 R-GCN, the same epochs: whole graph, P partitions one per step
             (serial), and P partitions per step over P devices (`:P,parallel`, one
             partition per device); time per epoch from each step's exact edges, test MRR,
             and bytes between devices per step from the compiled step's HLO (partition-
             parallel vs whole-graph data-parallel on the same mesh). Needs P devices: on CPU
             XLA_FLAGS=--xla_force_host_platform_device_count=P (simulated devices share the
             CPU's cores: no real parallel speedup there; the bytes are the scaling figure)
  planted    the same comparison on `rgcn_planted` (a synthetic KG with planted communities,
             small halos): whole graph vs each P of --planted_parts serial, and parallel on P
             devices when that many exist; plus where a step's time goes (loss + grad of one
             whole-graph step and of one step of every partition, interleaved)
  rgcn       `rgcn_fb15k237` (whole graph) and `rgcn_fb15k237_partitioned` (METIS, P parts)
             with the same epochs: time per epoch from the trainer's steady-state step rate,
             test MRR side by side, and where a step's time goes (encoder / decoder sizes and
             timings of one whole-graph and one partition step)
Writes benchmarks/results/kg_<section>.json + .md; the MRR-vs-time curves to kg_mrr.png.

  python benchmarks/kg.py --sections=kge --decoder=complex
  python benchmarks/kg.py --sections=rgcn --rgcn_epochs=4 --parts=4
  XLA_FLAGS=--xla_force_host_platform_device_count=2 python benchmarks/kg.py \
    --sections=parallel --parts=2 --rgcn_epochs=2
  XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/kg.py \
    --sections=planted --planted_parts=4,8 --rgcn_epochs=5
"""

from __future__ import annotations

import json
import os
import sys
import time

import harness
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import app, flags

from experiments import (
  kge_fb15k237,
  rgcn_fb15k237,
  rgcn_fb15k237_partitioned,
  rgcn_planted,
)
from recgnn import comms, sharding
from recgnn.tasks import link_prediction as lp
from recgnn.train import loop, setup

RESULTS = str(harness.RESULTS)

_SECTIONS = flags.DEFINE_string("sections", "kge,rgcn", "kge, rgcn, parallel, planted")
_QUICK = flags.DEFINE_bool("quick", False, "smoke run, not figures: 0.02 epochs, evals every one")
_DECODER = flags.DEFINE_string("decoder", "complex", "kge section: decoder")
_EPOCHS = flags.DEFINE_float("epochs", 0, "kge section: epochs (0 = the experiment's)")
_EVAL_EVERY = flags.DEFINE_integer("eval_every_epochs", 5, "kge section: valid eval period")
_RGCN_EPOCHS = flags.DEFINE_float("rgcn_epochs", 4, "rgcn section: epochs of each run")
_PARTS = flags.DEFINE_integer("parts", 4, "rgcn section: partitions")
_PLANTED_PARTS = flags.DEFINE_string("planted_parts", "4,8", "planted: partition counts")
_PLANTED_PARALLEL = flags.DEFINE_bool(
  "planted_parallel", True, "planted: also the parallel run of each P (needs P devices)"
)
_REUSE_SERIAL = flags.DEFINE_bool(
  "reuse_serial",
  False,
  "parallel / planted: take the whole-graph and serial runs from the previous results "
  "file (same settings) and run only the parallel ones",
)
_WHOLE_FROM = flags.DEFINE_string(
  "whole_from",
  "",
  "parallel / planted: take only the whole-graph run from this results file (e.g. "
  "kg_planted; its epochs may differ: the table says so)",
)
_RERUN_WHOLE = flags.DEFINE_bool(
  "rerun_whole", False, "with --reuse_serial: run the whole graph again (the rest reused)"
)
_NAME = flags.DEFINE_string("name", "", "parallel / planted: results file name")
_REUSE_WHOLE = flags.DEFINE_bool(
  "rgcn_reuse_whole", False, "rgcn: take the whole-graph run from results/kg_rgcn.json"
)
_RGCN_NAME = flags.DEFINE_string(
  "rgcn_name", "kg_rgcn", "rgcn: results file name (benchmarks/results/NAME.json / .md)"
)
_KGE_RESUME = flags.DEFINE_string(
  "kge_resume", "", "kge: continue this finished run's workdir to --epochs (results add up)"
)
_KGE_WORKDIR = flags.DEFINE_string("kge_workdir", "", "kge_rescan: the finished run's workdir")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/recgnn_kg_bench", "scratch for the runs")


def _task(cfg) -> lp.LinkPrediction:
  """The task of `cfg` on the mesh the trainer would build for it."""
  return lp.LinkPrediction(cfg, loop.config_mesh(cfg))


def _machine() -> dict:
  """harness.machine_info() and the 1-minute load at the start, which the reports quote."""
  info = harness.machine_info()
  return {**info, "load_avg_1m_at_start": info["load_avg_at_start"][0]}


def _write(name: str, payload: dict, md: str):
  # Load at the start is the run's own record when there is one (kge_rescan keeps it).
  payload["machine"] = {**_machine(), **payload.get("machine", {})}
  payload["machine"]["load_avg_1_5_15m_at_end"] = list(os.getloadavg())
  harness.write_results(name, payload, md, sort_keys=True)


def _curve(workdir: str, steps_per_epoch: int, seconds_per_step: float) -> list[dict]:
  """(epoch, seconds, valid mrr) from the trainer's metrics.jsonl (the last record of a
  step: a resumed run's final eval may repeat one)."""
  out = {}
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    for line in f:
      rec = json.loads(line)
      if "valid/mrr" in rec:
        out[rec["step"]] = {
          "epoch": rec["step"] / steps_per_epoch,
          "seconds": rec["step"] * seconds_per_step,
          "valid_mrr": rec["valid/mrr"],
        }
  return [out[k] for k in sorted(out)]


def _step_seconds(workdir: str, task) -> float:
  """Steady-state seconds per step: median over the trainer's log intervals after the first
  (which includes compilation). The trainer's rate is steps x (the FIRST batch's examples)
  / seconds, so that is what converts it back."""
  edges_per_step = task.num_examples(next(task.train_batches(0)))
  rates = []
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    for line in f:
      rec = json.loads(line)
      if "samples_per_second" in rec:
        rates.append(rec["samples_per_second"])
  rates = rates[1:] or rates
  return edges_per_step / float(np.median(rates))


def _entity_table(result) -> np.ndarray:
  for key, group in result.plan.groups.items():
    t = group.tables(result.state.emb[key])
    if lp.TABLE in t:
      return np.asarray(t[lp.TABLE])
  raise KeyError(lp.TABLE)


def time_eval(task, params, table: np.ndarray, split: str = "test") -> tuple[float, dict]:
  """Seconds of the full filtered evaluation of `split` (every query, every entity), the
  predict step jitted, second pass timed; and the metrics (which must equal the trainer's)."""
  predict = jax.jit(task.predict)
  emb = {lp.TABLE: jnp.asarray(table)}
  batches = [jax.device_put(b) for b in task.eval_batches(split)]
  for b in batches[:2]:  # compile (the last batch has the same shapes)
    jax.block_until_ready(predict(params, b, emb))
  t0 = time.perf_counter()
  outs = [predict(params, b, emb) for b in batches]
  outs = jax.device_get(outs)
  seconds = time.perf_counter() - t0
  return seconds, task.metrics(outs)


def run_kge():
  decoder = _DECODER.value
  start = _machine()
  cfg = kge_fb15k237.get_config(decoder)
  task = _task(cfg)
  spe = task.steps_per_epoch()
  if _EPOCHS.value:  # (train.epochs is an int: a fraction of an epoch as steps)
    e = _EPOCHS.value
    whole = float(e).is_integer()
    cfg.train.epochs, cfg.train.steps = (int(e), 0) if whole else (0, max(4, round(spe * e)))
    cfg.train.log_every = cfg.train.log_every if whole else max(1, cfg.train.steps // 4)
  cfg.train.eval_every = int(spe * _EVAL_EVERY.value)
  workdir = os.path.join(_WORKDIR.value, f"kge_{decoder}_{int(time.time())}")
  earlier = 0.0
  if _KGE_RESUME.value:
    # Continue a finished run to more epochs (the trainer's resume reproduces an uninterrupted
    # run exactly; tests/test_trainer.py): its wall time so far is in the previous results.
    workdir = _KGE_RESUME.value
    with open(os.path.join(RESULTS, f"kg_kge_{decoder}.json")) as f:
      prev = json.load(f)
    earlier = prev.get("wall_seconds_before_resume") or prev["train_wall_seconds_incl_evals"]
  t0 = time.perf_counter()
  result = loop.train(cfg, workdir, resume=bool(_KGE_RESUME.value))
  wall = earlier + time.perf_counter() - t0
  m = result.metrics
  edges_per_epoch = len(task.train_triples)
  steps = int(m["step"])
  epochs = steps / spe
  step_s = _step_seconds(workdir, task)
  eval_s, eval_m = time_eval(task, result.state.params, _entity_table(result), "test")
  curve = _curve(workdir, spe, step_s)
  payload = {
    "experiment": f"kge_fb15k237:{decoder}",
    "config": {
      "dim": cfg.embeddings.dim,
      "batch_queries": cfg.batch_size,
      "regularizer": cfg.model.regularizer,
      "reg_weight": cfg.model.reg_weight,
      "entity_optimizer": dict(cfg.embeddings.optimizer),
      "relation_optimizer": dict(cfg.optimizer),
      "plan": [list(r) for r in cfg.embeddings.plan],
    },
    "epochs": epochs,
    "steps": steps,
    "train_wall_seconds_incl_evals": wall,
    "wall_seconds_before_resume": earlier,
    "wall_seconds_this_call": wall - earlier,
    "train_seconds_est": steps * step_s,
    "edges_per_second": edges_per_epoch / (spe * step_s),
    "test": {k.split("/", 1)[1]: v for k, v in m.items() if k.startswith("test/")},
    "valid": {k.split("/", 1)[1]: v for k, v in m.items() if k.startswith("valid/")},
    "test_eval_seconds": eval_s,
    "test_eval_queries": 2 * len(task.kg.splits["test"]),
    "test_eval_mrr_recomputed": eval_m["mrr"],
    "valid_curve": curve,
    "published_libkge_mrr": {"distmult": 0.343, "complex": 0.348},
  }
  payload["workdir"] = workdir
  payload["machine"] = start
  payload["command"] = " ".join(["python", *sys.argv])
  _write(f"kg_kge_{decoder}", payload, _kge_md(payload, cfg, task))
  return payload


def _kge_md(payload: dict, cfg, task) -> str:
  t, curve, epochs = payload["test"], payload["valid_curve"], payload["epochs"]
  return (
    f"# FB15k-237, `{payload['experiment']}` (filtered, test, both sides)\n\n"
    "| MRR | Hits@1 | Hits@3 | Hits@10 | epochs | train time | edges/s | full test eval |\n"
    "|---|---|---|---|---|---|---|---|\n"
    f"| {t['mrr']:.4f} | {t['hits@1']:.4f} | {t['hits@3']:.4f} | {t['hits@10']:.4f} | "
    f"{epochs:.1f} | {payload['train_seconds_est'] / 60:.1f} min of steps at the steady-state "
    "rate"
    + (
      f" (resumed run: {payload['wall_seconds_before_resume'] / 60:.1f} min wall incl. evals "
      "before the resume)"
      if payload.get("wall_seconds_before_resume")
      else f" ({payload['train_wall_seconds_incl_evals'] / 60:.1f} min wall incl. evals)"
    )
    + " | "
    f"{payload['edges_per_second']:,.0f} | {payload['test_eval_seconds']:.1f} s "
    f"({payload['test_eval_queries']:,} queries x {task.kg.num_entities:,} entities) |\n\n"
    f"dim {cfg.embeddings.dim}, 1-vs-all over grouped queries ({cfg.batch_size} per step), "
    f"reciprocal relations, {cfg.model.regularizer} {cfg.model.reg_weight}, entity table "
    f"through the plan {list(map(tuple, cfg.embeddings.plan))} with "
    f"{cfg.embeddings.optimizer.name} lr {cfg.embeddings.optimizer.learning_rate}; relations "
    f"{cfg.optimizer.name} lr {cfg.optimizer.learning_rate}. Published (LibKGE, tuned): "
    "DistMult 0.343, ComplEx 0.348. Machine: 2-core CPU shared with other jobs (load at "
    f"start {payload.get('machine', _machine())['load_avg_1m_at_start']:.1f}).\n\n"
    "Valid MRR during training: "
    + ", ".join(f"epoch {c['epoch']:.0f}: {c['valid_mrr']:.4f}" for c in curve)
    + "\n"
  )


def rescan_kge(workdir: str):
  """Recompute the step-rate figures of a finished `kge` run from its workdir's
  metrics.jsonl (the first version of this script converted the trainer's rate with the
  mean batch instead of the first batch's triples)."""
  decoder = _DECODER.value
  path = os.path.join(RESULTS, f"kg_kge_{decoder}.json")
  with open(path) as f:
    payload = json.load(f)
  cfg = kge_fb15k237.get_config(decoder)
  task = _task(cfg)
  spe = task.steps_per_epoch()
  step_s = _step_seconds(workdir, task)
  payload["train_seconds_est"] = payload["steps"] * step_s
  payload["edges_per_second"] = len(task.train_triples) / (spe * step_s)
  payload["valid_curve"] = _curve(workdir, spe, step_s)
  payload["workdir"] = workdir
  with open(path, "w") as f:  # the run's machine record kept
    json.dump(payload, f, indent=2, sort_keys=True)
  md = _kge_md(payload, cfg, task)
  with open(os.path.join(RESULTS, f"kg_kge_{decoder}.md"), "w") as f:
    f.write(md)
  print(md)


def _train_epochs(cfg, name: str, epochs: float, step_seconds) -> tuple:
  """Train `cfg` for `epochs` in a fresh workdir, valid MRR once per epoch (the MRR-vs-time
  curve); seconds per step from `step_seconds(workdir, task)`. Returns (task, the run's
  figures, wall seconds, workdir)."""
  task = _task(cfg)
  spe = task.steps_per_epoch()
  cfg.train.epochs = 0
  cfg.train.steps = int(round(spe * epochs))
  cfg.train.eval_every = spe
  cfg.train.log_every = max(spe // 4, 1)
  workdir = os.path.join(_WORKDIR.value, f"{name}_{int(time.time())}")
  print(f"--- {name}: {cfg.train.steps} steps ({spe} per epoch)", flush=True)
  t0 = time.perf_counter()
  result = loop.train(cfg, workdir)
  wall = time.perf_counter() - t0
  step_s = step_seconds(workdir, task)
  m = result.metrics
  figures = {
    "steps_per_epoch": spe,
    "epochs": int(m["step"]) / spe,
    "seconds_per_step": step_s,
    "seconds_per_epoch": spe * step_s,
    "test": {k.split("/", 1)[1]: v for k, v in m.items() if k.startswith("test/")},
    "valid_curve": _curve(workdir, spe, step_s),
  }
  return task, figures, wall, workdir


def _rgcn_run(cfg, name: str):
  task, figures, wall, _ = _train_epochs(cfg, name, _RGCN_EPOCHS.value, _step_seconds)
  return task, {**figures, "train_wall_seconds_incl_evals": wall}


def _step_fns(task, batch):
  """(encoder forward, loss + gradient) of one step on random entity rows, jitted, and their
  arguments."""
  rows = jnp.asarray(
    np.random.default_rng(0).normal(size=(batch["ids"][lp.TABLE].shape[0], task.dim)),
    jnp.float32,
  )
  b = jax.device_put({k: v for k, v in batch.items() if k != "ids"})
  params = task.init_params(jax.random.key(0), b, {lp.TABLE: rows})
  enc = jax.jit(lambda p, r, b: task.losses.encode(p, b, r, True, jax.random.key(1)))
  grad = jax.jit(
    jax.grad(lambda p, r, b: task.loss(p, b, {lp.TABLE: r}, jax.random.key(1))[0], argnums=(0, 1))
  )
  meta = {"rows": int(rows.shape[0]), "edges": int(np.count_nonzero(batch["enorm"]))}
  return meta, enc, grad, (params, rows, b)


def _breakdown(whole_task, part_task, reps: int = 3) -> dict:
  """Where a step's time goes, by graph size: encoder forward and loss + gradient (encoder +
  decoder) of one whole-graph step and of one step of EVERY partition, timed interleaved
  (rep by rep over all of them, best of `reps`) so that the shared machine's load drifts over
  all alike; and the epoch those step times add up to (steps x time, summed over partitions)."""
  B = part_task.batch_size
  cases = {"whole": (whole_task, next(whole_task.train_batches(0)), whole_task.steps_per_epoch())}
  rng = np.random.default_rng(0)
  for p, part in enumerate(part_task.partitions):
    batch = part_task.partition_batch(p, part.triples[:B], rng)
    cases[f"partition {p}"] = (part_task, batch, -(-len(part.triples) // B))
  fns = {k: _step_fns(t, b) for k, (t, b, _) in cases.items()}
  best = {k: {"encoder_forward_s": float("inf"), "loss_and_grad_s": float("inf")} for k in fns}
  for _, enc, grad, args in fns.values():  # compile
    jax.block_until_ready((enc(*args), grad(*args)))
  for _ in range(reps):
    for k, (_, enc, grad, args) in fns.items():
      for name, fn in (("encoder_forward_s", enc), ("loss_and_grad_s", grad)):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best[k][name] = min(best[k][name], time.perf_counter() - t0)
  out = {k: {**fns[k][0], **best[k], "steps_per_epoch": cases[k][2]} for k in fns}
  epoch = {
    "whole": out["whole"]["steps_per_epoch"] * out["whole"]["loss_and_grad_s"],
    "partitioned": sum(
      v["steps_per_epoch"] * v["loss_and_grad_s"] for k, v in out.items() if k != "whole"
    ),
  }
  return {"steps": out, "loss_and_grad_epoch_s": epoch}


def run_rgcn():
  P = _PARTS.value
  start = _machine()
  if _REUSE_WHOLE.value:  # the whole-graph run of the previous results (same config)
    with open(os.path.join(RESULTS, "kg_rgcn.json")) as f:
      whole = json.load(f)["whole"]
    whole_task = _task(rgcn_fb15k237.get_config())
  else:
    whole_task, whole = _rgcn_run(rgcn_fb15k237.get_config(), "rgcn_whole")
  part_cfg = rgcn_fb15k237_partitioned.get_config(str(P))
  part_task, part = _rgcn_run(part_cfg, f"rgcn_part{P}")
  parts = part_task.partitions
  N, E = part_task.kg.num_entities, len(part_task.graph["edges"])
  breakdown = _breakdown(whole_task, part_task)
  est = breakdown["loss_and_grad_epoch_s"]
  payload = {
    "whole": whole,
    "partitioned": part,
    "parts": P,
    "partition_seconds": part_task.partition_seconds,
    "partition_sizes": [
      {"core": p.num_core, "halo": p.num_halo, "edges": len(p.edges), "triples": len(p.triples)}
      for p in parts
    ],
    "padded_rows": part_task.max_nodes,
    "padded_edges": part_task.max_edges,
    "speedup_per_epoch": whole["seconds_per_epoch"] / part["seconds_per_epoch"],
    "encoder_work_ratio": sum(len(p.triples) * len(p.edges) for p in parts)
    / (len(part_task.train_triples) * E),
    "mrr_difference": part["test"]["mrr"] - whole["test"]["mrr"],
    "machine": start,
    "command": " ".join(["python", *sys.argv]),
    "step_breakdown": breakdown["steps"],
    "loss_and_grad_epoch_s": est,
    "speedup_per_epoch_loss_and_grad_interleaved": est["whole"] / est["partitioned"],
  }
  sizes = "\n".join(
    f"| {i} | {s['core']:,} | {s['halo']:,} | {(s['core'] + s['halo']) / N:.0%} | "
    f"{s['edges']:,} ({s['edges'] / E:.0%}) | {s['triples']:,} |"
    for i, s in enumerate(payload["partition_sizes"])
  )
  md = (
    f"# FB15k-237: R-GCN + DistMult, whole graph vs {P} self-sufficient partitions\n\n"
    f"Same model, {_RGCN_EPOCHS.value:g} epochs each, edge mini-batches of "
    f"{whole_task.batch_size}, "
    + (
      "scored 1-vs-all (whole graph: against every entity; partitioned: against the "
      f"partition's {part_cfg.partition.candidates} rows). "
      if whole_task.scoring == "1vsall"
      else f"{whole_task.num_neg} negatives (whole graph: uniform over all entities; "
      "partitioned: from the partition's core). "
    )
    + "Test MRR: filtered, both sides, whole-graph encoder at eval. The two runs' step times "
    "are measured at different moments of a shared machine"
    + (" (the whole-graph run is the one in results/kg_rgcn.json)" if _REUSE_WHOLE.value else "")
    + ".\n\n"
    "| training | s / epoch | steps / epoch | s / step | test MRR | Hits@10 |\n"
    "|---|---|---|---|---|---|\n"
    f"| whole graph | {whole['seconds_per_epoch']:.1f} | {whole['steps_per_epoch']} | "
    f"{whole['seconds_per_step']:.3f} | {whole['test']['mrr']:.4f} | "
    f"{whole['test']['hits@10']:.4f} |\n"
    f"| {P} partitions (METIS) | {part['seconds_per_epoch']:.1f} | {part['steps_per_epoch']} | "
    f"{part['seconds_per_step']:.3f} | {part['test']['mrr']:.4f} | "
    f"{part['test']['hits@10']:.4f} |\n\n"
    f"Speedup per epoch: **{payload['speedup_per_epoch']:.2f}x**; MRR difference "
    f"(partitioned - whole): {payload['mrr_difference']:+.4f}.\n\n"
    f"Partitions (METIS via pymetis, {payload['partition_seconds']:.1f} s to partition and "
    "build halos; "
    + (
      f"every step padded to the largest partition, {part_task.max_nodes:,} rows / "
      f"{part_task.max_edges:,} edges"
      if part_cfg.partition.pad == "max"
      else "each partition's steps sized to it: one compiled step per partition"
    )
    + "). Encoder work per epoch relative to the whole graph (sum over partitions of "
    f"triples x encoder edges): {payload['encoder_work_ratio']:.2f}.\n\n"
    "| part | core | halo | rows of all entities | encoder edges | training triples |\n"
    "|---|---|---|---|---|---|\n" + sizes + "\n\n"
    "Where a step's time goes (one step, random rows; every step timed interleaved with the "
    "others, best of 3, so load drift hits all alike):\n\n"
    "| step | rows | encoder edges | encoder forward | loss + grad (encoder + decoder) | "
    "steps / epoch |\n"
    "|---|---|---|---|---|---|\n"
    + "\n".join(
      f"| {k} | {v['rows']:,} | {v['edges']:,} | {v['encoder_forward_s'] * 1e3:.0f} ms | "
      f"{v['loss_and_grad_s'] * 1e3:.0f} ms | {v['steps_per_epoch']} |"
      for k, v in payload["step_breakdown"].items()
    )
    + f"\n\nSummed over an epoch, loss + grad: whole {est['whole']:.1f} s, partitioned "
    f"{est['partitioned']:.1f} s: **{payload['speedup_per_epoch_loss_and_grad_interleaved']:.2f}x**"
    " from the interleaved step timings (the per-epoch figure above comes from two runs at "
    "different moments).\n"
  )
  _write(_RGCN_NAME.value, payload, md)
  return payload


# ----------------------------------------------------------------------------- parallel


def _step_edges(task, step: int) -> int:
  """Training edges of step `step` (from the task's deterministic schedule, no batch built)."""
  spe, B = task.steps_per_epoch(), task.batch_size
  epoch, within = divmod(step, spe)

  def edges(p, i):
    return min(B, len(task.partitions[p].triples) - i * B)

  if task.parallel:
    return sum(edges(*x) for x in task.parallel_schedule(epoch)[within] if x is not None)
  if task.partitions:
    return edges(*task.batches.partition_schedule(epoch)[within])
  return min(B, len(task.train_triples) - within * B)


def _exact_step_seconds(workdir: str, task) -> float:
  """Steady-state seconds per step: the trainer logs edges/s per log interval; each
  interval's edges come from the schedule, so seconds = edges / rate exactly even where
  steps differ in edges (an epoch's last batches, idle parallel slots). Median over the
  intervals after the first (compilation)."""
  per_step, prev = [], 0
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    for line in f:
      rec = json.loads(line)
      if "samples_per_second" not in rec:
        continue
      step = rec["step"]
      edges = sum(_step_edges(task, k) for k in range(prev, step))
      per_step.append(edges / rec["samples_per_second"] / max(step - prev, 1))
      prev = step
  return float(np.median(per_step[1:] or per_step))


def _run(cfg, name: str, epochs: float) -> tuple:
  """Train `cfg` for `epochs` (valid MRR each epoch, test at the end): seconds per epoch
  from `_exact_step_seconds`, test metrics."""
  cfg.train.final_eval_splits = ("test",)
  task, figures, wall, workdir = _train_epochs(cfg, name, epochs, _exact_step_seconds)
  return task, {
    **figures,
    "wall_seconds_incl_evals_and_compile": wall,
    "mesh": dict(cfg.get("mesh", {})),
    "workdir": workdir,
  }


def _step_bytes(cfg) -> dict:
  """Bytes between devices per step (per device) from the compiled train step's HLO."""
  task = _task(cfg)
  mesh = task.mesh
  batch = next(task.train_batches(0))
  run = setup.build(cfg, mesh=mesh, task=task, example=batch, key=jax.random.key(0))
  buffers, layout = run.packed(run.prepare(batch), batch)
  s = comms.summary(run.train_step.lower(run.state, buffers, layout).compile().as_text())
  return {
    "mesh": sharding.describe(mesh),
    "total_operand_bytes": s["total_operand_bytes"],
    "by_op": s["by_op"],
    "edges_per_step": task.num_examples(batch),
  }


def _mesh(cfg, data: int):
  cfg.mesh = ml_collections.ConfigDict({"data": data, "model": 1})
  return cfg


def _compare(name: str, title: str, get_config, parts_list, parallel: bool, breakdown: bool):
  """Whole graph vs partitioned (serial, and parallel over P devices) with the same epochs."""
  epochs = _RGCN_EPOCHS.value
  start = _machine()
  runs = {}
  tasks = {}
  reused = {}
  name = _NAME.value or name
  if _REUSE_SERIAL.value:
    with open(os.path.join(RESULTS, f"{name}.json")) as f:
      prev = json.load(f)
    if prev["epochs"] != epochs:
      raise app.UsageError(f"--reuse_serial: {name}.json ran {prev['epochs']} epochs")
    reused = {k: v for k, v in prev["runs"].items() if "parallel" not in k}
    reused = {k: {**v, "reused_from_run_at_load": prev["machine"]} for k, v in reused.items()}
  if _WHOLE_FROM.value:
    with open(os.path.join(RESULTS, f"{_WHOLE_FROM.value}.json")) as f:
      prev = json.load(f)
    reused = {"whole": {**prev["runs"]["whole"], "reused_from_run_at_load": prev["machine"]}}
    reused["whole"]["from_file"] = _WHOLE_FROM.value
  if _RERUN_WHOLE.value:
    reused.pop("whole", None)

  def run(key, cfg, tag):
    if key in reused:
      tasks[key], runs[key] = _task(cfg), reused[key]
    else:
      tasks[key], runs[key] = _run(cfg, tag, epochs)

  run("whole", _mesh(get_config(""), 1), f"{name}_whole")
  bytes_ = {}
  for P in parts_list:
    run(f"{P} serial", _mesh(get_config(str(P)), 1), f"{name}_p{P}")
    if parallel and jax.device_count() >= P:
      cfg = _mesh(get_config(f"{P},parallel"), P)
      tasks[f"{P} parallel"], runs[f"{P} parallel"] = _run(cfg, f"{name}_p{P}_par", epochs)
      bytes_[f"{P} partitions in parallel"] = _step_bytes(_mesh(get_config(f"{P},parallel"), P))
      # The same graph data-parallel without partitions: edges split over the devices,
      # every device encodes the whole graph (rows and graph replicated).
      bytes_[f"whole graph, edges split over {P}"] = _step_bytes(_mesh(get_config(""), P))
    elif parallel:
      print(f"{P} parallel skipped: {jax.device_count()} devices (XLA_FLAGS=...count={P})")
  sizes = {}
  for k, t in tasks.items():
    if t.partitions:
      sizes[k.split()[0]] = {
        "rows_max": t.max_nodes,
        "rows_mean": float(np.mean([len(p.nodes) for p in t.partitions])),
        "halo_mean": float(np.mean([p.num_halo for p in t.partitions])),
        "edges_max": t.max_edges,
        "triples": [len(p.triples) for p in t.partitions],
      }
  whole = runs["whole"]
  payload = {
    "graph": title,
    "entities": tasks["whole"].kg.num_entities,
    "encoder_edges": len(tasks["whole"].graph["edges"]),
    "epochs": epochs,
    "runs": runs,
    "speedup_per_epoch_vs_whole": {
      k: whole["seconds_per_epoch"] / v["seconds_per_epoch"] for k, v in runs.items()
    },
    "mrr_minus_whole": {k: v["test"]["mrr"] - whole["test"]["mrr"] for k, v in runs.items()},
    "partition_sizes": sizes,
    "bytes_per_step": bytes_,
    "devices": jax.device_count(),
    "machine": start,
    "command": " ".join(["python", *sys.argv]),
    "xla_flags": os.environ.get("XLA_FLAGS", ""),
    "reused_runs": sorted(reused),
  }
  if breakdown:
    for P in parts_list:
      b = _breakdown(tasks["whole"], tasks[f"{P} serial"])
      payload[f"step_breakdown_{P}"] = b
  payload["machine"]["load_avg_1_5_15m_at_end"] = list(os.getloadavg())
  _write(name, payload, _compare_md(payload))
  return payload


def _compare_md(p: dict) -> str:
  runs = p["runs"]
  n = p["entities"]
  lines = [
    f"# {p['graph']}: R-GCN + DistMult, whole graph vs self-sufficient partitions\n",
    f"{n:,} entities, {p['encoder_edges']:,} encoder edges; {p['epochs']:g} epoch(s) per run, "
    "edge mini-batches of 4096 scored 1-vs-all (whole graph: every entity; a partition: its "
    "core + halo rows), 1 R-GCN layer, dim 64. Time per epoch = steps x the steady-state step "
    "time (each log interval's edges from the schedule / its edges/s). Test MRR filtered, "
    "both sides, whole-graph encoder at eval. "
    f"Machine: 2-core CPU shared with other jobs, load {p['machine']['load_avg_1m_at_start']:.1f} "
    f"at start, {p['machine']['load_avg_1_5_15m_at_end'][0]:.1f} at end; {p['devices']} "
    "simulated CPU device(s) (`XLA_FLAGS` "
    f"`{p['xla_flags'] or 'unset'}`): the runs use a 1 x 1 mesh, parallel runs P x 1.\n",
    (
      f"Runs {', '.join(p['reused_runs'])} are reused from "
      f"{p['runs'][p['reused_runs'][0]].get('from_file', 'the previous invocation')} "
      f"({p['runs'][p['reused_runs'][0]]['epochs']:g} epochs; load "
      f"{p['runs'][p['reused_runs'][0]]['reused_from_run_at_load']['load_avg_1m_at_start']:.1f}"
      " at its start).\n"
      if p.get("reused_runs")
      else ""
    ),
    "| training | mesh | steps / epoch | s / step | s / epoch | vs whole | test MRR | "
    "MRR - whole | Hits@10 |",
    "|---|---|---|---|---|---|---|---|---|",
  ]
  for k, r in runs.items():
    mesh = f"{r['mesh'].get('data', 1)}x{r['mesh'].get('model', 1)}"
    label = "whole graph" if k == "whole" else f"{k.split()[0]} partitions, {k.split()[1]}"
    lines.append(
      f"| {label} | {mesh} | {r['steps_per_epoch']} | {r['seconds_per_step']:.3f} | "
      f"{r['seconds_per_epoch']:.1f} | {p['speedup_per_epoch_vs_whole'][k]:.2f}x | "
      f"{r['test']['mrr']:.4f} | {p['mrr_minus_whole'][k]:+.4f} | {r['test']['hits@10']:.4f} |"
    )
  if p["partition_sizes"]:
    lines += [
      "",
      "| partitions | rows per partition (mean / max) | halo (mean) | of all entities "
      "| encoder edges (max) | training triples per partition |",
      "|---|---|---|---|---|---|",
    ]
    for P, s in p["partition_sizes"].items():
      lines.append(
        f"| {P} | {s['rows_mean']:,.0f} / {s['rows_max']:,} | {s['halo_mean']:,.0f} | "
        f"{s['rows_mean'] / n:.0%} | {s['edges_max']:,} | "
        f"{min(s['triples']):,}-{max(s['triples']):,} |"
      )
  if p["bytes_per_step"]:
    lines += [
      "",
      "Bytes each device sends per step (operands of the compiled step's collectives, HLO):",
      "",
      "| step | mesh | edges in the step compiled | bytes / device / step | by collective |",
      "|---|---|---|---|---|",
    ]
    for k, b in p["bytes_per_step"].items():
      ops = ", ".join(f"{o} {v['operand_bytes']:,} ({v['count']})" for o, v in b["by_op"].items())
      lines.append(
        f"| {k} | {b['mesh']} | {b['edges_per_step']:,} | {b['total_operand_bytes']:,} | {ops} |"
      )
  for key in [k for k in p if k.startswith("step_breakdown_")]:
    P = key.rsplit("_", 1)[1]
    b = p[key]
    lines += [
      "",
      f"Where a step's time goes, {P} partitions (one step each, random rows, interleaved, "
      "best of 3):",
      "",
      "| step | rows | encoder edges | encoder forward | loss + grad | steps / epoch |",
      "|---|---|---|---|---|---|",
    ]
    for k, v in b["steps"].items():
      lines.append(
        f"| {k} | {v['rows']:,} | {v['edges']:,} | {v['encoder_forward_s'] * 1e3:.0f} ms | "
        f"{v['loss_and_grad_s'] * 1e3:.0f} ms | {v['steps_per_epoch']} |"
      )
    e = b["loss_and_grad_epoch_s"]
    lines.append(
      f"\nSummed over an epoch (loss + grad only): whole {e['whole']:.1f} s, partitioned "
      f"{e['partitioned']:.1f} s: {e['whole'] / e['partitioned']:.2f}x."
    )
  return "\n".join(lines) + "\n"


def run_parallel():
  P = _PARTS.value
  if jax.device_count() < P:
    raise app.UsageError(
      f"--sections=parallel --parts={P} needs {P} devices, {jax.device_count()} here; on CPU "
      f"run with XLA_FLAGS=--xla_force_host_platform_device_count={P}"
    )

  def get(arg):
    return rgcn_fb15k237_partitioned.get_config(arg) if arg else rgcn_fb15k237.get_config()

  return _compare("kg_parallel", "FB15k-237", get, [P], True, False)


def run_planted():
  parts = [int(x) for x in _PLANTED_PARTS.value.split(",") if x]
  return _compare(
    "kg_planted",
    "Planted-community KG (rgcn_planted)",
    rgcn_planted.get_config,
    parts,
    _PLANTED_PARALLEL.value,
    True,
  )


def plot(kge_payloads: list[dict], rgcn_payload: dict | None):
  if not harness.can_plot():
    return
  with harness.png(os.path.join(RESULTS, "kg_mrr.png"), figsize=(6, 4), dpi=120) as (fig, ax):
    for p in kge_payloads:
      c = p["valid_curve"]
      ax.plot(
        [x["seconds"] / 60 for x in c], [x["valid_mrr"] for x in c], "o-", label=p["experiment"]
      )
    if rgcn_payload:
      for k in ("whole", "partitioned"):
        c = rgcn_payload[k]["valid_curve"]
        label = f"R-GCN {k}" + (f" ({rgcn_payload['parts']} parts)" if k == "partitioned" else "")
        ax.plot([x["seconds"] / 60 for x in c], [x["valid_mrr"] for x in c], "s--", label=label)
    ax.set_xlabel("training time (min, steady-state step rate)")
    ax.set_ylabel("filtered valid MRR")
    ax.set_title("FB15k-237")
    ax.grid(alpha=0.3)
    ax.legend()


def _load(name):
  path = os.path.join(RESULTS, f"{name}.json")
  if os.path.isfile(path):
    with open(path) as f:
      return json.load(f)
  return None


def main(argv):
  del argv
  if _QUICK.value:
    flags.FLAGS.epochs, flags.FLAGS.rgcn_epochs, flags.FLAGS.eval_every_epochs = 0.02, 0.02, 1
  sections = [s.strip() for s in _SECTIONS.value.split(",") if s.strip()]
  for s in sections:
    if s not in ("kge", "rgcn", "kge_rescan", "parallel", "planted"):
      raise app.UsageError(
        f"Unknown section {s!r}; available: kge, rgcn, kge_rescan, parallel, planted"
      )
  if "kge_rescan" in sections:
    rescan_kge(_KGE_WORKDIR.value)
  if "kge" in sections:
    run_kge()
  if "rgcn" in sections:
    run_rgcn()
  if "parallel" in sections:
    run_parallel()
  if "planted" in sections:
    run_planted()
  kges = [p for d in ("complex", "distmult") if (p := _load(f"kg_kge_{d}"))]
  plot(kges, _load("kg_rgcn"))


if __name__ == "__main__":
  app.run(main)
