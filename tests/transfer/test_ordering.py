"""The receiver lets go of the bucket strictly before the final ACK, as the sender sees it when the ACK arrives.

A logging handler on the sender's ``final_ack_received`` event looks into the receiver at that moment:
for shm at the segments in its ``/proc/<pid>/maps``, for CUDA IPC at how many of its ``cuIpcCloseMemHandle``
calls have returned (the test peer counts them in a file, see ``peers.IpcCloseProbe``). The peer makes its
release slow, so an ACK sent before it would be seen with the bucket mapped; and a peer that ACKs before it
releases shows that each observer catches exactly that.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from refitkit.transfer import BucketedWeightSender
from tests.transfer.harness import CASES, Case
from tests.transfer.peers import IpcCloseProbe, mapped_segments

pytestmark = pytest.mark.timeout(60)

SHM_CASES = [CASES[0], CASES[2]]  # shm-cpu, shm-cuda
SHM_CPU = Case("shm", "cpu", "cpu")
CUDA_IPC = Case("cuda_ipc", "cuda", "cuda")
RELEASE_DELAY_S = 0.3  # the peer's release takes this long: ample for an early ACK to overtake it
LATE_RELEASE_S = 1.0  # the rule-breaking peer releases this long after its ACK went out


def bucket_segments(pid: int) -> list[str]:
    """The shm bucket segments mapped in process ``pid``."""
    return mapped_segments(pid)


class _AtFinalAck(logging.Handler):
    """In the sender, at the moment the final ACK arrives: ``look(receiver_pid)``, then ``then()`` (still
    before the sender frees its bucket)."""

    def __init__(self, look: Callable[[int], Any], then: Callable[[], None] | None = None) -> None:
        super().__init__(logging.DEBUG)
        self.look, self.then = look, then
        self.seen: list[Any] = []

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "refit_event", None) == "final_ack_received":
            self.seen.append(self.look(record.peer_pid))
            if self.then is not None:
                self.then()


@contextmanager
def watching_the_final_ack(handler: _AtFinalAck) -> Iterator[_AtFinalAck]:
    logger = logging.getLogger("refitkit.transfer._ipc.sender")
    previous_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous_level)


def several_buckets(device: str) -> list[tuple[str, torch.Tensor]]:
    """Several 32 KiB buckets and one tensor split across them."""
    weights = [(f"w{i}", torch.full((3000,), float(i), device=device)) for i in range(8)]
    weights.append(("big", torch.arange(20000, dtype=torch.float32, device=device)))
    return weights


def sync_with_watched_ack(
    server, endpoint: str, case: Case, handler: _AtFinalAck, mode: str, arg: dict
) -> dict[str, Any]:
    with watching_the_final_ack(handler):
        with BucketedWeightSender(
            endpoint, bucket_bytes=32 << 10, transport=case.transport, timeout_s=10, direct=False
        ) as sender:
            server.start_session(endpoint, device=case.receiver_device, timeout_s=10, mode=mode, arg=arg)
            stats = sender.send(several_buckets(case.tensor_device))
    result = server.result()
    assert result["ok"], result
    assert stats.tensors == 9 and stats.buckets > 2
    assert len(handler.seen) == 1  # one final ACK, observed once
    return result


def slow(probe: IpcCloseProbe | None = None) -> dict[str, Any]:
    return {"delay_s": RELEASE_DELAY_S, "probe": probe.path if probe else None}


def late(probe: IpcCloseProbe | None = None) -> dict[str, Any]:
    return {"delay_s": LATE_RELEASE_S, "probe": probe.path if probe else None}


def ipc_close_probe(tmp_path) -> IpcCloseProbe:
    probe = IpcCloseProbe(str(tmp_path / "ipc-closes"))
    probe.reset()
    return probe


def wait_for_the_close(probe: IpcCloseProbe) -> None:
    """Hold the sender (bounded) until the late receiver really closed its mapping: the sender must not free a
    bucket that is still mapped over there."""
    deadline = time.monotonic() + LATE_RELEASE_S + 10.0
    while probe.read()[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)  # polling a peer we made late on purpose; the test checks the count afterwards


@pytest.mark.parametrize("case", SHM_CASES)
def test_shm_bucket_is_unmapped_before_the_final_ack(receiver_server, endpoint, case):
    handler = _AtFinalAck(bucket_segments)
    result = sync_with_watched_ack(receiver_server, endpoint, case, handler, "slow_release", slow())
    assert result["seconds"] > RELEASE_DELAY_S  # the slow release did run in this session
    assert handler.seen == [[]]  # when the sender hears the ACK, nothing of the bucket is mapped there
    assert result["segments_after"] == []


@pytest.mark.cuda
def test_cuda_ipc_mapping_is_closed_before_the_final_ack(receiver_server, endpoint, tmp_path):
    probe = ipc_close_probe(tmp_path)
    handler = _AtFinalAck(lambda pid: probe.read())
    sync_with_watched_ack(receiver_server, endpoint, CUDA_IPC, handler, "slow_release", slow(probe))
    # When the sender hears the ACK, the receiver's one mapping of the bucket is closed (CUDA_SUCCESS)...
    assert handler.seen == [(1, 0)]
    assert probe.read() == (1, 0)  # ...and nothing was mapped or closed afterwards


def test_the_shm_observer_catches_an_ack_sent_before_the_unmapping(receiver_server, endpoint):
    """The observer above can fail: a peer that ACKs first is seen with its bucket segment still mapped."""
    handler = _AtFinalAck(bucket_segments)
    result = sync_with_watched_ack(receiver_server, endpoint, SHM_CPU, handler, "release_after_ack", late())
    [segments_at_ack] = handler.seen
    assert len(segments_at_ack) == 1 and re.match(r"^(/dev/shm|/memfd:)refitkit-", segments_at_ack[0]), segments_at_ack
    assert result["segments_after"] == []  # it did unmap, late


@pytest.mark.cuda
def test_the_cuda_ipc_observer_catches_an_ack_sent_before_the_close(receiver_server, endpoint, tmp_path):
    """The observer above can fail: a peer that ACKs first is seen with its mapping still open."""
    probe = ipc_close_probe(tmp_path)
    handler = _AtFinalAck(lambda pid: probe.read(), then=lambda: wait_for_the_close(probe))
    sync_with_watched_ack(receiver_server, endpoint, CUDA_IPC, handler, "release_after_ack", late(probe))
    assert handler.seen == [(0, -1)]  # not closed, not even tried, when the ACK arrived
    assert probe.read() == (1, 0)  # closed once, late
