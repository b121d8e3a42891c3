"""FSDPAdapter on real FSDP2 over gloo: offload frees everything, reload restores it bit for bit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from refitkit.engines import DeviceState
from refitkit.engines.fsdp import FSDPAdapter, clean_fqn
from refitkit.errors import InvalidInput, RefitError
from tests.engines.fsdp import ranks
from tests.helpers.copies import CopyOrder
from tests.helpers.world import run_world

CASES = [
    pytest.param(1, False, False, False, False, id="plain-module"),
    pytest.param(1, True, False, True, False, id="fsdp-ws1-to-cpu"),
    pytest.param(2, True, True, False, False, id="fsdp-ws2-bf16-drop-grads"),
    pytest.param(2, True, True, True, True, id="fsdp-ws2-bf16-keep-grads"),
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size, fsdp, mixed_precision, use_to, keep_grads", CASES)
def test_cycle_frees_everything_and_training_is_bit_identical(world_size, fsdp, mixed_precision, use_to, keep_grads):
    results = run_world(ranks.train_with_cycle, world_size, fsdp, mixed_precision, use_to, keep_grads, timeout_s=180)
    for rank, result in enumerate(results):
        freed = result["freed"]
        assert freed["state"] == "OFFLOADED" and freed["parts"] == ["OFFLOADED"] * 3
        assert freed["live_storages"] == [], f"rank {rank}: storages left on the device: {freed['live_storages']}"
        assert freed["grads_left"] == []
        assert freed["device_bytes"] == 0
        assert freed["host_bytes"] == freed["moved_bytes"] > 0
        assert freed["model_bytes"] > 0 and freed["optimizer_bytes"] > 0
        assert result["n_grads_before"] > 0, "the scenario must offload with grads present"
        if keep_grads:
            assert freed["grad_bytes"] > 0 and not freed["grads_none"]
            assert result["grads_intact"]
        else:
            assert freed["grad_bytes"] == 0 and freed["grads_none"]
        assert result["again_bytes"] == 0, "a second offload must move nothing"
        assert result["intact"], f"rank {rank}: params/buffers/optimizer state changed across the cycle"
        assert result["state_after_reload"] == "ON_DEVICE"
        assert result["losses"] == result["base_losses"], f"rank {rank}: losses differ"
        base, final = result["base_final"], result["final"]
        assert sorted(base) == sorted(final)
        for key in base:
            assert torch.equal(base[key].reshape(-1).view(torch.uint8), final[key].reshape(-1).view(torch.uint8)), key
    if world_size == 2:
        assert results[0]["losses"] != results[1]["losses"], "ranks must see different data"


@pytest.mark.timeout(180)
def test_named_weights_match_the_unsharded_state_dict_bit_for_bit():
    results = run_world(ranks.named_weights_match, 2, timeout_s=150)
    for result in results:
        assert result["initial_names"] == result["reference_names"]
        assert "cache" not in result["initial_names"], "non-persistent buffers are not weights"
        assert result["initial_equal"]
        assert result["trained_names"] == result["full_names"]
        assert result["trained_equal"]
        assert result["types"] == ["Tensor"], "full tensors, not DTensors"
        assert result["trained_changed"]
        assert result["says_held"] is False
        assert result["says_fresh"] is True  # a direct sender may keep each gathered tensor while the engine reads it


def test_an_unsharded_models_weights_are_its_own_tensors_and_the_stream_says_so():
    model, _, adapter = _plain()
    weights = adapter.named_weights()
    assert weights.refitkit_holds_tensors is True
    streamed = list(weights)
    own = dict(model.state_dict(keep_vars=True))
    assert [name for name, _ in streamed] == list(model.state_dict())
    # the very bytes of the model's tensors, not copies: a sender may read them where they lie
    assert all(tensor.data_ptr() == own[name].data_ptr() for name, tensor in streamed)
    adapter.offload()
    lazy = adapter.named_weights()  # checks run at the first item, as a generator's do (a cycle exchanges them)
    with pytest.raises(RefitError, match="model is offloaded; reload"):
        next(lazy)


@pytest.mark.timeout(180)
def test_offload_reshards_params_left_unsharded_by_an_inference_forward():
    results = run_world(ranks.offload_after_inference_forward, 2, timeout_s=150)
    for result in results:
        assert result["unsharded_before"], "the scenario must leave params unsharded"
        assert result["unsharded_after"] == [] and result["live"] == []
        assert result["same_output"]


@pytest.mark.timeout(180)
def test_repeated_cycles_allocate_no_new_host_memory():
    results = run_world(ranks.repeated_cycles, 2, 4, timeout_s=150)
    for result in results:
        sizes = result["sizes"]
        assert all(size == sizes[0] for size in sizes), sizes
        assert sizes[0][0] > 0 and sizes[0][2] > 0
        assert result["held_after"] == 0


# --- in-process: the state machine on a plain module -------------------------------------------


def _plain() -> tuple[nn.Module, torch.optim.Optimizer, FSDPAdapter]:
    model, optimizer = ranks.build(1, fsdp=False, mixed_precision=False)
    ranks.train_step(model, optimizer, 0, 0, zero=False)
    return model, optimizer, FSDPAdapter(model, optimizer)


def test_to_is_idempotent_and_parts_move_separately():
    model, optimizer, adapter = _plain()
    weight = model.head.weight
    first = adapter.offload(optimizer=False, grad=False)
    assert adapter.part_states.model is DeviceState.OFFLOADED
    assert adapter.part_states.optimizer is DeviceState.ON_DEVICE
    assert adapter.state is DeviceState.OFFLOADED
    assert weight.untyped_storage().nbytes() == 0 and first.optimizer.bytes == 0
    assert adapter.to("cpu", optimizer=False, grad=False).total.bytes == 0
    second = adapter.to("cpu")
    assert second.model.bytes == 0 and second.optimizer.bytes > 0
    assert adapter.to("cpu").total.bytes == 0
    assert adapter.state_bytes().device_bytes == 0
    adapter.reload()
    assert adapter.reload().total.bytes == 0
    assert adapter.state is DeviceState.ON_DEVICE and model.head.weight is weight
    assert weight.untyped_storage().nbytes() == weight.numel() * 4


def test_a_reload_regrows_the_weights_before_the_optimizers_state_and_grads():
    # (after a flush on CUDA the weights then share as few segments as fit: a sync maps fewer allocations)
    model, optimizer, adapter = _plain()
    weights = {p.untyped_storage()._cdata for p in model.parameters()}
    state = {t.untyped_storage()._cdata for state in optimizer.state.values() for t in state.values() if t.dim()}
    for _ in range(2):  # (the second reload issues its first copies from the plan the offload before it left)
        adapter.offload()
        with CopyOrder() as order:
            adapter.reload()
        assert set(order.written[: len(weights)]) == weights
        assert state <= set(order.written[len(weights) :])


def test_reload_with_zero_grads_gives_zero_grads():
    model, _, adapter = _plain()
    adapter.offload()
    assert all(p.grad is None for p in model.parameters())
    adapter.reload(zero_grads=True)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def test_kept_grads_zeroed_on_reload_keep_their_tensor():
    model, _, adapter = _plain()
    grad = model.head.weight.grad
    adapter.offload(keep_grads=True)
    assert grad.untyped_storage().nbytes() == 0
    adapter.reload(zero_grads=True)
    assert model.head.weight.grad is grad and not grad.any()


def test_bad_transitions_and_arguments_raise_clear_errors():
    _, _, adapter = _plain()
    with pytest.raises(InvalidInput, match="live on cpu.*use reload"):
        adapter.to("cuda")
    with pytest.raises(InvalidInput, match="meta"):
        adapter.to("meta")
    with pytest.raises(InvalidInput, match="not a device"):
        adapter.to("warp-drive")
    with pytest.raises(InvalidInput, match="model= must be a bool"):
        adapter.offload(model="yes")
    adapter.offload()
    with pytest.raises(RefitError, match="model is offloaded; reload"):
        next(adapter.named_weights())
    assert adapter.state is DeviceState.OFFLOADED, "a refused call must not change the state"
    with pytest.raises(InvalidInput, match="not an nn.Module"):
        FSDPAdapter([nn.Linear(2, 2), "layer"])
    with pytest.raises(InvalidInput, match="not a torch.optim.Optimizer"):
        FSDPAdapter(nn.Linear(2, 2), optimizer=[object()])


def test_replaced_param_is_named_in_the_error_and_nothing_is_restored():
    model, _, adapter = _plain()
    adapter.offload(optimizer=False, grad=False)
    model.head.weight.data = torch.zeros(0)
    with pytest.raises(InvalidInput, match="head.weight"):
        adapter.reload()
    assert model.embed.weight.untyped_storage().nbytes() == 0, "validation happens before any byte moves"
    assert adapter.part_states.model is DeviceState.OFFLOADED


def test_clean_fqn_drops_wrapper_components():
    assert clean_fqn("layers.0._checkpoint_wrapped_module.attention.wq.weight") == "layers.0.attention.wq.weight"
    assert clean_fqn("_orig_mod.tok_embeddings.weight") == "tok_embeddings.weight"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [1, 2])
def test_an_adapter_cycle_creates_no_cyclic_garbage(world_size):
    for result in run_world(ranks.cycle_garbage, world_size, timeout_s=150):
        assert {phase: count for phase, (count, _) in result.items()} == {
            "offload": 0,
            "reload": 0,
            "named_weights": 0,
        }, result
