"""Which storage each offloaded name held, so a reload refuses a tensor replaced while offloaded."""

from __future__ import annotations

from torch.multiprocessing.reductions import StorageWeakRef

from refitkit.engines._states import NamedTensors
from refitkit.errors import InvalidInput
from refitkit.offload.arena import HostArena
from refitkit.offload.device import local_tensor


class ReplacedTensorGuard:
    """``EngineAdapter``'s record of offloaded storages (a mixin: ``arena`` and ``_offloaded`` are the adapter's)."""

    arena: HostArena
    # per part, name -> the storage offloaded under it
    _offloaded: dict[str, dict[str, tuple[int, StorageWeakRef]]]

    def _held_storages(self, named: NamedTensors, *, in_flight: bool = False) -> dict[str, tuple[int, StorageWeakRef]]:
        """name -> storage for every tensor whose bytes the arena now holds (O(1) each).

        ``in_flight``: asked while an offload of all of ``named`` has its copies issued but not
        done; a storage with a slot that still has device bytes is one it is moving, so counts.
        """
        held: dict[str, tuple[int, StorageWeakRef]] = {}
        for name, tensor in named:
            storage = local_tensor(tensor).untyped_storage()
            slot = self.arena.slot_of(storage)
            if slot is not None and (slot.holds_data or (in_flight and storage.nbytes() > 0)):
                held[name] = (storage._cdata, StorageWeakRef(storage))
        return held

    def _release_held(self, parts: list[str], released: list[str]) -> None:
        """Release the records of ``parts`` once a reload's checks used them, while its copies still run (a
        thousand weak references cost ~1 ms on an H200 host after the last copy); each part is added to
        ``released`` before its records go, so an interrupt in between still has them rebuilt."""
        for part in parts:
            if self._offloaded.get(part):
                released.append(part)
                self._offloaded[part].clear()

    def _hold_again(self, parts: list[str], named_by_part: dict[str, NamedTensors]) -> None:
        """After a reload that released these records failed: the same records again. Its moves were undone,
        so the storages are offloaded again, and each name points at the storage it had at offload (checked)."""
        for part in parts:
            self._offloaded[part] = self._held_storages(named_by_part[part])

    def _check_not_replaced(self, part: str, named: NamedTensors) -> None:
        """Refuse a reload when a name now points at another tensor than the one offloaded under it.

        Restoring the new tensor's neighbours would leave the old one (still referenced, e.g. by the
        optimizer) at 0 bytes and its bytes stranded in the arena, so nothing is restored.
        """
        offloaded = self._offloaded.get(part)
        if not offloaded:
            return
        current = {name: tensor for name, tensor in named}
        replaced: list[str] = []
        for name, (key, ref) in offloaded.items():
            if ref.expired():
                continue  # nothing references the old storage any more: no bytes left to lose
            tensor = current.get(name)
            if tensor is None or local_tensor(tensor).untyped_storage()._cdata != key:
                replaced.append(name)
        if replaced:
            more = f" (and {len(replaced) - 1} more)" if len(replaced) > 1 else ""
            raise InvalidInput(
                f"{type(self).__name__}.reload(): {replaced[0]!r}{more} was replaced or removed while offloaded "
                f"(e.g. `module.weight = nn.Parameter(...)` or a new optimizer state tensor); its offloaded bytes "
                "are still in the arena and nothing was restored: put the original tensor back and call reload() again"
            )
