"""TorchRec's DLRM-DCNv2 (`torchrec.models.dlrm.DLRM_DCN`) beside recgnn's, on multi-hot batches.

What `benchmarks/dlrm_throughput.py --model=dcnv2` compares: recgnn's CTR task with
`model.interaction=dcn` (recgnn/models/dcn.py, low-rank cross layers) against TorchRec's
`DLRM_DCN`, both with

  - T tables (default 26) of the same rows and dim, multi-hot bags of MLPerf's sizes
    (3,2,1,2,6,1,1,1,1,7,3,8,1,6,9,5,1,1,1,12,100,27,10,3,1,1: 214 ids per example), sum
    pooling. The first id of every bag is Zipf-drawn, the others come from it by MLPerf's
    one-hot -> multi-hot recipe (recgnn.data.multihot, uniform), so hot rows stay hot;
  - bottom MLP 13-...-D (ReLU after every layer), x0 = [bottom(dense), e_1, ..., e_T] of width
    N = (T + 1) D, L low-rank cross layers x_{l+1} = x0 * (U_l (V_l x_l) + b_l) + x_l, top MLP
    N-...-1 (no ReLU on the logit), BCE-with-logits;
  - SGD at one learning rate for tables and MLPs. TorchRec's tables are a
    FusedEmbeddingBagCollection (FBGEMM, EXACT_SGD fused into the backward, as peers_dlrm's
    DLRM peer), its MLPs and cross layers torch.optim.SGD. (MLPerf trains with Adagrad; SGD
    keeps this comparable to the dot-DLRM benchmark and needs no optimizer state.)

Batches (`MultiHotBatch`) are numpy: dense float32[B, 13], one int64[B, L_t] per table, labels
float32[B]; TorchRec gets them as a KeyedJaggedTensor (values feature-major, lengths L_t),
recgnn as its padded bags ids[t] int32[B, L_t] (MLPerf's bags are full: no PAD).

`check(rec, cfg, batches)` shows the two compute the same: recgnn's initial weights copied into
TorchRec's model, logits on batch 1, one train step of each on batch 0, then logits on batch 1
and the tables again, beside the parameter counts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import harness
import numpy as np

from recgnn.data import multihot

from . import dlrm as peers_dlrm

PEERS = ("torchrec",)  # plain PyTorch has no DCN reference to mirror; TorchRec's is MLPerf's
versions = peers_dlrm.versions
set_threads = peers_dlrm.set_threads


@dataclasses.dataclass(frozen=True, kw_only=True)
class DcnConfig(peers_dlrm.DlrmConfig):
  """peers_dlrm.DlrmConfig with the cross network in place of the dot interaction.

  Attributes:
    cross_layers: low-rank cross layers L.
    low_rank: their rank r (TorchRec's DLRM_DCN has low-rank layers only).
    bag_sizes: ids per example of each table (default: MLPerf's 26, cycled to num_tables).
  """

  cross_layers: int = 3
  low_rank: int = 64
  bag_sizes: tuple[int, ...] = ()

  def __post_init__(self):
    super().__post_init__()
    if not self.bag_sizes:
      sizes = multihot.MLPERF_MULTI_HOT_SIZES
      object.__setattr__(
        self, "bag_sizes", tuple(sizes[t % len(sizes)] for t in range(self.num_tables))
      )
    if len(self.bag_sizes) != self.num_tables:
      raise ValueError(f"bag_sizes: {len(self.bag_sizes)} values for {self.num_tables} tables")
    if self.low_rank < 1:
      raise ValueError(f"low_rank must be >= 1 (TorchRec's DLRM_DCN), got {self.low_rank}")

  @property
  def interaction_width(self) -> int:
    """Width of x0, the cross layers and the top MLP's input: N = (T + 1) D."""
    return (self.num_tables + 1) * self.dim

  @property
  def matmul_macs(self) -> int:
    """The MLPs' multiply-adds per example plus the cross layers' (x V: N r, then U: r N)."""
    return super().matmul_macs + self.cross_layers * 2 * self.interaction_width * self.low_rank

  def describe(self) -> str:
    n = self.interaction_width
    return (
      f"bottom {self.num_dense}-{'-'.join(map(str, self.bottom))}, {self.cross_layers} "
      f"low-rank ({self.low_rank}) cross layers over N = {n}, top {n}-"
      f"{'-'.join(map(str, self.top))}, multi-hot bags of {','.join(map(str, self.bag_sizes))} "
      f"ids ({sum(self.bag_sizes)} per example), sum pooling"
    )


@dataclasses.dataclass(frozen=True)
class MultiHotBatch:
  """One training batch as numpy arrays (see the module docstring)."""

  dense: np.ndarray  # float32[B, num_dense]
  ids: tuple[np.ndarray, ...]  # int64[B, L_t] per table
  labels: np.ndarray  # float32[B]

  def bags(self) -> list[np.ndarray]:
    return list(self.ids)


def make_batches(cfg: DcnConfig, batch: int, n: int, zipf: float, seed: int):
  """n identical-for-everyone batches: dense N(0,1), Bernoulli labels, and per table Zipf
  first ids expanded to bags of bag_sizes[t] by MLPerf's recipe (uniform)."""
  rng = np.random.default_rng(seed)
  recipe = multihot.MultiHotRecipe(sizes=cfg.bag_sizes, seed=seed)
  out = []
  for _ in range(n):
    ids = tuple(
      recipe.expand(t, harness.zipf_ids(rng, rows, (batch,), zipf), rows).astype(np.int64)
      for t, rows in enumerate(cfg.rows)
    )
    dense = rng.normal(size=(batch, cfg.num_dense)).astype(np.float32)
    labels = (rng.random(batch) < 0.25).astype(np.float32)
    out.append(MultiHotBatch(dense, ids, labels))
  return out


def available() -> dict[str, str | None]:
  """Peer name -> None if it imports here, else why not."""
  why = peers_dlrm.available()["torchrec"]
  if why is None:
    try:
      from torchrec.models.dlrm import DLRM_DCN  # noqa: F401
    except Exception as e:
      why = f"{type(e).__name__}: {e}"
  return {"torchrec": why}


def build(name: str, cfg: DcnConfig, seed: int = 0):
  """-> (model, to_inputs(MultiHotBatch) -> torch inputs, step(inputs) -> loss)."""
  if name not in PEERS:
    raise ValueError(f"Unknown DCNv2 peer {name!r}; available: {', '.join(PEERS)}")

  def make_model(ebc):
    from torchrec.models.dlrm import DLRM_DCN

    return DLRM_DCN(
      embedding_bag_collection=ebc,
      dense_in_features=cfg.num_dense,
      dense_arch_layer_sizes=list(cfg.bottom),
      over_arch_layer_sizes=list(cfg.top),
      dcn_num_layers=cfg.cross_layers,
      dcn_low_rank_dim=cfg.low_rank,
    )

  return peers_dlrm.build_torchrec(cfg, seed, make_model)


def runner(name: str, cfg: DcnConfig, batches: Sequence[MultiHotBatch], seed: int = 0):
  """peers_dlrm.runner for the DCNv2 peer: run(k) trains k steps -> the last loss."""
  _, to_inputs, step = build(name, cfg, seed)
  return peers_dlrm.runner_of(to_inputs, step, batches)


# ----------------------------------------------------------------------------- same math


def copy_recgnn_weights(model, params, tables: Sequence[np.ndarray]) -> None:
  """Writes recgnn's DCN params ({"params": ...} of recgnn.models.dcn.DCN) and tables
  (float32[rows_t, D] each, in feature order) into TorchRec's DLRM_DCN `model`, in place.

  torch Linear weights are [out, in], flax kernels [in, out]; TorchRec's cross layer l computes
  W_l (V_l x) with V_l [r, N], W_l [N, r], so V_l = recgnn's V_l^T and W_l = recgnn's U_l^T.
  """
  import torch

  p = params["params"]
  sd = model.state_dict()  # views of the live weights (FBGEMM's included): copy_ writes them
  dest = {}
  for t, rows in enumerate(tables):
    dest[f"sparse_arch.embedding_bag_collection.embedding_bags.t{t}.weight"] = rows
  for i in range(len(p["bottom"])):
    layer = p["bottom"][f"Dense_{i}"]
    dest[f"dense_arch.model._mlp.{i}._linear.weight"] = np.asarray(layer["kernel"]).T
    dest[f"dense_arch.model._mlp.{i}._linear.bias"] = layer["bias"]
  for i in range(len(p["cross"]) // 3):
    dest[f"inter_arch.crossnet.V_kernels.{i}"] = np.asarray(p["cross"][f"V_{i}"]).T
    dest[f"inter_arch.crossnet.W_kernels.{i}"] = np.asarray(p["cross"][f"U_{i}"]).T
    dest[f"inter_arch.crossnet.bias.{i}"] = p["cross"][f"b_{i}"]
  top = [p["top"][f"Dense_{i}"] for i in range(len(p["top"]))]
  for i, layer in enumerate(top):
    key = "over_arch.model.1" if i == len(top) - 1 else f"over_arch.model.0._mlp.{i}._linear"
    dest[f"{key}.weight"] = np.asarray(layer["kernel"]).T
    dest[f"{key}.bias"] = layer["bias"]
  if set(dest) != set(sd):
    raise AssertionError(f"weights not copied: {set(sd) ^ set(dest)}")
  with torch.no_grad():
    for k, v in dest.items():
      v = torch.from_numpy(np.array(v, np.float32))  # a writable copy (jax's are read-only)
      if sd[k].shape != v.shape:
        raise AssertionError(f"{k}: TorchRec {tuple(sd[k].shape)}, recgnn {tuple(v.shape)}")
      sd[k].copy_(v)


def check(rec, cfg: DcnConfig, batches: Sequence[MultiHotBatch], seed: int = 0) -> dict:
  """recgnn's DCNv2 step against TorchRec's DLRM_DCN on identical weights.

  `rec`: dlrm_throughput.Recgnn over `batches` (its task's model is recgnn's DCN; its
  `train_step` is the timed step's function, unpacked inputs). Returns the parameter counts,
  max |logit difference| on batch 1 before and after one train step of each on batch 0 (the
  step checks backward, pooling's transpose and both SGDs) and max |table difference| after
  it, each beside the size of what it compares (the logits' scale, the step's changes).
  """
  import jax
  import torch

  from recgnn.train import step as step_lib

  names = rec.task.names
  plan = rec.plan
  state = rec.init_state()

  def tables(state):
    exported = {k: g.export(state.emb[k]) for k, g in plan.groups.items()}
    return [
      np.asarray(exported[plan.table_group[n]][n]["rows"])[:r] for n, r in zip(names, cfg.rows)
    ]

  def recgnn_logits(state, i):
    prepared, batch = rec.inputs[i]
    pooled, _ = step_lib.lookup_all(plan, state.emb, prepared)
    logits = rec.task.model.apply(state.params, batch["dense"], {n: pooled[n] for n in names})
    return np.asarray(logits)

  model, to_inputs, step = build("torchrec", cfg, seed)
  initial = tables(state)
  copy_recgnn_weights(model, jax.device_get(state.params), initial)
  inputs = [to_inputs(b) for b in batches[:2]]

  def torchrec_logits(i):
    with torch.no_grad():
      return model(inputs[i][0], inputs[i][1]).squeeze(1).numpy()

  out = {
    "params_recgnn": int(
      sum(np.size(x) for x in jax.tree.leaves(state.params))
      + sum(s.num_rows * s.dim for s in plan.specs.values())
    ),
    "params_torchrec": int(sum(p.numel() for p in model.parameters())),
  }
  before = recgnn_logits(state, 1)
  out["logit_scale"] = float(np.max(np.abs(before)))
  out["max_abs_diff_init"] = float(np.max(np.abs(before - torchrec_logits(1))))
  state = rec.train_step(state, *rec.inputs[0])[0]
  step(inputs[0])
  after = recgnn_logits(state, 1)
  out["max_abs_diff_after_step"] = float(np.max(np.abs(after - torchrec_logits(1))))
  out["logit_change_by_step"] = float(np.max(np.abs(after - before)))
  with torch.no_grad():
    sd = model.state_dict()
    theirs = [
      sd[f"sparse_arch.embedding_bag_collection.embedding_bags.t{t}.weight"].numpy()
      for t in range(cfg.num_tables)
    ]
  ours = tables(state)
  out["table_max_abs_diff_after_step"] = float(
    max(np.max(np.abs(a - b)) for a, b in zip(ours, theirs))
  )
  out["table_change_by_step"] = float(max(np.max(np.abs(a - b)) for a, b in zip(ours, initial)))
  return out


def check_ok(result: dict, tol: float = 1e-4) -> bool:
  """Same parameter count, logits within tol of their scale (at least 1), and the step's
  changes within 100 tol of their size (they are small differences of close numbers)."""
  scale = max(result["logit_scale"], 1.0)
  return (
    result["params_recgnn"] == result["params_torchrec"]
    and max(result["max_abs_diff_init"], result["max_abs_diff_after_step"]) <= tol * scale
    and result["max_abs_diff_after_step"] <= 100 * tol * result["logit_change_by_step"]
    and result["table_max_abs_diff_after_step"] <= 100 * tol * result["table_change_by_step"]
  )


def check_at(cfg: DcnConfig, batch: int, zipf: float, seed: int, make_recgnn) -> dict | None:
  """`check` on two fresh batches, with "ok" (check_ok) added and the verdict printed; None
  (and why, printed) where TorchRec does not import. `make_recgnn(cfg, batches, seed=)`:
  dlrm_throughput.Recgnn."""
  why = available()["torchrec"]
  if why is not None:
    print(f"check: TorchRec not available ({why})", flush=True)
    return None
  batches = make_batches(cfg, batch, 2, zipf, seed)
  out = check(make_recgnn(cfg, batches, seed=seed), cfg, batches, seed)
  out["ok"] = check_ok(out)
  print("\n".join(check_lines(out)), flush=True)
  return out


def check_lines(result: dict | None) -> list[str]:
  """`check_at`'s result as a markdown bullet ([] for None)."""
  if not result:
    return []
  return [
    f"- same model: {'yes' if result['ok'] else '**NO**'} (recgnn's initial weights copied into "
    f"TorchRec's DLRM_DCN): parameters {result['params_recgnn']:,} (recgnn) vs "
    f"{result['params_torchrec']:,} (TorchRec); max |logit difference| "
    f"{result['max_abs_diff_init']:.1e} at init and {result['max_abs_diff_after_step']:.1e} "
    f"after one SGD step of each (which moved the logits by up to "
    f"{result['logit_change_by_step']:.1e}); max |table difference| after it "
    f"{result['table_max_abs_diff_after_step']:.1e} (the step moved table entries by up to "
    f"{result['table_change_by_step']:.1e})"
  ]
