"""The tests' own process helper (``tests/helpers/procs.py``): a child forks from a server that already imported
torch, froze that heap, and the child runs in the environment the test had when it started it."""

from __future__ import annotations

import pytest

from tests.helpers import procs

pytestmark = pytest.mark.timeout(120)


def _report(conn) -> None:
    import gc
    import os
    import sys

    conn.send(
        {
            "torch_preloaded": "torch" in sys.modules,
            "frozen": gc.get_freeze_count(),
            "tracked": len(gc.get_objects()),
            "variable": os.environ.get("REFITKIT_PROCS_PROBE"),
        }
    )


def test_a_child_starts_from_the_servers_frozen_heap_in_the_tests_environment(monkeypatch):
    monkeypatch.setenv("REFITKIT_PROCS_PROBE", "set by the test")
    ctx = procs.context()
    parent, child = ctx.Pipe()
    process = ctx.Process(target=_report, args=(child,))
    process.start()
    assert parent.poll(60), f"the child sent nothing (exit code {process.exitcode})"
    seen = parent.recv()
    process.join(10)
    assert seen["torch_preloaded"], seen  # forked from the server, not spawned
    assert seen["variable"] == "set by the test", seen
    # torch's import leaves ~170,000 objects; frozen, a child's full collection walks only its own (a few hundred)
    assert seen["frozen"] > 50_000 and seen["tracked"] < seen["frozen"] // 10, seen
