"""Weight versions and sync coverage on the engine side (refitkit.rollout.versions), and the old import path."""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys

import pytest

from refitkit.rollout.versions import EngineWeights, coverage_of
from refitkit.transfer import WeightVersion

pytestmark = pytest.mark.timeout(60)

NAMES = frozenset(f"model.layers.{layer}.{part}.weight" for layer in range(7) for part in ("q", "k", "v"))  # 21


def test_a_whole_sync_makes_the_weights_clean_at_its_version():
    state = EngineWeights()
    assert state.version == WeightVersion(None, None) and state.next_version() == 0
    state.landed(5, coverage_of(set(NAMES), NAMES))
    assert state.version == WeightVersion(5, None) and state.version.clean
    assert state.next_version() == 6
    assert state.as_dict() == {
        "version": 5,
        "incomplete": None,
        "clean": True,
        "received": 21,
        "expected": 21,
        "missing": [],
        "failed": None,
    }


def test_a_partial_sync_is_incomplete_and_names_what_it_missed():
    state = EngineWeights()
    state.landed(1, coverage_of(set(NAMES), NAMES))
    delivered = set(sorted(NAMES)[:3])
    coverage = coverage_of(delivered, NAMES)
    state.landed(2, coverage)
    assert not coverage.complete and len(coverage.missing) == 18
    assert coverage.describe().startswith("3 of the 21 weights the engine loads (missing 'model.layers.1.k.weight'")
    assert coverage.describe().endswith("and 10 more)")
    assert state.version == WeightVersion(1, 2) and not state.version.clean  # the last whole sync was 1; 2 is partial
    state.landed(3, coverage_of(set(NAMES) - delivered, NAMES))  # the other part does not add up to a whole sync
    assert state.version == WeightVersion(1, 3)
    state.landed(4, coverage_of(set(NAMES), NAMES))
    assert state.version == WeightVersion(4, None)


def test_a_failed_sync_marks_incomplete_only_when_it_touched_the_weights():
    state = EngineWeights()
    state.landed(0, coverage_of(set(NAMES), NAMES))
    state.failed(1, touched=False)  # nothing reached the loader: the weights are still version 0
    assert state.version == WeightVersion(0, None)
    assert state.as_dict()["failed"] is None
    state.failed(2, touched=True, handed=coverage_of(set(sorted(NAMES)[:4]), NAMES))
    assert state.version == WeightVersion(0, 2) and state.next_version() == 3
    failed = state.as_dict()["failed"]  # what the broken sync had handed over, for the trainer's PartialPush
    assert (failed["version"], failed["received"], failed["expected"], len(failed["missing"])) == (2, 4, 21, 17)
    state.landed(3, coverage_of(set(NAMES), NAMES))
    assert state.as_dict()["failed"] is None  # a sync that landed: nothing failed since


def test_unknown_engine_names_leave_coverage_to_the_stream():
    coverage = coverage_of({"a", "b"}, None)
    assert coverage.complete and coverage.expected is None and "unknown" in coverage.describe()


def test_the_old_import_path_is_gone():
    """The deprecated ``refitkit.transfer.vllm`` shim was removed: the one home is ``refitkit.rollout.vllm``."""
    script = "import refitkit.transfer.vllm"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=50)
    assert result.returncode != 0 and "No module named 'refitkit.transfer.vllm'" in result.stderr


@pytest.mark.parametrize(
    "files,message",
    [
        ({"model.safetensors.index.json": b'{"metadata": {}}'}, "no weight_map object"),
        ({"model.safetensors.index.json": b"[1, 2]"}, "no weight_map object"),
        ({"model.safetensors": b"\x05\x00"}, "shorter than a safetensors header"),
        ({"model.safetensors": b"\x02\x00\x00\x00\x00\x00\x00\x00[]"}, "its header is not a JSON object"),
        ({"model.safetensors": b'\x04\x00\x00\x00\x00\x00\x00\x00{"a"'}, "Expecting"),
        ({"model.safetensors": b'\x0f\x00\x00\x00\x00\x00\x00\x00{"a": {"x": 1}}'}, "tensor 'a' has no shape list"),
    ],
)
def test_a_malformed_checkpoint_index_or_header_is_a_value_error_naming_the_file(tmp_path, files, message):
    """The worker leaves coverage unknown on ValueError/OSError; anything else would fail every sync."""
    from refitkit.rollout.checkpoint_names import _safetensors_shapes

    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    with pytest.raises(ValueError, match=message):
        _safetensors_shapes(str(tmp_path))


def _safetensors(path, tensors: dict[str, list[int]]) -> None:
    """A safetensors file's header (names, dtypes, shapes, offsets) and zero bytes for the data."""
    header, offset = {}, 0
    for name, shape in tensors.items():
        size = 4 * math.prod(shape)
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))


def test_a_checkpoints_shapes_come_from_the_headers_of_the_files_its_index_lists(tmp_path):
    from refitkit.rollout.checkpoint_names import checkpoint_weight_names, checkpoint_weight_shapes

    _safetensors(tmp_path / "model-1.safetensors", {"embed.weight": [16, 4], "lm_head.weight": [16, 4]})
    _safetensors(tmp_path / "model-2.safetensors", {"norm.weight": [4]})
    _safetensors(tmp_path / "stray.safetensors", {"not.listed": [1]})  # not in the index: not the checkpoint's
    index = {
        "weight_map": {
            "embed.weight": "model-1.safetensors",
            "lm_head.weight": "model-1.safetensors",
            "norm.weight": "model-2.safetensors",
        }
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))

    shapes = checkpoint_weight_shapes(str(tmp_path), revision=None, tied_embeddings=False)
    assert shapes == {"embed.weight": (16, 4), "lm_head.weight": (16, 4), "norm.weight": (4,)}
    tied = checkpoint_weight_shapes(str(tmp_path), revision=None, tied_embeddings=True)
    assert tied == {"embed.weight": (16, 4), "norm.weight": (4,)}
    assert checkpoint_weight_names(str(tmp_path), revision=None, tied_embeddings=True) == frozenset(tied)
