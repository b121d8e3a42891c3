"""PEFT-style LoRA models for tests, without peft: ``LoraLinear`` names its tensors as PEFT's LoraLayer does
(``base_layer.weight``, ``lora_A.<adapter>.weight``, ``lora_B.<adapter>.weight``, ``lora_alpha[adapter]``) and
computes ``base(x) + B(A(x)) * alpha / r``, so a wrapped HF model is also the reference forward."""

from __future__ import annotations

from typing import Any

import torch

from tests.helpers import procs

TARGETS = ("q_proj", "v_proj", "gate_proj", "down_proj")


class LoraLinear(torch.nn.Module):
    def __init__(
        self, base: torch.nn.Linear, rank: int, alpha: float, generator: torch.Generator, adapter: str = "default"
    ) -> None:
        super().__init__()
        self.base_layer = base
        self.lora_A = torch.nn.ModuleDict({adapter: torch.nn.Linear(base.in_features, rank, bias=False)})
        self.lora_B = torch.nn.ModuleDict({adapter: torch.nn.Linear(rank, base.out_features, bias=False)})
        self.lora_alpha = {adapter: alpha}
        self.scaling = alpha / rank
        self.adapter = adapter
        with torch.no_grad():  # B is not zero (as after some training): the adapter must change the outputs
            self.lora_A[adapter].weight.copy_(torch.randn(rank, base.in_features, generator=generator) * 0.1)
            self.lora_B[adapter].weight.copy_(torch.randn(base.out_features, rank, generator=generator) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora_B[self.adapter](self.lora_A[self.adapter](x)) * self.scaling


def add_lora(
    model: torch.nn.Module, *, seed: int, rank: int = 8, alpha: float = 16.0, targets=TARGETS
) -> torch.nn.Module:
    """Wrap every Linear named in ``targets`` of ``model`` (in place) with a LoraLinear drawn from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    for _name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if child_name in targets and isinstance(child, torch.nn.Linear):
                setattr(module, child_name, LoraLinear(child, rank, alpha, generator))
    return model


def lora_llama(base_seed: int, lora_seed: int, **kwargs: Any) -> torch.nn.Module:
    """The tiny test Llama of ``base_seed`` with a LoRA adapter of ``lora_seed``."""
    from examples.tiny_llama import random_llama

    return add_lora(random_llama(seed=base_seed), seed=lora_seed, **kwargs)


class ToyLoraModel(torch.nn.Module):
    """A two-layer stand-in with Llama-like module names (for the core venv, where transformers may be absent)."""

    def __init__(self, seed: int, rank: int = 4, alpha: float = 8.0) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList()
        for _ in range(2):
            layer = torch.nn.Module()
            layer.self_attn = torch.nn.Module()
            layer.self_attn.q_proj = torch.nn.Linear(16, 16, bias=False)
            layer.self_attn.v_proj = torch.nn.Linear(16, 8, bias=False)
            layer.norm = torch.nn.LayerNorm(16)
            self.model.layers.append(layer)
        with torch.no_grad():
            for param in self.parameters():
                param.copy_(torch.randn(param.shape, generator=generator))
        add_lora(self, seed=seed + 1, rank=rank, alpha=alpha, targets=("q_proj", "v_proj"))


def sender_main(
    url: str, secret: str, model_kind: str, seeds: tuple[int, int], version: int, base: bool, answers: Any
) -> None:
    """Send one LoRA sync of a model rebuilt from ``seeds`` over the broadcast; answer with the outcome."""
    from refitkit.rollout.lora import LoraSync
    from refitkit.transfer._broadcast.sender import BroadcastWeightSender

    model = ToyLoraModel(seeds[0]) if model_kind == "toy" else lora_llama(*seeds)
    try:
        with BroadcastWeightSender(url, secret=secret, receivers=1, bucket_bytes=1 << 16, timeout_s=30.0) as sender:
            stats = LoraSync(model).send(lambda weights: sender.send(weights, version=version), base=base)
        answers.put((None, stats.tensors))
    except Exception as exc:
        answers.put((type(exc).__name__, str(exc)))


def start_sender(
    url: str, secret: str, model_kind: str, seeds: tuple[int, int], version: int, *, base: bool
) -> tuple[Any, Any]:
    ctx = procs.context()
    answers = ctx.Queue()
    process = ctx.Process(
        target=sender_main, args=(url, secret, model_kind, seeds, version, base, answers), daemon=True
    )
    process.start()
    return process, answers
