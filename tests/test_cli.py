"""The `refitkit` command line, run for real (`python -m refitkit.cli` in a subprocess): exit codes and messages."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import psutil
import pytest
import torch

from refitkit.cli import build_parser, main

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parent.parent
GIB = 1 << 30
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")


def refitkit(*argv: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess:
    """``python -m refitkit.cli ARGV`` with this checkout first on the path."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))))
    return subprocess.run(
        [sys.executable, "-m", "refitkit.cli", *argv],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
        cwd=ROOT,
    )


def test_version_comes_from_the_package_metadata():
    done = refitkit("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"refitkit {importlib.metadata.version('refitkit')}\n"


def test_every_option_carries_help_text():
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert sorted(subparsers.choices) == ["audit", "bench", "demo"]
    for name, sub in [("refitkit", parser), *subparsers.choices.items()]:
        for action in sub._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            assert action.help, f"{name} {'/'.join(action.option_strings)} has no help text"
    shown = refitkit("demo", "--help")
    assert shown.returncode == 0 and "train/refit/resume rounds" in shown.stdout and "cuda:N" in shown.stdout


BAD_OPTIONS = [
    (
        ["audit", "--window", "2"],
        "refitkit audit: error: argument --window: must be >= 3 (a trend needs 3 cycles), got 2",
    ),
    (["audit", "--width", "0"], "refitkit audit: error: argument --width: must be >= 1, got 0"),
    (["audit", "--width", "-3"], "refitkit audit: error: argument --width: must be >= 1, got -3"),
    (["audit", "--width", "1000000"], "refitkit audit: error: --width 1000000: the demo model needs ~"),
    (["audit", "--warmup", "-1"], "refitkit audit: error: argument --warmup: must be >= 0, got -1"),
    (["audit", "--cycles", "x"], "refitkit audit: error: argument --cycles: expected an integer, got 'x'"),
    (
        ["audit", "--cycles", "2"],
        "refitkit audit: error: --cycles 2 leaves no cycle to judge after --warmup 5: need --cycles >= 8",
    ),
    (
        ["audit", "--threshold-mib-per-cycle", "nan"],
        "refitkit audit: error: argument --threshold-mib-per-cycle: must be a finite number > 0",
    ),
    (
        ["audit", "--threshold-mib-per-cycle", "inf"],
        "refitkit audit: error: argument --threshold-mib-per-cycle: must be a finite number > 0",
    ),
    (
        ["audit", "--plot", "/nonexistent-refitkit/audit.png"],
        "refitkit audit: error: --plot /nonexistent-refitkit/audit.png: folder /nonexistent-refitkit does not exist",
    ),
    (["audit", "--plot", "/tmp"], "refitkit audit: error: --plot /tmp: is a folder; give a file name"),
    (["demo", "--rounds", "0"], "refitkit demo: error: argument --rounds: must be >= 1, got 0"),
    (["demo", "--rounds", "-1"], "refitkit demo: error: argument --rounds: must be >= 1, got -1"),
    (
        ["demo", "--device", "bogus"],
        "refitkit demo: error: --device 'bogus': not a device (expected cpu, cuda or cuda:N)",
    ),
    (["demo", "--device", "meta"], "refitkit demo: error: --device meta: the demo runs on cpu or cuda"),
    (
        ["bench", "--only", "nope"],
        "refitkit bench: error: --only nope: no such benchmark (choose from fsdp_offload, megatron_offload, offload, pinning, refit_cycle, sync_floor, weight_sync)",
    ),
    (
        ["bench", "--host-memory-gib", "-1"],
        "refitkit bench: error: argument --host-memory-gib: must be a finite number > 0, got '-1'",
    ),
    (
        ["bench", "--gpu-memory-gib", "nan"],
        "refitkit bench: error: argument --gpu-memory-gib: must be a finite number >= 0, got 'nan'",
    ),
    pytest.param(
        ["demo", "--device", "cuda"], "refitkit demo: error: --device cuda: CUDA is not available here", marks=NO_CUDA
    ),
    pytest.param(
        ["audit", "--memory-history", "/tmp/h.pickle"],
        "refitkit audit: error: --memory-history records the CUDA allocator: no CUDA device here",
        marks=NO_CUDA,
    ),
    (["audit", "--plot", "/tmp/" + "x" * 300 + ".png"], "refitkit audit: error: --plot /tmp/xxx"),
]


@pytest.mark.parametrize(
    ("argv", "message"), BAD_OPTIONS, ids=lambda v: " ".join(v)[:60] if isinstance(v, list) else ""
)
def test_bad_options_end_in_one_error_line_and_status_2(argv, message, capsys):
    # in this process for speed (each subprocess imports torch); the test below runs a few for real
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    out, err = capsys.readouterr()
    assert err.splitlines()[-1].startswith(message), err
    assert out == ""  # nothing ran


@pytest.mark.parametrize(
    ("argv", "message"),
    [BAD_OPTIONS[0], BAD_OPTIONS[3], BAD_OPTIONS[12], BAD_OPTIONS[15]],  # each of these was a traceback before
    ids=["audit --window 2", "audit --width 1000000", "demo --device bogus", "bench --host-memory-gib -1"],
)
def test_bad_options_from_the_real_command_line(argv, message):
    done = refitkit(*argv)
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert done.stderr.splitlines()[-1].startswith(message), done.stderr
    assert done.stdout == ""


def test_bench_skips_gpu_benchmarks_without_a_gpu_and_exits_0():
    done = refitkit("bench", "--only", "offload,pinning,megatron_offload", "--gpu-memory-gib", "0")
    assert done.returncode == 0, done.stderr
    for script in ("megatron_offload.py", "offload.py", "pinning.py"):
        assert f"== {script}: skipped (needs a CUDA GPU)" in done.stdout


def _planned_args(stdout: str, script: str) -> list[str]:
    line = next(line for line in stdout.splitlines() if line.startswith(f"== {script}"))
    return line.split("  [")[0].split()[2:]


def test_bench_on_a_small_machine_sizes_fsdp_offload_down_or_skips_it():
    done = refitkit("bench", "--dry-run", "--host-memory-gib", "2", "--gpu-memory-gib", "0")
    assert done.returncode == 0, done.stderr
    args = _planned_args(done.stdout, "fsdp_offload.py")
    assert args[:4] == ["--device", "cpu", "--layers", "1"], done.stdout
    assert args[4] == "--vocab-size" and 1024 <= int(args[5]) < 151936
    assert "sized to the machine: 1 of 28 layers" in done.stdout
    tiny = refitkit("bench", "--dry-run", "--host-memory-gib", "0.5", "--gpu-memory-gib", "0")
    assert tiny.returncode == 0
    assert re.search(
        r"== fsdp_offload.py: skipped \(even 1 layer with a 1024-row vocabulary needs ~1\.\d GiB; budget 0\.5 GiB host",
        tiny.stdout,
    )


def test_bench_sizes_fsdp_offload_to_this_machines_available_memory():
    sys.path.insert(0, str(ROOT))
    from benchmarks._sizing import (
        FSDP_FULL_LAYERS,
        FSDP_FULL_VOCAB,
        fsdp_offload_peak,
        plan_fsdp_offload,
        probe_machine,
    )

    machine = probe_machine(gpu_bytes=0)  # the real psutil figure
    assert 0 < machine.host_bytes <= psutil.virtual_memory().total
    plan = plan_fsdp_offload(machine)
    full, _ = fsdp_offload_peak(FSDP_FULL_LAYERS, FSDP_FULL_VOCAB, gpu=False)
    if full > machine.host_bytes:  # e.g. the 24 GiB CI machine, where the full size was killed at 24 GB RSS
        assert plan.runs and "--layers" in plan.args, plan
        sizes = dict(zip(plan.args[2::2], map(int, plan.args[3::2])))
        peak, _ = fsdp_offload_peak(sizes["--layers"], sizes["--vocab-size"], gpu=False)
        assert peak <= machine.host_bytes
    else:
        assert plan.args == ("--device", "cpu"), plan


def test_sized_fsdp_offload_stays_within_its_host_budget():
    """The estimate the plan trusts is an upper bound: the benchmark's real peak RSS stays under the budget."""
    budget_gib = 2.0
    wrapper = (
        "import resource, subprocess, sys\n"
        "rc = subprocess.run([sys.executable, '-m', 'refitkit.cli', *sys.argv[1:]]).returncode\n"
        "print('PEAK_KIB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"  # largest waited-for descendant
        "sys.exit(rc)\n"
    )
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))),
        OMP_NUM_THREADS="1",
    )
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            wrapper,
            "bench",
            "--only",
            "fsdp_offload",
            "--host-memory-gib",
            str(budget_gib),
            "--gpu-memory-gib",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=200,
        env=env,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "sized to the machine" in done.stdout and "offload_vs_flat" in done.stdout
    peak_bytes = int(done.stdout.split("PEAK_KIB")[-1]) * 1024
    assert 0 < peak_bytes <= budget_gib * GIB, f"peak RSS {peak_bytes / GIB:.2f} GiB over a {budget_gib} GiB budget"


