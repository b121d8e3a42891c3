"""A move's per-part figures and held-storage records, looked up while its copies run (``EngineAdapter``'s helper)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch.multiprocessing.reductions import StorageWeakRef

from refitkit.engines._states import AdapterMove, NamedTensors
from refitkit.offload import MoveStats

if TYPE_CHECKING:
    from refitkit.engines.base import EngineAdapter


class Bookkeeping:
    """A move's per-part figures (and held storages), looked up while its copies run, not after them.

    Everything read here is final once the copies are issued: slot sizes are set, and a storage
    still holding bytes with a slot is one this move frees (see ``EngineAdapter._held_storages``).
    """

    def __init__(self, adapter: "EngineAdapter", by_part: dict[str, NamedTensors]) -> None:
        self._adapter = adapter
        self._by_part = by_part
        self._counts: dict[str, tuple[int, int]] = {}
        self.held: dict[str, dict[str, tuple[int, StorageWeakRef]]] | None = None

    def run(self, held: list[str] | None = None) -> None:
        self._counts = {part: self._adapter._moved(named) for part, named in self._by_part.items()}
        if held is not None:
            adapter, before = self._adapter, self._adapter._held_before
            self.held = {
                part: adapter._held_storages(self._by_part[part], in_flight=True, reuse=before.pop(part, None)) for part in held
            }

    def split(self, total: MoveStats) -> AdapterMove:
        """Per-part stats; the time is the phase's, shared."""
        if not self._counts:
            self.run()
        parts = {
            part: MoveStats(bytes=nbytes, storages=count, seconds=total.seconds if nbytes else 0.0)
            for part, (nbytes, count) in self._counts.items()
        }
        return AdapterMove(model=parts["model"], optimizer=parts["optimizer"], grad=parts["grad"], total=total)
