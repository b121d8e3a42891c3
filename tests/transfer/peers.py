"""Processes on the other end of a transfer, for tests: module-level so ``spawn`` can start them.

``ReceiverServer`` is one long-lived spawned receiver process that runs a session per command
(so round-trip tests do not pay a torch import each); the ``*_main`` functions are one-shot
peers for the fault matrix (self-SIGKILL, a killed sender). Spawned peers inherit this process's
environment, ``PYTORCH_CUDA_ALLOC_CONF`` included: ``ReceiverServer`` checks that it arrived.
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import struct
import time
from collections.abc import Callable
from typing import Any

import torch

from tests.helpers import procs

Digest = tuple[str, tuple[int, ...], str]
ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"


def digest(tensor: torch.Tensor) -> Digest:
    """dtype, shape and sha256 of the raw bytes: equal digests mean bit-exact tensors."""
    raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return str(tensor.dtype), tuple(tensor.shape), hashlib.sha256(raw).hexdigest()


def mapped_segments(pid: int | str = "self") -> list[str]:
    """refitkit shared-memory segments mapped into a process (from /proc/<pid>/maps)."""
    with open(f"/proc/{pid}/maps") as maps:
        return [
            line.split()[-2] if line.rstrip().endswith("(deleted)") else line.split()[-1]
            for line in maps
            if any(mark in line for mark in ("/dev/shm/refitkit-", "/memfd:refitkit-"))
        ]


def cuda_allocator_expandable() -> bool | None:
    """Whether torch's CUDA allocator in this process makes expandable segments (None without CUDA)."""
    if not torch.cuda.is_available():
        return None
    alive = torch.empty(1, device="cuda")  # a segment to look at
    expandable = any(segment.get("is_expandable", False) for segment in torch.cuda.memory_snapshot())
    del alive
    return expandable


class IpcCloseProbe:
    """A 16-byte file both processes read: how many ``cuIpcCloseMemHandle`` calls of the receiver returned
    CUDA_SUCCESS, and the last call's result. The sender-side test reads it when the final ACK arrives."""

    _FORMAT = "<qq"

    def __init__(self, path: str) -> None:
        self.path = path

    def reset(self) -> None:
        self._write(0, -1)

    def read(self) -> tuple[int, int]:
        """(successful closes, last result; -1 before any call)."""
        with open(self.path, "rb") as file:
            return struct.unpack(self._FORMAT, file.read(struct.calcsize(self._FORMAT)))

    def closed(self, result: int) -> None:
        closes, _ = self.read()
        self._write(closes + (result == 0), result)

    def _write(self, closes: int, result: int) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            os.pwrite(fd, struct.pack(self._FORMAT, closes, result), 0)
        finally:
            os.close(fd)


class _HeldRelease:
    """Interposes on how the receiver lets go of the bucket: the shm unmapping (``ShmMapping.release``) and,
    given a probe, the CUDA IPC close (the driver's ``cuIpcCloseMemHandle`` as ``cuda_ipc`` calls it; each
    real close is counted in the probe).

    ``ack_first=False``: the release takes ``delay_s`` more, in its place; an ACK sent before it would
    reach the sender while the bucket is still mapped. ``ack_first=True``: a receiver that breaks the rule:
    the release reports success at once and really happens ``delay_s`` after the session returned (after its
    ACK), so the tests can show that their observers catch it."""

    def __init__(self, *, delay_s: float, ack_first: bool, probe: IpcCloseProbe | None) -> None:
        self.delay_s, self.ack_first, self.probe = delay_s, ack_first, probe
        self.pending: list[Callable[[], Any]] = []
        self._restore: list[Callable[[], None]] = []

    def __enter__(self) -> _HeldRelease:
        from refitkit.transfer._ipc import shm

        release = shm.ShmMapping.release
        shm.ShmMapping.release = lambda mapping: self._hold(lambda: release(mapping))  # type: ignore[method-assign]
        self._restore.append(lambda: setattr(shm.ShmMapping, "release", release))
        if self.probe is not None:
            from refitkit.transfer._ipc import cuda_ipc

            lib = cuda_ipc._driver()
            close, probe = lib.cuIpcCloseMemHandle, self.probe

            def held_close(pointer: int) -> int:
                device = torch.cuda.current_device()

                def really_close() -> int:
                    with torch.cuda.device(device):
                        result = close(pointer)
                    probe.closed(result)
                    return result

                return self._hold(really_close)

            lib.cuIpcCloseMemHandle = held_close
            self._restore.append(lambda: setattr(lib, "cuIpcCloseMemHandle", close))
        return self

    def _hold(self, release: Callable[[], Any]) -> Any:
        if self.ack_first:
            self.pending.append(release)
            return 0  # CUDA_SUCCESS, as far as the library can tell
        time.sleep(self.delay_s)
        return release()

    def session_returned(self) -> None:
        """The session is over (its final ACK is out): now really release what was held."""
        if self.pending:
            time.sleep(self.delay_s)  # long enough for the sender to look while the bucket is still mapped here
        while self.pending:
            self.pending.pop(0)()

    def __exit__(self, *exc_info: object) -> None:
        while self._restore:
            self._restore.pop()()


