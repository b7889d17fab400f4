"""recgnn entry point.

  python run.py --experiment=dlrm_kaggle [--workdir=DIR] [--config.train.steps=100] ...
  python run.py --list

--experiment=NAME loads experiments/NAME.py:get_config() (NAME:ARG passes ARG to it). The
config is locked: a misspelt --config.x.y override fails at once, listing the valid keys.

--resume continues the workdir's run (refused when there is no checkpoint, or when the
checkpoint was saved by another configuration: the differing keys are named and the
checkpoint is kept); --resume_if_present continues it if there is one, else starts. An error
of the configuration, plan, data or workdir prints one line and exits with status 2
(--verbose: the traceback).
"""

from __future__ import annotations

import difflib
import importlib
import os
import pkgutil
import sys

from recgnn import hostmem, xla_env

# Run as the program (not imported by a test): may re-execute this process under tcmalloc,
# before anything loads.
MALLOC = hostmem.preload_allocator() if __name__ == "__main__" else "as the importing process's"
xla_env.relax_simulated_device_timeouts()  # before jax initialises its backends
hostmem.keep_freed_memory()  # before jax's threads start: a step's temporaries reused

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

import experiments  # noqa: E402
from recgnn.train import watchdog  # noqa: E402

_EXPERIMENT = flags.DEFINE_string("experiment", None, "Experiment name (see --list).")
_LIST = flags.DEFINE_bool("list", False, "List the experiments and exit.")
_WORKDIR = flags.DEFINE_string(
  "workdir", None, "Checkpoints, TensorBoard scalars, traces, results.json (default: workdir/NAME)."
)
_COORD = flags.DEFINE_string(
  "coordinator_address",
  None,
  "HOST:PORT of process 0, for a run over many processes (jax.distributed; default "
  "$JAX_COORDINATOR_ADDRESS). One process when unset.",
)
_NPROC = flags.DEFINE_integer("num_processes", None, "Processes in the run ($JAX_NUM_PROCESSES).")
_PID = flags.DEFINE_integer("process_id", None, "This process's id, 0.. ($JAX_PROCESS_ID).")
_HEARTBEAT = flags.DEFINE_integer(
  "heartbeat_timeout",
  30,
  "Many processes: seconds after which a silent peer counts as dead and every process stops "
  "with an error (shorter: a crash is noticed sooner; too short for a loaded machine: a live "
  "peer is declared dead).",
  lower_bound=1,
)
_RESUME = flags.DEFINE_bool(
  "resume",
  False,
  "Continue from the latest checkpoint in --workdir. Refused when there is none, and when it "
  "was saved by another configuration (the differing keys are named; the checkpoint is kept).",
)
_RESUME_IF_PRESENT = flags.DEFINE_bool(
  "resume_if_present",
  False,
  "Continue from the latest checkpoint in --workdir if there is one, else start at step 0 "
  "(for a job scheduler that reruns the same command).",
)
_VERBOSE = flags.DEFINE_bool(
  "verbose",
  False,
  "Show the Python traceback of configuration, plan, data and workdir errors (without it: "
  "one line, exit status 2).",
)
_PROFILE = flags.DEFINE_string(
  "profile_steps", None, "START:STOP: write an XLA profiler trace of these train steps."
)
_BUDGET = flags.DEFINE_string(
  "device_memory_budget",
  None,
  "Refuse embedding plans needing more device memory per device (e.g. 2G; 'plan+10%': the "
  "plan's own bytes plus 10%, logged in bytes).",
)
_HOST_BUDGET = flags.DEFINE_string(
  "host_memory_budget",
  None,
  "Refuse embedding plans needing more host memory (e.g. 16G) for their host tables and "
  "caches; offload's storage='ssd:DIR' keeps only a host cache of a table's rows in RAM.",
)
_PLAN_REPORT = flags.DEFINE_bool(
  "plan_report",
  False,
  "Time each table's placement before training (as plan=auto does) and after it print the "
  "predicted step time and bytes against the measured ones, per group "
  "(workdir/plan_report.json). Always on with an auto(...) plan rule.",
)


