"""Offload core on a GPU: device memory really drops and returns, pinned exact-size arena."""

from __future__ import annotations

import pytest
import torch

from refitkit.errors import InvalidInput
from refitkit.offload import (
    HostArena,
    flush_device,
    offload_optimizer,
    offload_tensors,
    reload_optimizer,
    reload_tensors,
)
from tests.offload.child import run_in_child
from tests.offload.test_moves import random_tensor, storage_bytes

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(180)]


MIB = 1 << 20
# what device free memory may differ from the allocator's account by: the driver maps in 2 MiB pages
DRIVER_SLACK_BYTES = 2 * MIB


def _warm_up() -> None:
    """Load the kernels the measured code uses (lazy module loading takes device memory), then flush."""
    small = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    arena = HostArena()
    offload_tensors([small], arena)
    reload_tensors([small], arena)
    small.cpu()
    del small
    flush_device()


def memory_returns_to_the_device() -> dict:
    """In a fresh process (nothing cached, nothing from earlier tests): offload, flush, reload."""
    _warm_up()
    free_base = torch.cuda.mem_get_info()[0]
    allocated_base = torch.cuda.memory_allocated()
    # >10 MiB each: the caching allocator gives each its own segment, so empty_cache can return it
    tensors = {f"w{i}": torch.randn(4096, 2048 + 64 * i, device="cuda", dtype=torch.bfloat16) for i in range(4)}
    expected = {k: v.cpu() for k, v in tensors.items()}
    nbytes = sum(t.untyped_storage().nbytes() for t in tensors.values())
    torch.cuda.synchronize()
    free_loaded = torch.cuda.mem_get_info()[0]
    allocated_loaded = torch.cuda.memory_allocated()
    arena = HostArena()
    moved = offload_tensors(tensors, arena).bytes
    allocated_offloaded = torch.cuda.memory_allocated()
    flush_device()
    free_offloaded = torch.cuda.mem_get_info()[0]
    reload_tensors(tensors, arena, device="cuda")
    allocated_reloaded = torch.cuda.memory_allocated()
    intact = [torch.equal(t.cpu(), expected[name]) for name, t in tensors.items()]
    return {
        "nbytes": nbytes,
        "moved": moved,
        "free_base": free_base,
        "free_loaded": free_loaded,
        "free_offloaded": free_offloaded,
        "allocated_base": allocated_base,
        "allocated_loaded": allocated_loaded,
        "allocated_offloaded": allocated_offloaded,
        "allocated_reloaded": allocated_reloaded,
        "intact": intact,
    }


def test_memory_allocated_drops_by_the_offloaded_bytes_and_comes_back():
    r = run_in_child(memory_returns_to_the_device)
    nbytes = r["nbytes"]
    assert r["moved"] == nbytes
    # blocks are rounded up by the caching allocator, so the drop is at least the storage bytes
    assert nbytes <= r["allocated_loaded"] - r["allocated_offloaded"] <= nbytes + 4 * (2 * MIB), r
    # the device itself got the bytes back (free memory, which also sees what the allocator cannot),
    # and is where it was before the tensors existed, up to the driver's page granularity
    assert r["free_offloaded"] - r["free_loaded"] >= nbytes, r
    assert abs(r["free_base"] - r["free_offloaded"]) <= DRIVER_SLACK_BYTES, r
    assert r["allocated_offloaded"] == r["allocated_base"], r
    # the storages are back: the allocator's account (its rounding) is at least the storage bytes
    assert nbytes <= r["allocated_reloaded"] - r["allocated_base"] <= r["allocated_loaded"] - r["allocated_base"], r
    assert r["intact"] == [True] * 4


def reload_out_of_device_memory() -> dict:
    """A real CUDA out-of-memory at the third of four storages, then a retry once memory is allowed again."""
    _warm_up()
    tensors = {f"w{i}": torch.randint(0, 256, (256 * MIB,), dtype=torch.uint8, device="cuda") for i in range(4)}
    expected = {k: v.cpu() for k, v in tensors.items()}
    arena = HostArena()
    offload_tensors(tensors, arena)
    flush_device()
    free_offloaded = torch.cuda.mem_get_info()[0]
    total = torch.cuda.get_device_properties(0).total_memory
    # the caching allocator refuses beyond this fraction: room for two storages, not three
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + 600 * MIB) / total)
    try:
        reload_tensors(tensors, arena)
        error = None
    except Exception as caught:  # noqa: BLE001 - reported to the parent as data
        error = (type(caught).__name__, str(caught), type(caught.__cause__).__name__)
    device_bytes = [t.untyped_storage().nbytes() for t in tensors.values()]
    flush_device()
    free_after_failure = torch.cuda.mem_get_info()[0]
    held = arena.held_bytes
    torch.cuda.set_per_process_memory_fraction(1.0)
    reload_tensors(tensors, arena)
    return {
        "error": error,
        "device_bytes": device_bytes,
        "held": held,
        "free_offloaded": free_offloaded,
        "free_after_failure": free_after_failure,
        "intact": [torch.equal(t.cpu(), expected[name]) for name, t in tensors.items()],
    }


