"""The benchmark harness: what every script in benchmarks/ shares, one copy of each.

A benchmark starts

    import harness  # this checkout first on sys.path (before any installed recgnn)

    harness.simulated_devices(8)  # only where it needs several devices: before jax starts

    import jax  # noqa: E402
    from recgnn import ...  # noqa: E402

and ends with `harness.write_results(name, payload, markdown)`, the payload started by
`harness.record(args)` before measuring. The pieces (one module a concern):

  env        the tree on sys.path, simulated devices (before jax initialises)
  flags      the shared flags: parser(doc), add_output, add_rounds, add_dlrm, add_against
  machine    the machine record (CPU, load, versions, environment), the matmul rate
  results    results/<name>.json + .md (+ .png), markdown tables, record(args)
  timing     blocked calls, jitted runners, contestants in round-robin in one process
  processes  contestants in separate processes in rounds, --against=COMMIT, trainer runs
  ids        bounded Zipf ids
  dlrm_task  one DLRM task over given tables (benchmarks and tests drive the trainer's step)

benchmarks/README.md says how to write a benchmark with it.
"""

from . import env, flags
from .ids import zipf_cdf, zipf_ids, zipf_ranks
from .machine import cpu_model, load, machine_info, matmul_gflops
from .processes import (
  alternated,
  distribution,
  extract_commit,
  rotated,
  rounds,
  run_checked,
  trainer_flags,
  trainer_process,
  trees,
)
from .results import RESULTS, can_plot, md_table, png, record, write_results
from .timing import interleaved_timing, jitted_runner, prepare_without_steps, time_calls

simulated_devices = env.simulated_devices
ROOT = env.ROOT

env.tree_on_path()

__all__ = [
  "RESULTS",
  "ROOT",
  "alternated",
  "can_plot",
  "cpu_model",
  "distribution",
  "env",
  "extract_commit",
  "flags",
  "interleaved_timing",
  "jitted_runner",
  "prepare_without_steps",
  "load",
  "machine_info",
  "matmul_gflops",
  "md_table",
  "png",
  "record",
  "rotated",
  "rounds",
  "run_checked",
  "simulated_devices",
  "time_calls",
  "trainer_flags",
  "trainer_process",
  "trees",
  "write_results",
  "zipf_cdf",
  "zipf_ids",
  "zipf_ranks",
]
