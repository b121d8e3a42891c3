"""RefitCycle(overlap=True) over Megatron's distributed optimizer (CPU shim, gloo): bit-identical to serial.

The optimizer part (fp32 main params and Adam state) starts copying before the weights stream;
the refit is collective (the all-gathers of named_weights), so it runs in a real 2-rank world.
"""

from __future__ import annotations

import pytest
import torch

from tests.engines.megatron import tiny_gpt
from tests.helpers.world import run_world


def overlap_world(rank: int, world_size: int) -> dict:
    from refitkit.engines import DeviceState
    from refitkit.engines import megatron as rm
    from refitkit.refit import RefitCycle

    out: dict = {}
    for overlap in (False, True):
        trainer = tiny_gpt.build()
        adapter = rm.MegatronAdapter(trainer.chunks, trainer.optimizer)
        losses, offloaded, moved = [], [], []
        with RefitCycle(adapter, None, overlap=overlap, barrier_timeout_s=60.0) as cycle:
            for step in range(3):
                losses.append(tiny_gpt.train_step(trainer, step))
                report = cycle.refit(step)
                offloaded.append(adapter.part_states == type(adapter.part_states)(*(DeviceState.OFFLOADED,) * 3))
                moved.append(report.phase("offload").bytes)
                cycle.resume(step)
        losses.append(tiny_gpt.train_step(trainer, 3))
        out[overlap] = {"losses": losses, "weights": tiny_gpt.weights(trainer), "offloaded": offloaded, "moved": moved}
    return out


@pytest.mark.timeout(300)
def test_overlap_over_megatrons_distributed_optimizer_trains_bit_identical_to_serial():
    for result in run_world(overlap_world, 2, timeout_s=280):
        serial, overlapped = result[False], result[True]
        assert overlapped["offloaded"] == serial["offloaded"] == [True] * 3
        assert overlapped["moved"] == serial["moved"] and serial["moved"][0] > 0
        assert overlapped["losses"] == serial["losses"]
        assert all(torch.equal(overlapped["weights"][n], w) for n, w in serial["weights"].items())
