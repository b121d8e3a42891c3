"""TorchTitanAdapter on torchtitan's real llama3 debug model (FSDP2 over gloo, CPU)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchtitan", reason="needs the torchtitan env: make test-torchtitan")

from tests.engines.torchtitan import ranks  # noqa: E402
from tests.helpers.world import run_world  # noqa: E402


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size, keep_grads", [(1, False), (2, True)], ids=["ws1-drop-grads", "ws2-keep-grads"])
def test_cycle_frees_everything_and_training_is_bit_identical(world_size, keep_grads):
    results = run_world(ranks.train_with_cycle, world_size, keep_grads, timeout_s=240)
    for rank, result in enumerate(results):
        base, cycled = result["base"], result["cycled"]
        assert cycled["state"] == "OFFLOADED" and cycled["state_after"] == "ON_DEVICE"
        assert cycled["live"] == [] and cycled["live_grads"] == [], f"rank {rank}: storages left on the device"
        assert cycled["device_bytes"] == 0
        model_bytes, optimizer_bytes, grad_bytes = cycled["bytes"]
        assert model_bytes > 0 and optimizer_bytes > 0
        assert (grad_bytes > 0) == keep_grads
        assert cycled["again"] == 0, "to('cpu') twice must move nothing the second time"
        assert cycled["intact"], f"rank {rank}: state changed across the cycle"
        assert cycled["losses"] == base["losses"], f"rank {rank}: losses differ"
        assert sorted(cycled["final"]) == sorted(base["final"])
        for key, tensor in base["final"].items():
            other = cycled["final"][key]
            assert torch.equal(tensor.reshape(-1).view(torch.uint8), other.reshape(-1).view(torch.uint8)), key


@pytest.mark.timeout(300)
def test_named_weights_match_full_state_dict_and_cycles_reuse_the_arena():
    results = run_world(ranks.named_weights_and_cycles, 2, 3, timeout_s=240)
    for result in results:
        assert result["names"] == result["full_names"]
        assert result["equal"] and result["shapes_full"]
        assert result["types"] == ["Tensor"]
        sizes = result["sizes"]
        assert all(size == sizes[0] for size in sizes) and sizes[0][2] > 0, sizes


def test_optimizers_container_is_unpacked_and_bad_input_is_named():
    from torch import nn

    from refitkit.engines.torchtitan import TorchTitanAdapter
    from refitkit.errors import InvalidInput

    model = nn.Linear(3, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    adapter = TorchTitanAdapter([model], [optimizer])
    assert adapter.optimizers == [optimizer]
    with pytest.raises(InvalidInput, match="optimizers is a str"):
        TorchTitanAdapter([model], "adamw")
