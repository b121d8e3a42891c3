"""LoRA sync: the trainer streams the base weights once and the adapter (PEFT names, rank, alpha) every time;
the engine side collects it bit-exact, checked, and refuses payloads that are not an adapter."""

from __future__ import annotations

import socket

import pytest
import torch

from refitkit.errors import InvalidInput, ProtocolError
from refitkit.rollout.lora import (
    LORA_CONFIG_NAME,
    LoraCollector,
    LoraSpec,
    LoraSync,
    base_tensors,
    lora_spec,
    lora_tensors,
)
from refitkit.transfer._broadcast.receiver import BroadcastWeightReceiver
from tests.rollout.lora_models import ToyLoraModel, start_sender
from tests.transfer.peers import digest

pytestmark = pytest.mark.timeout(180)

SECRET = "job-secret-0123456789abcdef"
PEFT = "base_model.model.model.layers"
LORA_NAMES = [f"{PEFT}.{i}.self_attn.{m}.lora_{p}.weight" for i in (0, 1) for m in ("q_proj", "v_proj") for p in "AB"]
BASE_NAMES = [
    f"model.layers.{i}.{n}"
    for i in (0, 1)
    for n in ("self_attn.q_proj.weight", "self_attn.v_proj.weight", "norm.weight", "norm.bias")
]


def test_sync_streams_the_base_once_then_only_the_adapter():
    model = ToyLoraModel(seed=0)
    sync = LoraSync(model)  # alpha read from the modules' lora_alpha, as PEFT keeps it
    assert sync.spec == LoraSpec(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))
    sent: list[list[str]] = []

    def send(weights):
        sent.append([name for name, _ in weights])
        return "stats"

    def broken(weights):
        next(iter(weights))
        raise RuntimeError("link down (test)")

    with pytest.raises(RuntimeError, match="link down"):
        sync.send(broken)
    assert not sync.base_sent  # a sync that failed does not count: the base goes again
    assert sync.send(send) == "stats"
    sync.send(send)
    sync.send(send, base=True)  # on request
    assert sorted(sent[0]) == sorted(BASE_NAMES + LORA_NAMES + [LORA_CONFIG_NAME])
    assert sorted(sent[1]) == sorted(LORA_NAMES + [LORA_CONFIG_NAME])
    assert sorted(sent[2]) == sorted(sent[0])
    params = dict(model.named_parameters())
    assert torch.equal(
        dict(base_tensors(model))["model.layers.1.self_attn.v_proj.weight"],
        params["model.layers.1.self_attn.v_proj.base_layer.weight"],
    )
    assert torch.equal(
        dict(lora_tensors(model))[f"{PEFT}.0.self_attn.q_proj.lora_B.weight"],
        params["model.layers.0.self_attn.q_proj.lora_B.default.weight"],
    )
    assert list(lora_tensors(model, adapter="other")) == []


def test_spec_needs_one_rank_and_an_alpha():
    model = ToyLoraModel(seed=0)
    model.model.layers[0].self_attn.q_proj.lora_alpha = 3  # not PEFT's per-adapter dict: still read
    with pytest.raises(InvalidInput, match=r"carry \[3.0, 8.0\] lora_alpha; pass alpha="):
        lora_spec(model)
    assert lora_spec(model, alpha=32).alpha == 32.0
    with pytest.raises(InvalidInput, match="alpha=0; need a number > 0"):
        lora_spec(model, alpha=0)
    mixed = ToyLoraModel(seed=0)
    mixed.model.layers[1].self_attn.v_proj.lora_A["default"] = torch.nn.Linear(16, 2, bias=False)
    with pytest.raises(InvalidInput, match=r"LoRA ranks differ across modules \(\[2, 4\]\)"):
        lora_spec(mixed)
    with pytest.raises(InvalidInput, match="no lora_A/lora_B parameters for adapter 'default'"):
        lora_spec(torch.nn.Linear(2, 2))


def receive_one(url: str, collector: LoraCollector) -> None:
    BroadcastWeightReceiver(url, secret=SECRET, rank=1, timeout_s=30.0).receive(collector)


def free_url() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{probe.getsockname()[1]}"


@pytest.mark.parametrize("base", [True, False])
def test_adapter_arrives_bit_exact_over_the_broadcast(base):
    url = free_url()
    process, answers = start_sender(url, SECRET, "toy", (5, 0), version=3, base=base)
    loaded: list[tuple[list[str], bool]] = []
    collector = LoraCollector(on_base=lambda weights, last: loaded.append(([name for name, _ in weights], last)))
    try:
        receive_one(url, collector)
        error, tensors = answers.get(timeout=60)
    finally:
        process.join(30)
    assert error is None, tensors
    model = ToyLoraModel(seed=5)
    adapter = collector.adapter()
    assert adapter.spec == LoraSpec(4, 8.0, ("q_proj", "v_proj"))
    assert {name: digest(tensor) for name, tensor in adapter.tensors.items()} == {
        name: digest(t) for name, t in lora_tensors(model)
    }
    assert sorted(collector.base_names) == (sorted(BASE_NAMES) if base else [])
    assert tensors == len(LORA_NAMES) + 1 + (len(BASE_NAMES) if base else 0)
    assert loaded[-1][1] is True  # on_base heard the end of the stream
    assert process.exitcode == 0


def config_tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)


def test_collector_refuses_what_is_not_an_adapter():
    spec = LoraSpec(4, 8.0, ("q_proj",)).to_tensor()
    a, b = torch.zeros(4, 16), torch.zeros(16, 4)
    name = f"{PEFT}.0.self_attn.q_proj"
    cases = [
        ([(f"{name}.lora_A.weight", a)], ProtocolError, f"carried no '{LORA_CONFIG_NAME}'"),
        ([(LORA_CONFIG_NAME, spec)], ProtocolError, "a config but no lora_A/lora_B tensors"),
        ([(LORA_CONFIG_NAME, spec), (f"{name}.lora_A.weight", a)], ProtocolError, r"arrived with \['lora_A'\] only"),
        (
            [(LORA_CONFIG_NAME, spec), (f"{name}.lora_A.weight", torch.zeros(2, 16)), (f"{name}.lora_B.weight", b)],
            ProtocolError,
            r"lora_A \(2, 16\) and lora_B \(16, 4\) do not fit rank r=4",
        ),
        ([(LORA_CONFIG_NAME, config_tensor("{not json"))], ProtocolError, "is not JSON"),
        (
            [(LORA_CONFIG_NAME, config_tensor('{"r": 0, "lora_alpha": 8, "target_modules": ["q"]}'))],
            ProtocolError,
            "has r=0",
        ),
        ([(LORA_CONFIG_NAME, torch.zeros(3, dtype=torch.float32))], ProtocolError, "expected up to 65536 uint8 bytes"),
        (
            [("model.norm.weight", torch.zeros(3))],
            InvalidInput,
            "base weight 'model.norm.weight' arrived but .* no on_base",
        ),
    ]
    for weights, error, message in cases:
        collector = LoraCollector()
        with pytest.raises(error, match=message):
            collector(weights, True)
            collector.adapter()
    good = LoraCollector()
    good([(LORA_CONFIG_NAME, spec), (f"{name}.lora_A.weight", a), (f"{name}.lora_B.weight", b)], True)
    assert good.adapter().spec.rank == 4
