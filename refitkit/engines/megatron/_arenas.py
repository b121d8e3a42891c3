"""Where the module-level Megatron functions keep their host memory between calls.

Each model chunk and each leaf Megatron optimizer is bound to one ``HostArena`` the first time
it is offloaded, held in a ``WeakKeyDictionary`` so the arena lives exactly as long as the
object. Objects offloaded together share one arena (one copy phase, one synchronize); an
arena is allocated once and reused every round.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

from refitkit.errors import InvalidInput
from refitkit.offload import HostArena

_ARENAS: weakref.WeakKeyDictionary[object, HostArena] = weakref.WeakKeyDictionary()


def arena_of(obj: object) -> HostArena | None:
    """The arena holding ``obj``'s offloaded storages (a model chunk or leaf optimizer), if any."""
    return _ARENAS.get(obj)


def arena_groups(objects: Sequence[object]) -> list[tuple[HostArena, list[object]]]:
    """Group objects by arena; objects without one join the first arena found, or a new one, for good."""
    groups: dict[int, tuple[HostArena, list[object]]] = {}
    unbound: list[object] = []
    for obj in objects:
        arena = _ARENAS.get(obj)
        if arena is None:
            unbound.append(obj)
        else:
            groups.setdefault(id(arena), (arena, []))[1].append(obj)
    if unbound:
        arena, members = next(iter(groups.values())) if groups else (HostArena(), [])
        for obj in unbound:
            _ARENAS[obj] = arena
        members.extend(unbound)
        groups.setdefault(id(arena), (arena, members))
    return list(groups.values())


def bind(objects: Sequence[object], arena: HostArena) -> None:
    """Make ``arena`` the arena of every object (an adapter sharing memory with the functions).

    Refuses to rebind an object whose current arena still holds data: that data would be lost
    to later reloads.
    """
    for obj in objects:
        current = _ARENAS.get(obj)
        if current is not None and current is not arena and current.held_bytes > 0:
            raise InvalidInput(
                f"{type(obj).__name__} has {current.held_bytes} bytes offloaded in another HostArena; "
                "reload it before handing it to a new adapter"
            )
    for obj in objects:
        _ARENAS[obj] = arena


def shared_arena(objects: Sequence[object]) -> HostArena:
    """One arena for all ``objects``: an existing one of theirs (no other holding data), else new."""
    arenas = {id(a): a for a in (_ARENAS.get(o) for o in objects) if a is not None}
    holding = [a for a in arenas.values() if a.held_bytes > 0]
    if len(holding) > 1:
        raise InvalidInput(
            f"these objects hold offloaded data in {len(holding)} different HostArenas; reload them "
            "(load_megatron_model_to_gpu / load_megatron_optimizer) before sharing one arena"
        )
    arena = holding[0] if holding else (next(iter(arenas.values())) if arenas else HostArena())
    bind(objects, arena)
    return arena
