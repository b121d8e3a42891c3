"""Bucket hand-offs as frames, and the bounded wait both sides run until one comes.

Each bucket needs two hand-offs: the sender's ``packed`` frame says its bytes are complete, the receiver's ``done``
frame says it finished reading them (for the last bucket, the ``released`` frame is the final ACK). A side whose
copies or reads are queued on a CUDA stream records an event after them and sends the frame once the event has
completed, in order (``announce_finished``); CPU copies are synchronous and announced at once.

Waits block in the kernel with the caller's deadline: on the socket (a ZMQ poll, which also sees the peer's connection
end), or, while a side has its own CUDA work still to announce and no frame is queued, on the oldest of those events
(``OwnWork``: a helper thread synchronizes a blocking-sync event, asleep in the driver with the GIL released,
while the waiting thread sleeps on it in slices up to the deadline; the frame is announced the moment the copies end).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from refitkit.errors import TransferTimeout
from refitkit.transfer.common import SessionPhase
from refitkit.transfer.protocol import timeout_error


def event_after(stream: Any) -> Any:
    """A CUDA event after the work queued on ``stream`` (None: CPU work, done). Blocking-sync: a thread waiting on it
    sleeps in the driver instead of spinning."""
    if stream is None:
        return None
    import torch

    event = torch.cuda.Event(blocking=True)
    event.record(stream)
    return event


def announce_finished(pending: deque[tuple[int, Any]], announce: Callable[[int], None]) -> None:
    """``announce(seq)``, in order, for each pending bucket whose CUDA event (or None: nothing to wait for) has
    completed; stops at the first that has not (never waits)."""
    while pending:
        seq, event = pending[0]
        if event is not None and not event.query():
            return
        pending.popleft()
        announce(seq)


class OwnWork:
    """A side's wait for its own CUDA work still to announce: its copies or reads, and whatever was queued before them
    on the same stream (the trainer's optimizer step, say). One per session.

    ``wait`` blocks until the oldest pending event has completed, for at most ``slice_s``: a helper thread synchronizes
    the event (blocking-sync: asleep in the driver, the GIL released) and this thread sleeps on the helper's flag. A
    wait that its slice cut short (the sender looks for a cancellation every ``CANCEL_SLICE_S``) finds the same helper
    when it comes back: one helper per event, never one per slice. Only the caller's deadline (``left_s``) ends the
    wait with an error: a collective among that work that waits on a dead rank never ends, and then TransferTimeout
    names ``timeout_s``. The socket is looked at again after each slice."""

    def __init__(self) -> None:
        self._event: Any = None  # the event the helper synchronizes
        self._done: threading.Event | None = None  # set by the helper once that event completed
        self._helper: threading.Thread | None = None

    def wait(
        self,
        pending: deque[tuple[int, Any]],
        *,
        left_s: float,
        timeout_s: float,
        phase: SessionPhase,
        slice_s: float | None = None,
    ) -> None:
        """Until the oldest of ``pending`` completed, for at most ``slice_s`` (default: all of ``left_s``)."""
        seq, event = pending[0] if pending else (0, None)
        if event is None or event.query():
            return
        if event is not self._event or self._done is None:
            self._event, self._done = event, threading.Event()
            self._helper = threading.Thread(target=_synchronize, args=(event, self._done), name=HELPER, daemon=True)
            self._helper.start()
        wait_s = max(0.0, left_s if slice_s is None else min(left_s, slice_s))
        if self._done.wait(wait_s):
            helper, self._helper, self._event, self._done = self._helper, None, None, None
            helper.join()  # type: ignore[union-attr]  # (it ends as it sets the flag)
            return
        if wait_s < left_s:
            return  # the slice ended, not the deadline
        raise TransferTimeout(
            f"{phase.value}: the CUDA work queued on this side before bucket {seq}'s hand-off did not finish within "
            f"timeout_s={timeout_s:g} (a kernel stuck on this GPU? a collective waiting on a rank that is gone?); raise "
            "timeout_s only if that work is merely slow"
        )


HELPER = "refitkit-cuda-event"  # the helper threads' name


def _synchronize(event: Any, done: threading.Event) -> None:
    try:
        event.synchronize()
    finally:
        done.set()


def wait_until(
    ready: Callable[[], bool],
    look: Callable[[float], None],
    *,
    timeout_s: float,
    phase: SessionPhase,
    waiting_for: str,
    peer: str,
) -> None:
    """Until ``ready()``: ``look(left_s)`` blocks in the kernel for at most ``left_s`` (the time left to the
    deadline; it picks its own shorter slice where it must look at another source); TransferTimeout (naming
    ``phase``, ``waiting_for``, ``peer`` and the knob) once ``timeout_s`` has passed."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        left_s = deadline - time.monotonic()
        if left_s <= 0.0:
            raise timeout_error(phase, waiting_for, peer, timeout_s)
        look(left_s)


def poll_ms(wait_s: float) -> int:
    """A ZMQ poll's timeout for ``wait_s`` seconds, rounded up (a poll of 0 ms for 0.4 ms left would spin)."""
    return max(0, math.ceil(wait_s * 1000))
