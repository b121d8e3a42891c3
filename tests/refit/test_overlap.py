"""RefitCycle(overlap=True): the optimizer state leaves while the weights stream; training stays bit-identical,
failures keep the phase all-or-nothing, and every phase and bucket is a profiler range.

One rank (no torch.distributed), a real sender and a real receiver (a thread here, over shm).
"""

from __future__ import annotations

import threading
import uuid

import pytest
import torch
from torch import nn

from refitkit.engines import DeviceState
from refitkit.engines.fsdp import FSDPAdapter
from refitkit.errors import InvalidInput, TransferError
from refitkit.offload import HostArena
from refitkit.refit import RefitCycle
from refitkit.transfer import BucketedWeightReceiver, BucketedWeightSender

pytestmark = pytest.mark.timeout(120)

PHASES = ["sync_weights", "offload", "flush_device", "barrier"]


def _model(device: str = "cpu", width: int = 48) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, width), nn.Tanh(), nn.Linear(width, 32)).to(device)
    model.register_buffer("scale", torch.full((32,), 0.5, device=device))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    optimizer.zero_grad(set_to_none=True)
    batch = torch.randn(8, 32, generator=gen).to(model.scale.device)
    (model(batch) * model.scale).square().mean().backward()
    optimizer.step()


class _Peer:
    """A receiver thread that copies every tensor into its own params (what an inference engine does)."""

    def __init__(self, endpoint: str) -> None:
        self.weights: dict[str, torch.Tensor] = {}
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(endpoint,), daemon=True)
        self.thread.start()

    def _run(self, endpoint: str) -> None:
        def load(batch, is_last):
            for name, tensor in batch:
                mine = self.weights.get(name)
                if mine is None:
                    self.weights[name] = mine = torch.empty_like(tensor)
                mine.copy_(tensor)

        try:
            BucketedWeightReceiver(endpoint, "cpu", timeout_s=30.0).receive(load)
        except BaseException as error:  # noqa: BLE001 - checked by the test
            self.error = error

    def join(self) -> None:
        self.thread.join(30.0)
        assert not self.thread.is_alive() and self.error is None, self.error


def _rounds(overlap: bool, keep_grads: bool, rounds: int = 2, device: str = "cpu", width: int = 48) -> dict:
    model, optimizer = _model(device, width)
    _train(model, optimizer, 0)
    adapter = FSDPAdapter(model, optimizer, arena=HostArena(pin_memory=False), keep_grads=keep_grads)
    endpoint = f"overlap-{uuid.uuid4().hex[:8]}"
    sender = BucketedWeightSender(endpoint, bucket_bytes=8 << 10, transport="shm", timeout_s=30.0)
    cycle = RefitCycle(adapter, sender, overlap=overlap)
    out: dict = {"received": [], "phases": [], "offload_bytes": [], "states": []}
    try:
        for step in range(1, rounds + 1):
            expected = {
                name: t.to("cpu", copy=True) for name, t in adapter.named_weights()
            }  # the peer receives on the CPU
            peer = _Peer(endpoint)
            report = cycle.refit(step)
            peer.join()
            out["received"].append(
                sorted(peer.weights) == sorted(expected)
                and all(torch.equal(peer.weights[n], expected[n]) for n in expected)
            )
            out["phases"].append([p.name for p in report.phases])
            out["offload_bytes"].append(report.phase("offload").bytes)
            out["states"].append((adapter.part_states, adapter.state_bytes().device_bytes))
            cycle.resume(step)
            _train(model, optimizer, step)  # no synchronize before the next refit: the side stream must wait
    finally:
        sender.close()
        cycle.close()
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["state"] = [t.clone() for s in optimizer.state.values() for t in s.values()]
    return out


@pytest.mark.parametrize("keep_grads", [False, True])
def test_overlap_keeps_training_bit_identical_and_offloads_the_same_bytes(keep_grads):
    on, off = _rounds(True, keep_grads), _rounds(False, keep_grads)
    assert on["received"] == off["received"] == [True, True]
    assert on["phases"] == off["phases"] == [PHASES, PHASES]
    assert on["offload_bytes"] == off["offload_bytes"] and on["offload_bytes"][0] > 0
    offloaded = DeviceState.OFFLOADED
    for states, device_bytes in on["states"]:
        assert (states.model, states.optimizer, states.grad, device_bytes) == (offloaded, offloaded, offloaded, 0)
    assert all(torch.equal(on["params"][n], off["params"][n]) for n in off["params"])
    assert all(torch.equal(a, b) for a, b in zip(on["state"], off["state"], strict=True))


