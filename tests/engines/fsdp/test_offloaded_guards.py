"""While a part is offloaded its tensors keep their identity with 0-byte storages: what would read or save them is
refused with ``OffloadedStateError`` (before: a segfault, garbage or an unloadable checkpoint). Each call runs in a
child process, so a crash shows as the child's exit code instead of taking pytest down."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

CHILD = r"""
import sys, torch
from refitkit.engines.fsdp import FSDPAdapter
from refitkit.errors import OffloadedStateError
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
optimizer = torch.optim.AdamW(model.parameters())
model(torch.randn(4, 64)).sum().backward()
optimizer.step()
adapter = FSDPAdapter(model, optimizer)
adapter.offload(**{PARTS})
try:
    {CALL}
except OffloadedStateError as exc:
    print("REFUSED", exc)
    adapter.reload()
    model(torch.randn(4, 64)).sum().backward()  # reloaded: everything works again
    optimizer.step()
    print("WORKS AFTER RELOAD", len(model.state_dict()), len(optimizer.state_dict()["state"]))
    sys.exit(0)
print("NOT REFUSED")
"""

CASES = {
    "forward": ("{}", "model(torch.randn(4, 64))", "Sequential.forward() while the model state is offloaded"),
    "state_dict": ("{}", "model.state_dict()", "the model's state_dict() while the model state is offloaded"),
    "torch_save": ("{}", "torch.save(model.state_dict(), sys.argv[1])", "the model's state_dict()"),
    "step": ("{}", "optimizer.step()", "AdamW.step() while the model and optimizer state is offloaded"),
    "step_params_only": ("{'optimizer': False}", "optimizer.step()", "AdamW.step() while the model state is offloaded"),
    "optimizer_state_dict": (
        "{}",
        "optimizer.state_dict()",
        "AdamW.state_dict() while the optimizer state is offloaded",
    ),
}


def run_child(parts: str, call: str, path: Path) -> subprocess.CompletedProcess:
    source = CHILD.replace("{PARTS}", parts).replace("{CALL}", call)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-c", source, str(path)], capture_output=True, text=True, timeout=120, env=env
    )


@pytest.mark.timeout(150)
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_call_on_offloaded_state_is_refused_and_reload_brings_it_back(case, tmp_path):
    parts, call, message = CASES[case]
    checkpoint = tmp_path / "model.pt"
    result = run_child(parts, call, checkpoint)
    assert result.returncode == 0, f"rc {result.returncode}: {result.stdout[-2000:]} {result.stderr[-2000:]}"
    assert "REFUSED" in result.stdout and message in result.stdout, result.stdout
    assert "adapter.reload()" in result.stdout  # the message says what to do
    assert "WORKS AFTER RELOAD 4 4" in result.stdout
    assert not checkpoint.exists()  # no unloadable checkpoint was written


@pytest.mark.timeout(150)
def test_the_optimizer_may_save_while_only_the_params_are_offloaded(tmp_path):
    result = run_child(
        "{'optimizer': False}", "optimizer.state_dict(); print('SAVED'); raise OffloadedStateError('x')", tmp_path / "x"
    )
    assert "SAVED" in result.stdout and result.returncode == 0, result.stdout + result.stderr
