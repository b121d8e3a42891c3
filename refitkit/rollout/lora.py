"""LoRA sync: the adapter only (A/B matrices, their PEFT names, rank and alpha), the base weights once.

Trainer side: ``LoraSync(model, alpha=...)`` streams, per sync, the base weights (Hugging Face names,
LoRA wrappers stripped) on the first sync or when asked, then every ``lora_A`` / ``lora_B`` tensor under
the name PEFT saves it with (``base_model.model.<module>.lora_A.weight``), then the adapter's config as
one small tensor (``LORA_CONFIG_NAME``: JSON bytes, data only). Any sender carries the stream, e.g.
``sync.send(lambda weights: broadcast_sender.send(weights, version=step))``.

Engine side: ``LoraCollector`` is a receiver's ``on_bucket``: it keeps copies of the adapter's tensors,
hands base weights (if any) to ``on_base``, and ``adapter()`` checks the lot (every A has its B, one
rank, the config present and well formed). ``VllmLoraLoader(llm).load(adapter)`` writes it as a PEFT
adapter directory and registers it with vLLM under a new LoRA id per sync (the previous one is
removed), returning the ``LoRARequest`` to sample with.

A model is "peft-style" when its LoRA tensors are parameters named ``….lora_A[.<adapter>].weight`` and
``….lora_B[.<adapter>].weight`` beside (or around a ``base_layer`` holding) the base weight, as PEFT's
``LoraModel`` names them; ``peft`` itself is not needed.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from refitkit.errors import EngineError, InvalidInput, ProtocolError

log = logging.getLogger("refitkit.rollout.lora")

LORA_CONFIG_NAME = "refitkit.lora_config"  # a uint8 tensor: the adapter's config as JSON
MAX_CONFIG_BYTES = 1 << 16
PEFT_PREFIX = "base_model.model."
_PARTS = ("lora_A", "lora_B")

Weights = Iterable[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class LoraSpec:
    """What an engine needs besides the matrices: ``rank`` (r), ``alpha`` (scaling = alpha / r) and the module
    names the adapter targets (e.g. ``("q_proj", "v_proj")``)."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]

    def peft_config(self, base_model: str | None = None) -> dict[str, Any]:
        """The ``adapter_config.json`` of this adapter, as PEFT writes it (the fields engines read)."""
        return {
            "peft_type": "LORA",
            "r": self.rank,
            "lora_alpha": self.alpha,
            "target_modules": list(self.target_modules),
            "bias": "none",
            "base_model_name_or_path": base_model,
        }

    def to_tensor(self) -> torch.Tensor:
        raw = json.dumps(
            {"r": self.rank, "lora_alpha": self.alpha, "target_modules": list(self.target_modules)}
        ).encode()
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8)

    @staticmethod
    def from_tensor(tensor: torch.Tensor) -> LoraSpec:
        """Parse (and check) the config tensor of a stream; ProtocolError if it is not one."""
        if tensor.dtype != torch.uint8 or tensor.dim() != 1 or not 0 < tensor.numel() <= MAX_CONFIG_BYTES:
            raise ProtocolError(
                f"{LORA_CONFIG_NAME!r} is {tensor.dtype} {tuple(tensor.shape)}; expected up to {MAX_CONFIG_BYTES} uint8 bytes of JSON"
            )
        try:
            fields = json.loads(tensor.cpu().numpy().tobytes().decode())
        except (UnicodeDecodeError, ValueError) as exc:
            raise ProtocolError(f"{LORA_CONFIG_NAME!r} is not JSON: {exc}") from None
        rank, alpha, targets = (
            fields.get(key) if isinstance(fields, dict) else None for key in ("r", "lora_alpha", "target_modules")
        )
        if not (
            type(rank) is int
            and rank > 0
            and type(alpha) in (int, float)
            and alpha > 0
            and isinstance(targets, list)
            and targets
            and all(isinstance(name, str) and name for name in targets)
        ):
            raise ProtocolError(
                f"{LORA_CONFIG_NAME!r} has r={rank!r}, lora_alpha={alpha!r}, target_modules={targets!r}"
            )
        return LoraSpec(rank, float(alpha), tuple(targets))


def lora_part(name: str) -> tuple[str, str] | None:
    """``(module path, "lora_A" | "lora_B")`` of a LoRA tensor's name (PEFT's live or saved form), else None."""
    pieces = name.split(".")
    for index, piece in enumerate(pieces):
        if piece in _PARTS and pieces[-1] == "weight" and len(pieces) - index in (2, 3):
            return ".".join(pieces[:index]), piece
    return None


def peft_name(module: str, part: str) -> str:
    """The name PEFT saves ``part`` of ``module`` under (adapter name dropped, ``base_model.model.`` in front)."""
    return f"{module if module.startswith(PEFT_PREFIX) else PEFT_PREFIX + module}.{part}.weight"


