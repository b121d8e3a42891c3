"""vLLM side of a weight sync: a worker extension that receives a refitkit session into the live model.

Start the engine with the extension mixed into its workers::

    llm = LLM(model=path, worker_extension_cls="refitkit.rollout.vllm.RefitWorkerExtension")

then, every step, ``push_weights(llm, sender, weights)`` (a ``BucketedWeightSender``: ZMQ + CUDA
IPC or shm, same host) or ``push_weights_broadcast(llm, sender, weights, secret=..., version=...)``
(a ``BroadcastWeightSender``: gloo or NCCL, other GPUs or nodes). Both tell the workers to receive
(``collective_rpc``, in a helper thread) while this thread sends, bounded by the sender's timeout.
Only strings and numbers cross ``collective_rpc`` (tensors in its arguments do not arrive as
tensors); the weights travel through the transport. Each worker loads the stream through
``Worker.reload_weights(weights_iterator=...)``.

Weight versions (see ``refitkit.rollout.versions``): every sync carries a version; each worker
keeps the version of its last whole sync and reports its weights *incomplete* after a sync that
failed part-way or did not deliver every weight of the engine's checkpoint (``push_weights`` then
raises ``InvalidInput`` naming the missing weights). ``clean_weight_version(llm)`` returns the
version only while every worker is clean. Everything of vLLM's beyond ``reload_weights`` lives in
``_vllm_internals``.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from refitkit.errors import InvalidInput, TransferError, TransferTimeout
from refitkit.rollout import _vllm_internals as internals
from refitkit.rollout._stream_bridge import ReceiveBridge
from refitkit.rollout.versions import MISSING_SHOWN, EngineWeights, SyncCoverage, coverage_of, weight_version_of
from refitkit.transfer.broadcast_receiver import BroadcastWeightReceiver, WeightVersion
from refitkit.transfer.broadcast_sender import checked_version
from refitkit.transfer.packing import check_items
from refitkit.transfer.phases import TransferStats
from refitkit.transfer.receiver import BucketedWeightReceiver

log = logging.getLogger(__name__)

EXTENSION_QUALNAME = "refitkit.rollout.vllm.RefitWorkerExtension"
RPC_SLACK_S = 30.0  # on top of the receiver's timeout: the worker may still be loading when the sender finishes
_UNREAD = object()  # the checkpoint's names not read yet


class RefitWorkerExtension:
    """Methods mixed into every vLLM worker (``worker_extension_cls``), called via ``llm.collective_rpc``."""

    _refit_state: EngineWeights | None = None
    _refit_expected: Any = _UNREAD

    def refit_receive(self, endpoint: str, timeout_s: float = 120.0, version: int | None = None) -> dict[str, Any]:
        """Receive one session from the ``BucketedWeightSender`` on ``endpoint`` as weight ``version``; plain stats.

        ``endpoint`` may contain ``{rank}``, replaced by this worker's rank (one sender per rank when
        several workers each need the full weights); ``version`` None means one above any seen. A
        failure is reported to the sender (which raises ``TransferError``) and re-raised here; the
        model keeps serving, with the weights loaded so far (reported incomplete), until a push completes.
        """
        if not isinstance(endpoint, str):
            raise InvalidInput(f"endpoint must be a str (name or ipc:///path), got {type(endpoint).__name__}")
        state = self._refit_weights()
        number = state.next_version() if version is None else checked_version(version)
        endpoint = endpoint.replace("{rank}", str(internals.worker_rank(self)))
        receiver = BucketedWeightReceiver(endpoint, internals.worker_device(self), timeout_s=timeout_s)
        began = time.perf_counter()
        weights = receiver.iter_weights()
        tracked = _Tracked(weights, clone=True)
        try:
            self.reload_weights(weights_iterator=iter(tracked))  # type: ignore[attr-defined]
        except BaseException:
            state.failed(number, touched=tracked.handed_out > 0)  # layers that got nothing keep their old tensors
            weights.close()  # releases the bucket, then the sender gets an error frame (TransferError there)
            internals.recover_after_failed_reload(self)
            raise
        weights.close()  # a no-op after the whole stream; a loader that stopped early fails the session here
        if receiver.last_stats is None:
            state.failed(number, touched=True)
            raise TransferError(f"vLLM's reload_weights returned before the last tensor from {endpoint!r}")
        coverage = self._refit_landed(number, tracked.names)
        return {**_stats_dict(receiver.last_stats), **_coverage_dict(number, coverage), "load_s": time.perf_counter() - began}

    def refit_receive_broadcast(
        self, rendezvous: str, secret: str | bytes, timeout_s: float = 120.0, first_rank: int = 1, backend: str = "gloo"
    ) -> dict[str, Any]:
        """Join the ``BroadcastWeightSender`` at ``rendezvous`` (as rank ``first_rank`` + this worker's rank) for
        its next session and load the stream; the version is the one the sender gives the session."""
        state = self._refit_weights()
        rank = int(first_rank) + internals.worker_rank(self)
        receiver = BroadcastWeightReceiver(
            rendezvous, secret=secret, rank=rank, device=internals.worker_device(self), backend=backend, timeout_s=timeout_s
        )  # fmt: skip
        began = time.perf_counter()
        bridge = ReceiveBridge(receiver.receive, timeout_s=receiver.timeout_s)
        tracked = _Tracked(bridge, clone=False)  # the bridge hands out its own copies
        try:
            try:
                self.reload_weights(weights_iterator=iter(tracked))  # type: ignore[attr-defined]
            except BaseException as exc:
                internals.recover_after_failed_reload(self)
                try:
                    bridge.finish(loader_error=exc)  # the sender hears vLLM's reason
                except BaseException as late:
                    if late is not exc:  # the stream's own error, raised through the loader: already the cause
                        exc.add_note(f"refitkit: the broadcast receiver then failed too: {type(late).__name__}: {late}")
                raise
            stats = bridge.finish()  # the loader took the whole stream; the receiver's error (if any) is the news
        except BaseException:
            # The session's version: it broke part-way (incomplete), or it landed and vLLM failed after it.
            landed = receiver.weights_version.version if receiver.last_stats is not None else None
            version = receiver.weights_version.incomplete if receiver.weights_version.incomplete is not None else landed
            state.failed(state.next_version() if version is None else version, touched=tracked.handed_out > 0)
            raise
        number = receiver.weights_version.version
        if number is None:  # the receiver records the session's version when it lands
            raise TransferError(f"broadcast session from {rendezvous} ended without a version (a bug in refitkit)")
        coverage = self._refit_landed(number, tracked.names)
        return {**_stats_dict(stats), **_coverage_dict(number, coverage), "rank": rank, "load_s": time.perf_counter() - began}

    def refit_weight_version(self) -> dict[str, Any]:
        """This worker's weight state: version, incomplete, clean, and the last sync's coverage (plain values)."""
        return self._refit_weights().as_dict()

    def refit_worker_info(self) -> dict[str, Any]:
        """This worker's pid, rank and device, and whether its weights are clean (plain values)."""
        return {
            "pid": os.getpid(), "rank": internals.worker_rank(self), "device": str(internals.worker_device(self)),
            "weights_consistent": self._refit_weights().version.clean,
        }  # fmt: skip

    def refit_checksums(self, names: list[str] | None = None) -> dict[str, str]:
        """sha256 of each named parameter's bytes as the engine holds them (all parameters by default)."""
        params = dict(internals.vllm_model(self).named_parameters())
        if names is None:
            names = sorted(params)
        missing = [name for name in names if name not in params]
        if missing:
            raise InvalidInput(f"no parameter(s) {missing} in the vLLM model (it has {len(params)}, e.g. {sorted(params)[:4]})")
        return {name: tensor_sha256(params[name]) for name in names}

    # -- state (attributes prefixed: they share the worker's namespace) ----------------------------

    def _refit_weights(self) -> EngineWeights:
        if self._refit_state is None:
            self._refit_state = EngineWeights()
        return self._refit_state

    def _refit_landed(self, version: int, names: set[str]) -> SyncCoverage:
        if self._refit_expected is _UNREAD:
            self._refit_expected = internals.checkpoint_weight_names(self)
        coverage = coverage_of(names, self._refit_expected)
        self._refit_weights().landed(version, coverage)
        if not coverage.complete:
            log.warning("weight sync of version %d covered only %s: weights incomplete", version, coverage.describe())
        return coverage


@dataclass(frozen=True)
class VllmPushStats:
    """One push as seen by the trainer (``sender``) and by each vLLM worker (``workers``, plain dicts)."""

    sender: TransferStats
    workers: list[dict[str, Any]]


def push_weights(
    llm: Any, sender: Any, weights: Iterable[tuple[str, torch.Tensor]], *, version: int | None = None,
    timeout_s: float | None = None,
) -> VllmPushStats:  # fmt: skip
    """Send ``weights`` through a ``BucketedWeightSender`` into a vLLM ``LLM`` running ``RefitWorkerExtension``.

    The workers' ``refit_receive`` runs in a helper thread while this thread sends. ``version``
    (default: one above any the workers saw) tags the sync. ``timeout_s`` (default: the sender's)
    bounds the worker's receiver; the rpc gets ``RPC_SLACK_S`` more. A receiver failure raises the
    sender's ``TransferError`` with vLLM's message appended; bad items raise ``InvalidInput`` naming
    the tensor: a list or tuple before any worker waits (the engine's weights are untouched), a
    generator's when it is reached (the engine then reports its weights incomplete until a push
    completes). A push that did not deliver every weight the engine loads raises ``InvalidInput``
    naming the missing ones (the weights it did deliver were loaded: the engine reports incomplete).
    """
    number = None if version is None else checked_version(version)
    timeout_s = _checked_timeout(sender, timeout_s)
    weights = _checked_weights(weights, need_cuda=getattr(sender, "transport", None) == "cuda_ipc")
    endpoint = f"ipc://{sender.path}"  # absolute: the engine's processes may see another socket dir
    pushed = _drive(llm, "refit_receive", (endpoint, timeout_s, number), lambda: sender.send(weights), timeout_s)
    _raise_if_partial(pushed)
    return pushed


def push_weights_broadcast(
    llm: Any, sender: Any, weights: Iterable[tuple[str, torch.Tensor]], *, secret: str | bytes, version: int,
    first_rank: int = 1, timeout_s: float | None = None,
) -> VllmPushStats:  # fmt: skip
    """Broadcast ``weights`` through a ``BroadcastWeightSender`` into a vLLM ``LLM`` as weight ``version``.

    The LLM's workers join as ranks ``first_rank``.. (other receivers of the sender take the other
    ranks; the sender admits exactly its ``receivers``). ``secret`` is the job's secret (the
    sender's), ``timeout_s`` as in ``push_weights``; failures and partial pushes raise as there.
    """
    number = checked_version(version)
    timeout_s = _checked_timeout(sender, timeout_s)
    weights = _checked_weights(weights, need_cuda=False)
    if isinstance(first_rank, bool) or not isinstance(first_rank, int) or first_rank < 1:
        raise InvalidInput(f"first_rank={first_rank!r}; need an int >= 1 (rank 0 is the sender)")
    rendezvous = f"tcp://{sender.host}:{sender.port}"
    args = (rendezvous, secret, timeout_s, first_rank, sender.backend)
    pushed = _drive(llm, "refit_receive_broadcast", args, lambda: sender.send(weights, version=number), timeout_s)
    _raise_if_partial(pushed)
    return pushed


def weight_versions(llm: Any) -> list[WeightVersion]:
    """Each worker's ``WeightVersion`` (``clean`` False while a failed or partial sync's weights are in place)."""
    return [weight_version_of(state) for state in llm.collective_rpc("refit_weight_version")]


def clean_weight_version(llm: Any) -> int | None:
    """The version every worker serves, whole; None before the first sync. Raises ``TransferError`` while any
    worker's weights are incomplete or the workers disagree: an RL loop must not sample from them as that version."""
    states = llm.collective_rpc("refit_weight_version")
    for rank, state in enumerate(states):
        if not state["clean"]:
            missing = state["missing"]
            why = f"; it did not deliver {len(missing)} weights, e.g. {missing[:3]}" if missing else " (it failed part-way)"
            raise TransferError(
                f"vLLM worker {rank}'s weights are incomplete: sync of version {state['incomplete']} did not land whole"
                f"{why}; its last whole sync was version {state['version']}. Push every weight again"
            )
    versions = {state["version"] for state in states}
    if len(versions) > 1:
        raise TransferError(f"vLLM workers serve different weight versions {sorted(versions, key=str)}; push again")
    return versions.pop() if versions else None


def tensor_sha256(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's raw bytes (dtype and layout as stored), for bit-exact comparisons."""
    # A copy: numpy() on a tensor's own CPU storage makes that storage non-resizable (it could no longer be offloaded).
    raw = tensor.detach().to("cpu", copy=True).contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(raw.numpy().tobytes()).hexdigest()


# -- helpers ---------------------------------------------------------------------------------------


class _Tracked:
    """The stream handed to vLLM, counted and named (and copied when the source's tensors are bucket views).

    vLLM's layerwise reload keeps a layer's tensors until the layer is complete, past the point
    where the receiver reuses (or unmaps) the bucket they point into, so views cannot be passed on.
    """

    def __init__(self, weights: Iterable[tuple[str, torch.Tensor]], *, clone: bool) -> None:
        self.weights, self.clone = weights, clone
        self.handed_out = 0
        self.names: set[str] = set()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.weights:
            owned = tensor.clone() if self.clone else tensor
            tensor = None  # type: ignore[assignment]  # no bucket view may stay referenced while we are suspended
            self.handed_out += 1
            self.names.add(name)
            yield name, owned


def _checked_timeout(sender: Any, timeout_s: float | None) -> float:
    timeout_s = sender.timeout_s if timeout_s is None else float(timeout_s)
    if not timeout_s > 0:
        raise InvalidInput(f"timeout_s={timeout_s!r}; need a positive number of seconds")
    return timeout_s


def _checked_weights(weights: Any, *, need_cuda: bool) -> Any:
    """A list or tuple checked whole (refused before any worker waits: the engine sees no byte of it), else an iterator."""
    try:
        weights = weights if isinstance(weights, (list, tuple)) else iter(weights)
    except TypeError:
        raise InvalidInput(f"weights is a {type(weights).__name__}, not an iterable of (name, tensor)") from None
    if isinstance(weights, (list, tuple)):
        check_items(weights, need_cuda=need_cuda)
    return weights


def _drive(llm: Any, method: str, args: tuple[Any, ...], send: Callable[[], TransferStats], timeout_s: float) -> VllmPushStats:
    """Run the workers' ``method`` in a helper thread while ``send()`` runs here; both bounded."""
    rpc_timeout_s = timeout_s + RPC_SLACK_S
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="refitkit-vllm-rpc")
    try:
        rpc = pool.submit(llm.collective_rpc, method, timeout=rpc_timeout_s, args=args)
        try:
            sent = send()
        except TransferError as exc:
            # The worker released and reported (or never connected); its own error says why.
            engine_error = _error_of(rpc, wait_s=RPC_SLACK_S)
            if engine_error is None:
                raise
            raise type(exc)(f"{exc}; vLLM's {method}: {engine_error}", remote_message=exc.remote_message) from exc
        except BaseException:
            _error_of(rpc, wait_s=RPC_SLACK_S)  # bad input: the worker got an abort; return once it is idle
            raise
        done, _ = concurrent.futures.wait([rpc], timeout=rpc_timeout_s)
        if not done:
            raise TransferTimeout(
                f"vLLM's {method} did not return within {rpc_timeout_s:.0f} s after the sender finished "
                f"(timeout_s={timeout_s} + {RPC_SLACK_S:.0f} s slack)"
            )
        return VllmPushStats(sender=sent, workers=list(rpc.result()))
    finally:
        pool.shutdown(wait=False)  # a stuck rpc ends on its own timeout; do not wait past ours


def _raise_if_partial(pushed: VllmPushStats) -> None:
    for rank, worker in enumerate(pushed.workers):
        if not worker["complete"]:
            missing = worker["missing"]
            raise InvalidInput(
                f"the push delivered {worker['expected'] - len(missing)} of the {worker['expected']} weights vLLM worker "
                f"{rank} loads; missing {missing[:MISSING_SHOWN]}{' ...' if len(missing) > MISSING_SHOWN else ''}. The weights it did deliver were "
                f"loaded, so the engine now reports version {worker['version']} as incomplete: push every weight"
            )


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


def _coverage_dict(version: int, coverage: SyncCoverage) -> dict[str, Any]:
    return {
        "version": version, "complete": coverage.complete, "expected": coverage.expected,
        "missing": list(coverage.missing),
    }  # fmt: skip
