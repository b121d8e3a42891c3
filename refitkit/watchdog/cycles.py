"""CycleAudit: which reference cycles does a block of code leave behind, and what do they hold?"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from refitkit.errors import LeakDetected, RefitError
from refitkit.watchdog._referrers import referrer_chain, type_name

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CyclicTensor:
    """A tensor found in cyclic garbage (described, not kept: the audit frees what it found)."""

    device: str
    dtype: str
    shape: tuple[int, ...]
    storage_bytes: int


@dataclass(frozen=True)
class CycleReport:
    """Cyclic garbage a block created: counts, types, tensors and how the largest one is held."""

    cyclic_objects: int  # objects in reference cycles, or reachable only from them
    by_type: dict[str, int]  # type name -> count, most common first
    tensor_bytes: dict[str, int]  # device -> bytes of the unique storages those tensors hold
    tensors: tuple[CyclicTensor, ...]  # largest first
    largest_chain: tuple[str, ...] = ()  # referrer chain of the largest tensor (or object), innermost first
    method: str = "freeze"  # "freeze" (only objects made inside) or "collect-before" (fallback)
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def clean(self) -> bool:
        return self.cyclic_objects == 0

    def summary(self, *, top: int = 5) -> str:
        """A few lines for errors and logs."""
        if self.clean:
            return "no cyclic garbage"
        types = ", ".join(f"{name} x{count}" for name, count in list(self.by_type.items())[:top])
        held = ", ".join(f"{device}: {nbytes} B" for device, nbytes in self.tensor_bytes.items()) or "no tensors"
        lines = [f"{self.cyclic_objects} objects in reference cycles ({types}); tensors hold {held}"]
        if self.largest_chain:
            lines.append("largest held via: " + " <- ".join(self.largest_chain))
        return "\n".join(lines)


@dataclass
class _SavedGcState:
    enabled: bool
    thresholds: tuple[int, ...]
    debug: int
    garbage: list[Any]


class CycleAudit(contextlib.ContextDecorator):
    """Reports the reference cycles created inside a ``with`` block (or a decorated call).

    Opt-in audit mode: this is the one place in refitkit that runs ``gc.collect()``. On entry it
    freezes every existing object (``gc.freeze()``) and disables automatic collection; on exit
    it collects with ``gc.DEBUG_SAVEALL`` so exactly the unreachable objects made inside are
    captured, describes them, then frees them with a second collection that, thanks to the
    freeze, scans only those new objects. It restores the GC state it found: enabled flag,
    thresholds, debug flags and ``gc.garbage``'s contents (object generations are not part of
    that promise). If objects are already frozen (by the caller or an outer audit) it cannot
    freeze cleanly and falls back to collecting before the block, so objects made earlier that
    die inside may be counted too (``report.method == "collect-before"``). Other threads'
    garbage made meanwhile is counted as well.
    """

    def __init__(self, *, chain_depth: int = 6) -> None:
        self.chain_depth = chain_depth
        self.report: CycleReport | None = None
        self._saved: _SavedGcState | None = None
        self._froze = False

    def __enter__(self) -> CycleAudit:
        if self._saved is not None:
            raise RefitError("CycleAudit is not re-entrant; use a fresh CycleAudit for a nested block")
        self.report = None
        self._saved = _SavedGcState(gc.isenabled(), gc.get_threshold(), gc.get_debug(), list(gc.garbage))
        gc.garbage.clear()
        gc.disable()
        self._froze = gc.get_freeze_count() == 0
        if self._froze:
            gc.freeze()
        else:
            gc.set_debug(0)
            gc.collect()  # audit mode: clear garbage made before the block
        return self

    def __exit__(self, *exc: object) -> None:
        saved, self._saved = self._saved, None
        if saved is None:
            # nothing was frozen or disabled: collecting now would run a full GC outside audit mode
            raise RefitError("CycleAudit.__exit__ without __enter__: use it as `with CycleAudit() as audit:`")
        try:
            added_by_block = list(gc.garbage)
            gc.garbage.clear()
            gc.set_debug(gc.DEBUG_SAVEALL)
            gc.collect()  # audit mode: capture, do not free
            found = list(gc.garbage)
            gc.garbage.clear()
            gc.set_debug(0)
            self.report = self._describe(found, added_by_block)
            del found
            gc.collect()  # audit mode: free what was captured (frozen objects are not scanned)
        finally:
            if self._froze:
                gc.unfreeze()
            gc.set_debug(saved.debug)
            gc.set_threshold(*saved.thresholds)
            gc.garbage[:] = saved.garbage + added_by_block
            if saved.enabled:
                gc.enable()
        if not self.report.clean:
            logger.debug("CycleAudit: %s", self.report.summary())

    def _describe(self, found: list[Any], added_by_block: list[Any]) -> CycleReport:
        by_type = Counter(type_name(obj) for obj in found)
        storages: dict[int, tuple[str, int]] = {}
        tensors: list[tuple[CyclicTensor, Any]] = []
        for obj in found:
            if isinstance(obj, torch.Tensor):
                described = _describe_tensor(obj)
                tensors.append((described, obj))
                storage_key, device, nbytes = _storage_identity(obj)
                storages[storage_key] = (device, nbytes)
        tensor_bytes: dict[str, int] = {}
        for device, nbytes in storages.values():
            tensor_bytes[device] = tensor_bytes.get(device, 0) + nbytes
        tensors.sort(key=lambda item: item[0].storage_bytes, reverse=True)
        target = tensors[0][1] if tensors else (found[0] if found else None)
        chain = referrer_chain(target, found, max_depth=self.chain_depth) if target is not None else ()
        notes = (
            (f"{len(added_by_block)} uncollectable objects added to gc.garbage by the block",) if added_by_block else ()
        )
        return CycleReport(
            cyclic_objects=len(found),
            by_type=dict(by_type.most_common()),
            tensor_bytes=tensor_bytes,
            tensors=tuple(t for t, _ in tensors),
            largest_chain=chain,
            method="freeze" if self._froze else "collect-before",
            notes=notes,
        )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)
    if to_local is not None and type(tensor).__name__ == "DTensor":
        return to_local()
    return tensor


def _describe_tensor(tensor: torch.Tensor) -> CyclicTensor:
    local = _local(tensor)
    nbytes = local.untyped_storage().nbytes() if local.layout == torch.strided else 0
    return CyclicTensor(str(local.device), str(local.dtype).removeprefix("torch."), tuple(local.shape), nbytes)


def _storage_identity(tensor: torch.Tensor) -> tuple[int, str, int]:
    local = _local(tensor)
    if local.layout != torch.strided or local.device.type == "meta":
        return id(local), str(local.device), 0
    storage = local.untyped_storage()
    return storage._cdata, str(local.device), storage.nbytes()


@contextlib.contextmanager
def assert_no_cycles(what: str = "block", *, max_objects: int = 0) -> Iterator[CycleAudit]:
    """Raise ``LeakDetected`` if the block leaves more than ``max_objects`` objects in reference cycles.

    For tests that promise a code path is GC-free (offload rounds, transfer sessions). Runs a
    ``CycleAudit`` (audit mode: it collects).
    """
    audit = CycleAudit()
    with audit:
        yield audit
    if audit.report is None:  # __exit__ always sets it unless it raised, which would not reach here
        raise RefitError(f"assert_no_cycles({what!r}): the audit produced no report")
    if audit.report.cyclic_objects > max_objects:
        raise LeakDetected(f"{what} created cyclic garbage (max_objects={max_objects}): {audit.report.summary()}")