def available_experiments() -> dict[str, str]:
  """name -> first line of the experiment module's docstring."""
  out = {}
  for m in sorted(pkgutil.iter_modules(experiments.__path__), key=lambda m: m.name):
    if m.name.startswith("_"):
      continue
    module = importlib.import_module(f"experiments.{m.name}")
    out[m.name] = (module.__doc__ or "").strip().splitlines()[0] if module.__doc__ else ""
  return out


def load_config(spec: str):
  """'NAME' or 'NAME:ARG' -> experiments/NAME.py:get_config(ARG)."""
  name, _, arg = spec.partition(":")
  names = available_experiments()
  if name not in names:
    close = [n for n in names if n.startswith(name)] or difflib.get_close_matches(name, names, n=3)
    hint = f" Did you mean {', '.join(close[:3])}?" if close else ""
    raise SystemExit(
      f"Unknown experiment {name!r}.{hint} Available: {', '.join(names)} (python run.py --list)"
    )
  module = importlib.import_module(f"experiments.{name}")
  return with_defaults(module.get_config(arg or None))


def with_defaults(config):
  """Keys every experiment has, so `--config.mesh.data=8` or `--config.train.epochs=2` work
  whatever the experiment file sets: the mesh (data 0 = every device not on model), the
  training length (train.steps > 0 wins over train.epochs) and the watchdog's bounds."""
  import ml_collections

  if "mesh" not in config:
    config.mesh = ml_collections.ConfigDict({"data": 0, "model": 1})
  if "train" in config:
    if "steps" not in config.train:
      config.train.steps = 0
    if "epochs" not in config.train:
      config.train.epochs = 0.0
    # The trainer's watchdog (recgnn/train/watchdog.py): a unit of work (step, eval batch,
    # save) past watchdog_factor x its median (at least watchdog_min_s; the first one:
    # watchdog_first_s) ends the run with the stacks; factor 0 turns it off. SIGTERM ends a
    # step that does not finish within sigterm_grace_s.
    for key, value in watchdog.CONFIG_DEFAULTS.items():
      if key not in config.train:
        config.train[key] = value
  return config