def test_a_reload_out_of_device_memory_frees_what_it_regrew_and_retries_bit_exact():
    r = run_in_child(reload_out_of_device_memory)
    assert r["error"] is not None and r["error"][0] == "RefitError", r["error"]
    assert "while restoring 'w2' on cuda" in r["error"][1] and r["error"][2] == "OutOfMemoryError", r["error"]
    assert r["device_bytes"] == [0, 0, 0, 0]
    assert r["held"] == 4 * 256 * MIB
    # the two storages regrown before the failure went back to the device
    assert abs(r["free_offloaded"] - r["free_after_failure"]) <= DRIVER_SLACK_BYTES, r
    assert r["intact"] == [True] * 4


def _drop_ipc_lock_capability() -> None:
    """As root, give up CAP_IPC_LOCK (which bypasses RLIMIT_MEMLOCK) for this process only."""
    import ctypes

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    libc = ctypes.CDLL(None, use_errno=True)
    header, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3
    if libc.capget(ctypes.byref(header), data) != 0:
        return
    cap_ipc_lock = 1 << 14
    data[0].effective &= ~cap_ipc_lock
    data[0].permitted &= ~cap_ipc_lock
    libc.capset(ctypes.byref(header), data)


def pin_refused_then_retry() -> dict:
    import os
    import resource

    _warm_up()
    a = torch.full((64 * MIB,), 0x11, dtype=torch.uint8, device="cuda")
    b = torch.full((64 * MIB,), 0x22, dtype=torch.uint8, device="cuda")
    arena = HostArena(pin_memory=True)
    if os.geteuid() == 0:
        _drop_ipc_lock_capability()
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    low = 64 << 10 if hard == resource.RLIM_INFINITY else min(64 << 10, hard)
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (low, hard))
    try:
        offload_tensors({"a": a}, arena)
        error = None
    except Exception as caught:  # noqa: BLE001 - reported to the parent as data
        error = (type(caught).__name__, str(caught))
    finally:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (soft, hard))
    if error is None:
        return {"refused": False}
    after_failure = (
        arena.nbytes,
        arena.chunks,
        arena.slot_of(a.untyped_storage()) is not None,
        a.untyped_storage().nbytes(),
    )
    offload_tensors({"b": b}, arena)
    offload_tensors({"a": a}, arena)
    reload_tensors({"a": a, "b": b}, arena)
    return {
        "refused": True,
        "error": error,
        "after_failure": after_failure,
        "a_intact": bool((a == 0x11).all()),
        "b_intact": bool((b == 0x22).all()),
    }


def test_a_refused_pin_leaves_the_arena_as_it_was_and_a_retry_keeps_bytes_apart():
    r = run_in_child(pin_refused_then_retry)
    if not r["refused"]:
        pytest.skip("cudaHostRegister was not refused under a 64 KiB RLIMIT_MEMLOCK here (capability kept?)")
    assert r["b_intact"] and r["a_intact"], "a storage came back with another's bytes"
    assert r["error"][0] == "RefitError" and "cudaHostRegister" in r["error"][1], r["error"]
    assert r["after_failure"] == (0, 0, False, 64 * MIB)


def test_arena_is_pinned_and_exact():
    tensors = [torch.zeros((1 << 20) + 1, dtype=torch.uint8, device="cuda") for _ in range(3)]
    arena = HostArena()
    assert arena.pinned
    offload_tensors(tensors, arena)
    assert all(chunk.is_pinned() for chunk in arena._chunks)
    assert arena.nbytes <= 1.02 * 3 * ((1 << 20) + 1)
    reload_tensors(tensors, arena)
    arena.release()
    assert arena.nbytes == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.bool, torch.complex64, torch.int64])
