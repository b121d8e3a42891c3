"""Bad input to the Megatron functions: a clear InvalidInput naming the culprit, nothing moved."""

from __future__ import annotations

import pytest
import torch

from refitkit.engines import megatron as rm
from refitkit.errors import InvalidInput


def _linear() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(8, 4)


def test_empty_models_is_refused():
    with pytest.raises(InvalidInput, match="models is empty"):
        rm.offload_megatron_model_to_cpu([])


def test_a_non_module_is_named_and_nothing_moves():
    model = _linear()
    with pytest.raises(InvalidInput, match=r"models\[1\] is a str"):
        rm.offload_megatron_model_to_cpu([model, "policy"])
    assert model.weight.untyped_storage().nbytes() == 32 * 4


def test_a_torch_optimizer_is_refused_with_the_right_pointer():
    model = _linear()
    adam = torch.optim.Adam(model.parameters())
    for call in (rm.offload_megatron_optimizer, rm.load_megatron_optimizer, rm.offload_megatron_copy_params):
        with pytest.raises(InvalidInput, match=r"got Adam.*refitkit\.offload\.offload_optimizer"):
            call(adam)
    with pytest.raises(InvalidInput, match="got Adam"):
        rm.MegatronAdapter(model, adam)


def test_an_unsupported_megatron_optimizer_kind_is_named():
    from megatron.core.optimizer import ChainedOptimizer, MegatronOptimizer, OptimizerConfig

    abstract = sorted(MegatronOptimizer.__abstractmethods__)
    custom_kind = type(
        "CustomMegatronOptimizer", (MegatronOptimizer,), {name: lambda *a, **k: None for name in abstract}
    )
    model = _linear()
    custom = custom_kind(torch.optim.Adam(model.parameters()), OptimizerConfig())
    with pytest.raises(InvalidInput, match="CustomMegatronOptimizer is not supported yet"):
        rm.offload_megatron_optimizer(custom)
    with pytest.raises(InvalidInput, match="CustomMegatronOptimizer is not supported yet"):
        rm.offload_megatron_copy_params(ChainedOptimizer([custom]))


def test_a_plain_module_round_trips_with_kept_or_dropped_grads():
    model = _linear()
    model(torch.ones(2, 8)).sum().backward()
    weight, grad = model.weight.detach().clone(), model.weight.grad.clone()

    rm.offload_megatron_model_to_cpu(model, keep_grad=True)
    assert model.weight.untyped_storage().nbytes() == 0 and model.weight.grad.untyped_storage().nbytes() == 0
    rm.load_megatron_model_to_gpu(model)
    assert torch.equal(model.weight, weight) and torch.equal(model.weight.grad, grad)

    rm.offload_megatron_model_to_cpu([model])
    assert model.weight.grad is None, "grads are dropped unless kept"
    rm.load_megatron_model_to_gpu([model], load_grad=True)
    assert torch.equal(model.weight, weight) and model.weight.grad is None
    assert rm.arena_of(model).chunks == 1, "the second round reused the first round's host memory"
