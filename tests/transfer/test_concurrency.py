"""One session at a time per sender: concurrent send()/asend() calls are serialised (bounded) or refused,
never race on the socket; a cancelled asend() aborts the receiver and frees everything."""

from __future__ import annotations

import asyncio
import gc
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from refitkit.errors import TransferError
from refitkit.transfer import BucketedWeightSender
from refitkit.transfer._ipc import sender as sender_module
from refitkit.transfer._ipc.endpoint import socket_identity
from tests.helpers.world import child_env
from tests.transfer.harness import Case, own_segment_files, roundtrip
from tests.transfer.peers import ReceiverServer, digest, mapped_segments

pytestmark = pytest.mark.timeout(120)

BUCKET = 8192


def tensors(count: int, prefix: str = "w") -> list[tuple[str, torch.Tensor]]:
    return [(f"{prefix}{index}", torch.full((1000,), float(index))) for index in range(count)]


@pytest.fixture(scope="module")
def second_receiver():
    """A second receiver process, for two sessions of one sender that overlap in time."""
    server = ReceiverServer()
    yield server
    server.close()


def gated(items: list[tuple[str, torch.Tensor]], gate: threading.Event, started: threading.Event):
    """Yields the first item, then waits (bounded) for ``gate``: the session stays open meanwhile."""
    yield items[0]
    started.set()
    if not gate.wait(60):
        raise RuntimeError("the test never opened the gate")
    yield from items[1:]


def test_a_second_send_waits_for_the_running_one(receiver_server, second_receiver, endpoint):
    first, second = tensors(6, "a"), tensors(6, "b")
    gate, started = threading.Event(), threading.Event()
    finished: dict[str, float] = {}
    errors: list[BaseException] = []

    with BucketedWeightSender(endpoint, bucket_bytes=BUCKET, timeout_s=30, direct=False) as sender:

        def run(name: str, weights) -> None:
            try:
                sender.send(weights)
                finished[name] = time.monotonic()
            except BaseException as exc:
                errors.append(exc)

        receiver_server.start_session(endpoint, timeout_s=30)
        one = threading.Thread(target=run, args=("first", gated(first, gate, started)))
        one.start()
        assert started.wait(30)  # the first session is open, its caller's generator paused
        second_receiver.start_session(endpoint, timeout_s=30)
        two = threading.Thread(target=run, args=("second", second))
        two.start()
        two.join(1.5)
        assert two.is_alive() and not finished, "the second send() ran while the first session was open"
        gate.set()
        one.join(30)
        two.join(30)
        assert not errors, errors
        assert finished["first"] < finished["second"]
        assert own_segment_files() == [] and mapped_segments() == []
    assert receiver_server.result()["digests"] == {name: digest(tensor) for name, tensor in first}
    assert second_receiver.result()["digests"] == {name: digest(tensor) for name, tensor in second}


def test_a_second_send_gives_up_after_timeout_s_naming_the_knob(receiver_server, endpoint):
    gate, started = threading.Event(), threading.Event()
    with BucketedWeightSender(endpoint, bucket_bytes=BUCKET, timeout_s=1.5, direct=False) as sender:
        receiver_server.start_session(endpoint, timeout_s=10)
        one = threading.Thread(target=sender.send, args=(gated(tensors(4), gate, started),))
        one.start()
        try:
            assert started.wait(30)
            began = time.monotonic()
            with pytest.raises(TransferError, match=r"another send\(\) on .* held the sender for timeout_s=1.5"):
                sender.send(tensors(2, "x"))
            assert 1.4 < time.monotonic() - began < 5.0
        finally:
            gate.set()
            one.join(30)
    assert receiver_server.result()["ok"]


def test_send_from_inside_its_own_iterator_is_refused_at_once(receiver_server, endpoint):
    inner: list[BaseException] = []
    with BucketedWeightSender(endpoint, bucket_bytes=BUCKET, timeout_s=10, direct=False) as sender:

        def stream():
            yield "a", torch.ones(4)
            began = time.monotonic()
            try:
                sender.send([("b", torch.ones(4))])
            except TransferError as exc:
                inner.append(exc)
            assert time.monotonic() - began < 1.0
            yield "c", torch.zeros(4)

        receiver_server.start_session(endpoint, timeout_s=10)
        sender.send(stream())
    assert len(inner) == 1 and "called from inside its own running send()" in str(inner[0])
    assert set(receiver_server.result()["digests"]) == {"a", "c"}