class _EventLog(logging.Handler):
    """Records refitkit transfer events with a system-wide monotonic timestamp."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.events: list[tuple[str, float]] = []

    def emit(self, record: logging.LogRecord) -> None:
        event = getattr(record, "refit_event", None)
        if event:
            self.events.append((event, time.monotonic()))


def _run_session(
    endpoint: str, device: str, timeout_s: float, mode: str, arg: Any, notes: dict[str, Any]
) -> dict[str, Any]:
    """One receiving session; ``notes`` gets what the test wants even when the session fails:
    ``device_free_in_on_bucket`` (a CUDA receiver: the device's free bytes in the first on_bucket call)."""
    from refitkit.transfer import BucketedWeightReceiver

    if mode in (
        "slow_release",
        "release_after_ack",
    ):  # arg: {"delay_s": float, "probe": path of an IpcCloseProbe or None}
        probe = IpcCloseProbe(arg["probe"]) if arg.get("probe") else None
        with _HeldRelease(delay_s=arg["delay_s"], ack_first=mode == "release_after_ack", probe=probe) as held:
            try:
                result = _run_session(endpoint, device, timeout_s, "collect", None, notes)
            finally:
                held.session_returned()
        result["segments_after"] = mapped_segments()  # after what was held was released
        return result

    if mode == "repeat":  # arg: sessions; one receiver runs them all (what it keeps from one to the next is used)
        receiver = BucketedWeightReceiver(endpoint, device, timeout_s=timeout_s)
        sessions = []
        for _ in range(arg):
            got_now: dict[str, Digest] = {}
            receiver.receive(lambda weights, is_last: got_now.update((name, digest(t)) for name, t in weights))
            plans = {seq: id(plan) for seq, plan in receiver._plans.items()}  # noqa: SLF001  (which it laid out anew)
            sessions.append({"digests": got_now, "plans": plans})
        return {"sessions": sessions, "digests": sessions[-1]["digests"], "segments_after": mapped_segments()}

    receiver = BucketedWeightReceiver(endpoint, device, timeout_s=timeout_s)
    got: dict[str, Digest] = {}
    calls: list[tuple[int, bool]] = []
    kept: list[torch.Tensor] = []

    def on_bucket(weights: list[tuple[str, torch.Tensor]], is_last: bool) -> None:
        if device.startswith("cuda") and not calls:  # the bucket (or its staging copy) is on the device now
            notes["device_free_in_on_bucket"] = torch.cuda.mem_get_info(torch.device(device))[0]
        calls.append((len(weights), is_last))
        if mode == "raise" and len(calls) == arg:
            raise RuntimeError(f"loader exploded at bucket {arg}")
        if mode == "stall" and len(calls) == 1:  # a loader that takes arg seconds over its first bucket
            time.sleep(arg)
        if mode in ("kill", "kill_forked"):  # reads nothing on its way: a test that times the sender must not time
            if len(calls) == arg:  # our digests
                die(forked_holder=mode == "kill_forked")
            return
        for name, tensor in weights:
            got[name] = digest(tensor)
            if mode == "keep_view":
                kept.append(tensor)  # breaks the contract: cleanup must then fail and say so
        if mode == "copy":  # what a loader does: copy into its own parameters
            for _name, tensor in weights:
                torch.empty_like(tensor).copy_(tensor)

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
        try:
            stats = receiver.receive(on_bucket)
        finally:
            if kept:  # the loader drops what it wrongly kept; the staging block those views held past the
                kept.clear()  # release's empty_cache went back to this process's cache: give it back too
                if device.startswith("cuda"):
                    torch.cuda.empty_cache()
    return {"digests": got, "calls": calls, "stats": stats, "segments_after": mapped_segments()}


def _server_main(conn: Any) -> None:
    torch.set_num_threads(1)
    events = _EventLog()
    logging.getLogger("refitkit.transfer").addHandler(events)
    logging.getLogger("refitkit.transfer").setLevel(logging.DEBUG)
    import refitkit.transfer  # noqa: F401  (imported before "ready": sessions then start at once)

    if torch.cuda.is_available():
        torch.zeros(1, device="cuda")  # CUDA context up front, so a session's hello is not delayed by it

    conn.send({"pid": os.getpid(), "alloc_conf": os.environ.get(ALLOC_CONF), "expandable": cuda_allocator_expandable()})
    while True:
        command = conn.recv()
        if command is None:
            return
        events.events.clear()
        started = time.monotonic()
        session_id, command = command
        notes: dict[str, Any] = {}
        try:
            result = {"ok": True, **_run_session(*command, notes)}
        except BaseException as exc:  # every failure goes back to the test as data
            result = {"ok": False, "type": type(exc).__name__, "message": str(exc), "cause": _described(exc.__cause__)}
        if not result["ok"]:  # measured once the exception (and views its frames kept) is gone
            result["segments_after"] = mapped_segments()
        result.update(notes)
        result["seconds"] = time.monotonic() - started
        result["events"] = list(events.events)
        result["session_id"] = session_id
        conn.send(result)


def _described(error: BaseException | None) -> tuple[str, str] | None:
    """(type, message) of an exception, kept by nothing (its frames may hold a mapping the test checks is gone)."""
    return None if error is None else (type(error).__name__, str(error))


class ReceiverServer:
    """A spawned receiver process; ``start_session`` returns at once, ``result`` waits for the outcome.

    ``info``: its pid, its ``PYTORCH_CUDA_ALLOC_CONF`` and whether its CUDA allocator makes expandable segments."""

    def __init__(self) -> None:
        ctx = procs.context()
        self._conn, child = ctx.Pipe()
        self._session_id = 0
        self.process = ctx.Process(target=_server_main, args=(child,), daemon=True)
        self.process.start()
        deadline = time.monotonic() + 120
        while not self._conn.poll(0.5):
            if not self.process.is_alive() or time.monotonic() > deadline:  # a child that died says so now
                self.close()
                raise RuntimeError(f"receiver server did not start (exit code {self.process.exitcode}) within 120 s")
        self.info: dict[str, Any] = self._conn.recv()
        if self.info["alloc_conf"] != os.environ.get(ALLOC_CONF):
            self.close()
            raise RuntimeError(
                f"receiver server runs with {ALLOC_CONF}={self.info['alloc_conf']!r}, this process with "
                f"{os.environ.get(ALLOC_CONF)!r}: both processes of a transfer test must use the same allocator"
            )

    def start_session(
        self, endpoint: str, *, device: str = "cpu", timeout_s: float = 10.0, mode: str = "collect", arg: Any = None
    ) -> None:
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
    import refitkit.transfer  # noqa: F401  imported up front too: a test that times the session must not time this

    torch.set_num_threads(1)
    if device.startswith("cuda"):
        torch.zeros(1, device=device)  # CUDA context up front: the test times the session, not CUDA's start
    conn.send("starting")
    conn.send(_run_session(endpoint, device, timeout_s, mode, arg, {}))


HOLDER_S = 4.0  # how long a dying peer's forked child holds its descriptors (and so its connections) open


def die(*, forked_holder: bool = False) -> None:
    """SIGKILL this process; with ``forked_holder``, first fork a child that holds copies of its descriptors (its
    sockets' connections among them) open for ``HOLDER_S``, as a trainer's forked DataLoader workers would."""
    if forked_holder and os.fork() == 0:
        time.sleep(HOLDER_S)  # (the child: it only keeps the inherited descriptors open, then leaves at once)
        os._exit(0)
    os.kill(os.getpid(), signal.SIGKILL)


def killed_sender_main(
    endpoint: str,
    bucket_bytes: int,
    kill_at_item: int,
    conn: Any,
    transport: str = "shm",
    device: str = "cpu",
    forked_holder: bool = False,
) -> None:
    """A sender that SIGKILLs itself while pulling item ``kill_at_item`` (buckets already in flight); its tensors
    lie on ``device`` and go by ``transport``; ``forked_holder``: see ``die``."""
    from refitkit.transfer import BucketedWeightSender

    torch.set_num_threads(1)
    if device.startswith("cuda"):
        torch.zeros(1, device=device)  # CUDA context up front: the test times the session, not CUDA's start
    sender = BucketedWeightSender(endpoint, bucket_bytes=bucket_bytes, transport=transport, timeout_s=30, direct=False)
    conn.send(os.getpid())

    def weights():
        for index in range(1000):
            if index == kill_at_item:
                die(forked_holder=forked_holder)
            yield f"w{index}", torch.full((bucket_bytes // 8,), float(index), device=device)

    sender.send(weights())


def looping_receiver_main(endpoint: str, syncs: int, timeout_s: float, conn: Any) -> None:
    """A receiver that calls ``receive()`` ``syncs`` times in a loop, as an engine's worker does; its loader raises
    on a tensor named ``explode``. Reports each sync (sent as it ends): its outcome, digests and seconds."""
    from refitkit.transfer import BucketedWeightReceiver

    torch.set_num_threads(1)
    receiver = BucketedWeightReceiver(endpoint, "cpu", timeout_s=timeout_s)
    conn.send("ready")
    for _ in range(syncs):
        got: dict[str, Digest] = {}

        def on_bucket(weights: list[tuple[str, torch.Tensor]], is_last: bool) -> None:
            for name, tensor in weights:
                if name == "explode":
                    raise RuntimeError("the loader refused 'explode'")
                got[name] = digest(tensor)

        began = time.monotonic()
        try:
            receiver.receive(on_bucket)
            outcome: dict[str, Any] = {"ok": True, "digests": got}
        except Exception as exc:  # every failure goes back to the test as data
            outcome = {"ok": False, "type": type(exc).__name__, "message": str(exc)}
        outcome["seconds"] = time.monotonic() - began
        outcome["segments_after"] = mapped_segments()
        conn.send(outcome)


def garbage_main(path: str, conn: Any) -> None:
    """A third process of our uid that connects to a sender's socket at ``path`` and sends it frames that are not
    a receiver's: bytes that are no msgpack, another wire version, a well-formed frame of a session it never had,
    a three-part message, once told to go (it says "ready" when connected); then waits to be told to close."""
    import msgpack
    import zmq

    from refitkit.transfer.protocol import WIRE_VERSION

    context = zmq.Context()
    rogue = context.socket(zmq.DEALER)
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.connect(f"ipc://{path}")
    conn.send("ready")
    if not conn.poll(60) or conn.recv() != "go":
        return
    rogue.send(b"\x93garbage!")
    rogue.send(msgpack.packb({"v": WIRE_VERSION + 1, "kind": "done", "session": "x", "seq": 0}))
    rogue.send(msgpack.packb({"v": WIRE_VERSION, "kind": "done", "session": "not-yours", "seq": 0}))
    rogue.send(msgpack.packb({"v": WIRE_VERSION, "kind": "error", "session": "not-yours", "message": "boom"}))
    rogue.send_multipart([b"three", b"part", b"message"])
    conn.send("sent")
    conn.poll(60)
    rogue.close()
    context.term()
