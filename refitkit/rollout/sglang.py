"""SGLang side of a weight sync: refitkit sessions received inside SGLang's schedulers, driven from its ``Engine``.

Tested on one H200 with SGLang 0.5.17 (``tests/engines/sglang``; see ``docs/sglang.md``).

refitkit's ``sglang.srt.plugins`` entry point (``register_with_sglang``) runs in every SGLang process and
hooks the scheduler's ``update_weights_from_ipc`` (``_sglang_internals`` says where and why). The trainer
then calls ``push_weights(engine, sender, weights)`` (a ``BucketedWeightSender``: ZMQ + CUDA IPC or shm,
same host) or ``push_weights_broadcast(...)`` (a ``BroadcastWeightSender``): a helper thread calls
``Engine.update_weights_from_ipc(zmq_handles={"refitkit": <JSON request>})`` while this thread sends, both
bounded. Only strings cross SGLang's control path (SGLang pickles its own control messages; refitkit's wire
carries none); the weights travel through the transport, each bucket landed in place through the model's
``load_weights`` (``DirectLoads``: one copy on arrival). SGLang's writer lock keeps generation out while a
sync runs; its cache flush follows a sync; its answer, ``(success, message)``, carries refitkit's JSON reply.

Weight versions and coverage as for vLLM (``refitkit.rollout.versions``). The same request path answers the
queries ``collective_rpc`` cannot (it discards return values): ``engine_state`` (versions, released memory,
free bytes, parameter fingerprints). Under tensor parallelism every scheduler joins the broadcast and loads its
shard; each TP rank's reply reaches TP rank 0 over SGLang's TP CPU group (JSON bytes in tensors, ``gather_replies``),
whose answer carries them all (``tp_ranks``): a failure on any rank fails the call, naming the rank. Over CUDA IPC one
sender feeds one scheduler (TP=1).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from refitkit._knobs import renamed_knob
from refitkit.errors import EngineAsleep, EngineError, InvalidInput, TransferError
from refitkit.rollout import _sglang_internals as internals
from refitkit.rollout._push import RPC_SLACK_S, EngineCall, PushStats, drive, raise_if_partial, rank_error
from refitkit.rollout.checkpoint_names import checkpoint_weight_names
from refitkit.rollout.load_plan import DirectLoads
from refitkit.rollout.sessions import (
    HelperThreads,
    KeptBroadcast,
    SyncProgress,
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
from refitkit.rollout.versions import MISSING_SHOWN, EngineWeights, coverage_of, weight_version_of
from refitkit.rollout.vllm import tensor_fingerprint
from refitkit.transfer import (
    BucketedWeightReceiver,
    ChannelState,
    TransferStats,
    WeightVersion,
)
from refitkit.transfer.common import checked_version
from refitkit.transfer.protocol import failure_fields

log = logging.getLogger(__name__)

PLUGIN_NAME = "refitkit"  # the entry point's name in sglang.srt.plugins (SGLANG_PLUGINS may whitelist it)
PROTOCOL = 2  # the "refitkit" field of every request and reply (2: a failure crosses as its code and fields)
_UNREAD = object()


# -- the request and reply codec (JSON strings in SGLang's zmq_handles and message) ------------------------

REQUEST_FIELDS: dict[str, dict[str, tuple[type, ...]]] = {
    "receive": {"endpoint": (str,), "timeout_s": (int, float), "version": (int, type(None))},
    "receive_broadcast": {
        "rendezvous": (str,),
        "secret": (str,),
        "timeout_s": (int, float),
        "first_rank": (int,),
        "backend": (str,),
    },
    "state": {"fingerprints": (list, type(None))},  # parameter names, [] for all of them, None for none
    "discarded": {},
    "close": {},
}


def encode_request(op: str, **fields: Any) -> str:
    """One request as JSON, checked as the scheduler will check it."""
    text = json.dumps({"refitkit": PROTOCOL, "op": op, **fields})
    decode_request(text)
    return text


def decode_request(text: str) -> dict[str, Any]:
    """A request's fields (with ``op``); ``InvalidInput`` naming what is wrong with anything else."""
    try:
        request = json.loads(text)
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"refitkit request is not JSON: {exc}") from None
    if not isinstance(request, dict) or request.get("refitkit") != PROTOCOL:
        raise InvalidInput(f"refitkit request without protocol {PROTOCOL}: {str(text)[:200]!r}")
    op = request.get("op")
    if op not in REQUEST_FIELDS:
        raise InvalidInput(f"refitkit request op {op!r}; known: {sorted(REQUEST_FIELDS)}")
    fields = REQUEST_FIELDS[op]
    extra = set(request) - set(fields) - {"refitkit", "op"}
    if extra:
        raise InvalidInput(f"refitkit {op} request has unknown fields {sorted(extra)}")
    for name, types in fields.items():
        value = request.get(name)
        if isinstance(value, bool) or not isinstance(value, types):
            raise InvalidInput(
                f"refitkit {op} request: {name}={value!r}; need {' or '.join(t.__name__ for t in types)}"
            )
    names = request.get("fingerprints")
    if isinstance(names, list) and not all(isinstance(name, str) for name in names):
        raise InvalidInput("refitkit state request: fingerprints must be a list of parameter names")
    return request


