"""The trainer's side of a push into a live engine, one core for every engine (vLLM, SGLang).

An engine module describes its side as an ``EngineCall``: the blocking call that makes its ranks receive
one session (vLLM's ``collective_rpc``, SGLang's ``update_weights_from_ipc``) and how to read each rank's
report from what that call returned. ``drive`` runs the call in a helper thread while this thread sends,
both bounded; a rank's failure comes back as its own type, rebuilt from the code and fields it reported
(``rank_error``; nothing is parsed out of text), and a push that landed only part of what a rank loads
raises ``PartialPush`` (``raise_if_partial``, and ``drive`` itself when the trainer's stream broke after
weights landed). What differs per engine (its calls, its request format, its prefix-cache reset) stays in
its own module and its ``_*_internals`` file.

A rank's report is a dict of plain values: a sync that landed is ``sessions.sync_report`` (version,
``complete``, ``expected``, ``missing``, seconds and counts); a failed one is ``{"failure": <failure_fields>,
"weights": <EngineWeights.as_dict()>}``, the latter saying what the failed sync had handed to the loader.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from refitkit.errors import (
    EngineError,
    PartialPush,
    RefitError,
    RemoteError,
    TransferError,
    TransferTimeout,
    WeightRejected,
    error_from_record,
)
from refitkit.rollout.sessions import HelperThreads, bounded_result
from refitkit.rollout.versions import MISSING_SHOWN
from refitkit.transfer import TransferStats
from refitkit.transfer.protocol import remote_failure

RPC_SLACK_S = 30.0  # on top of the receiver's timeout: an engine rank may still be loading when the sender finishes


@dataclass(frozen=True)
class PushStats:
    """One push as seen by the trainer (``sender``) and by each engine rank (``ranks``, plain dicts in rank order: a
    vLLM worker's or an SGLang TP rank's ``sync_report``); ``reset_s``: from the end of the sender's stream until the
    prefix-cache reset asked for came back (None: none asked for, or the engine reset it inside its own call);
    ``prefix_cache_reset``: the engine's answer to it (None: none asked for, or no answer from this engine)."""

    sender: TransferStats
    ranks: list[dict[str, Any]]
    reset_s: float | None = None
    prefix_cache_reset: bool | None = None

    @property
    def workers(self) -> list[dict[str, Any]]:
        """Deprecated spelling of ``ranks`` (vLLM's ``VllmPushStats.workers``)."""
        warnings.warn("PushStats.workers is deprecated: use PushStats.ranks", DeprecationWarning, stacklevel=2)
        return self.ranks

    @property
    def scheduler(self) -> dict[str, Any]:
        """Deprecated: SGLang's TP rank 0 report, every rank's under ``tp_ranks`` (``SglangPushStats.scheduler``)."""
        warnings.warn("PushStats.scheduler is deprecated: use PushStats.ranks", DeprecationWarning, stacklevel=2)
        return dict(self.ranks[0], tp_ranks=list(self.ranks)) if len(self.ranks) > 1 else self.ranks[0]


@dataclass(frozen=True)
class EngineCall:
    """One engine's side of a push, as ``drive`` needs it.

    ``what`` names the call in messages (``"vLLM's refit_receive"``); ``call()`` blocks until every rank received one
    session (or failed) and returns what the engine answered; ``reports(answer)`` turns that answer into each rank's
    report (rank order; raising the engine's own typed refusal where the answer is one); ``rank_name(rank)`` names a
    rank in messages (``"vLLM worker 0"``)."""

    what: str
    call: Callable[[], Any]
    reports: Callable[[Any], list[dict[str, Any]]]
    rank_name: Callable[[int], str]


