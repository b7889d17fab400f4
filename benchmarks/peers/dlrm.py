"""PyTorch peers of recgnn's DLRM for side-by-side throughput: TorchRec and plain PyTorch.

Both peers run the DLRM reference Kaggle configuration (26 tables, dim 16, bottom MLP
13-512-256-64-16, dot interaction without self-interactions: 27 * 26 / 2 = 351 pairs + the
16-wide dense vector = 367 into the top MLP 367-512-256-1, BCE-with-logits, SGD lr 0.1) and
are trained on batches given as numpy arrays, the same ones recgnn gets:

  dense   float32[B, 13]
  ids     int64[B, T] (column t = the one-hot id of table t) or a sequence of T int64[B]
  labels  float32[B]

Peers:
  torchrec  torchrec.models.dlrm.DLRM over a `FusedEmbeddingBagCollection`: FBGEMM's
            SplitTableBatchedEmbeddingBags (all 26 tables in one kernel) with the optimizer
            fused into the backward (EXACT_SGD), i.e. the embedding rows are updated inside
            `loss.backward()` and never get a gradient tensor. This is TorchRec's fused path
            for an unsharded model on CPU; DistributedModelParallel with
            `apply_optimizer_in_backward` builds the same FBGEMM module per shard.
            The MLPs are updated by torch.optim.SGD.
  pytorch   the dlrm reference's structure: one `nn.EmbeddingBag(mode="sum", sparse=True)`
            per table and one torch.optim.SGD over everything (sparse row gradients for the
            tables, dense for the MLPs).

`available()` says which peers import here; `train_throughput(name, ...)` builds one, trains
it on the given batches and returns samples/s (median over timed repetitions after warmup).
The peer stack is installed by `benchmarks/peers/install.sh` (see benchmarks/README.md).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import harness
import numpy as np

PEERS = ("torchrec", "pytorch")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DlrmConfig:
  """A DLRM: tables, MLP widths and the SGD step size (defaults: the reference Kaggle config).

  Attributes:
    num_rows: rows of each table (one int for all tables, or one per table).
    num_tables: T, the number of categorical features (one table each).
    dim: embedding width; also the bottom MLP's output width.
    num_dense: width of the dense features.
    bottom: bottom MLP layer widths (ReLU after each, the last included).
    top: top MLP layer widths (ReLU after each but the last, which is the logit).
    learning_rate: SGD step size of tables and MLPs alike.
  """

  num_rows: int | tuple[int, ...] = 100_000
  num_tables: int = 26
  dim: int = 16
  num_dense: int = 13
  bottom: tuple[int, ...] = (512, 256, 64, 16)
  top: tuple[int, ...] = (512, 256, 1)
  learning_rate: float = 0.1

  def __post_init__(self):
    if self.bottom[-1] != self.dim:
      raise ValueError(f"bottom MLP must end at dim={self.dim}, got {self.bottom}")
    if self.top[-1] != 1:
      raise ValueError(f"top MLP must end in one logit, got {self.top}")
    if not isinstance(self.num_rows, int) and len(self.num_rows) != self.num_tables:
      raise ValueError(f"num_rows: {len(self.num_rows)} values for {self.num_tables} tables")

  @property
  def rows(self) -> tuple[int, ...]:
    if isinstance(self.num_rows, int):
      return (self.num_rows,) * self.num_tables
    return tuple(self.num_rows)

  @property
  def interaction_width(self) -> int:
    """Width into the top MLP: the dense vector + pairwise dots of the T + 1 vectors."""
    f = self.num_tables + 1
    return self.dim + f * (f - 1) // 2

  @property
  def matmul_macs(self) -> int:
    """Multiply-adds per example of the forward's matmuls (the bottom and top MLPs)."""
    macs = 0
    for widths in ((self.num_dense, *self.bottom), (self.interaction_width, *self.top)):
      macs += sum(a * b for a, b in zip(widths[:-1], widths[1:]))
    return macs

  def describe(self) -> str:
    """The model in one line, for result files."""
    return (
      f"bottom {self.num_dense}-{'-'.join(map(str, self.bottom))}, dot interaction, "
      f"top {self.interaction_width}-{'-'.join(map(str, self.top))}, one-hot ids"
    )


