"""Builds the SGLang engines of this suite and reads them back (imported by the tests; nothing runs on import).

SGLang spawns its scheduler processes, which import ``__main__`` again: engines are made from fixtures (pytest's
``__main__`` has its guard), never at module level. refitkit's plugin reaches those processes through its
``sglang.srt.plugins`` entry point: where refitkit is not pip-installed (PYTHONPATH only), ``install_entry_point``
writes a minimal dist-info that declares it, on a path every SGLang process sees.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

import torch

PROMPT = [1, 17, 5, 200, 9, 33, 70, 4, 128, 251, 64, 3, 99, 12, 180, 7]
LOGPROB_TOLERANCE = 5e-2  # bf16 kernels of SGLang against HF's eager bf16 forward (holds on the H200; not tightened)
TIMEOUT_S = 60.0


def install_entry_point(directory: str) -> None:
    """Declare refitkit's ``sglang.srt.plugins`` entry point from ``directory`` (put on sys.path and PYTHONPATH)."""
    info = os.path.join(directory, "refitkit_sglang_tests-0.0.dist-info")
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w") as handle:
        handle.write("Metadata-Version: 2.1\nName: refitkit-sglang-tests\nVersion: 0.0\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as handle:
        handle.write("[sglang.srt.plugins]\nrefitkit = refitkit.rollout.sglang:register_with_sglang\n")
    sys.path.insert(0, directory)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (directory, os.environ.get("PYTHONPATH")) if p)


def make_engine(path: str, **kwargs: Any) -> Any:
    """An ``sglang.Engine`` on checkpoint ``path``: bf16, a small slice of the GPU, refitkit's plugin loaded."""
    import sglang

    settings = dict(
        model_path=path,
        dtype="bfloat16",
        mem_fraction_static=0.15,
        random_seed=0,
        log_level="error",
        context_length=256,
        skip_tokenizer_init=True,
        attention_backend="triton",
    )
    return sglang.Engine(**{**settings, **kwargs})


def prompt_logprobs(engine: Any) -> list[float]:
    """SGLang's logprob of each prompt token given the ones before it (``input_token_logprobs``: (logprob, id, text))."""
    output = engine.generate(
        input_ids=PROMPT,
        sampling_params={"max_new_tokens": 1, "temperature": 0.0},
        return_logprob=True,
        logprob_start_len=0,
    )
    entries = output["meta_info"]["input_token_logprobs"]
    return [float(entry[0]) for entry in entries[1:]]


def greedy_tokens(engine: Any, count: int = 4) -> list[int]:
    """SGLang's greedy continuation of the prompt (``count`` tokens, end-of-sequence ignored)."""
    params = {"max_new_tokens": count, "temperature": 0.0, "ignore_eos": True}
    return list(engine.generate(input_ids=PROMPT, sampling_params=params)["output_ids"])


def reference_logprobs(model: torch.nn.Module) -> list[float]:
    """The same logprobs from a HF forward pass of ``model`` (the trainer's copy)."""
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT], device=next(model.parameters()).device)).logits[0]
    logprobs = torch.log_softmax(logits.double(), dim=-1)
    return [logprobs[position, token].item() for position, token in enumerate(PROMPT[1:])]


def reference_greedy(model: torch.nn.Module, count: int = 4) -> list[int]:
    """The same continuation from HF forwards of ``model``: argmax of the last position, ``count`` times."""
    tokens = list(PROMPT)
    with torch.no_grad():
        for _ in range(count):
            logits = model(torch.tensor([tokens], device=next(model.parameters()).device)).logits[0, -1]
            tokens.append(int(logits.argmax()))
    return tokens[len(PROMPT) :]


def expected_fingerprints(trainer: torch.nn.Module | Mapping[str, torch.Tensor]) -> dict[str, list[int]]:
    """The trainer's weights' fingerprints as SGLang holds them (Llama/Qwen: q/k/v in qkv_proj, gate/up in gate_up_proj).

    A Qwen3-MoE trainer is passed as its stream (checkpoint names: ``dict(FSDPAdapter(model).named_weights())``; its
    ``named_parameters()`` hold the experts fused under transformers' names): each layer's per-expert weights are
    stacked as SGLang's ``FusedMoE`` holds them with its Triton backend, ``mlp.experts.w13_weight`` ``[E, 2I, H]``
    (each expert's gate rows, then its up rows) and ``mlp.experts.w2_weight`` ``[E, H, I]``: vLLM's stacking
    (``stacked_digests``) under SGLang's names (vLLM 0.25 puts them under ``mlp.experts.routed_experts.``)."""
    from refitkit.rollout.vllm import stacked_digests, tensor_fingerprint

    digests = stacked_digests(trainer, tensor_fingerprint)
    return {name.replace(".mlp.experts.routed_experts.", ".mlp.experts."): value for name, value in digests.items()}


def assert_engine_holds(engine: Any, trainer: torch.nn.Module | dict[str, list[int]]) -> None:
    """Every trainer weight (a model, or its ``expected_fingerprints``) bit for bit in the engine."""
    from refitkit.rollout.sglang import engine_state

    expected = trainer if isinstance(trainer, dict) else expected_fingerprints(trainer)
    held = engine_state(engine, fingerprints=sorted(expected))["fingerprints"]
    differing = sorted(name for name in expected if held[name] != expected[name])
    assert not differing, f"SGLang's params differ from the trainer's: {differing[:8]}"
