"""Deferred reload: storages regrown and copied back behind the caller, waited for before first use.

``reload_deferred`` validates like ``reload_tensors`` and returns at once; a worker thread regrows
each storage and copies its bytes from the arena (on CUDA it issues the copies on a side stream
and records an event; on CPU it does the copies itself). ``DeferredReload.wait`` is the one place
that waits: bounded by ``timeout_s``, then, on CUDA, the caller's stream waits for the side
stream's event (the host does not block on the copies). ``StepGate`` makes an optimizer's
``step``, ``state_dict`` and ``load_state_dict`` do that wait through torch's pre-hooks, removed
once the state has arrived.

A reload that fails frees what it regrew; the slots still hold the bytes, so the same reload can
be retried (as with ``reload_tensors``). The failure is raised by ``wait``, naming the tensor.
"""

from __future__ import annotations

import enum
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Sequence

import torch
from torch.utils.hooks import RemovableHandle

from refitkit._knobs import checked_seconds
from refitkit.errors import DeferredTimeout, RefitError
from refitkit.offload.arena import HostArena, Slot
from refitkit.offload.device import SegmentedRegrow, storage_as_bytes
from refitkit.offload.moves import StorageGroup, TensorSet, _common_device, finish_reload, named_tensors, reload_plan
from refitkit.offload.stats import EMPTY_MOVE, MoveStats

BeforeCopy = Callable[[str], None]


class ArrivalState(enum.Enum):
    """Where a deferred reload stands."""

    COPYING = "copying"  # the worker is regrowing storages and issuing copies
    ISSUED = "issued"  # every copy done (CPU) or queued behind the side stream's event (CUDA)
    ARRIVED = "arrived"  # waited for: the storages may be used, the arena slots are free again
    FAILED = "failed"  # rolled back: the storages are freed, the arena still holds their bytes