def test_gather_of_two_asends_runs_them_one_after_the_other(receiver_server, second_receiver, endpoint):
    first, second = tensors(40, "a"), tensors(40, "b")

    async def both(sender: BucketedWeightSender):
        return await asyncio.gather(sender.asend(first), sender.asend(second))

    with BucketedWeightSender(endpoint, bucket_bytes=BUCKET, timeout_s=30, direct=False) as sender:
        receiver_server.start_session(endpoint, timeout_s=30)
        second_receiver.start_session(endpoint, timeout_s=30)
        stats = asyncio.run(both(sender))
        assert [s.tensors for s in stats] == [40, 40]
        assert own_segment_files() == [] and mapped_segments() == []
    got = [receiver_server.result()["digests"], second_receiver.result()["digests"]]
    expected = [{name: digest(tensor) for name, tensor in items} for items in (first, second)]
    assert sorted(map(sorted, got)) == sorted(map(sorted, expected))  # each receiver got one whole list
    assert all(result in expected for result in got)


_RACE = textwrap.dedent(
    """
    import asyncio, multiprocessing as mp, os, sys, tempfile, threading
    os.environ.setdefault("REFITKIT_SOCKET_DIR", tempfile.mkdtemp(prefix="rk-race-"))  # children inherit it
    import torch
    from refitkit.transfer import BucketedWeightReceiver, BucketedWeightSender

    def receive(endpoint):
        got = []
        BucketedWeightReceiver(endpoint, "cpu", timeout_s=30).receive(lambda w, last: got.extend(n for n, _ in w))
        assert len(got) == 100, len(got)

    if __name__ == "__main__":
        ctx = mp.get_context("spawn")
        weights = [(f"w{i}", torch.full((1000,), float(i))) for i in range(100)]
        for round in range(2):  # threads, then asyncio.gather
            endpoint = f"race{os.getpid()}r{round}"
            with BucketedWeightSender(endpoint, bucket_bytes=8192, timeout_s=30, direct=False) as sender:
                peers = [ctx.Process(target=receive, args=(endpoint,)) for _ in range(2)]
                [peer.start() for peer in peers]
                if round % 2:
                    async def both():
                        return await asyncio.gather(sender.asend(weights), sender.asend(weights))
                    stats = asyncio.run(both())
                else:
                    stats = []
                    threads = [threading.Thread(target=lambda: stats.append(sender.send(weights))) for _ in range(2)]
                    [thread.start() for thread in threads]
                    [thread.join(60) for thread in threads]
                assert [s.tensors for s in stats] == [100, 100], stats
                [peer.join(60) for peer in peers]
                assert [peer.exitcode for peer in peers] == [0, 0]
        print("no race")
    """
)


def test_concurrent_sends_never_abort_the_process(tmp_path):
    """Before the lock, two sessions on one ROUTER socket aborted the process in libzmq
    ("Assertion failed: !_current_out") or hung in Context.term(): run it where a crash cannot take
    the test process down."""
    script = tmp_path / "race.py"
    script.write_text(_RACE)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=100, env=child_env())
    assert done.returncode == 0 and "no race" in done.stdout, (done.returncode, done.stderr[-2000:])


def test_cancelled_asend_aborts_the_receiver_and_frees_everything(receiver_server, endpoint):
    async def stalled():
        for name, tensor in tensors(3):
            yield name, tensor
        await asyncio.Event().wait()  # a gather that never finishes
        yield "never", torch.ones(1)

    async def main(sender: BucketedWeightSender) -> float:
        began = time.monotonic()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(sender.asend(stalled()), 1.0)
        return time.monotonic() - began

    with BucketedWeightSender(endpoint, bucket_bytes=BUCKET, timeout_s=20, direct=False) as sender:
        receiver_server.start_session(endpoint, timeout_s=20)
        seconds = asyncio.run(main(sender))
        assert seconds < 5.0
        assert own_segment_files() == [] and mapped_segments() == []  # freed before the cancellation propagated
        result = receiver_server.result()
        assert not result["ok"] and "cancelled" in result["message"] and "INCOMPLETE" in result["message"]
        assert result["seconds"] < 10  # aborted, not timed out
        assert result["segments_after"] == []
    roundtrip(receiver_server, endpoint, tensors(3))