@dataclasses.dataclass(frozen=True)
class Batch:
  """One training batch as numpy arrays (see the module docstring)."""

  dense: np.ndarray  # float32[B, num_dense]
  ids: np.ndarray  # int64[B, T]
  labels: np.ndarray  # float32[B]

  @classmethod
  def of(cls, dense, ids, labels) -> Batch:
    if not isinstance(ids, np.ndarray):
      ids = np.stack([np.asarray(i) for i in ids], axis=1)
    return cls(
      np.asarray(dense, np.float32), np.asarray(ids, np.int64), np.asarray(labels, np.float32)
    )

  def bags(self) -> list[np.ndarray]:
    """Each table's ids as int64[B, 1]: bags of one id (peers_dcn.MultiHotBatch: of L_t)."""
    return [self.ids[:, t : t + 1] for t in range(self.ids.shape[1])]


def make_batches(
  cfg: DlrmConfig, batch: int, n: int, zipf: float, seed: int, same_hot_rows: bool = False
) -> list[Batch]:
  """n identical-for-everyone batches: dense N(0,1), Zipf ids per table, Bernoulli labels.

  same_hot_rows: one rank -> id permutation per table for the whole stream, so the popular
  rows are the same in every batch (what a cache or a hot set can exploit: a real stream).
  Default False: a fresh permutation per batch and table (the hot rows move every batch: a
  cache sees no reuse across batches), as the throughput benchmarks have always drawn them."""
  rng = np.random.default_rng(seed)
  perms = [rng.permutation(rows) for rows in cfg.rows] if same_hot_rows else [None] * len(cfg.rows)
  out = []
  for _ in range(n):
    ids = np.stack(
      [harness.zipf_ids(rng, rows, (batch,), zipf, perm=p) for rows, p in zip(cfg.rows, perms)],
      axis=1,
    )
    dense = rng.normal(size=(batch, cfg.num_dense)).astype(np.float32)
    labels = (rng.random(batch) < 0.25).astype(np.float32)
    out.append(Batch.of(dense, ids, labels))
  return out


def set_threads(n: int | None = None) -> int:
  """Use all of this machine's cores for torch's intra-op pool (default: the CPUs we may use)."""
  import torch

  n = n or len(os.sched_getaffinity(0))
  torch.set_num_threads(n)
  return n


def available() -> dict[str, str | None]:
  """Peer name -> None if it imports here, else why not (the import error)."""
  out: dict[str, str | None] = {}
  try:
    import torch  # noqa: F401
  except Exception as e:  # any import failure means "not available"
    return {p: f"torch: {type(e).__name__}: {e}" for p in PEERS}
  out["pytorch"] = None
  try:
    import fbgemm_gpu  # noqa: F401
    import torchrec  # noqa: F401
    from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection  # noqa: F401
  except Exception as e:
    out["torchrec"] = f"{type(e).__name__}: {e}"
  else:
    out["torchrec"] = None
  return {p: out[p] for p in PEERS}


def versions() -> dict[str, str]:
  """Versions of the peer packages that import."""
  out = {}
  for mod in ("torch", "torchrec", "fbgemm_gpu"):
    try:
      m = __import__(mod)
      out[mod] = getattr(m, "__version__", "?")
    except Exception:
      continue
  return out


# ----------------------------------------------------------------------------- models


def _mlp(torch, widths: Sequence[int], last_relu: bool):
  nn = torch.nn
  layers = []
  for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
    layers.append(nn.Linear(a, b))
    if last_relu or i < len(widths) - 2:
      layers.append(nn.ReLU())
  return nn.Sequential(*layers)