def lora_tensors(model: torch.nn.Module, *, adapter: str = "default") -> Iterator[tuple[str, torch.Tensor]]:
    """Only the LoRA matrices of ``model`` (adapter ``adapter`` where PEFT names several), under PEFT's saved names."""
    for name, param in model.named_parameters():
        found = lora_part(name)
        if found is None:
            continue
        pieces = name.split(".")
        if len(pieces) - pieces.index(found[1]) == 3 and pieces[-2] != adapter:  # another adapter of a PEFT model
            continue
        yield peft_name(*found), param.detach()


def base_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every non-LoRA parameter under its Hugging Face name (``base_model.model.`` and ``.base_layer`` dropped)."""
    for name, param in model.named_parameters():
        if lora_part(name) is not None:
            continue
        plain = name[len(PEFT_PREFIX) :] if name.startswith(PEFT_PREFIX) else name
        yield plain.replace(".base_layer.", "."), param.detach()


def lora_spec(model: torch.nn.Module, *, alpha: float | None = None, adapter: str = "default") -> LoraSpec:
    """The adapter's rank (from its A matrices: one rank for all), alpha (given, or PEFT's ``lora_alpha`` of the
    modules) and target module names; InvalidInput when the model has no LoRA tensors or mixed ranks."""
    ranks: dict[str, int] = {}
    targets: set[str] = set()
    for name, tensor in lora_tensors(model, adapter=adapter):
        module, part = lora_part(name)  # type: ignore[misc]
        targets.add(module.rsplit(".", 1)[-1])
        if part == "lora_A":
            ranks[name] = tensor.shape[0]
    if not ranks:
        raise InvalidInput(f"the model has no lora_A/lora_B parameters for adapter {adapter!r}")
    if len(set(ranks.values())) != 1:
        raise InvalidInput(
            f"LoRA ranks differ across modules ({sorted(set(ranks.values()))}); one rank per adapter is supported"
        )
    if alpha is None:
        found = {_module_alpha(module, adapter) for module in model.modules()} - {None}
        if len(found) != 1:
            raise InvalidInput(
                f"alpha=None and the model's modules carry {sorted(found) or 'no'} lora_alpha; pass alpha= (scaling = alpha / r)"
            )
        alpha = found.pop()
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise InvalidInput(f"alpha={alpha!r}; need a number > 0 (scaling = alpha / r)")
    return LoraSpec(next(iter(ranks.values())), float(alpha), tuple(sorted(targets)))


def _module_alpha(module: torch.nn.Module, adapter: str) -> float | None:
    value = getattr(module, "lora_alpha", None)
    if isinstance(value, dict):  # PEFT's LoraLayer: one alpha per adapter name
        value = value.get(adapter)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


class LoraSync:
    """The trainer side: per sync the base weights (first sync, or ``base=True``), then the adapter and its config."""

    def __init__(self, model: torch.nn.Module, *, alpha: float | None = None, adapter: str = "default") -> None:
        self.model, self.adapter = model, adapter
        self.spec = lora_spec(model, alpha=alpha, adapter=adapter)
        self.base_sent = False

    def weights(self, *, base: bool | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """The stream of one sync; ``base=None`` includes the base weights until a sync with them landed."""
        if base if base is not None else not self.base_sent:
            yield from base_tensors(self.model)
        yield from lora_tensors(self.model, adapter=self.adapter)
        yield LORA_CONFIG_NAME, self.spec.to_tensor()

    def send(self, send: Callable[[Weights], Any], *, base: bool | None = None) -> Any:
        """``send(weights)`` one sync (e.g. ``lambda w: sender.send(w, version=step)``); the base counts as sent only
        once a sync that carried it returned."""
        with_base = base if base is not None else not self.base_sent
        result = send(self.weights(base=with_base))
        if with_base:
            self.base_sent = True
        return result


@dataclass(frozen=True)
class LoraAdapter:
    """A received adapter: its spec and tensors by PEFT name (host copies)."""

    spec: LoraSpec
    tensors: dict[str, torch.Tensor]

    def save(self, path: str, *, base_model: str | None = None) -> None:
        """Write a PEFT adapter directory (``adapter_model.safetensors`` + ``adapter_config.json``)."""
        try:
            from safetensors.torch import save_file
        except ImportError:
            raise InvalidInput(
                "saving a LoRA adapter needs safetensors (pip install safetensors; vLLM brings it)"
            ) from None
        os.makedirs(path, exist_ok=True)
        save_file(
            {name: tensor.contiguous() for name, tensor in self.tensors.items()},
            os.path.join(path, "adapter_model.safetensors"),
        )
        with open(os.path.join(path, "adapter_config.json"), "w") as config:
            json.dump(self.spec.peft_config(base_model), config)


class LoraCollector:
    """A receiver's ``on_bucket``: keeps the adapter (copies), passes base weights to ``on_base(weights, is_last)``."""

    def __init__(self, *, on_base: Callable[[list[tuple[str, torch.Tensor]], bool], Any] | None = None) -> None:
        self.on_base = on_base
        self.tensors: dict[str, torch.Tensor] = {}
        self.spec: LoraSpec | None = None
        self.base_names: list[str] = []

    def __call__(self, weights: list[tuple[str, torch.Tensor]], is_last: bool) -> None:
        base = []
        for name, tensor in weights:
            if name == LORA_CONFIG_NAME:
                self.spec = LoraSpec.from_tensor(tensor)
            elif lora_part(name) is not None:
                self.tensors[name] = tensor.detach().to("cpu", copy=True)  # the bucket's views die after this call
            else:
                base.append((name, tensor))
        if base and self.on_base is None:
            raise InvalidInput(
                f"base weight {base[0][0]!r} arrived but this LoraCollector has no on_base to load it into"
            )
        self.base_names += [name for name, _ in base]
        if self.on_base is not None and (base or is_last):
            self.on_base(base, is_last)

    def adapter(self) -> LoraAdapter:
        """The adapter received, checked: a config, every A with its B, A ``(r, in)`` and B ``(out, r)``."""
        if self.spec is None:
            raise ProtocolError(f"the stream carried no {LORA_CONFIG_NAME!r}: not a LoRA sync (LoraSync.weights())")
        modules: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in self.tensors.items():
            module, part = lora_part(name)  # type: ignore[misc]
            modules.setdefault(module, {})[part] = tensor
        if not modules:
            raise ProtocolError("the LoRA sync carried a config but no lora_A/lora_B tensors")
        for module, parts in modules.items():
            a, b = parts.get("lora_A"), parts.get("lora_B")
            if a is None or b is None:
                raise ProtocolError(
                    f"{module!r} arrived with {sorted(parts)} only; each LoRA module needs lora_A and lora_B"
                )
            if a.dim() != 2 or b.dim() != 2 or a.shape[0] != self.spec.rank or b.shape[1] != self.spec.rank:
                raise ProtocolError(
                    f"{module!r}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit rank r={self.spec.rank}"
                )
        return LoraAdapter(self.spec, dict(self.tensors))


