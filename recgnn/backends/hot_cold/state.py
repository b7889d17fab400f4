"""hot_cold's state: built (init, import_), restored, checkpointed (export, extras).

One concern: the state's life outside the step. A state is the hot arrays (the current hot
set's rows, split over the mesh), the rings of recent write-backs and the version counters;
building or restoring one resets the host bookkeeping that must agree with it (the hot set's
slot maps, the host tier's ring positions and writer count, the preparer's version).
`StateKeeper` is an object the `HotCold` front holds (recgnn/backends/hot_cold/backend.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from recgnn.backends.hot_cold import hot_set as hot_set_lib
from recgnn.backends.hot_cold.device import DeviceStep
from recgnn.backends.hot_cold.geometry import Geometry
from recgnn.backends.hot_cold.host_side import HostTier
from recgnn.backends.hot_cold.hot_set import HotSet
from recgnn.backends.hot_cold.prepare import Preparer
from recgnn.embeddings import base, host_cache, host_tier

ABSENT = host_tier.ABSENT


class StateKeeper:
  """init / import_ / restore / restore_extras (each resets the host bookkeeping for the
  state it returns), export / sync / extras (after the stale check)."""

  def __init__(
    self, geometry: Geometry, hot: HotSet, host: HostTier, device: DeviceStep, prep: Preparer
  ):
    self._g, self._hot, self._host, self._device, self._prep = geometry, hot, host, device, prep
    self._stale = host_cache.StaleCheck(geometry.owner, "hot / cold")

  def check_stale(self, state) -> None:
    self._stale.check(state)

  def init(self, key):
    host = {}
    for name, spec in self._g.specs.items():
      opt = spec.optimizer
      s = base.aligned_rows(spec.num_rows)
      table = np.zeros((s, spec.dim), np.float32)
      table[: spec.num_rows] = base.init_table(base.table_key(key, name), spec)
      host[name] = {"table": table}
      host[name].update(
        {k: np.full(s, opt.initial_accumulator, np.float32) for k in opt.slot_names()}
      )
    return self._fresh(host, keep_hot_set=True)

  def import_(self, logical):
    """Every row to the host tables (numpy, one copy: O(N) at restore only), empty hot
    arrays: the hot set is profiled again, or comes from the checkpoint (`restore_extras`)."""
    host = {}
    for n, s in self._g.specs.items():
      arrays = {"table": logical[n]["rows"], **{k: logical[n][k] for k in s.optimizer.slot_names()}}
      host[n] = {k: np.array(jax.device_get(v), np.float32) for k, v in arrays.items()}
    return self._fresh(host, keep_hot_set=False)

  def _fresh(self, host: dict, keep_hot_set: bool) -> dict:
    """A state for `host` (every row, numpy: to the host tier); the hot arrays hold the
    current hot set (from `use_profile` before init) or nothing."""
    g = self._g
    sh = g.state_sharding()
    self._host.set(host)
    tables = {}
    if not keep_hot_set:
      self._hot.clear()
    for name, r in self._hot.rows.items():
      spec, opt = r.spec, r.spec.optimizer
      hot = {"table": np.zeros((r.alloc, spec.dim), np.float32)}
      hot.update(
        {k: np.full(r.alloc, opt.initial_accumulator, np.float32) for k in opt.slot_names()}
      )
      filled = r.slot_row >= 0
      if filled.any():  # a hot set picked before init: its rows start from the host values
        src = self._host.host_of(name)
        for k in hot:
          hot[k][filled] = src[k][r.slot_row[filled]]
      hot_rows = np.where(filled, r.slot_row, spec.num_rows).astype(np.int32)
      tables[name] = {
        "hot": jax.device_put(hot, sh["tables"][name]["hot"]),
        "hot_rows": jax.device_put(hot_rows, sh["tables"][name]["hot_rows"]),
      }
    self._restart(0)
    # Two buffers: the state is donated, and one buffer donated twice is an error.
    zero = lambda: jax.device_put(np.zeros((), np.int32), g.repl())  # noqa: E731
    return {"tables": tables, "ring": self._empty_ring(), "version": zero(), "stale": zero()}

  def _restart(self, version: int) -> None:
    """The host bookkeeping for a state just built or restored at `version`."""
    self._prep.restart(version)
    self._hot.restart()
    self._host.adopt()

  def _empty_ring(self) -> tuple[dict, ...]:
    """The rings before the first train step, zeros (a slot is read only once a step wrote
    it): per stack the rows `HostTier.expect` was told train batches need, or [0, ...],
    which the first train step resizes from its batch's "ring" shape (a second program)."""
    out = []
    for stack, names in enumerate(self._g.stacks):
      d, v = self._g.specs[names[0]].dim, self._host.ring_rows(stack)
      b = {
        "table": np.zeros((v, d), np.float32),
        **{k: np.zeros(v, np.float32) for k in self._g.slots(names)},
      }
      out.append(jax.device_put(b, self._g.repl()))
    return tuple(out)

  def logical_target(self):
    out = {}
    repl = self._g.repl()
    for name, spec in self._g.specs.items():
      s, d = base.aligned_rows(spec.num_rows), spec.dim
      t = {"rows": jax.ShapeDtypeStruct((s, d), jnp.float32, sharding=repl)}
      for k in spec.optimizer.slot_names():
        t[k] = jax.ShapeDtypeStruct((s,), jnp.float32, sharding=repl)
      out[name] = t
    return out

  def export(self, state):
    """The logical rows of a synced state: copies of the host tables (`HostTier.export`)."""
    self.check_stale(state)
    return self._host.export()

  def sync(self, state):
    """Every hot row written back to the host tables (`HostTier.sync`)."""
    self.check_stale(state)
    return self._host.sync(state)

  def restore(self, state):
    """Host bookkeeping from a state of this group's run (its hot slots; the host tables are
    the group's, after every write-back handed over); the profile restarts."""
    self.check_stale(state)
    self._hot.adopt_slots(
      {
        name: np.asarray(jax.device_get(t["hot_rows"])).astype(np.int64)
        for name, t in state["tables"].items()
      }
    )
    self._restart(int(jax.device_get(state["version"])))
    return state

  def extras(self, state):
    """The hot set, saved beside the logical rows in the checkpoint's metadata: each table's
    hot rows as the state holds them (its slot map, not the input thread's bookkeeping,
    which may be ahead by a migration planned for a batch not yet run), delta-coded."""
    out = {}
    for name, t in state["tables"].items():
      rows = np.asarray(jax.device_get(t["hot_rows"])).astype(np.int64)
      out[name] = hot_set_lib.encode_rows(np.sort(rows[rows < self._g.specs[name].num_rows]))
    return {"hot_set": out}

  def restore_extras(self, state, extras):
    """The saved hot set migrated into the state `import_` built (every row on the host, no
    step run since): the resumed run computes from the same hot rows at once, with no new
    profile. Done here, on the host tables and the hot arrays, not by a step. A hot set
    that does not fit this backend (another budget, other tables) is ignored: profiled
    again."""
    rows = self._hot.saved_fits(extras.get("hot_set") or {})
    if rows is None:
      return state
    self._host.drain()
    tables = dict(state["tables"])
    for name, r in self._hot.rows.items():
      spec = r.spec
      m = hot_set_lib.migrate(r, rows[name])
      packed = self._hot.pack_migration(name, m)
      host = self._host.host_of(name)
      # (the state import_ built: nothing hot yet, so nothing leaves; every row's value is
      # the host's)
      packed["in_src"] = np.full(packed["in_rows"].shape[0], ABSENT, np.int32)
      packed["in_vals"] = {k: v[packed["in_rows"]] for k, v in host.items()}
      move = jax.jit(functools.partial(self._device.migration, spec=spec))
      ring = {k: jnp.zeros((0,) + v.shape[1:], v.dtype) for k, v in packed["in_vals"].items()}
      tables[name], gone = move(tables[name], jax.device_put(packed, self._g.repl()), ring)
      if gone is not None:
        self._host.scatter_leaving(name, m[3], jax.device_get(gone))
    self._hot.adopted(rows)
    self._prep.restart_split()
    return {**state, "tables": tables}
