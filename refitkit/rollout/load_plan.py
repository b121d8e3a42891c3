"""Where each streamed weight lands in an engine's parameters: a load plan taken once from the engine's own loaders.

An engine such as vLLM fuses Hugging Face weights (q/k/v rows into ``qkv_proj``, gate/up rows into
``gate_up_proj``) and may shard, transpose, repack or convert them. ``record_load_plan`` runs the
engine's own ``load_weights`` once on *recording* tensors: every parameter is swapped for an int64
tensor of -1 and every streamed name gets an int64 source whose elements encode (name number,
position). Afterwards each parameter tells exactly where each source element went. A name whose
elements landed, in order, in one contiguous run of one parameter's memory (the whole parameter, or
rows of a fused one) gets a ``Destination``; anything else (transposed, sharded, repacked, scaled,
spread over several parameters) is left to the ordinary path, with the reason kept in ``skipped``.

``plan.bind(model)`` resolves the destinations against the live parameters; the bound plan is what a
broadcast receiver takes as ``direct=`` to land those weights straight into parameter memory.
A streamed weight whose dtype or shape is not the one planned falls back to the bucket path (the
receiver logs why), so a stale plan costs speed, never correctness.

Recording holds 8 bytes per parameter element on the parameters' device for the duration of the
call (the originals are put back afterwards): take the plan on the host, or on a model instance made
for that purpose (e.g. the engine's model class built directly, before weights are post-processed).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from refitkit.errors import InvalidInput

log = logging.getLogger("refitkit.rollout.load_plan")

_POSITION_BITS = 32  # low bits: the element's position in its source; high bits: the source's number + 1
_MAX_ELEMENTS = 1 << _POSITION_BITS


@dataclass(frozen=True)
class Destination:
    """A streamed weight lands as ``numel`` elements at element ``offset`` of ``param`` (contiguous memory), viewed
    as ``shape``; ``dtype`` is the parameter's, which the streamed tensor must match to go direct."""

    param: str
    offset: int
    numel: int
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class LoadPlan:
    """Per streamed name, its ``Destination``; ``skipped`` maps every other recorded name to why it is not direct."""

    destinations: Mapping[str, Destination]
    skipped: Mapping[str, str] = field(default_factory=dict)

    def bind(self, model: torch.nn.Module) -> BoundPlan:
        """The plan against ``model``'s live parameters (checked now: same dtype, enough contiguous elements)."""
        params = dict(model.named_parameters(remove_duplicate=False))
        targets: dict[str, torch.Tensor] = {}
        for name, dest in self.destinations.items():
            param = params.get(dest.param)
            if param is None:
                raise InvalidInput(f"load plan: {name!r} lands in {dest.param!r}, which the model does not have (plan of another model?)")
            data = param.data
            if data.dtype != dest.dtype or not data.is_contiguous() or dest.offset + dest.numel > data.numel():
                raise InvalidInput(
                    f"load plan: {name!r} lands in {dest.param!r} at elements {dest.offset}..{dest.offset + dest.numel}, "
                    f"but that parameter is now {data.dtype} {tuple(data.shape)} (contiguous={data.is_contiguous()}); "
                    "take the plan again on this model"
                )
            targets[name] = data.view(-1)[dest.offset : dest.offset + dest.numel].view(dest.shape)
        return BoundPlan(targets)


