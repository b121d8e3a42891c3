"""`refitkit audit` (refitkit.cli.audit over refitkit.audit.run_audit): verdict table, exit code, PNG plot."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest

from refitkit.cli import audit as main

pytestmark = pytest.mark.timeout(120)


def test_clean_run_prints_ok_verdicts_and_writes_a_png(tmp_path, capsys):
    plot = tmp_path / "audit.png"
    assert main(["--cycles", "12", "--width", "128", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    for watcher in ("host RSS", "reference cycles", "GC activity", "GPU memory"):
        assert watcher in out
    assert "LEAK" not in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000


def test_planted_cycle_is_reported_and_fails_the_run(capsys):
    enabled = gc.isenabled()
    assert main(["--cycles", "8", "--width", "128", "--plant", "cycle"]) == 1
    out = capsys.readouterr().out
    assert "LEAK" in out and "_Planted" in out and "cpu: 1.00 MiB" in out
    assert gc.isenabled() == enabled


def test_planted_bytes_leak_is_flagged_by_the_rss_watchdog(capsys):
    assert main(["--cycles", "16", "--width", "128", "--plant", "bytes", "--threshold-mib-per-cycle", "0.5"]) == 1
    out = capsys.readouterr().out
    assert "growing from cycle" in out


@pytest.mark.timeout(300)
def test_the_planted_bytes_leak_is_flagged_at_the_default_threshold_every_time(capsys):
    """It once planted exactly the threshold (1 MiB/cycle) and said "ok" on its own leak in 2 runs of 3."""
    for _ in range(3):
        assert main(["--cycles", "12", "--width", "128", "--plant", "bytes"]) == 1
        assert "growing from cycle" in capsys.readouterr().out


def test_bad_cycles_is_a_usage_error():
    with pytest.raises(SystemExit) as exited:
        main(["--cycles", "0"])
    assert exited.value.code == 2


def test_cycle_audit_exit_without_enter_is_a_refit_error_even_under_python_O():
    """Under -O an assert vanished: the bare __exit__ then ran two full collections and died on None."""
    code = (
        "import gc\n"
        "from refitkit.errors import RefitError\n"
        "from refitkit.watchdog import CycleAudit\n"
        "gc.disable()\n"
        "before = sum(s['collections'] for s in gc.get_stats())\n"
        "try:\n"
        "    CycleAudit().__exit__(None, None, None)\n"
        "except RefitError as error:\n"
        "    print('RefitError:', error)\n"
        "print('collections', sum(s['collections'] for s in gc.get_stats()) - before)\n"
    )
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(root), os.environ.get("PYTHONPATH")))))
    done = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "RefitError: CycleAudit.__exit__ without __enter__: use it as `with CycleAudit() as audit:`",
        "collections 0",
    ]
