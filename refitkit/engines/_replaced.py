"""Which storage each offloaded name held, so a reload refuses a tensor replaced while offloaded."""

from __future__ import annotations

from torch.multiprocessing.reductions import StorageWeakRef

from refitkit.engines._states import NamedTensors
from refitkit.errors import InvalidInput
from refitkit.offload.arena import HostArena
from refitkit.offload.device import local_tensor


class ReplacedTensorGuard:
    """``EngineAdapter``'s record of offloaded storages (a mixin: ``arena``, ``_offloaded`` and ``_held_before``
    are the adapter's)."""

    arena: HostArena
    # per part, name -> the storage offloaded under it
    _offloaded: dict[str, dict[str, tuple[int, StorageWeakRef]]]
    # per part, the records of its last offload once reloaded: the next offload of the same storages reuses
    # them. Made anew each round, a thousand records would live from one move to the next, be promoted to the
    # collector's oldest generation every round and bring the trainer's next full collection closer; freed
    # after a reload's last copy, they cost ~1 ms on an H200 host. They hold no bytes (weak references).
    _held_before: dict[str, dict[str, tuple[int, StorageWeakRef]]]

    def _held_storages(
        self, named: NamedTensors, *, in_flight: bool = False, reuse: dict[str, tuple[int, StorageWeakRef]] | None = None
    ) -> dict[str, tuple[int, StorageWeakRef]]:
        """name -> storage for every tensor whose bytes the arena now holds (O(1) each).

        ``in_flight``: asked while an offload of all of ``named`` has its copies issued but not
        done; a storage with a slot that still has device bytes is one it is moving, so counts.
        ``reuse``: earlier records whose entry is taken as is for a name that still has the same storage (alive:
        a live weak reference keeps its key from being given to another storage).
        """
        held: dict[str, tuple[int, StorageWeakRef]] = {}
        for name, tensor in named:
            storage = local_tensor(tensor).untyped_storage()
            slot = self.arena.slot_of(storage)
            if slot is not None and (slot.holds_data or (in_flight and storage.nbytes() > 0)):
                key = storage._cdata
                record = reuse.get(name) if reuse else None
                if record is None or record[0] != key or record[1].expired():
                    record = (key, StorageWeakRef(storage))
                held[name] = record
        return held

    def _retire_held(self, parts: list[str], retired: list[str]) -> None:
        """Once a reload's checks used the records of ``parts``: keep them for the next offload to reuse, out of
        the offloaded ones. Each part is added to ``retired`` before it leaves them, for ``_hold_again``."""
        for part in parts:
            held = self._offloaded.get(part)
            if held:
                self._held_before[part] = held
                retired.append(part)
                del self._offloaded[part]

    def _hold_again(self, parts: list[str]) -> None:
        """After a reload that retired these records failed: they are the offloaded ones again (its moves were
        undone, so the storages are offloaded again, each under the name it had: the reload checked that)."""
        for part in parts:
            self._offloaded[part] = self._held_before.pop(part)

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
