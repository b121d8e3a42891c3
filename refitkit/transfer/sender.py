"""The trainer side of a weight sync: stream (name, tensor) pairs through a double-buffered bucket.

One ``send()`` is one session: wait for a receiver's hello, allocate the bucket buffer (two halves
of ``bucket_bytes // 2``), let the receiver map it once (the first bucket is packed meanwhile, and
sent once the receiver said ``ready``), stream buckets, and wait for the final ACK that the receiver
sends only after it released every view and its mapping. The bucket is freed
in a ``finally``, so the sender holds 0 bytes of bucket memory after every ``send()``, whether it
succeeded or not.

Failure semantics: items are validated one by one as the stream is consumed. An invalid item (or
an exception from the caller's iterator) aborts the session: the receiver gets an ``abort`` frame,
releases, and raises ``TransferError``; buckets it already consumed stay consumed, but it never
sees ``is_last=True``, so a loader that commits on the last bucket commits nothing. ``send()``
then re-raises the original error (``InvalidInput`` for bad items).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq

from refitkit.errors import InvalidInput, ProtocolError, TransferError, TransferTimeout
from refitkit.transfer import cuda_ipc, shm
from refitkit.transfer.endpoint import bind_sender, socket_path
from refitkit.transfer.packing import BOTH_HALVES, BucketPacker, CheckedItem, check_item
from refitkit.transfer.phases import SessionPhase, TransferStats
from refitkit.transfer.protocol import ALIGN_BYTES, decode, encode, expect, recv_frame

log = logging.getLogger(__name__)

TRANSPORTS = ("auto", "cuda_ipc", "shm")
_END = object()


async def _anext_or_end(iterator: Any) -> Any:
    try:
        return await iterator.__anext__()
    except StopAsyncIteration:
        return _END


class BucketedWeightSender:
    """Binds ``endpoint`` and sends weights to one ``BucketedWeightReceiver`` per ``send()``."""

    def __init__(
        self, endpoint: str, bucket_bytes: int = 2 << 30, transport: str = "auto", timeout_s: float = 120.0
    ) -> None:
        if transport not in TRANSPORTS:
            raise InvalidInput(f"transport={transport!r}; expected one of {TRANSPORTS}")
        if not isinstance(bucket_bytes, int) or bucket_bytes < 4 * ALIGN_BYTES:
            raise InvalidInput(f"bucket_bytes={bucket_bytes!r}; need an int of at least {4 * ALIGN_BYTES}")
        if not timeout_s > 0:
            raise InvalidInput(f"timeout_s={timeout_s!r}; need a positive number of seconds")
        if transport == "cuda_ipc" and not cuda_ipc.ipc_available():
            raise InvalidInput("transport='cuda_ipc' needs a CUDA GPU and the CUDA driver in the sender")
        self.endpoint = endpoint
        self.path = socket_path(endpoint)
        self.bucket_bytes = bucket_bytes
        self.half_bytes = bucket_bytes // 2 // ALIGN_BYTES * ALIGN_BYTES
        self.transport = transport
        self.timeout_s = float(timeout_s)
        self.last_timings_s: dict[str, float] = {}  # per-phase seconds of the last session, for benchmarks
        shm.remove_stale_segments()
        self._context: zmq.Context | None = None
        self._socket: zmq.Socket | None = None
        self._open()

    # -- socket lifecycle -------------------------------------------------------------------------

    def _open(self) -> None:
        self._context = zmq.Context()
        try:
            self._socket = bind_sender(self._context, self.path)
        except Exception:
            self._context.term()
            self._context = None
            raise

    def _reopen(self) -> None:
        """After a failed session: drop queued frames and half-open peers with a fresh socket."""
        self.close()
        self._open()

    def close(self) -> None:
        """Close the socket (its file is removed); the sender cannot send afterwards."""
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
        if self._context is not None:
            self._context.term()  # returns once the listener is gone, so a rebind cannot race it
            self._context = None
            try:
                os.unlink(self.path)  # libzmq leaves the file; a closed sender should not look stale
            except FileNotFoundError:
                pass

    def __enter__(self) -> "BucketedWeightSender":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- public API -------------------------------------------------------------------------------

    def send(self, weights: Any) -> TransferStats:
        """Send every (name, tensor) of a sync or async iterable; returns after the receiver released."""
        if hasattr(weights, "__aiter__"):
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                return asyncio.run(self.asend(weights))
            raise InvalidInput("send() got an async iterable inside a running event loop; use `await sender.asend(...)`")
        try:
            iterator = iter(weights)
        except TypeError:
            raise InvalidInput(f"weights is a {type(weights).__name__}, not an iterable of (name, tensor)") from None
        return self._session(lambda: next(iterator, _END))

    async def asend(self, weights: Any) -> TransferStats:
        """``send()`` for event loops: the session runs in a worker thread; async items are pulled on this loop."""
        loop = asyncio.get_running_loop()
        if hasattr(weights, "__aiter__"):
            iterator = weights.__aiter__()

            def pull() -> Any:
                return asyncio.run_coroutine_threadsafe(_anext_or_end(iterator), loop).result()

        else:
            try:
                sync_iterator = iter(weights)
            except TypeError:
                raise InvalidInput(f"weights is a {type(weights).__name__}, not an iterable of (name, tensor)") from None

            def pull() -> Any:
                return next(sync_iterator, _END)

        return await asyncio.to_thread(self._session, pull)

    # -- one session ------------------------------------------------------------------------------

    def _session(self, pull: Callable[[], Any]) -> TransferStats:
        if self._socket is None:
            raise TransferError(f"sender on {self.endpoint!r} is closed")
        run = _SendSession(self, pull)
        try:
            return run.run()
        except BaseException as exc:
            run.abort(exc)
            self._reopen()
            raise
        finally:
            run.free()


class _SendSession:
    """State of one send(): the peer, the bucket, the packer and the sequence numbers."""

    def __init__(self, sender: BucketedWeightSender, pull: Callable[[], Any]) -> None:
        self.sender = sender
        self.sock: zmq.Socket = sender._socket  # type: ignore[assignment]
        self.pull = pull
        self.session = secrets.token_hex(8)
        self.phase = SessionPhase.HANDSHAKE
        self.peer: bytes | None = None
        self.bucket: shm.ShmBucket | cuda_ipc.CudaIpcBucket | None = None
        self.packer: BucketPacker | None = None
        self.setup_sent = False
        self.set_up = False  # the receiver said ready: it mapped the bucket
        self.remote_failed = False
        self.seq = 0
        self.unacked: deque[tuple[int, int]] = deque()  # (seq, bit mask of the halves it occupies)
        self.ack_wait_s = 0.0
        self.items = 0
        self.seen: set[str] = set()
        self.need_cuda = sender.transport == "cuda_ipc"

    def run(self) -> TransferStats:
        start = time.perf_counter()
        hello = self._await_hello()
        self._mark("hello_wait", start)
        first = self._next_item()
        began = time.perf_counter()
        self._set_up(hello, first)
        self._mark("setup", began)
        began = time.perf_counter()
        self.phase = SessionPhase.STREAMING
        total_bytes = 0
        item = first
        if self.packer is not None:
            pack, next_item = self.packer.pack, self._next_item
            while item is not None:
                pack(*item)
                total_bytes += item[1].nbytes
                item = next_item()
            self.packer.finish()
        else:
            self._send_bucket(0, False, [], True)  # an empty stream: the receiver still learns it ended
        self._mark("stream", began)
        began = time.perf_counter()
        self.phase = SessionPhase.DRAINING
        last_seq, _ = self.unacked.pop()
        while self.unacked:
            self._await("done", self.unacked.popleft()[0])
        self._await("released", last_seq)
        self._mark("drain_and_release", began)
        log.debug("final ACK received", extra={"refit_event": "final_ack_received", "peer_pid": hello.get("pid")})
        self.phase = SessionPhase.RELEASED
        return TransferStats(
            bytes=total_bytes, tensors=self.items, buckets=self.seq,
            seconds=time.perf_counter() - start, ack_wait_s=self.ack_wait_s,
        )  # fmt: skip

    def _mark(self, phase: str, began: float) -> None:
        self.sender.last_timings_s[phase] = time.perf_counter() - began

    # -- items and buckets ------------------------------------------------------------------------

    def _next_item(self) -> CheckedItem | None:
        item = self.pull()
        if item is _END:
            return None
        checked = check_item(self.items, item, self.seen, need_cuda=self.need_cuda)
        self.items += 1
        return checked

    def _set_up(self, hello: dict[str, Any], first: CheckedItem | None) -> None:
        transport = self._choose_transport(hello, first)
        half = self.sender.half_bytes
        if transport == "shm":
            self.bucket = shm.ShmBucket(2 * half, session=self.session)
        elif transport == "cuda_ipc":
            assert first is not None
            self.bucket = cuda_ipc.CudaIpcBucket(2 * half, device=first[1].device)
        handle = self.bucket.handle() if self.bucket is not None else {}
        self._send(encode("setup", session=self.session, transport=transport, half_bytes=half, handle=handle))
        self.setup_sent = True
        # No wait for "ready" here: the first bucket is packed while the receiver maps the buffer.
        if self.bucket is not None:
            self.packer = BucketPacker(self.bucket.tensor, half, send_bucket=self._send_bucket, wait_free=self._wait_free)

    def _await_ready(self) -> None:
        self._await("ready", None)
        self.set_up = True
        if self.bucket is not None:
            self.bucket.receiver_mapped()

    def _choose_transport(self, hello: dict[str, Any], first: CheckedItem | None) -> str:
        if first is None:
            return "none"
        receiver_cuda = hello.get("device") == "cuda"
        wanted = self.sender.transport
        if wanted == "cuda_ipc" and not receiver_cuda:
            raise TransferError(f"transport='cuda_ipc' but the receiver on {self.sender.endpoint!r} is on the CPU")
        if wanted == "auto":
            wanted = "cuda_ipc" if receiver_cuda and first[1].is_cuda and cuda_ipc.ipc_available() else "shm"
        self.need_cuda = wanted == "cuda_ipc"
        if self.need_cuda and not first[1].is_cuda:
            raise InvalidInput(f"{first[0]!r} is on {first[1].device}; transport='cuda_ipc' needs CUDA tensors")
        return wanted

    def _send_bucket(self, half: int, wide: bool, entries: list[Any], last: bool) -> None:
        """Ship one packed bucket, once the receiver has mapped the buffer and the copies into it are done."""
        if self.bucket is not None:
            self.bucket.mark_packed()
        payload = encode("bucket", session=self.session, seq=self.seq, half=half, wide=wide, last=last, entries=entries)
        if not self.set_up:
            self._await_ready()
        if self.bucket is not None:
            self.bucket.wait_packed()  # the receiver must read complete bytes
        self._send(payload)
        self.unacked.append((self.seq, BOTH_HALVES if wide else 1 << half))
        self.seq += 1

    def _wait_free(self, halves: int) -> None:
        """Wait until no bucket in flight occupies ``halves`` (double buffering: we overwrite them next)."""
        while any(mask & halves for _, mask in self.unacked):
            self._await("done", self.unacked.popleft()[0])  # the receiver consumes buckets in order

    # -- frames ---------------------------------------------------------------------------------

    def _send(self, payload: bytes) -> None:
        assert self.peer is not None
        try:
            self.sock.send_multipart([self.peer, payload], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            raise TransferTimeout(
                f"{self.phase.value}: receiver on {self.sender.endpoint!r} is gone ({exc}) at bucket {self.seq}"
            ) from None

    def _recv(self, waiting_for: str) -> tuple[bytes, dict[str, Any]]:
        parts = recv_frame(
            self.sock, timeout_s=self.sender.timeout_s, phase=self.phase,
            waiting_for=waiting_for, peer=f"the receiver on {self.sender.endpoint!r}",
        )  # fmt: skip
        if len(parts) != 2:
            raise ProtocolError(f"{self.phase.value}: a {len(parts) - 1}-part message on {self.sender.endpoint!r}")
        return parts[0], decode(parts[1])

    def _await_hello(self) -> dict[str, Any]:
        while True:
            peer, frame = self._recv("hello (is a receiver connected?)")
            if frame["kind"] == "hello":
                self.peer = peer
                return frame
            log.debug("dropped a stale %s frame before the handshake", frame["kind"])

    def _await(self, kind: str, seq: int | None) -> dict[str, Any]:
        """Wait for ``kind`` (for bucket ``seq``) from our peer; an error frame becomes TransferError."""
        waiting_for = f"{kind} for bucket {seq}" if seq is not None else kind
        began = time.perf_counter()
        try:
            while True:
                peer, frame = self._recv(waiting_for)
                if peer != self.peer:
                    if frame["kind"] == "hello":  # another receiver: tell it we are busy
                        self.sock.send_multipart([peer, encode("abort", session="", reason="sender busy")], flags=zmq.NOBLOCK)
                    continue  # a well-formed frame from an earlier session's peer
                if frame["kind"] == "error":
                    message = str(frame.get("message"))
                    self.remote_failed = True  # the receiver released before it reported
                    raise TransferError(
                        f"receiver on {self.sender.endpoint!r} failed ({frame.get('phase')}): {message}",
                        remote_message=message,
                    )
                expect(frame, kind, session=self.session)
                if seq is not None and frame.get("seq") != seq:
                    raise ProtocolError(f"{kind} for bucket {frame.get('seq')!r}, expected bucket {seq}")
                return frame
        finally:
            if kind in ("done", "released"):
                self.ack_wait_s += time.perf_counter() - began

    # -- failure and cleanup ----------------------------------------------------------------------

    def abort(self, exc: BaseException) -> None:
        """Tell a live receiver the session is over and, when it can still answer, wait for it to release."""
        self.phase = SessionPhase.RELEASED
        if self.peer is None or self.remote_failed:
            return  # no receiver yet, or it already released and reported
        try:
            self.sock.send_multipart([self.peer, encode("abort", session=self.session, reason=repr(exc))], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            return
        if isinstance(exc, (TransferTimeout, ProtocolError)) or not self.setup_sent:
            return  # the peer is dead, hostile or was never asked to map the bucket: free without waiting
        # Wait (bounded) for the receiver to unmap (it may still be mapping: setup went out before
        # ready came back) before the bucket is freed under it.
        deadline = time.monotonic() + self.sender.timeout_s
        try:
            while time.monotonic() < deadline:
                peer, frame = self._recv("released after abort")
                if peer == self.peer and frame["kind"] in ("released", "error") and frame.get("session") == self.session:
                    return
        except TransferError as late:
            log.warning("receiver did not confirm the abort on %r: %s", self.sender.endpoint, late)

    def free(self) -> None:
        """Free the bucket (idempotent); after this the sender holds no bucket memory."""
        if self.packer is not None:
            self.packer.detach()  # a traceback may still reference the packer; it must not keep the bucket
        self.packer = None
        bucket, self.bucket = self.bucket, None
        if bucket is not None:
            began = time.perf_counter()
            bucket.free()
            self._mark("free", began)
