"""Checking each streamed (name, tensor) and laying tensors out in buckets of the bucket buffer.

The sender validates a list or tuple whole before its session starts (``check_items``), and a
generator's items one by one just before packing each (it is consumed once). A bucket is
one half of the buffer (the sender fills one half while the receiver reads the other), or a *wide*
bucket spanning both halves:

- a tensor that fits in a half goes whole into the current bucket, or starts the next one;
- a tensor larger than a half but not than the buffer goes whole into a wide bucket, so the
  receiver hands out a view of it instead of allocating and reassembling a copy;
- a larger tensor is split into byte ranges that fill buckets one after another.

A bucket is also shipped once it holds ``BUCKET_MAX_TENSORS`` tensors: the receiver's per-tensor
work (views, the loader's copies) then overlaps the sender's packing of the next bucket instead of
starting only after a whole half was packed, and the last bucket, whose consumption nothing
overlaps, stays short.

Everything here runs once per tensor on the critical path of a sync: the checks are plain type
and attribute tests, and a tensor's destination is one view of the buffer (viewed as each dtype
once per session). Small contiguous tensors can be batched: consecutive ones of one dtype whose
sizes are multiples of ``ALIGN_BYTES`` lie back to back in the bucket (a *run*), and a run is
copied by one ``torch.cat(..., out=<the run's bytes>)`` when it ends (a different dtype, a tensor
that is not batched, an odd size, or the bucket ships). A launched copy costs about 10 us of CPU
on the H200 machine, more than a small tensor's copy takes on the GPU; ``cat`` costs under 1 us
per input there (``torch._foreach_copy_``, the previous method, cost 5 us per tensor with the
integer views it needed to keep NaN payloads intact; ``cat`` moves elements as opaque bytes of
their width, so payloads survive). Larger tensors are copied at once, where one launch is cheap
next to the bytes. Deferring a copy is only safe when the caller cannot change a tensor after
handing it over, so the sender batches only streams given as a list or tuple, or as an iterator
known to yield tensors that something else holds as they are (``held_unchanged``: torch's own
``Module.named_parameters()`` / ``named_buffers()``, a dict's ``items()``). Any other generator may
refill one staging buffer per item, and FSDP-style generators promise to hold one gathered
tensor at a time, so their tensors are copied as they come.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from refitkit.errors import InvalidInput, TransferError
from refitkit.transfer.protocol import (
    ALIGN_BYTES,
    SUPPORTED_DTYPES,
    WIRE_DTYPE_NAMES,
    align_up,
    contiguous_strides,
    entry_to_wire,
)

BUCKET_MAX_TENSORS = 64
BATCH_MAX_BYTES = 16 << 20  # contiguous tensors below this are batched into runs (one copy per run)
PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
BOTH_HALVES = 0b11
HALF_GRAIN_BYTES = 1 << 20  # halves of a buffer sized to a list are whole MiB (cuda_ipc maps whole 2 MiB pages)

CheckedItem = tuple[str, torch.Tensor, str]  # name, tensor (no autograd history), wire dtype name
SendBucket = Callable[[int, bool, list[Any], bool], None]  # half, wide, entries, last


def check_item(index: int, item: Any, seen: set[str], *, need_cuda: bool, detach: bool = True) -> CheckedItem:
    """One streamed item as (name, tensor, wire dtype), or InvalidInput naming what is wrong with it.

    ``detach=False``: a tensor that requires grad is returned as it is (``BucketPacker.pack`` detaches what it
    copies; a tensor read where it lies needs no detached twin, which costs 1-3 us per tensor)."""
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        raise InvalidInput(f"weights item #{index} is a {type(item).__name__}, not a (name, tensor) pair")
    name, tensor = item
    if not isinstance(name, str) or not name:
        raise InvalidInput(f"weights item #{index}: the name must be a non-empty str, got {name!r}")
    if not name.isascii():  # the wire carries UTF-8: a lone surrogate would fail in the middle of a bucket
        try:
            name.encode()
        except UnicodeEncodeError as exc:
            raise InvalidInput(f"weights item #{index}: the name {name!r} is not valid UTF-8 ({exc.reason})") from exc
    if type(tensor) not in PLAIN_TENSOR_TYPES:  # subclasses (DTensor, ...) take the slow checks
        if not isinstance(tensor, torch.Tensor):
            raise InvalidInput(f"{name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        dtensor_module = sys.modules.get("torch.distributed.tensor")  # no DTensor exists unless it was imported
        if dtensor_module is not None and isinstance(tensor, dtensor_module.DTensor):
            raise InvalidInput(f"{name!r} is a DTensor shard; send full tensors (adapter.named_weights() gathers them)")
    if tensor.is_nested:  # strided nested tensors pass the layout test; their bytes are not one block
        raise InvalidInput(f"{name!r} is a nested tensor; send its components as separate tensors")
    if tensor.layout is not torch.strided:
        raise InvalidInput(f"{name!r} has layout {tensor.layout}; only dense (strided) tensors can be sent")
    if not (tensor.is_cuda or tensor.is_cpu):
        raise InvalidInput(f"{name!r} is on device {tensor.device}; only cpu and cuda tensors can be sent")
    wire_dtype = WIRE_DTYPE_NAMES.get(tensor.dtype)
    if wire_dtype is None:
        raise InvalidInput(
            f"{name!r} has dtype {tensor.dtype}, which cannot be sent; supported: {', '.join(sorted(SUPPORTED_DTYPES))}"
        )
    if name in seen:
        raise InvalidInput(f"duplicate tensor name {name!r} in one send()")
    if need_cuda and not tensor.is_cuda:
        raise InvalidInput(f"{name!r} is on {tensor.device}; transport='cuda_ipc' needs CUDA tensors")
    seen.add(name)
    if detach and tensor.requires_grad:  # copying from it into the bucket must not record autograd history
        tensor = tensor.detach()
    return name, tensor, wire_dtype


# The code objects of torch's generators that yield a module's own tensors (an override in a subclass has others).
_MODULE_MEMBER_CODES = frozenset({torch.nn.Module.named_parameters.__code__, torch.nn.Module.named_buffers.__code__})
_DICT_ITEMS_ITERATORS = (type(iter({}.items())), type(iter(OrderedDict().items())))  # (state_dict() is an OrderedDict)


def held_unchanged(iterator: Any) -> bool:
    """Whether ``iterator`` yields tensors that stay as they are while ``send()`` pulls the rest, so their small
    copies may be deferred like a list's (and, with ``direct=True``, read where they lie): a generator made by
    torch's ``Module.named_parameters()`` or ``named_buffers()`` (the module's own tensors: nothing runs between
    two items but torch's walk over the modules), a dict's ``items()`` (the dict holds every tensor), or an
    iterator that says so itself (``refitkit_holds_tensors = True``: an adapter's ``named_weights()`` over a
    model whose weights it yields as they are). Anything else may reuse a buffer."""
    if getattr(iterator, "refitkit_holds_tensors", False) is True:
        return True
    code = getattr(iterator, "gi_code", None)
    if code is not None:
        return code in _MODULE_MEMBER_CODES
    return type(iterator) in _DICT_ITEMS_ITERATORS


def fresh_each(iterator: Any) -> bool:
    """Whether ``iterator`` says each tensor it yields is made for the caller or is the model's own as it is
    (``refitkit_fresh_tensors = True``: an adapter's ``named_weights()`` that gathers them), so nothing else writes
    one while a sender keeps it: with ``direct=True`` the engine may read it where it lies until the sender lets go."""
    return getattr(iterator, "refitkit_fresh_tensors", False) is True


def check_items(listed: list | tuple, *, need_cuda: bool) -> tuple[list[CheckedItem], bool]:
    """Every item of a list or tuple checked in one pass, before anything is sent (so no receiver sees a
    byte of a bad list), and whether all its tensors are CUDA tensors; InvalidInput names the first bad one."""
    seen: set[str] = set()
    checked = [check_item(index, item, seen, need_cuda=need_cuda) for index, item in enumerate(listed)]
    return checked, all(tensor.is_cuda for _, tensor, _ in checked)


def half_bytes_for(listed: list | tuple | None, max_half_bytes: int) -> int:
    """The half size for a session: ``max_half_bytes`` (from ``bucket_bytes``), or less for a list or
    tuple that needs less (the buffer is allocated and freed every session).

    A half holds the list's largest tensor (nothing is split or goes wide that would not have with
    the whole bucket) and a fair share of the stream: half of it, or less when BUCKET_MAX_TENSORS
    makes more buckets anyway (Qwen3-0.6B: 310 tensors, at least 5 buckets, so halves of its
    largest tensor's 297 MiB instead of 568 MiB: half the memory, and the same speed on the H200,
    where freeing either took 0.65-0.7 ms inside a session). Each tensor counts as padded to
    ALIGN_BYTES. A generator (size unknown) gets ``max_half_bytes``; a list comes here checked.
    """
    if not listed:
        return max_half_bytes
    try:
        sizes = [item[1].nbytes for item in listed]
    except Exception:
        return max_half_bytes
    buckets = max(2, -(-len(sizes) // BUCKET_MAX_TENSORS))
    needed = max(max(sizes) + ALIGN_BYTES, -(-(sum(sizes) + len(sizes) * ALIGN_BYTES) // buckets))
    return min(max_half_bytes, -(-needed // HALF_GRAIN_BYTES) * HALF_GRAIN_BYTES)


def _current_raw_stream(index: int) -> int:
    """torch's current stream on GPU ``index`` as the driver's handle: ``torch._C._cuda_getCurrentRawStream``
    (private; checked with torch 2.11 and 2.13, where torch's compilers launch their kernels with it), a fraction
    of ``torch.cuda.current_stream()``'s cost, paid once per packed tensor."""
    return torch._C._cuda_getCurrentRawStream(index)


class BucketPacker:
    """Copies tensors into the bucket buffer, bucket after bucket.

    ``send_bucket(half, wide, entries, last)`` ships the bucket just packed; ``wait_free(halves)``
    returns once the receiver is done with every half in the ``halves`` bit mask (bit 0: half 0,
    bit 1: half 1), which the packer calls before it writes into them.
    """

    def __init__(
        self,
        buffer: torch.Tensor,
        half_bytes: int,
        *,
        send_bucket: SendBucket,
        wait_free: Callable[[int], None],
        batch: bool = False,
    ) -> None:
        self._buffer: torch.Tensor | None = buffer
        # Batch (defer) small copies only when the caller said its tensors stay as they are until the
        # bucket ships, and only tensors on the buffer's device (get_device(): -1 for the CPU).
        self._batch_device = buffer.get_device() if batch else None
        self._typed: dict[torch.dtype, torch.Tensor] = {}  # the buffer seen as each dtype, made once
        self.half_bytes = half_bytes
        self._send_bucket = send_bucket
        self._wait_free = wait_free
        self.half = 0
        self.wide = False
        self.capacity = half_bytes  # bytes of the current bucket
        self.bucket_start = 0  # where the current bucket starts in the buffer
        self.used = 0  # bytes used in the current bucket
        self.entries: list[Any] = []  # wire entries of the current bucket
        self._run: list[torch.Tensor] = []  # flat sources of the open run, back to back from _run_start
        self._run_dtype: torch.dtype | None = None
        self._run_start = 0  # the open run's first byte in the current bucket
        self._run_elements = 0
        # A CUDA buffer's copies go on torch's current stream, which a generator may change between items (it
        # yields from inside ``torch.cuda.stream(...)``): the streams this bucket's copies went on, joined into
        # the current one before the bucket ships (the sender announces it after the current stream's work).
        self._cuda_index = buffer.get_device() if buffer.is_cuda else None
        self._copy_streams: set[int] = set()

    def detach(self) -> None:
        """Forget the buffer and every view of it, so it can be freed while this packer is still referenced."""
        self._buffer = None
        self._typed.clear()
        self._run = []

    def pack(self, name: str, tensor: torch.Tensor, wire_dtype: str) -> None:
        """Copy one tensor in: whole when it fits in the buffer's half (or whole buffer), else as byte ranges."""
        if tensor.requires_grad:  # (an item checked with detach=False): the copy must not record autograd history
            tensor = tensor.detach()
        nbytes = tensor.nbytes
        if nbytes > 2 * self.half_bytes:
            self._end_run()
            self._pack_split(name, tensor, wire_dtype, nbytes)
            return
        offset = align_up(self.used)  # in an open run that is where its last tensor ended (sizes are aligned)
        if offset + nbytes > self.capacity or len(self.entries) >= BUCKET_MAX_TENSORS:
            self._next_bucket(wide=nbytes > self.half_bytes)
            offset = 0
        # No local name for a destination view: a traceback would keep the bucket alive.
        if (
            nbytes < BATCH_MAX_BYTES
            and tensor.get_device() == self._batch_device
            and tensor.is_contiguous()
            and not tensor.is_conj()
            and not tensor.is_neg()  # lazy conj/neg views must be resolved by copy_
        ):
            dtype = tensor.dtype
            if dtype is not self._run_dtype:
                self._end_run()
                self._run_dtype, self._run_start = dtype, offset
            self._run.append(tensor if tensor.dim() == 1 else tensor.view(-1))
            self._run_elements += tensor.numel()
            if nbytes % ALIGN_BYTES:  # the next tensor starts aligned, so not right after this one
                self._end_run()
        else:
            self._end_run()
            strides = tensor.stride() if tensor.is_contiguous() else contiguous_strides(tensor.shape)
            element = (self.bucket_start + offset) // tensor.element_size()
            self._typed_buffer(tensor.dtype).as_strided(tensor.shape, strides, element).copy_(tensor)
            self._note_copy_stream()  # (a run's copy is queued later: _end_run notes its stream)
        self.entries.append(entry_to_wire(name, wire_dtype, tensor.shape, offset))
        self.used = offset + nbytes

    def finish(self) -> None:
        """Ship the current bucket as the last one (possibly empty: the receiver still learns the stream ended)."""
        self._end_run()
        self._join_copy_streams()
        self._send_bucket(self.half, self.wide, self.entries, True)

    def _end_run(self) -> None:
        """Issue the open run's copy: its flat sources into its bytes of the bucket, one ``cat``."""
        if self._run:
            dtype = self._run_dtype
            if dtype is None:
                raise TransferError("packer: an open run without a dtype (a bug in refitkit)")
            first = (self.bucket_start + self._run_start) // dtype.itemsize
            torch.cat(self._run, out=self._typed_buffer(dtype)[first : first + self._run_elements])
            self._run = []
            self._note_copy_stream()
        self._run_dtype = None
        self._run_elements = 0

    def _pack_split(self, name: str, tensor: torch.Tensor, wire_dtype: str, nbytes: int) -> None:
        # One contiguous byte view of the source (a temporary copy only if the tensor is strided, or a
        # lazy conj/neg view, whose bytes must be resolved before they can be seen as bytes).
        flat = tensor.resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)
        start = 0
        while start < nbytes:
            offset = align_up(self.used)
            if offset >= self.capacity or len(self.entries) >= BUCKET_MAX_TENSORS:
                self._next_bucket(wide=False)
                offset = 0
            count = min(self.capacity - offset, nbytes - start)
            first = self.bucket_start + offset
            self._typed_buffer(torch.uint8)[first : first + count].copy_(flat[start : start + count])
            self._note_copy_stream()
            self.entries.append(entry_to_wire(name, wire_dtype, tensor.shape, offset, (start, count)))
            self.used = offset + count
            start += count

    def _next_bucket(self, *, wide: bool) -> None:
        """Ship the current bucket (if it holds anything) and wait until the next one's memory is free."""
        self._end_run()
        if self.entries:
            self._join_copy_streams()
            self._send_bucket(self.half, self.wide, self.entries, False)
            self.half = 0 if self.wide else self.half ^ 1
        if wide:
            self.half = 0
        self.wide = wide
        self.capacity = 2 * self.half_bytes if wide else self.half_bytes
        self.bucket_start = 0 if wide else self.half * self.half_bytes
        self.used = 0
        self.entries = []
        self._wait_free(BOTH_HALVES if wide else 1 << self.half)

    def _note_copy_stream(self) -> None:
        """Note the stream the copy just issued into a CUDA buffer went on (torch's current one)."""
        if self._cuda_index is not None:
            self._copy_streams.add(_current_raw_stream(self._cuda_index))

    def _join_copy_streams(self) -> None:
        """Make the current stream wait for the other streams this bucket's copies were queued on, so that work
        queued after it (the sender's announcement, a broadcast) follows every copy of the bucket."""
        if self._cuda_index is None or not self._copy_streams:
            return
        current = torch.cuda.current_stream(self._cuda_index)
        for handle in self._copy_streams:
            if handle != current.cuda_stream:
                # (not ExternalStream: for handle 0, the default stream, it makes a new stream instead)
                current.wait_stream(torch.cuda.get_stream_from_external(handle, current.device))
        self._copy_streams.clear()

    def _typed_buffer(self, dtype: torch.dtype) -> torch.Tensor:
        typed = self._typed.get(dtype)
        if typed is None:
            if self._buffer is None:
                raise TransferError("packer used after detach(): the session's bucket was already freed")
            typed = self._typed[dtype] = self._buffer.view(dtype)
        return typed
