"""CUDA IPC transport: a bucket the sender owns outright, so it can free it whatever the receiver does.

Why not torch's own CUDA IPC (``UntypedStorage._share_cuda_`` / ``_new_shared_cuda``): sharing a
storage that way wraps it in torch's ``CudaIPCSentData``; when the sender drops it while the
receiver's reference counter is non-zero, the block goes to ``CudaIPCSentDataLimbo`` and is
only freed once the receiver decrements that counter. A SIGKILLed receiver never does, so the
bucket (2 GiB by default) stays reserved for the life of the trainer.

Here the bucket is allocated with the CUDA driver (``cuMemAlloc``), outside torch's caching
allocator, exported with ``cuIpcGetMemHandle`` and freed with ``cuMemFree`` by the sender alone:
after a normal session (the receiver has already called ``cuIpcCloseMemHandle`` before its final
ACK), after an error, and after a timeout on a dead receiver, whose context and mappings the
driver tears down with the process. Nothing is ever parked in a limbo list, so the sender's
``torch.cuda.memory_reserved()`` never moves and device free memory (``mem_get_info``) is back
to its baseline when ``send()`` returns. Torch only sees the buffer through
``__cuda_array_interface__`` (a non-owning view); a finalizer frees the memory when the last
view dies, and ``free()`` checks that it did.

The handle travels as raw fields: 64 handle bytes, the byte size and the GPU's UUID (so a
receiver with a different ``CUDA_VISIBLE_DEVICES`` order maps the same physical GPU).

Direct mode (``AllocationExports``): the sender exports the allocations that hold its weights (the
caching allocator's segments, found with ``cuMemGetAddressRange``) with the same raw handles, once per
allocation per session, and the receiver reads each weight where it lies. The trainer owns that memory
throughout: the receiver closes every mapping before its final ACK, and a receiver that dies takes its
mappings with it (the driver's teardown), so no torch refcount limbo is involved. Memory that
``cuIpcGetMemHandle`` refuses (virtual-memory allocations, e.g. ``expandable_segments:True``) goes
through the bucket instead.
The driver calls were checked against the CUDA 12/13 driver API (libcuda.so.1, ``_v2`` entry
points) with torch 2.11/2.13.
"""

from __future__ import annotations

import bisect
import ctypes
import functools
import time
import weakref
from typing import Any

import torch

from refitkit.errors import ProtocolError, TransferError

_IPC_HANDLE_BYTES = 64
# Allocations are whole 2 MiB pages: the receiver's cuIpcOpenMemHandle took 7-12 ms for a buffer
# with a partial last page on the H200 (CUDA 13), 0.2-0.45 ms for the same size rounded up.
_ALLOC_GRAIN_BYTES = 2 << 20
_LAZY_ENABLE_PEER_ACCESS = 1
_POINTER_BUFFER_ID = 7  # CU_POINTER_ATTRIBUTE_BUFFER_ID: a process-wide unique id of the allocation a pointer lies in


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * _IPC_HANDLE_BYTES)]


@functools.lru_cache(maxsize=1)
def _driver() -> ctypes.CDLL:
    """The CUDA driver library, initialised; TransferError when there is none."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise TransferError(f"transport='cuda_ipc' needs the CUDA driver (libcuda.so.1): {exc}") from exc
    lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    lib.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
    lib.cuMemFree_v2.argtypes = [ctypes.c_uint64]
    lib.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(_IpcHandle), ctypes.c_uint64]
    lib.cuIpcCloseMemHandle.argtypes = [ctypes.c_uint64]
    lib.cuMemGetAddressRange_v2.argtypes = [
        ctypes.POINTER(ctypes.c_uint64),
        ctypes.POINTER(ctypes.c_size_t),
        ctypes.c_uint64,
    ]
    lib.cuPointerGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
    lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    lib.cuCtxGetDevice.argtypes = [ctypes.POINTER(ctypes.c_int)]
    _check(lib, lib.cuInit(0), "cuInit")
    return lib


def _ipc_open_fn(lib: ctypes.CDLL) -> Any:
    fn = getattr(lib, "cuIpcOpenMemHandle_v2", None) or lib.cuIpcOpenMemHandle
    fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), _IpcHandle, ctypes.c_uint]
    return fn


def _check(lib: ctypes.CDLL, result: int, call: str) -> None:
    if result != 0:
        text = ctypes.c_char_p()
        lib.cuGetErrorString(result, ctypes.byref(text))
        raise TransferError(f"{call} failed: CUDA error {result} ({(text.value or b'?').decode()})")


def ipc_available() -> bool:
    """Whether this process can use the cuda_ipc transport (a GPU and the CUDA driver)."""
    if not torch.cuda.is_available():
        return False
    try:
        _driver()
    except TransferError:
        return False
    return True


def device_uuid(device: torch.device) -> str:
    """The physical GPU's UUID, the same in every process whatever CUDA_VISIBLE_DEVICES says."""
    return str(torch.cuda.get_device_properties(device).uuid)


