"""Offload/reload of tensors: bit-exact, per storage, identity kept, device bytes really freed."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch

from refitkit.errors import InvalidInput
from refitkit.offload import HostArena, MoveStats, offload_tensors, reload_tensors
from refitkit.offload.overlapped import cancel_offload, start_offload
from tests.helpers.copies import CopyOrder


def _all_dtypes() -> list[torch.dtype]:
    """Every dtype torch can allocate and view as bytes on this build (bf16, fp8s, complex, bool, ints...)."""
    found = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # complex32 / quantized dtypes warn on allocation
        candidates = [value for value in vars(torch).values() if isinstance(value, torch.dtype)]
    for value in candidates:
        if value in found:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.empty(8, dtype=value).view(torch.uint8)
        except (RuntimeError, TypeError):
            continue
        found.append(value)
    return sorted(found, key=str)


ALL_DTYPES = _all_dtypes()


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random bits of any dtype (NaN payloads included), so comparisons are on bytes, not values."""
    g = torch.Generator().manual_seed(seed)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    numel = 1
    for dim in shape:
        numel *= dim
    raw = torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw &= 1
    return raw.view(dtype).reshape(shape)


def storage_bytes(t: torch.Tensor) -> bytes:
    s = t.untyped_storage()
    return bytes(torch.empty(0, dtype=torch.uint8).set_(s, 0, (s.nbytes(),), (1,)).tolist())


def test_dtype_list_covers_the_hard_cases():
    for dtype in (
        torch.bfloat16,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.bool,
        torch.int8,
        torch.uint16,
        torch.complex64,
        torch.complex128,
        torch.float64,
    ):
        assert dtype in ALL_DTYPES


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_round_trip_is_bit_exact_for_every_dtype(dtype):
    tensor = random_tensor((3, 17), dtype, seed=hash(str(dtype)) % 1000)
    before = storage_bytes(tensor)
    storage_key = tensor.untyped_storage()._cdata
    arena = HostArena()

    moved = offload_tensors({"w": tensor}, arena)

    assert moved.bytes == len(before) and moved.storages == 1
    assert tensor.untyped_storage().nbytes() == 0
    assert arena.held_bytes == len(before)
    back = reload_tensors({"w": tensor}, arena)
    assert back.bytes == len(before)
    assert tensor.untyped_storage()._cdata == storage_key, "the same storage object must be restored in place"
    assert storage_bytes(tensor) == before
    assert arena.held_bytes == 0


def test_views_sharing_a_storage_move_once_and_stay_views():
    base = random_tensor((8, 6), torch.float32)
    row, col, flat = base[2:5], base[:, 1], base.view(-1)
    before = storage_bytes(base)
    arena = HostArena()

    moved = offload_tensors([("base", base), ("row", row), ("col", col), ("flat", flat)], arena)

    assert moved.storages == 1 and moved.bytes == 8 * 6 * 4
    for t in (base, row, col, flat):
        assert t.untyped_storage().nbytes() == 0
    reload_tensors([row], arena)  # any one view restores the whole shared storage
    assert storage_bytes(base) == before
    flat[0] = 42.0
    assert base[0, 0].item() == 42.0 and row.data_ptr() == base.data_ptr() + 2 * 6 * 4


def test_non_contiguous_tensors_round_trip_their_whole_storage():
    parent = random_tensor((16, 9), torch.bfloat16, seed=3)
    strided = parent[::3, 1::2].t()
    assert not strided.is_contiguous()
    values = strided.clone()
    arena = HostArena()
    offload_tensors({"strided": strided}, arena)
    assert parent.untyped_storage().nbytes() == 0
    reload_tensors({"strided": strided}, arena)
    assert torch.equal(strided.view(torch.int16), values.view(torch.int16))
    assert strided.stride() == (2, 27)


def test_zero_size_tensors_are_accepted_and_move_nothing():
    empty = torch.empty(0, 5)
    arena = HostArena()
    assert offload_tensors({"empty": empty}, arena).bytes == 0
    assert reload_tensors({"empty": empty}, arena).bytes == 0
    assert empty.shape == (0, 5) and arena.nbytes == 0


def test_move_stats_repr_shows_every_documented_figure_gbps_included():
    # the README lists MoveStats(bytes, storages, seconds, gbps); the repr showed gbps nowhere
    weights = {"w": torch.randn(1 << 16)}
    arena = HostArena()
    for stats in (offload_tensors(weights, arena), reload_tensors(weights, arena)):
        assert stats.gbps > 0
        assert repr(stats) == f"MoveStats(bytes={4 << 16}, storages=1, seconds={stats.seconds!r}, gbps={stats.gbps!r})"
    assert (
        repr(MoveStats(bytes=2_000_000_000, storages=3, seconds=0.5))
        == "MoveStats(bytes=2000000000, storages=3, seconds=0.5, gbps=4.0)"
    )


