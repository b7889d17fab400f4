"""The run's scalars on disk: metrics.jsonl (one JSON line per log step and eval) and
TensorBoard (tensorboardX, when installed), written on a thread of their own in call order.
Only process 0 writes them (`open` returns None elsewhere)."""

from __future__ import annotations

import concurrent.futures
import json
import os


def _summary_writer(workdir: str):
  try:
    from tensorboardX import SummaryWriter
  except ImportError:  # scalars still go to metrics.jsonl
    return None
  return SummaryWriter(os.path.join(workdir, "tensorboard"))


class ScalarWriter:
  """metrics.jsonl and TensorBoard, written on a thread of their own in call order: a log
  line's scalars (hundreds with a host tier's per-table counters) cost ~20 Python calls each
  in tensorboardX, ~110 per step amortized on the launching thread for cdlrm_kaggle's 26
  offloaded tables at log_every=48 (benchmarks/host_path.py). A failed write is raised at
  the next `write` or at `close`, which also closes the files."""

  def __init__(self, metrics_file, writer):
    self._file, self._writer = metrics_file, writer
    self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="recgnn-scalars")
    self._pending: list[concurrent.futures.Future] = []

  @classmethod
  def open(cls, workdir: str, main: bool) -> ScalarWriter | None:
    """The writer of `workdir`'s metrics.jsonl (appended to: a resumed run continues it) and
    TensorBoard scalars; None on processes other than the main one."""
    if not main:
      return None
    metrics_file = open(os.path.join(workdir, "metrics.jsonl"), "a")  # noqa: SIM115 (close)
    return cls(metrics_file, _summary_writer(workdir))

  def _write(self, step: int, scalars: dict[str, float]) -> None:
    self._file.write(json.dumps({"step": step, **scalars}) + "\n")
    self._file.flush()
    if self._writer is not None:
      for k, v in scalars.items():
        self._writer.add_scalar(k, v, step)

  def write(self, step: int, scalars: dict[str, float]) -> None:
    self._check(done_only=True)
    self._pending.append(self._pool.submit(self._write, step, scalars))

  def _check(self, done_only: bool) -> None:
    while self._pending and (not done_only or self._pending[0].done()):
      self._pending.pop(0).result()  # (re-raises a write's error)

  def close(self) -> None:
    """Every write finished (its error raised), then the files closed."""
    try:
      self._pool.shutdown(wait=True)
      self._check(done_only=False)
    finally:
      self._file.close()
      if self._writer is not None:
        self._writer.close()
