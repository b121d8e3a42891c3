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

A live engine cannot spare that memory: ``DirectLoads`` learns the same plan from a real sync instead.
It loads each weight it has not met through the engine's loader alone, watching what the loader does
(``torch.overrides.TorchFunctionMode``); a weight the loader copied whole, in one ``copy_`` and with no
other write, into a contiguous run of one parameter (and whose bytes then match) goes straight there
in every later sync: one copy per byte, no loader, small ones batched into one multi-tensor copy.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import astuple, dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from refitkit.errors import InvalidInput

log = logging.getLogger("refitkit.rollout.load_plan")

_POSITION_BITS = 32  # low bits: the element's position in its source; high bits: the source's number + 1
_MAX_ELEMENTS = 1 << _POSITION_BITS
# Direct copies below this go in one multi-tensor copy per bucket (alone they are launch-bound): all of Qwen3-0.6B's
# matrices (2-6 MiB), none of Qwen3-8B's (8-96 MiB), whose copies run faster one by one.
SMALL_COPY_BYTES = 8 << 20


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
                raise InvalidInput(
                    f"load plan: {name!r} lands in {dest.param!r}, which the model does not have (plan of another model?)"
                )
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
            raise InvalidInput(
                f"{item[0]!r} has {math.prod(shape)} elements; the recording encodes positions below 2**{_POSITION_BITS}"
            )
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
            skipped[name] = (
                f"{found[next(iter(found))]} of its {numel} elements landed in {next(iter(found))!r} (sharded or padded)"
            )
        else:
            param_name, offset, _ = runs[number]
            destinations[name] = Destination(param_name, offset, numel, shape, dtypes[param_name])
    log.info("load plan: %d of %d streamed names go direct", len(destinations), len(names))
    return LoadPlan(destinations, skipped)


@dataclass(frozen=True)
class LandedStats:
    """How one sync's weights landed: straight into parameters (``direct``), or through the engine's loader
    (``loader``: of them ``observed`` were met for the first time and watched)."""

    direct_tensors: int = 0
    direct_bytes: int = 0
    loader_tensors: int = 0
    loader_bytes: int = 0
    observed: int = 0

    def __add__(self, other: LandedStats) -> LandedStats:
        return LandedStats(*(a + b for a, b in zip(astuple(self), astuple(other))))


