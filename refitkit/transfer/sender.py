"""The trainer side of a weight sync: stream (name, tensor) pairs through a double-buffered bucket.

One ``send()`` is one session: wait for a receiver's hello, allocate the bucket buffer (two halves
of ``bucket_bytes // 2``; a list or tuple that needs less gets less: the buffer is allocated and
freed every session, and freeing 2 GiB took 1.2-2.4 ms inside a session on the H200, 1.1 GiB
0.65-1.0 ms), let the receiver map it once (buckets are packed and their frames queued
meanwhile), stream buckets, and wait for the final ACK that the receiver sends only after it
released every view and its mapping. A bucket's frame leaves as soon as its copies are issued; its
bytes are announced when the copies finished, and its half is reused once the receiver announced
it done reading (both through ``doorbell``). The bucket is freed in a ``finally``, so the sender
holds 0 bytes of bucket memory after every ``send()``, whether it succeeded or not. A receiver
whose hello arrives during a session is served by the next ``send()``.

Validation: a list or tuple is checked whole (names, dtypes, devices, duplicates, layout) before
the sender waits for a hello, so no receiver sees a byte of a bad list; ``send()`` raises
``InvalidInput`` at once, and a receiver already waiting is refused with an ``abort`` frame (as for
weights that are not an iterable at all). A generator is checked item by item as it is consumed.

Failure semantics: an invalid generator item, an exception from the caller's iterator (also
``KeyboardInterrupt`` or ``SystemExit``), or a cancelled ``asend()`` aborts the session: the
receiver gets an ``abort`` frame, releases, and raises ``TransferError`` saying the weights are
INCOMPLETE and how many buckets and tensors it had already handed to ``on_bucket``: those were
applied (a stream cannot be taken back), but it never sees ``is_last=True``, so a loader that
commits on the last bucket commits nothing. ``send()`` then re-raises the original error
(``InvalidInput`` for bad items) once the bucket is freed.

One session at a time: a sender's socket belongs to the thread running its session. A second
``send()`` / ``asend()`` waits for the running one (at most ``timeout_s``, then ``TransferError``);
a ``send()`` from inside the running session's own iterator is refused at once. A cancelled
``asend()`` stops its worker thread within a wait slice (a caller's sync iterator that blocks is
waited for), aborts the receiver, frees the bucket and lets the next session run.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from refitkit.errors import InvalidInput, ProtocolError, TransferError
from refitkit.transfer import cuda_ipc, shm
from refitkit.transfer._send_session import CANCEL_SLICE_S, END, StopRequest, _Cancelled, _raise_if_cancelled, _SendSession
from refitkit.transfer.endpoint import WaitingReceivers, bind_sender, remove_socket_file, socket_identity, socket_path
from refitkit.transfer.packing import CheckedItem, check_items, half_bytes_for
from refitkit.transfer.phases import TransferStats, checked_knobs
from refitkit.transfer.protocol import ALIGN_BYTES, decode

log = logging.getLogger(__name__)

_Prepared = tuple[Callable[[], Any], list[CheckedItem] | None, bool]  # pull, a list's checked items, all on CUDA


async def _anext_or_end(iterator: Any) -> Any:
    try:
        return await iterator.__anext__()
    except StopAsyncIteration:
        return END


class BucketedWeightSender:
    """Binds ``endpoint`` and sends weights to one ``BucketedWeightReceiver`` per ``send()``."""

    def __init__(
        self, endpoint: str, bucket_bytes: int = 2 << 30, transport: str = "auto", timeout_s: float = 120.0
    ) -> None:
        timeout_s, bucket_bytes, transport = checked_knobs(  # type: ignore[assignment]
            timeout_s=timeout_s, bucket_bytes=bucket_bytes, transport=transport, min_bucket_bytes=4 * ALIGN_BYTES
        )
        if transport == "cuda_ipc" and not cuda_ipc.ipc_available():
            raise InvalidInput("transport='cuda_ipc' needs a CUDA GPU and the CUDA driver in the sender")
        self.endpoint = endpoint
        self.path = socket_path(endpoint)
        self.bucket_bytes = bucket_bytes
        self.half_bytes = bucket_bytes // 2 // ALIGN_BYTES * ALIGN_BYTES
        self.transport = transport
        self.timeout_s = timeout_s
        self._lock = threading.Lock()  # one session at a time: ZMQ sockets are not thread-safe
        self._owner: int | None = None  # the thread running the current session
        self._stop: StopRequest | None = None  # stops the current session (close() from another thread)
        self._closed = False
        self.last_timings_s: dict[str, float] = {}  # per-phase seconds of the last session, for benchmarks
        self._waiting = WaitingReceivers()  # hellos that arrived during a session, for the next ones
        shm.remove_stale_segments()
        self._context: zmq.Context | None = None
        self._socket: zmq.Socket | None = None
        self._open()

    # -- socket lifecycle -------------------------------------------------------------------------

    def _open(self) -> None:
        self._context = zmq.Context()
        try:
            self._socket = bind_sender(self._context, self.path)
            self._bound = socket_identity(self.path)  # close() removes this file, not a successor's
        except Exception:
            self._context.term()
            self._context = None
            raise

    def _reopen(self) -> None:
        """After a failed session: drop queued frames and half-open peers with a fresh socket."""
        # Waiting receivers' connections go with the old socket, hellos still queued in it too: tell
        # every one of them to fail fast and say hello again.
        self._refuse_waiting("the sender's previous session failed; say hello again")
        self._close_socket()
        self._open()

    def close(self) -> None:
        """Close the socket (its file is removed); the sender cannot send afterwards.

        A ``send()`` running in another thread is stopped first (its receiver aborted, its bucket
        freed), bounded by ``timeout_s``; closing from inside the running ``send()`` is refused."""
        if self._owner == threading.get_ident():
            raise TransferError(
                f"close() on {self.endpoint!r} was called from inside its own running send() (the weights "
                "iterator?); close the sender after send() returns"
            )
        self._closed = True
        stop = self._stop
        if stop is not None:
            stop.stop("the sender was closed (close())")
        if not self._lock.acquire(timeout=self.timeout_s + 1.0):
            raise TransferError(
                f"close() on {self.endpoint!r}: the running send() did not stop within timeout_s={self.timeout_s:g}"
            )
        try:
            self._close_socket()
        finally:
            self._lock.release()

    def _close_socket(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
        if self._context is not None:
            self._context.term()  # returns once the listener is gone, so a rebind cannot race it
            self._context = None
            remove_socket_file(self.path, self._bound)  # libzmq leaves the file; a closed sender should not look stale

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
        return self._exclusive(lambda: self._prepare(weights), None)

    async def asend(self, weights: Any) -> TransferStats:
        """``send()`` for event loops: the session runs in a worker thread; async items are pulled on this loop.

        Cancelling it (``task.cancel()``, ``asyncio.wait_for``) stops the session: the receiver is
        aborted and the bucket freed before the ``CancelledError`` propagates."""
        loop = asyncio.get_running_loop()
        cancel = StopRequest()
        if hasattr(weights, "__aiter__"):
            iterator = weights.__aiter__()

            def pull() -> Any:
                future = asyncio.run_coroutine_threadsafe(_anext_or_end(iterator), loop)
                while True:  # in slices: a cancelled asend() must not leave this thread waiting on the loop
                    try:
                        return future.result(CANCEL_SLICE_S)
                    except concurrent.futures.TimeoutError:
                        if cancel.is_set():
                            future.cancel()
                            raise _Cancelled("asend() was cancelled while waiting for the next item") from None

            def prepare() -> _Prepared:
                return pull, None, False

        else:

            def prepare() -> _Prepared:
                return self._prepare(weights)

        work = loop.run_in_executor(None, self._exclusive, prepare, cancel)
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            cancel.stop("asend() was cancelled")  # the worker aborts the receiver, frees the bucket, releases the lock
            await asyncio.wait([work])  # bounded: every wait of the session looks at ``cancel`` each slice
            raise

    # -- one session at a time --------------------------------------------------------------------

    def _exclusive(self, prepare: Callable[[], _Prepared], cancel: StopRequest | None) -> TransferStats:
        """Run one session holding the sender's lock (waiting for a running one at most ``timeout_s``)."""
        if self._owner == threading.get_ident():
            raise TransferError(
                f"send() on {self.endpoint!r} was called from inside its own running send() (the weights "
                "iterator?); one session at a time: send the weights after it returns"
            )
        deadline = time.monotonic() + self.timeout_s
        while not self._lock.acquire(timeout=CANCEL_SLICE_S):
            _raise_if_cancelled(cancel, "while waiting for another send() on this sender")
            if time.monotonic() >= deadline:
                raise TransferError(
                    f"another send() on {self.endpoint!r} held the sender for timeout_s={self.timeout_s:g}; a sender "
                    "runs one session at a time: wait for it, use another sender (endpoint), or raise timeout_s"
                )
        self._owner = threading.get_ident()
        self._stop = cancel = cancel if cancel is not None else StopRequest()
        try:
            if self._closed or self._socket is None:
                raise TransferError(f"sender on {self.endpoint!r} is closed")
            _raise_if_cancelled(cancel, "before its session started")
            try:
                pull, listed, all_cuda = prepare()
            except InvalidInput as exc:
                self._refuse_waiting(f"the sender's weights were invalid: {exc}")
                raise
            return self._session(pull, listed, all_cuda, cancel)
        finally:
            self._owner = self._stop = None
            self._lock.release()

    def _prepare(self, weights: Any) -> _Prepared:
        """(pull, the checked items of a list or tuple, whether they are all CUDA tensors) for a sync iterable."""
        if isinstance(weights, (list, tuple)):
            checked, all_cuda = check_items(weights, need_cuda=self.transport == "cuda_ipc")
            items = iter(checked)
            return lambda: next(items, END), checked, all_cuda
        try:
            iterator = iter(weights)
        except TypeError:
            raise InvalidInput(f"weights is a {type(weights).__name__}, not an iterable of (name, tensor)") from None
        return lambda: next(iterator, END), None, False

    def _refuse_waiting(self, reason: str) -> None:
        """Send an abort to every receiver whose hello is already here, so none waits its timeout for nothing."""
        if self._socket is None:
            return
        while self._socket.poll(0, zmq.POLLIN):
            try:
                peer, frame = self._socket.recv_multipart(zmq.NOBLOCK)[:2]
                hello = decode(frame)
            except (ValueError, ProtocolError):
                continue  # garbage is dropped, as a session would
            if hello["kind"] == "hello":
                self._waiting.add(peer, hello)
        self._waiting.turn_away(self._socket, reason)

    # -- one session ------------------------------------------------------------------------------

    def _session(
        self, pull: Callable[[], Any], listed: list[CheckedItem] | None, all_cuda: bool, cancel: StopRequest
    ) -> TransferStats:
        """One session; ``listed``: the checked items, when the caller gave a list or tuple (its tensors stay
        as they are during the session, so small copies may be deferred, and its size is known up front)."""
        if self._socket is None:
            raise TransferError(f"sender on {self.endpoint!r} is closed")
        run = _SendSession(self, pull, listed, all_cuda, cancel, half_bytes_for(listed, self.half_bytes))
        try:
            stats = run.run()
        except BaseException as exc:  # also KeyboardInterrupt / SystemExit from the caller's iterator
            try:
                run.abort(exc)
            finally:
                self._clean_up_after(run, exc)
            raise
        run.free()
        return stats

    def _clean_up_after(self, run: _SendSession, exc: BaseException) -> None:
        """After a failed session: free the bucket, then a fresh socket. Neither may hide ``exc``."""
        try:
            run.free()
        except Exception as late:
            log.error("sender on %r could not free the bucket after %r: %s", self.endpoint, exc, late)
        if self._closed or not run.ever_offered:
            return  # closing anyway, or no receiver was ever offered the bucket: the socket holds no session
        try:
            self._reopen()
        except Exception as late:  # the sender is closed now; its next send() says so
            log.error("sender on %r could not rebind after %r (it is closed now): %s", self.endpoint, exc, late)
            exc.add_note(f"refitkit: the sender could not rebind {self.endpoint!r} afterwards and is closed: {late!r}")
