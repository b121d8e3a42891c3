"""The overlapped offload on a GPU: the caller is not held while the launch queue is full, the copies are
exact, and a stalled copy engine ends in a bounded RefitError that frees nothing."""

from __future__ import annotations

import pytest
import torch

from refitkit.errors import RefitError
from refitkit.offload import HostArena, overlapped
from refitkit.offload.overlapped import cancel_offload, finish_offload, start_offload
from tests.offload.test_moves import random_tensor

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(180)]

# more copies than a stream's launch queue holds (~1020 on the H200 machine): issuing them all from the caller's
# thread would hold it until the copy engine drained most of them
COPIES = 2500
SLEEP_CYCLES = (
    1_000_000_000  # ~0.5 s (at ~2 GHz) of a busy kernel on the current stream, ahead of the side stream's copies
)


def _state() -> dict[str, torch.Tensor]:
    return {f"s{i}": random_tensor((4096,), torch.float32, seed=i).cuda() for i in range(COPIES)}


def test_start_offload_returns_while_the_copies_wait_and_finish_is_exact():
    state, arena = _state(), HostArena()
    expected = {name: t.cpu() for name, t in state.items()}
    arena.reserve(t.untyped_storage() for t in state.values())
    torch.cuda._sleep(4 * SLEEP_CYCLES)  # the side stream waits for it: no copy can run yet
    copies = start_offload(state, arena)
    try:
        assert not torch.cuda.current_stream().query(), "start_offload returned while the queued work still ran"
    except AssertionError:
        cancel_offload(copies)  # no issuing thread outlives the test
        raise
    finish_offload(copies)
    assert all(t.untyped_storage().nbytes() == 0 for t in state.values())
    for name, tensor in state.items():
        slot = arena.slot_of(tensor.untyped_storage())
        assert torch.equal(arena.host_bytes(slot, slot.nbytes).view(torch.int32), expected[name].view(torch.int32)), (
            name
        )


def test_a_stalled_issue_times_out_frees_nothing_and_cancel_waits(monkeypatch):
    state, arena = _state(), HostArena()
    expected = {name: t.cpu() for name, t in state.items()}
    arena.reserve(t.untyped_storage() for t in state.values())
    torch.cuda._sleep(4 * SLEEP_CYCLES)  # the copy engine "stalls" behind it for ~2 s
    monkeypatch.setattr(overlapped, "ISSUE_TIMEOUT_S", 0.05)
    copies = start_offload(state, arena)
    with pytest.raises(
        RefitError,
        match=r"finish_offload: the overlapped offload's copies were not all issued within "
        r"0\.05 s .*nothing was freed; raise refitkit\.offload\.overlapped\.ISSUE_TIMEOUT_S",
    ):
        finish_offload(copies)
    monkeypatch.setattr(overlapped, "ISSUE_TIMEOUT_S", 60.0)
    cancel_offload(copies)
    assert copies.issuer is not None and not copies.issuer.is_alive()
    assert all(torch.equal(t.cpu().view(torch.int32), expected[name].view(torch.int32)) for name, t in state.items()), (
        "every storage stays on the device"
    )
    assert not any(arena.slot_of(t.untyped_storage()).holds_data for t in state.values())


def _exit_while_issuing() -> None:
    """A process that starts an overlapped offload and exits without finishing or cancelling it."""
    state, arena = _state(), HostArena()
    arena.reserve(t.untyped_storage() for t in state.values())
    torch.cuda._sleep(4 * SLEEP_CYCLES)  # the copies wait behind it: the worker is still issuing at exit
    copies = start_offload(state, arena)
    assert copies.issuer is not None and copies.issuer.is_alive()
    print("exiting", flush=True)


def test_a_process_exiting_while_copies_are_issued_exits_cleanly():
    import subprocess
    import sys

    code = "from tests.offload.test_cuda_overlapped import _exit_while_issuing as f; f()"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "exiting" in done.stdout and "terminate called" not in done.stderr
