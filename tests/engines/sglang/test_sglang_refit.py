"""On a GPU with SGLang 0.5.17: RefitCycle drives an sglang.Engine through SglangLink, over CUDA IPC and the broadcast."""

from __future__ import annotations

import json
import multiprocessing
import time

import pytest
import torch

from examples.tiny_llama import random_llama
from refitkit.engines.fsdp import FSDPAdapter
from refitkit.errors import EngineAsleep, InvalidInput, KVCacheWontFit, PartialPush, TransferError
from refitkit.refit import RefitCycle
from refitkit.rollout import SglangLink
from refitkit.rollout.links import EngineMemory
from refitkit.rollout.sglang import (
    clean_weight_version,
    close_channels,
    engine_state,
    push_weights,
    receive_from,
    weight_version,
)
from refitkit.transfer import BroadcastWeightSender, BucketedWeightSender, WeightVersion
from tests.engines.sglang.ipc_sender_process import send_then_die
from tests.engines.sglang.sglang_engine import (
    LOGPROB_TOLERANCE,
    PROMPT,
    TIMEOUT_S,
    assert_engine_holds,
    expected_fingerprints,
    greedy_tokens,
    make_engine,
    prompt_logprobs,
    reference_greedy,
    reference_logprobs,
)
from tests.helpers.ports import free_port

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(600)]
SECRET = "sglang-broadcast-secret-0123456789"