@pytest.mark.cuda
@pytest.mark.parametrize("keep_grads", [False, True])
def test_overlap_on_a_gpu_copies_what_the_step_wrote_and_trains_bit_identical(keep_grads):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    on = _rounds(True, keep_grads, rounds=3, device="cuda", width=4096)  # 2 x 0.5 MiB weights: copies take time
    off = _rounds(False, keep_grads, rounds=3, device="cuda", width=4096)
    assert on["received"] == off["received"] == [True] * 3
    assert on["offload_bytes"] == off["offload_bytes"]
    assert all(device_bytes == 0 for _, device_bytes in on["states"])
    assert all(torch.equal(on["params"][n], off["params"][n]) for n in off["params"])
    assert all(torch.equal(a, b) for a, b in zip(on["state"], off["state"], strict=True))


@pytest.mark.cuda
def test_on_a_gpu_the_last_rounds_largest_copies_go_out_before_the_round_is_planned_and_a_failed_check_moves_nothing():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from refitkit.offload.overlapped import EARLY_FLIGHT_COPIES

    model, optimizer = _model("cuda", width=4096)
    adapter = FSDPAdapter(model, optimizer, arena=HostArena(pin_memory=False))
    early, stale = [], []
    for step in range(3):
        _train(model, optimizer, step)
        old = None
        if step == 2:  # a state tensor replaced since the last round, the old one still alive: copied early, not moved
            first = next(iter(optimizer.state.values()))
            old, first["exp_avg"] = first["exp_avg"], first["exp_avg"].clone()
        before = [t.clone() for s in optimizer.state.values() for t in s.values()]
        flight = adapter.begin_offload()
        early.append(flight.copies.early_copies)
        stale.append([storage.nbytes() for storage in flight.copies.stale_early])
        del old  # its storage lives on until the early copy out of it is waited for
        adapter.offload(optimizer=False, grad=False, finishing=flight)
        assert adapter.state_bytes().device_bytes == 0 and flight.copies.stale_early == []
        adapter.reload()
        after = [t for s in optimizer.state.values() for t in s.values()]
        assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    assert early == [0, EARLY_FLIGHT_COPIES, EARLY_FLIGHT_COPIES - 1]  # the new exp_avg was copied after planning
    assert stale == [[], [], [4096 * 32 * 4]]

    _train(model, optimizer, 3)  # the view records the worker made are filed (what reload checks each tensor against)
    flight = adapter.begin_offload()
    adapter.offload(optimizer=False, grad=False, finishing=flight)
    state_ids = {id(t) for s in optimizer.state.values() for t in s.values() if t.is_cuda}
    assert len(state_ids) == 8 and state_ids <= set(adapter.arena.views)
    adapter.reload()
    _train(model, optimizer, 4)
    state = next(iter(optimizer.state.values()))
    state["exp_avg_sq"] = state["exp_avg_sq"].to_sparse()  # start_offload refuses its layout, after the early copies
    before = [t.to_dense().cpu() for s in optimizer.state.values() for t in s.values()]
    with pytest.raises(InvalidInput, match=r"has layout torch.sparse_coo; only strided tensors can be offloaded"):
        adapter.begin_offload()
    after = [t.to_dense().cpu() for s in optimizer.state.values() for t in s.values()]
    assert adapter.part_states.optimizer is DeviceState.ON_DEVICE and adapter.arena.held_bytes == 0
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))


def _on_device_and_intact(adapter: FSDPAdapter, optimizer: torch.optim.Optimizer, before: list[torch.Tensor]) -> bool:
    states = adapter.part_states
    after = [t for s in optimizer.state.values() for t in s.values()]
    return (
        (states.model, states.optimizer, states.grad) == (DeviceState.ON_DEVICE,) * 3
        and adapter.arena.held_bytes == 0
        and all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    )


