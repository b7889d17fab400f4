"""The `tt` backend's front: the contract's methods (per table, grouped by `TableGroup`), each
handed to the part that owns its phase (the package docstring says what flows where).

  TTShape       shape.py      the frozen layout: factorization, ranks, core shapes
  TTOptions     options.py    the plan string's options
  Preparer      prepare.py    ids -> prepared (input thread): cache plan, prefix trees
  DeviceStep    device.py     lookup / update over the cores and the cache
  StateKeeper   state.py      init, shardings, memory, table, checkpoints
"""

from __future__ import annotations

from recgnn import sharding
from recgnn.backends.tt.device import DeviceStep
from recgnn.backends.tt.options import TTOptions
from recgnn.backends.tt.prepare import Preparer
from recgnn.backends.tt.shape import target_variance, tt_shape
from recgnn.backends.tt.state import StateKeeper
from recgnn.embeddings import base


@base.register_backend("tt")
class TT(base.TableBackend):
  """Tensor-train table. See the package docstring; options: `TTOptions`."""

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
    c = self.cache_rows
    self._prep = Preparer(spec, self.shape, o, c, self.cache_warmup, self.lookahead)
    self._device = DeviceStep(spec, self.shape, o, c)
    self._state = StateKeeper(spec, self.shape, o, c, self.replicated())

  def describe(self) -> str:
    o = self.options
    opts = [f"rank={o.rank}"]
    if self.shape.num_cores != 3:
      opts.append(f"cores={self.shape.num_cores}")
    if o.init != "sampled_gaussian":
      opts.append(f"init={o.init}")
    if o.init_path:
      opts.append(f"init_path={o.init_path}")
    if o.kernel != "prefix":
      opts.append(f"kernel={o.kernel}")
    if o.contract != "auto":
      opts.append(f"contract={o.contract}")
    if o.row_factors is not None or o.dim_factors is not None:
      opts.append(f"row_factors={self.shape.row_factors}")
      opts.append(f"dim_factors={self.shape.dim_factors}")
    if self.cache_rows:
      opts.append(f"cache_rows={self.cache_rows}")
      if self.cache_warmup != 50:
        opts.append(f"cache_warmup={self.cache_warmup}")
    if o.pad != "grow":
      opts.append(f"pad={o.pad}")
    elif self.lookahead != 16:
      opts.append(f"lookahead={self.lookahead}")
    return f"tt({', '.join(opts)})"

  # ------------------------------------------------------------------ state
  def state_sharding(self):
    return self._state.state_sharding()

  def init(self, key):
    return self._state.init(key)

  def num_params(self) -> int:
    """Floats of the cores (what TT-Rec's compression ratio counts)."""
    return self.shape.num_params

  def memory(self):
    return self._state.memory()

  def table(self, state):
    return self._state.table(state)

  @property
  def logical_format(self) -> str:
    """Checkpoints hold the cores themselves (rows -> TT would be a lossy re-compression):
    a TT table restores only into a TT table of the same shape and cache."""
    return f"tt[{self.shape.describe()}; cache_rows={self.cache_rows}]"

  def export(self, state):
    return state

  def logical_target(self):
    return self._state.logical_target()

  def import_(self, logical):
    return self.restore(sharding.put(logical, self.state_sharding()))

  def restore(self, state):
    # The hot set lives in the state; a checkpoint taken during the warm-up restarts it.
    self._prep.restart(self._state.hot_set(state))
    return state

  # ------------------------------------------------------------------ host side
  def prepare(self, ids, upcoming=(), *, train=True):
    return self._prep.prepare(ids, upcoming, train)

  def stats(self):
    return self._prep.stats()

  # ------------------------------------------------------------------ the step
  def lookup(self, state, prepared):
    return self._device.lookup(state, prepared)

  def lookup_pooled(self, state, prepared, count):
    """-> (f32[B, D] pooled, residuals). Residuals (prefix kernels): the gathered core slices
    and the pullback of the prefix tree's products (`DeviceStep.lookup_tree`), so `update`
    runs only the backward pass, never the prefix products again. The naive kernel keeps
    nothing (`()`)."""
    if self.options.kernel == "naive":
      return super().lookup_pooled(state, prepared, count)
    rows, residuals = self._device.lookup_tree(state, prepared)
    return base.pool_rows(rows, count), residuals

  def update_pooled(self, state, prepared, residuals, g, count):
    if self.options.kernel == "naive":
      return super().update_pooled(state, prepared, residuals, g, count)
    g, prepared, count = sharding.replicate((g, prepared, count), self.mesh)
    grads = base.unpool(g, count, prepared["ids"].shape[1])
    return self._device.update(state, prepared, grads, residuals)

  def update(self, state, prepared, grads, residuals=None):
    return self._device.update(state, prepared, grads, residuals)

  def core_grads(self, state, prepared, grads):
    """d loss / d cores, dense (tests: `DeviceStep.core_grads`)."""
    return self._device.core_grads(state, prepared, grads)
