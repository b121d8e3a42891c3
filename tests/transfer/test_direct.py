"""Direct mode: the receiver reads each weight where the sender's tensors lie (the sender's own allocations,
exported once a session), one copy per byte; what cannot go direct goes through the bucket, and says why.

On the CPU: the fallback (shm has no direct reads) and a hostile direct frame; the rest on the GPU."""

from __future__ import annotations

import time

import pytest
import torch

from refitkit.engines import FreshWeights, HeldWeights
from refitkit.errors import InvalidInput, ProtocolError, TransferError, TransferTimeout
from refitkit.transfer import BucketedWeightSender
from refitkit.transfer._ipc import sender as sender_module
from refitkit.transfer.protocol import MAX_EXPORTS, direct_fields, entries_from_wire
from tests.transfer.harness import Case, assert_device_memory_back, device_free_bytes, receiver_killed_at, roundtrip
from tests.transfer.peers import cuda_allocator_expandable, digest
from tests.transfer.test_hostile_peer import bucket_frame, run_rogue_sender

pytestmark = pytest.mark.timeout(120)

CUDA_IPC = Case("cuda_ipc", "cuda", "cuda")
KIB, MIB = 1 << 10, 1 << 20


def weights_on(device: str) -> list[tuple[str, torch.Tensor]]:
    torch.manual_seed(0)
    return [(f"w{i}", torch.randn(64 + i, 96, device=device).to(torch.bfloat16)) for i in range(6)]


# -- on the CPU -------------------------------------------------------------------------------------


def test_direct_over_shm_sends_everything_through_the_bucket_and_says_why(receiver_server, endpoint):
    weights = weights_on("cpu")
    _, result = roundtrip(receiver_server, endpoint, weights, direct=True)
    split = result["split"]
    assert (split.direct_tensors, split.bucket_tensors, split.allocations) == (0, len(weights), 0)
    assert split.bucket_bytes == sum(tensor.nbytes for _, tensor in weights)
    assert split.bucket_reasons == {"the session's transport is not cuda_ipc": len(weights)}


def test_without_direct_the_sender_reports_no_split(receiver_server, endpoint):
    _, result = roundtrip(receiver_server, endpoint, weights_on("cpu"))
    assert result["split"] is None


def _entries(*items: list) -> list:
    return entries_from_wire(list(items), capacity=1 << 40)


@pytest.mark.parametrize(
    "direct, entries, sizes, message",
    [
        pytest.param([1], _entries(["w", "float32", [4], 0]), [], r"is not a map", id="not-a-map"),
        pytest.param({"exports": [], "allocs": []}, [], [MIB], r"\(0 entries, 1 to 512\)", id="no-entries"),
        pytest.param(
            {"exports": [], "allocs": []},
            _entries(["w", "float32", [4], 0]),
            [MIB],
            r"one allocation per entry",
            id="allocs-missing",
        ),
        pytest.param(
            {"exports": [], "allocs": [1]},
            _entries(["w", "float32", [4], 0]),
            [MIB],
            r"'w' lies in allocation 1; 1 are",
            id="index-out-of-range",
        ),
        pytest.param(
            {"exports": [], "allocs": [True]},
            _entries(["w", "float32", [4], 0]),
            [MIB],
            r"allocation True",
            id="index-not-int",
        ),
        pytest.param(
            {"exports": [], "allocs": [0]},
            _entries(["w", "float32", [128], MIB - 256]),
            [MIB],
            r"'w' \(bytes 1048320\.\.1048832\) is not a whole tensor inside allocation 0 of 1048576 bytes",
            id="beyond",
        ),
        pytest.param(
            {"exports": [], "allocs": [0]},
            _entries(["w", "float32", [4], 0, 0, 8]),
            [MIB],
            r"not a whole tensor",
            id="split-piece",
        ),
        pytest.param(
            {"exports": [{"nbytes": 0}], "allocs": [0]},
            _entries(["w", "float32", [4], 0]),
            [],
            r"announces no size",
            id="export-without-size",
        ),
        pytest.param(
            {"exports": [{"nbytes": 4096}] * 2, "allocs": [0]},
            _entries(["w", "float32", [4], 0]),
            [MIB] * (MAX_EXPORTS - 1),
            r"1025 exported allocations in one session, at most 1024",
            id="too-many-exports",
        ),
        pytest.param(
            {"exports": [], "allocs": [0], "kept": 1},
            _entries(["w", "float32", [4], 0]),
            [MIB],
            r"kept=1 is not a bool",
            id="kept-not-bool",
        ),
    ],
)
def test_a_hostile_direct_bucket_is_refused_before_anything_is_mapped(direct, entries, sizes, message):
    with pytest.raises(ProtocolError, match=message):
        direct_fields(direct, entries=entries, sizes=sizes)


