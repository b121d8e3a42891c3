"""On a GPU: a checkpoint taken (or loaded) right after a deferred reload is ordered after the side stream's copies.

As in test_cuda_deferred.py, the memory the regrown storages come from is poisoned with NaN and
the side stream is held behind a GPU spin kernel: a ``state_dict()`` that did not wait would copy
NaN (or half-copied) moments to the host; a ``load_state_dict()`` that did not wait would have
its values overwritten by the copies that land later (in place, as DCP loads).
"""

from __future__ import annotations

import pytest
import torch

from refitkit.engines import DeviceState
from refitkit.engines.fsdp import FSDPAdapter
from refitkit.offload import flush_device
from tests.helpers.bits import bits_equal

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(180)]

SPIN_CYCLES = 200_000_000  # ~0.1 s of one SM at H200 clocks: far longer than launching the host's reads
WIDTH = 1024  # 4 MiB fp32 weights: their state comes from the large pool, where the poison was freed


def make(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH) for _ in range(3))).cuda()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(100 + step)
    model(torch.randn(64, WIDTH, device="cuda", generator=g)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def host_copy(state_dict: dict) -> dict[str, torch.Tensor]:
    """The state dict's tensors on the host, as torch.save would write them."""
    return {f"{key}.{name}": v.cpu() for key, state in state_dict["state"].items() for name, v in state.items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return sorted(a) == sorted(b) and all(bits_equal(a[k], b[k]) for k in a)


def deferred_with_the_copies_held(steps: int = 2) -> tuple[torch.nn.Module, torch.optim.Optimizer, FSDPAdapter]:
    model, optimizer = make()
    for step in range(steps):
        train_step(model, optimizer, step)
    adapter = FSDPAdapter(model, optimizer)
    adapter.offload()
    flush_device()
    poisoned: list[bool] = []

    def before_copy(name: str) -> None:  # in the worker, with the side stream current
        if not poisoned:
            poisoned.append(True)
            # freed at once, back to the side stream's pool: the regrown storages are carved from it
            torch.full((adapter.arena.held_bytes // 4 + WIDTH * WIDTH,), float("nan"), device="cuda")
            torch.cuda._sleep(SPIN_CYCLES)  # the copies queue behind this on the side stream

    adapter._deferred_before_copy = before_copy
    adapter.reload(defer_optimizer=True)
    return model, optimizer, adapter


def test_state_dict_right_after_a_deferred_reload_on_the_gpu_holds_every_byte():
    reference_model, reference = make()
    for step in range(2):
        train_step(reference_model, reference, step)
    expected = host_copy(reference.state_dict())
    _, optimizer, adapter = deferred_with_the_copies_held()
    assert adapter.part_states.optimizer is DeviceState.ARRIVING
    got = host_copy(optimizer.state_dict())
    assert adapter.part_states.optimizer is DeviceState.ON_DEVICE
    assert same(got, expected)


def test_a_state_loaded_in_place_right_after_a_deferred_reload_on_the_gpu_is_not_overwritten():
    source_model, source = make(seed=1)
    for step in range(3):
        train_step(source_model, source, step)
    loaded = host_copy(source.state_dict())
    _, optimizer, adapter = deferred_with_the_copies_held()
    target = optimizer.state_dict()
    for key, state in target["state"].items():
        for name, value in state.items():
            value.copy_(loaded[f"{key}.{name}"])  # as dcp.load writes into the tensors it was given
    optimizer.load_state_dict(target)
    torch.cuda.synchronize()  # any copy still queued on the side stream lands before the check
    assert adapter.part_states.optimizer is DeviceState.ON_DEVICE
    assert same(host_copy(optimizer.state_dict()), loaded)
