"""`tt`: the table as tensor-train cores (TT-Rec, Yin et al., MLSys'21).

An N x D table is stored as K cores G_k of shape [n_k, r_{k-1}, d_k, r_k] with
prod(n_k) >= N, prod(d_k) = D and r_0 = r_K = 1. Row i, written in mixed radix as
(i_1, ..., i_K) (i_K fastest), is the product of one slice per core:

  row(i) = reshape(G_1[i_1] @ G_2[i_2] @ ... @ G_K[i_K], [D])   (contracting the rank axes)

A 10M x 16 table at rank 32 is ~0.5M floats instead of 160M. The cores are small dense
params owned by this backend (not optax): `update` takes the vjp of the lookup w.r.t. the
core slices the batch touched and applies the table's optimizer to those slices only.

Optimizer semantics on cores (one "row" = one core slice G_k[i], a [r_{k-1}, d_k, r_k] block):
  sgd              G_k[i] -= lr * dL/dG_k[i]  (the exact gradient of the loss w.r.t. the core)
  rowwise_adagrad  one accumulator per core slice: acc_k[i] += mean(g_k[i]**2);
                   G_k[i] -= lr * g_k[i] / (sqrt(acc_k[i]) + eps), g_k[i] summed over the batch
Slices a batch does not touch have a zero gradient, so the sparse update equals the dense
optimizer step on the whole core.

Kernels (`kernel=`), all computing the same rows (benchmarks/tt.py measures them):
  naive   per bag slot: gather one slice per core on the device, contract; the vjp is taken
          w.r.t. the whole cores (a core-sized dense gradient each step). The reference.
  unique  host dedups the batch's rows; one chain of slice products per distinct row; the
          update touches only the distinct slices of each core.
  prefix  TT-Rec's kernel: rows sharing an index prefix (i_1..i_k) share the partial product
          G_1[i_1] @ ... @ G_k[i_k]. The host builds the prefix tree of the batch's distinct
          rows (`prepare`); the device computes each distinct prefix once, level by level
          (the level products below). The default: the fastest measured
          (benchmarks/results/tt_kernels.md, tt_contract.md).

Level products (`contract=`, for unique and prefix): level k multiplies each prefix's
partial product [a, r] by its slice of core k [r, d_k * r_k]. `batched`: one batched matmul
over the P_k prefixes (P_k tiny matmuls; on XLA:CPU its transpose, a contraction over
a <= 4, is slow). `pairs`: one plain matmul of the P_{k-1} distinct parents by the S_k
distinct slices ([P_{k-1} a, r] @ [r, S_k d_k r_k]), then a gather of the P_k pairs used:
P_{k-1} S_k / P_k times the arithmetic, but as one GEMM (and its vjp two GEMMs and a
scatter). `auto` (default) picks per level from the static capacities with the cost model
of `level_product` (constants per platform, fitted to `benchmarks/tt.py --sections=levels`,
which times both on single levels: XLA:CPU's in `CPU_COSTS`, an accelerator's by gpu_check's
calibrate stage into tt_cost.json; `--sections=kernels --contracts=batched,pairs,auto`
compares them on one table); pairs only while its [P_{k-1} a, S_k d_k r_k] product stays
under the model's `pairs_max_floats`. Both are exact: rows and gradients agree up to float
summation order (tests/test_tt.py).

Cache (`cache_rows=C`, TT-Rec's cache of hot uncompressed rows): the host counts accesses over
the first `cache_warmup` batches, then fixes the C most frequent rows as the hot set (LFU over
the warm-up, as TT-Rec). Hot rows are served and trained as plain rows of a float32[C, D] cache
(with their own row-wise optimizer state); the cores no longer see them. The cache is filled
from the TT reconstruction of the current cores by the first update that sees the hot set, so
the logical table is continuous. `table(state)` is the TT reconstruction overridden by the
cache; `sync` has nothing to write back (the cache is part of the state).

Shapes are static per bucket: `prepare` pads the distinct-row, prefix and slice counts to
grow-only capacities (1.25x the largest count of the first batch and the `lookahead` batches
after it, rounded to 4 sizes per octave; grown only when a count does not fit), so a jitted
step retraces only the rare times a capacity grows (and once when the cache's hot set is
fixed). `pad=full` pads to the batch size instead: one shape, no retrace,
more padded work (benchmarks/tt.py measures both).

Files: options.py (`TTOptions`), shape.py (factorization, initial cores, reconstruction),
cost.py (contract=auto's cost model), kernels.py (a level's product, capacity rounding); this
file holds one concern, the
`TT` backend class (its host-side planning of prefix trees and cache, its device code).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from recgnn import sharding
from recgnn.backends.tt.cost import (  # noqa: F401  (the package's public names)
  _COST_FILE,
  CPU_COSTS,
  CostModel,
  _read_cost_file,
  cost_model,
  fit_cost_model,
  level_product,
)
from recgnn.backends.tt.kernels import HEADROOM, _round_up, level  # noqa: F401
from recgnn.backends.tt.options import CONTRACTS, KERNELS, PADS, TTOptions  # noqa: F401
from recgnn.backends.tt.shape import (  # noqa: F401
  INITS,
  TTShape,
  balanced_dim_factors,
  balanced_row_factors,
  core_std,
  init_cores,
  load_init_table,
  reconstruct,
  target_variance,
  tt_shape,
  tt_svd,
)
from recgnn.embeddings import access_counts as profile
from recgnn.embeddings import base

# ----------------------------------------------------------------------------- backend


@base.register_backend("tt")
class TT(base.TableBackend):
  """Tensor-train table. See the module docstring; options: `TTOptions`."""

  Options = TTOptions
  # Its prepare plans prefix trees and the cache over the whole batch.
  capabilities = base.Capabilities(plans_globally=True)
  batch_major = ("ids", "inverse", "cache_slot", "cache_inverse")

  def __init__(self, spec: base.TableSpec, mesh, layout: base.Layout | None = None, **options):
    super().__init__(spec, mesh, layout, **options)
    o = self.options
    target_variance(spec)  # fail at plan time for a zeros initializer
    cores = 3 if o.cores is None else o.cores
    self.shape = tt_shape(spec.num_rows, spec.dim, o.rank, cores, o.row_factors, o.dim_factors)
    self.cache_rows = min(o.cache_rows, spec.num_rows)
    self.cache_warmup = o.warmup
    self.lookahead = (16 if o.lookahead is None else o.lookahead) if o.pad == "grow" else 0
    self._caps: dict[str, int] = {}
    # Access counts of the warm-up (the shared profiler; sparse: only the rows seen).
    self._warm = profile.AccessProfile(spec.num_rows, sparse=True)
    self._hot: np.ndarray | None = None  # sorted hot row ids, fixed after the warm-up

  def describe(self) -> str:
    opts = [f"rank={self.options.rank}"]
    if self.shape.num_cores != 3:
      opts.append(f"cores={self.shape.num_cores}")
    if self.options.init != "sampled_gaussian":
      opts.append(f"init={self.options.init}")
    if self.options.init_path:
      opts.append(f"init_path={self.options.init_path}")
    if self.options.kernel != "prefix":
      opts.append(f"kernel={self.options.kernel}")
    if self.options.contract != "auto":
      opts.append(f"contract={self.options.contract}")
    if self.options.row_factors is not None or self.options.dim_factors is not None:
      opts.append(f"row_factors={self.shape.row_factors}")
      opts.append(f"dim_factors={self.shape.dim_factors}")
    if self.cache_rows:
      opts.append(f"cache_rows={self.cache_rows}")
      if self.cache_warmup != 50:
        opts.append(f"cache_warmup={self.cache_warmup}")
    if self.options.pad != "grow":
      opts.append(f"pad={self.options.pad}")
    elif self.lookahead != 16:
      opts.append(f"lookahead={self.lookahead}")
    return f"tt({', '.join(opts)})"

  # --------------------------------------------------------------------------- state

  def state_sharding(self):
    """The cores are small: replicated on every device of the mesh (and the cache with them,
    so a batch-split lookup reads its rows locally)."""
    shapes = jax.eval_shape(self._init_shapes)
    return jax.tree.map(lambda _: self.replicated(), shapes)

  def _init_shapes(self):
    spec, opt = self.spec, self.spec.optimizer
    state = {"cores": [jnp.zeros(s, jnp.float32) for s in self.shape.core_shapes()]}
    if opt.needs_unique:
      state["accum"] = [jnp.zeros((s[0],), jnp.float32) for s in self.shape.core_shapes()]
    if self.cache_rows:
      c = self.cache_rows
      state["cache"] = jnp.zeros((c, spec.dim), jnp.float32)
      state["cache_ids"] = jnp.zeros((c,), jnp.int32)
      state.update({f"cache_{s}": jnp.zeros((c,), jnp.float32) for s in opt.slot_names()})
    return state

  def init(self, key):
    spec, opt = self.spec, self.spec.optimizer
    target = load_init_table(self.options.init_path, spec) if self.options.init_path else None
    cores = init_cores(key, self.shape, target_variance(spec), self.options.init, target)
    state = {"cores": cores}
    if opt.needs_unique:
      state["accum"] = [opt.init_slots(s[0])["accum"] for s in self.shape.core_shapes()]
    if self.cache_rows:
      c = self.cache_rows
      state["cache"] = jnp.zeros((c, spec.dim), jnp.float32)
      # num_rows marks an empty slot; the first update that sees the hot set fills the cache.
      state["cache_ids"] = jnp.full((c,), spec.num_rows, jnp.int32)
      state.update({f"cache_{s}": v for s, v in opt.init_slots(c).items()})
    return state

  def num_params(self) -> int:
    """Floats of the cores (what TT-Rec's compression ratio counts)."""
    return self.shape.num_params

  def memory(self):
    slots = len(self.spec.optimizer.slot_names())
    b = 4 * self.shape.num_params + 4 * slots * sum(self.shape.row_factors)
    b += self.cache_rows * (4 * self.spec.dim + 4 * slots + 4)
    where = "device" + (f" + {self.cache_rows}-row cache" if self.cache_rows else "")
    return base.MemoryReport(b, 0, where)

  def table(self, state):
    rows = np.array(reconstruct(state["cores"], self.spec.num_rows))
    if self.cache_rows:
      ids = np.asarray(state["cache_ids"])
      ok = ids < self.spec.num_rows
      rows[ids[ok]] = np.asarray(state["cache"])[ok]
    return rows

  @property
  def logical_format(self) -> str:
    """Checkpoints hold the cores themselves (rows -> TT would be a lossy re-compression):
    a TT table restores only into a TT table of the same shape and cache."""
    return f"tt[{self.shape.describe()}; cache_rows={self.cache_rows}]"

  def export(self, state):
    return state

  def logical_target(self):
    shapes = jax.eval_shape(self._init_shapes)
    return jax.tree.map(
      lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
      shapes,
      self.state_sharding(),
    )

  def import_(self, logical):
    return self.restore(sharding.put(logical, self.state_sharding()))

  def restore(self, state):
    # The hot set lives in the state; a checkpoint taken during the warm-up restarts it.
    self._caps, self._hot = {}, None
    self._warm = profile.AccessProfile(self.spec.num_rows, sparse=True)
    if self.cache_rows:
      ids = np.asarray(state["cache_ids"])
      if (ids < self.spec.num_rows).any():
        self._hot = np.sort(ids[ids < self.spec.num_rows])
    return state

  def stats(self):
    return {f"cap_{k}": float(v) for k, v in self._caps.items()}

  # --------------------------------------------------------------------------- host

  def _cap(self, name: str, n: int, limit: int) -> int:
    """Static size of a padded array holding n entries (grow-only; see module docstring)."""
    if self.options.pad == "full":
      return limit
    # Keyed by the batch shape too: eval batches (often larger) must not pad train batches.
    key = f"{name}@{self._batch_size}"
    cap = self._caps.get(key, 0)
    if n > cap or cap == 0:
      # Grow only when the count does not fit: growing whenever HEADROOM * n passed the
      # capacity recompiled for batches that fit (3 recompiles in ttrec_kaggle's first 40
      # steps, 30-45 s each under load).
      cap = max(cap, min(_round_up(n), limit))
      self._caps[key] = cap
    return cap

  def _cache_plan(self, ids: np.ndarray, count: bool) -> tuple[dict, np.ndarray]:
    """Cache slots of this batch and the ids left for the cores (hits -> PAD).

    count: whether the batch counts toward the warm-up (train batches; eval batches only
    read the table, so they neither decide the hot set nor end the warm-up).
    """
    n, c = self.spec.num_rows, self.cache_rows
    out = {}
    if self._hot is None and count:
      self._warm.add(ids)
      if self._warm.batches >= self.cache_warmup:
        # LFU over the warm-up; ties go to the smaller id.
        self._hot = self._warm.top(c)
        self._warm = profile.AccessProfile(n, sparse=True)
        # The cores now see fewer distinct rows: let the capacities shrink (one recompile).
        self._caps = {}
    hot_ids = np.full(c, n, np.int32)
    slot = np.full(ids.shape, c, np.int32)
    if self._hot is not None and self._hot.size:
      hot_ids[: self._hot.size] = self._hot
      pos = np.searchsorted(self._hot, ids)
      pos = np.minimum(pos, self._hot.size - 1)
      hit = (ids >= 0) & (self._hot[pos] == ids)
      slot = np.where(hit, pos, c).astype(np.int32)
      ids = np.where(hit, base.PAD, ids)
    out["cache_ids"] = hot_ids
    out["cache_slot"] = slot
    if self.spec.optimizer.needs_unique:
      out["cache_unique"], out["cache_inverse"] = base.dedup(np.where(slot < c, slot, -1), c)
    return out, ids

  def _presize(self, upcoming, total: int) -> None:
    """pad=grow: the first batch of a shape (and the first after the hot set is fixed) sizes
    the capacities from the largest counts of the next `lookahead` batches too, so they
    rarely grow later: each growth recompiles the trainer's whole step (30-45 s under load
    here; ttrec_kaggle: none in 300 steps, three in its first 40 before)."""
    if (
      self.options.pad != "grow" or self.options.kernel == "naive" or f"rows@{total}" in self._caps
    ):
      return
    if self.cache_rows and self._hot is None:
      return  # warm-up: the capacities are reset when the hot set is fixed
    for u in list(upcoming)[: self.lookahead]:
      u = np.asarray(u).astype(np.int64)
      if u.size != total:
        continue
      if self._hot is not None and self._hot.size:
        pos = np.minimum(np.searchsorted(self._hot, u), self._hot.size - 1)
        u = np.where((u >= 0) & (self._hot[pos] == u), base.PAD, u)
      self._tree(np.unique(u[u >= 0]), total)

  def _tree(self, rows: np.ndarray, total: int) -> tuple[int, list]:
    """The prefix tree of the sorted distinct rows: (rows' capacity, per level k: distinct
    prefixes (i_1..i_k) as keys, the slices they use, each key's slice, p_cap, s_cap);
    capacities grown to fit."""
    shape = self.shape
    u_cap = self._cap("rows", rows.size, total)
    levels = []
    for k in range(shape.num_cores):
      keys = rows // shape.strides[k]  # sorted, as rows are: no np.unique (a sort) needed
      last = k == shape.num_cores - 1
      if self.options.kernel == "prefix" and not last and keys.size:
        keys = keys[np.concatenate([[True], keys[1:] != keys[:-1]])]
      n_k = shape.row_factors[k]
      digit = keys % n_k
      used = np.zeros(n_k, bool)  # the slices used, in order, and each key's rank among them
      used[digit] = True
      slices = np.flatnonzero(used)
      slice_idx = (np.cumsum(used) - 1)[digit]
      limit = min(total, math.prod(shape.row_factors[: k + 1]))
      p_cap = (
        u_cap if (last or self.options.kernel == "unique") else self._cap(f"p{k}", keys.size, limit)
      )
      s_cap = self._cap(f"s{k}", slices.size, min(total, n_k))
      levels.append((keys, slices, slice_idx, p_cap, s_cap))
    return u_cap, levels

  def prepare(self, ids, upcoming=(), *, train=True):
    ids = np.asarray(ids).astype(np.int64)
    n_rows = self.spec.num_rows
    out = {}
    if self.cache_rows:
      cache, ids = self._cache_plan(ids, count=train)
      out.update(cache)
    out["ids"] = np.where(ids < 0, n_rows, ids).astype(np.int32)
    if self.options.kernel == "naive":
      return out
    shape, total = self.shape, ids.size
    self._batch_size = total
    if train:
      self._presize(upcoming, total)
    valid = ids.reshape(-1) >= 0
    rows, inverse = np.unique(ids.reshape(-1)[valid], return_inverse=True)
    u_cap, levels = self._tree(rows, total)
    inv = np.full(total, u_cap, np.int32)
    inv[valid] = inverse
    out["inverse"] = inv.reshape(ids.shape)
    # The prefix tree: level k holds the distinct prefixes (i_1..i_k) of the batch's rows
    # ('unique': every row its own chain), each with its parent at level k-1 and its slice.
    prev_keys = None
    for k, (keys, slices, slice_idx, p_cap, s_cap) in enumerate(levels):
      n_k = shape.row_factors[k]
      sl = np.full(s_cap, n_k, np.int32)  # n_k: gathers fill 0, scatters drop
      sl[: slices.size] = slices
      si = np.full(p_cap, s_cap, np.int32)  # s_cap: a zero slice, so padded prefixes are 0
      si[: keys.size] = slice_idx
      out[f"slices{k}"], out[f"slice_of{k}"] = sl, si
      if k > 0:
        parent = np.zeros(p_cap, np.int32)
        if self.options.kernel == "prefix":
          parent[: keys.size] = np.searchsorted(prev_keys, keys // n_k)
        else:
          parent[: keys.size] = np.arange(keys.size)
        out[f"parent{k}"] = parent
      prev_keys = keys
    return out

  # --------------------------------------------------------------------------- device

  def _tree_rows(self, slices: Sequence[jax.Array], prepared) -> jax.Array:
    """Distinct rows float32[U, D] from the gathered slices of each core (prefix tree)."""
    k_cores = self.shape.num_cores
    pre = None
    for k in range(k_cores):
      if k == 0:
        s = slices[0].at[prepared["slice_of0"]].get(mode="fill", fill_value=0.0)
        pre = s[:, 0]  # [P_0, d_1, r_1]
        continue
      out = level(
        pre, slices[k], prepared[f"parent{k}"], prepared[f"slice_of{k}"], self.options.contract
      )
      p, a, d, r1 = out.shape
      pre = out.reshape(p, a * d, r1)
    return pre.reshape(pre.shape[0], self.spec.dim)

  def _gather_slices(self, state, prepared) -> list[jax.Array]:
    return [
      g.at[prepared[f"slices{k}"]].get(mode="fill", fill_value=0.0)
      for k, g in enumerate(state["cores"])
    ]

  def _naive_rows(self, cores: Sequence[jax.Array], ids: jax.Array) -> jax.Array:
    """Rows float32[..., D] of ids (N = padding -> 0), one slice per core per id."""
    shape = self.shape
    flat = ids.reshape(-1)
    pre = None
    for k, g in enumerate(cores):
      digit = (flat // shape.strides[k]) % shape.row_factors[k]
      s = g[digit]  # [M, r, d, s]
      if k == 0:
        pre = s[:, 0]
        continue
      m, a, r = pre.shape
      pre = jnp.matmul(pre, s.reshape(m, r, -1)).reshape(m, a * s.shape[2], s.shape[3])
    rows = pre.reshape(flat.shape[0], self.spec.dim)
    rows = jnp.where((flat < self.spec.num_rows)[:, None], rows, 0.0)
    return rows.reshape(ids.shape + (self.spec.dim,))

  def _tt_lookup(self, state, prepared) -> jax.Array:
    """The cores' part of the lookup: float32[B, L, D], 0 at padding and cache hits."""
    if self.options.kernel == "naive":
      return self._naive_rows(state["cores"], prepared["ids"])
    rows = self._tree_rows(self._gather_slices(state, prepared), prepared)
    return rows.at[prepared["inverse"]].get(mode="fill", fill_value=0.0)

  def _cache_filled(self, state, prepared) -> jax.Array:
    return jnp.all(state["cache_ids"] == prepared["cache_ids"])

  def lookup(self, state, prepared):
    return self._overlay_cache(state, prepared, self._tt_lookup(state, prepared))

  def lookup_pooled(self, state, prepared, count):
    """-> (f32[B, D] pooled, residuals). Residuals (prefix kernels): the gathered core slices
    and the pullback of the prefix tree's products (`jax.vjp`'s linearization, a pytree of
    the level products), so `update` runs only the backward pass, never the prefix products
    again. The naive kernel keeps nothing (`()`)."""
    if self.options.kernel == "naive":
      return super().lookup_pooled(state, prepared, count)
    slices = self._gather_slices(state, prepared)
    rows, pull = jax.vjp(lambda s: self._tree_rows(s, prepared), slices)
    out = rows.at[prepared["inverse"]].get(mode="fill", fill_value=0.0)
    out = self._overlay_cache(state, prepared, out)
    return base.pool_rows(out, count), {"slices": slices, "pull": pull}

  def update_pooled(self, state, prepared, residuals, g, count):
    if self.options.kernel == "naive":
      return super().update_pooled(state, prepared, residuals, g, count)
    g, prepared, count = sharding.replicate((g, prepared, count), self.mesh)
    grads = base.unpool(g, count, prepared["ids"].shape[1])
    return self.update(state, prepared, grads, residuals)

  def _overlay_cache(self, state, prepared, out):
    """The cores' rows `out` f32[B, L, D] with the cache's rows where the batch hits it."""
    if not self.cache_rows:
      return out
    slot = prepared["cache_slot"]
    hit = slot < self.cache_rows
    # Until an update has filled the cache for this hot set (the first batch after the
    # warm-up, or a batch looked up but never updated, e.g. eval), hot rows come from the
    # cores, which is what the fill will copy: the logical table stays continuous.
    cached = jax.lax.cond(
      self._cache_filled(state, prepared),
      lambda: state["cache"].at[slot].get(mode="fill", fill_value=0.0),
      lambda: self._naive_rows(
        state["cores"],
        jnp.where(
          hit,
          jnp.asarray(prepared["cache_ids"]).at[slot].get(mode="fill", fill_value=0),
          self.spec.num_rows,
        ),
      ),
    )
    return jnp.where(hit[..., None], cached, out)

  def core_grads(self, state, prepared, grads) -> list[jax.Array]:
    """d loss / d cores (dense, core-shaped) given grads float32[B, L, D] of the lookup.

    Only the cores' part: cache hits contribute nothing. For tests; `update` stays sparse.
    """
    if self.options.kernel == "naive":
      _, vjp = jax.vjp(lambda c: self._naive_rows(c, prepared["ids"]), list(state["cores"]))
      return vjp(grads)[0]
    slices = self._gather_slices(state, prepared)
    _, vjp = jax.vjp(lambda s: self._tt_rows_from(s, prepared), slices)
    g = vjp(grads)[0]
    return [
      jnp.zeros_like(c).at[prepared[f"slices{k}"]].add(g[k], mode="drop")
      for k, c in enumerate(state["cores"])
    ]

  def _tt_rows_from(self, slices, prepared):
    rows = self._tree_rows(slices, prepared)
    return rows.at[prepared["inverse"]].get(mode="fill", fill_value=0.0)

  def update(self, state, prepared, grads, residuals=None):
    """grads f32[B, L, D]. residuals: `lookup_pooled`'s (prefix kernels), else the forward
    pass is run again here for its pullback."""
    opt = self.spec.optimizer
    state = dict(state)
    if self.cache_rows:
      # Fill before anything trains: the rows this batch looked up were the cores' rows.
      state = jax.lax.cond(
        self._cache_filled(state, prepared),
        lambda s: s,
        lambda s: self._fill(s, prepared),
        state,
      )
      slots = {k: state[f"cache_{k}"] for k in opt.slot_names()}
      cprep = {"ids": prepared["cache_slot"]}
      if opt.needs_unique:
        cprep["unique"], cprep["inverse"] = prepared["cache_unique"], prepared["cache_inverse"]
      hit = (prepared["cache_slot"] < self.cache_rows)[..., None]
      cache, slots = base.sparse_sgd_or_adagrad(
        self.spec, state["cache"], slots, cprep, jnp.where(hit, grads, 0.0)
      )
      state["cache"] = cache
      state.update({f"cache_{k}": v for k, v in slots.items()})
      grads = jnp.where(hit, 0.0, grads)
    if self.options.kernel == "naive":
      g = self.core_grads(state, prepared, grads)
      cores, accum = [], []
      for k, c in enumerate(state["cores"]):
        flat = c.reshape(c.shape[0], -1)
        acc = {"accum": state["accum"][k]} if opt.needs_unique else {}
        new, acc = opt.apply(flat, acc, g[k].reshape(flat.shape))
        cores.append(new.reshape(c.shape))
        accum.extend(acc.values())
    else:
      if residuals:
        slices = residuals["slices"]
        # The transpose of the lookup's gather of distinct rows: sum the grads per row.
        u = prepared[f"slice_of{self.shape.num_cores - 1}"].shape[0]
        g_rows = jnp.zeros((u, self.spec.dim), grads.dtype)
        g = residuals["pull"](g_rows.at[prepared["inverse"]].add(grads, mode="drop"))[0]
      else:
        slices = self._gather_slices(state, prepared)
        _, vjp = jax.vjp(lambda s: self._tt_rows_from(s, prepared), slices)
        g = vjp(grads)[0]  # summed per distinct slice: the gather's transpose adds repeats
      cores, accum = [], []
      for k, c in enumerate(state["cores"]):
        idx = prepared[f"slices{k}"]
        flat, gk = slices[k].reshape(idx.shape[0], -1), g[k].reshape(idx.shape[0], -1)
        acc = {}
        if opt.needs_unique:
          acc = {"accum": state["accum"][k].at[idx].get(mode="fill", fill_value=0.0)}
        new, acc = opt.apply(flat, acc, gk)
        cores.append(c.at[idx].set(new.reshape(slices[k].shape), mode="drop"))
        if opt.needs_unique:
          accum.append(state["accum"][k].at[idx].set(acc["accum"], mode="drop"))
    state["cores"] = cores
    if opt.needs_unique:
      state["accum"] = accum
    return state

  def _fill(self, state, prepared):
    ids = prepared["cache_ids"]
    state = dict(state)
    state["cache"] = self._naive_rows(state["cores"], ids)
    state["cache_ids"] = ids
    for k, v in self.spec.optimizer.init_slots(self.cache_rows).items():
      state[f"cache_{k}"] = v
    return state