def test_a_failed_sync_cancels_the_optimizer_copies_and_leaves_everything_on_the_device():
    model, optimizer = _model()
    _train(model, optimizer, 0)
    before = [t.clone() for s in optimizer.state.values() for t in s.values()]
    adapter = FSDPAdapter(model, optimizer, arena=HostArena(pin_memory=False))
    endpoint = f"overlap-{uuid.uuid4().hex[:8]}"
    sender = BucketedWeightSender(endpoint, bucket_bytes=8 << 10, transport="shm", timeout_s=0.5)  # nobody connects
    cycle = RefitCycle(adapter, sender, overlap=True)
    try:
        with pytest.raises(TransferError, match="hello"):
            cycle.refit(1)
        assert _on_device_and_intact(adapter, optimizer, before)
        peer = _Peer(endpoint)  # the next refit works
        sender.timeout_s = 30.0
        cycle.refit(2)
        peer.join()
        assert adapter.state is DeviceState.OFFLOADED and adapter.state_bytes().device_bytes == 0
        cycle.resume(2)
        assert all(torch.equal(a, b) for a, b in zip([t for s in optimizer.state.values() for t in s.values()], before))
    finally:
        sender.close()
        cycle.close()


def test_a_params_offload_that_fails_after_the_optimizer_copies_started_leaves_everything_on_the_device():
    model, optimizer = _model()
    model.scale.share_memory_()  # a buffer offload refuses (non-resizable storage), after the sync
    _train(model, optimizer, 0)
    before = [t.clone() for s in optimizer.state.values() for t in s.values()]
    adapter = FSDPAdapter(model, optimizer, arena=HostArena(pin_memory=False))
    with RefitCycle(adapter, None, overlap=True) as cycle:
        with pytest.raises(InvalidInput, match=r"'model.scale' lives in a non-resizable storage"):
            cycle.refit(1)
    assert _on_device_and_intact(adapter, optimizer, before)
    assert adapter.arena.views == {}, "the cancelled copies left view records behind"
    _train(model, optimizer, 1)  # the state still trains


def test_optimizer_copies_that_cannot_start_fail_the_offload_phase_after_the_sync():
    model, optimizer = _model()
    _train(model, optimizer, 0)
    first_state = next(iter(optimizer.state.values()))
    first_state["exp_avg"].share_memory_()  # start_offload refuses it before any byte moves
    before = [t.clone() for s in optimizer.state.values() for t in s.values()]
    adapter = FSDPAdapter(model, optimizer, arena=HostArena(pin_memory=False))
    endpoint = f"overlap-{uuid.uuid4().hex[:8]}"
    sender = BucketedWeightSender(endpoint, bucket_bytes=8 << 10, transport="shm", timeout_s=30.0)
    cycle = RefitCycle(adapter, sender, overlap=True)
    try:
        peer = _Peer(endpoint)
        with pytest.raises(InvalidInput, match=r"non-resizable storage"):
            cycle.refit(1)
        peer.join()  # the weights were still delivered: the sync ran before the offload phase failed
        assert len(peer.weights) == len(dict(model.named_parameters())) + 1
        assert _on_device_and_intact(adapter, optimizer, before)
    finally:
        sender.close()
        cycle.close()


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(t.untyped_storage().nbytes() for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t))


def test_the_state_in_flight_is_freed_inside_the_params_move_while_the_params_still_hold_their_bytes():
    model, optimizer = _model()
    _train(model, optimizer, 0)
    before = [t.clone() for s in optimizer.state.values() for t in s.values()]
    params_before = {n: p.detach().clone() for n, p in model.named_parameters()}
    state_bytes = _state_bytes(optimizer)
    adapter = FSDPAdapter(model, optimizer, arena=HostArena(pin_memory=False))
    params_at_finish: list[int] = []
    finish = adapter.finish_offload

    def watched_finish(flight):  # the real finish, noting what the params held when it ran
        params_at_finish.extend(p.untyped_storage().nbytes() for p in model.parameters())
        return finish(flight)

    adapter.finish_offload = watched_finish  # type: ignore[method-assign]
    flight = adapter.begin_offload()
    moved = adapter.offload(model=True, optimizer=False, grad=False, finishing=flight)  # (the flight drops the grads)
    assert params_at_finish and all(nbytes > 0 for nbytes in params_at_finish)  # before the params were freed
    assert flight.finished is not None and flight.finished.total.bytes == state_bytes
    assert moved.total.bytes == sum(p.numel() * p.element_size() for p in params_before.values()) + model.scale.nbytes
    states = adapter.part_states
    assert (states.model, states.optimizer, states.grad) == (DeviceState.OFFLOADED,) * 3
    assert adapter.state_bytes().device_bytes == 0
    adapter.reload()
    assert all(
        torch.equal(a, b)
        for a, b in zip([t for s in optimizer.state.values() for t in s.values()], before, strict=True)
    )
    assert all(torch.equal(p, params_before[n]) for n, p in model.named_parameters())