def _interact(torch, dense_out, sparse, triu):
  """dense_out float32[B, D], sparse float32[B, T, D] -> float32[B, D + (T+1) T / 2]."""
  z = torch.cat([dense_out.unsqueeze(1), sparse], dim=1)
  zz = torch.bmm(z, z.transpose(1, 2))
  return torch.cat([dense_out, zz[:, triu[0], triu[1]]], dim=1)


def _build_pytorch(cfg: DlrmConfig, seed: int):
  import torch

  nn = torch.nn
  torch.manual_seed(seed)

  class PlainDlrm(nn.Module):
    """The dlrm reference's DLRM_Net: EmbeddingBag(sum, sparse=True) per table, dot interaction."""

    def __init__(self):
      super().__init__()
      self.tables = nn.ModuleList()
      for n in cfg.rows:
        eb = nn.EmbeddingBag(n, cfg.dim, mode="sum", sparse=True)
        nn.init.uniform_(eb.weight, -(n**-0.5), n**-0.5)
        self.tables.append(eb)
      self.bottom = _mlp(torch, (cfg.num_dense, *cfg.bottom), last_relu=True)
      self.top = _mlp(torch, (cfg.interaction_width, *cfg.top), last_relu=False)
      f = cfg.num_tables + 1
      self.register_buffer("triu", torch.triu_indices(f, f, offset=1), persistent=False)

    def forward(self, dense, ids):
      # ids: int64[B, T]; a 2-D input to EmbeddingBag is B bags of one id each (one-hot).
      x = self.bottom(dense)
      sparse = torch.stack([t(ids[:, i : i + 1]) for i, t in enumerate(self.tables)], dim=1)
      return self.top(_interact(torch, x, sparse, self.triu)).squeeze(1)

  model = PlainDlrm()
  opt = torch.optim.SGD(model.parameters(), lr=cfg.learning_rate)
  loss_fn = nn.BCEWithLogitsLoss()

  def to_inputs(b: Batch):
    return (
      torch.from_numpy(b.dense),
      torch.from_numpy(np.ascontiguousarray(b.ids)),
      torch.from_numpy(b.labels),
    )

  def step(inputs):
    dense, ids, labels = inputs
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(model(dense, ids), labels)
    loss.backward()
    opt.step()
    return loss

  return model, to_inputs, step


def build_pytorch_on(
  cfg: DlrmConfig, device: str, seed: int = 0, compiled: bool = False, bf16: bool = False
):
  """The `pytorch` peer on `device` ("cuda" / "cpu") for tools/gpu_check.py's perf stage:
  the same model (one `nn.EmbeddingBag(mode="sum", sparse=True)` per table, the reference
  MLPs, dot interaction, SGD with sparse row gradients for the tables), its batches kept in
  pinned host memory and copied to the device inside each step (as recgnn's step receives
  its batch), so both sides pay their own host -> device traffic.

  compiled: `torch.compile` of the dense part (bottom MLP, interaction, top MLP, loss): the
  EmbeddingBags stay eager (sparse gradients). bf16: that part under CUDA autocast (bf16
  matmuls, float32 params and tables), as recgnn's model.dtype=bfloat16.
  -> (to_inputs(Batch) -> pinned host tensors, step(inputs) -> loss, sync())."""
  import torch

  nn = torch.nn
  torch.manual_seed(seed)
  dev = torch.device(device)
  tables = nn.ModuleList()
  for n in cfg.rows:
    eb = nn.EmbeddingBag(n, cfg.dim, mode="sum", sparse=True)
    nn.init.uniform_(eb.weight, -(n**-0.5), n**-0.5)
    tables.append(eb)
  bottom = _mlp(torch, (cfg.num_dense, *cfg.bottom), last_relu=True)
  top = _mlp(torch, (cfg.interaction_width, *cfg.top), last_relu=False)
  tables, bottom, top = tables.to(dev), bottom.to(dev), top.to(dev)
  f = cfg.num_tables + 1
  triu = torch.triu_indices(f, f, offset=1, device=dev)
  loss_fn = nn.BCEWithLogitsLoss()

  def dense_part(dense, sparse, labels):
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
      logits = top(_interact(torch, bottom(dense), sparse, triu)).squeeze(1)
    return loss_fn(logits.float(), labels)

  dense_fn = torch.compile(dense_part) if compiled else dense_part
  params = [*tables.parameters(), *bottom.parameters(), *top.parameters()]
  opt = torch.optim.SGD(params, lr=cfg.learning_rate)
  pin = dev.type == "cuda"

  def to_inputs(b: Batch):
    out = (
      torch.from_numpy(b.dense),
      torch.from_numpy(np.ascontiguousarray(b.ids)),
      torch.from_numpy(b.labels),
    )
    return tuple(x.pin_memory() for x in out) if pin else out

  def step(inputs):
    dense, ids, labels = (x.to(dev, non_blocking=True) for x in inputs)
    opt.zero_grad(set_to_none=True)
    sparse = torch.stack([t(ids[:, i : i + 1]) for i, t in enumerate(tables)], dim=1)
    loss = dense_fn(dense, sparse, labels)
    loss.backward()
    opt.step()
    return loss

  def sync():
    if pin:
      torch.cuda.synchronize()

  return to_inputs, step, sync