def test_second_round_allocates_no_host_memory():
    tensors = {f"t{i}": random_tensor((64, 33 + i), torch.float16, seed=i) for i in range(10)}
    arena = HostArena()
    offload_tensors(tensors, arena)
    reload_tensors(tensors, arena)
    nbytes, chunks, chunk_ptr = arena.nbytes, arena.chunks, arena._chunks[0].data_ptr()
    offloaded = sum(t.untyped_storage().nbytes() for t in tensors.values())
    assert nbytes <= 1.02 * offloaded + 256 * len(tensors)
    for _ in range(3):
        offload_tensors(tensors, arena)
        reload_tensors(tensors, arena)
        assert (arena.nbytes, arena.chunks, arena._chunks[0].data_ptr()) == (nbytes, chunks, chunk_ptr)


def test_host_footprint_is_exact_for_large_storages():
    tensors = [torch.zeros(1 << 20, dtype=torch.uint8) for _ in range(4)]  # 4 MiB, no power-of-two padding room
    extra = torch.zeros((1 << 20) + 1, dtype=torch.uint8)  # just past a power of two
    arena = HostArena()
    offload_tensors(tensors + [extra], arena)
    assert arena.nbytes <= 1.02 * (5 * (1 << 20) + 1)


def test_reserve_ahead_takes_allocation_off_the_offload():
    tensors = [random_tensor((100,), torch.float32, seed=i) for i in range(3)]
    arena = HostArena()
    reserved = arena.reserve(t.untyped_storage() for t in tensors)
    assert reserved >= 1200 and arena.chunks == 1
    offload_tensors(tensors, arena)
    assert arena.chunks == 1 and arena.nbytes == reserved


def test_a_dead_storage_slot_is_reused_by_a_new_storage():
    arena = HostArena()
    old = torch.ones(1000)
    offload_tensors([old], arena)
    reload_tensors([old], arena)
    nbytes = arena.nbytes
    del old
    new = torch.full((1000,), 2.0)
    offload_tensors([new], arena)
    assert arena.nbytes == nbytes and arena.chunks == 1
    reload_tensors([new], arena)
    assert torch.equal(new, torch.full((1000,), 2.0))


def test_offloading_twice_is_idempotent():
    t = random_tensor((10,), torch.int64)
    before = storage_bytes(t)
    arena = HostArena()
    offload_tensors([t], arena)
    assert offload_tensors([t], arena).bytes == 0
    reload_tensors([t], arena)
    assert reload_tensors([t], arena).bytes == 0
    assert storage_bytes(t) == before


def test_a_round_runs_no_garbage_collection():
    collections = []

    def on_gc(phase, info):
        if phase == "start":
            collections.append(info["generation"])

    tensors = {f"t{i}": torch.randn(128) for i in range(200)}
    arena = HostArena()
    thresholds = gc.get_threshold()
    gc.set_threshold(10**9)  # no automatic collection: any callback would be an explicit gc.collect()
    gc.callbacks.append(on_gc)
    try:
        for _ in range(3):
            offload_tensors(tensors, arena)
            reload_tensors(tensors, arena)
    finally:
        gc.callbacks.remove(on_gc)
        gc.set_threshold(*thresholds)
    assert collections == []


def test_mixed_devices_are_refused_before_anything_moves():
    cpu = torch.randn(4)
    meta = torch.empty(4, device="meta")
    arena = HostArena()
    with pytest.raises(InvalidInput, match=r"mixed devices: 'cpu_w' is on cpu but 'meta_w' is on meta"):
        offload_tensors({"cpu_w": cpu, "meta_w": meta}, arena)
    assert cpu.untyped_storage().nbytes() == 16 and arena.nbytes == 0


def test_non_tensors_are_named_in_the_error():
    with pytest.raises(InvalidInput, match=r"'layer.bias' is a list, not a torch.Tensor"):
        offload_tensors({"layer.weight": torch.ones(2), "layer.bias": [1.0]}, HostArena())


def test_a_tensor_resized_after_offload_is_refused_and_its_bytes_kept():
    t = torch.arange(10, dtype=torch.float32)
    arena = HostArena()
    offload_tensors({"w": t}, arena)
    t.resize_(20)
    with pytest.raises(InvalidInput, match=r"'w' was resized or re-viewed"):
        reload_tensors({"w": t}, arena)
    assert arena.held_bytes == 40