class VllmLoraLoader:
    """Registers each received adapter with a vLLM ``LLM`` (``enable_lora=True``).

    ``inplace=True`` (the default): every version replaces the adapter under one LoRA id
    (``LoRARequest(load_inplace=True)``: vLLM loads the new adapter before it drops the old one, so a
    refused adapter leaves the previous version serving), then resets the prefix cache, whose blocks are
    keyed by that id and hold the old adapter's KV. ``inplace=False``: a new id per version and the
    previous one removed (vLLMs without in-place LoRA loading).
    """

    def __init__(self, llm: Any, *, root_dir: str | None = None, inplace: bool = True, lora_id: int = 1) -> None:
        if not isinstance(inplace, bool):
            raise InvalidInput(f"VllmLoraLoader: inplace= must be a bool, got {inplace!r}")
        if isinstance(lora_id, bool) or not isinstance(lora_id, int) or lora_id < 1:
            raise InvalidInput(f"VllmLoraLoader: lora_id={lora_id!r}; need an int >= 1 (vLLM's LoRA ids start at 1)")
        self.llm, self.inplace = llm, inplace
        self.root_dir = root_dir or tempfile.mkdtemp(prefix="refitkit-lora-")
        self.current: Any = None  # the LoRARequest to sample with
        self._next_id = lora_id

    def load(self, adapter: LoraAdapter, *, version: int) -> Any:
        """Write ``adapter`` as weight version ``version``, load it into the engine in place of the previous one;
        returns the ``LoRARequest`` to sample with."""
        from vllm.lora.request import LoRARequest

        lora_id = self._next_id
        path = os.path.join(self.root_dir, f"v{version}-id{lora_id}")
        adapter.save(path)
        name = "refitkit" if self.inplace else f"refitkit-v{version}"
        # The request that loads forces the reload; the one returned must not (vLLM would reload it every step).
        loading = LoRARequest(name, lora_id, path, load_inplace=self.inplace)
        if not self.llm.llm_engine.add_lora(loading):
            shutil.rmtree(path, ignore_errors=True)
            raise InvalidInput(
                f"vLLM refused LoRA adapter {name!r} from {path} (enable_lora=True? max_lora_rank >= r?)"
            )
        previous, self.current = self.current, LoRARequest(name, lora_id, path)
        if previous is not None:
            if not self.inplace:
                self.llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)
        if not self.inplace:
            self._next_id += 1
        elif not self.llm.reset_prefix_cache():
            raise EngineError(
                f"LoRA id {lora_id} now holds version {version}, but vLLM refused to reset its prefix cache (a "
                "request still holds KV blocks): cached KV of the previous adapter could be reused. The adapter needs "
                "no second load: let those requests finish or abort them, then call llm.reset_prefix_cache(); load "
                "between rollouts, or use VllmLoraLoader(llm, inplace=False) (a new LoRA id per version shares no KV)"
            )
        log.info(
            "LoRA adapter of version %d loaded as vLLM LoRA id %d%s",
            version,
            lora_id,
            " in place" if self.inplace else "",
        )
        return self.current
