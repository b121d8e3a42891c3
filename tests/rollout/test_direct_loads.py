"""DirectLoads: the first sync goes through the model's own loader, watched; what it copied whole goes direct after.

The model below loads the way vLLM's layers do: q/k/v rows into one fused parameter, a plain copy, a
transposed copy, a padded copy (``fill_`` of the rest), a scaled copy. Every landing is compared bit for
bit with the same weights loaded by ``load_weights`` alone into a twin model.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from refitkit.rollout.load_plan import SMALL_COPY_BYTES, DirectLoads


class FusingModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Parameter(torch.zeros(12, 4, dtype=torch.bfloat16))
        self.norm = nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
        self.big = nn.Parameter(torch.zeros(SMALL_COPY_BYTES // 2, dtype=torch.bfloat16))  # at the batching bound
        self.proj = nn.Parameter(torch.zeros(4, 6, dtype=torch.bfloat16))
        self.padded = nn.Parameter(torch.zeros(8, 4, dtype=torch.bfloat16))
        self.scaled = nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))

    def load_weights(self, weights) -> None:
        for name, loaded in weights:
            if name in ("q", "k", "v"):
                self.qkv.data.narrow(0, 4 * "qkv".index(name), 4).copy_(loaded)
            elif name in ("norm", "big"):
                target = getattr(self, name)
                target.data[: loaded.shape[0]].copy_(loaded)
                target.data[loaded.shape[0] :].fill_(0)  # like vLLM's embedding loader: padding rows, here none
            elif name == "proj_t":
                self.proj.data.copy_(loaded.t())
            elif name == "pad":
                self.padded.data[:6].copy_(loaded)
                self.padded.data[6:].fill_(0)
            elif name == "scaled":
                self.scaled.data.copy_(loaded * 2)
            else:
                raise KeyError(name)


SHAPES = {
    "q": (4, 4),
    "k": (4, 4),
    "v": (4, 4),
    "norm": (4,),
    "big": (SMALL_COPY_BYTES // 2,),
    "proj_t": (6, 4),
    "pad": (6, 4),
    "scaled": (4,),
}
DIRECT = {"q", "k", "v", "norm", "big"}


def weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(name, torch.randn(shape, generator=generator).to(torch.bfloat16)) for name, shape in SHAPES.items()]


def assert_same_params(model: nn.Module, reference: nn.Module) -> None:
    for (name, param), (_, expected) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(param.view(torch.int16), expected.view(torch.int16)), name


def loaded_by_the_loader(seed: int) -> FusingModel:
    reference = FusingModel()
    with torch.no_grad():
        reference.load_weights(weights(seed))
    return reference


def test_first_sync_watches_the_loader_and_later_ones_copy_straight_into_the_parameters():
    model = FusingModel()
    loads = DirectLoads(model, model.load_weights)
    loads.begin()
    first = loads.land(weights(1))
    assert (first.observed, first.loader_tensors, first.direct_tensors) == (len(SHAPES), len(SHAPES), 0)
    assert set(loads.destinations) == DIRECT
    assert "transform" in loads.skipped["proj_t"] and "transform" in loads.skipped["scaled"]
    assert "fill_" in loads.skipped["pad"]  # the loader wrote more than the copy: never direct
    assert_same_params(model, loaded_by_the_loader(1))

    calls = []
    loads.load_weights = lambda items: (calls.append([name for name, _ in items]), model.load_weights(items))
    loads.begin()
    second = loads.land(weights(2))
    assert (second.direct_tensors, second.loader_tensors, second.observed) == (len(DIRECT), 3, 0)
    assert second.direct_bytes == sum(tensor.nbytes for name, tensor in weights(2) if name in DIRECT)
    assert calls == [["proj_t", "pad", "scaled"]]  # one loader call for the rest of the bucket
    assert_same_params(model, loaded_by_the_loader(2))


def test_a_weight_unlike_the_planned_one_goes_through_the_loader():
    model = FusingModel()
    loads = DirectLoads(model, model.load_weights)
    loads.land(weights(1))
    odd = [(name, tensor.float()) if name == "norm" else (name, tensor) for name, tensor in weights(3)]
    stats = loads.land(odd)
    assert stats.direct_tensors == len(DIRECT) - 1 and stats.loader_tensors == 4
    assert_same_params(model, loaded_by_the_loader(3))  # the loader casts the float32 norm as before


def test_a_parameter_the_engine_replaced_is_bound_again():
    model = FusingModel()
    loads = DirectLoads(model, model.load_weights)
    loads.land(weights(1))
    model.qkv = nn.Parameter(torch.zeros(12, 4, dtype=torch.bfloat16))  # e.g. post-processing made a new tensor
    loads.begin()
    stats = loads.land(weights(4))
    assert stats.direct_tensors == len(DIRECT)
    assert_same_params(model, loaded_by_the_loader(4))  # the new parameter got q/k/v, not the old memory


class Outer(nn.Module):
    """A model whose loading layer sits one module down, as vLLM's decoder layers do."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = FusingModel()

    def load_weights(self, weights) -> None:
        self.inner.load_weights(weights)


