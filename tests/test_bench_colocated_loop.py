"""benchmarks/colocated_loop.py's Mixture-of-Experts models without a GPU: the layer estimate and ``--dry-run``.

The run itself needs a GPU and GPU vLLM. What a CPU can check: the estimate of how many Qwen3-30B-A3B layers fit an
80 GB H100 is the largest count that satisfies its own inequality; the layer sizes it counts are the model's; and
``--dry-run`` builds the tiny MoE, writes its checkpoint (reused by the next run), streams ``FSDPAdapter``'s weights
equal to that checkpoint bit for bit, and plans 30B-A3B on the meta device.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import colocated_loop  # noqa: E402
from benchmarks.shapes import QWEN3_30B_A3B, moe_layer_params, moe_outer_params  # noqa: E402

TRANSFORMERS_MOE = importlib.util.find_spec("transformers") is not None and (
    importlib.util.find_spec("transformers.core_model_loading") is not None
)


def test_the_layer_estimate_is_the_most_layers_its_inequality_admits():
    per_layer, outer = moe_layer_params(QWEN3_30B_A3B), moe_outer_params(QWEN3_30B_A3B)
    # Qwen3-30B-A3B's published total (30.5 B) from the same counts: 48 layers and the untied embeddings
    assert per_layer == 623_120_640 and outer == 622_331_904
    assert 48 * per_layer + outer == 30_532_122_624

    total, bucket = colocated_loop.H100_TOTAL_BYTES, 2 << 30
    for utilization in (0.2, 0.3, 0.4):
        layers, arithmetic = colocated_loop.layers_that_fit(QWEN3_30B_A3B, utilization=utilization, bucket_bytes=bucket)
        budget = int(utilization * total)
        fixed = colocated_loop.PROCESS_BYTES + bucket + colocated_loop.LAYERWISE_LAYERS * per_layer * 2

        def fits(count: int, budget: int = budget, fixed: int = fixed) -> bool:
            params = outer + count * per_layer
            trainer = 8 * params  # bf16 params and grads, AdamW's two states in bf16
            weights = 2 * params + colocated_loop.ENGINE_ACTIVATION_BYTES
            return trainer + budget + fixed <= total and weights <= budget

        assert layers >= 1 and fits(layers) and not fits(layers + 1), utilization
        assert arithmetic["layers"] == layers and arithmetic["trainer_bytes_per_param"] == 8
    # a bigger engine budget leaves the trainer less
    assert colocated_loop.layers_that_fit(QWEN3_30B_A3B, utilization=0.3, bucket_bytes=bucket)[0] == 9
    assert colocated_loop.layers_that_fit(QWEN3_30B_A3B, utilization=0.5, bucket_bytes=bucket)[0] == 5


def dry_run(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    out = tmp_path / "plan.json"
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))),
        OMP_NUM_THREADS="1",
    )
    done = subprocess.run(
        [sys.executable, "benchmarks/colocated_loop.py", "--dry-run", "--json", str(out), *args],
        capture_output=True,
        text=True,
        timeout=280,
        env=env,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done, json.loads(out.read_text())


@pytest.mark.skipif(not TRANSFORMERS_MOE, reason="needs transformers 5 (its MoE models and core_model_loading)")
def test_the_dry_run_writes_the_tiny_checkpoint_streams_it_and_plans_30b_a3b(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    done, (tiny, big) = dry_run(tmp_path, "--models", "30b-a3b-tiny,30b-a3b", "--checkpoint", str(checkpoints))

    estimate = done.stdout.index("[30b-a3b] layers that fit one 80 GB H100: 9 (8 B/param x ")
    assert estimate < done.stdout.index("[30b-a3b] plan: 9 layers")  # printed before the model is built

    assert max(max(prompt) for prompt in colocated_loop.PROMPTS) < 1024  # the tiny vocabulary holds every prompt
    # the tiny model: 2 layers of 16 experts; per layer 9 dense weights and 3 per expert, plus embed, norm, lm_head
    assert (tiny["model"], tiny["device"], tiny["layers"], tiny["optimizer"]) == ("30b-a3b-tiny", "cpu", 2, "fused")
    assert tiny["params"] == tiny["params_by_shapes"] == 1_151_872
    assert (tiny["push_tensors"], tiny["push_expert_tensors"]) == (3 + 2 * (9 + 3 * 16), 2 * 3 * 16)
    assert tiny["push_bytes"] == tiny["weight_bytes"] == 2 * 1_151_872
    assert tiny["push_views_of_fused"] is True
    written = checkpoints / "qwen3-30b-a3b-tiny-2l"
    assert tiny["checkpoint"] == str(written) and (written / "config.json").is_file()
    assert tiny["checkpoint_tensors"] == tiny["push_tensors"]
    assert tiny["checkpoint_names_equal"] is True and tiny["checkpoint_values_equal"] is True
    config = tiny["checkpoint_config"]
    assert (config["model_type"], config["num_hidden_layers"], config["moe_intermediate_size"]) == ("qwen3_moe", 2, 64)
    engine = dict((name, shape) for name, shape in tiny["engine_params_checked"])
    assert engine["model.layers.1.mlp.experts.routed_experts.w13_weight"] == [16, 2 * 64, 128]
    assert engine["model.layers.1.mlp.experts.routed_experts.w2_weight"] == [16, 128, 64]
    assert engine["model.layers.1.self_attn.qkv_proj.weight"] == [(2 + 2 * 1) * 64, 128]

    # 30B-A3B: on the meta device (no checkpoint), its real widths, the estimated layers
    assert (big["device"], big["layers"], big["fit"]["layers"], big["checkpoint"]) == ("meta", 9, 9, None)
    assert big["params"] == big["params_by_shapes"] == 9 * 623_120_640 + 622_331_904
    assert (big["push_tensors"], big["push_expert_tensors"]) == (3 + 9 * (9 + 3 * 128), 9 * 3 * 128)
    assert big["push_bytes"] == big["weight_bytes"] == 2 * big["params"]
    engine = dict((name, shape) for name, shape in big["engine_params_checked"])
    assert engine["model.layers.8.mlp.experts.routed_experts.w13_weight"] == [128, 2 * 768, 2048]
    assert engine["model.layers.8.mlp.experts.routed_experts.w2_weight"] == [128, 2048, 768]
    assert engine["model.layers.8.self_attn.qkv_proj.weight"] == [(32 + 2 * 4) * 128, 2048]
    assert big["engine"] == {
        "quantization": None,
        "gpu_memory_utilization": 0.3,
        "enable_sleep_mode": True,
        "max_model_len": 1024,
    }

    # the next run reuses the checkpoint (a file left in it stays) and its weights are still the stream's
    (written / "left-by-the-first-run").write_text("")
    _, (again,) = dry_run(
        tmp_path, "--models", "30b-a3b-tiny", "--checkpoint", str(checkpoints), "--quantization", "fp8"
    )
    assert (written / "left-by-the-first-run").is_file()
    assert again["checkpoint_values_equal"] is True and again["engine"]["quantization"] == "fp8"
    # another layer count is another checkpoint
    _, (three,) = dry_run(tmp_path, "--models", "30b-a3b-tiny", "--checkpoint", str(checkpoints), "--layers", "3")
    assert three["checkpoint"] == str(checkpoints / "qwen3-30b-a3b-tiny-3l") and three["push_tensors"] == 3 + 3 * (
        9 + 3 * 16
    )
    assert three["checkpoint_values_equal"] is True


def test_the_dry_run_refuses_dense_models_and_unknown_ones(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))))
    for models, message in (
        ("0.6b", "--dry-run plans the MoE models only, not ['0.6b']"),
        ("30b-a3b,70b", "--models: unknown ['70b']; choose from ['0.6b', '8b', '30b-a3b', '30b-a3b-tiny']"),
    ):
        done = subprocess.run(
            [sys.executable, "benchmarks/colocated_loop.py", "--dry-run", "--models", models],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
            cwd=ROOT,
        )
        assert done.returncode == 2 and message in done.stderr, done.stderr


def layerwise_report(tensors: int, nbytes: int) -> dict:
    """A vLLM worker's report of a layerwise sync, as ``WorkerReceiver.receive`` makes it (the fields read here)."""
    return {
        "bytes": nbytes,
        "tensors": tensors,
        "seconds": 0.30,
        "ack_wait_s": 0.02,
        "load_s": 0.40,
        "loader_s": 0.0,
        "post_s": 0.0,
        "direct_tensors": 0,
        "direct_bytes": 0,
        "loader_tensors": 0,
        "loader_bytes": 0,
        "load_path": "layerwise",
        "receiver_handshake_s": 0.001,
        "receiver_frames_s": 0.05,
        "receiver_packed_s": 0.0,
        "receiver_map_s": 0.004,
        "receiver_on_bucket_s": 0.0,
        "receiver_release_s": 0.02,
        "receiver_release_sync_s": 0.015,  # a part of release: not counted twice
        "receiver_close_s": 0.0,
    }