def _check_overrides(config, argv: list[str]) -> None:
  """Fail before anything runs when an override names a key the config lacks."""
  for arg in argv:
    if not arg.startswith("--config."):
      continue
    path = arg[len("--config.") :].split("=", 1)[0].split(".")
    node = config
    for i, key in enumerate(path):
      if not hasattr(node, "keys") or key not in node:
        where = ".".join(["config", *path[:i]])
        valid = sorted(node.keys()) if hasattr(node, "keys") else []
        close = difflib.get_close_matches(key, valid, n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise SystemExit(
          f"Unknown config key {'.'.join(['config', *path])!r}.{hint} "
          f"Keys of {where}: {', '.join(valid)}"
        )
      node = node[key]


def apply_overrides(config, overrides: list[str]):
  """`--config.a.b=VALUE` overrides applied to a copy of `config` (locked, as the CLI does),
  which is returned. An unknown key raises SystemExit naming the valid ones; a value that
  does not parse as the key's type raises ValueError naming the override. (The CLI runs this
  before absl parses the same flags, so a bad value is one line, not absl's usage dump.)"""
  _check_overrides(config, overrides)
  values = flags.FlagValues()
  argv = ["run.py", *overrides]
  config_flags.DEFINE_config_dict("config", config.copy_and_resolve_references(),
                                  flag_values=values, lock_config=True, sys_argv=argv)  # fmt: skip
  try:
    values(argv)
  except flags.Error as e:
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    raise ValueError(f"Bad override: {text}") from None
  return values.config


def main(argv):
  del argv
  from absl import logging

  from recgnn import distributed
  from recgnn.train import loop

  # Our progress goes to stdout; keep library INFO chatter (Orbax) out of it.
  logging.set_verbosity(logging.WARNING)
  # Before anything touches a device: join the other processes (a no-op for one process).
  distributed.initialize(_COORD.value, _NPROC.value, _PID.value, heartbeat_s=_HEARTBEAT.value)
  config = flags.FLAGS.config
  name = _EXPERIMENT.value.partition(":")[0]
  workdir = _WORKDIR.value or os.path.join("workdir", name)
  loop.log(f"Experiment {_EXPERIMENT.value}; workdir {os.path.abspath(workdir)}")
  loop.log(f"malloc: {MALLOC}")
  from recgnn.train import checkpoint

  resume = "if_present" if _RESUME_IF_PRESENT.value else _RESUME.value
  try:
    profile, budget = loop.parse_steps(_PROFILE.value), loop.parse_budget(_BUDGET.value)
    if _HOST_BUDGET.value is not None:  # (the setup reads config.host_memory_budget)
      with config.unlocked():  # (an experiment's config is locked; few name this key)
        config.host_memory_budget = _HOST_BUDGET.value
  except ValueError as e:
    fail(str(e))
  try:
    result = loop.train(
      config,
      workdir,
      resume=resume,
      profile_steps=profile,
      device_memory_budget=budget,
      plan_report=_PLAN_REPORT.value,
    )
  except (loop.NonFiniteLoss, checkpoint.CheckpointWriteError, checkpoint.CorruptCheckpoint) as e:
    # The message says what happened and what to do; a traceback would bury it.
    raise SystemExit(f"{type(e).__name__}: {e}") from None
  except Exception as e:
    if _VERBOSE.value:
      raise
    if getattr(e, "user_line", None):  # (an error of the data or plan on the input side)
      fail(f"{e.user_line}; --verbose shows its traceback")
    if not is_user_error(e):
      raise
    fail(f"{type(e).__name__}: {e}")
  metrics = {k: v for k, v in result.metrics.items() if isinstance(v, (int, float))}
  loop.log("Final: " + "  ".join(f"{k} {v:.5g}" for k, v in sorted(metrics.items())))


USAGE_EXIT = 2  # a configuration / plan / data / workdir error: the command line needs a fix


def fail(message: str) -> None:
  """One line on stderr and exit status 2: the message names the fix, a traceback would
  only bury it (--verbose shows it)."""
  print(message, file=sys.stderr, flush=True)
  sys.exit(USAGE_EXIT)


def is_user_error(e: BaseException) -> bool:
  """An error of the configuration, the plan, the data or the workdir raised before the
  first step (loop.train marks those `during_setup`), as opposed to a bug."""
  from recgnn.train import workdir_lock

  kinds = (ValueError, LookupError, OSError, workdir_lock.WorkdirLocked)
  return isinstance(e, kinds) and bool(getattr(e, "during_setup", False))


def _peek(argv: list[str], flag: str) -> str | None:
  for i, a in enumerate(argv):
    if a.startswith(f"--{flag}="):
      return a.split("=", 1)[1]
    if a == f"--{flag}" and i + 1 < len(argv):
      return argv[i + 1]
  return None


def cli(argv: list[str] | None = None) -> None:
  argv = list(sys.argv if argv is None else argv)
  if "--list" in argv:
    for name, doc in available_experiments().items():
      print(f"{name:<20} {doc}")
    return
  spec = _peek(argv, "experiment")
  if spec is None:
    fail(
      "Give --experiment=NAME (python run.py --list shows them: "
      + ", ".join(available_experiments())
      + ")"
    )
  try:
    config = load_config(spec)
    apply_overrides(config, [a for a in argv[1:] if a.startswith("--config.")])
  except SystemExit as e:
    if isinstance(e.code, str):
      fail(e.code)
    raise
  except ValueError as e:
    fail(str(e))
  config_flags.DEFINE_config_dict("config", config, lock_config=True)
  app.run(main, argv=argv)


if __name__ == "__main__":
  cli()