def test_gpu_round_trip_is_bit_exact(dtype):
    t = random_tensor((33, 7), dtype, seed=5).cuda()
    view = t[3:, ::2]
    before = storage_bytes(t.cpu())
    arena = HostArena()
    offload_tensors({"t": t, "view": view}, arena)
    assert t.untyped_storage().nbytes() == 0
    reload_tensors({"view": view}, arena)
    assert storage_bytes(t.cpu()) == before


def test_mixed_cpu_and_cuda_tensors_are_refused():
    with pytest.raises(InvalidInput, match=r"mixed devices: 'a' is on cuda:0 but 'b' is on cpu"):
        offload_tensors({"a": torch.ones(2, device="cuda"), "b": torch.ones(2)}, HostArena())


def test_adam_state_offload_frees_device_memory():
    model = torch.nn.Linear(512, 512).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    model(torch.randn(4, 512, device="cuda")).sum().backward()
    optimizer.step()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    arena = HostArena()
    moved = offload_optimizer(optimizer, arena)
    assert moved.bytes >= 2 * (512 * 512 + 512) * 4
    big_states = 2 * (512 * 512 + 512) * 4  # exp_avg + exp_avg_sq; the 4-byte step scalars sit in 512-byte blocks
    assert before - torch.cuda.memory_allocated() >= big_states
    assert all(t.untyped_storage().nbytes() == 0 for state in optimizer.state.values() for t in state.values())
    reload_optimizer(optimizer, arena)
    assert torch.cuda.memory_allocated() == before


def test_a_background_reservation_pins_for_real_and_serves_the_first_offload():
    tensors = {f"w{i}": torch.randn(1 << 20, device="cuda") for i in range(3)}
    expected = {name: t.clone() for name, t in tensors.items()}
    arena = HostArena()
    reservation = arena.reserve([t.untyped_storage() for t in tensors.values()], background=True)
    # the default stream keeps working while the thread pins (what training does meanwhile)
    busy = sum(float(t.square().sum()) for t in tensors.values())
    assert reservation.wait(60.0) == arena.nbytes and arena.chunks == 1
    assert all(chunk.is_pinned() for chunk in arena._chunks)
    offload_tensors(tensors, arena)
    assert arena.chunks == 1 and all(t.untyped_storage().nbytes() == 0 for t in tensors.values())
    reload_tensors(tensors, arena)
    assert all(torch.equal(tensors[n], expected[n]) for n in tensors) and busy > 0
    arena.release()


def background_pin_refused() -> dict:
    import os
    import resource

    from refitkit.errors import RefitError

    _warm_up()
    a = torch.full((64 * MIB,), 0x11, dtype=torch.uint8, device="cuda")
    arena = HostArena(pin_memory=True)
    if os.geteuid() == 0:
        _drop_ipc_lock_capability()
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    low = 64 << 10 if hard == resource.RLIM_INFINITY else min(64 << 10, hard)
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (low, hard))
    try:
        reservation = arena.reserve([a.untyped_storage()], background=True)
        reservation._thread.join(60.0)
    finally:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (soft, hard))
    if reservation.exception() is None:
        return {"refused": False}
    after_failure = (arena.nbytes, arena.chunks, arena.slot_of(a.untyped_storage()) is not None)
    try:
        offload_tensors({"a": a}, arena)
        error = None
    except RefitError as caught:
        error = str(caught)
    torch.ones(1, device="cuda").add_(1)  # the refused register must not poison this thread's next kernel
    offload_tensors({"a": a}, arena)
    reload_tensors({"a": a}, arena)
    return {"refused": True, "error": error, "after_failure": after_failure, "a_intact": bool((a == 0x11).all())}


def test_a_background_pin_that_is_refused_surfaces_at_the_offload_and_the_arena_stays_usable():
    r = run_in_child(background_pin_refused)
    if not r["refused"]:
        pytest.skip("cudaHostRegister was not refused under a 64 KiB RLIMIT_MEMLOCK here (capability kept?)")
    assert r["after_failure"] == (0, 0, False)
    assert "reserve(background=True) failed in its thread" in r["error"] and "cudaHostRegister" in r["error"], r
    assert r["a_intact"]


def _segments_holding(pointers: list[int]) -> int:
    """How many of the caching allocator's segments hold these device pointers."""
    found = set()
    for segment in torch.cuda.memory_snapshot():
        start, size = segment["address"], segment["total_size"]
        found.update(start for p in pointers if start <= p < start + size)
    return len(found)