def test_finishing_refuses_parts_already_in_flight_and_a_move_with_nothing_left_still_finishes():
    model, optimizer = _model()
    _train(model, optimizer, 0)
    before = [t.clone() for s in optimizer.state.values() for t in s.values()]
    adapter = FSDPAdapter(model, optimizer, arena=HostArena(pin_memory=False))
    flight = adapter.begin_offload()
    with pytest.raises(
        InvalidInput, match=r"\['grad', 'optimizer'\] already in flight \(finishing=\); pass them as False"
    ):
        adapter.offload(finishing=flight)
    with pytest.raises(InvalidInput, match=r"offload\(finishing=\): expected begin_offload\(\)'s result, got 'flight'"):
        adapter.offload(optimizer=False, finishing="flight")  # type: ignore[arg-type]
    other_model, other_optimizer = _model()
    _train(other_model, other_optimizer, 0)
    other = FSDPAdapter(other_model, other_optimizer, arena=HostArena(pin_memory=False))
    for call in (
        lambda: other.offload(optimizer=False, grad=False, finishing=flight),
        lambda: other.finish_offload(flight),
        lambda: other.cancel_offload(flight),
    ):
        with pytest.raises(InvalidInput, match=r"begun by another adapter; finish or cancel it there"):
            call()
    assert other.part_states.model is DeviceState.ON_DEVICE  # nothing moved there either
    adapter.cancel_offload(flight)
    assert _on_device_and_intact(adapter, optimizer, before)  # nothing moved
    with pytest.raises(InvalidInput, match=r"already finished or cancelled"):
        adapter.offload(optimizer=False, grad=False, finishing=flight)
    assert _on_device_and_intact(adapter, optimizer, before)

    adapter.offload(optimizer=False, grad=False)  # the params first, by hand
    flight = adapter.begin_offload()
    assert adapter.offload(optimizer=False, grad=False, finishing=flight).total.bytes == 0  # nothing of its own left
    assert flight.finished is not None and flight.finished.total.bytes == _state_bytes_before(before)
    assert adapter.part_states.optimizer is DeviceState.OFFLOADED and adapter.state_bytes().device_bytes == 0
    adapter.reload()
    assert all(
        torch.equal(a, b)
        for a, b in zip([t for s in optimizer.state.values() for t in s.values()], before, strict=True)
    )


def _state_bytes_before(before: list[torch.Tensor]) -> int:
    return sum(t.untyped_storage().nbytes() for t in before)


def test_overlap_must_be_a_bool():
    model, optimizer = _model()
    with pytest.raises(InvalidInput, match=r"overlap= must be a bool, got 'yes'"):
        RefitCycle(FSDPAdapter(model, optimizer), None, overlap="yes")  # type: ignore[arg-type]


def test_a_profiler_trace_of_a_refit_names_every_phase_and_every_bucket():
    from torch.profiler import ProfilerActivity, profile

    model, optimizer = _model()
    _train(model, optimizer, 0)
    adapter = FSDPAdapter(model, optimizer, arena=HostArena(pin_memory=False))
    endpoint = f"overlap-{uuid.uuid4().hex[:8]}"
    sender = BucketedWeightSender(endpoint, bucket_bytes=8 << 10, transport="shm", timeout_s=30.0)
    cycle = RefitCycle(adapter, sender, overlap=True)
    try:
        with profile(activities=[ProfilerActivity.CPU]) as trace:
            peer = _Peer(endpoint)
            direct = sender.send(adapter.named_weights())  # the same stream a refit sends, counted
            peer.join()
            peer = _Peer(endpoint)
            cycle.refit(1)
            peer.join()
            cycle.resume(1)
    finally:
        sender.close()
        cycle.close()
    names = [event.name for event in trace.events()]
    for phase in ["offload_start", *PHASES, "reload"]:
        assert names.count(f"refitkit.{phase}") == (2 if phase == "barrier" else 1), phase
    assert direct.buckets >= 3
    assert names.count("refitkit.sync.bucket") == 2 * direct.buckets