def encode_reply(
    *, result: dict[str, Any] | None = None, error: BaseException | None = None, weights: dict[str, Any] | None = None
) -> str:
    """The scheduler's answer: ``result`` (plain values), or ``error`` as its code, fields and frames (``failure_fields``)
    with the scheduler's weight state (``weights``: what a failed sync had handed over)."""
    if error is None:
        return json.dumps({"refitkit": PROTOCOL, "ok": True, "result": result or {}})
    return json.dumps({"refitkit": PROTOCOL, "ok": False, "failure": failure_fields(error), "weights": weights})


def reply_reports(success: bool, message: str, *, what: str) -> list[dict[str, Any]]:
    """Each TP rank's report in SGLang's ``(success, message)`` for request ``what``: its result, or its failure as
    ``{"failure": ..., "weights": ...}``; a message that is not refitkit's means the plugin is not running there."""
    try:
        reply = json.loads(message)
    except (TypeError, ValueError):
        reply = None
    if not isinstance(reply, dict) or reply.get("refitkit") != PROTOCOL:
        raise InvalidInput(
            f"SGLang answered refitkit's {what} without refitkit's plugin (success={success}, message={str(message)[:300]!r}): "
            f"install refitkit in the engine's environment (its sglang.srt.plugins entry point {PLUGIN_NAME!r}), and "
            f"if SGLANG_PLUGINS is set, list {PLUGIN_NAME!r} in it; the trainer and the engine need the same refitkit "
            f"(reply protocol {PROTOCOL})"
        )
    if reply.get("ok"):
        if not success:
            raise EngineError(f"SGLang answered refitkit's {what} with success=False around refitkit's result")
        result = dict(reply.get("result") or {})
        return list(result.get("tp_ranks") or [result])
    return [
        dict(rank["result"])
        if rank.get("ok")
        else {"failure": dict(rank.get("failure") or {}), "weights": rank.get("weights")}
        for rank in reply.get("ranks") or [reply]
    ]


def decode_reply(success: bool, message: str, *, what: str) -> dict[str, Any]:
    """The result in SGLang's ``(success, message)`` for request ``what`` (TP rank 0's, every rank's under
    ``tp_ranks``); a rank's refusal or failure is raised as its own type, rebuilt from its code and fields."""
    reports = reply_reports(success, message, what=what)
    failed = [rank for rank, report in enumerate(reports) if "failure" in report]
    if failed:
        raise rank_error(reports, failed, what=f"SGLang's {what}", rank_name=_tp_rank)
    return dict(reports[0], tp_ranks=reports) if len(reports) > 1 else reports[0]


def _tp_rank(rank: int) -> str:
    return f"SGLang's TP rank {rank}"


# -- inside each scheduler process ---------------------------------------------------------------------


