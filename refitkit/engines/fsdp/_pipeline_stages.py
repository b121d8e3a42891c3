"""Weights of every pipeline stage on every rank of a pipeline group, one tensor at a time.

Under pipeline parallelism each rank holds only its stages' layers, but the rank that streams
to the inference engine must send the whole model. Each pipeline rank in turn broadcasts its
own (already gathered and named) weights over the pipeline group: a header says what comes (a
name, a shape, a dtype; msgpack, nothing executable), then the tensor goes over the trainer's
pipeline group. The other ranks of a stage (data / tensor parallel) run the same exchange in
their own pipeline groups, so the gathers inside a stage line up as they do without pipelining.

Failures cross stages, bounded. The headers travel on a dedicated gloo group made from the
pipeline group's ranks with refitkit's timeout (``pp_timeout_s``), never on the trainer's group:
a wait there is bounded and a timed-out one breaks only our group (see ``refitkit.ranks``). A
stage that fails part-way sends a failure header in place of the next weight, so the others
raise ``RankFailure`` at once instead of waiting in a collective; a stage rank that never sends
its next header makes the others raise ``TransferTimeout`` after ``pp_timeout_s``. Either way
every rank still iterates its own stream to the end without forwarding it: the gathers inside
its stage are collectives its data / tensor parallel peers (in other pipeline groups) are in.
The header replaces the old size and metadata broadcasts, so a weight costs one header and one
tensor broadcast, no extra round trip.
"""

from __future__ import annotations

import datetime
import struct
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import msgpack
import torch

from refitkit._knobs import checked_seconds
from refitkit.errors import InvalidInput, ProtocolError, RankFailure, RefitError, TransferError, TransferTimeout

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

_RECORD_BYTES = 1024  # one header; a longer payload follows in a second broadcast of its exact size
_PREFIX = struct.Struct("<BI")  # kind, payload bytes
_DONE, _WEIGHT, _FAILED = 0, 1, 2
_MESSAGE_CHARS = 900  # a failure's message, cut so that most fit the record
_MAX_DIMS = 64  # more dims in a weight header is a forged or corrupt one


