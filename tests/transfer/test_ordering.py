"""The receiver releases its mapping strictly before the final ACK; a refactor that moves the ACK fails here."""

from __future__ import annotations

import logging
import re
import time

import pytest
import torch

from refitkit.transfer import BucketedWeightSender
from tests.transfer.harness import CASES
from tests.transfer.peers import mapped_segments

pytestmark = pytest.mark.timeout(60)

# doorbell.Doorbell.create's name: <prefix><pid>-<session>c. The receiver posts the final ACK's
# doorbell twin from that 4 KiB segment of counters and unmaps it right after: it holds no bucket bytes.
_CONTROL_SEGMENT = re.compile(r"-[0-9a-f]{16}c$")


class _AtFinalAck(logging.Handler):
    """In the sender, at the moment the final ACK arrives: timestamp it and look into the receiver's mappings."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.seen: list[tuple[float, list[str]]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "refit_event", None) == "final_ack_received":
            self.seen.append((time.monotonic(), mapped_segments(record.peer_pid)))


@pytest.mark.parametrize("case", [CASES[0]])
def test_release_happens_before_the_final_ack(receiver_server, endpoint, case):
    handler = _AtFinalAck()
    logger = logging.getLogger("refitkit.transfer.sender")
    logger.addHandler(handler)
    previous_level = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        weights = [(f"w{i}", torch.full((3000,), float(i))) for i in range(8)]  # several buckets, one split tensor
        weights.append(("big", torch.arange(20000, dtype=torch.float32)))
        with BucketedWeightSender(endpoint, bucket_bytes=32 << 10, timeout_s=10) as sender:
            # The receiver's unmapping takes 0.3 s here: an ACK (frame or doorbell) that left before it
            # would reach the sender while the receiver still maps the bucket.
            receiver_server.start_session(endpoint, timeout_s=10, mode="slow_release", arg=0.3)
            sender.send(weights)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous_level)
    result = receiver_server.result()
    assert result["ok"]
    receiver_events = dict(result["events"])
    [(ack_received_at, receiver_segments_at_ack)] = handler.seen
    assert receiver_events["receiver_released"] < receiver_events["final_ack_sending"] < ack_received_at
    assert result["seconds"] > 0.3
    # When the sender hears the ACK, nothing of the bucket is mapped there (the counters may still be).
    assert [path for path in receiver_segments_at_ack if not _CONTROL_SEGMENT.search(path)] == []
    assert result["segments_after"] == []