class SchedulerReceiver:
    """One SGLang scheduler's side of refitkit syncs: receives a session in place into its model and keeps its
    weight versions (one per model: a disk reload that replaces the model starts a fresh record)."""

    def __init__(
        self, *, model: torch.nn.Module, device: torch.device, rank: int, checkpoint: tuple[str, str | None, bool]
    ) -> None:
        self.model, self.device, self.rank, self.checkpoint = model, device, rank, checkpoint
        self.weights = EngineWeights()
        self.direct = DirectLoads(model, model.load_weights)
        self._expected: Any = _UNREAD
        self._receiver: BucketedWeightReceiver | None = None  # the last sync's, for the next on its endpoint
        self._broadcast = KeptBroadcast(device, f"SGLang scheduler (TP rank {rank})")  # for the next broadcast like it

    def receive(
        self, endpoint: str, timeout_s: float, version: int | None, *, weights_released: bool
    ) -> dict[str, Any]:
        """One session from the ``BucketedWeightSender`` on ``endpoint`` (``{rank}`` is this TP rank) as ``version``."""
        number = self.weights.next_version() if version is None else checked_version(version)
        endpoint = endpoint.replace("{rank}", str(self.rank))
        receiver = self._receiver
        if (
            receiver is None
            or receiver.state is ChannelState.CLOSED
            or receiver.endpoint != endpoint
            or receiver.timeout_s != timeout_s
        ):
            close_receiver(receiver, f"SGLang scheduler (TP rank {self.rank})")
            receiver = self._receiver = BucketedWeightReceiver(endpoint, self.device, timeout_s=timeout_s)
        if weights_released:
            refuse_session(receiver, self._asleep())
        return self._land(receiver.receive, lambda: number)

    def receive_broadcast(
        self, rendezvous: str, secret: str, timeout_s: float, first_rank: int, backend: str, *, weights_released: bool
    ) -> dict[str, Any]:
        """Join the ``BroadcastWeightSender`` at ``rendezvous`` as rank ``first_rank`` + this TP rank for one session,
        with the receiver kept from the last sync if it was opened with the same arguments (its group is reused)."""
        rank = first_rank + self.rank
        receiver = self._broadcast.open(rendezvous, secret, rank, backend, timeout_s)
        if weights_released:
            refuse_session(receiver, self._asleep())

        def number() -> int:  # the broadcast's version is the sender's, known once (part of) the session arrived
            version = receiver.weights_version
            found = version.incomplete if version.incomplete is not None else version.version
            return self.weights.next_version() if found is None else found

        return self._land(receiver.receive, number)

    def discarded(self) -> None:
        """The weights were released without a host backup: garbage until a full sync lands (reported incomplete)."""
        self.weights.failed(self.weights.next_version(), touched=True)

    def close(self) -> None:
        """Close the receiver kept for the next sync (the weight versions stay); a later sync opens a new one."""
        receiver, self._receiver = self._receiver, None
        close_receiver(receiver, f"SGLang scheduler (TP rank {self.rank})")
        self._broadcast.close()

    def _land(
        self, receive: Callable[[Callable[..., Any]], TransferStats], number: Callable[[], int]
    ) -> dict[str, Any]:
        began = time.perf_counter()
        progress = SyncProgress()
        try:
            stats = land_in_place(receive, self.direct, progress)
            # SGLang's next forward runs on its forward stream after the scheduler's (scheduler.py:3565): our copies
            # were issued on the scheduler's current stream, so they are ordered before it without a sync.
        except BaseException:
            handed = coverage_of(progress.names, self._expected_names())
            self.weights.failed(number(), touched=progress.touched, handed=handed)  # what loaded stays: a mix
            raise
        version = number()
        coverage = record_landing(self.weights, version, progress.names, self._expected_names())
        return sync_report(stats, version, coverage, progress, began)

    def _expected_names(self) -> frozenset[str] | None:
        if self._expected is _UNREAD:
            path, revision, tied = self.checkpoint
            self._expected = checkpoint_weight_names(path, revision=revision, tied_embeddings=tied)
        return self._expected

    def _asleep(self) -> EngineAsleep:
        return EngineAsleep(
            f"SGLang scheduler (TP rank {self.rank})'s weights are released (release_memory_occupation): a copy into "
            "them would fault. Resume them first: engine.resume_memory_occupation(tags=['weights']), or let "
            "SglangLink(sleep_level=...) drive release and resume"
        )


