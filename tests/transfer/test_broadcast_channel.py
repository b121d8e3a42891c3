"""The broadcast channel: the sender and its receivers keep their group across syncs (gloo on 127.0.0.1, real
processes). N syncs form it once and land bit-exact; a receiver killed mid-sync ends the sender's sync within its
bound and the next sync, with a fresh receiver, forms a new group; a sender that closes makes a receiver's next
call fail with PeerGone, and a new sender on the same rendezvous is then joined afresh by the same receiver."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from refitkit.errors import ChannelClosed, PeerGone, TransferTimeout
from refitkit.transfer import BroadcastWeightReceiver, ChannelState
from refitkit.transfer._broadcast import group as grp
from refitkit.transfer._broadcast.sender import BroadcastWeightSender
from tests.transfer.broadcast_peers import ReceiverProcess
from tests.transfer.peers import digest
from tests.transfer.test_broadcast import BOUND_S, BUCKET, SECRET, TIMEOUT_S, free_port, random_tensor, stream

pytestmark = pytest.mark.timeout(180)


def weights_of(sync: int) -> list[tuple[str, torch.Tensor]]:
    """A different stream each sync: three dtypes, one tensor split across buckets."""
    return [
        ("a.bf16", random_tensor(torch.bfloat16, (64, 33), 10 * sync)),
        ("b.f32", random_tensor(torch.float32, (5000, 7), 10 * sync + 1)),  # 140 KB: split across buckets
        ("c.i8", random_tensor(torch.int8, (999,), 10 * sync + 2)),
    ]


class ThreadReceiver:
    """A receiver kept in this process, one ``receive()`` per ``start()`` on a thread of its own."""

    def __init__(self, url: str, rank: int) -> None:
        self.receiver = BroadcastWeightReceiver(url, secret=SECRET, rank=rank, timeout_s=TIMEOUT_S)
        self.outcome: dict[str, Any] = {}
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        def run() -> None:
            got: dict[str, Any] = {}

            def on_bucket(weights: list, last: bool) -> None:
                got.update((name, digest(tensor)) for name, tensor in weights)

            began = time.monotonic()
            try:
                self.receiver.receive(on_bucket)
                self.outcome = {"error": None, "got": got}
            except Exception as exc:
                self.outcome = {"error": exc, "got": got}
            self.outcome["seconds"] = time.monotonic() - began

        self.outcome = {}
        self.thread = threading.Thread(target=run, name="test-broadcast-receiver")
        self.thread.start()

    def result(self) -> dict[str, Any]:
        assert self.thread is not None
        self.thread.join(BOUND_S + 5)
        assert not self.thread.is_alive(), "the receiver's receive() did not end"
        return self.outcome


def group_prefixes(sender: BroadcastWeightSender) -> set[str]:
    """The groups whose rendezvous keys are in the sender's store."""
    return {key[len(grp.PREFIX) :].split("/")[0] for key in sender._store.list_keys() if "/pg/" in key}


def test_syncs_on_one_kept_group_are_bit_exact_and_form_it_once():
    url = f"tcp://127.0.0.1:{free_port()}"
    process = ReceiverProcess()
    local = ThreadReceiver(url, rank=2)
    try:
        with BroadcastWeightSender(url, secret=SECRET, receivers=2, bucket_bytes=BUCKET, timeout_s=TIMEOUT_S) as sender:
            for sync in range(1, 5):
                weights = weights_of(sync)
                want = {name: digest(tensor) for name, tensor in weights}
                process.start(url, SECRET, 1)
                local.start()
                sender.send(weights, version=sync)
                error, message, _, got, version = process.result()
                assert error is None, message
                assert got == want and version == (sync, None)
                mine = local.result()
                assert mine["error"] is None and mine["got"] == want
                assert ("group" in sender.last_timings_s) == (sync == 1)  # formed by the first sync only
                if sync == 1:
                    kept = sender.group_id
                assert sender.group_id == kept and local.receiver.group_id == kept
                assert sender.groups_formed == 1 and local.receiver.groups_formed == 1
                assert group_prefixes(sender) == {kept}  # one group's rendezvous, ever
            # the in-process receiver closes: its next call is refused, and the sender's next sync forms a new group
            local.receiver.close()
            local.receiver.close()  # idempotent
            assert local.receiver.state is ChannelState.CLOSED and local.receiver.group_id is None
            with pytest.raises(ChannelClosed, match="broadcast receiver rank 2 .* is closed"):
                local.receiver.receive(lambda weights, last: None)
            fresh = ThreadReceiver(url, rank=2)
            weights = weights_of(5)
            process.start(url, SECRET, 1)
            fresh.start()
            sender.send(weights, version=5)
            error, message, _, got, _ = process.result()
            assert error is None, message
            assert got == {name: digest(tensor) for name, tensor in weights} and fresh.result()["error"] is None
            assert sender.groups_formed == 2 and sender.group_id not in (None, kept)
            assert fresh.receiver.group_id == sender.group_id and group_prefixes(sender) == {sender.group_id}
            fresh.receiver.close()
        with pytest.raises(ChannelClosed, match="is closed"):
            sender.send(weights, version=6)
        assert sender.group_id is None
    finally:
        assert process.close() == 0


