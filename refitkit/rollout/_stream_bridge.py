"""One iterator of (name, tensor) over a receiver that calls back per bucket (``BroadcastWeightReceiver.receive``).

vLLM loads a whole sync from one iterator (``reload_weights(weights_iterator=...)``), while the
broadcast receiver hands out a bucket at a time to a callback. The receiver runs in a helper
thread; its callback copies each tensor (the bucket's views die when the callback returns) into a
small queue that the loader's iterator drains. Every wait is bounded; a loader that stops early
makes the callback raise (``finish``), so the receiver reports the failure, and the loader's
reason, to the sender. The last bucket's callback returns only once the loader has taken the end
of the stream (it landed every weight before): the receiver's report of the session, which ends
the sender's ``send()``, then carries the loader's verdict, never an "ok" the loader contradicts
a moment later.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from refitkit.errors import TransferError, TransferTimeout, error_from_record, error_record

QUEUE_ITEMS = 16  # tensors copied ahead of the loader
POLL_S = 0.05  # how often a blocked side checks whether the other one gave up
_END = object()


class ReceiveBridge:
    """``receive(on_bucket)`` in a thread, seen as one iterator of owned tensors; ``handed_out`` counts them."""

    def __init__(
        self, receive: Callable[[Callable[[list[tuple[str, torch.Tensor]], bool], Any]], Any], *, timeout_s: float
    ) -> None:
        self.timeout_s = timeout_s
        self.handed_out = 0
        self.result: Any = None
        self._items: queue.Queue[Any] = queue.Queue(maxsize=QUEUE_ITEMS)
        self._stopped = threading.Event()  # the loader gave up: the callback must raise
        self._drained = threading.Event()  # the loader took the end of the stream: it landed every weight before
        self._error: BaseException | None = None
        self._reason = ""  # why the loader stopped, for the receiver's report to the sender
        self._loader_error: BaseException | None = (
            None  # refitkit's own reason: reported as itself (its code and fields)
        )
        self._thread = threading.Thread(
            target=self._run, args=(receive,), name="refitkit-broadcast-receive", daemon=True
        )

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        self._thread.start()
        while True:
            item = self._take()
            if item is _END:
                self._drained.set()
                return
            self.handed_out += 1
            yield item
            item = None

    def finish(self, loader_error: BaseException | None = None) -> Any:
        """Stop the receiver if it still runs (its session fails, naming ``loader_error``: why the loader stopped),
        wait (bounded) for its thread, re-raise its error; its ``receive()`` result otherwise."""
        if loader_error is not None:
            self._reason = f": {type(loader_error).__name__}: {loader_error}"
            record = error_record(loader_error)  # a copy of refitkit's own error (raised in the receiver's thread)
            self._loader_error = error_from_record(
                record.get("error_code"), str(loader_error), record.get("error_fields")
            )
        self._stopped.set()  # set after the reason: the receiver's thread reads it once it sees the event
        if self._thread.ident is None:  # the loader never asked for a weight: no session was joined
            return None
        self._thread.join(timeout=self.timeout_s + 2 * POLL_S + 1.0)
        if self._thread.is_alive():
            raise TransferTimeout(
                f"the broadcast receiver did not end within timeout_s={self.timeout_s:g} after the loader stopped"
            )
        if self._error is not None and self._error is not self._loader_error:  # (the loader's own reason: not news)
            raise self._error
        return self.result

    # -- the receiver's thread --------------------------------------------------------------------

    def _run(self, receive: Callable[..., Any]) -> None:
        try:
            self.result = receive(self._on_bucket)
            if not self._drained.is_set():  # (a stream whose last bucket never came through the callback)
                self._put(_END)
        except BaseException as exc:
            self._error = exc
            self._stopped.set()

    def _on_bucket(self, weights: list[tuple[str, torch.Tensor]], is_last: bool) -> None:
        for name, view in weights:
            self._put((name, view.clone()))  # the view is valid only during this call
        if is_last:  # the session's report waits for the loader's verdict on every weight
            self._put(_END)
            deadline = time.monotonic() + self.timeout_s
            while not self._drained.wait(POLL_S):
                self._raise_if_stopped()
                if time.monotonic() > deadline:
                    raise TransferTimeout(
                        f"the engine's loader did not take the last weights within timeout_s={self.timeout_s:g}; "
                        "raise timeout_s if it is only slow"
                    )

    def _raise_if_stopped(self) -> None:
        if self._stopped.is_set():
            if self._loader_error is not None:  # a refusal of refitkit's: the sender hears it as its type
                raise self._loader_error
            raise TransferError(
                f"the engine's loader stopped taking weights before the end of the stream{self._reason}"
            )

    def _put(self, item: Any) -> None:
        deadline = time.monotonic() + self.timeout_s
        while True:
            self._raise_if_stopped()
            try:
                self._items.put(item, timeout=POLL_S)
                return
            except queue.Full:
                if time.monotonic() > deadline:
                    raise TransferTimeout(
                        f"the engine's loader took no weight for timeout_s={self.timeout_s:g}; raise timeout_s if it is only slow"
                    ) from None

    # -- the loader's side ------------------------------------------------------------------------

    def _take(self) -> Any:
        # The receiver bounds each of its own waits by timeout_s; the slack covers one copy into the queue.
        deadline = time.monotonic() + self.timeout_s + 1.0
        while True:
            try:
                return self._items.get(timeout=POLL_S)
            except queue.Empty:
                pass
            if self._error is not None or not self._thread.is_alive():
                if self._items.empty():
                    raise (
                        self._error
                        if self._error is not None
                        else TransferError("the broadcast receiver ended without the end of the stream")
                    )
            if time.monotonic() > deadline:
                raise TransferTimeout(f"no weight from the broadcast receiver within timeout_s={self.timeout_s:g}")