class SchedulerReceivers:
    """Each SGLang scheduler's ``SchedulerReceiver``, by the model it serves: refitkit's one process-wide registry.

    SGLang forces it. Its only plug-in point for a weight update is a class-level hook on the scheduler's
    ``update_weights_from_ipc`` (``_sglang_internals.register_update_hook``), called with SGLang's own updater, a slots
    dataclass that cannot carry an attribute of ours (``docs/dev/sglang-internals.md``); so what a scheduler keeps from
    one sync to the next (its weight versions, its plan of direct copies, its receiver) lives here, keyed by the model
    (held weakly: a reload from disk that replaces the model starts a fresh entry). Locked (nothing here assumes the
    scheduler's one thread); each entry is stamped with the process that made it, so a forked child sees none of its
    parent's (their connections and mappings are the parent's)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_model: weakref.WeakKeyDictionary[torch.nn.Module, tuple[int, SchedulerReceiver]] = (
            weakref.WeakKeyDictionary()
        )

    def get(self, model: torch.nn.Module) -> SchedulerReceiver | None:
        """The receiver of ``model`` made in this process, if any."""
        with self._lock:
            entry = self._by_model.get(model)
        return entry[1] if entry is not None and entry[0] == os.getpid() else None

    def get_or_make(self, model: torch.nn.Module, make: Callable[[], SchedulerReceiver]) -> SchedulerReceiver:
        """The receiver of ``model`` made in this process, or ``make()``'s, kept (a parent's entry is dropped, never
        closed: what it holds is the parent's)."""
        with self._lock:
            entry = self._by_model.get(model)
            if entry is not None and entry[0] == os.getpid():
                return entry[1]
            receiver = make()
            self._by_model[model] = (os.getpid(), receiver)
            return receiver


_SCHEDULER_RECEIVERS = SchedulerReceivers()


def scheduler_receiver(updater: Any) -> SchedulerReceiver:
    """The receiver of this scheduler's current model (``SchedulerReceivers`` says why it is kept there)."""
    model = internals.scheduler_model(updater)

    def make() -> SchedulerReceiver:
        rank, _ = internals.tp_rank_and_size(updater)
        return SchedulerReceiver(
            model=model,
            device=internals.scheduler_device(updater),
            rank=rank,
            checkpoint=internals.checkpoint_of(updater),
        )

    return _SCHEDULER_RECEIVERS.get_or_make(model, make)


def handle_update(original: Callable[[Any, Any], Any], updater: Any, recv_req: Any) -> Any:
    """The AROUND hook on the scheduler's ``update_weights_from_ipc``: refitkit's requests here, others to SGLang.

    Nothing may escape: an exception in a scheduler handler kills the whole engine (scheduler.py:4949). Every
    TP rank leaves through the barrier SGLang's own handler ends with."""
    text = internals.request_text(recv_req)
    if text is None:
        return original(updater, recv_req)
    try:
        reply = encode_reply(result=_serve(updater, recv_req, decode_request(text)))
    except Exception as exc:
        log.error("refitkit request failed in the SGLang scheduler: %s: %s", type(exc).__name__, exc)
        reply = encode_reply(error=exc, weights=_weight_state(updater))
    try:  # under TP every rank's outcome reaches the trainer through TP rank 0's answer
        success, reply = merge_replies(internals.tp_replies(updater, reply, gather_replies))
    except Exception as exc:
        log.error("refitkit could not gather the TP ranks' replies: %s: %s", type(exc).__name__, exc)
        success, reply = (
            False,
            encode_reply(error=EngineError(f"gathering the TP ranks' replies failed: {type(exc).__name__}: {exc}")),
        )
    try:
        internals.tp_barrier(updater)
    except Exception as exc:  # a broken TP group: say so in the answer rather than kill the scheduler
        log.error("refitkit: SGLang's TP barrier failed after a request: %s: %s", type(exc).__name__, exc)
        success, reply = (
            False,
            encode_reply(error=EngineError(f"SGLang's TP barrier failed: {type(exc).__name__}: {exc}")),
        )
    return internals.update_output(success, reply)


