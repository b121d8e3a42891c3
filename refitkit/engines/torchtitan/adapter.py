"""TorchTitanAdapter: offload / reload for torchtitan's model parts and OptimizersContainer, HF-named weights."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from refitkit.engines.fsdp.adapter import FSDPAdapter, clean_fqn
from refitkit.engines.torchtitan import _torchtitan as titan
from refitkit.errors import InvalidInput
from refitkit.offload import HostArena

logger = logging.getLogger(__name__)


class TorchTitanAdapter(FSDPAdapter):
    """Offload / reload of a torchtitan trainer's state: ``trainer.model_parts`` and ``trainer.optimizers``.

    torchtitan parallelizes with FSDP2 / TP / PP (DTensor params), so moving is the FSDP
    adapter's; this class unpacks the ``OptimizersContainer`` and, given torchtitan's own
    ``state_dict_adapter`` (the trainer's ``checkpointer.sd_adapter``), streams weights under
    Hugging Face names and layouts through its ``to_hf``, one weight (or one fused module) at
    a time. Without it, ``named_weights()`` yields torchtitan's FQNs. ``pp_group`` (torchtitan's
    ``parallel_dims.get_mesh("pp").get_group()``) makes every stage's weights reach every rank.
    """

    def __init__(
        self,
        model_parts: nn.Module | Sequence[nn.Module],
        optimizers: Any = None,
        *,
        state_dict_adapter: Any = None,
        arena: HostArena | None = None,
        keep_grads: bool = False,
        zero_grads: bool = False,
        pp_group: Any = None,
        pp_timeout_s: float = 300.0,
    ) -> None:
        titan.require_torchtitan()
        super().__init__(
            model_parts,
            titan.container_optimizers(optimizers),
            arena=arena,
            keep_grads=keep_grads,
            zero_grads=zero_grads,
            pp_group=pp_group,
            pp_timeout_s=pp_timeout_s,
        )
        self._to_hf = titan.check_state_dict_adapter(state_dict_adapter)
        self._dropped_reported: set[str] = set()
        if self._to_hf is None:
            logger.info("TorchTitanAdapter: no state_dict_adapter given; named_weights() yields torchtitan's FQNs")

    def _yields_own_tensors(self) -> bool:
        """Not with a state-dict adapter: ``to_hf`` makes new tensors (split, permuted), which a sender must not
        keep referenced or read in place."""
        return self._to_hf is None and super()._yields_own_tensors()

    def _yields_fresh_tensors(self) -> bool:
        """Not with a state-dict adapter either: whatever ``to_hf`` builds its tensors from is its own business."""
        return self._to_hf is None and super()._yields_fresh_tensors()

    def _local_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's weights under HF names when a state-dict adapter was given, else torchtitan's FQNs.

        ``to_hf`` sees one weight at a time, or the few tensors of one module whose save hook
        rewrites them (fused ``wqkv``), never the model. Pipeline stages keep torchtitan's global
        layer numbers in their FQNs, so each stage's weights get their own HF layer names.
        """
        if self._to_hf is None:
            yield from super()._local_weights()
            return
        for part in self.model_parts:
            yield from self._hf_entries(part)

    def _hf_entries(self, part: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        hooked = {clean_fqn(prefix): module for prefix, module in titan.modules_with_save_hooks(part).items()}
        group_prefix: str | None = None
        group: dict[str, torch.Tensor] = {}
        for name, tensor in self._full_entries(part):
            prefix = _owning_prefix(name, hooked)
            if group and prefix != group_prefix:
                yield from self._convert(titan.run_save_hooks(hooked[group_prefix], group, f"{group_prefix}."))
                group = {}
            if prefix is None:
                yield from self._convert({name: tensor})
            else:
                group_prefix, group[name] = prefix, tensor
            del tensor
        if group:
            yield from self._convert(titan.run_save_hooks(hooked[group_prefix], group, f"{group_prefix}."))

    def _convert(self, native: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        try:
            converted = self._to_hf.to_hf(native)
        except (KeyError, ValueError, RuntimeError) as error:
            raise InvalidInput(
                f"{type(self).__name__}.named_weights(): {type(self._to_hf).__name__}.to_hf could not convert "
                f"{sorted(native)} ({type(error).__name__}: {error}); pass the state_dict_adapter built for this "
                "model's config, or state_dict_adapter=None for torchtitan's names"
            ) from None
        if not converted:
            self._report_dropped(native)
        native.clear()
        # pop as we go: the generator keeps no reference to what the caller already has
        while converted:
            name = next(iter(converted))
            yield name, converted.pop(name)

    def _report_dropped(self, native: dict[str, torch.Tensor]) -> None:
        """Warn once per name when ``to_hf`` drops a tensor that is not all zeros: the engine's model goes without it.

        torchtitan's Qwen3 ``to_hf`` drops what its map lacks, among them the MoE router's ``expert_bias_E`` (the
        load-balancing bias its routing adds before top-k), which a Hugging Face Qwen3-MoE has no place for: once
        trained away from zero, the engine routes tokens otherwise than the trainer.
        """
        for name, tensor in native.items():
            if name in self._dropped_reported or not bool(tensor.detach().ne(0).any()):
                continue
            self._dropped_reported.add(name)
            logger.warning(
                "%s.named_weights(): %s.to_hf has no Hugging Face name for %s, which is not all zeros; the engine's "
                "model goes without it%s",
                type(self).__name__,
                type(self._to_hf).__name__,
                name,
                (
                    " and routes tokens otherwise than the trainer (build the MoE with load_balance_coeff=None "
                    "to train without this bias)"
                    if name.endswith("expert_bias_E")
                    else ""
                ),
            )


def _owning_prefix(name: str, hooked: dict[str, nn.Module]) -> str | None:
    """The deepest module prefix in ``hooked`` that ``name`` lives under, or None."""
    best: str | None = None
    for prefix in hooked:
        if name.startswith(f"{prefix}.") and (best is None or len(prefix) > len(best)):
            best = prefix
    return best
