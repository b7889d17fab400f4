"""The `hot_cold` backend's front: the contract's methods, each handed to the part that owns
its phase (the package docstring says what flows where).

  Geometry      geometry.py   the frozen layout: capacities, stacks, shardings, memory
  HotSet        hot_set.py    which rows are hot: slot maps, profile, picks, migrations
  HostTier      host_side.py  the host tables, the ring's bookkeeping, the writer
  Preparer      prepare.py    ids -> prepared (input thread), stats
  DeviceStep    device.py     lookup / update / migration inside the step
  StateKeeper   state.py      init, import_ / export, restore, extras
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

from recgnn.backends.hot_cold import call_shapes
from recgnn.backends.hot_cold.device import DeviceStep
from recgnn.backends.hot_cold.geometry import Geometry
from recgnn.backends.hot_cold.host_side import HostTier
from recgnn.backends.hot_cold.hot_set import HotSet
from recgnn.backends.hot_cold.options import HotColdOptions
from recgnn.backends.hot_cold.prepare import Preparer
from recgnn.backends.hot_cold.state import StateKeeper
from recgnn.embeddings import access_counts as profile
from recgnn.embeddings import base


@base.register_backend("hot_cold")
class HotCold(base.Backend):
  """Hot rows on the devices (row-sharded), cold rows in host RAM (numpy, read by prepare and
  written by the host writer); popular / non-popular micro-batches. Options:
  `HotColdOptions`."""

  Options = HotColdOptions

  def __init__(
    self,
    specs: Sequence[base.TableSpec],
    mesh: jax.sharding.Mesh,
    layout: base.Layout | None = None,
    text: str = "",
    **options,
  ):
    super().__init__(specs, mesh, layout, text, **options)
    o = self.options
    self.capabilities = self._capabilities(o)
    self.geometry = Geometry.build(self.specs, mesh, self.layout, o)
    self._hot = HotSet(self.geometry, o)
    self._host = HostTier(self.geometry, bool(o.reprofile), self.layout.steps_per_call)
    self._device = DeviceStep(self.geometry)
    # (the split-off warning's group is the backend string: `micro.OFF_LOG`)
    self._prep = Preparer(self.geometry, o, self._hot, self._host, self.describe())
    self._state = StateKeeper(self.geometry, self._hot, self._host, self._device, self._prep)
    # Every batch's cold rows are read by its own prepare (the input pipeline runs ahead of
    # the step): nothing to look ahead for.
    self.lookahead = 0

  @classmethod
  def capabilities_for(cls, options):
    return cls._capabilities(HotColdOptions.parse(options))

  @staticmethod
  def _capabilities(o: HotColdOptions) -> base.Capabilities:
    # The hot set and the popular / non-popular split are planned over the whole batch; the
    # step returns the cold rows it updated for the host writer (TO_HOST).
    return base.Capabilities(
      splits_batch=o.split,
      plans_globally=True,
      writes_host=True,
      stacks_calls=True,
      resets_rows=True,
    )

  def describe(self, table=None):
    del table
    return self.options.describe()

  # ------------------------------------------------------------------ layout and state
  def state_sharding(self):
    return self.geometry.state_sharding()

  def memory(self):
    return self.geometry.memory()

  def batch_memory(self, ids_shapes):
    """The device ring of recent write-backs (`HostTier.batch_memory`)."""
    return self._host.batch_memory(ids_shapes)

  def expect_batches(self, ids_shapes):
    """Rings made at the rows such batches need (`HostTier.expect`)."""
    self._host.expect(ids_shapes)

  def init(self, key):
    return self._state.init(key)

  def logical_format(self, table):
    return "rows"

  def logical_target(self):
    return self._state.logical_target()

  def import_(self, logical):
    return self._state.import_(logical)

  def export(self, state):
    return self._state.export(state)

  def sync(self, state):
    return self._state.sync(state)

  def restore(self, state):
    return self._state.restore(state)

  def extras(self, state):
    return self._state.extras(state)

  def restore_extras(self, state, extras):
    return self._state.restore_extras(state, extras)

  def tables(self, state):
    return self._host.tables(state)

  # ------------------------------------------------------------------ the hot set
  def use_profile(self, profiles: dict[str, profile.AccessProfile]) -> profile.HotSet:
    """Pick the hot set from a profile made elsewhere (`HotSet.use_profile`)."""
    return self._hot.use_profile(profiles)

  def hot_set(self):
    return self._hot.hot_set()

  # ------------------------------------------------------------------ host side
  def prepare(self, ids, upcoming=(), *, train=True):
    """`Preparer.prepare`; upcoming: ignored (each batch's prepare reads its own rows)."""
    del upcoming
    return self._prep.prepare(ids, train)

  def prepared_spec(self, prepared):
    return self._prep.prepared_spec(prepared)

  def place_resets(self, prepared, resets):
    """A dynamic table's reused rows placed in a prepared train batch (`Preparer.place_resets`)."""
    return self._prep.place_resets(prepared, resets)

  @property
  def cold_shapes(self) -> set[tuple[int, ...]]:
    """The train steps' cold-list lengths seen so far."""
    return self._prep.cold_shapes

  def stats(self):
    return self._prep.stats()

  def after_update(self, state, to_host=None, steps=1):
    return self._host.after_update(state, to_host, steps)

  def stack_call(self, prepared):
    """A call's k train batches of one shape (`call_shapes.one_shape`)."""
    out = call_shapes.one_shape(self.geometry, prepared)
    self._prep.cold_shapes.update(tuple(c["src"].shape[0] for c in p["cold"]) for p in out)
    return out

  def planned_to_host(self, prepared):
    return self._host.planned_to_host(prepared)

  def host_write_seconds(self):
    return self._host.host_write_seconds()

  # ------------------------------------------------------------------ the step
  def micro_batches(self, prepared):
    return self._device.micro_batches(prepared)

  def lookup_micro(self, state, prepared):
    return self._device.lookup_micro(state, prepared)

  def lookup(self, state, prepared):
    return self._device.lookup(state, prepared)

  def update(self, state, prepared, residuals, grads):
    return self._device.update(state, prepared, residuals, grads)

  def reset_rows(self, state, resets):
    """The hot slots `place_resets` named reset (`DeviceStep.reset_rows`)."""
    return self._device.reset_rows(state, resets)