def build_torchrec(cfg: DlrmConfig, seed: int, make_model: Callable[[Any], Any] | None = None):
  """TorchRec's model over a FusedEmbeddingBagCollection (fused SGD), its inputs and step.

  `make_model(ebc)` builds the model over the collection (default: `torchrec.models.dlrm.DLRM`
  of cfg's MLPs; peers_dcn passes `DLRM_DCN`). Batches are anything with `dense`, `labels`
  and `bags()` (every bag of table t holding the same number of ids).
  """
  import torch
  from torchrec.models.dlrm import DLRM
  from torchrec.modules.embedding_configs import EmbeddingBagConfig
  from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
  from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

  torch.manual_seed(seed)
  keys = [f"f{t}" for t in range(cfg.num_tables)]
  tables = [
    EmbeddingBagConfig(name=f"t{t}", embedding_dim=cfg.dim, num_embeddings=n, feature_names=[k])
    for t, (n, k) in enumerate(zip(cfg.rows, keys))
  ]
  ebc = FusedEmbeddingBagCollection(
    tables=tables,
    optimizer_type=torch.optim.SGD,
    optimizer_kwargs={"lr": cfg.learning_rate},
    device=torch.device("cpu"),
  )
  if make_model is None:
    model = DLRM(
      embedding_bag_collection=ebc,
      dense_in_features=cfg.num_dense,
      dense_arch_layer_sizes=list(cfg.bottom),
      over_arch_layer_sizes=list(cfg.top),
    )
  else:
    model = make_model(ebc)
  first = next(m for m in model.over_arch.modules() if isinstance(m, torch.nn.Linear))
  if first.in_features != cfg.interaction_width:
    raise AssertionError(
      f"TorchRec's top MLP takes {first.in_features} features, expected {cfg.interaction_width}"
    )
  # The tables are updated by the fused optimizer inside backward; the dense SGD must not see
  # them (FusedEBC re-registers the FBGEMM weights as parameters for state_dict's sake).
  emb = {id(p) for p in ebc.parameters()}
  dense_params = [p for p in model.parameters() if id(p) not in emb]
  opt = torch.optim.SGD(dense_params, lr=cfg.learning_rate)
  loss_fn = torch.nn.BCEWithLogitsLoss()

  def to_inputs(b):
    bags = b.bags()
    bsz = b.labels.shape[0]
    # KJT values are feature-major: all of f0's bags (example by example), then f1's, ...
    kjt = KeyedJaggedTensor.from_lengths_sync(
      keys=keys,
      values=torch.from_numpy(np.concatenate([x.reshape(-1) for x in bags]).astype(np.int64)),
      lengths=torch.from_numpy(np.repeat([x.shape[1] for x in bags], bsz).astype(np.int32)),
    )
    return torch.from_numpy(b.dense), kjt, torch.from_numpy(b.labels)

  def step(inputs):
    dense, kjt, labels = inputs
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(model(dense, kjt).squeeze(1), labels)
    loss.backward()  # also applies the fused SGD to the touched rows
    opt.step()
    return loss

  return model, to_inputs, step


