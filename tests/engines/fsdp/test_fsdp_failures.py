"""FSDPAdapter refuses what would lose data: tensors replaced while offloaded, swapped or wrong arguments."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from refitkit.engines import DeviceState
from refitkit.engines.fsdp import FSDPAdapter
from refitkit.errors import InvalidInput
from refitkit.offload import HostArena
from tests.engines.fsdp import ranks
from tests.helpers.world import run_world

pytestmark = pytest.mark.timeout(180)


def _trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    model, optimizer = ranks.build(1, fsdp=False, mixed_precision=False)
    ranks.train_step(model, optimizer, 0, 0, zero=False)
    return model, optimizer


def _snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every param and optimizer state tensor's bytes, to compare bit for bit after the round trip."""
    out = {f"param.{n}": p.detach().clone().view(-1).view(torch.uint8) for n, p in model.named_parameters()}
    for index, state in enumerate(optimizer.state.values()):
        for key, value in state.items():
            out[f"state.{index}.{key}"] = value.clone().reshape(-1).view(torch.uint8)
    return out


def test_a_param_replaced_while_offloaded_is_refused_and_nothing_is_lost():
    model, optimizer = _trained()
    expected = _snapshot(model, optimizer)
    adapter = FSDPAdapter(model, optimizer)
    adapter.offload()
    held = adapter.arena.held_bytes
    original = model.head.weight
    model.head.weight = nn.Parameter(torch.zeros(original.shape))

    with pytest.raises(
        InvalidInput,
        match=r"'model\.head\.weight' was replaced or removed while offloaded.*put the "
        r"original tensor back and call reload\(\) again",
    ):
        adapter.reload()

    assert adapter.state is DeviceState.OFFLOADED and adapter.part_states.model is DeviceState.OFFLOADED
    assert model.embed.weight.untyped_storage().nbytes() == 0, "nothing may be restored"
    assert original.untyped_storage().nbytes() == 0
    assert adapter.arena.held_bytes == held, "the offloaded bytes stay in the arena"
    model.head.weight = original
    adapter.reload()
    assert adapter.state is DeviceState.ON_DEVICE
    after = _snapshot(model, optimizer)
    assert sorted(after) == sorted(expected)
    assert all(torch.equal(after[key], expected[key]) for key in expected)


def test_an_optimizer_state_tensor_replaced_while_offloaded_is_refused():
    model, optimizer = _trained()
    adapter = FSDPAdapter(model, optimizer)
    adapter.offload()
    state = optimizer.state[model.head.weight]
    original = state["exp_avg"]
    state["exp_avg"] = torch.zeros(original.shape)

    with pytest.raises(InvalidInput, match=r"'optimizer\.param_groups\[0\]\.params\[\d+\]\.exp_avg' was replaced"):
        adapter.reload()

    assert adapter.part_states.optimizer is DeviceState.OFFLOADED
    state["exp_avg"] = original
    adapter.reload()
    assert original.untyped_storage().nbytes() == original.numel() * 4


def test_a_param_removed_while_offloaded_is_refused_and_parts_not_asked_for_are_not_checked():
    model, optimizer = _trained()
    adapter = FSDPAdapter(model, optimizer)
    adapter.offload()
    block = model.blocks[1]
    model.blocks[1] = nn.Identity()  # its 6 params (2 norm, 4 linear) disappear from the model
    with pytest.raises(InvalidInput, match=r"'model\.blocks\.1\.0\.weight' \(and 5 more\) was replaced or removed"):
        adapter.reload()
    # the optimizer part can come back on its own: its tensors were not replaced
    adapter.reload(model=False, grad=False)
    assert adapter.part_states.optimizer is DeviceState.ON_DEVICE
    model.blocks[1] = block
    adapter.reload()
    assert adapter.state is DeviceState.ON_DEVICE


