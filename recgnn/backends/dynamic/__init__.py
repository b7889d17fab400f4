"""`dynamic(capacity=..., inner=..., admit=..., evict=...)`: tables of raw 64-bit ids (no
dictionary pass, no modulo) in front of any backend. Each table's ids are mapped to rows of a
fixed-capacity table held by the inner backend, as ordinary rows: a row is created when its id
is admitted and reused when another id is, with its state reset.

    plan = [("C(3|4)", "dynamic(capacity=1_000_000, admit=count, k=2, evict=lfu)"),
            ("C1", "dynamic(capacity=100_000, inner='offload(cache_fraction=0.1)', evict=none)")]

Why a wrapper backend, the map on the host (docs/dynamic_tables.md has the figures): the map
is sequential by nature (admission and eviction decide in stream order, each id after the one
before), which a compiled host loop does in tens of ns per id while the step runs; it sits
where offload's cache planner sits (the input thread, in stream order) and gives the inner
backend ordinary rows, so every backend (dense, offload, hot_cold, sharded, tt) takes it
without a change to its step. The price: a host map needs the raw ids on the host (under the
device feed this group's ids are still read and prepared there: `prepares_on_device` is
off), and it plans over the whole batch (`plans_globally`: every process maps the global
batch, so all make the same decisions).

Host side (prepare, input thread, in stream order): per table, `IdMap.map_at` turns ids
int[B, L] into rows int32[B, L] (-1 for padding and for ids not admitted: they read a zero row
and are not trained), the rows reused by this batch (`resets`) and where the batch first
reads each; the inner backend prepares the rows, then places the resets in that prepared
batch (`place_resets`: dense keeps rows as slots; a host tier names the device slot that
holds the row in this step, or puts the reset into the row the step loads from the host).
prepared = {"inner": the inner backend's prepared, "reset": {table: {"slots": int32[R],
"rows": f32[R, D]}}}.

Step: `lookup` and `update` first apply the resets to the state (`reset_rows`, the inner
backend's `Capabilities.resets_rows`: the slots set to fresh initial values, their optimizer
state to its initial value; O(R * D), the same pure function in both, so the update starts
from the state the lookup read; dense, sharded, offload, hot_cold have it). Evictions need
it, unless reset=none: a reused row then keeps what the evicted id left in it (R = 0: nothing
to apply), which any inner backend takes and is the only choice for tt, whose rows share
their cores' slices (one row cannot be reset alone). With evict=none no row is reused and
any backend works.

State = {"inner": the inner backend's state, "steps": int32[] train updates applied}: the
step count tells a checkpoint which maps to save (`history.History`: the input thread runs
ahead of the step). The checkpoint's logical form is the inner backend's, each table's dict
with the map's arrays beside ("map/<name>"); its format names the capacity and the policy,
so a resume with other ones is refused naming both.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from recgnn import sharding
from recgnn.backends.dynamic import history, id_map, resets
from recgnn.backends.dynamic.options import DynamicOptions
from recgnn.embeddings import base, protocols, registry

MAP = "map/"


def _inner_class(text: str) -> tuple[type, dict]:
  name, options = registry.parse_backend(text)
  if name not in registry.REGISTRY:
    raise ValueError(
      f"dynamic: unknown inner backend {name!r}; available: "
      f"{', '.join(sorted(k for k in registry.REGISTRY if k != 'dynamic'))}"
    )
  return registry.REGISTRY[name], options


#: Why an inner backend cannot reset a row, where there is more to say than that it does not.
_WHY_NOT = {
  "tt": "a tt row is a product of core slices shared with other rows, so one row cannot be "
  "put back to fresh values without changing others, and its optimizer state is per core "
  "slice, not per row. "
}


def _cannot_reset(o: DynamicOptions, inner: str) -> str:
  """The refusal of evictions with reset=rows over an inner backend that cannot reset rows."""
  return (
    f"dynamic(evict={o.evict}): evicted rows are reused, and inner backend {o.inner!r} "
    "cannot reset a row in the step (Capabilities.resets_rows: dense, sharded, offload, "
    f"hot_cold); {_WHY_NOT.get(inner, '')}Use another inner backend, evict=none (a full "
    "table rejects new ids) or reset=none (a reused row starts from what the evicted id left "
    "in it)"
  )


@base.register_backend("dynamic")
class Dynamic(base.Backend):
  """Raw ids mapped to rows of an inner backend (see the module docstring)."""

  Options = DynamicOptions

  @classmethod
  def capabilities_for(cls, options):
    cls_, inner_options = _inner_class(cls.Options.parse(options).inner)
    caps = cls_.capabilities_for(inner_options)
    return dataclasses.replace(
      caps,
      plans_globally=True,
      stateless_prepare=False,
      prepares_on_device=False,
      resets_rows=False,
      maps_ids=True,
    )

  def __init__(self, specs, mesh, layout=None, text: str = "", **options):
    super().__init__(specs, mesh, layout, text, **options)
    o = self.options
    self.capabilities = type(self).capabilities_for(options)
    cls, inner_options = _inner_class(o.inner)
    self.inner_specs = {
      s.name: dataclasses.replace(s, num_rows=o.capacity, raw_ids=False) for s in specs
    }
    inner_list = list(self.inner_specs.values())
    self.inner = registry.construct(cls, o.inner, inner_list, mesh, self.layout, inner_options)
    protocols.check(self.inner, o.inner)
    self.reuses = o.evict != "none" and o.reset == "rows"
    if self.reuses and not self.inner.capabilities.resets_rows:
      raise ValueError(_cannot_reset(o, cls.name))
    self.lookahead = self.inner.lookahead
    self.maps = {n: id_map.IdMap(o.policy()) for n in self.specs}
    ahead = (base.PREFETCH + 2) * self.layout.steps_per_call + self.lookahead
    self.history = history.History(self.maps, every=max(64, 4 * ahead))
    self._last = {n: m.counters() for n, m in self.maps.items()}

  def describe(self, table=None):
    return self.text

  # ---- state

  def init(self, key):
    steps = jax.device_put(jnp.zeros((), jnp.int32), self._replicated())
    return {"inner": self.inner.init(key), "steps": steps}

  def _replicated(self):
    return sharding.named(self.mesh, sharding.REPLICATED)

  def state_sharding(self):
    return {"inner": self.inner.state_sharding(), "steps": self._replicated()}

  # ---- host side

  def prepare(self, ids, upcoming=(), *, train=True):
    rows, reset = {}, {}
    if train:
      self.history.before_train(self.maps[next(iter(self.maps))].counters()["step"], ids)
    seed = self.options.seed
    for n, m in self.maps.items():
      first = m.counters()["resets"]
      rows[n], slots, at = m.map_at(ids[n], train=train)
      if not self.reuses:  # (reset=none: reused rows kept as they are)
        slots, at = slots[:0], at[:0]
      reset[n] = resets.make(self.inner_specs[n], slots, seed, first, self.reuses, at=at)
    ahead = [
      {n: m.map(u[n], train=False)[0] for n, m in self.maps.items()}
      for u in upcoming[: self.lookahead]
    ]
    inner, reset = self.inner.place_resets(self.inner.prepare(rows, ahead, train=train), reset)
    return {"inner": inner, "reset": reset}

  def prepared_spec(self, prepared):
    reset = jax.tree.map(lambda _: sharding.REPLICATED, prepared["reset"])
    return {"inner": self.inner.prepared_spec(prepared["inner"]), "reset": reset}

  def stack_call(self, prepared):
    inner = self.inner.stack_call([p["inner"] for p in prepared])
    out = []
    for p, q in zip(prepared, inner, strict=True):
      longest = {n: max(x["reset"][n]["slots"].shape[0] for x in prepared) for n in self.maps}
      out.append(
        {"inner": q, "reset": {n: resets.pad(r, longest[n]) for n, r in p["reset"].items()}}
      )
    return out

  # ---- step

  def _reset(self, state, prepared):
    todo = {n: r for n, r in prepared["reset"].items() if r["slots"].shape[0]}
    return self.inner.reset_rows(state["inner"], todo) if todo else state["inner"]

  def lookup(self, state, prepared):
    return self.inner.lookup(self._reset(state, prepared), prepared["inner"])

  def micro_batches(self, prepared):
    return self.inner.micro_batches(prepared["inner"])

  def lookup_micro(self, state, prepared):
    return self.inner.lookup_micro(self._reset(state, prepared), prepared["inner"])

  def update(self, state, prepared, residuals, grads):
    inner = self.inner.update(self._reset(state, prepared), prepared["inner"], residuals, grads)
    inner, to_host = base.split_to_host(inner)
    out = {"inner": inner, "steps": state["steps"] + 1}
    return out if to_host is None else {**out, base.TO_HOST: to_host}

  # ---- the inner backend's protocols, passed through

  def after_update(self, state, to_host=None, steps=1):
    if state is None:
      return self.inner.after_update(None, to_host, steps)
    state, mine = base.split_to_host(state)
    inner = self.inner.after_update(state["inner"], mine if to_host is None else to_host, steps)
    return {**state, "inner": inner}

  def batch_memory(self, ids_shapes):
    return self.inner.batch_memory(ids_shapes)

  def expect_batches(self, ids_shapes):
    self.inner.expect_batches(ids_shapes)

  def replan(self, state, step):
    inner, changed = self.inner.replan(state["inner"], step)
    return {**state, "inner": inner}, changed

  def sync(self, state):
    return {**state, "inner": self.inner.sync(state["inner"])}

  def restore(self, state):
    return {**state, "inner": self.inner.restore(state["inner"])}

  # ---- reports

  def memory(self):
    out = {}
    for n, r in self.inner.memory().items():
      host = r.host_bytes + self.maps[n].nbytes()
      out[n] = dataclasses.replace(r, host_bytes=host, placement=f"{r.placement} + id map")
    return out

  def device_bytes(self):
    return self.inner.device_bytes()

  def num_params(self):
    return self.inner.num_params()

  def stats(self):
    out = {f"{k}": v for k, v in self.inner.stats().items()}
    for n, m in self.maps.items():
      now, before = m.counters(), self._last[n]
      for k in ("admitted", "evicted", "rejected"):
        out[f"{n}/dynamic_{k}"] = float(now[k] - before[k])
      out[f"{n}/dynamic_occupancy"] = now["occupied"] / m.policy.capacity
      self._last[n] = now
    return out

  def extras(self, state):
    return self.inner.extras(state["inner"])

  def restore_extras(self, state, extras):
    return {**state, "inner": self.inner.restore_extras(state["inner"], extras)}

  def report(self, state):
    return self.inner.report(state["inner"])

  def tables(self, state):
    return self.inner.tables(state["inner"])

  def rows_of(self, table: str) -> np.ndarray:
    """The raw id each row of `table` holds now, as the input thread left it (-1: free)."""
    return self.maps[table].key_of(np.arange(self.options.capacity))

  # ---- checkpoints: the inner backend's logical form + the maps at the state's step

  def logical_format(self, table):
    return f"{self.options.format()}+{self.inner.logical_format(table)}"

  def export(self, state):
    maps = self.history.at(int(jax.device_get(state["steps"])))
    out = self.inner.export(state["inner"])
    return {n: {**x, **{MAP + k: v for k, v in maps[n].items()}} for n, x in out.items()}

  def logical_target(self):
    empty = id_map.new_arrays(self.options.policy())
    target = self.inner.logical_target()
    return {n: {**t, **{MAP + k: v for k, v in empty.items()}} for n, t in target.items()}

  def import_(self, logical):
    inner = {n: {k: v for k, v in x.items() if not k.startswith(MAP)} for n, x in logical.items()}
    maps = {
      n: {k[len(MAP) :]: np.asarray(v) for k, v in x.items() if k.startswith(MAP)}
      for n, x in logical.items()
    }
    policy = self.options.policy()
    for n in self.maps:
      self.maps[n] = id_map.IdMap(policy, maps[n])
    step = self.maps[next(iter(self.maps))].counters()["step"]
    self.history = history.History(self.maps, self.history.every, step)
    self._last = {n: m.counters() for n, m in self.maps.items()}
    steps = jax.device_put(jnp.asarray(step, jnp.int32), self._replicated())
    return {"inner": self.inner.import_(inner), "steps": steps}
