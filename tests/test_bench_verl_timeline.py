"""benchmarks/verl_grpo.py's timeline: each mode's update_weights laid out phase after phase, one bar a step, drawn
as a PNG (the core venv has matplotlib; verl's venv has none, and the GPU run's results are drawn here with
``--report-only``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import verl_grpo

pytestmark = pytest.mark.timeout(120)


def results() -> dict:
    naive = {"wake_weights_s": 0.5, "sync_s": 1.5, "trainer_offload_s": 0.25, "barrier_kv_wake_s": 0.75}
    refit = {"wake_weights_s": 0.25, "sync_s": 0.5, "trainer_offload_s": 0.125}  # a call that ended in its barrier
    return {
        "naive": {"steps": [{"step": 0, "phases": naive}, {"step": 1, "verl": {"timing_s/gen": 2.0}}]},
        "refitkit": {"steps": [{"step": 0, "phases": refit}]},
    }


def test_each_update_weights_is_laid_out_phase_after_phase() -> None:
    assert verl_grpo.timeline_segments(results()) == [
        ("naive", 0, "wake_weights", 0.0, 0.5),
        ("naive", 0, "sync", 0.5, 1.5),
        ("naive", 0, "trainer_offload", 2.0, 0.25),
        ("naive", 0, "barrier_kv_wake", 2.25, 0.75),
        ("refitkit", 0, "wake_weights", 0.0, 0.25),
        ("refitkit", 0, "sync", 0.25, 0.5),
        ("refitkit", 0, "trainer_offload", 0.75, 0.125),
    ]


def test_the_timeline_is_a_png_with_a_panel_a_mode(tmp_path: Path) -> None:
    matplotlib = pytest.importorskip("matplotlib")  # in the core venv through refitkit's [plot] extra
    matplotlib.use("Agg")
    import matplotlib.image

    path = tmp_path / "timeline.png"
    assert verl_grpo.timeline(results(), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, _ = matplotlib.image.imread(path).shape
    assert width == 9 * 120 and height > 200  # 9 inches at 120 dpi; two panels
    assert not verl_grpo.timeline({"naive": {"steps": [{"step": 1, "verl": {}}]}}, tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()