def local_device_for(uuid: str, fallback: torch.device) -> torch.device:
    """The local CUDA device with GPU ``uuid`` (``fallback`` when UUIDs are unavailable)."""
    for index in range(torch.cuda.device_count()):
        try:
            if str(torch.cuda.get_device_properties(index).uuid) == uuid:
                return torch.device("cuda", index)
        except (AttributeError, RuntimeError):
            return fallback
    raise TransferError(f"the sender's GPU {uuid} is not visible to the receiver (check CUDA_VISIBLE_DEVICES)")


def _bind_context(device: torch.device) -> None:
    """Make ``device``'s primary context (the one torch uses) current on this thread for the driver calls that follow."""
    torch.cuda.set_device(device)
    lib = _driver()
    context, ordinal = ctypes.c_void_p(), ctypes.c_int(-1)
    if (
        lib.cuCtxGetCurrent(ctypes.byref(context)) == 0
        and context.value
        and lib.cuCtxGetDevice(ctypes.byref(ordinal)) == 0
    ):
        if ordinal.value == device.index:
            return  # already current: no stream sync (it would stall the copies queued behind earlier buckets)
    # A thread the runtime has not used yet has no current context: a runtime call that needs one makes it current.
    torch.cuda.current_stream(device).synchronize()


class _DevicePointer:
    """A non-owning ``__cuda_array_interface__`` over raw device bytes, for torch.as_tensor."""

    def __init__(self, pointer: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (pointer, False),
            "version": 3,
            "strides": None,
        }


def _wrap(pointer: int, nbytes: int, device: torch.device, on_last_view: Any) -> tuple[torch.Tensor, weakref.finalize]:
    holder = _DevicePointer(pointer, nbytes)
    tensor = torch.as_tensor(holder, device=device)
    return tensor, weakref.finalize(holder, on_last_view)


def _free(device: torch.device, pointer: int) -> None:
    lib = _driver()
    with torch.cuda.device(device):
        _check(lib, lib.cuMemFree_v2(pointer), "cuMemFree")


def _close(device: torch.device, pointer: int) -> None:
    lib = _driver()
    with torch.cuda.device(device):
        _check(lib, lib.cuIpcCloseMemHandle(pointer), "cuIpcCloseMemHandle")


