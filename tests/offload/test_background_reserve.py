"""Background reservations: the arena sized and allocated (pinned on CUDA) in a thread, settled by wait or offload.

Pinning is a no-op without CUDA, but the thread, the allocation, the bookkeeping and the
failure handling are the real ones (a real allocation failure in a spawned child).
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from refitkit.engines.fsdp import FSDPAdapter
from refitkit.errors import InvalidInput, RefitError
from refitkit.offload import HostArena, Reservation, ReserveTimeout, offload_tensors, reload_tensors
from refitkit.offload.device import ALIGN_BYTES
from tests.offload.child import address_space_headroom, run_in_child

pytestmark = pytest.mark.timeout(120)

MIB = 1 << 20


def _aligned(nbytes: int) -> int:
    return (nbytes + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


def test_a_background_reservation_serves_the_first_offload_without_allocating_again():
    tensors = {f"w{i}": torch.randn(1000 + i) for i in range(3)}
    expected = {name: t.clone() for name, t in tensors.items()}
    arena = HostArena(pin_memory=False)
    reservation = arena.reserve([t.untyped_storage() for t in tensors.values()], background=True)
    assert isinstance(reservation, Reservation)
    want = sum(_aligned(t.untyped_storage().nbytes()) for t in tensors.values())
    assert reservation.wait(30.0) == want == reservation.nbytes
    assert reservation.done() and reservation.exception() is None
    assert (arena.nbytes, arena.chunks) == (want, 1)
    assert all(arena.slot_of(t.untyped_storage()) is not None for t in tensors.values())
    moved = offload_tensors(tensors, arena)
    assert moved.bytes == sum(t.untyped_storage().nbytes() for t in expected.values())
    assert (arena.nbytes, arena.chunks) == (want, 1), "the offload allocated again"
    reload_tensors(tensors, arena)
    assert all(torch.equal(tensors[n], expected[n]) for n in tensors)


def test_the_first_offload_settles_a_reservation_nobody_waited_on():
    a, b = torch.randn(4096), torch.randn(333)
    expected_a = a.clone()
    arena = HostArena(pin_memory=False)
    reservation = arena.reserve([a.untyped_storage()], background=True)
    offload_tensors({"a": a, "b": b}, arena)  # b was not reserved: one more chunk, for b only
    assert reservation.done() and arena.chunks == 2
    assert arena.nbytes == _aligned(4096 * 4) + _aligned(333 * 4)
    assert reservation.wait(1.0) == _aligned(4096 * 4)  # already settled: wait just reports
    reload_tensors({"a": a, "b": b}, arena)
    assert torch.equal(a, expected_a)


def test_a_wait_that_runs_out_is_bounded_names_its_knob_and_can_be_waited_again():
    a = torch.randn(2048)
    expected = a.clone()
    arena = HostArena(pin_memory=False, reserve_wait_s=0.2)
    with arena._chunks_lock:  # the thread cannot file its chunk while the test holds this
        reservation = arena.reserve([a.untyped_storage()], background=True)
        with pytest.raises(ReserveTimeout, match=r"within 0\.05 s.*raise Reservation\.wait\(timeout_s\)"):
            reservation.wait(0.05)
        with pytest.raises(ReserveTimeout, match=r"within 0\.2 s.*raise HostArena\(reserve_wait_s=\.\.\.\)"):
            offload_tensors({"a": a}, arena)
        assert a.untyped_storage().nbytes() == 2048 * 4, "an offload that timed out must move nothing"
        assert arena.slot_of(a.untyped_storage()) is None and not reservation.done()
    assert reservation.wait(30.0) == _aligned(2048 * 4)
    offload_tensors({"a": a}, arena)
    assert arena.chunks == 1
    reload_tensors({"a": a}, arena)
    assert torch.equal(a, expected)


def test_a_storage_that_dies_before_the_reservation_settles_leaves_a_free_slot():
    a, b = torch.randn(1024), torch.randn(1024)
    arena = HostArena(pin_memory=False)
    with arena._chunks_lock:
        reservation = arena.reserve([a.untyped_storage(), b.untyped_storage()], background=True)
        del b
    reservation.wait(30.0)
    assert arena.slot_of(a.untyped_storage()) is not None
    c = torch.full((1024,), 3.0)  # fits b's slot: no new chunk
    offload_tensors({"a": a, "c": c}, arena)
    assert arena.chunks == 1
    reload_tensors({"c": c}, arena)
    assert torch.equal(c, torch.full((1024,), 3.0))


def test_two_background_reservations_never_promise_the_same_dead_slot():
    arena = HostArena(pin_memory=False)
    dead = torch.ones(1024)
    offload_tensors({"dead": dead}, arena)
    reload_tensors({"dead": dead}, arena)
    del dead  # one free slot of 4 KiB
    x, y = torch.full((1024,), 1.0), torch.full((1024,), 2.0)
    with arena._chunks_lock:
        first = arena.reserve([x.untyped_storage()], background=True)
        second = arena.reserve([y.untyped_storage()], background=True)
    assert (first.nbytes, second.nbytes) == (0, _aligned(4096)), "x reuses the dead slot, y gets fresh bytes"
    first.wait(30.0)
    second.wait(30.0)
    offload_tensors({"x": x, "y": y}, arena)
    assert arena.chunks == 2
    reload_tensors({"x": x, "y": y}, arena)
    assert torch.equal(x, torch.full((1024,), 1.0)) and torch.equal(y, torch.full((1024,), 2.0))


def test_wait_refuses_a_bad_timeout():
    arena = HostArena(pin_memory=False)
    reservation = arena.reserve([torch.ones(4).untyped_storage()], background=True)
    with pytest.raises(InvalidInput, match=r"Reservation\.wait\(timeout_s\)=-1"):
        reservation.wait(-1)
    reservation.wait(30.0)
    with pytest.raises(InvalidInput, match=r"HostArena\(reserve_wait_s\)=0"):
        HostArena(pin_memory=False, reserve_wait_s=0)


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    torch.manual_seed(seed)
    optimizer.zero_grad(set_to_none=True)
    model(torch.randn(4, 64)).square().mean().backward()
    optimizer.step()


def _adapter_run(prepare: bool) -> tuple[dict[str, torch.Tensor], int, int]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.Tanh(), nn.Linear(96, 64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optimizer, 1)
    adapter = FSDPAdapter(model, optimizer, arena=HostArena(pin_memory=False), keep_grads=True)
    if prepare:
        reservation = adapter.prepare()
        _train(model, optimizer, 2)  # training runs while the arena is allocated
        prepared_bytes = reservation.wait(30.0)
    else:
        _train(model, optimizer, 2)
        prepared_bytes = 0
    adapter.offload()
    chunks = adapter.arena.chunks
    adapter.reload()
    _train(model, optimizer, 3)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, prepared_bytes, chunks


def test_adapter_prepare_sizes_every_part_and_training_stays_bit_identical():
    prepared, prepared_bytes, chunks = _adapter_run(prepare=True)
    serial, _, _ = _adapter_run(prepare=False)
    assert chunks == 1, "the first offload after prepare() allocated again"
    params = 64 * 96 + 96 + 96 * 64 + 64
    # params, exp_avg, exp_avg_sq and the kept grads: 4 storages a param tensor, plus AdamW's step tensors
    assert prepared_bytes >= 4 * 4 * params
    assert all(torch.equal(prepared[n], serial[n]) for n in serial)


# --- a real allocation failure in the thread (spawned child, lowered address-space limit) ---------


def background_failure(surface_at: str) -> dict:
    torch.set_num_threads(1)
    a = torch.full((64 * MIB,), 0x11, dtype=torch.uint8)
    arena = HostArena(pin_memory=False)
    dead = torch.ones(1024)
    offload_tensors({"dead": dead}, arena)
    reload_tensors({"dead": dead}, arena)
    del dead
    small = torch.full((1024,), 7.0)  # fits the dead slot: handed over, not allocated
    with address_space_headroom(24 * MIB):  # room for the thread's stack, not for 64 MiB
        reservation = arena.reserve([small.untyped_storage(), a.untyped_storage()], background=True)
        reservation._thread.join(60.0)
    done, thread_error = reservation.done(), type(reservation.exception()).__name__
    after = (
        arena.nbytes,
        arena.chunks,
        arena.slot_of(a.untyped_storage()) is None,
        arena.slot_of(small.untyped_storage()) is None,
    )
    errors = []
    for _ in range(2):  # the failure surfaces once at the offload, then the offload allocates itself
        try:
            if surface_at == "wait" and not errors:
                reservation.wait(10.0)
            else:
                offload_tensors({"a": a, "small": small}, arena)
        except RefitError as caught:
            errors.append(str(caught))
    reload_tensors({"a": a, "small": small}, arena)
    again = None
    try:
        reservation.wait(1.0)
    except RefitError as caught:
        again = str(caught)
    return {
        "done": done,
        "thread_error": thread_error,
        "after": after,
        "errors": errors,
        "again": again,
        "a_intact": bool((a == 0x11).all()),
        "small_intact": bool((small == 7.0).all()),
        "arena_nbytes": arena.nbytes,
    }


@pytest.mark.parametrize("surface_at", ["wait", "offload"])
def test_a_background_reservation_that_fails_leaves_the_arena_usable_and_says_so_once(surface_at):
    r = run_in_child(background_failure, surface_at)
    assert r["done"] and r["thread_error"] == "RefitError", r
    assert r["after"] == (4096, 1, True, True), "the failed reservation registered something"
    assert len(r["errors"]) == 1, r["errors"]
    message = r["errors"][0]
    assert "HostArena.reserve(background=True) failed in its thread" in message
    assert f"allocating {64 * MIB} host bytes for 1 storages failed" in message and "stays usable" in message
    assert r["again"] == message, "wait() after the failure must report the same error"
    assert r["a_intact"] and r["small_intact"]
    assert r["arena_nbytes"] == 4096 + 64 * MIB, "the retry reused the dead slot for small and allocated a only"


def _wait_done(reservation: Reservation) -> None:
    """Until the thread finished, WITHOUT settling the reservation (as an offload would find it)."""
    deadline = time.monotonic() + 30.0
    while not reservation.done():
        assert time.monotonic() < deadline, "the reservation thread did not finish within 30 s"
        time.sleep(0.005)


def test_a_storage_that_grew_after_its_background_reservation_does_not_overrun_its_neighbours_slot():
    a = torch.arange(16, dtype=torch.float32)  # 64 bytes: reserved at that size
    b = torch.arange(64, dtype=torch.float32) + 1000.0  # its slot lies right after a's
    arena = HostArena(pin_memory=False)
    reservation = arena.reserve([a.untyped_storage(), b.untyped_storage()], background=True)
    _wait_done(reservation)
    a.resize_(128)  # the storage grows to 512 bytes before the first offload settles the reservation
    a.copy_(torch.arange(128, dtype=torch.float32) + 5.0)
    expected_a, expected_b = a.clone(), b.clone()
    offload_tensors({"b": b, "a": a}, arena)
    reload_tensors({"b": b, "a": a}, arena)
    assert torch.equal(a, expected_a)
    assert torch.equal(b, expected_b), "a's copy ran past its reserved slot into b's host bytes"


def test_release_after_a_failed_background_reservation_settles_the_later_ones_too():
    arena = HostArena(pin_memory=False)
    huge = torch.empty(1 << 50, dtype=torch.uint8, device="meta")  # 1 PiB: the host allocation fails
    failing = arena.reserve([huge.untyped_storage()], background=True)
    y = torch.full((256,), 2.0)
    later = arena.reserve([y.untyped_storage()], background=True)
    _wait_done(failing)
    _wait_done(later)
    arena.release()  # logs the failure; must not leave `later` to register slots in chunks it just freed
    assert (arena.nbytes, arena.chunks) == (0, 0)
    z, w = torch.full((256,), 3.0), torch.full((256,), 4.0)
    offload_tensors({"z": z}, arena)
    offload_tensors({"w": w}, arena)
    offload_tensors({"y": y}, arena)
    reload_tensors({"z": z, "w": w, "y": y}, arena)
    assert torch.equal(z, torch.full((256,), 3.0)) and torch.equal(y, torch.full((256,), 2.0))
    assert torch.equal(w, torch.full((256,), 4.0)), "y's stale slot pointed into w's chunk"
