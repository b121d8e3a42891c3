"""AutomodelAdapter in one process: the shapes of trainer state it accepts, HF names, bad input."""

from __future__ import annotations

import pytest
import torch
from nemo_automodel.components.checkpoint.state_dict_adapter import StateDictAdapter
from torch import nn

from refitkit.engines import DeviceState
from refitkit.engines.automodel import AutomodelAdapter
from refitkit.errors import InvalidInput
from tests.engines.automodel import ranks

pytestmark = pytest.mark.timeout(60)


class FusedGateUpMLP(nn.Module):
    """A native layout Hugging Face does not have: gate and up projections fused in one weight."""

    def __init__(self, hidden: int = 8, inner: int = 12) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)
        self.state_dict_adapter = SplitGateUp()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(hidden).chunk(2, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class SplitGateUp(StateDictAdapter):
    """Automodel's conversion contract for the fused layout: one native tensor, two HF tensors."""

    def to_hf(self, state_dict, **kwargs):
        return dict(
            pair for fqn, tensor in state_dict.items() for pair in self.convert_single_tensor_to_hf(fqn, tensor)
        )

    def from_hf(self, hf_state_dict, device_mesh=None, **kwargs):
        raise NotImplementedError("not needed to stream weights")

    def convert_single_tensor_to_hf(self, fqn, tensor, **kwargs):
        if fqn.endswith("gate_up_proj.weight"):
            gate, up = tensor.chunk(2, dim=0)
            stem = fqn.removesuffix("gate_up_proj.weight")
            return [(f"{stem}gate_proj.weight", gate), (f"{stem}up_proj.weight", up)]
        return [(fqn, tensor)]


def _trained_llama() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = ranks.tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ranks.train_step([model], [optimizer], 0, 0)
    return model, optimizer


def test_named_weights_go_through_the_models_state_dict_adapter():
    model = FusedGateUpMLP()
    fused = model.gate_up_proj.weight.detach().clone()
    streamed = dict(AutomodelAdapter([model]).named_weights())
    assert sorted(streamed) == ["down_proj.weight", "gate_proj.weight", "up_proj.weight"]
    assert torch.equal(streamed["gate_proj.weight"], fused[:12]) and torch.equal(streamed["up_proj.weight"], fused[12:])
    assert torch.equal(streamed["down_proj.weight"], model.down_proj.weight)
    native = dict(AutomodelAdapter([model], hf_names=False).named_weights())
    assert sorted(native) == ["down_proj.weight", "gate_up_proj.weight"]


def test_a_state_dict_adapter_that_is_not_automodels_is_rejected():
    model = FusedGateUpMLP()
    model.state_dict_adapter = object()
    with pytest.raises(InvalidInput, match="state_dict_adapter is a object.*hf_names=False"):
        AutomodelAdapter([model])
    assert len(dict(AutomodelAdapter([model], hf_names=False).named_weights())) == 2


def test_several_model_parts_and_optimizers_move_together():
    torch.manual_seed(0)
    parts = [nn.Linear(6, 10), nn.Linear(10, 3)]
    optimizers = [torch.optim.AdamW(part.parameters(), lr=1e-2) for part in parts]
    loss = parts[1](parts[0](torch.randn(4, 6))).square().mean()
    loss.backward()
    for optimizer in optimizers:
        optimizer.step()
    before = ranks.local_state(parts, optimizers)
    adapter = AutomodelAdapter(parts, optimizers)
    move = adapter.offload()
    assert adapter.state is DeviceState.OFFLOADED and adapter.state_bytes().device_bytes == 0
    assert all(p.untyped_storage().nbytes() == 0 for part in parts for p in part.parameters())
    assert move.optimizer.bytes == sum(4 * 2 * p.numel() + 4 for part in parts for p in part.parameters())
    adapter.reload()
    after = ranks.local_state(parts, optimizers)
    assert sorted(after) == sorted(before) and all(torch.equal(after[k], before[k]) for k in before)


def test_one_module_and_one_optimizer_are_accepted():
    model, optimizer = _trained_llama()
    adapter = AutomodelAdapter(model, optimizer)
    assert adapter.model_parts == [model] and adapter.optimizers == [optimizer]
    assert adapter.offload().optimizer.bytes > 0


def test_to_an_accelerator_on_a_cpu_model_is_a_clear_error():
    model, optimizer = _trained_llama()
    adapter = AutomodelAdapter([model], [optimizer])
    adapter.to("cpu")
    with pytest.raises(InvalidInput, match="live on cpu.*use reload"):
        adapter.to("cuda")
    assert adapter.state is DeviceState.OFFLOADED, "a refused move changes nothing"
    adapter.reload()
    assert adapter.state is DeviceState.ON_DEVICE


@pytest.mark.parametrize(
    "model_parts, message",
    [
        pytest.param([], "model_parts is empty", id="empty"),
        pytest.param("model", "model_parts is a str", id="string"),
        pytest.param([nn.Linear(2, 2), {"w": torch.ones(2)}], r"model_parts\[1\] is a dict", id="not-a-module"),
    ],
)
def test_bad_model_parts_are_named(model_parts, message):
    with pytest.raises(InvalidInput, match=message):
        AutomodelAdapter(model_parts)


def test_bad_optimizers_are_named():
    model = nn.Linear(2, 2)
    with pytest.raises(InvalidInput, match=r"optimizers\[1\] is a dict"):
        AutomodelAdapter([model], [torch.optim.SGD(model.parameters(), lr=0.1), {"lr": 0.1}])
    with pytest.raises(InvalidInput, match="optimizers is a int"):
        AutomodelAdapter([model], 3)


def test_an_optimizer_over_other_params_is_rejected_before_anything_moves():
    model = nn.Linear(2, 2)
    original = nn.Linear(2, 3)  # e.g. the module as it was before parallelize_model replaced its params
    optimizer = torch.optim.SGD([*model.parameters(), *original.parameters()], lr=0.1)
    with pytest.raises(
        InvalidInput,
        match=r"optimizers\[0\]\.param_groups\[0\]\.params\[2\] \(shape \(3, 2\)\).*after parallelize_model",
    ):
        AutomodelAdapter([model], [optimizer])
    assert model.weight.untyped_storage().nbytes() == 16
