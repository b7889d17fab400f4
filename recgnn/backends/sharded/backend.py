"""The `sharded` backend's front: the contract's methods, each handed to the part that owns
its phase (the package docstring says what flows where).

  Geometry      geometry.py   the frozen layout: placements, segments, bytes, shardings
  Wire          wire.py       the codecs, their adaptive bounds, width re-plans, reports
  Preparer      prepare.py    ids -> prepared (input thread)
  DeviceStep    step.py       lookup / update (Routing: routing.py; Exchange: exchange.py)
  StateKeeper   state.py      init, tables, logical_target / export / import_
  Reset         reset.py      reset_rows: given rows put back in the step (a dynamic table's)
"""

from __future__ import annotations

from absl import logging

from recgnn.backends.sharded.geometry import Geometry
from recgnn.backends.sharded.options import ShardedOptions
from recgnn.backends.sharded.prepare import Preparer
from recgnn.backends.sharded.reset import Reset
from recgnn.backends.sharded.state import StateKeeper
from recgnn.backends.sharded.step import DeviceStep
from recgnn.backends.sharded.wire import Wire
from recgnn.embeddings import base


@base.register_backend("sharded")
class Sharded(base.Backend):
  """Model-parallel tables (see the package docstring). Options: `ShardedOptions`."""

  Options = ShardedOptions
  # Routes each device's ids to their owners; prepare is per example; rows reset in place.
  capabilities = base.Capabilities(needs_split_ids=True, prepares_on_device=True, resets_rows=True)

  @classmethod
  def capabilities_for(cls, options):
    return cls._capabilities(ShardedOptions.parse(options))

  @staticmethod
  def _capabilities(o: ShardedOptions) -> base.Capabilities:
    # widths=auto re-plans the codes' widths (static shapes) while training.
    return base.Capabilities(
      needs_split_ids=True,
      replans_shapes="auto" in o.code_widths.values(),
      prepares_on_device=True,
      resets_rows=True,
    )

  def __init__(self, specs, mesh, layout: base.Layout | None = None, text: str = "", **options):
    super().__init__(specs, mesh, layout, text, **options)
    self.capabilities = self._capabilities(self.options)
    self.geometry = Geometry.build(self.specs, mesh, self.layout, self.options)
    self.wire = Wire(self.geometry, self.options, self.capabilities.replans_shapes)
    self._prep = Preparer(self.specs, self.process_local)
    self._device = DeviceStep(self.geometry, self.wire)
    self._state = StateKeeper(self.geometry, self.wire)
    self._reset = Reset(self.geometry, self.wire)
    logging.info("sharded placements:\n%s", self.format_placements())

  def describe(self, table=None):
    if table is None:
      return self.text
    p = self.geometry.placement[table]
    where = f"table@{p.shard}" if p.kind == "table" else p.kind
    return f"{self.text} [{where}]"

  def format_placements(self) -> str:
    return self.geometry.format_placements(self.wire.codecs)

  # ------------------------------------------------------------------ layout and state
  def memory(self):
    return self.geometry.memory()

  def device_bytes_by_shard(self) -> list[int]:
    return self.geometry.device_bytes_by_shard()

  def device_bytes(self) -> int:
    """The most one device holds for the whole group (table-wise tables live on one shard,
    so the per-table figures of `memory` do not add up to it)."""
    return max(self.geometry.device_bytes_by_shard())

  def state_sharding(self):
    return self._state.state_sharding()

  def init(self, key):
    return self._state.init(key)

  def tables(self, state):
    return self._state.tables(state)

  def logical_format(self, table):
    return "rows"

  def logical_target(self):
    return self._state.logical_target()

  def export(self, state):
    return self._state.export(state)

  def import_(self, logical):
    return self._state.import_(logical)

  # ------------------------------------------------------------------ the codecs
  @property
  def codecs(self) -> dict:
    """{"fwd" | "bwd": codecs.Codec}: what the steps built now are traced with."""
    return self.wire.codecs

  @property
  def width_changes(self) -> int:
    return self.wire.width_changes

  def replan(self, state, step: int):
    """widths=auto: the codes' widths re-planned (`Wire.replan`)."""
    return self.wire.replan(state, step)

  def extras(self, state):
    return self.wire.extras(state, self.text)

  def restore_extras(self, state, extras):
    return self.wire.restore_extras(state, extras)

  def wire_bytes(self, batch: int) -> dict[str, int]:
    return self.wire.wire_bytes(batch)

  def stats(self):
    return self.wire.stats(self._prep.batch)

  def report(self, state):
    return {**self.stats(), **self.codec_report(state)}

  def codec_report(self, state) -> dict[str, float]:
    return self.wire.report(state)

  # ------------------------------------------------------------------ host side and step
  def prepare(self, ids, upcoming=(), *, train=True):
    del upcoming
    return self._prep.prepare(ids, train)

  def prepare_on_device(self, ids):
    return self._prep.prepare_on_device(ids)

  def prepared_spec(self, prepared):
    return self._prep.prepared_spec(prepared)

  def lookup(self, state, prepared):
    return self._device.lookup(state, prepared)

  def update(self, state, prepared, residuals, grads):
    return self._device.update(state, prepared, residuals, grads)

  def reset_rows(self, state, resets):
    return self._reset.reset_rows(state, resets)
