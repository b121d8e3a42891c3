"""Optimizer state and gradient offload: freed, restored in place, training continues bit-identically."""

from __future__ import annotations

import copy

import pytest
import torch

from refitkit.errors import InvalidInput
from refitkit.offload import (
    HostArena,
    offload_grads,
    offload_optimizer,
    offload_tensors,
    optimizer_state_tensors,
    reload_grads,
    reload_optimizer,
    reload_tensors,
)


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))


def train_step(model, optimizer, step: int) -> float:
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def run(offload_between: bool, optimizer_cls=torch.optim.AdamW, **kwargs):
    model = make_model()
    optimizer = optimizer_cls(model.parameters(), lr=1e-2, **kwargs)
    losses = [train_step(model, optimizer, s) for s in range(2)]
    if offload_between:
        arena = HostArena()
        params = list(model.named_parameters())
        offload_tensors(params, arena)
        offload_optimizer(optimizer, arena)
        for _, p in params:
            assert p.untyped_storage().nbytes() == 0
        for _, t in optimizer_state_tensors(optimizer):
            assert t.untyped_storage().nbytes() == 0
        reload_tensors(params, arena)
        reload_optimizer(optimizer, arena)
    losses += [train_step(model, optimizer, s) for s in range(2, 4)]
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def test_adamw_training_is_bit_identical_across_an_offload():
    plain_losses, plain_weights = run(offload_between=False)
    losses, weights = run(offload_between=True)
    assert losses == plain_losses
    for name in plain_weights:
        assert torch.equal(weights[name], plain_weights[name]), name


def test_sgd_momentum_training_is_bit_identical_across_an_offload():
    plain_losses, _ = run(False, torch.optim.SGD, momentum=0.9)
    losses, _ = run(True, torch.optim.SGD, momentum=0.9)
    assert losses == plain_losses


def test_optimizer_state_tensors_are_named_and_include_every_state_tensor():
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters())
    train_step(model, optimizer, 0)
    names = [name for name, _ in optimizer_state_tensors(optimizer)]
    assert "param_groups[0].params[0].exp_avg" in names
    assert "param_groups[0].params[3].exp_avg_sq" in names
    assert len(names) == 4 * 3  # step, exp_avg, exp_avg_sq for 4 params (all on CPU here)


def test_grads_are_dropped_by_default_and_zeroed_on_request():
    model = make_model()
    model(torch.randn(2, 16)).sum().backward()
    params = list(model.named_parameters())
    offload_grads(params, HostArena())
    assert all(p.grad is None for _, p in params)
    reload_grads(params, HostArena(), zero=True)
    assert all(p.grad is not None and not p.grad.any() for _, p in params)


def test_kept_grads_are_offloaded_and_restored_bit_exact():
    model = make_model()
    model(torch.randn(2, 16)).sum().backward()
    params = list(model.named_parameters())
    grads = {name: p.grad for name, p in params}
    expected = {name: g.clone() for name, g in grads.items()}
    arena = HostArena()
    moved = offload_grads(params, arena, keep=True)
    assert moved.bytes == sum(g.numel() * 4 for g in expected.values())
    assert all(p.grad is grads[name] and p.grad.untyped_storage().nbytes() == 0 for name, p in params)
    reload_grads(params, arena)
    for name, p in params:
        assert p.grad is grads[name] and torch.equal(p.grad, expected[name])


def test_kept_grads_reloaded_as_zero_skip_the_copy_but_free_the_slot():
    model = make_model()
    model(torch.randn(2, 16)).sum().backward()
    params = list(model.named_parameters())
    arena = HostArena()
    offload_grads(params, arena, keep=True)
    reload_grads(params, arena, zero=True)
    assert arena.held_bytes == 0
    assert all(not p.grad.any() and p.grad.untyped_storage().nbytes() == p.numel() * 4 for _, p in params)