def test_a_reload_after_a_flush_regrows_every_storage_bit_exact_and_the_next_flush_frees_them_all():
    _warm_up()
    tensors = [random_tensor((1024 + 37 * i, 1024), torch.bfloat16, seed=i).cuda() for i in range(24)]  # 2-4 MiB each
    originals = [t.cpu().view(torch.uint8) for t in tensors]  # bits (NaN payloads compare too)
    arena = HostArena()
    offload_tensors(tensors, arena)
    flush_device()
    reserved_before = torch.cuda.memory_reserved()
    reload_tensors(tensors, arena)
    assert _segments_holding([t.data_ptr() for t in tensors]) == 1  # 77 MiB in one shared segment; before: 24
    total = sum(-(-t.untyped_storage().nbytes() // 512) * 512 for t in tensors)
    assert 0 <= torch.cuda.memory_reserved() - reserved_before - total < 2 * MIB  # that segment, rounded to 2 MiB
    assert all(torch.equal(t.cpu().view(torch.uint8), o) for t, o in zip(tensors, originals))
    offload_tensors(tensors, arena)
    flush_device()
    assert torch.cuda.memory_reserved() == reserved_before  # every block went back to the driver
    reload_tensors(tensors, arena)
    assert all(torch.equal(t.cpu().view(torch.uint8), o) for t, o in zip(tensors, originals))


def test_a_reload_without_a_flush_takes_the_cached_blocks_and_reserves_no_new_segment():
    _warm_up()
    tensors = [random_tensor((1024 + 37 * i, 1024), torch.bfloat16, seed=i).cuda() for i in range(24)]
    originals = [t.cpu().view(torch.uint8) for t in tensors]
    arena = HostArena()
    offload_tensors(tensors, arena)  # the freed blocks stay in the cache: no flush_device()
    reserved_before = torch.cuda.memory_reserved()
    reload_tensors(tensors, arena)
    assert torch.cuda.memory_reserved() == reserved_before  # a shared segment here would have sat unused
    assert all(torch.equal(t.cpu().view(torch.uint8), o) for t, o in zip(tensors, originals))


def test_grads_zeroed_after_a_flush_share_segments_and_the_next_flush_frees_them_all():
    from refitkit.offload import offload_grads, reload_grads

    _warm_up()
    params = [
        (f"p{i}", torch.nn.Parameter(torch.randn(1024 + 37 * i, 1024, device="cuda", dtype=torch.bfloat16)))
        for i in range(24)
    ]
    arena = HostArena()
    for _, param in params:
        param.grad = torch.ones_like(param)
    offload_grads(params, arena)  # dropped, as a step's grads are by default
    flush_device()
    reserved_before = torch.cuda.memory_reserved()
    segments_before = torch.cuda.memory_stats()["segment.all.current"]
    reload_grads(params, arena, zero=True)
    grads = [param.grad for _, param in params]
    assert all(
        grad is not None and grad.shape == param.shape and not grad.any() for grad, (_, param) in zip(grads, params)
    )
    # One new segment for all 77 MiB (before: one 20 MiB segment per few grads). The first grads may take the free
    # tails of the params' own segments instead (best fit), which no flush returns while the params live.
    assert torch.cuda.memory_stats()["segment.all.current"] - segments_before == 1
    del grads
    offload_grads(params, arena)
    flush_device()
    assert torch.cuda.memory_reserved() == reserved_before  # the shared segment went back whole


def test_weights_reloaded_ahead_after_a_flush_share_as_few_segments_as_fit():
    # a model's weights and its optimizer's state of the same sizes, 3 GiB in all: by size alone they interleave
    # over two 2 GiB segments; ahead, the 1.5 GiB of weights regrow into one (a sync maps one allocation, not two)
    mib = 1 << 20
    sizes = [384 * mib] * 3 + [128 * mib] * 3
    weights = [torch.full((n,), i + 1, dtype=torch.uint8, device="cuda") for i, n in enumerate(sizes)]
    states = [torch.full((n,), 100 + i, dtype=torch.uint8, device="cuda") for i, n in enumerate(sizes)]
    arena = HostArena()
    spans = {}
    for ahead in (None, weights):
        offload_tensors(weights + states, arena)
        flush_device()
        reload_tensors(weights + states, arena, ahead=ahead)
        spans[ahead is not None] = _segments_holding([t.data_ptr() for t in weights])
        assert all(int(t[0]) == i + 1 and int(t[-1]) == i + 1 for i, t in enumerate(weights))
    assert spans == {False: 2, True: 1}