def drive(
    engine: EngineCall,
    send: Callable[[Callable[[], Any]], TransferStats],
    *,
    timeout_s: float,
    version: int | None,
    helpers: HelperThreads,
    then: Callable[[], Any] | None = None,
) -> PushStats:
    """Run ``engine.call`` in one of ``helpers`` while ``send(on_hello)`` runs here, both bounded (``timeout_s`` +
    ``RPC_SLACK_S`` for the engine). ``then`` (an engine call: the prefix-cache reset) is asked for once the engine's
    receiver said hello (``on_hello``), else once ``send`` returned: an engine that runs calls in the order they came is
    inside ``engine.call`` by then, so ``then`` runs right after it and both replies come back together.

    Failures: a rank's refusal (an ``EngineError`` of refitkit's, e.g. ``EngineAsleep``, ``WeightRejected``) is raised
    as itself, from the sender's error; another rank failure keeps the sender's ``TransferError`` type, the rank's
    error named after it; a trainer's stream that broke (a bad item, its own exception) after weights landed on a rank
    is a ``PartialPush`` from the stream's error; a rank that reports a failure after the sender finished raises it.
    ``version``: the push's version where the trainer named it (None: each rank numbered it)."""
    rpc_timeout_s = timeout_s + RPC_SLACK_S
    with helpers.use() as submit:  # (a stuck call ends on its own timeout; nothing waits past ours)
        calling = threading.Event()

        def call() -> Any:
            calling.set()
            return engine.call()

        future = submit(call)
        # Let the helper take the interpreter first: the sender only waits for the engine's hello, which waits for this
        # call, and the sender's own Python before its wait (checks, an early bucket) would otherwise go first
        calling.wait(RPC_SLACK_S)
        queued: list[concurrent.futures.Future] = []

        def ask_then() -> None:
            if then is not None and not queued:
                queued.append(submit(then))

        try:
            sent = send(ask_then)
        except TransferError as exc:  # the ranks released and reported (or never connected): their reasons
            failure = _rank_failure(engine, future, exc)
            _settle(queued)
            raise failure from exc
        except Exception as exc:  # the trainer's stream broke: an aborted session; say so if weights had landed
            reports = _reports_once_ended(engine, future, wait_s=RPC_SLACK_S)
            _settle(queued)
            partial = _landed_before_break(engine, reports, exc, version)
            if partial is None:
                raise
            raise partial from exc
        except BaseException:
            _reports_once_ended(engine, future, wait_s=RPC_SLACK_S)  # an interrupt: the ranks got an abort
            _settle(queued)
            raise
        ended = time.perf_counter()
        ask_then()  # (the sender had no hello to report: a broadcast)
        done, _ = concurrent.futures.wait([future], timeout=rpc_timeout_s)
        if not done:
            raise TransferTimeout(
                f"{engine.what} did not return within {rpc_timeout_s:.0f} s after the sender finished "
                f"(timeout_s={timeout_s:g} + RPC_SLACK_S={RPC_SLACK_S:.0f} s)"
            )
        if future.exception() is not None:
            exc = future.exception()
            raise EngineError(f"{engine.what} failed after the sender finished: {type(exc).__name__}: {exc}") from exc
        reports = engine.reports(future.result())
        failed = [rank for rank, report in enumerate(reports) if "failure" in report]
        if failed:
            raise rank_error(reports, failed, what=engine.what, rank_name=engine.rank_name)
        reset_s = answer = None
        if queued:
            within = f"{rpc_timeout_s:.0f} s (the push's timeout_s + RPC_SLACK_S)"
            answer = bounded_result(
                queued[0], timeout_s=rpc_timeout_s, what=f"the prefix-cache reset after {engine.what}", within=within
            )
            reset_s = time.perf_counter() - ended
        return PushStats(
            sender=sent, ranks=reports, reset_s=reset_s, prefix_cache_reset=answer if isinstance(answer, bool) else None
        )


def raise_if_partial(pushed: PushStats, engine: EngineCall) -> None:
    """``PartialPush`` for the first rank whose sync landed whole but did not deliver every weight it loads."""
    for rank, report in enumerate(pushed.ranks):
        if not report["complete"]:
            raise partial_push(
                engine.rank_name(rank),
                version=report["version"],
                expected=report["expected"],
                missing=tuple(report["missing"]),
            )


def partial_push(
    engine: str,
    *,
    version: int | None,
    expected: int | None,
    missing: tuple[str, ...] = (),
    delivered: int | None = None,
    broke: str | None = None,
) -> PartialPush:
    """The ``PartialPush`` of a rank (``engine``) that got ``delivered`` (default: ``expected`` less ``missing``) of the
    ``expected`` weights it loads; ``broke``: why the trainer's stream ended early (None: it ended whole, but short)."""
    if delivered is None and broke is None and expected is not None:
        delivered = expected - len(missing)
    number = "its version" if version is None else f"version {version}"
    weights = "weights" if expected is None else f"of the {expected} weights"
    if delivered is None:
        landed = f"{engine} may have loaded some {weights} it loads (it does not say how many)"
    else:
        landed = f"{engine} loaded {delivered} {weights} it loads"
    more = f" and {len(missing) - MISSING_SHOWN} more" if len(missing) > MISSING_SHOWN else ""
    shown = f"; missing {list(missing[:MISSING_SHOWN])}{more}" if missing else ""
    what = (
        f"the push of {number} broke after weights landed ({broke}): {landed}"
        if broke
        else (f"the push of {number} delivered {delivered} {weights} {engine} loads")
    )
    return PartialPush(
        f"{what}{shown}. The weights that landed stay loaded, so the engine reports {number} as incomplete until a "
        "full push lands: push every weight of the checkpoint (its Hugging Face names) again",
        version=version,
        delivered=delivered,
        expected=expected,
        missing=missing,
        engine=engine,
    )