def trainer_model(seed: int) -> torch.nn.Module:
    return random_llama(seed=seed).to(device="cuda", dtype=torch.bfloat16)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    batch = torch.tensor([PROMPT], device="cuda")
    model(input_ids=batch, labels=batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def free_bytes() -> int:
    return torch.cuda.mem_get_info()[0]


def test_the_cycle_refits_several_steps_bit_exact_with_memory_released_and_resumed(tiny):
    model = trainer_model(seed=20)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with BucketedWeightSender(
        "sglang-cycle", bucket_bytes=1 << 20, transport="cuda_ipc", timeout_s=TIMEOUT_S
    ) as sender:
        link = SglangLink(tiny, sender, sleep_level=2, first_version=10, engine_timeout_s=60.0)
        phase_free: dict[str, int] = {}  # the device's free bytes after each phase (this process sees the whole device)
        with RefitCycle(
            FSDPAdapter(model, optimizer), link, on_phase=lambda phase: phase_free.__setitem__(phase, free_bytes())
        ) as cycle:
            serving_free = free_bytes()
            link.sleep_for_training()  # the engine served; the trainer's state is on the device: its first step
            state = engine_state(tiny)
            assert (
                sorted(state["released"]) == ["cuda_graph", "kv_cache", "weights"]
                and link.memory is EngineMemory.ASLEEP
            )
            assert free_bytes() > serving_free + state["kv_cache_bytes"] // 2  # the release gave memory back
            assert not weight_version(tiny).clean  # no host backup: the weights were discarded
            for step in range(3):
                train_step(model, optimizer)
                expected_logprobs, expected_greedy = reference_logprobs(model), reference_greedy(model)
                held = expected_fingerprints(model)  # the trainer's state is offloaded once the refit returns
                tensors = len(list(model.parameters()))
                report = cycle.refit(step)

                names = [phase.name for phase in report.phases]
                assert names == [
                    "engine_wake_weights",
                    "sync_weights",
                    "offload",
                    "flush_device",
                    "barrier",
                    "engine_wake_kv_cache",
                ]
                kv_bytes = engine_state(tiny)["kv_cache_bytes"]
                assert (
                    phase_free["barrier"] - phase_free["engine_wake_kv_cache"] > kv_bytes // 2
                )  # the KV cache came back
                print(
                    json.dumps(
                        {
                            "step": step,
                            "kv_cache_mib": kv_bytes >> 20,
                            "free_mib": {k: v >> 20 for k, v in phase_free.items()},
                            "phase_ms": {phase.name: round(phase.seconds * 1e3, 1) for phase in report.phases},
                        }
                    )
                )
                assert engine_state(tiny)["released"] == [] and link.memory is EngineMemory.SERVING
                assert clean_weight_version(tiny) == 10 + step
                assert link.last_push.ranks[0]["complete"] and link.last_push.ranks[0]["tensors"] == tensors
                assert_engine_holds(tiny, held)  # bit for bit what the trainer held
                assert prompt_logprobs(tiny) == pytest.approx(expected_logprobs, abs=LOGPROB_TOLERANCE)
                assert greedy_tokens(tiny) == expected_greedy

                resumed = cycle.resume(step)  # the engine releases before the trainer's state comes back
                assert [phase.name for phase in resumed.phases] == ["engine_sleep", "reload", "barrier"]
                assert link.memory is EngineMemory.ASLEEP and not weight_version(tiny).clean  # discarded again
        link.wake_for_rollout()  # leave the engine serving for the next test
    assert link.memory is EngineMemory.SERVING and engine_state(tiny)["released"] == []


def test_a_push_into_released_weights_is_refused_and_the_engine_still_serves(tiny):
    trainer = trainer_model(seed=30)
    with BucketedWeightSender("sglang-push", bucket_bytes=1 << 20, transport="cuda_ipc", timeout_s=TIMEOUT_S) as sender:
        push_weights(tiny, sender, trainer.named_parameters(), version=40)
        tiny.release_memory_occupation(tags=["weights"])  # by hand: no link saw it
        try:
            began = time.monotonic()
            with pytest.raises(
                EngineAsleep, match=r"weights are released .*resume_memory_occupation\(tags=\['weights'\]\)"
            ):
                push_weights(tiny, sender, trainer.named_parameters(), version=41)
            assert time.monotonic() - began < TIMEOUT_S / 2  # refused by the scheduler, not found by a timeout
            assert engine_state(tiny)["released"] == ["weights"]
        finally:
            tiny.resume_memory_occupation(tags=["weights"])
    assert weight_version(tiny) == WeightVersion(40, None)  # the refusal touched nothing
    assert len(prompt_logprobs(tiny)) == len(PROMPT) - 1  # still serving


def test_closing_the_schedulers_channels_keeps_the_weights_and_the_next_push_opens_anew(tiny):
    trainer = trainer_model(seed=32)
    with BucketedWeightSender(
        "sglang-close", bucket_bytes=1 << 20, transport="cuda_ipc", timeout_s=TIMEOUT_S
    ) as sender:
        push_weights(tiny, sender, trainer.named_parameters(), version=42)
        closed = close_channels(tiny)
        assert (closed["weights"]["version"], closed["weights"]["clean"]) == (42, True)
        began = time.monotonic()
        push_weights(tiny, sender, trainer.named_parameters(), version=43)  # a new connection, at once
        assert time.monotonic() - began < TIMEOUT_S / 2
    assert clean_weight_version(tiny) == 43


def test_a_push_of_some_weights_is_a_partial_push_naming_how_many_landed(tiny):
    trainer = trainer_model(seed=35)
    weights = list(trainer.named_parameters())
    with BucketedWeightSender(
        "sglang-partial", bucket_bytes=1 << 20, transport="cuda_ipc", timeout_s=TIMEOUT_S
    ) as sender:
        push_weights(tiny, sender, weights, version=45)
        with pytest.raises(PartialPush) as caught:
            push_weights(tiny, sender, weights[:3], version=46)
        partial = caught.value
        assert (partial.version, partial.delivered, partial.expected) == (46, 3, len(weights))
        assert partial.engine == "SGLang's TP rank 0" and len(partial.missing) == len(weights) - 3
        assert "the push of version 46 delivered 3 of the" in str(partial) and "push every weight" in str(partial)
        assert weight_version(tiny) == WeightVersion(45, 46)
        push_weights(tiny, sender, weights, version=47)
    assert clean_weight_version(tiny) == 47


def test_a_killed_sender_leaves_the_engine_incomplete_until_a_full_sync(tiny):
    trainer = trainer_model(seed=50)
    with BucketedWeightSender("sglang-full", bucket_bytes=1 << 20, transport="cuda_ipc", timeout_s=TIMEOUT_S) as sender:
        push_weights(tiny, sender, trainer.named_parameters(), version=50)
    spawn = multiprocessing.get_context("spawn")
    ready = spawn.Queue()
    kill_timeout_s = 15.0
    process = spawn.Process(target=send_then_die, args=("sglang-killed", 11, kill_timeout_s, ready))
    process.start()
    try:
        path = ready.get(timeout=120)
        began = time.monotonic()
        with pytest.raises(
            TransferError,
            match=r"SGLang's TP rank 0 in SGLang's receive raised (TransferTimeout|PeerGone|TransferError)",
        ):
            receive_from(tiny, f"ipc://{path}", version=51, timeout_s=kill_timeout_s)  # (its own type, across)
        assert time.monotonic() - began < kill_timeout_s + 30.0
        process.join(timeout=30)
        assert process.exitcode == -9
    finally:
        if process.is_alive():
            process.kill()
            process.join(timeout=30)
    assert weight_version(tiny) == WeightVersion(50, 51)  # buckets of 51 landed, then it broke
    with pytest.raises(TransferError, match="sync of version 51 did not land whole .* last whole sync was version 50"):
        clean_weight_version(tiny)
    assert len(prompt_logprobs(tiny)) == len(PROMPT) - 1  # the engine still serves

    with BucketedWeightSender(
        "sglang-again", bucket_bytes=1 << 20, transport="cuda_ipc", timeout_s=TIMEOUT_S
    ) as sender:
        push_weights(tiny, sender, trainer.named_parameters(), version=52)
    assert clean_weight_version(tiny) == 52
    assert_engine_holds(tiny, trainer)
    assert prompt_logprobs(tiny) == pytest.approx(reference_logprobs(trainer), abs=LOGPROB_TOLERANCE)


def test_a_kv_cache_that_cannot_fit_is_refused_with_the_bytes(tiny):
    trainer = trainer_model(seed=60)
    with BucketedWeightSender("sglang-kv", bucket_bytes=1 << 20, transport="cuda_ipc", timeout_s=TIMEOUT_S) as sender:
        link = SglangLink(tiny, sender, sleep_level=2, first_version=60, engine_timeout_s=60.0)
        link.sleep_for_training()
        link.send(trainer.named_parameters())  # resumes the weights first
        state = engine_state(tiny)
        needed = state["kv_cache_bytes"]
        assert needed > 0 and state["released"] == ["cuda_graph", "kv_cache"]
        hog = torch.empty(state["free_bytes"] - needed // 2, dtype=torch.uint8, device="cuda")  # the trainer holds on
        try:
            with pytest.raises(KVCacheWontFit, match=r"needs \d+ MiB .* has \d+ MiB free") as caught:
                link.wake_for_rollout()
            assert caught.value.needed_bytes == needed and caught.value.free_bytes < needed
            assert link.memory is EngineMemory.WEIGHTS_AWAKE and engine_state(tiny)["released"] == [
                "cuda_graph",
                "kv_cache",
            ]
        finally:
            del hog
            torch.cuda.empty_cache()
        link.wake_for_rollout()  # the trainer let go: now it fits
    assert link.memory is EngineMemory.SERVING and engine_state(tiny)["released"] == []
    assert_engine_holds(tiny, trainer)


def test_a_qwen3_0_6b_shaped_checkpoint_refits_bit_exact_for_several_steps(tmp_path, plugin_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(device="cuda", dtype=torch.bfloat16)
    from examples.tiny_llama import save_checkpoint

    save_checkpoint(model, str(tmp_path))
    engine = make_engine(str(tmp_path), enable_memory_saver=True, mem_fraction_static=0.3)
    try:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        with BucketedWeightSender("sglang-qwen3", transport="cuda_ipc", timeout_s=TIMEOUT_S) as sender:
            link = SglangLink(engine, sender, sleep_level=2, engine_timeout_s=120.0)
            with RefitCycle(FSDPAdapter(model, optimizer), link) as cycle:
                link.sleep_for_training()
                for step in range(3):
                    train_step(model, optimizer)
                    held = expected_fingerprints(model)
                    cycle.refit(step)
                    assert clean_weight_version(engine) == step and link.last_push.ranks[0]["complete"]
                    assert_engine_holds(engine, held)
                    assert len(greedy_tokens(engine)) == 4  # it serves on the pushed weights
                    cycle.resume(step)
            link.wake_for_rollout()
    finally:
        engine.shutdown()


def test_the_cycle_refits_over_the_broadcast_bit_exact(tiny):
    model = trainer_model(seed=70)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rendezvous = f"tcp://127.0.0.1:{free_port()}"
    with BroadcastWeightSender(
        rendezvous, secret=SECRET, receivers=1, bucket_bytes=1 << 20, timeout_s=TIMEOUT_S
    ) as sender:
        link = SglangLink(tiny, sender, secret=SECRET, sleep_level=2, first_version=70, engine_timeout_s=60.0)
        with RefitCycle(FSDPAdapter(model, optimizer), link) as cycle:
            link.sleep_for_training()
            for step in range(2):
                train_step(model, optimizer)
                expected_greedy, held = reference_greedy(model), expected_fingerprints(model)
                cycle.refit(step)
                assert clean_weight_version(tiny) == 70 + step and link.last_push.ranks[0]["complete"]
                assert_engine_holds(tiny, held)
                assert greedy_tokens(tiny) == expected_greedy
                cycle.resume(step)
        link.wake_for_rollout()
    assert link.memory is EngineMemory.SERVING and engine_state(tiny)["released"] == []


def test_a_link_refuses_what_cannot_work(tiny):
    with pytest.raises(InvalidInput, match="SglangLink: engine must be an sglang.Engine"):
        SglangLink(object(), None)  # type: ignore[arg-type]
    with pytest.raises(
        InvalidInput, match="SglangLink: sender must be a BucketedWeightSender or a BroadcastWeightSender, got a str"
    ):
        SglangLink(tiny, "policy-0")  # type: ignore[arg-type]
    with BroadcastWeightSender(
        f"tcp://127.0.0.1:{free_port()}", secret=SECRET, receivers=1, timeout_s=TIMEOUT_S
    ) as sender:
        with pytest.raises(InvalidInput, match="a BroadcastWeightSender needs secret="):
            SglangLink(tiny, sender)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallelism needs two GPUs")
def test_a_tensor_parallel_engine_refits_over_the_broadcast_every_rank_whole(tmp_path, plugin_path, monkeypatch):
    """TP=2: both schedulers join the broadcast, each loads its shard; every rank's outcome comes back through rank 0."""
    from examples.tiny_llama import save_checkpoint

    # SGLang refuses a TP engine whose GPUs' free memory differs by over 10%: the suite's other engine sits on GPU 0
    monkeypatch.setenv("SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK", "0")
    save_checkpoint(random_llama(seed=0).to(torch.bfloat16), str(tmp_path))
    engine = make_engine(str(tmp_path), tp_size=2)
    try:
        model = trainer_model(seed=80)
        with BroadcastWeightSender(
            f"tcp://127.0.0.1:{free_port()}", secret=SECRET, receivers=2, timeout_s=TIMEOUT_S
        ) as sender:
            link = SglangLink(engine, sender, secret=SECRET, first_version=80)
            link.send(model.named_parameters())
        ranks = link.last_push.ranks
        assert [rank["version"] for rank in ranks] == [80, 80] and all(rank["complete"] for rank in ranks)
        assert clean_weight_version(engine) == 80
        assert [state["rank"] for state in engine_state(engine)["tp_ranks"]] == [0, 1]
        assert prompt_logprobs(engine) == pytest.approx(reference_logprobs(model), abs=LOGPROB_TOLERANCE)
        assert greedy_tokens(engine) == reference_greedy(model)
    finally:
        engine.shutdown()