class DirectLoads:
    """Lands streamed weights in a live model: straight into the parameter where the model's own loader was
    seen to copy a weight whole, through ``load_weights`` otherwise (see the module docstring).

    ``begin()`` once per sync (re-resolves the plan if the engine replaced a parameter), then ``land(weights)``
    per bucket: the copies are issued on the current stream, like the loader's own.
    """

    def __init__(self, model: torch.nn.Module, load_weights: Loader) -> None:
        self.model, self.load_weights = model, load_weights
        self.destinations: dict[str, Destination] = {}
        self.skipped: dict[str, str] = {}  # name -> why it goes through the loader
        self._targets: dict[str, torch.Tensor] = {}
        self._bound_to = _BoundParams(model, {})  # the parameters the targets were made from, as they were then

    def begin(self) -> None:
        """Check the plan's parameters are the ones it was bound to (vLLM may swap a parameter's tensor)."""
        if not self.destinations:
            return
        if self._bound_to.unchanged():
            return
        log.info("load plan: the engine's parameters moved since the plan was bound; binding it again")
        self._bind()

    def land(self, weights: list[tuple[str, torch.Tensor]]) -> LandedStats:
        """Land one bucket's ``(name, tensor)`` pairs (views valid during the call)."""
        big: list[tuple[torch.Tensor, torch.Tensor]] = []
        small_targets: list[torch.Tensor] = []
        small_sources: list[torch.Tensor] = []
        loaded: list[tuple[str, torch.Tensor]] = []
        new: list[tuple[str, torch.Tensor]] = []
        direct_bytes = 0
        for name, tensor in weights:
            target = self._targets.get(name)
            if target is not None and target.dtype == tensor.dtype and target.shape == tensor.shape:
                direct_bytes += tensor.nbytes
                if tensor.nbytes < SMALL_COPY_BYTES and tensor.device == target.device:  # one device per batch
                    small_targets.append(target)
                    small_sources.append(tensor)
                else:
                    big.append((target, tensor))
            elif name in self.skipped or name in self.destinations:  # planned, but this tensor is not the planned one
                loaded.append((name, tensor))
            else:
                new.append((name, tensor))
        with torch.no_grad():
            for target, tensor in big:
                target.copy_(tensor)
            if small_targets:
                torch._foreach_copy_(small_targets, small_sources)
            if loaded:
                self.load_weights(loaded)
            try:
                for name, tensor in new:
                    self._observe(name, tensor)
            finally:  # also after a loader error: what was learned before it is used next time
                if new:
                    self._bind()
        return LandedStats(
            direct_tensors=len(big) + len(small_targets),
            direct_bytes=direct_bytes,
            loader_tensors=len(loaded) + len(new),
            loader_bytes=sum(t.nbytes for _, t in loaded + new),
            observed=len(new),
        )

    def _observe(self, name: str, tensor: torch.Tensor) -> None:
        """Load ``name`` through the loader alone, watching it; plan it direct if it only copied it whole."""
        watch = _LoaderWatch()
        with watch:
            self.load_weights([(name, tensor)])
        why, owner = self._not_direct(tensor, watch)
        if owner is None:
            self.skipped[name] = why
            return
        target, _ = watch.copies[0]
        param_name, data = owner
        offset = (target.data_ptr() - data.data_ptr()) // target.element_size()
        self.destinations[name] = Destination(param_name, offset, target.numel(), tuple(target.shape), target.dtype)

    def _not_direct(self, tensor: torch.Tensor, watch: _LoaderWatch) -> tuple[str, tuple[str, torch.Tensor] | None]:
        """Why ``tensor`` cannot go direct, or ("", the parameter that holds its one copy)."""
        if watch.writes:
            return f"the loader wrote with {sorted(set(watch.writes))}", None
        if len(watch.copies) != 1:
            return f"the loader made {len(watch.copies)} copies of it", None
        target, source = watch.copies[0]
        if not isinstance(source, torch.Tensor) or not _same_view(source, tensor) or not tensor.is_contiguous():
            return "the loader copied a transform or a part of it (sharded, transposed or converted)", None
        if target.dtype != tensor.dtype or tuple(target.shape) != tuple(tensor.shape) or not target.is_contiguous():
            return (
                f"it lands as {target.dtype} {tuple(target.shape)} (streamed {tensor.dtype} {tuple(tensor.shape)})",
                None,
            )
        owner = self._owner(target)
        if owner is None:
            return "the loader copied it outside the model's parameters", None
        flat = lambda t: t.reshape(-1).view(torch.uint8)  # noqa: E731
        if not torch.equal(flat(target), flat(tensor).to(target.device)):
            return "its bytes differ from the streamed ones after loading", None
        return "", owner

    def _owner(self, target: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        """The parameter whose contiguous memory holds all of ``target``."""
        start, end = target.data_ptr(), target.data_ptr() + target.nbytes
        for param_name, param in self.model.named_parameters(remove_duplicate=False):
            data = param.data
            if (
                data.is_contiguous()
                and data.dtype == target.dtype
                and data.data_ptr() <= start
                and end <= data.data_ptr() + data.nbytes
            ):
                return param_name, data
        return None

    def _bind(self) -> None:
        try:
            bound = LoadPlan(self.destinations, self.skipped).bind(self.model)
        except InvalidInput as exc:  # the model changed under the plan: learn it again
            log.warning("load plan dropped (%s); the next sync watches the loader again", exc)
            self.destinations.clear()
            self.skipped.clear()
            self._targets, self._bound_to = {}, _BoundParams(self.model, {})
            return
        self._targets = bound.targets
        params = dict(self.model.named_parameters(remove_duplicate=False))
        self._bound_to = _BoundParams(
            self.model, {dest.param: params[dest.param] for dest in self.destinations.values()}
        )


class _BoundParams:
    """Parameters as a plan was bound to them, checked once per sync without walking the whole model: each is still
    the same object under its name (every module on its path the same child of its parent) on the same memory.
    Walking ``named_parameters()`` for that took 0.5-1 ms per sync of a 0.6B model in vLLM (the worker's hello waited on it).

    The data pointers are read with tensor-subclass dispatch off: vLLM's parameters are subclasses with a Python
    ``__torch_function__``, through which each ``data_ptr()`` cost 3 µs, 0.7 ms for Qwen3-0.6B's 227 per sync (on
    the worker's path before its hello). The pointer read is the same either way."""

    def __init__(self, model: torch.nn.Module, params: dict[str, torch.nn.Parameter]) -> None:
        links: dict[str, tuple[torch.nn.Module, str, torch.nn.Module]] = {}  # module path -> (parent, name, module)
        self._leaves: list[
            tuple[torch.nn.Module, str, torch.nn.Parameter, int]
        ] = []  # owner, attribute, param, data_ptr
        for name, param in params.items():
            *path, attribute = name.split(".")
            module = model
            for depth, part in enumerate(path):
                child = module._modules[part]
                links[".".join(path[: depth + 1])] = (module, part, child)  # type: ignore[assignment]
                module = child  # type: ignore[assignment]
            self._leaves.append((module, attribute, param, _data_pointer(param)))
        self._links = list(links.values())

    def unchanged(self) -> bool:
        if not all(parent._modules.get(part) is child for parent, part, child in self._links):
            return False
        with torch._C.DisableTorchFunctionSubclass():
            return all(
                owner._parameters.get(attribute) is param and param.data_ptr() == pointer
                for owner, attribute, param, pointer in self._leaves
            )


def _data_pointer(tensor: torch.Tensor) -> int:
    with torch._C.DisableTorchFunctionSubclass():  # (see _BoundParams)
        return tensor.data_ptr()


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()


_WRITES = frozenset({"__setitem__", "__set__", "__delitem__"})


class _LoaderWatch(TorchFunctionMode):
    """What one loader call does through torch: its ``copy_`` calls (target, source) and any other write."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[tuple[torch.Tensor, Any]] = []
        self.writes: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_:
            self.copies.append((args[0], args[1]))
        elif _is_write(func, kwargs) and not _writes_nothing(func, args, kwargs):
            self.writes.append(getattr(func, "__name__", repr(func)))
        return func(*args, **kwargs)


def _writes_nothing(func: Any, args: tuple, kwargs: dict) -> bool:
    """An in-place op on an empty tensor (vLLM's embedding loader zero-fills its padding rows, often none)."""
    written = kwargs.get("out", args[0] if args else None)
    return getattr(func, "__name__", "") != "__set__" and isinstance(written, torch.Tensor) and written.numel() == 0


def _is_write(func: Any, kwargs: dict) -> bool:
    """In place (``fill_``, ``__iadd__``), an item or ``.data`` assignment, or an ``out=`` argument."""
    name = getattr(func, "__name__", "")
    in_place = name.endswith("_") and not name.endswith("__")
    return in_place or name in _WRITES or name.startswith("__i") or kwargs.get("out") is not None