def rank_error(
    reports: list[dict[str, Any]], failed: list[int], *, what: str, rank_name: Callable[[int], str]
) -> RefitError:
    """The error the first of the ``failed`` ranks reported (``failure_fields``), rebuilt as its own type from its code
    and fields, the others' named after it; the cause a ``RemoteError`` standing for the rank's own exception.

    A ``WeightRejected`` or ``PartialPush`` keeps its message (it names the rank); another refitkit error gets the rank
    and the call before its own; any other exception becomes an ``EngineError`` naming its type."""
    first, *others = failed
    remote = remote_failure(dict(reports[first]["failure"]))
    where = f"{rank_name(first)} in {what}"
    also = "".join(f"; {rank_name(rank)}: {_said(reports[rank]['failure'])}" for rank in others)
    if remote is None:
        return EngineError(f"{where} failed without saying why{also}")
    typed = remote.error
    if isinstance(typed, (WeightRejected, PartialPush)):
        message = f"{remote.remote_message}{also}"
    else:
        message = f"{where} raised {_said(reports[first]['failure'])}{also}"
    code = reports[first]["failure"].get("error_code")
    rebuilt = error_from_record(code, message, reports[first]["failure"].get("error_fields")) if typed else None
    error = rebuilt if rebuilt is not None else EngineError(message)
    error.__cause__ = remote
    return error


def peer_error(error: BaseException) -> RefitError | None:
    """The refitkit error a receiver reported over refitkit's own wire, rebuilt from its code and fields (the cause of
    the sender's ``TransferError``); None when it reported another exception, or nothing."""
    cause = error.__cause__
    return cause.error if isinstance(cause, RemoteError) else None


def _said(failure: Mapping[str, Any]) -> str:
    """A rank's failure in words: its code (or its type's name) and its message."""
    kind = failure.get("error_code") or str(failure.get("error_type", "?")).rpartition(".")[2]
    return f"{kind}: {failure.get('error_message', '')}"


def _rank_failure(engine: EngineCall, future: concurrent.futures.Future, exc: TransferError) -> RefitError:
    """The error a failed session raises, from the sender's ``exc`` and what the ranks reported (bounded wait)."""
    reports = _reports_once_ended(engine, future, wait_s=RPC_SLACK_S)
    failed = [rank for rank, report in enumerate(reports or []) if "failure" in report]
    if reports and failed:
        typed = rank_error(reports, failed, what=engine.what, rank_name=engine.rank_name)
    else:
        typed = peer_error(exc)
    if _refused(typed):
        return typed  # type: ignore[return-value]  # the engine's refusal, as itself
    said = "" if typed is None else f"; {typed}"
    if typed is None and future.done() and future.exception() is not None:  # the engine's call failed: its words
        said = f"; {engine.what}: {type(future.exception()).__name__}: {future.exception()}"
    if not said:
        return exc
    return type(exc)(
        f"{exc}{said}",
        remote_message=exc.remote_message,
        remote_type=exc.remote_type,
        remote_traceback=exc.remote_traceback,
    )


def _refused(error: RefitError | None) -> bool:
    """Whether ``error`` is a refusal refitkit made in an engine rank (one of its ``EngineError``s, rebuilt from its code
    and fields), not another exception of the rank's that only its ``EngineError`` stands for."""
    if not isinstance(error, EngineError):
        return False
    cause = error.__cause__
    return not isinstance(cause, RemoteError) or cause.error is not None


def _settle(queued: list[concurrent.futures.Future]) -> None:
    """Let the engine call asked for after the hello (the prefix-cache reset, which the engine runs once the failed
    receive returned) end before the push raises, within ``RPC_SLACK_S``: a push that failed leaves no helper thread in
    a call (one still running past that is retired, and reported, by ``HelperThreads``). Its answer is not needed."""
    concurrent.futures.wait(queued, timeout=RPC_SLACK_S)


def _reports_once_ended(
    engine: EngineCall, future: concurrent.futures.Future, *, wait_s: float
) -> list[dict[str, Any]] | None:
    """Each rank's report once the engine's call ended (bounded by ``wait_s``); None if it still runs, raised, or
    answered with a refusal of its own."""
    done, _ = concurrent.futures.wait([future], timeout=wait_s)
    if not done or future.exception() is not None:
        return None
    try:
        return engine.reports(future.result())
    except RefitError:
        return None


def _landed_before_break(
    engine: EngineCall, reports: list[dict[str, Any]] | None, broke: BaseException, version: int | None
) -> PartialPush | None:
    """The ``PartialPush`` of the first rank that had loaded weights of this push when the trainer's stream broke."""
    for rank, report in enumerate(reports or []):
        failed = (report.get("weights") or {}).get("failed") if "failure" in report else None
        if failed and (version is None or failed["version"] == version):
            return partial_push(
                engine.rank_name(rank),
                version=failed["version"],
                expected=failed["expected"],
                delivered=failed["received"],
                broke=f"{type(broke).__name__}: {broke}",
            )
    return None