def test_a_kept_grad_replaced_while_offloaded_is_refused():
    model, optimizer = _trained()
    adapter = FSDPAdapter(model, optimizer, keep_grads=True)
    adapter.offload()
    grad = model.head.weight.grad
    model.head.weight.grad = torch.zeros(model.head.weight.shape)
    with pytest.raises(InvalidInput, match=r"'model\.head\.weight\.grad' was replaced"):
        adapter.reload()
    model.head.weight.grad = grad
    adapter.reload()
    assert model.head.weight.grad is grad and grad.untyped_storage().nbytes() == grad.numel() * 4


def replaced_sharded_param(rank: int, world_size: int) -> dict:
    """FSDP2 over gloo: a sharded (DTensor) param replaced while offloaded is named; putting it back works."""
    from torch.distributed.tensor import DTensor

    model, optimizer = ranks.build(world_size, fsdp=True, mixed_precision=False)
    ranks.train_step(model, optimizer, rank, 0, zero=False)
    expected = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
    adapter = FSDPAdapter(model, optimizer)
    adapter.offload()
    original = model.head.weight
    fresh = torch.zeros(original.to_local().shape)  # only metadata of the offloaded shard is read
    model.head.weight = nn.Parameter(
        DTensor.from_local(
            fresh, original.device_mesh, original.placements, shape=original.shape, stride=original.stride()
        )
    )
    try:
        adapter.reload()
        error = None
    except InvalidInput as caught:
        error = str(caught)
    state = adapter.state.name
    model.head.weight = original
    adapter.reload()
    return {
        "error": error,
        "state": state,
        "intact": all(torch.equal(p.to_local(), expected[n]) for n, p in model.named_parameters()),
    }


@pytest.mark.timeout(240)
def test_a_sharded_param_replaced_while_offloaded_is_refused_on_every_rank():
    for result in run_world(replaced_sharded_param, 2, timeout_s=180):
        assert result["error"] is not None and "'model.head.weight' was replaced" in result["error"], result
        assert result["state"] == "OFFLOADED"
        assert result["intact"]


# --- constructor arguments --------------------------------------------------------------------


def test_swapped_model_and_optimizer_are_named():
    model, optimizer = _trained()
    with pytest.raises(
        InvalidInput,
        match=r"FSDPAdapter: model is a AdamW optimizer, not an nn.Module; the model "
        r"comes first: FSDPAdapter\(model, optimizer\)",
    ):
        FSDPAdapter(optimizer)
    with pytest.raises(InvalidInput, match=r"FSDPAdapter: model is a AdamW optimizer"):
        FSDPAdapter(optimizer, model)
    with pytest.raises(
        InvalidInput, match=r"optimizer is a \w+ module, not a torch.optim.Optimizer; the model comes first"
    ):
        FSDPAdapter(model, model)
    with pytest.raises(
        InvalidInput, match=r"model part 1 is a AdamW, not an nn.Module; the optimizers go in the second"
    ):
        FSDPAdapter([model, optimizer])


@pytest.mark.parametrize(
    "model_arg, message",
    [
        pytest.param("model", r"model must be an nn.Module or a list of nn.Modules, got a str", id="str"),
        pytest.param({"a": nn.Linear(2, 2)}, r"model must be an nn.Module .* got a dict", id="dict"),
        pytest.param(3, r"model must be an nn.Module .* got a int", id="int"),
        pytest.param(None, r"model must be an nn.Module .* got a NoneType", id="none"),
        pytest.param([], r"model is an empty list", id="empty"),
    ],
)
def test_a_model_that_is_not_a_module_is_named(model_arg, message):
    with pytest.raises(InvalidInput, match=message):
        FSDPAdapter(model_arg)