def test_cancelling_an_asend_that_waits_for_a_hello_frees_the_sender(receiver_server, endpoint):
    async def main(sender: BucketedWeightSender) -> float:
        task = asyncio.ensure_future(sender.asend(tensors(3)))
        await asyncio.sleep(0.3)  # lets the worker reach the hello wait; nothing is synchronised by it
        began = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return time.monotonic() - began

    with BucketedWeightSender(endpoint, bucket_bytes=BUCKET, timeout_s=30, direct=False) as sender:
        seconds = asyncio.run(main(sender))
        assert seconds < 1.0  # within a wait slice, not timeout_s=30
        receiver_server.start_session(endpoint, timeout_s=10)
        assert sender.send(tensors(3)).tensors == 3  # the lock was released
    assert receiver_server.result()["ok"]


def test_a_cancelled_asend_reports_nothing_but_the_cancellation(receiver_server, endpoint):
    """Cancelled mid-stream (``wait_for``) or while waiting for a hello (``task.cancel()``), asend() raises the
    caller's CancelledError / TimeoutError and nothing else: asyncio reports no "Future exception was never
    retrieved" for the worker's stop, and the receiver's abort names no private class."""
    reported: list[dict] = []

    async def stalled():
        for name, tensor in tensors(3):
            yield name, tensor
        await asyncio.Event().wait()  # a gather that never finishes
        yield "never", torch.ones(1)

    async def main(sender: BucketedWeightSender) -> list[str]:
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: reported.append(context))
        outcomes = []
        try:  # (no pytest.raises: a kept exception would keep the worker's future alive past the check)
            await asyncio.wait_for(sender.asend(stalled()), 1.0)
        except TimeoutError:
            outcomes.append("timed out")
        task = asyncio.ensure_future(sender.asend(tensors(3)))  # no receiver this time: it waits for a hello
        await asyncio.sleep(0.3)  # lets the worker reach the hello wait; nothing is synchronised by it
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            outcomes.append("cancelled")
        return outcomes

    with BucketedWeightSender(endpoint, bucket_bytes=BUCKET, timeout_s=20, direct=False) as sender:
        receiver_server.start_session(endpoint, timeout_s=20)
        assert asyncio.run(main(sender)) == ["timed out", "cancelled"]
        result = receiver_server.result()
        assert own_segment_files() == [] and mapped_segments() == []
    gc.collect()  # finalise now any future dropped in a cycle: asyncio reports an unretrieved exception only then
    assert [context.get("message") for context in reported] == []
    assert not result["ok"] and result["type"] == "TransferError" and "INCOMPLETE" in result["message"]
    assert result["message"].endswith("): asend() was cancelled while waiting for the next item"), result["message"]


def test_a_failed_session_keeps_the_socket_frees_the_bucket_and_raises_its_error(
    receiver_server, endpoint, monkeypatch
):
    """After a failed session the sender neither binds its socket anew (before: it did, and a failed rebind closed
    the sender; a hello said meanwhile was lost) nor keeps the bucket, and the caller's error comes out as it was."""

    def stream():
        yield from tensors(3)
        raise KeyError("gather failed on rank 3")

    with BucketedWeightSender(endpoint, bucket_bytes=BUCKET, timeout_s=10, direct=False) as sender:
        receiver_server.start_session(endpoint, timeout_s=10)
        bound, sock = sender._bound, sender._socket

        def refuse(*args, **kwargs):
            raise OSError("injected: a second bind")

        monkeypatch.setattr(sender_module, "bind_sender", refuse)
        with pytest.raises(KeyError, match="rank 3") as raised:
            sender.send(stream())
        assert getattr(raised.value, "__notes__", []) == []
        assert own_segment_files() == [] and mapped_segments() == []
        assert sender._socket is sock and socket_identity(sender.path) == bound  # the same socket, still bound
        result = receiver_server.result()
        assert not result["ok"] and "INCOMPLETE" in result["message"], result
        receiver_server.start_session(endpoint, timeout_s=10)
        assert sender.send(tensors(2)).tensors == 2  # the next sync, on the same socket
    assert receiver_server.result()["ok"]


