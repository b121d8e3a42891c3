"""RefitCycle calls a link's engine-memory steps in the cycle's order: the engine's weights back before the sync, its
KV cache only after every rank offloaded and flushed, and its memory released before the trainer's state returns."""

from __future__ import annotations

import pytest
import torch

from refitkit.engines.base import DeviceState
from refitkit.engines.fsdp import FSDPAdapter
from refitkit.errors import RecoveryNeeded
from refitkit.refit import RefitCycle


class EngineLink:
    """A link whose engine is a dict in this process; it records what the cycle asked and the trainer's state then."""

    def __init__(self, adapter_box: list, *, drives_memory: bool = True, fail: str | None = None) -> None:
        self.drives_memory = drives_memory
        self.adapter_box, self.fail = adapter_box, fail
        self.events: list[tuple[str, str]] = []
        self.engine: dict[str, torch.Tensor] = {}

    def _note(self, step: str) -> None:
        self.events.append((step, self.adapter_box[0].state.value))
        if step == self.fail:
            raise RuntimeError(f"the engine refused {step}")

    def wake_for_sync(self) -> None:
        self._note("wake_for_sync")

    def send(self, weights):
        self._note("send")
        self.engine = {name: tensor.detach().clone() for name, tensor in weights}

        class Sent:
            bytes = sum(tensor.nbytes for tensor in self.engine.values())

        return Sent()

    def wake_for_rollout(self) -> None:
        self._note("wake_for_rollout")

    def sleep_for_training(self) -> None:
        self._note("sleep_for_training")


def cycle_with(**link_knobs):
    model = torch.nn.Linear(16, 8)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    optimizer.step()
    box: list = []
    link = EngineLink(box, **link_knobs)
    adapter = FSDPAdapter(model, optimizer)
    box.append(adapter)
    return model, adapter, link, RefitCycle(adapter, link)


def test_the_cycle_drives_the_engines_memory_in_order():
    model, adapter, link, cycle = cycle_with()
    expected = {name: param.detach().clone() for name, param in model.named_parameters()}
    with cycle:
        report = cycle.refit(0)
        assert [phase.name for phase in report.phases] == [
            "engine_wake_weights",
            "sync_weights",
            "offload",
            "flush_device",
            "barrier",
            "engine_wake_kv_cache",
        ]
        for earlier, later in zip(report.phases, report.phases[1:]):  # one after the other, none inside another
            assert earlier.start_s + earlier.seconds <= later.start_s
        resumed = cycle.resume(0)
    assert [phase.name for phase in resumed.phases] == ["engine_sleep", "reload", "barrier"]
    assert link.events == [
        ("wake_for_sync", "on_device"),
        ("send", "on_device"),
        ("wake_for_rollout", "offloaded"),  # the KV cache comes back only once the trainer's state is off the device
        ("sleep_for_training", "offloaded"),  # and the engine lets go before the trainer's state returns
    ]
    assert adapter.state is DeviceState.ON_DEVICE
    assert all(torch.equal(link.engine[name], tensor) for name, tensor in expected.items())


def test_a_failed_wake_of_the_weights_fails_the_sync_and_offloads_nothing():
    _, adapter, link, cycle = cycle_with(fail="wake_for_sync")
    with cycle, pytest.raises(RuntimeError, match="the engine refused wake_for_sync"):
        cycle.refit(0)
    assert [step for step, _ in link.events] == ["wake_for_sync"]  # nothing was sent
    assert adapter.state is DeviceState.ON_DEVICE


def test_a_refused_kv_wake_is_raised_after_the_offload():
    _, adapter, link, cycle = cycle_with(fail="wake_for_rollout")
    with cycle, pytest.raises(RecoveryNeeded, match="the engine refused wake_for_rollout") as caught:
        cycle.refit(0)
    assert caught.value.recovery == "call cycle.resume() on every rank" and str(caught.value).endswith(
        caught.value.recovery
    )
    assert isinstance(caught.value.__cause__, RuntimeError)  # the link's own error
    assert adapter.state is DeviceState.OFFLOADED  # the trainer's memory is free; the wake can be retried
    link.fail = None
    link.wake_for_rollout()
    assert link.events[-1] == ("wake_for_rollout", "offloaded")


def test_a_link_that_does_not_drive_memory_is_only_sent_to():
    _, _, link, cycle = cycle_with(drives_memory=False)
    with cycle:
        report = cycle.refit(0)
        resumed = cycle.resume(0)
    assert [step for step, _ in link.events] == ["send"]
    assert [phase.name for phase in report.phases] == ["sync_weights", "offload", "flush_device", "barrier"]
    assert [phase.name for phase in resumed.phases] == ["reload", "barrier"]