class CudaIpcBucket:
    """The sender's bucket buffer: driver-allocated device memory exported for IPC."""

    transport = "cuda_ipc"

    def __init__(self, nbytes: int, *, device: torch.device) -> None:
        lib = _driver()
        nbytes = -(-nbytes // _ALLOC_GRAIN_BYTES) * _ALLOC_GRAIN_BYTES
        self.device, self.nbytes = device, nbytes
        previous = torch.cuda.current_device()
        _bind_context(device)
        try:
            pointer = ctypes.c_uint64()
            _check(lib, lib.cuMemAlloc_v2(ctypes.byref(pointer), nbytes), f"cuMemAlloc({nbytes} bytes)")
            handle = _IpcHandle()
            try:
                _check(lib, lib.cuIpcGetMemHandle(ctypes.byref(handle), pointer.value), "cuIpcGetMemHandle")
            except TransferError:
                _free(device, pointer.value)
                raise
        finally:
            torch.cuda.set_device(previous)
        self._handle = bytes(handle.reserved)
        self._streams: dict[int, torch.cuda.Stream] = {}  # every stream copies into the bucket were shipped on
        self.tensor: torch.Tensor | None
        self.tensor, self._freed = _wrap(pointer.value, nbytes, device, functools.partial(_free, device, pointer.value))

    def handle(self) -> dict[str, Any]:
        """The raw fields the receiver needs to map this bucket."""
        return {"ipc_handle": self._handle, "nbytes": self.nbytes, "device_uuid": device_uuid(self.device)}

    def receiver_mapped(self) -> None:
        """Nothing to do: the sender keeps sole ownership of the memory."""

    def shipped(self) -> torch.cuda.Stream:
        """The stream the copies of the bucket being shipped were issued on (the current one); remembered,
        so ``free()`` waits for it even when the caller has switched streams since."""
        stream = torch.cuda.current_stream(self.device)
        self._streams.setdefault(stream.cuda_stream, stream)
        return stream

    def free(self) -> None:
        """Wait for pending copies and return the memory to the driver; idempotent."""
        if self.tensor is not None:
            for stream in (*self._streams.values(), torch.cuda.current_stream(self.device)):
                stream.synchronize()
            self._streams.clear()
        self.tensor = None  # the finalizer frees the memory as this last view dies
        if self._freed.alive:
            raise TransferError("sender bucket: a view of the CUDA bucket is still referenced; memory not freed")


class CudaIpcMapping:
    """The receiver's mapping of the sender's bucket, opened once per session."""

    def __init__(self, handle: dict[str, Any], device: torch.device) -> None:
        try:
            raw, nbytes, uuid = bytes(handle["ipc_handle"]), int(handle["nbytes"]), str(handle["device_uuid"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"bad cuda_ipc handle fields ({type(exc).__name__}: {exc})") from exc
        if len(raw) != _IPC_HANDLE_BYTES:
            raise ProtocolError(f"cuda_ipc handle has {len(raw)} bytes, expected {_IPC_HANDLE_BYTES}")
        if nbytes <= 0:
            raise ProtocolError(f"cuda_ipc handle announces {nbytes} bytes")
        lib = _driver()
        self.device = local_device_for(uuid, device)
        previous = torch.cuda.current_device()
        _bind_context(self.device)
        try:
            pointer = ctypes.c_uint64()
            result = _ipc_open_fn(lib)(
                ctypes.byref(pointer), _IpcHandle.from_buffer_copy(raw), _LAZY_ENABLE_PEER_ACCESS
            )
            _check(lib, result, "cuIpcOpenMemHandle")
            # The size is the driver's, not the wire's: a view beyond the allocation would read another one.
            # (At least as large: the driver may round the allocation up; the sender already rounds to pages.)
            try:
                base, size = ctypes.c_uint64(), ctypes.c_size_t()
                _check(
                    lib,
                    lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), pointer.value),
                    "cuMemGetAddressRange",
                )
                if base.value != pointer.value or size.value < nbytes:
                    raise ProtocolError(
                        f"cuda_ipc handle announces {nbytes} bytes; the mapped allocation has {size.value} "
                        f"(at offset {pointer.value - base.value})"
                    )
                self.tensor: torch.Tensor | None
                self.tensor, self._closed = _wrap(
                    pointer.value, nbytes, self.device, functools.partial(_close, self.device, pointer.value)
                )
            except BaseException:
                lib.cuIpcCloseMemHandle(pointer.value)  # opened but never handed out: close it here, or it stays mapped
                raise
        finally:
            torch.cuda.set_device(previous)

    def bucket(self, offset: int, used_bytes: int) -> torch.Tensor:
        """The used bytes of one half, read in place from the sender's GPU memory."""
        if self.tensor is None or offset < 0 or offset + used_bytes > self.tensor.numel():
            raise ProtocolError(f"bucket bytes {offset}..{offset + used_bytes} are outside the mapped CUDA IPC buffer")
        return self.tensor[offset : offset + used_bytes]