class DeferredReload:
    """One deferred reload: its worker, its side stream and event, and its outcome."""

    def __init__(
        self,
        pending: list[tuple[StorageGroup, Slot]],
        arena: HostArena,
        *,
        timeout_s: float,
        what: str,
        before_copy: BeforeCopy | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        self.what = what  # e.g. "FSDPAdapter's optimizer state", for messages
        self.nbytes = sum(slot.nbytes for _, slot in pending)
        self.storages = len(pending)
        self._pending = pending
        self._arena = arena
        self._before_copy = before_copy
        self._issued = threading.Event()
        self._state = ArrivalState.COPYING if pending else ArrivalState.ISSUED
        self._failure: str | None = None  # why the reload failed, raised as a fresh RefitError by each wait()
        self._worker_trace = ""  # the worker's error as text: the object would hold its frame, which holds self
        self._copying = ""  # the tensor the worker is on, for a timeout's message
        self._copied = 0
        self._start = time.perf_counter()
        self.device = _common_device([group for group, _ in pending], "reload_deferred") if pending else None
        self._stream: torch.cuda.Stream | None = None
        self._event: torch.cuda.Event | None = None
        if self.device is not None and self.device.type == "cuda":
            self._stream = torch.cuda.Stream(device=self.device)
            self._event = torch.cuda.Event()
            # the side stream starts after everything the caller queued so far
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        if not pending:
            self._issued.set()
            return
        self._worker = threading.Thread(target=self._copy_all, name="refitkit-deferred-reload", daemon=True)
        self._worker.start()

    @property
    def state(self) -> ArrivalState:
        return self._state

    def _copy_all(self) -> None:
        regrown: list[StorageGroup] = []
        try:
            with _on_stream(self._stream):
                # shared segments for the state (their free blocks belong to this stream's pool, where the regrows look)
                segments = SegmentedRegrow(self.device, [slot.nbytes for _, slot in self._pending])
                for index, (group, slot) in enumerate(self._pending):
                    self._copying = group.first_name
                    if self._before_copy is not None:
                        self._before_copy(group.first_name)
                    segments.before(index)
                    group.storage.resize_(slot.nbytes)
                    regrown.append(group)
                    storage_as_bytes(group.storage).copy_(self._arena.host_bytes(slot, slot.nbytes), non_blocking=True)
                    self._copied += 1
                if self._event is not None:
                    self._event.record(self._stream)
            self._state = ArrivalState.ISSUED
        except BaseException as error:  # whatever stopped the worker, wait() must not report success
            self._roll_back(regrown)
            self._failure = (
                f"the deferred reload of {self.what} failed while restoring {self._copying!r} on {self.device} "
                f"({type(error).__name__}: {error}); every storage of it was freed again and its bytes are still "
                "in the arena: free device memory (e.g. the inference engine's KV cache) and call reload() again"
            )
            self._worker_trace = "".join(traceback.format_exception(error)).rstrip()
            self._state = ArrivalState.FAILED
        finally:
            self._issued.set()

    def _roll_back(self, regrown: list[StorageGroup]) -> None:
        """Free what was regrown once its queued copies are done; the arena keeps every byte."""
        try:
            if self._stream is not None:
                self._stream.synchronize()  # a queued copy may still write into a storage about to be freed
        finally:
            for group in regrown:
                group.storage.resize_(0)

    def _failed(self) -> RefitError:
        """A fresh error per raise: re-raising one object would grow its traceback by every step's frames."""
        note = f"refitkit: the deferred reload's worker failed with:\n{self._worker_trace}"
        if not hasattr(BaseException, "add_note"):  # Python 3.10: the worker's trace goes in the message
            return RefitError(f"{self._failure}\n{note}")
        failed = RefitError(self._failure)
        failed.add_note(note)
        return failed

    def wait(self, timeout_s: float | None = None) -> MoveStats:
        """Wait (bounded) until the storages may be used by the caller's stream; raise the reload's failure.

        Idempotent: after ARRIVED it returns at once; after FAILED it raises the same failure again
        (a new ``RefitError`` each time, with the same message).
        """
        if self._state is ArrivalState.ARRIVED:
            return EMPTY_MOVE
        limit = self.timeout_s if timeout_s is None else checked_seconds(timeout_s, "deferred_timeout_s")
        if not self._issued.wait(limit):
            raise DeferredTimeout(
                f"{self.what} (reload(defer_optimizer=True): {self.storages} storages, {self.nbytes} bytes) did not "
                f"arrive within deferred_timeout_s={limit:g} s: {self._copied} copied, still on {self._copying!r}; "
                "nothing was lost (a later wait continues); raise deferred_timeout_s if the host is that slow"
            )
        if self._failure is not None:
            raise self._failed()
        if self._event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(self._event)  # the GPU orders the step after the copies; the host does not block
            for group, _ in self._pending:
                # allocated on the side stream, now used on this one: a later free must wait for this stream too
                storage_as_bytes(group.storage).record_stream(current)
        self._state = ArrivalState.ARRIVED
        return finish_reload(self._pending, self._arena, seconds=time.perf_counter() - self._start)


def reload_deferred(
    tensors: TensorSet,
    arena: HostArena,
    *,
    timeout_s: float = 300.0,
    what: str = "the deferred tensors",
    before_copy: BeforeCopy | None = None,
) -> DeferredReload:
    """Start restoring ``tensors`` from ``arena`` behind the caller; ``.wait()`` before using them.

    Validated exactly like ``reload_tensors`` before anything moves. ``before_copy(name)`` runs in
    the worker before each storage is regrown (for diagnostics and tests: it lets a test hold the
    copies back deterministically).
    """
    timeout_s = checked_seconds(timeout_s, "deferred_timeout_s")
    pending = reload_plan(named_tensors(tensors), arena)
    return DeferredReload(pending, arena, timeout_s=timeout_s, what=what, before_copy=before_copy)


class StepGate:
    """Hooks on each optimizer that wait for a deferred reload before its state is touched.

    Per optimizer: a ``step`` pre-hook, a ``state_dict`` pre-hook (checkpoints read the state's
    storages) and a ``load_state_dict`` pre-hook (values loaded before the copies land would be
    overwritten by them). They are removed once the state arrived. ``on_arrival`` (held weakly
    when it is a bound method, so the hooks never keep an adapter alive) runs once after the state
    arrived; ``on_failure(error)`` once, when the reload's failure is first raised.
    """

    def __init__(
        self,
        deferred: DeferredReload,
        optimizers: Sequence[torch.optim.Optimizer],
        *,
        on_arrival: Callable[[], None] | None = None,
        on_failure: Callable[[RefitError], None] | None = None,
    ) -> None:
        self.deferred = deferred
        self._on_arrival = _weak_callable(on_arrival)
        self._on_failure = _weak_callable(on_failure)
        self.reported = False  # the reload's failure was raised (to a step or to the owner)
        self._arrived = False  # on_arrival ran
        self._hooks: list[_GateHook] = []
        for optimizer in optimizers:
            self._hooks += [
                _GateHook(self, optimizer.register_step_pre_hook, optimizer.register_step_post_hook),
                _GateHook(self, optimizer.register_state_dict_pre_hook, optimizer.register_state_dict_post_hook),
                _GateHook(
                    self, optimizer.register_load_state_dict_pre_hook, optimizer.register_load_state_dict_post_hook
                ),
            ]

    def wait(self, *, running: _GateHook | None = None) -> None:
        """Wait for the deferred reload (bounded); on arrival the hooks are removed.

        On failure the hooks stay, so every later step or state-dict call raises too (the state is
        not there) until the owner reloads and ``remove()``s this gate; ``reported`` says the
        failure was raised. ``running``: the hook torch is calling now (see ``remove``).
        """
        try:
            self.deferred.wait()
        except DeferredTimeout:
            raise  # still copying: keep the hooks, a later call waits again
        except RefitError as error:
            if not self.reported:
                self.reported = True
                callback = self._on_failure()
                if callback is not None:
                    callback(error)
            raise
        self.remove(running=running)
        if not self._arrived:
            self._arrived = True
            callback = self._on_arrival()
            if callback is not None:
                callback()

    def remove(self, *, running: _GateHook | None = None) -> None:
        """Remove the hooks (``running``, the one torch is calling now, may go right after the call)."""
        for hook in self._hooks:
            hook.remove(running=hook is running)
        self._hooks.clear()


class _GateHook:
    """One of a gate's pre-hooks on one optimizer (step, state_dict or load_state_dict)."""

    def __init__(
        self,
        gate: StepGate,
        register: Callable[[Callable], RemovableHandle],
        register_post: Callable[[Callable], RemovableHandle],
    ) -> None:
        self._gate = gate
        self._register_post = register_post
        self._post: RemovableHandle | None = None
        self._removing = False  # the gate is done with it
        self.handle = register(self)

    def __call__(self, optimizer: torch.optim.Optimizer, *args: object) -> None:
        # returns None for every kind: the step's args, the state dict to load, stay as they are
        if self._removing:  # still here: the call it was to go after raised before its post-hooks
            self.remove(running=True)
            return
        self._gate.wait(running=self)

    def remove(self, *, running: bool) -> None:
        """Remove this hook now, or right after the call that runs it when a later hook is still to come.

        torch loops over an optimizer's hooks in an OrderedDict: removing the running hook before
        the loop's end raises "OrderedDict mutated during iteration" in the caller's step or
        state_dict call. A post-hook of the same call (another dict) removes it instead.
        """
        self._removing = True
        if not running or _is_last(self.handle):
            self.handle.remove()
        elif self._post is None:
            self._post = self._register_post(self._remove_after_call)

    def _remove_after_call(self, optimizer: torch.optim.Optimizer, *args: object) -> None:
        self.handle.remove()
        if self._post is not None and _is_last(self._post):  # else it goes at its next call
            self._post.remove()


def _is_last(handle: RemovableHandle) -> bool:
    """Whether the hook is the last in its dict: a loop over the dict ends right after it, so it may go."""
    hooks = handle.hooks_dict_ref()
    return hooks is None or not hooks or next(reversed(hooks)) == handle.id


class _on_stream:
    """``torch.cuda.stream(stream)`` with the stream's device current, or nothing without a stream."""

    def __init__(self, stream: torch.cuda.Stream | None) -> None:
        self._stream = stream
        self._contexts: list = []

    def __enter__(self) -> None:
        if self._stream is not None:
            self._contexts = [torch.cuda.device(self._stream.device), torch.cuda.stream(self._stream)]
            for context in self._contexts:
                context.__enter__()

    def __exit__(self, *exc_info: object) -> None:
        for context in reversed(self._contexts):
            context.__exit__(*exc_info)


def _weak_callable(fn: Callable | None) -> Callable[[], Callable | None]:
    if fn is None:
        return lambda: None
    if hasattr(fn, "__self__") and hasattr(fn, "__func__"):
        return weakref.WeakMethod(fn)
    return lambda: fn