@pytest.mark.cuda
def test_bench_plan_on_a_gpu_machine_runs_every_gpu_benchmark():
    """On the H200 (139 GiB free, 128 GiB host) nothing is skipped for size; only a missing megatron-core may skip."""
    done = refitkit("bench", "--dry-run")
    assert done.returncode == 0, done.stderr
    assert "no GPU" not in done.stdout
    for script in ("fsdp_offload.py", "offload.py", "pinning.py", "refit_cycle.py", "weight_sync.py"):
        line = next(line for line in done.stdout.splitlines() if line.startswith(f"== {script}"))
        assert "skipped" not in line and "--device cpu" not in line and "--cpu-overhead" not in line, line
    megatron = next(line for line in done.stdout.splitlines() if line.startswith("== megatron_offload.py"))
    assert "skipped" not in megatron or "needs megatron-core" in megatron, megatron


def test_the_wheel_ships_py_typed(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "refitkit", source / "refitkit", ignore=shutil.ignore_patterns("__pycache__"))
    build = "import sys; from setuptools import build_meta; print(build_meta.build_wheel(sys.argv[1]))"
    done = subprocess.run(
        [sys.executable, "-c", build, str(tmp_path / "dist")], capture_output=True, text=True, cwd=source, timeout=180
    )
    assert done.returncode == 0, done.stderr
    wheel = tmp_path / "dist" / done.stdout.strip().splitlines()[-1]
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    assert "refitkit/py.typed" in names and "refitkit/cli.py" in names


