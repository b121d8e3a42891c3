"""Processes on the other end of a transfer, for tests: module-level so ``spawn`` can start them.

``ReceiverServer`` is one long-lived spawned receiver process that runs a session per command
(so round-trip tests do not pay a torch import each); the ``*_main`` functions are one-shot
peers for the fault matrix (self-SIGKILL, a killed sender).
"""

from __future__ import annotations

import hashlib
import logging
import multiprocessing as mp
import os
import signal
import time
from typing import Any

import torch

Digest = tuple[str, tuple[int, ...], str]


def digest(tensor: torch.Tensor) -> Digest:
    """dtype, shape and sha256 of the raw bytes: equal digests mean bit-exact tensors."""
    raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return str(tensor.dtype), tuple(tensor.shape), hashlib.sha256(raw).hexdigest()


def mapped_segments(pid: int | str = "self") -> list[str]:
    """refitkit shared-memory segments mapped into a process (from /proc/<pid>/maps)."""
    with open(f"/proc/{pid}/maps") as maps:
        return [line.split()[-2] if line.rstrip().endswith("(deleted)") else line.split()[-1]
                for line in maps if "/dev/shm/refitkit-" in line or "/memfd:refitkit-" in line]  # fmt: skip


class _EventLog(logging.Handler):
    """Records refitkit transfer events with a system-wide monotonic timestamp."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.events: list[tuple[str, float]] = []

    def emit(self, record: logging.LogRecord) -> None:
        event = getattr(record, "refit_event", None)
        if event:
            self.events.append((event, time.monotonic()))


def _run_session(endpoint: str, device: str, timeout_s: float, mode: str, arg: Any) -> dict[str, Any]:
    from refitkit.transfer import BucketedWeightReceiver

    receiver = BucketedWeightReceiver(endpoint, device, timeout_s=timeout_s)
    got: dict[str, Digest] = {}
    calls: list[tuple[int, bool]] = []
    kept: list[torch.Tensor] = []

    def on_bucket(weights: list[tuple[str, torch.Tensor]], is_last: bool) -> None:
        calls.append((len(weights), is_last))
        if mode == "raise" and len(calls) == arg:
            raise RuntimeError(f"loader exploded at bucket {arg}")
        if mode == "kill" and len(calls) == arg:
            os.kill(os.getpid(), signal.SIGKILL)
        for name, tensor in weights:
            got[name] = digest(tensor)
            if mode == "keep_view":
                kept.append(tensor)  # breaks the contract: cleanup must then fail and say so
        if mode == "copy":  # what a loader does: copy into its own parameters
            for name, tensor in weights:
                torch.empty_like(tensor).copy_(tensor)

    if mode == "slow_release":  # unmapping takes ``arg`` s: an ACK sent before it is seen with the bucket mapped
        from refitkit.transfer import shm

        release = shm.ShmMapping.release

        def slow_release(self: Any) -> None:
            time.sleep(arg)
            release(self)

        shm.ShmMapping.release = slow_release  # type: ignore[method-assign]
        try:
            return _run_session(endpoint, device, timeout_s, "collect", None)
        finally:
            shm.ShmMapping.release = release  # type: ignore[method-assign]
    if mode == "iter":
        for name, tensor in receiver.iter_weights():
            got[name] = digest(tensor)
        stats = receiver.last_stats
    elif mode == "iter_close_early":
        weights = receiver.iter_weights()
        next(weights)
        weights.close()
        stats = None
    else:
        stats = receiver.receive(on_bucket)
    return {"digests": got, "calls": calls, "stats": stats, "segments_after": mapped_segments()}


def _server_main(conn: Any) -> None:
    torch.set_num_threads(1)
    events = _EventLog()
    logging.getLogger("refitkit.transfer").addHandler(events)
    logging.getLogger("refitkit.transfer").setLevel(logging.DEBUG)
    import refitkit.transfer  # noqa: F401  (imported before "ready": sessions then start at once)

    if torch.cuda.is_available():
        torch.zeros(1, device="cuda")  # CUDA context up front, so a session's hello is not delayed by it

    conn.send("ready")
    while True:
        command = conn.recv()
        if command is None:
            return
        events.events.clear()
        started = time.monotonic()
        session_id, command = command
        try:
            result = {"ok": True, **_run_session(*command)}
        except BaseException as exc:  # every failure goes back to the test as data
            result = {"ok": False, "type": type(exc).__name__, "message": str(exc)}
        if not result["ok"]:  # measured once the exception (and views its frames kept) is gone
            result["segments_after"] = mapped_segments()
        result["seconds"] = time.monotonic() - started
        result["events"] = list(events.events)
        result["session_id"] = session_id
        conn.send(result)


class ReceiverServer:
    """A spawned receiver process; ``start_session`` returns at once, ``result`` waits for the outcome."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._session_id = 0
        self.process = ctx.Process(target=_server_main, args=(child,), daemon=True)
        self.process.start()
        if not self._conn.poll(120) or self._conn.recv() != "ready":
            raise RuntimeError("receiver server did not start")

    def start_session(self, endpoint: str, *, device: str = "cpu", timeout_s: float = 10.0, mode: str = "collect", arg: Any = None) -> None:
        self._session_id += 1
        self._conn.send((self._session_id, (endpoint, device, timeout_s, mode, arg)))

    def result(self, timeout_s: float = 30.0) -> dict[str, Any]:
        """The outcome of the latest session (results of sessions a failed test abandoned are skipped)."""
        deadline = time.monotonic() + timeout_s
        while self._conn.poll(max(0.0, deadline - time.monotonic())):
            result = self._conn.recv()
            if result["session_id"] == self._session_id:
                return result
        raise TimeoutError(f"receiver server gave no result within {timeout_s} s")

    def close(self) -> None:
        if self.process.is_alive():
            self._conn.send(None)
            self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)


def one_shot_receiver_main(endpoint: str, device: str, timeout_s: float, mode: str, arg: Any, conn: Any) -> None:
    """One receiving session in its own process (for modes that kill the process)."""
    torch.set_num_threads(1)
    if device.startswith("cuda"):
        torch.zeros(1, device=device)  # CUDA context up front: the test times the session, not CUDA's start
    conn.send("starting")
    conn.send(_run_session(endpoint, device, timeout_s, mode, arg))


def killed_sender_main(endpoint: str, bucket_bytes: int, kill_at_item: int, conn: Any) -> None:
    """A sender that SIGKILLs itself while pulling item ``kill_at_item`` (buckets already in flight)."""
    from refitkit.transfer import BucketedWeightSender

    torch.set_num_threads(1)
    sender = BucketedWeightSender(endpoint, bucket_bytes=bucket_bytes, transport="shm", timeout_s=30)
    conn.send(os.getpid())

    def weights():
        for index in range(1000):
            if index == kill_at_item:
                os.kill(os.getpid(), signal.SIGKILL)
            yield f"w{index}", torch.full((bucket_bytes // 8,), float(index))

    sender.send(weights())
