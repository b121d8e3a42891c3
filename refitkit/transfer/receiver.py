"""The inference side of a weight sync: map the sender's bucket once, hand out tensors, release, ACK.

``receive(on_bucket)`` calls ``on_bucket(weights, is_last)`` once per bucket (at least once: an
empty stream gives one call with ``[]`` and ``is_last=True``). ``iter_weights()`` is the same
session as one generator. Tensors are views into the bucket (also a tensor larger than a half,
which comes whole in a wide bucket; only tensors larger than the whole bucket are split across
buckets and reassembled on the receiver's device) and are valid only during the call / until the
next tensor is requested: copy what you keep. A GPU receiver on the shm transport hands out views
of a device staging buffer instead, under the same rule: a view kept past release is an error.

Ordering that keeps the sender's memory free: after the last bucket the receiver drops every
view, unmaps the bucket (and on CUDA runs ``ipc_collect`` + ``empty_cache``) and only then sends
the final ACK. Any failure (``on_bucket`` raising, also ``KeyboardInterrupt`` / ``SystemExit``,
which are re-raised as they are after the report; a view kept past release, a sender abort, a
timeout) also releases first and, when the sender can still hear it, reports an error frame.

Streams: on CUDA the receiver hands a bucket back (its half may then be overwritten by the sender)
and unmaps it once the work queued *so far* on the current stream has run. A loader that reads the
bucket on other streams (its own copy streams) must hand them over with ``receiver.wait_on(stream,
...)`` from inside ``on_bucket`` / the loop over ``iter_weights()``: every hand-back and the release
then also wait for the work queued on those streams, for the rest of the session. Reads on a stream
the receiver does not know about may see bytes of the next bucket.

Everything from the wire is checked before it is used (``protocol``): offsets, lengths, shapes and
sequence numbers against the session's announced bucket, the mapping's real size and the tensor's
own totals; a split tensor may not be larger than the receiving device's memory. A bad frame is a
ProtocolError; the session releases and reports it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from refitkit.errors import InvalidInput, TransferError
from refitkit.transfer._receive_session import _ReceiveSession
from refitkit.transfer.endpoint import socket_path
from refitkit.transfer.phases import SessionPhase, TransferStats, checked_device, checked_knobs
from refitkit.transfer.protocol import brief


OnBucket = Callable[[list[tuple[str, torch.Tensor]], bool], Any]


class BucketedWeightReceiver:
    """Connects to a sender's ``endpoint`` and receives one session per ``receive()`` / ``iter_weights()``."""

    def __init__(self, endpoint: str, device: str | torch.device, timeout_s: float = 120.0) -> None:
        self.timeout_s, _, _ = checked_knobs(timeout_s=timeout_s)
        self.device = checked_device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.endpoint = endpoint
        self.path = socket_path(endpoint)
        self.last_stats: TransferStats | None = None
        self._active: _ReceiveSession | None = None  # the session running now, for wait_on()

    def wait_on(self, *streams: Any) -> None:
        """From inside ``on_bucket`` / a loop over ``iter_weights()``: also wait for work queued on ``streams``
        (torch.cuda.Stream) before each bucket is handed back and before the release, for this session."""
        session = self._active
        if session is None or session.phase is not SessionPhase.STREAMING:
            raise InvalidInput("wait_on() is for the streams of a running session: call it from on_bucket or the loop")
        for stream in streams:
            if not isinstance(stream, torch.cuda.Stream) or self.device.type != "cuda":
                raise InvalidInput(f"wait_on({brief(stream)}): need torch.cuda.Stream objects on a CUDA receiver ({self.device})")
            session.streams.setdefault(stream.cuda_stream, stream)

    def receive(self, on_bucket: OnBucket) -> TransferStats:
        """Run one session, calling ``on_bucket(weights, is_last)`` per bucket; returns after the final ACK."""
        session = self._active = _ReceiveSession(self)
        try:
            session.open()
            while True:
                weights, last = session.next_bucket()
                failure = interrupted = None
                try:
                    on_bucket(weights, last)
                except Exception as exc:  # reported to the sender; the traceback must not keep views alive
                    failure = f"on_bucket raised {type(exc).__name__}: {exc}"
                except BaseException as exc:  # KeyboardInterrupt, SystemExit: report, release, then re-raise it
                    failure = f"on_bucket was interrupted by {type(exc).__name__}: {exc}"
                    interrupted = exc.with_traceback(None)  # its frames hold the views
                weights = None
                if failure is not None:
                    session.fail(failure)
                    if interrupted is not None:
                        raise interrupted
                    raise TransferError(failure)
                session.bucket_consumed(last)
                if last:
                    self.last_stats = session.stats()
                    return self.last_stats
        except BaseException as exc:  # also an interrupt while waiting: the sender must hear of it now
            session.fail(f"receiver gave up: {type(exc).__name__}: {exc}")
            raise
        finally:
            self._active = None
            session.close()

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The session as one generator; release + final ACK happen when it is exhausted or closed."""
        session = self._active = _ReceiveSession(self)
        yielded = 0
        complete = False
        try:
            session.open()
            while True:
                weights, last = session.next_bucket()
                for index in range(len(weights)):
                    name, tensor = weights[index]
                    weights[index] = None  # type: ignore[call-overload]
                    complete = last and index == len(weights) - 1
                    if complete and session.is_bucket_view(tensor):
                        # A for-loop still holds this tensor when it asks for the end (which releases the
                        # bucket); handing out a copy lets the release happen without a dangling view.
                        tensor = tensor.clone()
                    yielded += 1
                    yield name, tensor
                    name = tensor = None  # type: ignore[assignment]
                weights = None  # type: ignore[assignment]
                session.bucket_consumed(last)
                if last:
                    self.last_stats = session.stats()
                    return
        except GeneratorExit:
            name = tensor = weights = None  # type: ignore[assignment]
            if complete:  # closed after the last tensor: a normal end
                session.bucket_consumed(True)
                self.last_stats = session.stats()
            else:
                session.fail(f"iter_weights() was closed after {yielded} tensors, before the last bucket")
        except BaseException as exc:  # also KeyboardInterrupt / SystemExit thrown in at a yield
            name = tensor = weights = None  # type: ignore[assignment]
            session.fail(f"receiver gave up after {yielded} tensors: {type(exc).__name__}: {exc}")
            raise
        finally:
            if self._active is session:
                self._active = None
            session.close()