def test_storage_grown_behind_the_tensor_is_refused():
    t = torch.arange(10, dtype=torch.float32)
    arena = HostArena()
    offload_tensors({"w": t}, arena)
    t.untyped_storage().resize_(40)
    with pytest.raises(InvalidInput, match=r"'w': its storage was resized to 40 bytes after offload"):
        reload_tensors({"w": t}, arena)


def test_a_tensor_replaced_after_offload_is_refused_and_its_bytes_kept():
    param = torch.nn.Parameter(torch.arange(6, dtype=torch.float32))
    arena = HostArena()
    offload_tensors({"layer.weight": param}, arena)
    param.data = torch.zeros(6)
    with pytest.raises(InvalidInput, match=r"'layer.weight' was replaced between offload and reload"):
        reload_tensors({"layer.weight": param}, arena)
    assert arena.held_bytes == 24


def test_a_tensor_never_offloaded_into_this_arena_is_refused():
    t = torch.ones(3)
    offload_tensors([t], HostArena())
    with pytest.raises(InvalidInput, match=r"no device bytes and this arena holds none"):
        reload_tensors({"w": t}, HostArena())


def test_reload_to_another_device_is_refused():
    t = torch.ones(3)
    arena = HostArena()
    offload_tensors({"w": t}, arena)
    with pytest.raises(InvalidInput, match=r"'w' was offloaded from cpu, cannot reload to meta"):
        reload_tensors({"w": t}, arena, device="meta")
    reload_tensors({"w": t}, arena, device="cpu")
    assert torch.equal(t, torch.ones(3))


def test_non_resizable_storage_is_refused():
    import numpy as np

    external = torch.from_numpy(np.ones(4, dtype=np.float32))
    with pytest.raises(InvalidInput, match=r"'ext' lives in a non-resizable storage"):
        offload_tensors({"ext": external}, HostArena())


def test_release_refuses_while_data_is_held():
    from refitkit.errors import RefitError

    t = torch.ones(3)
    arena = HostArena()
    offload_tensors([t], arena)
    with pytest.raises(RefitError, match="still offloaded here"):
        arena.release()
    reload_tensors([t], arena)
    arena.release()
    assert arena.nbytes == 0


def test_pinning_without_cuda_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(InvalidInput, match="pin_memory=True.*needs CUDA"):
        HostArena(pin_memory=True)


def test_a_tensor_in_shared_memory_is_refused_before_anything_moves():
    # share_memory_() storages report resizable(), but growing one back after resize_(0) segfaulted on reload
    arena = HostArena()
    shared = torch.arange(64, dtype=torch.float32).share_memory_()
    before = shared.clone()
    with pytest.raises(InvalidInput, match=r"'tensors\[0\]' lives in a non-resizable storage"):
        offload_tensors([shared], arena)
    assert shared.untyped_storage().nbytes() == 64 * 4 and torch.equal(shared, before)
    assert arena.nbytes == 0


def test_a_failed_offload_keeps_the_view_records_of_an_earlier_one():
    arena = HostArena()
    t = torch.arange(1024, dtype=torch.float32)
    offload_tensors({"t": t}, arena)  # its first storage is offloaded
    t.data = torch.ones(1024)  # replaced while offloaded: a new resident storage

    def failing_bookkeeping() -> None:
        raise RuntimeError("bookkeeping failed")

    with pytest.raises(RuntimeError, match="bookkeeping failed"):
        offload_tensors({"t": t}, arena, while_copying=failing_bookkeeping)
    assert t.untyped_storage().nbytes() == 1024 * 4  # nothing was freed
    # the record of the first offload survived the failed one: the replaced tensor is still refused
    with pytest.raises(InvalidInput, match="'t' was replaced between offload and reload"):
        reload_tensors({"t": t}, arena)


def test_cancelling_an_overlapped_offload_keeps_the_records_of_a_storage_another_offload_freed():
    arena = HostArena()
    base = torch.arange(16, dtype=torch.float32)
    optimizer_view, model_view = base.view(4, 4), base.view(4, 4)  # two handles on one storage
    flight = start_offload({"optimizer": optimizer_view}, arena)
    offload_tensors({"param": model_view}, arena)  # frees the storage, its bytes in the arena
    cancel_offload(flight)  # e.g. the sync failed afterwards
    assert base.untyped_storage().nbytes() == 0
    model_view.data = torch.zeros(4, 4)  # replaced while offloaded
    with pytest.raises(InvalidInput, match="'param' was replaced between offload and reload"):
        reload_tensors({"param": model_view}, arena)