def _layers(allocation_bytes: int, *, layers: int, moved: int | None = None) -> list[tuple[str, str, tuple, int, int]]:
    """(name, wire dtype, shape, allocation, byte offset) of weights laid out as a reload leaves them: each layer's
    tensors one after the other (aligned), every layer alike, gate and up of one shape; then a tensor of its own,
    and one in a second allocation. ``moved``: that layer's up projection lies elsewhere (after everything else)."""
    shapes = [
        ("q", "bfloat16", (16, 32)),
        ("gate", "bfloat16", (24, 32)),
        ("up", "bfloat16", (24, 32)),
        ("norm", "float32", (32,)),
    ]
    placed, at = [], 0
    for layer in range(layers):
        for role, dtype, shape in shapes:
            nbytes = torch.Size(shape).numel() * (2 if dtype == "bfloat16" else 4)
            if role == "up" and layer == moved:
                continue
            placed.append((f"layers.{layer}.{role}", dtype, shape, 0, at))
            at += -(-nbytes // 256) * 256
    if moved is not None:
        placed.insert(4 * moved + 2, (f"layers.{moved}.up", "bfloat16", (24, 32), 0, at))
        at += 24 * 32 * 2
    placed.append(("head", "float32", (7, 9), 0, -(-at // 256) * 256))
    placed.append(("other", "bfloat16", (5, 3), 1, 512))
    assert max(offset for *_, offset in placed) + 4096 < allocation_bytes
    return placed


def _plan_of(placed, announced: list[int]):
    from refitkit.transfer._ipc.receiver import _DirectPlan  # the receiver's layout of a direct bucket
    from refitkit.transfer.protocol import entry_to_wire

    raw = [entry_to_wire(name, dtype, list(shape), offset) for name, dtype, shape, _, offset in placed]
    raw_allocs = [index for *_, index, _ in placed]
    entries = entries_from_wire(raw, capacity=1 << 40)
    _, allocs = direct_fields({"exports": [], "allocs": raw_allocs}, entries=entries, sizes=announced)
    return _DirectPlan(raw, raw_allocs, announced, entries, allocs), raw, raw_allocs


def test_a_direct_buckets_plan_makes_every_view_where_its_bytes_lie_and_fits_only_that_bucket():
    # The receiver lays a direct bucket out once: evenly spaced runs of one shape (gate and up interleaved) become
    # one strided view each, split by unbind; here over CPU bytes standing for two mapped allocations.
    torch.manual_seed(0)
    allocations = [
        torch.randint(0, 256, (1 << 16,), dtype=torch.uint8),
        torch.randint(0, 256, (4096,), dtype=torch.uint8),
    ]
    announced = [len(allocation) for allocation in allocations]
    for moved in (None, 1):
        placed = _layers(announced[0], layers=3, moved=moved)
        plan, raw, raw_allocs = _plan_of(placed, announced)
        views = plan.views(allocations)
        assert [name for name, _ in views] == [name for name, *_ in placed]  # the bucket's order
        for (name, tensor), (_, dtype, shape, index, offset) in zip(views, placed):
            source = allocations[index][offset : offset + tensor.nbytes]
            assert tensor.dtype == getattr(torch, dtype) and tuple(tensor.shape) == shape and tensor.is_contiguous(), (
                name
            )
            assert tensor.data_ptr() == source.data_ptr(), name  # a view of the mapped bytes, not a copy
            assert torch.equal(tensor.reshape(-1).view(torch.uint8), source), name
        # evenly laid out: q, gate, up (interleaved with gate), norm one run each; head and other their own views
        assert len(plan.runs) == 6 if moved is None else 6 < len(plan.runs) < len(placed)
        assert plan.nbytes == sum(tensor.nbytes for _, tensor in views)
        assert plan.fits([list(entry) for entry in raw], list(raw_allocs), list(announced))  # equal, as decoded anew
    shifted = [[*entry[:3], entry[3] + 256] if entry[0] == "head" else entry for entry in raw]
    assert not plan.fits(shifted, raw_allocs, announced)
    assert not plan.fits(raw, [0] * len(raw_allocs), announced)
    assert not plan.fits(raw, raw_allocs, [announced[0], announced[1] + 256])


def test_plans_belong_to_their_receiver_channel_a_new_channel_starts_with_none_and_close_drops_them():
    from refitkit.transfer import BucketedWeightReceiver

    with BucketedWeightReceiver("plans-a", "cpu") as first:
        first._plans[0] = "a plan"  # (what a direct sync leaves: the channel's next sync reuses it)
        with BucketedWeightReceiver("plans-a", "cpu") as second:  # another channel on the same endpoint
            assert second._plans == {} and second._plans is not first._plans
    assert first._plans == {}


def test_a_direct_bucket_in_an_shm_session_fails_the_receiver_cleanly(endpoint):
    direct = {"exports": [{"ipc_handle": b"\0" * 64, "nbytes": 4096, "device_uuid": "GPU-x"}], "allocs": [0]}
    raised, message, seconds, replies = run_rogue_sender(
        endpoint, {}, [bucket_frame([["w", "float32", [4], 0]], direct=direct)]
    )
    assert raised is ProtocolError and "a direct bucket in a session whose transport is not cuda_ipc" in message, (
        message
    )
    assert seconds < 2.0
    assert any(reply["kind"] == "error" and "direct bucket" in reply["message"] for reply in replies), replies


# -- on the GPU -------------------------------------------------------------------------------------


def exportable_memory() -> None:
    """Skip a test that needs the allocator's memory exportable (not so under expandable_segments:True)."""
    if cuda_allocator_expandable():
        pytest.skip("expandable_segments:True: torch's memory cannot be exported (tested by the fallback test)")


def _allocations(tensors: list[torch.Tensor]) -> int:
    """How many of the caching allocator's segments hold these tensors."""
    found = set()
    for segment in torch.cuda.memory_snapshot():
        start, size = segment["address"], segment["total_size"]
        found.update(start for t in tensors if start <= t.data_ptr() < start + size)
    return len(found)


@pytest.mark.cuda
def test_a_list_goes_direct_bit_exact_each_allocation_exported_once_and_nothing_kept(receiver_server, endpoint):
    exportable_memory()
    weights = weights_on("cuda") + [(f"big{i}", torch.randn(1024, 1024 + i, device="cuda")) for i in range(3)]
    roundtrip(
        receiver_server, endpoint, weights, case=CUDA_IPC, direct=True, mode="copy"
    )  # the receiver's CUDA context
    reserved, free = torch.cuda.memory_reserved(), device_free_bytes()
    _, result = roundtrip(receiver_server, endpoint, weights, case=CUDA_IPC, direct=True, mode="copy")
    split = result["split"]
    assert (split.direct_tensors, split.bucket_tensors, split.bucket_reasons) == (len(weights), 0, {})
    assert split.direct_bytes == sum(tensor.nbytes for _, tensor in weights)
    assert split.allocations == _allocations([tensor for _, tensor in weights])
    assert not {"early_bucket", "late_bucket"} & set(result["timings"])  # nothing needed the bucket: none was allocated
    assert (
        torch.cuda.memory_reserved() == reserved
    )  # the trainer's memory stayed the trainer's: nothing new, nothing lost
    assert_device_memory_back(free, "a direct sync")  # the receiver closed every mapping; the bucket was freed


@pytest.mark.cuda
@pytest.mark.parametrize("count", [128, 130])  # a whole number of direct buckets, and one more partial
def test_iter_weights_over_an_all_direct_stream_hands_out_every_tensor(receiver_server, endpoint, count):
    # a plain for loop keeps its last tensor referenced while the stream ends: the last bucket must be a real one
    exportable_memory()
    weights = [(f"w{i}", torch.full((1024,), float(i), device="cuda")) for i in range(count)]
    _, result = roundtrip(receiver_server, endpoint, weights, case=CUDA_IPC, direct=True, mode="iter")
    assert result["split"].direct_tensors == count and "late_bucket" not in result["timings"]


@pytest.mark.cuda
def test_under_expandable_segments_weights_go_through_the_bucket_saying_why(receiver_server, endpoint):
    """With PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (run the suite so), torch maps its memory through the
    driver's virtual-memory calls, which CUDA IPC cannot export: every weight takes the bucket, the reason named."""
    if not cuda_allocator_expandable():
        pytest.skip("the suite runs without expandable_segments:True (run it again with that PYTORCH_CUDA_ALLOC_CONF)")
    weights = weights_on("cuda")
    _, result = roundtrip(receiver_server, endpoint, weights, case=CUDA_IPC, direct=True)
    split = result["split"]
    assert (split.direct_tensors, split.bucket_tensors, split.allocations) == (0, len(weights), 0)
    [reason] = split.bucket_reasons
    assert reason.startswith("cuIpcGetMemHandle refused its allocation"), reason


@pytest.mark.cuda
def test_a_modules_parameters_go_direct_and_a_plain_generator_through_the_bucket(receiver_server, endpoint):
    exportable_memory()
    module = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 64)).cuda()
    expected = {name: digest(param) for name, param in module.named_parameters()}
    _, result = roundtrip(
        receiver_server, endpoint, module.named_parameters(), case=CUDA_IPC, direct=True, expected=expected
    )
    assert result["split"].direct_tensors == 4 and result["split"].bucket_tensors == 0
    _, result = roundtrip(
        receiver_server, endpoint, list(module.named_parameters()), case=CUDA_IPC, direct=True, generator=True
    )
    split = result["split"]
    assert split.direct_tensors == 0 and split.bucket_tensors == 4
    assert list(split.bucket_reasons) == [
        "the source's tensors may change or die while it is sent (a generator other than a module's or dict's, "
        "or an adapter's HeldWeights / FreshWeights)"
    ]


def _gathered(weights: list[tuple[str, torch.Tensor]], *, alive: list[int], return_cache: bool = False) -> FreshWeights:
    """Each weight cloned as it is yielded, as an FSDP2 gather makes it: a new tensor nothing else holds. ``alive``
    gets torch's allocated bytes before each clone (what the sender still keeps); ``return_cache``: return the
    allocator's free segments to the driver before each clone (those of tensors the sender let go)."""

    def gather():
        for name, tensor in weights:
            if return_cache:
                torch.cuda.empty_cache()
            alive.append(torch.cuda.memory_allocated())
            yield name, tensor.clone()

    return FreshWeights(gather())


def _send_gathered(server, endpoint: str, weights: list, *, bucket_bytes: int, return_cache: bool = False):
    """``weights`` gathered afresh through a default (direct) sender into a copying receiver; (split, timings, alive)."""
    expected = {name: digest(tensor) for name, tensor in weights}
    alive: list[int] = []
    with BucketedWeightSender(endpoint, bucket_bytes=bucket_bytes, transport="cuda_ipc", timeout_s=20.0) as sender:
        server.start_session(endpoint, device="cuda", timeout_s=20.0, mode="copy")
        sender.send(_gathered(weights, alive=alive, return_cache=return_cache))
    result = server.result()
    assert result["ok"], result
    assert result["digests"] == expected
    assert result["segments_after"] == []
    return sender.last_split, dict(sender.last_timings_s), alive


@pytest.mark.cuda
def test_gathered_tensors_go_direct_each_kept_only_until_the_receiver_read_it(receiver_server, endpoint):
    exportable_memory()
    torch.manual_seed(0)
    weights = [(f"w{i}", torch.randn(8 * MIB, device="cuda")) for i in range(48)]  # 32 MiB each, 1.5 GiB in all
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    split, timings, alive = _send_gathered(receiver_server, endpoint, weights, bucket_bytes=256 * MIB)
    assert (split.direct_tensors, split.bucket_tensors, split.bucket_reasons) == (48, 0, {})
    assert "late_bucket" not in timings  # no tensor needed the bucket: none was allocated
    # direct buckets of 64 MiB (a quarter of bucket_bytes), two in flight and one filling: never all 1.5 GiB at once
    assert max(alive) - baseline <= 256 * MIB, (
        f"{(max(alive) - baseline) / MIB:.0f} MiB of gathered tensors alive at once"
    )
    assert torch.cuda.memory_allocated() == baseline  # every gathered tensor let go


@pytest.mark.cuda
def test_an_allocation_returned_during_the_sync_and_made_again_at_its_address_is_exported_anew(
    receiver_server, endpoint
):
    exportable_memory()
    # 32 MiB each: one segment per gathered tensor; the allocator returns a read one's segment before the next clone,
    # and the driver tends to hand its address out again: the receiver must not read the new one through the old mapping
    weights = [(f"w{i}", torch.full((8 * MIB,), float(i), device="cuda")) for i in range(24)]
    split, _, _ = _send_gathered(receiver_server, endpoint, weights, bucket_bytes=128 * MIB, return_cache=True)
    assert (split.direct_tensors, split.bucket_tensors) == (24, 0)
    assert split.replaced_allocations >= 1, split  # the case this test is about did happen


@pytest.mark.cuda
def test_unaligned_views_and_allocations_past_the_limit_go_through_the_bucket(receiver_server, endpoint, monkeypatch):
    exportable_memory()
    monkeypatch.setattr(sender_module, "DIRECT_MAX_ALLOCATIONS", 2)
    flat = torch.randn(3 * MIB, device="cuda")  # one allocation: its aligned views go direct, the odd one does not
    others = [torch.randn(3 * MIB + 1024 * i, device="cuda") for i in range(3)]  # three more (12 MiB: one segment each)
    weights = [("a", flat[:MIB]), ("b", flat[MIB : 2 * MIB]), ("odd", flat[2 * MIB + 1 : 2 * MIB + 65])]
    weights += [(f"o{i}", tensor) for i, tensor in enumerate(others)]
    _, result = roundtrip(receiver_server, endpoint, weights, case=CUDA_IPC, direct=True, bucket_bytes=64 * MIB)
    split = result["split"]
    assert split.allocations == 2 and split.direct_tensors == 3  # a, b (one export) and o0 (the second)
    assert "late_bucket" in result["timings"]  # the bucket came when the odd view needed it, announced with its frame
    assert split.bucket_reasons == {
        "its bytes are not 256-byte aligned (a view into a larger tensor)": 1,
        "its allocation would be export number 3 of at most 2": 2,
    }


@pytest.mark.cuda
def test_a_late_bucket_that_cannot_be_allocated_aborts_the_session_and_the_receiver_hears_why(
    receiver_server, endpoint, monkeypatch
):
    exportable_memory()
    weights = weights_on("cuda")
    flat = torch.randn(MIB, device="cuda")
    weights.append(("odd", flat[1:1001]))  # the last one needs the bucket, after six went direct

    def device_full(self, nbytes, *, device):
        raise TransferError(f"cuMemAlloc({nbytes} bytes) failed: CUDA error 2 (out of memory)")

    monkeypatch.setattr(sender_module.cuda_ipc.CudaIpcBucket, "__init__", device_full)
    monkeypatch.setattr(sender_module, "DIRECT_SHIP_TENSORS", 2)  # the six direct ones ship before the odd one
    reserved = torch.cuda.memory_reserved()
    with BucketedWeightSender(
        endpoint, bucket_bytes=4 * MIB, transport="cuda_ipc", timeout_s=10.0, direct=True
    ) as sender:
        receiver_server.start_session(endpoint, device="cuda", timeout_s=10.0)
        with pytest.raises(TransferError, match=r"cuMemAlloc\(\d+ bytes\) failed"):
            sender.send(weights)
    result = receiver_server.result()
    assert not result["ok"] and "aborted the session" in result["message"] and "cuMemAlloc" in result["message"], result
    assert result["segments_after"] == []
    assert torch.cuda.memory_reserved() == reserved


@pytest.mark.cuda
def test_direct_buckets_and_bucket_halves_in_flight_together_land_bit_exact(receiver_server, endpoint):
    exportable_memory()
    # aligned tensors (direct) alternate with odd views (through a small bucket): up to two direct buckets and
    # both halves are in flight at once, and the receiver takes them in order
    flat = torch.randn(4 * MIB, device="cuda")
    weights = []
    for i in range(200):
        weights.append((f"d{i}", torch.randn(4096 + i, device="cuda")))
        weights.append((f"odd{i}", flat[i * 4096 + 1 : i * 4096 + 1 + 3000]))
    for _ in range(2):
        _, result = roundtrip(receiver_server, endpoint, weights, case=CUDA_IPC, direct=True, bucket_bytes=64 * KIB)
        split = result["split"]
        assert (split.direct_tensors, split.bucket_tensors) == (200, 200)


@pytest.mark.cuda
@pytest.mark.timeout(120)
def test_a_receiver_killed_mid_direct_sync_times_the_sender_out_and_the_weights_stay_intact(endpoint):
    # 1100 tensors of 64 KiB: 18 direct buckets (64 entries each) over ~35 of the small pool's 2 MiB segments
    weights = [(f"w{i}", torch.full((16 * KIB,), float(i), device="cuda")) for i in range(1100)]
    expected = [tensor.clone() for _, tensor in weights]
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved()
    with receiver_killed_at(endpoint, 2, device="cuda", timeout_s=5.0):
        with BucketedWeightSender(
            endpoint, bucket_bytes=64 * MIB, transport="cuda_ipc", timeout_s=5.0, direct=True
        ) as sender:
            began = time.monotonic()
            with pytest.raises(TransferTimeout):
                sender.send(weights)
            assert time.monotonic() - began < 5.0 + 2.0
    assert all(torch.equal(tensor, before) for (_, tensor), before in zip(weights, expected))  # nothing wrote into them
    assert torch.cuda.memory_reserved() == reserved  # the sender allocated nothing of torch's, and freed its bucket


def _segments() -> list[torch.Tensor]:
    """Two allocations a model's weights lie in (``_layers``), as a reload leaves them."""
    return [
        torch.empty(1 * MIB, dtype=torch.uint8, device="cuda"),
        torch.empty(4 * KIB, dtype=torch.uint8, device="cuda"),
    ]


def _laid_out(segments: list[torch.Tensor], moved: int | None = None) -> list[tuple[str, torch.Tensor]]:
    """``_layers``' 50 weights as views of ``segments``, given new values."""
    weights = []
    for name, dtype, shape, index, offset in _layers(segments[0].numel(), layers=12, moved=moved):
        nbytes = torch.Size(shape).numel() * (2 if dtype == "bfloat16" else 4)
        tensor = segments[index][offset : offset + nbytes].view(getattr(torch, dtype)).view(shape)
        weights.append((name, tensor.normal_()))
    return weights


@pytest.mark.cuda
def test_a_receiver_lays_out_a_held_models_buckets_once_and_anew_only_where_they_changed(
    receiver_server, endpoint, monkeypatch
):
    exportable_memory()
    monkeypatch.setattr(sender_module, "DIRECT_SHIP_TENSORS", 16)  # 50 weights: four direct buckets
    segments = _segments()

    # the same layout twice (new values), then layer 8's up projection elsewhere: bucket 2 changes (bucket 3, the
    # head and the other allocation's tensor, lies where it lay)
    with BucketedWeightSender(endpoint, transport="cuda_ipc", timeout_s=20.0) as sender:
        receiver_server.start_session(endpoint, device="cuda", timeout_s=20.0, mode="repeat", arg=3)
        expected = []
        for moved in (None, None, 8):
            weights = _laid_out(segments, moved)
            expected.append({name: digest(tensor) for name, tensor in weights})
            sender.send(weights)
            assert sender.last_split.direct_tensors == len(weights) == 50
    result = receiver_server.result()
    assert result["ok"], result
    sessions = result["sessions"]
    assert [session["digests"] for session in sessions] == expected  # bit-exact each time, new values included
    first, second, third = (session["plans"] for session in sessions)
    assert sorted(first) == [0, 1, 2, 3]
    assert second == first  # laid out once: the next session's buckets came as they were
    assert [third[seq] == second[seq] for seq in range(4)] == [True, True, False, True]
    assert result["segments_after"] == []


def _digests(weights) -> dict:
    return {name: digest(tensor) for name, tensor in weights}


@pytest.mark.cuda
def test_a_held_sources_syncs_land_bit_exact_however_its_stream_changes_between_them(
    receiver_server, endpoint, monkeypatch
):
    exportable_memory()
    monkeypatch.setattr(sender_module, "DIRECT_SHIP_TENSORS", 16)  # 50 weights: four direct buckets
    segments = _segments()
    extra = segments[1][1024:1280].view(torch.float32)

    def moved(count: int = 50) -> list:  # layer 8's up projection (item 34) elsewhere; new values
        return _laid_out(segments, moved=8)[:count]

    def renamed() -> list:
        weights = moved(47) + [("extra", extra)]
        weights[10] = ("renamed", weights[10][1])
        return weights

    def retyped() -> list:
        weights = renamed()
        weights[20] = (weights[20][0], weights[20][1].view(torch.float16))  # the same bytes seen as another dtype
        return weights

    def reshaped() -> list:
        weights = retyped()
        weights[25] = (weights[25][0], weights[25][1].reshape(-1))  # the same bytes seen in another shape
        return weights

    # each session against the one before it: new values where they lay, then a weight moved, a shorter and a
    # longer stream, a weight renamed, retyped, reshaped, and items as [name, tensor] lists
    sessions = [
        lambda: _laid_out(segments),
        lambda: _laid_out(segments),
        moved,
        lambda: moved(47),
        lambda: moved(47) + [("extra", extra.normal_())],
        renamed,
        retyped,
        lambda: [list(item) for item in retyped()],
        reshaped,
    ]
    with BucketedWeightSender(endpoint, transport="cuda_ipc", timeout_s=20.0) as sender:
        receiver_server.start_session(endpoint, device="cuda", timeout_s=20.0, mode="repeat", arg=len(sessions))
        expected = []
        for make in sessions:
            weights = make()
            expected.append(_digests(weights))
            sender.send(HeldWeights(iter(weights)))
            split = sender.last_split
            assert (split.direct_tensors, split.bucket_tensors) == (len(weights), 0) and split.allocations > 0
    result = receiver_server.result()
    assert result["ok"], result
    assert [session["digests"] for session in result["sessions"]] == expected  # bit-exact every time
    plans = [session["plans"] for session in result["sessions"]]
    assert plans[1] == plans[0]  # the buckets went as they went before: the receiver's plans fit them
    assert result["segments_after"] == []


@pytest.mark.cuda
@pytest.mark.parametrize(
    "bad, error",
    [
        pytest.param(("layers.0.gate", None), r"duplicate tensor name 'layers.0.gate'", id="duplicate-name"),
        pytest.param(("layers.7.up", "not a tensor"), r"'layers.7.up' is a str, not a torch.Tensor", id="not-a-tensor"),
        pytest.param("no pair", r"weights item #30 is a str, not a \(name, tensor\) pair", id="not-a-pair"),
    ],
)
def test_a_bad_item_in_a_held_sources_next_sync_is_refused_as_in_its_first(receiver_server, endpoint, bad, error):
    exportable_memory()
    segments = _segments()
    with BucketedWeightSender(endpoint, transport="cuda_ipc", timeout_s=20.0) as sender:
        receiver_server.start_session(endpoint, device="cuda", timeout_s=20.0, mode="copy")
        sender.send(HeldWeights(iter(_laid_out(segments))))
        assert receiver_server.result()["ok"]
        weights = _laid_out(segments)
        if bad[1] is None:  # a name the stream had already: the tensor at item 30's own place
            bad = (bad[0], weights[30][1])
        receiver_server.start_session(endpoint, device="cuda", timeout_s=20.0, mode="copy")
        with pytest.raises(InvalidInput, match=error):
            sender.send(HeldWeights(iter(weights[:30] + [bad] + weights[31:])))
        assert sender.last_split is None
        result = receiver_server.result()
        assert not result["ok"] and "aborted the session" in result["message"], result
        assert result["segments_after"] == []
        weights = _laid_out(segments)  # and the next sync lands whole
        receiver_server.start_session(endpoint, device="cuda", timeout_s=20.0, mode="copy")
        sender.send(HeldWeights(iter(weights)))
        result = receiver_server.result()
        assert result["ok"] and result["digests"] == _digests(weights), result


@pytest.mark.cuda
def test_a_next_sync_over_an_allocation_made_anew_at_its_address_reads_the_new_one(receiver_server, endpoint):
    exportable_memory()
    # an offload and reload between two syncs: the weights' allocation freed, then made again where it lay, with the
    # same layout; the new allocation must be exported anew (the old one's handle maps nothing of it)
    segments = _segments()
    address = segments[0].data_ptr()
    with BucketedWeightSender(endpoint, transport="cuda_ipc", timeout_s=20.0) as sender:
        receiver_server.start_session(endpoint, device="cuda", timeout_s=20.0, mode="repeat", arg=2)
        sender.send(HeldWeights(iter(_laid_out(segments))))
        segments = None
        torch.cuda.empty_cache()  # (the allocator returns the segment to the driver)
        segments = _segments()
        assert segments[0].data_ptr() == address  # the case this test is about did happen
        weights = _laid_out(segments)
        sender.send(HeldWeights(iter(weights)))
        assert sender.last_split.direct_tensors == len(weights) == 50
    result = receiver_server.result()
    assert result["ok"], result
    assert result["sessions"][1]["digests"] == _digests(weights)


def _moved(segments: list[torch.Tensor]) -> list:  # item 34, layer 8's up projection, lies elsewhere
    return _laid_out(segments, moved=8)


def _reshaped(segments: list[torch.Tensor]) -> list:  # item 20, layer 5's q, the same bytes seen in another shape
    weights = _laid_out(segments)
    weights[20] = (weights[20][0], weights[20][1].reshape(-1))
    return weights


@pytest.mark.cuda
@pytest.mark.parametrize("change, differs_at", [(_moved, 34), (_reshaped, 20)], ids=["moved", "reshaped"])
def test_a_bad_item_after_a_changed_layout_is_refused_naming_it(receiver_server, endpoint, change, differs_at):
    exportable_memory()
    segments = _segments()
    with BucketedWeightSender(endpoint, transport="cuda_ipc", timeout_s=20.0) as sender:
        receiver_server.start_session(endpoint, device="cuda", timeout_s=20.0, mode="repeat", arg=3)
        expected = []
        for make in (_laid_out, change, _laid_out):
            weights = make(segments)
            expected.append(_digests(weights))
            sender.send(HeldWeights(iter(weights)))
        result = receiver_server.result()
        assert result["ok"] and [session["digests"] for session in result["sessions"]] == expected, result
        # the changed stream again, after the layout before it, with item 40 named as item 3 (after the item where
        # the layouts differ) was: refused as in any sync
        weights = change(segments)
        assert weights[3][0] == "layers.0.norm" and differs_at < 40
        weights[40] = ("layers.0.norm", weights[40][1])
        receiver_server.start_session(endpoint, device="cuda", timeout_s=20.0, mode="copy")
        with pytest.raises(InvalidInput, match=r"duplicate tensor name 'layers.0.norm'"):
            sender.send(HeldWeights(iter(weights)))
        assert sender.last_split is None
        result = receiver_server.result()
        assert not result["ok"] and "aborted the session" in result["message"], result
        assert result["segments_after"] == []
        weights = change(segments)  # and the next sync lands whole
        receiver_server.start_session(endpoint, device="cuda", timeout_s=20.0, mode="copy")
        sender.send(HeldWeights(iter(weights)))
        result = receiver_server.result()
        assert result["ok"] and result["digests"] == _digests(weights), result


@pytest.mark.cuda
def test_syncs_with_and_without_a_tensor_through_the_bucket_land_bit_exact_in_turn(receiver_server, endpoint):
    exportable_memory()
    segments = _segments()

    def strided() -> list:  # item 12 as a transposed view: not contiguous, so it goes through the bucket
        weights = _laid_out(segments)
        weights[12] = (weights[12][0], weights[12][1].t())
        return weights

    # (what each sync sends, tensors through the bucket)
    sessions = [
        (lambda: _laid_out(segments), 0),
        (strided, 1),
        (lambda: _laid_out(segments), 0),
        (lambda: _laid_out(segments), 0),
    ]
    with BucketedWeightSender(endpoint, bucket_bytes=4 * MIB, transport="cuda_ipc", timeout_s=20.0) as sender:
        receiver_server.start_session(endpoint, device="cuda", timeout_s=20.0, mode="repeat", arg=len(sessions))
        expected, splits = [], []
        for make, _ in sessions:
            weights = make()
            expected.append(_digests(weights))
            sender.send(HeldWeights(iter(weights)))
            split = sender.last_split
            splits.append((split.bucket_tensors, split.direct_tensors + split.bucket_tensors))
    result = receiver_server.result()
    assert result["ok"], result
    assert [session["digests"] for session in result["sessions"]] == expected  # bit-exact every time
    assert splits == [(through, 50) for _, through in sessions]
    assert result["segments_after"] == []
