"""The backend contract's surface: the core every backend implements and the optional
protocols a backend opts into, each declared (never found by `hasattr`).

  protocol              methods                                   opted into by
  core (Backend)        init, state_sharding, prepare,            (every backend)
                        prepared_spec, lookup, update, memory,
                        tables, logical_format, export,
                        logical_target, import_
  core (TableBackend)   init, state_sharding, lookup, update,     (every per-table backend;
                        memory, table; prepare and the "rows"      prepare and the checkpoint
                        checkpoint (export / import_ from          have defaults)
                        `table`, `slots`, `from_rows`)
  HostTier              after_update, stack_call, batch_memory,   Capabilities.writes_host
                        expect_batches, splits_prepare,
                        prepare_ahead
  DevicePrepare         prepare_on_device                         Capabilities.prepares_on_device
  Replanning            replan                                    Capabilities.replans_shapes
  MicroBatching         micro_batches, lookup_micro               Capabilities.splits_batch
  StreamedCheckpoints   reads_streams (export may give a          reads_streams() -> True
                        StreamedTable, import_ a TableReader)
  AutoCandidates        auto_candidates (a classmethod)           overriding it
  RowReset              reset_rows, place_resets                  Capabilities.resets_rows

`Backend` (recgnn.embeddings.contract) keeps a no-op default of every optional method the
trainer calls on every group (a backend that opts into nothing is called through them); the
micro-batching methods have none and `prepare_on_device`'s refuses: only a group that
declares `splits_batch` / `prepares_on_device` is asked. A
backend that declares a protocol and leaves one of its `REQUIRED` methods to the default is
refused when its group is built (`check`, from `recgnn.planner.make_group`), naming them.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol

import jax

from recgnn.embeddings.contract import AutoContext, Backend, Capabilities, PyTree
from recgnn.embeddings.specs import TableSpec


class HostTier(Protocol):
  """Rows in host memory: the step hands rows to a host writer (`Capabilities.writes_host`;
  offload, hot_cold). recgnn/embeddings/host_tier.py holds the shared mechanism."""

  REQUIRED: ClassVar[tuple[str, ...]] = ("after_update",)

  def after_update(self, state: PyTree, to_host: PyTree | None = None, steps: int = 1) -> PyTree:
    """The step's TO_HOST output to the host writer, O(1); -> the state without it."""

  def stack_call(self, prepared: list[PyTree]) -> list[PyTree]:
    """A call's k prepared batches made one shape (`Capabilities.stacks_calls`)."""

  def batch_memory(self, ids_shapes: dict[str, tuple[int, ...]]) -> dict[str, int]:
    """Bytes per device of buffers sized by the batch (the ring of recent write-backs)."""

  def expect_batches(self, ids_shapes: dict[str, tuple[int, ...]]) -> None:
    """Before init / restore: such buffers made at the train batch's size."""

  @property
  def splits_prepare(self) -> bool:
    """Whether `prepare_ahead` leaves work to its second half."""

  def prepare_ahead(self, ids, upcoming=(), *, train=True):
    """`prepare` in two halves, each in stream order (`recgnn.train.plan_ahead`)."""


class DevicePrepare(Protocol):
  """`prepare` inside the jitted step from the batch's device ids (the device feed,
  `Layout.ids_on_device`; `Capabilities.prepares_on_device`: dense, sharded)."""

  REQUIRED: ClassVar[tuple[str, ...]] = ("prepare_on_device",)

  def prepare_on_device(self, ids: dict[str, jax.Array]) -> PyTree:
    """Inside jit: ids {table: int32[B, L]} -> the pytree `prepare` makes for them."""


class Replanning(Protocol):
  """Static shapes that follow the backend's own statistics (`Capabilities.replans_shapes`;
  sharded's code widths with widths=auto): the trainer rebuilds its steps on a change."""

  REQUIRED: ClassVar[tuple[str, ...]] = ("replan",)

  def replan(self, state: PyTree, step: int) -> tuple[PyTree, bool]:
    """After train step `step`: (state, whether the step's static shapes changed)."""


class MicroBatching(Protocol):
  """The batch run in pieces (`Capabilities.splits_batch`; hot_cold): the step runs the
  loss per micro-batch and one update (recgnn/embeddings/microbatch.py says the shapes)."""

  REQUIRED: ClassVar[tuple[str, ...]] = ("micro_batches", "lookup_micro")

  def micro_batches(self, prepared: PyTree) -> tuple[jax.Array, ...] | None:
    """Inside jit: one int32[n * P_m] index array per micro-batch, or None (whole)."""

  def lookup_micro(self, state: PyTree, prepared: PyTree) -> tuple[tuple[dict, ...], PyTree]:
    """(({table: f32[n * P_m, D]} per micro-batch, in `micro_batches`' order), residuals)."""


