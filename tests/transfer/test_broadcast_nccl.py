"""The broadcast transport over NCCL on two GPUs: a sender process on GPU 0, a receiver process on GPU 1.

The sender runs in a spawned process of its own (as the trainer would), so that NCCL's watchdog, should it
take a process down, takes that process and not pytest: the test then fails naming the exit code. This
process never touches CUDA. Covered: every wire dtype bit-exact (a list and a generator, a tensor wider
than a half and split tensors larger than the bucket); a receiver SIGKILLed mid-sync ends the sender's
session in a refitkit error naming phase, bucket and peer within timeout_s + 5 s (the stuck NCCL
communicator is aborted: ``_broadcast/group.py`` ``await_work``), the sender process stays alive, and the next
sessions, to a fresh receiver process, form a new communicator and land bit-exact.
"""

from __future__ import annotations

import queue
import re
import time
from typing import Any

import pytest
import torch

from refitkit.transfer.protocol import SUPPORTED_DTYPES
from tests.helpers import procs
from tests.transfer.broadcast_peers import ReceiverProcess
from tests.transfer.test_broadcast import SECRET, free_port, random_tensor, stream

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.cuda,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank: two GPUs"),
]

TIMEOUT_S = 10.0  # NCCL forms a communicator per session: generous on a loaded host
BOUND_S = TIMEOUT_S + 5.0
BUCKET = 1 << 16  # halves of 32 KiB
SENDER, RECEIVER = "cuda:0", "cuda:1"


def every_dtype() -> list[tuple[str, torch.Tensor]]:
    weights = [
        (f"{name}.w", random_tensor(dtype, (7, 13), seed))
        for seed, (name, dtype) in enumerate(SUPPORTED_DTYPES.items())
    ]
    return weights + [
        ("wide", random_tensor(torch.float32, (48, 256), 90)),  # 48 KiB: more than a half
        ("split.bf16", random_tensor(torch.bfloat16, (300, 257), 91)),  # 150 KiB: larger than the whole bucket
        ("split.c64", random_tensor(torch.complex64, (5000, 3), 92)),
        ("empty", torch.empty(0, 4)),
        ("strided", random_tensor(torch.float16, (64, 64), 93).t()),  # sent as its values
    ]


RECIPES = {"every_dtype": every_dtype, "stream": lambda: stream(count=12)}  # "stream": 6 buckets of 2 tensors


def sender_server_main(url: str, commands: Any, answers: Any) -> None:
    """A long-lived NCCL sender on GPU 0: ``(recipe, as_list, version)`` -> (error type or None, message,
    seconds, is a TransferError, digests of what it sent)."""
    from refitkit.errors import TransferError
    from refitkit.transfer._broadcast.sender import BroadcastWeightSender
    from tests.transfer.peers import digest

    torch.cuda.set_device(SENDER)
    sender = BroadcastWeightSender(
        url, secret=SECRET, receivers=1, bucket_bytes=BUCKET, device=SENDER, backend="nccl", timeout_s=TIMEOUT_S
    )
    answers.put("ready")
    while (command := commands.get()) is not None:
        recipe, as_list, version = command
        weights = [(name, tensor.to(SENDER)) for name, tensor in RECIPES[recipe]()]
        sent = {name: digest(tensor) for name, tensor in weights}
        start = time.monotonic()
        try:
            sender.send(weights if as_list else iter(weights), version=version)
            error: tuple = (None, "", False)
        except Exception as exc:
            error = (type(exc).__name__, str(exc), isinstance(exc, TransferError))
        answers.put((*error[:2], time.monotonic() - start, error[2], sent))


class SenderProcess:
    def __init__(self, url: str) -> None:
        ctx = procs.context()
        self.commands, self.answers = ctx.Queue(), ctx.Queue()
        self.process = ctx.Process(target=sender_server_main, args=(url, self.commands, self.answers), daemon=True)
        self.process.start()
        assert self.answer(120) == "ready"

    def send(self, recipe: str, version: int, *, as_list: bool = True) -> None:
        self.commands.put((recipe, as_list, version))

    def answer(self, timeout_s: float = 3 * BOUND_S) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self.answers.get(timeout=0.5)
            except queue.Empty:
                if not self.process.is_alive():  # e.g. NCCL's watchdog took it down
                    raise AssertionError(f"the sender process died with exit code {self.process.exitcode}") from None
                if time.monotonic() > deadline:
                    raise AssertionError(f"the sender gave no answer within {timeout_s:g} s") from None

    def close(self) -> int | None:
        if self.process.is_alive():
            self.commands.put(None)
        self.process.join(30)
        if self.process.is_alive():  # only this test's own child, by its pid
            self.process.kill()
            self.process.join(10)
        return self.process.exitcode


@pytest.fixture
def pair():
    url = f"tcp://127.0.0.1:{free_port()}"
    sender, receiver = SenderProcess(url), ReceiverProcess()
    made = {"url": url, "sender": sender, "receiver": receiver}
    yield made
    codes = [made["receiver"].close(), sender.close()]
    assert codes == [0, 0], f"processes did not exit cleanly (receiver, sender): {codes}"


def lands(pair: dict, recipe: str, version: int, *, as_list: bool = True) -> None:
    pair["receiver"].start(pair["url"], SECRET, 1, "ok", TIMEOUT_S, RECEIVER, "nccl")
    pair["sender"].send(recipe, version, as_list=as_list)
    error, message, _, _, sent = pair["sender"].answer()
    assert error is None, message
    got_error, got_message, _, got, landed = pair["receiver"].result(3 * BOUND_S)
    assert got_error is None, got_message
    assert got == sent and landed == (version, None)


def test_nccl_every_dtype_bit_exact_with_split_tensors_larger_than_a_bucket(pair):
    want = {name: tensor for name, tensor in every_dtype()}
    assert want["split.bf16"].nbytes > BUCKET and want["split.c64"].nbytes > BUCKET
    lands(pair, "every_dtype", 1, as_list=True)  # checked whole and batched
    lands(pair, "every_dtype", 2, as_list=False)  # a generator, item by item


def test_nccl_receiver_killed_mid_sync_then_a_fresh_receiver_works(pair):
    lands(pair, "stream", 1)
    pair["receiver"].start(pair["url"], SECRET, 1, "kill", TIMEOUT_S, RECEIVER, "nccl")  # dies inside bucket 1
    pair["sender"].send("stream", 2)
    error, message, seconds, is_transfer_error, _ = pair["sender"].answer()
    assert is_transfer_error and error in ("TransferTimeout", "PeerGone", "TransferError"), (error, message)
    assert seconds < BOUND_S, f"the sender took {seconds:.1f} s (bound {BOUND_S:g} s): {message}"
    # streaming (a broadcast stuck on the dead peer, aborted) or draining (the stream fit NCCL's buffers on the
    # dead peer's GPU and the sender waited for its status): either way phase, bucket and peer are named
    assert re.match(r"(streaming|draining): ", message) and "bucket" in message, message
    assert re.search(r"receiver rank(\(s\))? 1\b", message), message
    victim = pair["receiver"].process
    victim.join(BOUND_S)
    assert victim.exitcode == -9
    pair["receiver"].close()
    pair["receiver"] = ReceiverProcess()  # a restarted engine worker on GPU 1
    lands(pair, "stream", 3)  # a new session forms a new communicator; the aborted one is gone
    lands(pair, "every_dtype", 4)
    assert pair["sender"].process.is_alive()