def test_a_tensor_reviewed_on_the_device_between_rounds_is_recorded_anew():
    # a round's view records are taken again by the next offload only when they still describe the tensor
    t = torch.arange(12, dtype=torch.float32)
    other = torch.arange(6, dtype=torch.float32)
    arena = HostArena()
    offload_tensors({"w": t, "v": other}, arena)
    reload_tensors({"w": t, "v": other}, arena)
    t.set_(t.untyped_storage(), 2, (5, 2), (2, 1))  # re-viewed on the device: same storage, new shape and offset
    before = storage_bytes(t)
    offload_tensors({"w": t, "v": other}, arena)
    try:  # not refused as "re-viewed": its record is the new view (a traceback would print offloaded tensors)
        storages, refused = reload_tensors({"w": t, "v": other}, arena).storages, None
    except InvalidInput as error:
        storages, refused = 0, str(error)
    assert refused is None, refused
    assert storages == 2 and (t.shape, t.stride(), t.storage_offset()) == ((5, 2), (2, 1), 2)
    assert storage_bytes(t) == before and torch.equal(other, torch.arange(6, dtype=torch.float32))
    offload_tensors({"w": t, "v": other}, arena)
    t.resize_(3)  # re-viewed while offloaded is still refused, with the reused records too
    with pytest.raises(InvalidInput, match=r"'w' was resized or re-viewed"):
        reload_tensors({"w": t, "v": other}, arena)


def test_records_kept_for_the_next_round_do_not_pile_up_for_tensors_that_died():
    arena = HostArena()
    many = {f"old{i}": torch.randn(8) for i in range(2000)}
    offload_tensors(many, arena)
    reload_tensors(many, arena)
    assert len(arena.resident_views) == 2000  # kept for the next offload of the same tensors
    del many  # (e.g. optimizer state rebuilt): their records can never be taken again
    few = {f"new{i}": torch.randn(8) for i in range(10)}
    offload_tensors(few, arena)
    reload_tensors(few, arena)
    assert len(arena.resident_views) == 10
    assert all(record.tensor_ref() is not None for record in arena.resident_views.values())


def test_small_reloads_beside_many_live_records_do_not_sweep_them_every_time():
    arena = HostArena()
    many = {f"live{i}": torch.randn(8) for i in range(2000)}  # e.g. the other parts of a model, all alive
    offload_tensors(many, arena)
    reload_tensors(many, arena)
    one = {"small": torch.randn(8)}
    offload_tensors(one, arena)
    reload_tensors(one, arena)
    kept = arena.resident_views  # a sweep builds a new dict: the same one means no sweep ran
    for _ in range(5):  # each sweep would read all 2001 records and drop none
        offload_tensors(one, arena)
        reload_tensors(one, arena)
    assert arena.resident_views is kept and len(kept) == 2001


def test_a_reload_regrows_the_storages_ahead_first_and_largest_first_among_them():
    # a model's weights and its optimizer's state of the same shapes: by size alone the two interleave, and after a
    # flush each shared segment then holds some of both (a sync exports every segment that holds a weight)
    weights = [(f"w{i}", random_tensor((256 * size, 8), torch.float32, seed=i)) for i, size in enumerate((1, 4, 2, 3))]
    states = [
        (f"s{i}", random_tensor((256 * size, 8), torch.float32, seed=10 + i)) for i, size in enumerate((1, 4, 2, 3))
    ]
    key = {name: tensor.untyped_storage()._cdata for name, tensor in weights + states}
    before = {name: storage_bytes(tensor) for name, tensor in weights + states}
    arena = HostArena()
    orders = {}
    for ahead in (None, weights):
        offload_tensors(weights + states, arena)
        with CopyOrder() as order:
            reload_tensors(weights + states, arena, ahead=ahead)
        names = {storage: name for name, storage in key.items()}
        orders[ahead is not None] = [names[storage] for storage in order.written if storage in names]
        assert {name: storage_bytes(tensor) for name, tensor in weights + states} == before
    assert orders[False] == ["w1", "s1", "w3", "s3", "w2", "s2", "w0", "s0"]  # (what the weights' own order fixes)
    assert orders[True] == ["w1", "w3", "w2", "w0", "s1", "s3", "s2", "s0"]
    with pytest.raises(InvalidInput, match="'ahead\\[0\\]' is a str"):
        reload_tensors(weights + states, arena, ahead=["w0"])