def test_a_layerwise_fp8_result_is_held_against_the_one_copy_floor_and_summarised(capsys):
    worker = layerwise_report(3540, 12_460_835_328)
    split = colocated_loop.worker_split(worker)
    assert (split["load_path"], split["direct_tensors"], split["loader_tensors"], split["layerwise_tensors"]) == (
        "layerwise",
        0,
        0,
        3540,
    )
    assert split["engine_receive_ms"] == pytest.approx(75.0)  # handshake, frames, map, release (release_sync inside)
    assert split["engine_work_ms"] == pytest.approx(400.0 - 75.0)
    floor = colocated_loop.against_floor(500.0, 12_460_835_328, 2000.0)
    assert floor["floor_ms"] == pytest.approx(6.2304, rel=1e-4)
    assert floor["sync_vs_floor"] == pytest.approx(500.0 / 6.2304, rel=1e-4)

    expected = {"model.norm.weight": [1], "model.layers.0.mlp.experts.routed_experts.w13_weight": [2]}
    before = {"model.norm.weight": [0], "model.layers.0.mlp.experts.routed_experts.w13_weight": [3], "x_scale": [1]}
    held = {"model.norm.weight": [1], "model.layers.0.mlp.experts.routed_experts.w13_weight": [4], "x_scale": [2]}
    check = colocated_loop.quantized_check(held, expected, before)
    assert check == {
        "params_equal": None,
        "engine_params": 3,
        "equal_to_trainer": 1,
        "weights_changed": 2,
        "weights_compared": 2,
    }

    rows = []
    for step in range(3):
        row = {"step": step, "traced": False, "refit_ms": 3000.0, "refit_vs_flat_d2h": 2.0, "state_gb": 49.8}
        row.update({"flush_device_ms": 50.0, "sync_weights_ms": 450.0, "sync_bytes": worker["bytes"]})
        row.update({"engine_wake_weights_ms": 30.0, "engine_wake_kv_cache_ms": 20.0, "engine_sleep_ms": 40.0})
        row.update({"sender_kept_mib": 0.0, **split, **colocated_loop.against_floor(450.0, worker["bytes"], 2000.0)})
        rows.append({**row, **check})
    pushes = []
    for push in range(3):
        row = {"push": push, "path": "direct", "sync_ms": 480.0 + push, "bytes": worker["bytes"], **split}
        pushes.append({**row, **colocated_loop.against_floor(480.0 + push, worker["bytes"], 2000.0)})
    pushes[-1].update(params_equal=None, same_as_after_refit=True)
    result = {
        "model": "30b-a3b",
        "layers": 9,
        "experts_implementation": "grouped_mm",
        "quantization": "fp8",
        "optimizer": "fused",
        "zero_grads": False,
        "limits": {"pinned_d2h_gbps": 50.0, "d2d_gbps": 2000.0},
        "rows": rows,
        "pushes": pushes,
    }
    colocated_loop.print_summary(result)
    out = capsys.readouterr().out
    assert "30b-a3b (9 layers), fp8 engine (AdamW fused" in out
    assert "params equal every step: n/a (fp8: 1 of 3 engine params equal the trainer's" in out
    assert "sync in the refit 450.0 ms of 12.46 GB = 72.23x the one-copy floor 6.2 ms (D2D 2000 GB/s)" in out
    assert "load path layerwise, tensors direct 0 / loader 0 / layerwise 3540" in out
    assert "sync alone into the serving engine 482.0 ms = 77.36x the one-copy floor of its 12.46 GB, 6.2 ms" in out
    assert "worker: receiving 75.0 ms, the rest 325.0 ms" in out
    assert "params equal after the last push: n/a (quantized; the same bytes as after the last refit: True)" in out


def test_the_sender_and_the_worker_are_pinned_to_different_physical_cores(tmp_path):
    # a sysfs topology of 6 CPUs on 3 cores (hardware threads 0/3, 1/4, 2/5), one package
    for cpu, core in enumerate((0, 1, 2, 0, 1, 2)):
        topology = tmp_path / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text("0\n")
        (topology / "core_id").write_text(f"{core}\n")
    split = colocated_loop.split_cores
    assert split(set(range(6)), str(tmp_path)) == ({0, 1, 3, 4}, {2, 5})  # the last core, both its threads
    assert split({0, 3}, str(tmp_path)) is None  # one core's two threads only
    assert split({0, 1, 6}, str(tmp_path)) is None  # cpu6: no topology to read
    here = split()  # this machine's own topology, where it has two cores
    assert here is None or (here[0] and here[1] and not here[0] & here[1])
