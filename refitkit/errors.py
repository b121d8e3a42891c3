"""One hierarchy for every error refitkit raises; each message names the tensor, peer, phase and knob."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar


class RefitError(RuntimeError):
    """Base of every refitkit error.

    ``recovery``: when a ``RefitCycle`` call failed across ranks and left state it could not bring back by itself,
    the one call that recovers, made on every rank (e.g. ``"call cycle.resume() on every rank"``); the message says
    it too. ``None``: nothing to call (every rank is as the failed call found it).
    """

    recovery: str | None = None
    # The keyword fields its constructor takes after the message: with the class's name (its code), what crosses from
    # another process when it was raised there (``error_record`` / ``error_from_record``).
    fields: ClassVar[tuple[str, ...]] = ()


class InvalidInput(RefitError, ValueError):
    """A bad argument caught at the boundary, before anything moved."""


class TransferError(RefitError):
    """A weight transfer failed. When the peer reported why, it carries the peer's report (``remote_message``), the
    type of the peer's own exception (``remote_type``, e.g. ``"RuntimeError"``) and the last frames of its traceback as
    text (``remote_traceback``), and its ``__cause__`` is a ``RemoteError`` standing for that exception."""

    fields = ("remote_message", "remote_type", "remote_traceback")

    def __init__(
        self,
        message: str,
        *,
        remote_message: str | None = None,
        remote_type: str | None = None,
        remote_traceback: str | None = None,
    ) -> None:
        super().__init__(message)
        self.remote_message = remote_message
        self.remote_type = remote_type
        self.remote_traceback = remote_traceback


class RemoteError(RefitError):
    """The peer's own exception, rebuilt here from what its report carried as data (its type's name, its message and
    its traceback's last frames as text: nothing executable crosses the wire). Never raised on its own: it is the
    ``__cause__`` of the error the peer's report raised here, so a traceback shows the peer's failure first.

    ``error``: when the peer's exception was one of refitkit's errors that cross (``error_record``), that error rebuilt
    here from its code and fields (e.g. the ``EngineAsleep`` an engine rank refused a push with); None otherwise."""

    def __init__(
        self,
        remote_type: str,
        remote_message: str,
        remote_traceback: str | None = None,
        *,
        error: RefitError | None = None,
    ) -> None:
        text = f"{remote_type}: {remote_message}"
        if remote_traceback:
            text += f"\n--- on the peer ---\n{remote_traceback.rstrip()}"
        super().__init__(text)
        self.remote_type, self.remote_message, self.remote_traceback = remote_type, remote_message, remote_traceback
        self.error = error


class TransferTimeout(TransferError, TimeoutError):
    """A bounded wait in a transfer session ran out (dead or silent peer)."""


class PeerGone(TransferTimeout):
    """The peer's connection broke (it died or gave up): its connection closed while a wait was on, a send to it was
    refused at once, or a collective failed. Nothing timed out, but the caller handles it as the timeout it would
    otherwise have become."""


class ChannelClosed(TransferError):
    """A transfer channel was used after ``close()``, or in a process other than the one that opened it (a forked
    child: open a channel of its own there)."""


class ProtocolError(TransferError):
    """A frame on the socket was not a valid refitkit message (wrong version, unknown kind, garbage)."""


class BarrierTimeout(RefitError, TimeoutError):
    """Trainer ranks did not line up within the barrier's timeout; the rank group it ran on is spent (``recovery``)."""

    def __init__(self, message: str, *, recovery: str | None = None) -> None:
        super().__init__(message)
        self.recovery = recovery


class ReserveTimeout(RefitError, TimeoutError):
    """A background reservation did not finish allocating and pinning within the wait's bound."""


class LeakDetected(RefitError):
    """A watchdog saw memory grow across cycles, or an audit found retained memory."""


class RankFailure(RefitError):
    """A refit phase failed on another trainer rank; every rank raises after a bounded exchange.

    ``failures`` maps each failed rank to ``"<error type>: <message>"``; ``recovery`` (see ``RefitError``).
    """

    def __init__(self, message: str, *, failures: dict[int, str], recovery: str | None = None) -> None:
        super().__init__(message)
        self.failures = failures
        self.recovery = recovery


class RecoveryNeeded(RefitError):
    """A refit phase failed on this rank and left state the cycle could not bring back by itself: ``recovery`` names
    the one call to make on every rank (the other ranks raise ``RankFailure`` with the same ``recovery``).

    The rank's own error is the cause (``__cause__``); ``failures`` as in ``RankFailure``.
    """

    def __init__(self, message: str, *, failures: dict[int, str], recovery: str) -> None:
        super().__init__(message)
        self.failures = failures
        self.recovery = recovery


class DeferredTimeout(RefitError, TimeoutError):
    """State reloaded with ``defer_optimizer=True`` did not arrive within ``deferred_timeout_s``; nothing was lost."""


class EngineError(RefitError):
    """The inference engine refused or failed a phase of the cycle (wake, sleep, receive); names the phase."""


class EngineAsleep(EngineError):
    """A push was refused because the engine's weights are asleep (vLLM crashes when weights change while asleep)."""


class KVCacheWontFit(EngineError):
    """Waking the engine's KV cache was refused: its bytes exceed the device's free memory (the trainer still holds it).

    ``needed_bytes`` and ``free_bytes`` are the figures the refusal was based on; the engine keeps serving as it was.
    """

    fields = ("needed_bytes", "free_bytes")

    def __init__(self, message: str, *, needed_bytes: int, free_bytes: int) -> None:
        super().__init__(message)
        self.needed_bytes, self.free_bytes = needed_bytes, free_bytes


