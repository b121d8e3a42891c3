"""Lining up trainer ranks: bounded barriers and status exchanges on a dedicated gloo group.

Why a group of our own: on NCCL a barrier whose ``wait(timeout)`` expires is reported and then
NCCL's watchdog takes the whole process down (measured on two H200s); on gloo the same timeout is
an exception the caller can handle. And a timed-out collective leaves its group out of step, so it
must never be the trainer's own group. ``RankGroup`` is made once from the trainer's ranks (only
its members take part: ``use_local_synchronization``) and carries every barrier and status
exchange of the refit cycle; the trainer's own process groups are never touched.

A status exchange is one ``all_gather`` of a fixed-size record per rank: the exchange's round
number, the phase, and (for a rank that failed) the error's type and message, as JSON bytes (data,
never pickle). Every rank learns every rank's outcome, so a failure on one rank surfaces on all of
them within the exchange's bound. A timed-out exchange leaves this group unusable (gloo matches
collectives in order, and the absent rank may still arrive at the old one): every later exchange
refuses at once with a ``RefitError`` that says to make a new ``RefitCycle`` / ``RankGroup`` on
every rank. The round number in each record catches ranks that got out of step some other way.
Every such error carries the call that recovers in ``recovery`` (and its message); the caller names
it (``if_lost``, ``recovery``), since only the caller knows what its phase leaves behind.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from refitkit._knobs import checked_seconds
from refitkit.errors import BarrierTimeout, InvalidInput, RankFailure, RecoveryNeeded, RefitError

logger = logging.getLogger(__name__)

RECORD_BYTES = 2048  # one rank's status record; longer error messages are cut to fit
NEW_GROUP = "make a new RefitCycle (or RankGroup) on every rank"  # what recovers a spent group, by default


@dataclass(frozen=True)
class RankStatus:
    """One rank's outcome of a phase: ``error`` is ``None`` when the phase succeeded there."""

    rank: int
    phase: str
    error_type: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error_type is None


def _dist() -> Any:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