_BUILDERS: dict[str, Callable[[DlrmConfig, int], Any]] = {
  "pytorch": _build_pytorch,
  "torchrec": build_torchrec,
}


def build(name: str, cfg: DlrmConfig, seed: int = 0):
  """-> (model, to_inputs(Batch) -> torch inputs, step(inputs) -> loss). Raises ImportError."""
  if name not in _BUILDERS:
    raise ValueError(f"Unknown peer {name!r}; available: {', '.join(PEERS)}")
  return _BUILDERS[name](cfg, seed)


# ----------------------------------------------------------------------------- timing


def time_steps(
  step: Callable[[Any], Any],
  inputs: Sequence[Any],
  batch_size: int,
  warmup: int = 3,
  reps: int = 5,
  steps_per_rep: int | None = None,
  sync: Callable[[], Any] = lambda: None,
) -> dict[str, Any]:
  """Times `step` cycling over `inputs`; torch runs eagerly, so a step is done when it returns
  (on CPU; on a GPU `sync` waits for the device before and after each timed repetition).

  Returns {"samples_per_s": median over reps, "step_ms": median ms/step, "per_rep_ms": [...]}.
  """
  n = len(inputs)
  steps_per_rep = steps_per_rep or n
  for i in range(warmup):
    step(inputs[i % n])
  per_step = []
  k = 0
  for _ in range(reps):
    sync()
    t0 = time.perf_counter()
    for _ in range(steps_per_rep):
      step(inputs[k % n])
      k += 1
    sync()
    per_step.append((time.perf_counter() - t0) / steps_per_rep)
  med = statistics.median(per_step)
  return {
    "samples_per_s": batch_size / med,
    "step_ms": 1e3 * med,
    "per_rep_ms": [1e3 * s for s in per_step],
  }


def runner(name: str, cfg: DlrmConfig, batches: Sequence[Batch], seed: int = 0):
  """Builds peer `name` on `batches` (converted to torch once, here) -> run(k) -> last loss.

  run(k) trains k steps, cycling over the batches; for callers that interleave peers' timed
  repetitions with other contestants (benchmarks/dlrm_throughput.py).
  """
  _, to_inputs, step = build(name, cfg, seed)
  return runner_of(to_inputs, step, batches)


def runner_of(to_inputs, step, batches: Sequence[Any]):
  """`runner` for a built peer: (to_inputs, step) of `build` (or peers_dcn.build)."""
  inputs = [to_inputs(b) for b in batches]
  pos = [0]

  def run(k: int) -> float:
    loss = None
    for _ in range(k):
      loss = step(inputs[pos[0] % len(inputs)])
      pos[0] += 1
    return float(loss.item()) if loss is not None else float("nan")

  return run


def train_throughput(
  name: str,
  cfg: DlrmConfig,
  batches: Sequence[Batch],
  warmup: int = 3,
  reps: int = 5,
  steps_per_rep: int | None = None,
  seed: int = 0,
) -> dict[str, Any]:
  """Builds peer `name`, trains it on `batches` (converted to torch once, outside the timing).

  Returns time_steps's dict plus "final_loss" (a sanity check that training moves).
  """
  _, to_inputs, step = build(name, cfg, seed)
  inputs = [to_inputs(b) for b in batches]
  out = time_steps(step, inputs, batches[0].labels.shape[0], warmup, reps, steps_per_rep)
  out["final_loss"] = float(step(inputs[0]).item())
  return out
