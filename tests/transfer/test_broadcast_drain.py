"""A receiver that dies after the whole stream arrived (over NCCL a small stream fits the peer's buffers, so the
sender can finish streaming to a dead receiver): the sender waits for its status, bounded, and names it."""

from __future__ import annotations

import re
import time

import pytest

from refitkit.errors import TransferTimeout
from refitkit.transfer._broadcast.sender import BroadcastWeightSender
from tests.transfer.broadcast_peers import ReceiverProcess
from tests.transfer.test_broadcast import BUCKET, SECRET, free_port, stream

pytestmark = pytest.mark.timeout(120)

TIMEOUT_S = 3.0


def test_a_receiver_dead_after_the_last_bucket_is_named_in_the_draining_timeout():
    url = f"tcp://127.0.0.1:{free_port()}"
    sender = BroadcastWeightSender(url, secret=SECRET, receivers=1, bucket_bytes=BUCKET, timeout_s=TIMEOUT_S)
    process = ReceiverProcess()
    try:
        process.start(url, SECRET, 1, "kill-last", TIMEOUT_S)
        start = time.monotonic()
        with pytest.raises(TransferTimeout) as caught:
            sender.send(stream(count=6), version=1)
        seconds = time.monotonic() - start
        message = str(caught.value)
        assert message.startswith("draining: ") and re.search(r"receiver rank\(s\) 1 did not report", message), message
        assert "bucket 2 was the last" in message and "timeout_s=3" in message
        assert TIMEOUT_S - 0.5 < seconds < TIMEOUT_S + 2.0
        process.process.join(10)
        assert process.process.exitcode == -9
    finally:
        process.close()