class RankGroup:
    """The trainer ranks of one refit cycle, on a dedicated gloo group (see the module docstring).

    Making one is collective over the ranks of ``group`` (default: every rank): each of them must
    make it, in the same order as their other groups. Without ``torch.distributed`` initialised (or
    with one rank) every exchange is local and immediate.
    """

    def __init__(self, group: Any = None, *, timeout_s: float = 300.0, phase: str = "setup") -> None:
        self.timeout_s = checked_seconds(timeout_s, "barrier_timeout_s")
        self.round = 0
        self._broken: str | None = None  # why the group cannot be used any more
        dist = _dist()
        if dist is None:
            self.rank, self.size, self._group, self._ranks = 0, 1, None, [0]
            return
        self._ranks = (
            list(dist.get_process_group_ranks(group)) if group is not None else list(range(dist.get_world_size()))
        )
        self.rank = dist.get_rank()
        if self.rank not in self._ranks:
            raise InvalidInput(f"RankGroup: rank {self.rank} is not in the given group (ranks {self._ranks})")
        self.size = len(self._ranks)
        self._group = None
        if self.size > 1:
            # Its own timeout also bounds how long gloo keeps a timed-out collective pending.
            try:
                # Only the members take part when the group is a subgroup; for all ranks the group gets a
                # counted name (every rank makes its groups in the same order), so a group made after another
                # one was closed never meets that one's rendezvous keys (hashed names repeat per rank set).
                self._group = dist.new_group(
                    self._ranks,
                    backend="gloo",
                    timeout=datetime.timedelta(seconds=self.timeout_s),
                    use_local_synchronization=group is not None,
                )
            except RuntimeError as exc:  # gloo's rendezvous gave up: some rank never made its group
                raise BarrierTimeout(
                    f"barrier after {phase} timed out after {self.timeout_s:.1f} s on rank {self.rank} while making the "
                    f"rank group over ranks {self._ranks}: every rank must make it (RefitCycle, bounded_barrier); "
                    f"raise barrier_timeout_s if a rank is only slow: {exc}"
                ) from exc

    # -- exchanges --------------------------------------------------------------------------------

    def exchange(self, phase: str, error: BaseException | None = None, *, if_lost: str = NEW_GROUP) -> list[RankStatus]:
        """Every rank's outcome of ``phase`` (this rank's is ``error``, or success), within the group's ``timeout_s``
        (one bound for the wait and for gloo's own collective, so no rank can pass an exchange another gave up on).

        Raises ``BarrierTimeout`` when some rank does not arrive in time, ``RefitError`` when the group
        is out of step; it does not raise for failures it reports (see ``raise_failures``). Either error
        leaves the group spent and names ``if_lost`` as the call that recovers (``recovery``).
        """
        wait_s = self.timeout_s
        mine = RankStatus(self.rank, phase, type(error).__name__ if error is not None else None, _message(error))
        self.round += 1
        if self._group is None:
            return [mine]
        if self._broken is not None:
            raise _spent(f"{phase}: this cycle's rank group is unusable since {self._broken}; {if_lost}", if_lost)
        import torch.distributed as dist

        record = torch.zeros(RECORD_BYTES, dtype=torch.uint8)
        payload = _encode(self.round, mine)
        record[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        gathered = [torch.empty_like(record) for _ in range(self.size)]
        work = dist.all_gather(gathered, record, group=self._group, async_op=True)
        try:
            completed = work.wait(timeout=datetime.timedelta(seconds=wait_s))
        except RuntimeError as exc:  # gloo reports a timed-out or failed wait as RuntimeError
            self._broken = f"round {self.round} ({phase}) timed out or failed on rank {self.rank}"
            raise BarrierTimeout(
                f"barrier after {phase} timed out after {wait_s:.1f} s on rank {self.rank}: some rank did not "
                f"arrive (raise barrier_timeout_s if it is only slow): {exc}; this rank group is spent: {if_lost}",
                recovery=if_lost,
            ) from exc
        if completed is False:
            self._broken = f"round {self.round} ({phase}) timed out on rank {self.rank}"
            raise BarrierTimeout(
                f"barrier after {phase} did not complete within {wait_s:.1f} s on rank {self.rank}; "
                f"raise barrier_timeout_s if a rank is only slow; this rank group is spent: {if_lost}",
                recovery=if_lost,
            )
        statuses = []
        for source, raw in zip(self._ranks, gathered):
            round_, status = _decode(bytes(raw.numpy().tobytes()), source)
            if round_ != self.round or status.phase != phase:
                self._broken = f"rank {source} was at round {round_} ({status.phase}), rank {self.rank} at {self.round}"
                raise _spent(
                    f"{phase}: ranks are out of step: rank {source} is at exchange {round_} ({status.phase!r}), "
                    f"rank {self.rank} at {self.round} ({phase!r}); an earlier exchange failed on some rank: {if_lost}",
                    if_lost,
                )
            statuses.append(status)
        return statuses

    def barrier(self, phase: str) -> float:
        """Wait until every rank got here (bounded by ``timeout_s``); returns the seconds waited."""
        start = time.perf_counter()
        self.exchange(phase)
        return time.perf_counter() - start

    async def abarrier(self, phase: str) -> float:
        """``barrier()`` for event loops: the blocking collective runs in a worker thread."""
        return await asyncio.to_thread(self.barrier, phase)

    async def aexchange(self, phase: str, error: BaseException | None = None) -> list[RankStatus]:
        """``exchange()`` for event loops: the blocking collective runs in a worker thread."""
        return await asyncio.to_thread(self.exchange, phase, error)

    def settle(
        self,
        phase: str,
        error: BaseException | None,
        *,
        recovery: str | None = None,
        outcome: str | None = None,
        if_lost: str = NEW_GROUP,
    ) -> float:
        """Exchange this rank's outcome of ``phase`` and raise on every rank if any rank failed (``raise_failures``).

        ``if_lost`` as for ``exchange``. Returns the seconds the exchange took.
        """
        start = time.perf_counter()
        try:
            statuses = self.exchange(phase, error, if_lost=if_lost)
        except RefitError as exc:
            if error is not None:
                raise exc from error
            raise
        self.raise_failures(phase, statuses, error, recovery=recovery, outcome=outcome)
        return time.perf_counter() - start

    def raise_failures(
        self,
        phase: str,
        statuses: list[RankStatus],
        error: BaseException | None,
        *,
        recovery: str | None = None,
        outcome: str | None = None,
    ) -> None:
        """Raise when ``statuses`` (every rank's outcome of ``phase``, possibly with a later step's too) hold a failure.

        ``error`` is this rank's own failure; ``outcome``: what the failures left behind, and ``recovery``: the call
        that recovers, made on every rank (None: nothing to call); every rank's message says both. Without
        ``recovery`` a rank that failed re-raises its own ``error`` (the other ranks' failures noted), with it it
        raises ``RecoveryNeeded`` chained from ``error``; the others raise ``RankFailure`` naming each failed rank.
        """
        failed = [status for status in statuses if not status.ok]
        if error is None and not failed:
            return
        ranks = ", ".join(str(rank) for rank in dict.fromkeys(status.rank for status in failed))
        said = "; ".join(_describe(s) for s in failed)
        tail = (f"; {outcome}" if outcome else "") + (f": {recovery}" if recovery else "")
        failures: dict[int, str] = {}
        for status in failed:  # a rank may have failed twice (a phase, then its rollback)
            text = f"{status.error_type}: {status.error}"
            failures[status.rank] = f"{failures[status.rank]}; then {text}" if status.rank in failures else text
        if error is not None:
            if recovery is not None:
                raise RecoveryNeeded(
                    f"{phase} failed on rank(s) {ranks} (this is rank {self.rank}): {said}{tail}",
                    failures=failures,
                    recovery=recovery,
                ) from error
            others = [status for status in failed if status.rank != self.rank]
            if hasattr(error, "add_note"):  # (Python 3.11+)
                if others:
                    error.add_note("other ranks failed too: " + "; ".join(_describe(s) for s in others))
                if outcome:
                    error.add_note(f"refitkit: {outcome}")
            raise error
        raise RankFailure(
            f"{phase} failed on rank(s) {ranks} (this is rank {self.rank}, where it succeeded): {said}{tail}",
            failures=failures,
            recovery=recovery,
        )

    def close(self) -> None:
        """Destroy the gloo group (its sockets and threads); every member closes its own. Idempotent."""
        group, self._group = self._group, None
        if group is not None:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group(group)
        self._broken = self._broken or "close() was called"

    @property
    def broken(self) -> str | None:
        """Why this group can no longer be used (a timed-out exchange), or None."""
        return self._broken


def _spent(message: str, recovery: str) -> RefitError:
    """The refusal of a spent (or out-of-step) group, naming the call that recovers."""
    error = RefitError(message)
    error.recovery = recovery
    return error


def _describe(status: RankStatus) -> str:
    return f"rank {status.rank} in {status.phase}: {status.error_type}: {status.error}"


def _message(error: BaseException | None) -> str | None:
    return None if error is None else str(error) or repr(error)


def _encode(round_: int, status: RankStatus) -> bytes:
    """The JSON record, cut to fit ``RECORD_BYTES``: the error message shortened as far as needed."""
    fields = {
        "round": round_,
        "phase": status.phase[:200],
        "type": (status.error_type or "")[:200] or None,
        "error": status.error,
    }
    payload = json.dumps(fields, ensure_ascii=True).encode()
    message = status.error or ""
    while len(payload) > RECORD_BYTES:
        message = message[: len(message) // 2]
        fields["error"] = message + " [cut]"
        payload = json.dumps(fields, ensure_ascii=True).encode()
    return payload


def _decode(raw: bytes, rank: int) -> tuple[int, RankStatus]:
    try:
        fields = json.loads(raw.rstrip(b"\0").decode())
        return int(fields["round"]), RankStatus(rank, str(fields["phase"]), fields["type"], fields["error"])
    except (ValueError, KeyError, TypeError) as exc:
        raise RefitError(f"rank {rank} sent an unreadable status record ({exc}); is it running refitkit?") from None


_BARRIER_GROUPS: dict[tuple[int, float], RankGroup] = {}


def bounded_barrier(group: Any = None, *, timeout_s: float, phase: str = "refit") -> float:
    """Barrier over ``group``'s ranks that gives up after ``timeout_s`` with ``BarrierTimeout``; returns seconds
    waited. It runs on a dedicated gloo group made at the first call (collective: every rank of ``group``
    calls it) and kept for later calls with the same ``timeout_s`` (a group's own timeout bounds its collective,
    so each timeout gets its group); after a timeout that group is spent and later calls raise ``RefitError`` at
    once. The first call may take up to twice ``timeout_s`` (making the group, then the barrier). A no-op
    without an initialised process group (single-process runs).
    """
    seconds = checked_seconds(timeout_s, "timeout_s")
    if _dist() is None:
        return 0.0
    key = (id(group), seconds)  # the group's own timeout is the bound: one group per timeout
    ranks = _BARRIER_GROUPS.get(key)
    if ranks is None:
        ranks = _BARRIER_GROUPS[key] = RankGroup(group, timeout_s=seconds, phase=phase)
    return ranks.barrier(phase)


async def abounded_barrier(group: Any = None, *, timeout_s: float, phase: str = "refit") -> float:
    """``bounded_barrier()`` for event loops: the blocking collective runs in a worker thread."""
    return await asyncio.to_thread(bounded_barrier, group, timeout_s=timeout_s, phase=phase)


__all__ = ["RankGroup", "RankStatus", "abounded_barrier", "bounded_barrier"]
