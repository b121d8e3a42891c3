"""View records: what each tensor looked like when its storage left the device, checked at reload and reused.

A record is taken again by the next offload of the same tensor while it still describes it (same tensor, name,
storage, shape, stride, offset and dtype): a record made anew each round lives from one move to the next and is
promoted to the collector's oldest generation.
"""

from __future__ import annotations

import weakref

import torch

from refitkit.errors import InvalidInput
from refitkit.offload.arena import HostArena, ViewRecord

# Resident records beyond twice those alive at the last sweep (or a reload's) are checked for dead tensors: each
# sweep is paid for by as many new records, so small reloads beside many live records do not sweep every time.
RESIDENT_SLACK = 1024
Records = dict[int, ViewRecord]  # id(tensor) -> what it looked like when its storage left the device


def _same_view(record: ViewRecord, tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` still has the shape, stride, offset and dtype ``record`` says it had."""
    return (
        record.shape == tensor.shape
        and record.stride == tensor.stride()
        and record.storage_offset == tensor.storage_offset()
        and record.dtype == tensor.dtype
    )


def _view_records(key: int, views: list[tuple[str, torch.Tensor]], records: Records, resident: Records) -> None:
    """Each view's record (of the storage ``key``): its record of the last round (``resident``) when it still
    describes it, else a new one."""
    for name, t in views:
        old = resident.pop(id(t), None)
        reusable = old is not None and old.tensor_ref() is t and old.name == name and old.storage_key == key
        if reusable and _same_view(old, t):  # type: ignore[union-attr]
            records[id(t)] = old
        else:
            records[id(t)] = ViewRecord(
                weakref.ref(t), name, key, tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype
            )


def _check_views(arena: HostArena, named: list[tuple[str, torch.Tensor]]) -> None:
    """Refuse tensors that were replaced (new storage) or re-viewed since they were offloaded."""
    for name, tensor in named:
        record = arena.views.get(id(tensor))
        if record is None or record.tensor_ref() is not tensor:
            continue
        if tensor.untyped_storage()._cdata != record.storage_key:
            raise InvalidInput(
                f"{name!r} was replaced between offload and reload (it now points at another storage, "
                "e.g. after `.data = ...` or `set_()`); its offloaded bytes were kept, nothing was restored"
            )
        if not _same_view(record, tensor):
            now = (tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset(), tensor.dtype)
            before = (record.shape, record.stride, record.storage_offset, record.dtype)
            raise InvalidInput(
                f"{name!r} was resized or re-viewed between offload and reload: (shape, stride, offset, dtype) "
                f"was {before}, now {now}; nothing was restored"
            )


def _views_of(arena: HostArena, keys: set[int]) -> list[int]:
    """The view records of these storages (and of tensors that died), by key."""
    return [i for i, r in arena.views.items() if r.storage_key in keys or r.tensor_ref() is None]


def _forget_views(arena: HostArena, keys: set[int]) -> None:
    for tensor_id in _views_of(arena, keys):
        del arena.views[tensor_id]


def _keep_resident(arena: HostArena, restored_views: list[int], popped: Records | None) -> None:
    """Move the records of restored views from ``arena.views`` to ``arena.resident_views`` (for the next offload;
    ``popped`` collects them, so a failed reload can put them back), sweeping out dead tensors' records now and then."""
    resident = arena.resident_views
    for tensor_id in restored_views:
        record = arena.views.pop(tensor_id, None)
        if record is not None:
            resident[tensor_id] = record
            if popped is not None:
                popped[tensor_id] = record
    if len(resident) > 2 * max(arena.resident_alive, len(restored_views)) + RESIDENT_SLACK:
        arena.resident_views = {key: record for key, record in resident.items() if record.tensor_ref() is not None}
        arena.resident_alive = len(arena.resident_views)