def test_receiver_killed_mid_sync_ends_the_sync_then_a_fresh_receiver_joins_a_new_group():
    url = f"tcp://127.0.0.1:{free_port()}"
    processes = {1: ReceiverProcess(), 2: ReceiverProcess()}
    sender = BroadcastWeightSender(url, secret=SECRET, receivers=2, bucket_bytes=BUCKET, timeout_s=TIMEOUT_S)

    def sync(version: int, modes: dict[int, str] | None = None) -> None:
        weights = weights_of(version)
        for rank, process in processes.items():
            process.start(url, SECRET, rank, (modes or {}).get(rank, "ok"))
        sender.send(weights, version=version)
        for process in processes.values():
            error, message, _, got, landed = process.result()
            assert error is None, message
            assert got == {name: digest(tensor) for name, tensor in weights} and landed == (version, None)

    try:
        sync(1)
        first = sender.group_id
        processes[1].start(url, SECRET, 1)
        processes[2].start(url, SECRET, 2, "kill")
        began = time.monotonic()
        with pytest.raises(TransferTimeout, match="receiver rank") as raised:
            sender.send(stream(count=12), version=2)
        assert time.monotonic() - began < BOUND_S, raised.value
        assert sender.group_id is None  # a failed sync drops its group
        survivor = processes[1].result()
        assert survivor[0] in ("TransferError", "PeerGone") and survivor[2] < TIMEOUT_S - 1.0, survivor
        processes[2].process.join(10)
        assert processes[2].process.exitcode == -9
        processes[2] = ReceiverProcess()
        sync(3)  # the survivor (which kept its receiver) and the fresh receiver join a new group
        assert sender.groups_formed == 2 and sender.group_id not in (None, first)
        sync(4)
        assert sender.groups_formed == 2 and group_prefixes(sender) == {sender.group_id}
    finally:
        sender.close()
        codes = [process.close() for process in processes.values()]
        assert codes == [0, 0], codes


def test_a_closed_sender_fails_the_receivers_next_call_and_a_new_sender_is_joined_afresh():
    port = free_port()
    url = f"tcp://127.0.0.1:{port}"
    local = ThreadReceiver(url, rank=1)
    sender = BroadcastWeightSender(url, secret=SECRET, receivers=1, bucket_bytes=BUCKET, timeout_s=TIMEOUT_S)
    try:
        for version in (1, 2):
            local.start()
            sender.send(weights_of(version), version=version)
            assert local.result()["error"] is None
        held = local.receiver.group_id
        assert held == sender.group_id and local.receiver.groups_formed == 1
        sender.close()
        local.start()
        outcome = local.result()
        error = outcome["error"]
        assert isinstance(error, PeerGone), repr(error)
        assert "the sender (rank 0) stopped answering" in str(error) and "did it die or close?" in str(error)
        assert outcome["seconds"] < TIMEOUT_S - 1.0  # the broken connection told it, not its timeout
        assert local.receiver.group_id is None and local.receiver.state is ChannelState.OPEN
        # the same receiver object joins a new sender on the same rendezvous
        sender = BroadcastWeightSender(url, secret=SECRET, receivers=1, bucket_bytes=BUCKET, timeout_s=TIMEOUT_S)
        weights = weights_of(3)
        local.start()
        sender.send(weights, version=3)
        mine = local.result()
        assert mine["error"] is None and mine["got"] == {name: digest(tensor) for name, tensor in weights}
        assert local.receiver.groups_formed == 2 and local.receiver.group_id == sender.group_id != held
        assert local.receiver.weights_version.version == 3
    finally:
        sender.close()
        local.receiver.close()