_CLOSE_DURING_SEND = textwrap.dedent(
    """
    import threading, time, torch
    from refitkit.transfer import BucketedWeightSender
    sender = BucketedWeightSender("close-during-send-{tag}", bucket_bytes=1 << 20, timeout_s=20.0, direct=False)
    outcome = {{}}
    def run():
        try:
            sender.send([("w", torch.ones(4))])  # no receiver: it waits for a hello
            outcome["send"] = "returned"
        except Exception as exc:
            outcome["send"] = f"{{type(exc).__name__}}: {{exc}}"
    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(0.5)
    began = time.monotonic()
    sender.close()
    closed_s = time.monotonic() - began
    thread.join(10)
    print("closed in", round(closed_s, 2), "|", outcome.get("send"), "| socket", sender._socket is not None)
    """
)


def test_close_from_another_thread_stops_the_running_send_first(tmp_path):
    """Before: close() closed the socket under the session's thread (libzmq SIGABRT in signaler.cpp, or a
    hang), and the failed session then bound the endpoint again. Run where a crash cannot take pytest down."""
    script = tmp_path / "close_during_send.py"
    script.write_text(_CLOSE_DURING_SEND.format(tag=tmp_path.name[-8:]))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, env=child_env())
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    closed_s = float(done.stdout.split()[2])
    assert closed_s < 2.0, done.stdout  # stopped within a wait slice, not after timeout_s=20
    assert "_Cancelled: the sender was closed (close()) while waiting for a receiver's hello" in done.stdout
    assert done.stdout.strip().endswith("socket False"), done.stdout  # closed for good, not rebound


def test_a_session_that_fails_before_its_setup_keeps_the_next_receivers_hello(endpoint):
    """Before: the failed session rebound the socket, dropping the hello still queued in it: the second
    receiver waited its whole timeout, and so did the next send() for a hello."""
    outcomes: dict[str, object] = {}

    def receive(tag: str) -> None:
        from refitkit.transfer import BucketedWeightReceiver

        try:
            stats = BucketedWeightReceiver(endpoint, "cpu", timeout_s=6.0).receive(lambda weights, last: None)
            outcomes[tag] = stats.tensors
        except Exception as exc:
            outcomes[tag] = f"{type(exc).__name__}: {exc}"

    def broken():
        raise RuntimeError("the caller's iterator failed")
        yield  # a generator

    with BucketedWeightSender(endpoint, bucket_bytes=BUCKET, timeout_s=6.0, direct=False) as sender:
        threads = [threading.Thread(target=receive, args=(tag,)) for tag in ("first", "second")]
        for thread in threads:
            thread.start()
            time.sleep(0.3)  # both hellos are queued before the first send()
        with pytest.raises(RuntimeError, match="iterator failed"):
            sender.send(broken())
        began = time.monotonic()
        stats = sender.send(tensors(2))
        assert time.monotonic() - began < 3.0 and stats.tensors == 2
        for thread in threads:
            thread.join(10)
    assert "refused the session" in str(outcomes["first"]), outcomes
    assert outcomes["second"] == 2, outcomes


@pytest.mark.cuda
def test_cancelled_asend_over_cuda_ipc_frees_the_gpu_bucket(receiver_server, endpoint):
    """The 64 MiB device bucket is gone (device free memory back within 4 MiB) once the cancellation returns."""
    weights = [(f"w{index}", torch.full((1 << 18,), float(index), device="cuda")) for index in range(3)]
    torch.cuda.synchronize()
    free_before, _ = torch.cuda.mem_get_info()

    async def stalled():
        for item in weights:
            yield item
        await asyncio.Event().wait()
        yield "never", torch.ones(1, device="cuda")

    async def main(sender: BucketedWeightSender) -> None:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(sender.asend(stalled()), 3.0)

    with BucketedWeightSender(
        endpoint, bucket_bytes=64 << 20, transport="cuda_ipc", timeout_s=20, direct=False
    ) as sender:
        receiver_server.start_session(endpoint, device="cuda", timeout_s=20)
        asyncio.run(main(sender))
        torch.cuda.synchronize()
        free_after, _ = torch.cuda.mem_get_info()
        assert free_before - free_after < 4 << 20, f"{(free_before - free_after) >> 20} MiB still held"
        result = receiver_server.result()
        assert not result["ok"] and "cancelled" in result["message"]
    roundtrip(
        receiver_server,
        endpoint,
        [(name, tensor) for name, tensor in weights],
        bucket_bytes=64 << 20,
        case=Case("cuda_ipc", "cuda", "cuda"),
    )