class AllocationExports:
    """The sender's exports of the allocations that hold its weights (direct mode), for one session.

    ``locate`` finds the allocation a tensor's bytes lie in (known ranges first, the driver otherwise),
    exports it on first use (``cuIpcGetMemHandle``) and returns its index and the bytes' offset in it, or
    why the tensor must go through the bucket instead. ``take_new`` hands out the handles not yet announced.

    ``recycled``: the session lets go of tensors before it ends (gathered weights, dropped once the receiver
    read them), so the caching allocator may return an exported allocation to the driver and get a new one at
    the same address. Every known range is then checked against the allocation's buffer id (one driver call
    per tensor), and a new allocation at an old address is exported anew (the receiver's old mapping of the
    freed one stays unread until the session ends).
    """

    def __init__(self, device: torch.device, *, max_allocations: int, recycled: bool = False) -> None:
        self.device = device
        self.index = device.index  # what ``Tensor.get_device()`` says of a tensor on it
        self.max_allocations = max_allocations
        self.recycled = recycled
        self._bases: list[int] = []  # sorted starts of the exported allocations
        self._known: dict[int, tuple[int, int, int]] = {}  # start -> (end, index, buffer id)
        self._refused: dict[int, str] = {}  # start -> why its allocation cannot be exported (asked once)
        self._last: tuple[int, int, int] = (0, 0, 0)  # (start, end, index) of the allocation the last tensor lay in
        self.handles: list[dict[str, Any]] = []  # index -> the raw fields the receiver maps
        self.replaced = 0  # allocations found new at an exported address (``recycled`` sessions)
        self._announced = 0
        self.uuid = device_uuid(device)

    def locate(self, pointer: int, nbytes: int) -> tuple[int, int] | str:
        """(allocation index, byte offset) of ``nbytes`` bytes at ``pointer``, or why they cannot be exported."""
        base, end, index = self._last  # a model's weights come in runs from one allocation
        if base <= pointer and pointer + nbytes <= end and not self.recycled:
            return index, pointer - base
        at = bisect.bisect_right(self._bases, pointer) - 1
        if at >= 0:
            base = self._bases[at]
            end, index, buffer_id = self._known[base]
            if pointer + nbytes <= end:
                if not self.recycled or self._buffer_id(pointer) == buffer_id:
                    self._last = (base, end, index)
                    return index, pointer - base
                del self._bases[at], self._known[base]  # freed since it was exported: the one there now is another
                self.replaced += 1
        lib = _driver()
        base_c, size_c = ctypes.c_uint64(), ctypes.c_size_t()
        with torch.cuda.device(self.device):
            result = lib.cuMemGetAddressRange_v2(ctypes.byref(base_c), ctypes.byref(size_c), pointer)
        if result != 0:
            return f"its address has no allocation the driver knows (CUDA error {result})"
        base, size = base_c.value, size_c.value
        if base in self._refused:
            return self._refused[base]
        if pointer + nbytes > base + size:
            return "its bytes span two allocations"
        exported = self._export(base, size)
        return exported if isinstance(exported, str) else (exported, pointer - base)

    def _export(self, base: int, size: int) -> int | str:
        """Export the allocation of ``size`` bytes at ``base``: its index, or why it cannot be."""
        if len(self.handles) >= self.max_allocations:
            return f"its allocation would be export number {len(self.handles) + 1} of at most {self.max_allocations}"
        buffer_id = self._buffer_id(base) if self.recycled else 0
        if self.recycled and not buffer_id:  # no way to tell this allocation from a later one at its address
            return "the driver gives its allocation no buffer id (needed for tensors dropped during the sync)"
        handle = _IpcHandle()
        with torch.cuda.device(self.device):
            result = _driver().cuIpcGetMemHandle(ctypes.byref(handle), base)
        if result != 0:
            self._refused[base] = (
                f"cuIpcGetMemHandle refused its allocation (CUDA error {result}; expandable segments?)"
            )
            return self._refused[base]
        index = len(self.handles)
        self.handles.append({"ipc_handle": bytes(handle.reserved), "nbytes": size, "device_uuid": self.uuid})
        bisect.insort(self._bases, base)
        self._known[base] = (base + size, index, buffer_id)
        self._last = (base, base + size, index)
        return index

    def _buffer_id(self, pointer: int) -> int:
        """The driver's unique id of the allocation ``pointer`` lies in (0 when it knows none)."""
        value = ctypes.c_uint64()
        result = _driver().cuPointerGetAttribute(ctypes.byref(value), _POINTER_BUFFER_ID, pointer)
        return value.value if result == 0 else 0

    def take_new(self) -> list[dict[str, Any]]:
        """The handles exported since the last call, in index order (each is announced once)."""
        new = self.handles[self._announced :]
        self._announced = len(self.handles)
        return new


def release_mappings(mappings: list[CudaIpcMapping], *, what: str, timings: dict[str, float] | None = None) -> None:
    """Close every mapping (the bucket, and the sender's allocations of direct buckets) after this stream's reads,
    then flush torch's caches once; raises if a view of one is still referenced (that one stays open until it dies).
    ``timings`` gets the seconds of each step added (release_sync, release_close, release_flush)."""
    if not mappings:
        return
    spent = timings if timings is not None else {}
    began = time.perf_counter()
    torch.cuda.current_stream(mappings[0].device).synchronize()
    closing = time.perf_counter()
    spent["release_sync"] = spent.get("release_sync", 0.0) + closing - began
    alive = 0
    for mapping in mappings:
        mapping.tensor = None  # the finalizer closes the mapping as this last view dies
        alive += mapping._closed.alive
    flushing = time.perf_counter()
    spent["release_close"] = spent.get("release_close", 0.0) + flushing - closing
    if alive:
        raise TransferError(
            f"receiver release: a tensor view of {what} is still referenced ({alive} of {len(mappings)} mappings "
            "kept open; tensors handed to on_bucket / iter_weights are valid only until the next one; copy them)"
        )
    torch.cuda.ipc_collect()
    torch.cuda.empty_cache()
    spent["release_flush"] = spent.get("release_flush", 0.0) + time.perf_counter() - flushing
