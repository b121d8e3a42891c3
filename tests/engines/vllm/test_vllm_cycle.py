"""RefitCycle drives a live vLLM engine through a VllmLink (shm or broadcast): refit() pushes, vLLM serves the result.
The link owns the helper threads its engine calls run on, for its life: none outlives a push or a closed link."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from examples.tiny_llama import random_llama
from refitkit.engines.fsdp import FSDPAdapter
from refitkit.errors import InvalidInput, LinkClosed, WeightShapeMismatch
from refitkit.refit import RefitCycle
from refitkit.rollout import VllmLink, clean_weight_version, push_weights
from refitkit.rollout.sessions import HELPER_THREAD_PREFIX
from refitkit.transfer import BroadcastWeightSender, BucketedWeightSender
from tests.engines.vllm.vllm_checks import (
    LOGPROB_TOLERANCE,
    PROMPT,
    SECRET,
    SMALL_BUCKET_BYTES,
    TIMEOUT_S,
    assert_engine_holds,
    free_port,
    prompt_logprobs,
    reference_logprobs,
)

pytestmark = pytest.mark.timeout(300)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    batch = torch.tensor([PROMPT])
    model(input_ids=batch, labels=batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def run_cycle(engine, sender, link: VllmLink, *, first_version: int) -> None:
    model = random_llama(seed=5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with RefitCycle(FSDPAdapter(model, optimizer), link) as cycle:
        for step in range(2):
            train_step(model, optimizer)
            expected = reference_logprobs(model)
            report = cycle.refit(step)

            assert [phase.name for phase in report.phases] == ["sync_weights", "offload", "flush_device", "barrier"]
            assert prompt_logprobs(engine.llm) == pytest.approx(expected, abs=LOGPROB_TOLERANCE)  # the trained weights
            assert clean_weight_version(engine.llm) == first_version + step
            cycle.resume(step)
            assert report.phase("sync_weights").bytes == sum(param.nbytes for param in model.parameters())
    assert_engine_holds(engine, model)


def test_the_cycle_refits_vllm_over_shm(engine):
    with BucketedWeightSender(
        "vllm-cycle", bucket_bytes=SMALL_BUCKET_BYTES, transport="shm", timeout_s=TIMEOUT_S
    ) as sender:
        run_cycle(engine, sender, VllmLink(engine.llm, sender, first_version=300), first_version=300)


def test_the_cycle_refits_vllm_over_a_broadcast(engine):
    rendezvous = f"tcp://127.0.0.1:{free_port()}"
    with BroadcastWeightSender(
        rendezvous, secret=SECRET, receivers=1, bucket_bytes=SMALL_BUCKET_BYTES, timeout_s=TIMEOUT_S
    ) as sender:
        run_cycle(engine, sender, VllmLink(engine.llm, sender, secret=SECRET, first_version=400), first_version=400)


def test_a_link_refuses_what_cannot_work(engine):
    with pytest.raises(InvalidInput, match="VllmLink: llm must be a vllm.LLM"):
        VllmLink(object(), None)  # type: ignore[arg-type]
    with pytest.raises(
        InvalidInput, match="VllmLink: sender must be a BucketedWeightSender or a BroadcastWeightSender, got a str"
    ):
        VllmLink(engine.llm, "policy-0")  # type: ignore[arg-type]
    with BroadcastWeightSender(
        f"tcp://127.0.0.1:{free_port()}", secret=SECRET, receivers=1, timeout_s=TIMEOUT_S
    ) as sender:
        with pytest.raises(InvalidInput, match="a BroadcastWeightSender needs secret="):
            VllmLink(engine.llm, sender)


def test_a_link_drives_memory_only_on_a_sleep_mode_engine(engine):
    with BucketedWeightSender("vllm-no-sleep", transport="shm", timeout_s=TIMEOUT_S) as sender:
        with pytest.raises(InvalidInput, match="sleep_level needs an engine made with enable_sleep_mode=True"):
            VllmLink(engine.llm, sender, sleep_level=1)
        with pytest.raises(InvalidInput, match="sleep_level=3; need 1"):
            VllmLink(engine.llm, sender, sleep_level=3)
        with pytest.raises(InvalidInput, match="engine_timeout_s=0"):
            VllmLink(engine.llm, sender, engine_timeout_s=0)
        link = VllmLink(engine.llm, sender)
        assert not link.drives_memory  # RefitCycle then adds no engine phases (see run_cycle)
        link.sleep_for_training()
        link.wake_for_rollout()  # both no-ops without sleep_level: the engine kept serving
        assert len(prompt_logprobs(engine.llm)) == len(PROMPT) - 1


def helper_threads_alive() -> list[str]:
    """The names of refitkit's helper threads alive in this (the trainer's) process."""
    return [thread.name for thread in threading.enumerate() if thread.name.startswith(HELPER_THREAD_PREFIX)]


def checkpoint_weights(engine) -> list:
    return [(name, param.detach()) for name, param in engine.original.named_parameters()]


def test_no_helper_thread_outlives_a_push_or_a_closed_link(engine):
    weights = checkpoint_weights(engine)
    with BucketedWeightSender(
        "vllm-link-threads", bucket_bytes=SMALL_BUCKET_BYTES, transport="shm", timeout_s=TIMEOUT_S
    ) as sender:
        push_weights(engine.llm, sender, weights, version=500)
        assert helper_threads_alive() == []  # a one-shot push ends its own, after success ...
        name, tensor = weights[0]
        with pytest.raises(WeightShapeMismatch, match=f"refused weight '{name}'"):
            push_weights(engine.llm, sender, [(name, tensor[:-1])], version=501)
        assert helper_threads_alive() == []  # ... and after a failure that came back from the engine

        with VllmLink(engine.llm, sender, first_version=502) as link:
            link.send(weights)
            kept = helper_threads_alive()
            assert kept  # the link keeps its threads between pushes
            link.send(weights)
            assert set(helper_threads_alive()) <= set(kept)
        assert helper_threads_alive() == []
        with pytest.raises(LinkClosed, match=r"^VllmLink is closed: its helper threads are gone; make a new VllmLink"):
            link.send(weights)
        link.close()  # twice is fine
    assert clean_weight_version(engine.llm) == 503


def test_a_link_used_in_a_forked_child_is_refused_before_it_reaches_the_engine(engine):
    weights = checkpoint_weights(engine)
    with BucketedWeightSender(
        "vllm-link-fork", bucket_bytes=SMALL_BUCKET_BYTES, transport="shm", timeout_s=TIMEOUT_S
    ) as sender:
        with VllmLink(engine.llm, sender, first_version=600) as link:
            link.send(weights)  # the link's threads run in this process
            read, write = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child: a copy of the link whose threads are not here
                try:
                    link.send(weights)
                    said = "sent from the child"
                except BaseException as exc:
                    said = f"{type(exc).__name__}: {exc}"
                os.write(write, said.encode())
                os._exit(0)
            os.close(write)
            with os.fdopen(read, "rb") as pipe:
                said = pipe.read().decode()
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0
            assert said == (
                f"LinkClosed: VllmLink was made in process {os.getpid()} and is used in process {pid} (a forked "
                "child): its helper threads exist only in the process that made it; make a new VllmLink in this process"
            )
            link.send(weights)  # the parent's link still works
    assert clean_weight_version(engine.llm) == 601