# Makes numpy unimportable in the trainer (the `refitkit demo` process) or only in the peer it spawns: torch then
# raises "Numpy is not available" at that side's first .numpy(), a real failure of one side, as a torch-only install had.
_NUMPY_BLOCKED = """
import importlib.abc
import importlib.machinery
import sys


class _NoNumpy(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        return importlib.machinery.ModuleSpec(name, self) if name == "numpy" else None

    def create_module(self, spec):
        raise ModuleNotFoundError("No module named 'numpy' (blocked by the test)", name=spec.name)

    def exec_module(self, module):
        pass


if ("--multiprocessing-fork" in sys.argv) == {in_peer}:
    sys.meta_path.insert(0, _NoNumpy())
"""


@pytest.mark.parametrize(
    ("side", "message"),
    [
        (
            "trainer",
            "refitkit demo: error: RefitError: demo trainer failed at round 0: RuntimeError: Numpy is not available",
        ),
        (
            "peer",
            "refitkit demo: error: TransferError: demo peer failed before sending its digest of round 0: "
            "RuntimeError: Numpy is not available",
        ),
    ],
)
def test_demo_ends_fast_in_one_error_line_when_a_side_fails(side, message, tmp_path):
    # the trainer used to wait PEER_TIMEOUT_S (120 s) for a peer that waited on it, then print a raw traceback;
    # a failed peer printed its own traceback
    (tmp_path / "sitecustomize.py").write_text(_NUMPY_BLOCKED.format(in_peer=side == "peer"))
    path = os.pathsep.join(filter(None, (str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH"))))
    env = dict(os.environ, PYTHONPATH=path, PYTHONWARNINGS="ignore::UserWarning")  # torch warns that numpy failed
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "refitkit.cli", "demo", "--rounds", "1", "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=90,
        env=env,
        cwd=tmp_path,
    )
    assert time.monotonic() - start < 60, "the demo waited on the side that failed"
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert done.stderr.splitlines() == [message], done.stderr


def _installed_copy(tmp_path: Path) -> Path:
    """The package alone in a site folder, as `pip install .` leaves it: no benchmarks/ beside it."""
    site = tmp_path / "site"
    shutil.copytree(ROOT / "refitkit", site / "refitkit", ignore=shutil.ignore_patterns("__pycache__"))
    return site


def test_bench_outside_a_checkout_says_where_benchmarks_run_and_exits_1(tmp_path):
    site = _installed_copy(tmp_path)
    env = dict(os.environ, PYTHONPATH=str(site))
    done = subprocess.run(
        [sys.executable, "-m", "refitkit.cli", "bench", "--dry-run"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert done.stdout == ""
    assert done.stderr.splitlines() == [
        "refitkit bench: error: benchmarks run from a source checkout, not from an installed package "
        f"(no benchmarks/ beside {site}): in a clone of the repository, run `make bench`, "
        "or `refitkit bench` with refitkit installed from it by `pip install -e .`"
    ], done.stderr


def test_bench_help_says_it_needs_a_checkout():
    shown = refitkit("bench", "--help")
    assert shown.returncode == 0
    assert "exits 1 outside a source checkout" in " ".join(shown.stdout.split())
