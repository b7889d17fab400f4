"""The walk a reader makes to one `dlrm_kaggle` train step, counted: files and functions of
this repository on the way from `run.py` to the step, and in the step itself.

Not a benchmark: a count of code, taken from the code running. `smoke` (dlrm_kaggle at a
small size, its default plan) trains one step on one CPU device under a profile hook that
records every function of this repository (recgnn/, run.py, experiments/) called:

  to the step    the stack at the first call of the jitted train step (run.py -> ... -> the
                 call): the path a reader follows from the entry point to the step
  the step       every function called while jax traces the train step's Python (the step's
                 body: lookups, loss, optimizer, updates, packing's unpack), each once
  setup          every function called before the first step (building the run), each once

  python tools/step_walk.py                   # this tree
  RECGNN_BENCH_TREE=/path/to/other/tree python tools/step_walk.py   # another tree's code
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import harness  # noqa: E402  (puts the tree first on sys.path)


class Recorder:
  """A profile hook recording (file, function) of this tree's code, per phase."""

  def __init__(self, root: str):
    self.root = os.path.realpath(root)
    self.phase = "setup"
    self.seen: dict[str, set] = {"setup": set(), "step": set()}
    self.stack: list = []

  def ours(self, filename: str) -> str | None:
    path = os.path.realpath(filename)
    if not path.startswith(self.root + os.sep):
      return None
    rel = os.path.relpath(path, self.root)
    return rel if rel.startswith(("recgnn", "experiments", "run.py")) else None

  def __call__(self, frame, event, arg):
    del arg
    if event != "call":
      return
    rel = self.ours(frame.f_code.co_filename)
    if rel is not None:
      self.seen[self.phase].add((rel, frame.f_code.co_qualname))


def main() -> None:
  harness.simulated_devices(1)
  import jax

  from recgnn.train import loop, setup

  root = harness.env.tree()
  rec = Recorder(root)
  import run

  config = run.load_config("smoke")
  with config.unlocked():
    config.train.steps = 1
    config.train.log_every = 1
    config.train.eval_every = 0
    config.train.checkpoint_every = 0
    config.train.final_eval_splits = ()
    config.data.synthetic.rows = 12_000
  real_jit = setup.jit_steps

  def jit_steps(*a, **kw):
    train, evaluate = real_jit(*a, **kw)

    def first(state, *args):
      rec.stack = [
        (rec.ours(f.f_code.co_filename), f.f_code.co_qualname)
        for f in _frames(sys._getframe(1))
        if rec.ours(f.f_code.co_filename)
      ][::-1]
      rec.phase = "step"
      out = train(state, *args)
      jax.block_until_ready(out)
      rec.phase = "after"
      rec.seen.setdefault("after", set())
      return out

    first.lower = train.lower  # (the trainer's traffic reader lowers the step)
    return first, evaluate

  setup.jit_steps = jit_steps
  sys.setprofile(rec)
  try:
    with tempfile.TemporaryDirectory() as wd:
      loop.train(config, wd)
  finally:
    sys.setprofile(None)
  out = {
    "to_the_step": {"files": len({f for f, _ in rec.stack}), "functions": len(rec.stack),
                    "path": [f"{f}:{n}" for f, n in rec.stack]},
    "the_step": _count(rec.seen["step"]),
    "setup": _count(rec.seen["setup"]),
  }  # fmt: skip
  print("STEP_WALK " + json.dumps(out))


def _frames(frame):
  while frame is not None:
    yield frame
    frame = frame.f_back


def _count(seen: set) -> dict:
  return {"files": len({f for f, _ in seen}), "functions": len(seen)}


if __name__ == "__main__":
  main()
