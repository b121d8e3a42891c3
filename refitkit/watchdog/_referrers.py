"""Naming objects and the references between them, for short human-readable referrer chains."""

from __future__ import annotations

import gc
from typing import Any

import torch


def type_name(obj: Any) -> str:
    """``dict`` for builtins, ``module.Qualname`` for everything else."""
    cls = type(obj)
    if cls.__module__ == "builtins":
        return cls.__qualname__
    return f"{cls.__module__}.{cls.__qualname__}"


def describe(obj: Any) -> str:
    """A short label: tensors get dtype, shape, device and storage size."""
    if isinstance(obj, torch.Tensor):
        try:
            nbytes = obj.untyped_storage().nbytes()
        except (RuntimeError, NotImplementedError):  # sparse, meta-less wrappers
            nbytes = 0
        dtype = str(obj.dtype).removeprefix("torch.")
        return f"{type(obj).__name__}({dtype}{list(obj.shape)} on {obj.device}, {nbytes} B)"
    return type_name(obj)


def _edge(parent: Any, child: Any) -> str:
    """How ``parent`` refers to ``child``: ``['key']``, ``[3]``, ``.attr`` or nothing we can name."""
    if isinstance(parent, dict):
        for key, value in parent.items():
            if value is child:
                return f"[{key!r}]"
        return ""
    if isinstance(parent, (list, tuple)):
        for index, value in enumerate(parent):
            if value is child:
                return f"[{index}]"
        return ""
    attrs = getattr(parent, "__dict__", None)
    if isinstance(attrs, dict):
        if attrs is child:
            return ".__dict__"
        for key, value in attrs.items():
            if value is child:
                return f".{key}"
    return ""


def referrer_chain(target: Any, population: list[Any], *, max_depth: int = 6) -> tuple[str, ...]:
    """Walk from ``target`` up through objects of ``population`` that refer to it, until the cycle closes.

    Only references inside ``population`` (the captured garbage) are followed, so the walk
    costs O(len(population)), not a scan of the whole heap.
    """
    members = {id(obj): obj for obj in population}
    parents: dict[int, list[Any]] = {}
    for obj in population:
        for ref in gc.get_referents(obj):
            if id(ref) in members:
                parents.setdefault(id(ref), []).append(obj)
    chain = [describe(target)]
    seen = {id(target)}
    current = target
    for _ in range(max_depth):
        candidates = parents.get(id(current), [])
        if not candidates:
            break
        fresh = [p for p in candidates if id(p) not in seen]
        if not fresh:
            chain.append(f"(back to {describe(candidates[0])}: cycle closed)")
            break
        parent = fresh[0]
        chain.append(f"{describe(parent)}{_edge(parent, current)}")
        seen.add(id(parent))
        current = parent
    return tuple(chain)