def test_deepcopied_optimizer_state_is_unaffected():
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters())
    train_step(model, optimizer, 0)
    snapshot = copy.deepcopy(optimizer.state_dict())
    arena = HostArena()
    offload_optimizer(optimizer, arena)
    reload_optimizer(optimizer, arena)
    restored = optimizer.state_dict()
    for key, state in snapshot["state"].items():
        for name, value in state.items():
            assert torch.equal(restored["state"][key][name], value)


def test_dropped_tensors_regrow_zeroed_in_place_without_host_bytes():
    from refitkit.offload import drop_tensors, regrow_tensors

    flat = torch.randn(64)
    view = flat[8:16]
    arena = HostArena()
    assert drop_tensors({"grad_data": flat, "main_grad": view}, arena) == 256
    assert flat.untyped_storage().nbytes() == 0 and arena.nbytes == 0
    assert regrow_tensors({"main_grad": view}, arena) == 256
    assert view.data_ptr() == flat.data_ptr() + 32 and not flat.any()
    assert regrow_tensors({"grad_data": flat}, arena) == 0  # already resident


def _adam_after_a_step() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    train_step(model, optimizer, 0)
    return model, optimizer


def test_a_state_tensor_replaced_while_offloaded_is_refused_by_name_and_nothing_is_restored():
    model, optimizer = _adam_after_a_step()
    expected = {name: tensor.clone() for name, tensor in optimizer_state_tensors(optimizer)}
    arena = HostArena()
    offload_optimizer(optimizer, arena)
    held = arena.held_bytes
    state = optimizer.state[model[2].weight]
    original = state["exp_avg"]
    state["exp_avg"] = torch.zeros_like(expected["param_groups[0].params[2].exp_avg"])  # the old one is still alive

    message = (
        "'param_groups[0].params[2].exp_avg' was replaced in or removed from the optimizer's state between offload "
        "and reload (the tensor offloaded under that name still exists, at 0 bytes); its offloaded bytes were kept, "
        "nothing was restored: put the original tensor back and call reload_optimizer() again"
    )
    with pytest.raises(InvalidInput) as raised:
        reload_optimizer(optimizer, arena)
    assert str(raised.value) == message
    assert arena.held_bytes == held
    assert all(
        tensor.untyped_storage().nbytes() == 0
        for name, tensor in optimizer_state_tensors(optimizer)
        if name != "param_groups[0].params[2].exp_avg"
    )
    assert original.untyped_storage().nbytes() == 0
    del state["exp_avg"]  # removed instead of replaced: the same refusal
    with pytest.raises(InvalidInput, match=r"^'param_groups\[0\]\.params\[2\]\.exp_avg' was replaced in or removed"):
        reload_optimizer(optimizer, arena)
    assert arena.held_bytes == held

    state["exp_avg"] = original  # recoverable: the same call then restores every byte
    reload_optimizer(optimizer, arena)
    assert arena.held_bytes == 0
    restored = dict(optimizer_state_tensors(optimizer))
    assert sorted(restored) == sorted(expected)
    assert all(torch.equal(restored[name], expected[name]) for name in expected)


def test_two_optimizers_sharing_an_arena_and_their_names_reload_each_alone():
    """Both name their state ``param_groups[0].params[i]....``: the other optimizer's offloaded tensors under the same
    names are not a replacement."""
    (_model_a, adam_a), (_model_b, adam_b) = _adam_after_a_step(), _adam_after_a_step()
    arena = HostArena()
    offload_optimizer(adam_b, arena)
    reload_optimizer(adam_a, arena)  # never offloaded: nothing to restore, nothing refused
    offload_optimizer(adam_a, arena)
    reload_optimizer(adam_b, arena)
    assert all(tensor.untyped_storage().nbytes() == 0 for _, tensor in optimizer_state_tensors(adam_a))
    reload_optimizer(adam_a, arena)
    assert arena.held_bytes == 0