def gather_replies(group: Any, reply: str) -> list[str]:
    """Every rank's ``reply`` in rank order, over the CPU (gloo) process ``group``: UTF-8 bytes in uint8 tensors (sizes
    first), no pickle. Every rank of the group calls it."""
    data = (
        torch.frombuffer(bytearray(reply.encode()), dtype=torch.uint8) if reply else torch.empty(0, dtype=torch.uint8)
    )
    size = torch.tensor([data.numel()], dtype=torch.int64)
    sizes = [torch.empty_like(size) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(sizes, size, group=group)
    longest = max(int(s.item()) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: data.numel()] = data
    gathered = [torch.empty_like(padded) for _ in sizes]
    torch.distributed.all_gather(gathered, padded, group=group)
    return [t[: int(s.item())].numpy().tobytes().decode() for t, s in zip(gathered, sizes)]


def merge_replies(replies: list[str]) -> tuple[bool, str]:
    """One answer for the trainer from every TP rank's reply (rank order): rank 0's result with each rank's under
    ``tp_ranks`` when all succeeded, else every rank's reply under ``ranks`` (a failure with its code and fields)."""
    decoded = [json.loads(reply) for reply in replies]
    if len(decoded) == 1:
        return bool(decoded[0]["ok"]), replies[0]
    if not all(reply["ok"] for reply in decoded):
        return False, json.dumps({"refitkit": PROTOCOL, "ok": False, "ranks": decoded})
    result = dict(decoded[0]["result"], tp_ranks=[reply["result"] for reply in decoded])
    return True, encode_reply(result=result)


def _serve(updater: Any, recv_req: Any, request: dict[str, Any]) -> dict[str, Any]:
    op = request["op"]
    receiver = scheduler_receiver(updater)
    released = internals.WEIGHTS in internals.released_tags(updater)
    if op in ("receive", "receive_broadcast") and internals.has_draft_model(updater):
        raise InvalidInput("refitkit does not update a speculative-decoding draft model: start SGLang without one")
    if op == "receive":
        result = receiver.receive(
            request["endpoint"], float(request["timeout_s"]), request["version"], weights_released=released
        )
    elif op == "receive_broadcast":
        result = receiver.receive_broadcast(
            request["rendezvous"],
            request["secret"],
            float(request["timeout_s"]),
            request["first_rank"],
            request["backend"],
            weights_released=released,
        )
    elif op == "discarded":
        receiver.discarded()
        return {"weights": receiver.weights.as_dict()}
    elif op == "close":
        receiver.close()
        return {"weights": receiver.weights.as_dict()}
    else:
        return _state(updater, receiver, request["fingerprints"], weights_released=released)
    internals.flush_after_update(updater, recv_req)  # the prefix cache holds KV of the old weights (if asked to flush)
    return result


def _state(
    updater: Any, receiver: SchedulerReceiver, names: list[str] | None, *, weights_released: bool
) -> dict[str, Any]:
    """This scheduler's weight versions, released memory, device memory and (with ``names``) parameter fingerprints."""
    free_bytes, total_bytes = torch.cuda.mem_get_info(receiver.device)
    rank, tp_size = internals.tp_rank_and_size(updater)
    state = {
        "weights": receiver.weights.as_dict(),
        "released": internals.released_tags(updater),
        "idle": internals.is_idle(updater),
        "free_bytes": int(free_bytes),
        "total_bytes": int(total_bytes),
        "kv_cache_bytes": internals.kv_cache_bytes(updater),
        "rank": rank,
        "tp_size": tp_size,
        "pid": os.getpid(),
        "device": str(receiver.device),
    }
    if names is not None:
        if weights_released:
            raise EngineAsleep("fingerprints of released weights would read unmapped memory: resume the weights first")
        params = dict(receiver.model.named_parameters())
        missing = [name for name in names if name not in params]
        if missing:
            raise InvalidInput(
                f"no parameter(s) {missing[:MISSING_SHOWN]} in the SGLang model (it has {len(params)}, e.g. {sorted(params)[:4]})"
            )
        state["fingerprints"] = {name: tensor_fingerprint(params[name]) for name in (names or sorted(params))}
    return state


def _weight_state(updater: Any) -> dict[str, Any] | None:
    """The scheduler's weight state for a failure's reply (None where no sync ran yet or the model is unreadable)."""
    try:
        receiver = _SCHEDULER_RECEIVERS.get(internals.scheduler_model(updater))
    except Exception:  # (the reply must go out whatever the updater holds)
        return None
    return None if receiver is None else receiver.weights.as_dict()


def register_with_sglang() -> None:
    """The ``sglang.srt.plugins`` entry point, run by SGLang in each of its processes: hooks the scheduler's
    ``update_weights_from_ipc`` so that refitkit's requests reach ``SchedulerReceiver``."""
    internals.register_update_hook(handle_update)


# -- in the trainer's process (the one that made the sglang.Engine) -----------------------------------------


SglangPushStats = PushStats  # the name of one push's stats before SGLang's and vLLM's were one class (kept as an alias)


def push_weights(
    engine: Any,
    sender: Any,
    weights: Iterable[tuple[str, torch.Tensor]],
    *,
    version: int | None = None,
    timeout_s: float | None = None,
    reset_prefix_cache: bool = True,
    flush_cache: bool | None = None,
) -> PushStats:
    """Send ``weights`` through a ``BucketedWeightSender`` into an ``sglang.Engine`` running refitkit's plugin.

    ``version`` (default: one above any the engine saw) tags the sync; ``timeout_s`` (default: the sender's) bounds
    the scheduler's receiver, and SGLang's call gets ``RPC_SLACK_S`` more. ``reset_prefix_cache`` (default True):
    SGLang's own flush of the prefix cache after a whole sync, so no request is served from KV of the old weights once
    the push returns; pass False only where nothing can be served from it (the caller flushes before the next request,
    or the KV cache was released since: ``SglangLink`` skips it then); an update while requests are paused in place
    needs False (SGLang's flush would assert and kill the engine): flush once they finished. ``flush_cache``: its
    former name, still taken for one release (``DeprecationWarning``). A push into released weights is refused
    (``EngineAsleep``) before any byte lands; a failure raises the sender's ``TransferError`` with the scheduler's
    error named after it, a refusal as itself (``WeightRejected``...); a push that landed weights but not all of them
    raises ``PartialPush`` as ``refitkit.rollout.vllm.push_weights`` describes (the engine then reports its weights
    incomplete). One sender feeds one scheduler: an engine with ``tp_size`` > 1 takes ``push_weights_broadcast``.
    """
    reset = renamed_knob(
        "reset_prefix_cache", reset_prefix_cache, default=True, old="flush_cache", old_value=flush_cache
    )
    with HelperThreads("SGLang push_weights") as helpers:
        return push_weights_with(
            helpers, engine, sender, weights, version=version, timeout_s=timeout_s, reset_prefix_cache=reset
        )


def push_weights_with(
    helpers: HelperThreads,
    engine: Any,
    sender: Any,
    weights: Iterable[tuple[str, torch.Tensor]],
    *,
    version: int | None,
    timeout_s: float | None,
    reset_prefix_cache: bool,
) -> PushStats:
    """``push_weights`` with the engine's calls on ``helpers`` (a link's threads, kept across its pushes)."""
    reset = reset_prefix_cache
    tp_size = checked_engine(engine, "push_weights")["tp_size"]
    if tp_size != 1:
        raise InvalidInput(
            f"push_weights: this SGLang engine runs tp_size={tp_size} schedulers and a BucketedWeightSender feeds one; "
            f"use push_weights_broadcast with a BroadcastWeightSender(receivers={tp_size})"
        )
    number = None if version is None else checked_version(version)
    timeout_s = checked_timeout(sender, timeout_s)
    weights = checked_weights(weights, need_cuda=getattr(sender, "transport", None) == "cuda_ipc")
    request = encode_request("receive", endpoint=f"ipc://{sender.path}", timeout_s=timeout_s, version=number)
    call = _receive_call(engine, request, reset=reset)
    send = lambda on_hello: sender.send(weights)  # noqa: E731
    pushed = drive(call, send, timeout_s=timeout_s, version=number, helpers=helpers)
    return _checked_push(pushed, call, reset=reset)


def push_weights_broadcast(
    engine: Any,
    sender: Any,
    weights: Iterable[tuple[str, torch.Tensor]],
    *,
    secret: str | bytes,
    version: int,
    first_rank: int = 1,
    timeout_s: float | None = None,
    reset_prefix_cache: bool = True,
    flush_cache: bool | None = None,
) -> PushStats:
    """Broadcast ``weights`` through a ``BroadcastWeightSender`` into an ``sglang.Engine`` as weight ``version``; the
    schedulers join as ranks ``first_rank``... (one per TP rank: the sender's ``receivers`` must be the engine's
    ``tp_size``), each loading what its shard takes. The secret crosses SGLang's control path (pickled there, not
    logged). ``reset_prefix_cache`` (and its deprecated name ``flush_cache``) as in ``push_weights``."""
    reset = renamed_knob(
        "reset_prefix_cache", reset_prefix_cache, default=True, old="flush_cache", old_value=flush_cache
    )
    with HelperThreads("SGLang push_weights_broadcast") as helpers:
        return push_weights_broadcast_with(
            helpers,
            engine,
            sender,
            weights,
            secret=secret,
            version=version,
            first_rank=first_rank,
            timeout_s=timeout_s,
            reset_prefix_cache=reset,
        )


def push_weights_broadcast_with(
    helpers: HelperThreads,
    engine: Any,
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
    reset = reset_prefix_cache
    first_rank = checked_first_rank(first_rank)
    tp_size = checked_engine(engine, "push_weights_broadcast")["tp_size"]
    checked_broadcast_ranks(tp_size, first_rank, getattr(sender, "receivers", None), "push_weights_broadcast")
    number = checked_version(version)
    timeout_s = checked_timeout(sender, timeout_s)
    weights = checked_weights(weights, need_cuda=False)
    request = encode_request(
        "receive_broadcast",
        rendezvous=f"tcp://{sender.host}:{sender.port}",
        timeout_s=timeout_s,
        first_rank=first_rank,
        secret=secret if isinstance(secret, str) else secret.decode(),
        backend=sender.backend,
    )
    call = _receive_call(engine, request, reset=reset)
    send = lambda on_hello: sender.send(weights, version=number)  # noqa: E731
    pushed = drive(call, send, timeout_s=timeout_s, version=number, helpers=helpers)
    return _checked_push(pushed, call, reset=reset)


def receive_from(engine: Any, endpoint: str, *, version: int | None = None, timeout_s: float = 120.0) -> dict[str, Any]:
    """Have the engine receive one session from a ``BucketedWeightSender`` that runs elsewhere (another process)
    on ``endpoint`` (``ipc:///path``); the scheduler's result, bounded by ``timeout_s`` + ``RPC_SLACK_S``."""
    if not isinstance(endpoint, str):
        raise InvalidInput(f"endpoint must be a str (ipc:///path), got {type(endpoint).__name__}")
    tp_size = checked_engine(engine, "receive_from")["tp_size"]
    if tp_size != 1 and "{rank}" not in endpoint:
        raise InvalidInput(
            f"receive_from: this SGLang engine runs tp_size={tp_size} schedulers and one sender feeds one: put '{{rank}}' "
            f"in the endpoint (each TP rank then connects to its own sender), got {endpoint!r}"
        )
    number = None if version is None else checked_version(version)
    request = encode_request("receive", endpoint=endpoint, timeout_s=float(timeout_s), version=number)
    return call_engine(engine, request, what="receive", timeout_s=float(timeout_s) + RPC_SLACK_S)


def engine_state(engine: Any, *, fingerprints: list[str] | None = None, timeout_s: float = 120.0) -> dict[str, Any]:
    """TP rank 0's state: ``weights`` (versions and coverage), ``released`` tags, ``idle``, ``free_bytes``,
    ``kv_cache_bytes``...; with ``fingerprints`` (names, or [] for every parameter) their ``tensor_fingerprint``."""
    request = encode_request("state", fingerprints=fingerprints)
    return call_engine(engine, request, what="state query", timeout_s=timeout_s, reset_prefix_cache=False)


def weights_discarded(engine: Any, *, timeout_s: float = 120.0) -> dict[str, Any]:
    """Record that the engine's weights were released without a host backup: incomplete until a full sync."""
    request = encode_request("discarded")
    return call_engine(engine, request, what="discard record", timeout_s=timeout_s, reset_prefix_cache=False)


def close_channels(engine: Any, *, timeout_s: float = 120.0) -> dict[str, Any]:
    """Close the receivers each scheduler keeps between syncs (its connection to the trainer's sender, and a kept
    broadcast group); the weight versions stay, and the next push opens new ones. SGLang gives a plug-in no shutdown
    hook: call it before the sender goes, as vLLM's ``refit_close``."""
    request = encode_request("close")
    return call_engine(engine, request, what="close", timeout_s=timeout_s, reset_prefix_cache=False)


def weight_version(engine: Any) -> WeightVersion:
    """The ``WeightVersion`` TP rank 0 serves (``clean`` False while a failed or partial sync's weights are in place)."""
    return weight_version_of(engine_state(engine)["weights"])


def clean_weight_version(engine: Any) -> int | None:
    """The version the engine serves, whole (on every TP rank); None before the first sync; ``TransferError`` while
    it is incomplete."""
    found = engine_state(engine)
    for rank, state in enumerate(ranks["weights"] for ranks in found.get("tp_ranks", [found])):
        if not state["clean"]:
            missing = state["missing"]
            why = (
                f"; it did not deliver {len(missing)} weights, e.g. {missing[:3]}"
                if missing
                else " (it failed part-way)"
            )
            where = f" (TP rank {rank})" if "tp_ranks" in found else ""
            raise TransferError(
                f"SGLang's weights are incomplete{where}: sync of version {state['incomplete']} did not land whole{why}; "
                f"its last whole sync was version {state['version']}. Push every weight again"
            )
    versions = sorted({ranks["weights"]["version"] for ranks in found.get("tp_ranks", [found])}, key=str)
    if len(versions) > 1:
        raise TransferError(f"SGLang's TP ranks serve different weight versions {versions}: push every weight again")
    return found["weights"]["version"]


def call_engine(
    engine: Any, request: str, *, what: str, timeout_s: float, reset_prefix_cache: bool = True
) -> dict[str, Any]:
    """One refitkit request through ``Engine.update_weights_from_ipc`` in a helper thread, at most ``timeout_s``
    (``EngineTimeout``; SGLang's own exception an ``EngineError``)."""
    checked_engine(engine, f"SGLang's {what}")
    success, message = bounded_call(
        lambda: internals.call_update(engine, request, flush_cache=reset_prefix_cache),
        timeout_s=timeout_s,
        what=f"SGLang's update_weights_from_ipc ({what})",
        within=f"{timeout_s:g} s",
    )
    return decode_reply(success, message, what=what)


def checked_broadcast_ranks(tp_size: int, first_rank: int, receivers: Any, what: str) -> None:
    """The engine's schedulers join the broadcast as ranks ``first_rank`` .. ``first_rank + tp_size - 1``: every one of
    them must be a receiver the sender waits for (other receivers may take the other ranks)."""
    if not isinstance(receivers, int) or first_rank + tp_size - 1 > receivers:
        raise InvalidInput(
            f"{what}: this SGLang engine's {tp_size} scheduler(s) join the broadcast as rank(s) {first_rank}.."
            f"{first_rank + tp_size - 1} but the sender expects receivers={receivers} (ranks 1..{receivers}): make the "
            f"sender with receivers >= {first_rank + tp_size - 1}"
        )


def checked_engine(engine: Any, what: str) -> dict[str, Any]:
    """The engine's settings (``internals.engine_settings``) once it is known to be an ``sglang.Engine`` that refitkit
    can feed: one data-parallel replica (SGLang's IPC weight update serves dp_size=1) and one pipeline stage (every
    stage would take the request, and their TP ranks would collide on the broadcast's ranks); ``what`` names the
    caller in the refusal."""
    if not internals.is_engine(engine):
        raise InvalidInput(
            f"{what}: engine must be an sglang.Engine (with update_weights_from_ipc and the memory calls), got a "
            f"{type(engine).__name__}"
        )
    settings = internals.engine_settings(engine)
    if settings["dp_size"] != 1 or settings["pp_size"] != 1:
        raise InvalidInput(
            f"{what}: dp_size={settings['dp_size']}, pp_size={settings['pp_size']}; refitkit feeds one data-parallel "
            "replica of one pipeline stage (SGLang's weight update from IPC serves dp_size=1; tensor parallelism over "
            "the broadcast): one link or push per replica"
        )
    return settings


def _receive_call(engine: Any, request: str, *, reset: bool) -> EngineCall:
    """SGLang's ``update_weights_from_ipc`` with a receive request: each TP rank's report from its answer."""
    return EngineCall(
        what="SGLang's update_weights_from_ipc (receive)",
        rank_name=_tp_rank,
        call=lambda: internals.call_update(engine, request, flush_cache=reset),
        reports=lambda answer: reply_reports(*answer, what="receive"),
    )


def _checked_push(pushed: PushStats, call: EngineCall, *, reset: bool) -> PushStats:
    raise_if_partial(pushed, call)
    # SGLang flushes inside its own call and asserts it did (a failed flush fails the call): reset, if asked for
    return PushStats(sender=pushed.sender, ranks=pushed.ranks, prefix_cache_reset=True if reset else None)