class EngineTimeout(EngineError, TimeoutError):
    """A call into the engine (sleep, wake-up, an rpc) did not return within its bound."""


class LinkClosed(RefitError):
    """An engine link (``VllmLink``, ``SglangLink``, ``BroadcastLink``) was used after its ``close()``, or in a process
    other than the one that made it (a forked child has none of the link's helper threads): make a new link there."""


class OffloadedStateError(RefitError):
    """A call that reads or saves training state ran while that state is offloaded (0-byte device storages):
    a forward, ``state_dict()`` or an optimizer step would crash the process or save garbage. Reload first."""


class WeightRejected(EngineError):
    """The engine refused a pushed weight once the push had begun (weights before it may have landed: the engine then
    reports its weights incomplete until a full push lands).

    ``weight``, its pushed ``shape``, the shape in the checkpoint the engine loaded (``expected_shape``; None where
    unknown), which ``engine`` rank and ``phase``; ``remote_type`` and ``remote_message``: the engine's own error,
    carried as data where it was raised in another process (None where refitkit refused the weight itself).
    """

    fields = ("weight", "shape", "expected_shape", "engine", "phase", "remote_type", "remote_message")

    def __init__(
        self,
        message: str,
        *,
        weight: str,
        shape: tuple[int, ...] | None,
        expected_shape: tuple[int, ...] | None,
        engine: str,
        phase: str,
        remote_type: str | None = None,
        remote_message: str | None = None,
    ) -> None:
        super().__init__(message)
        self.weight, self.shape, self.expected_shape = weight, shape, expected_shape
        self.engine, self.phase = engine, phase
        self.remote_type, self.remote_message = remote_type, remote_message


class UnknownWeight(WeightRejected):
    """A pushed name the engine has no parameter for (its loader refused it; the checkpoint it loaded lacks it)."""


class WeightShapeMismatch(WeightRejected):
    """A pushed weight whose shape is not the one in the checkpoint the engine loaded (refused before loading it)."""


class PartialPush(EngineError):
    """A push that landed some weights in an engine rank but not all it loads: the stream delivered only part of the
    checkpoint's weights, or the trainer's stream broke (a bad item, its generator's own error) after some landed.
    What landed is loaded; the engine reports its weights incomplete at ``version`` until a full push lands.

    ``delivered`` of the ``expected`` weights the rank loads (``expected`` None: the engine's names are unknown;
    ``delivered`` None: the engine could not say how many landed), ``missing`` the checkpoint's names it did not get
    (sorted; empty when unknown), on ``engine`` (the rank, e.g. ``"vLLM worker 0"``); ``version``: the push's version
    (None: the engine numbered it and did not say).
    """

    fields = ("version", "delivered", "expected", "missing", "engine")

    def __init__(
        self,
        message: str,
        *,
        version: int | None,
        delivered: int | None,
        expected: int | None,
        missing: tuple[str, ...] = (),
        engine: str,
    ) -> None:
        super().__init__(message)
        self.version, self.delivered, self.expected, self.missing = version, delivered, expected, tuple(missing)
        self.engine = engine


# -- errors as typed values: how one raised in an engine's process crosses back (a code and fields, never text) -------

# The errors that come back as their own type; any other exception crosses as its type's name and message only.
CROSSING: dict[str, type[RefitError]] = {
    cls.__name__: cls
    for cls in (
        RefitError,
        InvalidInput,
        TransferError,
        TransferTimeout,
        PeerGone,
        ProtocolError,
        EngineError,
        EngineAsleep,
        EngineTimeout,
        KVCacheWontFit,
        WeightRejected,
        UnknownWeight,
        WeightShapeMismatch,
        PartialPush,
    )
}


def error_record(error: BaseException) -> dict[str, Any]:
    """``error`` as a typed value, plain data only (JSON and msgpack carry it): ``error_code`` (its class's name) and
    ``error_fields`` (its ``fields``, tuples as lists); empty for an exception that does not cross as its type."""
    kind = type(error)
    if CROSSING.get(kind.__name__) is not kind:
        return {}
    return {"error_code": kind.__name__, "error_fields": {name: _plain(getattr(error, name)) for name in kind.fields}}


def error_from_record(code: Any, message: str, fields: Any) -> RefitError | None:
    """The error an ``error_record`` described, with ``message``; None when ``code`` names no error that crosses or
    the fields are not its own plain values (a record from elsewhere: the caller reports it as text instead)."""
    cls = CROSSING.get(code) if isinstance(code, str) else None
    if cls is None or not isinstance(fields, Mapping) or set(fields) != set(cls.fields):
        return None
    values = {name: _typed(fields[name]) for name in cls.fields}
    if any(value is _NOT_PLAIN for value in values.values()):
        return None
    try:
        return cls(message, **values)
    except (TypeError, ValueError):
        return None


_NOT_PLAIN = object()


def _plain(value: Any) -> Any:
    return [_plain(item) for item in value] if isinstance(value, (tuple, list)) else value


def _typed(value: Any) -> Any:
    """A field's value from a record: None, a bool, a number, text, or a tuple of those; anything else is refused."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        items = tuple(_typed(item) for item in value)
        return _NOT_PLAIN if any(item is _NOT_PLAIN for item in items) else items
    return _NOT_PLAIN
