"""On one GPU, unshimmed (megatron-core 0.19.2): a Qwen3-like GPTModel of >= 1 B params and a small
Qwen3-MoE-like one train a step, stream in Hugging Face names over CUDA IPC to a receiver process
(bit-exact), offload, reload and train on bit-identical to a run without offload.

Run on the GPU machine: ``python -m pytest -m cuda tests/engines/megatron/test_cuda_hf.py``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile

import pytest
import torch

from tests.engines.megatron import parallel_gpt
from tests.engines.megatron.parallel_gpt import Layout
from tests.helpers.world import child_env, run_world

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(900)]

QWEN3_1B = Layout(hidden=2048, heads=16, groups=8, head_dim=128, ffn=6144, num_layers=20, vocab=32_000, tied=False)
QWEN3_MOE_SMALL = Layout(
    family="qwen3_moe", moe=True, hidden=512, heads=8, groups=4, head_dim=64, moe_ffn=256, num_layers=4, vocab=32_000
)
STREAM_TIMEOUT_S = 300.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _hf_names(layout: Layout) -> set[str]:
    """The checkpoint names transformers 5.18 loads for this config (experts one by one, as vLLM reads them)."""
    per_layer = [
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "self_attn.q_norm.weight",
        "self_attn.k_norm.weight",
    ]
    per_layer += [f"self_attn.{p}_proj.weight" for p in "qkvo"]
    if layout.moe:
        per_layer.append("mlp.gate.weight")
        per_layer += [
            f"mlp.experts.{e}.{p}_proj.weight" for e in range(parallel_gpt.EXPERTS) for p in ("gate", "up", "down")
        ]
    else:
        per_layer += [f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    names = {f"model.layers.{i}.{n}" for i in range(layout.num_layers) for n in per_layer}
    return names | {"model.embed_tokens.weight", "model.norm.weight"} | (set() if layout.tied else {"lm_head.weight"})


def gpu_world(rank: int, world_size: int, port: int, layout: Layout, out_path: str) -> dict:
    from refitkit.engines.megatron import MegatronAdapter
    from refitkit.transfer import BucketedWeightSender

    torch.distributed.destroy_process_group()
    torch.cuda.set_device(rank)
    torch.distributed.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    torch.use_deterministic_algorithms(True, warn_only=True)

    reference = parallel_gpt.build_trainer(layout)
    reference_losses = [parallel_gpt.train_step(reference, step) for step in range(3)]
    reference_weights = parallel_gpt.weights(reference)
    del reference
    torch.cuda.empty_cache()

    trainer = parallel_gpt.build_trainer(layout)
    losses = [parallel_gpt.train_step(trainer, 0)]
    adapter = MegatronAdapter(trainer.chunks, trainer.optimizer, hf_family=layout.family)
    params = sum(p.numel() for chunk in trainer.chunks for p in chunk.parameters())
    expected = {name: tensor.to("cpu", copy=True) for name, tensor in adapter.named_weights()}

    endpoint = f"megatron-hf-{os.getpid()}"
    with BucketedWeightSender(
        endpoint, bucket_bytes=512 << 20, transport="cuda_ipc", timeout_s=STREAM_TIMEOUT_S
    ) as sender:
        receiver = subprocess.Popen(
            [sys.executable, "-m", "tests.engines.megatron.stream_receiver", endpoint, out_path, str(STREAM_TIMEOUT_S)],
            env=child_env(),
        )
        try:
            stats = sender.send(adapter.named_weights())
        finally:
            receiver_rc = receiver.wait(timeout=STREAM_TIMEOUT_S)
    received = torch.load(out_path, weights_only=True)["weights"]

    allocated_before = torch.cuda.memory_allocated()
    adapter.offload()
    torch.cuda.synchronize()
    allocated_offloaded = torch.cuda.memory_allocated()
    adapter.reload()
    losses += [parallel_gpt.train_step(trainer, step) for step in (1, 2)]
    weights = parallel_gpt.weights(trainer)
    return {
        "params": params,
        "receiver_rc": receiver_rc,
        "stream_bytes": stats.bytes,
        "expected_names": sorted(expected),
        "received_names": sorted(received),
        "bit_exact": all(torch.equal(received[n], t) for n, t in expected.items() if n in received),
        "dtypes": sorted({str(t.dtype) for t in received.values()}),
        "freed_bytes": allocated_before - allocated_offloaded,
        "losses": (reference_losses, losses),
        "identical": weights.keys() == reference_weights.keys()
        and all(torch.equal(w, reference_weights[n]) for n, w in weights.items()),
    }


@pytest.mark.parametrize(
    "label,layout,min_params", [("qwen3-1b", QWEN3_1B, 10**9), ("qwen3-moe-small", QWEN3_MOE_SMALL, 10**7)]
)
def test_stream_hf_names_over_cuda_ipc_then_offload_and_train_on(label: str, layout: Layout, min_params: int) -> None:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    with tempfile.TemporaryDirectory(prefix="refitkit-megatron-gpu-") as directory:
        out_path = os.path.join(directory, "received.pt")
        (result,) = run_world(gpu_world, 1, _free_port(), layout, out_path, timeout_s=850.0)
    assert result["params"] >= min_params, result["params"]
    assert result["receiver_rc"] == 0
    assert set(result["expected_names"]) == _hf_names(layout)
    assert result["received_names"] == result["expected_names"]
    assert result["bit_exact"]
    assert result["dtypes"] == ["torch.bfloat16"]
    assert result["freed_bytes"] >= 2 * result["params"]  # at least the bf16 weights left the GPU
    reference_losses, losses = result["losses"]
    assert losses == reference_losses
    assert result["identical"]