class StreamedCheckpoints(Protocol):
  """Tables bigger than host RAM checkpointed a chunk at a time (offload's SSD level):
  `export` may give a `streamed.StreamedTable`, `import_` takes a `streamed.TableReader`."""

  REQUIRED: ClassVar[tuple[str, ...]] = ("reads_streams",)

  def reads_streams(self) -> bool:
    """Whether `import_` takes a reader for a table's logical form (True: opted in)."""


class AutoCandidates(Protocol):
  """A backend that offers itself to `auto(...)`: its own plan strings for a table, asked of
  every registered backend beside the planner's built-in list."""

  REQUIRED: ClassVar[tuple[str, ...]] = ("auto_candidates",)

  @classmethod
  def auto_candidates(cls, spec: TableSpec, context: AutoContext) -> list[str]:
    """Plan strings worth trying for `spec` (default: none)."""


class RowReset(Protocol):
  """Rows put back to given values with fresh optimizer state inside the step
  (`Capabilities.resets_rows`; dense, sharded, offload, hot_cold): what a dynamic table
  needs of its inner backend to reuse an evicted row (recgnn/backends/dynamic/). A backend
  whose rows move between the host and the devices also places the resets on the host
  (`place_resets`: where the step holds each row, or the reset put into the rows the step
  brings)."""

  REQUIRED: ClassVar[tuple[str, ...]] = ("reset_rows",)

  def reset_rows(self, state: PyTree, resets: dict) -> PyTree:
    """Inside jit: {table: {"slots": int32[R], "rows": f32[R, D]}} -> the state reset."""

  def place_resets(self, prepared: PyTree, resets: dict) -> tuple[PyTree, dict]:
    """Host, after `prepare`: (prepared, resets with "at") -> (prepared, `reset_rows`' resets)."""


#: Each optional protocol and how a backend declares it: a `Capabilities` field, or a
#: method it overrides (None: `reads_streams()` answering True, `auto_candidates` overridden
#: on the class; the planner asks every registered class, so a group is not checked for it).
OPTIONAL: dict[type, str | None] = {
  HostTier: "writes_host",
  DevicePrepare: "prepares_on_device",
  Replanning: "replans_shapes",
  MicroBatching: "splits_batch",
  StreamedCheckpoints: None,
  AutoCandidates: None,
  RowReset: "resets_rows",
}


def methods(protocol: type) -> tuple[str, ...]:
  """The methods a protocol groups, in declaration order."""
  return tuple(k for k in vars(protocol) if not k.startswith("_") and k != "REQUIRED")


def _overrides(obj: Any, name: str) -> bool:
  """Whether `name` comes from `obj`'s class or a base below `Backend` (not `Backend`'s
  default)."""
  owner = next((k for k in type(obj).__mro__ if name in vars(k)), None)
  return owner is not None and owner is not Backend


def declared(group: Backend) -> list[type]:
  """The optional protocols a built group opts into (its capabilities; `reads_streams()`)."""
  caps: Capabilities = group.capabilities
  out = [p for p, flag in OPTIONAL.items() if flag is not None and getattr(caps, flag)]
  if group.reads_streams():
    out.append(StreamedCheckpoints)
  return out


def missing(group: Backend) -> dict[str, list[str]]:
  """{protocol: its required methods the group leaves to `Backend`'s default} for each
  protocol it declares (empty: it implements what it declares)."""
  out = {}
  for proto in declared(group):
    lacking = [m for m in proto.REQUIRED if not _overrides(group, m)]
    if lacking:
      out[proto.__name__] = lacking
  return out


def check(group: Backend, text: str) -> None:
  """Refuse a group that declares an optional protocol without its required methods."""
  if lack := missing(group):
    what = "; ".join(f"{p}: {', '.join(ms)}" for p, ms in lack.items())
    raise TypeError(
      f"backend {text!r} declares optional protocols it does not implement ({what}): "
      "implement them or drop the capability (recgnn/embeddings/protocols.py)"
    )


def table() -> list[tuple[str, tuple[str, ...]]]:
  """(name, methods) of each optional protocol, in `OPTIONAL`'s order (docs/architecture.md
  states them as a table; tests/test_protocols.py keeps it true)."""
  return [(p.__name__, methods(p)) for p in OPTIONAL]