@pytest.mark.parametrize("swap", ["module", "data"])
def test_a_module_or_memory_the_engine_swapped_under_the_plan_is_bound_again(swap):
    model = Outer()
    loads = DirectLoads(model, lambda items: model.load_weights(items))
    loads.land(weights(1))
    assert loads.destinations["q"].param == "inner.qkv"
    old = model.inner
    if swap == "module":  # a new layer object: the old one (and its parameters, on their memory) stays alive here
        model.inner = FusingModel()
    else:  # the same parameter object on new memory
        old.qkv.data = torch.zeros(12, 4, dtype=torch.bfloat16)
    loads.begin()
    stats = loads.land(weights(5))
    assert stats.direct_tensors == len(DIRECT)
    assert_same_params(model.inner, loaded_by_the_loader(5))  # the live parameters got every weight


class DispatchingParameter(nn.Parameter):
    """A parameter subclass with a Python ``__torch_function__``, as vLLM's are; counts the calls that reach it."""

    calls = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        DispatchingParameter.calls += 1
        return super().__torch_function__(func, types, args, kwargs or {})


def test_the_per_sync_check_of_subclassed_parameters_skips_their_dispatch_and_still_sees_new_memory():
    model = FusingModel()
    model.qkv = DispatchingParameter(torch.zeros(12, 4, dtype=torch.bfloat16))
    model.big = DispatchingParameter(torch.zeros(SMALL_COPY_BYTES // 2, dtype=torch.bfloat16))
    loads = DirectLoads(model, model.load_weights)
    loads.land(weights(1))
    loads.begin()  # binds the plan to the parameters as they are
    DispatchingParameter.calls = 0
    loads.begin()  # nothing changed: the check reads every pointer, none through __torch_function__
    assert DispatchingParameter.calls == 0
    model.qkv.data = torch.zeros(12, 4, dtype=torch.bfloat16)  # the same subclassed parameter on new memory
    loads.begin()
    stats = loads.land(weights(6))
    assert stats.direct_tensors == len(DIRECT)
    assert_same_params(model, loaded_by_the_loader(6))  # q/k/v landed in the new memory


@pytest.mark.parametrize("write", ["setitem", "data", "out", "iadd"])
def test_any_other_write_in_the_loader_keeps_a_weight_off_the_direct_path(write):
    class Writer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.zeros(4))
            self.other = nn.Parameter(torch.zeros(4))

        def load_weights(self, weights) -> None:
            for _, loaded in weights:
                self.w.data.copy_(loaded)
                if write == "setitem":
                    self.other.data[0] = 1.0
                elif write == "data":
                    self.other.data = torch.ones(4)
                elif write == "out":
                    torch.add(loaded, 1, out=self.other.data)
                else:
                    other = self.other.data
                    other += 1

    model = Writer()
    loads = DirectLoads(model, model.load_weights)
    loads.land([("w", torch.ones(4))])
    assert not loads.destinations and "wrote" in loads.skipped["w"]