class BoundPlan:
    """A plan resolved to parameter memory: ``bound(name, dtype, shape)`` is the view to receive into, or None."""

    def __init__(self, targets: dict[str, torch.Tensor]) -> None:
        self.targets = targets

    def __call__(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor | None:
        return self.targets.get(name)

    def __len__(self) -> int:
        return len(self.targets)


Loader = Callable[[Iterable[tuple[str, torch.Tensor]]], Any]


def record_load_plan(
    model: torch.nn.Module, load_weights: Loader, streamed: Iterable[tuple[str, tuple[int, ...]]]
) -> LoadPlan:
    """Run ``load_weights`` (the engine's own, e.g. ``model.load_weights``) once on recording tensors for every
    ``(name, shape)`` in ``streamed``; return where each name landed. The model's parameters are put back as they
    were, whatever happens."""
    names: list[tuple[str, tuple[int, ...]]] = []
    for index, item in enumerate(streamed):
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise InvalidInput(f"streamed item {index} is {item!r}; expected (name, shape)")
        shape = tuple(int(size) for size in item[1])
        if math.prod(shape) >= _MAX_ELEMENTS:
            raise InvalidInput(f"{item[0]!r} has {math.prod(shape)} elements; the recording encodes positions below 2**{_POSITION_BITS}")
        names.append((item[0], shape))
    params = dict(model.named_parameters(remove_duplicate=False))
    saved = {name: param.data for name, param in params.items()}
    dtypes = {name: data.dtype for name, data in saved.items()}
    grads = {name: param.requires_grad for name, param in params.items()}
    try:
        for name, param in params.items():
            param.requires_grad_(False)  # an int64 .data is refused on a parameter that requires grad
            param.data = torch.full(saved[name].shape, -1, dtype=torch.int64, device=saved[name].device)
        sources = (
            (name, ((number + 1) << _POSITION_BITS) + torch.arange(math.prod(shape), dtype=torch.int64).view(shape))
            for number, (name, shape) in enumerate(names)
        )
        with torch.no_grad():
            load_weights(sources)
        landed = {name: param.data for name, param in params.items()}
    finally:
        for name, param in params.items():
            param.data = saved[name]
            param.requires_grad_(grads[name])
    return _read_recording(names, landed, dtypes)


def _read_recording(
    names: list[tuple[str, tuple[int, ...]]], landed: dict[str, torch.Tensor], dtypes: dict[str, torch.dtype]
) -> LoadPlan:
    elements: dict[int, dict[str, int]] = {}  # source number -> {param: elements of it there}
    runs: dict[int, tuple[str, int, int]] = {}  # source number -> (param, offset, first position) of its only run
    scattered: set[int] = set()  # sources whose elements form more than one in-order run in some parameter
    seen_storage: set[int] = set()
    for param_name, data in landed.items():
        if data.untyped_storage().data_ptr() in seen_storage:  # tied weights: one memory, read once
            continue
        seen_storage.add(data.untyped_storage().data_ptr())
        flat = data.reshape(-1).cpu()
        where = torch.nonzero(flat >= _MAX_ELEMENTS).view(-1)
        if not where.numel():
            continue
        values = flat[where]
        owners, positions = values >> _POSITION_BITS, values & (_MAX_ELEMENTS - 1)
        offsets = where - positions  # constant along a run that keeps its source's order
        cut = (owners[1:] != owners[:-1]) | (offsets[1:] != offsets[:-1]) | (where[1:] != where[:-1] + 1)
        starts = torch.cat([torch.zeros(1, dtype=torch.int64), torch.nonzero(cut).view(-1) + 1])
        run_owners = owners[starts]
        numbers, run_counts = torch.unique(run_owners, return_counts=True)
        owner_runs, owner_counts = torch.unique_consecutive(owners, return_counts=True)  # no sort of every element
        for number, count in zip(owner_runs.tolist(), owner_counts.tolist()):
            mine = elements.setdefault(number - 1, {})
            mine[param_name] = mine.get(param_name, 0) + count
        scattered.update(number - 1 for number in numbers[run_counts > 1].tolist())
        single = set(numbers[run_counts == 1].tolist())
        for start in starts.tolist():
            number = int(owners[start])
            if number in single:
                runs[number - 1] = (param_name, int(offsets[start]), int(positions[start]))
    destinations: dict[str, Destination] = {}
    skipped: dict[str, str] = {}
    for number, (name, shape) in enumerate(names):
        found = elements.get(number, {})
        numel = math.prod(shape)
        if not found:
            skipped[name] = "the loader put none of its elements in a parameter (dropped, or held outside parameters)"
        elif len(found) > 1:
            skipped[name] = f"its elements went to several parameters ({', '.join(sorted(found))})"
        elif number in scattered:
            skipped[name] = f"its elements landed in {next(iter(found))!r} out of order (transposed or repacked)"
        elif found[next(iter(found))] != numel or runs[number][2] != 0:
            skipped[name] = f"{found[next(iter(found))]} of its {numel} elements landed in {next(iter(found))!r} (sharded or padded)"
        else:
            param_name, offset, _ = runs[number]
            destinations[name] = Destination(param_name, offset, numel, shape, dtypes[param_name])
    log.info("load plan: %d of %d streamed names go direct", len(destinations), len(names))
    return LoadPlan(destinations, skipped)