def test_wrong_optimizers_and_knobs_are_named():
    model, optimizer = _trained()
    with pytest.raises(
        InvalidInput, match=r"optimizer must be a torch.optim.Optimizer, a list of them, or None, got a int"
    ):
        FSDPAdapter(model, 5)
    other = nn.Linear(3, 3)
    stranger = torch.optim.SGD(other.parameters(), lr=0.1)
    with pytest.raises(
        InvalidInput,
        match=r"optimizer 1 param_groups\[0\]\.params\[0\] \(shape \(3, 3\)\) is not a "
        r"parameter of the model passed",
    ):
        FSDPAdapter(model, [optimizer, stranger])
    with pytest.raises(InvalidInput, match=r"arena= must be a refitkit.offload.HostArena or None, got AdamW"):
        FSDPAdapter(model, arena=optimizer)
    with pytest.raises(InvalidInput, match=r"keep_grads= must be a bool, got 'yes'"):
        FSDPAdapter(model, keep_grads="yes")
    with pytest.raises(InvalidInput, match=r"zero_grads= must be a bool, got 1"):
        FSDPAdapter(model, zero_grads=1)
    assert FSDPAdapter(model, optimizer, arena=HostArena()).state is DeviceState.ON_DEVICE


def optimizer_built_before_sharding(rank: int, world_size: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = ranks.TinyLM()
    optimizer = torch.optim.AdamW(model.parameters())  # holds the params fully_shard is about to replace
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    try:
        FSDPAdapter(model, optimizer)
    except InvalidInput as error:
        return str(error)
    return "accepted"


@pytest.mark.timeout(120)
def test_an_optimizer_built_before_fully_shard_is_refused():
    (message,) = run_world(optimizer_built_before_sharding, 1, timeout_s=90)
    assert "optimizer 0 param_groups[0].params[0] (shape (37, 12)) is not a parameter of the model passed" in message
    assert "after sharding it" in message


def test_an_offload_hook_that_raises_leaves_the_parts_offloaded_and_reload_restores_them_bit_exact():
    class FailingHook(FSDPAdapter):
        def _after_offload(self, parts: list[str]) -> None:
            raise RuntimeError("injected failure in _after_offload")

    model, optimizer = _trained()
    expected = _snapshot(model, optimizer)
    adapter = FailingHook(model, optimizer, keep_grads=True)
    with pytest.raises(RuntimeError, match="injected failure in _after_offload"):
        adapter.offload()
    # the copies had freed every storage: ON_DEVICE here would make reload skip them
    assert adapter.part_states == type(adapter.part_states)(
        DeviceState.OFFLOADED, DeviceState.OFFLOADED, DeviceState.OFFLOADED
    )
    assert adapter.state_bytes().device_bytes == 0 and adapter.arena.held_bytes > 0
    adapter.reload()
    assert adapter.state is DeviceState.ON_DEVICE and adapter.arena.held_bytes == 0
    restored = _snapshot(model, optimizer)
    assert sorted(restored) == sorted(expected)
    assert all(torch.equal(restored[k], expected[k]) for k in expected)
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)  # the kept grads came back


def test_an_offload_interrupted_while_its_copies_are_waited_for_finishes_and_is_marked_offloaded(monkeypatch):
    from refitkit.offload import moves as moves_module

    model, optimizer = _trained()
    expected = _snapshot(model, optimizer)
    adapter = FSDPAdapter(model, optimizer)
    real_wait = moves_module.synchronize
    interrupts: list[int] = []

    def interrupted(device: torch.device) -> None:  # Ctrl-C lands while the phase waits for its copies
        if not interrupts:
            interrupts.append(1)
            raise KeyboardInterrupt
        real_wait(device)

    monkeypatch.setattr(moves_module, "synchronize", interrupted)
    with pytest.raises(KeyboardInterrupt):
        adapter.offload()
    assert adapter.state is DeviceState.OFFLOADED, "the copies were all issued: the offload finished before raising"
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    monkeypatch.undo()
    adapter.reload()
    after = _snapshot(model, optimizer)
    assert sorted(after) == sorted(expected) and all(torch.equal(after[key], expected[key]) for key in expected)