class PipelineStages:
    """The pipeline group of one rank for stage forwarding: tensors on ``group`` (the trainer's),
    headers on a gloo group of the same ranks made at the first stream, bounded by ``timeout_s``.

    Only the pipeline group's ranks make the header group, and torch names such a group from its
    ranks and the number of groups the process already has: every pipeline rank must have made
    the same number of process groups before its first stream (a mismatch ends in TransferTimeout).
    """

    def __init__(self, group: ProcessGroup, *, timeout_s: float = 300.0) -> None:
        import torch.distributed as dist

        self.group = group
        self.timeout_s = checked_seconds(timeout_s, "pp_timeout_s")
        self.ranks: list[int] = list(dist.get_process_group_ranks(group))
        self.pipeline_rank = dist.get_rank(group)
        self._headers: ProcessGroup | None = None
        self._broken: str | None = None  # why the header group cannot be used any more

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def broken(self) -> str | None:
        """Why this rank's header group can no longer be used (a timed-out header), or None."""
        return self._broken

    def close(self) -> None:
        """Destroy the header group (every pipeline rank closes its own). Idempotent."""
        headers, self._headers = self._headers, None
        if headers is not None:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group(headers)
        self._broken = self._broken or "close() was called"

    # -- headers ----------------------------------------------------------------------------------

    def send_weight(self, name: str, tensor: torch.Tensor, device: torch.device) -> None:
        """Tell the pipeline group what comes, then broadcast ``tensor`` over the trainer's group."""
        import torch.distributed as dist

        if tensor.device != device:
            raise InvalidInput(
                f"pipeline stage stream: {name!r} is on {tensor.device}, the pipeline group exchanges on {device}; "
                "keep every model part on one device"
            )
        dtype_name = str(tensor.dtype).removeprefix("torch.")
        nbytes = tensor.numel() * tensor.element_size()  # announced: the receiver checks the shape against it
        self._broadcast(_WEIGHT, msgpack.packb([name, list(tensor.shape), dtype_name, nbytes]), self.pipeline_rank)
        dist.broadcast(tensor.contiguous(), group=self.group, group_src=self.pipeline_rank)

    def send_done(self) -> None:
        self._broadcast(_DONE, b"", self.pipeline_rank)

    def send_failure(self, error: BaseException) -> None:
        """Tell the pipeline group this rank's stream failed (in place of its next weight)."""
        message = (str(error) or repr(error))[:_MESSAGE_CHARS]
        self._broadcast(_FAILED, msgpack.packb([type(error).__name__, message]), self.pipeline_rank)

    def receive_from(self, owner: int, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
        """Pipeline rank ``owner``'s weights until its done header; raises ``RankFailure`` on its failure header."""
        import torch.distributed as dist

        while True:
            kind, payload = self._receive(owner)
            if kind == _DONE:
                return
            if kind == _FAILED:
                error_type, message = _unpack(payload, owner, 2)
                raise RankFailure(
                    f"pipeline stage stream failed on pipeline rank {owner} (global rank {self.ranks[owner]}) while "
                    f"it streamed its stage's weights: {error_type}: {message}",
                    failures={self.ranks[owner]: f"{error_type}: {message}"},
                )
            name, shape, dtype = _weight_header(payload, owner)
            try:
                tensor = torch.empty(shape, dtype=dtype, device=device)
            except RuntimeError as exc:  # e.g. out of memory: name the weight and its sender, not just the allocator
                raise TransferError(
                    f"pipeline stage stream: no room on {device} for {name!r} {shape} of {dtype} from pipeline rank "
                    f"{owner}: {exc}"
                ) from exc
            dist.broadcast(tensor, group=self.group, group_src=owner)
            yield name, tensor
            del tensor

    # -- the gloo group ---------------------------------------------------------------------------

    def _header_group(self) -> ProcessGroup:
        if self._broken is not None:
            raise RefitError(
                f"pipeline stage stream on rank {self.ranks[self.pipeline_rank]}: the header group is unusable since "
                f"{self._broken}; make a new adapter (pp_group) on every pipeline rank"
            )
        if self._headers is None:
            import torch.distributed as dist

            try:  # only the pipeline group's ranks take part; gloo's own timeout bounds its rendezvous too
                self._headers = dist.new_group(
                    self.ranks,
                    backend="gloo",
                    timeout=datetime.timedelta(seconds=self.timeout_s),
                    use_local_synchronization=True,
                )
            except RuntimeError as exc:
                self._broken = "its making failed"
                raise TransferTimeout(
                    f"pipeline stage stream: making the header group over ranks {self.ranks} failed or timed out "
                    f"after pp_timeout_s={self.timeout_s:g} on rank {self.ranks[self.pipeline_rank]}: every pipeline "
                    f"rank must stream (named_weights) together; raise pp_timeout_s if one is only slow: {exc}"
                ) from exc
        return self._headers

    def _broadcast(self, kind: int, payload: bytes, owner: int) -> None:
        record = torch.zeros(_RECORD_BYTES, dtype=torch.uint8)
        head = _PREFIX.pack(kind, len(payload)) + payload[: _RECORD_BYTES - _PREFIX.size]
        record[: len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        self._wait(record, owner, "a header")
        if len(payload) > _RECORD_BYTES - _PREFIX.size:
            self._wait(torch.frombuffer(bytearray(payload), dtype=torch.uint8), owner, "a long header")

    def _receive(self, owner: int) -> tuple[int, bytes]:
        record = torch.empty(_RECORD_BYTES, dtype=torch.uint8)
        self._wait(record, owner, "the next header")
        raw = record.numpy().tobytes()
        kind, size = _PREFIX.unpack_from(raw)
        if kind not in (_DONE, _WEIGHT, _FAILED):
            raise ProtocolError(
                f"pipeline stage stream: pipeline rank {owner} sent header kind {kind}; is it running refitkit?"
            )
        if size <= _RECORD_BYTES - _PREFIX.size:
            return kind, raw[_PREFIX.size : _PREFIX.size + size]
        rest = torch.empty(size, dtype=torch.uint8)
        self._wait(rest, owner, "a long header")
        return kind, rest.numpy().tobytes()

    def _wait(self, record: torch.Tensor, owner: int, what: str) -> None:
        """Broadcast ``record`` from pipeline rank ``owner`` on the header group, within ``timeout_s``."""
        import torch.distributed as dist

        group = self._header_group()
        start = time.monotonic()
        try:
            work = dist.broadcast(record, group=group, group_src=owner, async_op=True)
            completed = work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:  # gloo reports a timed-out or lost peer as RuntimeError
            completed, failure = False, exc
        else:
            failure = None
        if completed is not False:
            return
        # gloo matches collectives in order and the absent rank may still come: the group is spent
        seconds = time.monotonic() - start
        me = self.ranks[self.pipeline_rank]
        self._broken = f"{what} from pipeline rank {owner} failed on rank {me}"
        where = f"pipeline rank {owner} (global rank {self.ranks[owner]})"
        if seconds < 0.9 * self.timeout_s:
            raise TransferError(
                f"pipeline stage stream: lost {where} after {seconds:.1f} s on rank {me} while exchanging {what} "
                f"(pp_timeout_s={self.timeout_s:g}): {failure}"
            ) from failure
        raise TransferTimeout(
            f"pipeline stage stream: {what} from {where} did not come within pp_timeout_s={self.timeout_s:g} on rank "
            f"{me}; every pipeline rank must stream (named_weights) together; raise pp_timeout_s if one is only slow"
            + (f": {failure}" if failure is not None else "")
        ) from failure


def across_stages(
    local: Iterator[tuple[str, torch.Tensor]], stages: PipelineStages, device: torch.device
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every pipeline rank's weights, in pipeline-rank order, on every rank of ``stages``.

    ``local`` is this rank's own stream; ``device`` is where the received tensors live (the
    model's device: CUDA for NCCL, CPU for gloo). A collective over the pipeline group: every
    member iterates to the end together. When a stage fails, every member raises (the failing
    one its own error, the others ``RankFailure`` or ``TransferTimeout``) after iterating
    ``local`` to the end, so the gathers inside each stage still line up.
    """
    if stages.size == 1:
        yield from local
        return
    me = stages.pipeline_rank
    for owner in range(stages.size):
        if owner == me:
            try:
                for name, tensor in local:
                    stages.send_weight(name, tensor, device)
                    yield name, tensor
                    del tensor
            except Exception as exc:
                _tell_failure(stages, exc)
                _drain(local, exc)
                raise
            stages.send_done()
        else:
            try:
                yield from stages.receive_from(owner, device)
            except Exception as exc:
                if owner < me:  # this rank's own stream has not run yet
                    _drain(local, exc)
                raise


def _unpack(payload: bytes, owner: int, fields: int) -> list:
    try:
        unpacked = msgpack.unpackb(payload)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise ProtocolError(f"pipeline stage stream: pipeline rank {owner} sent an unreadable header ({exc})") from None
    if not isinstance(unpacked, list) or len(unpacked) != fields:
        raise ProtocolError(f"pipeline stage stream: pipeline rank {owner} sent a header that is not {fields} fields")
    return unpacked


def _weight_header(payload: bytes, owner: int) -> tuple[str, list[int], torch.dtype]:
    """(name, shape, dtype) of a weight header, checked before anything is allocated from it."""
    name, shape, dtype_name, nbytes = _unpack(payload, owner, 4)
    where = f"pipeline stage stream: pipeline rank {owner} sent"
    if not isinstance(name, str):
        raise ProtocolError(f"{where} a weight header whose name is not a string ({type(name).__name__})")
    if not isinstance(shape, list) or not all(type(d) is int and 0 <= d for d in shape) or len(shape) > _MAX_DIMS:
        raise ProtocolError(
            f"{where} {name!r} with shape {str(shape)[:200]}: not a list of at most {_MAX_DIMS} non-negative ints"
        )
    dtype = getattr(torch, dtype_name, None) if isinstance(dtype_name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ProtocolError(f"{where} {name!r} with unknown dtype {dtype_name!r}; do all ranks run the same torch?")
    numel = 1
    for dim in shape:
        numel *= dim
    if type(nbytes) is not int or nbytes != numel * dtype.itemsize:
        raise ProtocolError(
            f"{where} {name!r} with shape {shape} of {dtype_name} ({numel * dtype.itemsize} bytes) but announced "
            f"{nbytes!r} bytes; nothing was allocated"
        )
    return name, shape, dtype


def _tell_failure(stages: PipelineStages, error: Exception) -> None:
    """Send the failure header unless the header group itself failed; never hide ``error``."""
    if stages.broken is not None:
        return
    try:
        stages.send_failure(error)
    except RefitError as late:
        error.add_note(f"refitkit: telling the other pipeline ranks failed too: {late}")


def _drain(local: Iterator[tuple[str, torch.Tensor]], error: Exception) -> None:
    """Iterate what is left of this rank's stream without forwarding it: its stage peers are in its gathers."""
    try:
        for _ in local:
            pass
    except Exception as late:
        error.add_note(f"refitkit: finishing this rank's own stream after the failure failed too: {late!r}")
