"""The names and layouts ``save_pretrained()`` writes for a transformers model's weights, in one place.

transformers 5 holds some weights in another layout than its checkpoints: a Mixture-of-Experts layer keeps its
experts fused (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``, ``mlp.experts.down_proj`` ``[E, H, I]``) where the
checkpoint, and every engine's loader, has one tensor per expert and projection (``mlp.experts.{e}.gate_proj.weight``
...). ``save_pretrained()`` reverts the model's conversion mapping over the whole state dict; ``CheckpointLayout``
reverts the same mapping one state-dict entry at a time, through transformers' own key renaming and conversion
operations, except that a split hands out views of the tensor it splits instead of copies of its halves.

Checked against transformers 5.18.0 (``core_model_loading``: ``revert_weight_conversion``, ``rename_source_key``,
``WeightConverter``, ``WeightRenaming``, ``PrefixChange``, ``Chunk``, ``SplitModulelist``;
``conversion_mapping.get_model_conversion_mapping``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from copy import deepcopy
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (
    Chunk,
    PrefixChange,
    SplitModulelist,
    WeightConverter,
    WeightRenaming,
    rename_source_key,
)

from refitkit.errors import InvalidInput, RefitError

NamedTensor = tuple[str, torch.Tensor]


class _ChunkAsViews(Chunk):
    """transformers' ``Chunk`` without its ``.contiguous()``: the chunks stay views of the tensor chunked.

    Reverting a fused ``gate_up_proj`` chunks it along dim 1 first, which transformers makes contiguous (a copy of
    the whole tensor) before splitting off each expert; each expert's half is contiguous in the fused tensor itself.
    """

    @torch.no_grad()
    def convert(
        self, input_dict: dict[str, Any], source_patterns: list[str], target_patterns: list[str], **kwargs: Any
    ) -> dict[str, torch.Tensor]:
        if len(input_dict) > 1:
            raise ValueError(f"Chunk of {len(input_dict)} source tensors, expected one")
        tensors = next(iter(input_dict.values()))
        tensor = tensors[0] if isinstance(tensors, list) else tensors
        targets = self.get_target_patterns(target_patterns, **kwargs)
        return dict(zip(targets, torch.chunk(tensor, len(targets), dim=self.dim), strict=True))


# the reverted operations whose every output is a view of its input (SplitModulelist chunks and squeezes)
_VIEW_OPERATIONS = (_ChunkAsViews, SplitModulelist)


class CheckpointLayout:
    """One transformers model's checkpoint names and layouts: the reverse of its conversion mapping.

    ``stream`` turns the model's state-dict entries into what ``save_pretrained()`` writes, name for name and bit
    for bit; ``makes_views``: every converted tensor is a view of the model's tensor it came from (no copies).
    """

    def __init__(self, model: PreTrainedModel, conversions: list[Any]) -> None:
        self.model = model
        owner = type(model).__name__
        try:
            # what revert_weight_conversion does: reverse the list (sub-models' transforms first), reverse each one
            reverse = [conversion.reverse_transform() for conversion in conversions[::-1]]
        except ValueError as exc:
            raise InvalidInput(
                f"{owner}: transformers cannot revert its weight conversion ({exc}), so the checkpoint's names are "
                "unknown; pass checkpoint_names=False to stream the in-memory names"
            ) from exc
        self._renamings = [entry for entry in reverse if isinstance(entry, WeightRenaming)]
        self._converters = [entry for entry in reverse if isinstance(entry, WeightConverter)]
        for converter in self._converters:
            converter.operations = [
                _ChunkAsViews(op.dim, op.num_shards_attribute) if type(op) is Chunk else op
                for op in converter.operations
            ]
        self._by_pattern = {pattern: entry for entry in self._converters for pattern in entry.source_patterns}
        self.makes_views = all(
            isinstance(op, _VIEW_OPERATIONS) for converter in self._converters for op in converter.operations
        )

    def checkpoint_name(self, name: str) -> tuple[str, str | None]:
        """The checkpoint's name for the state-dict entry ``name`` (the first one of a converted group, with its
        ``*``), and the source pattern of the converter that makes its tensors (None: renamed at most)."""
        return rename_source_key(name, self._renamings, self._converters, reverse=True)

    def stream(
        self, entries: list[NamedTensor], whole: Callable[[str, torch.Tensor], torch.Tensor]
    ) -> Iterator[NamedTensor]:
        """``entries`` (state-dict name, tensor) as the checkpoint's (name, tensor), one entry's worth at a time.

        ``whole(name, tensor)`` gives an entry's full tensor (a gather for a sharded one), called once per entry in
        order. An entry a converter needs together with others (none in the MoE mappings) is held until the last
        of them came; the generator keeps no reference to what it yielded.
        """
        planned = [(name, *self.checkpoint_name(name)) for name, _ in entries]
        members = Counter(key for _, key, pattern in planned if pattern is not None)
        pending: dict[str, list[tuple[str, str, torch.Tensor]]] = {}
        for (name, key, pattern), (_, tensor) in zip(planned, entries, strict=True):
            if pattern is None:
                yield key, whole(name, tensor)
                continue
            group = pending.setdefault(key, [])
            group.append((name, pattern, whole(name, tensor)))
            if len(group) < members[key]:
                continue
            converted = self._convert(key, pending.pop(key))
            del group
            converted.reverse()  # pop as we go: once yielded, a tensor is the caller's alone
            while converted:
                yield converted.pop()

    def _convert(self, key: str, group: list[tuple[str, str, torch.Tensor]]) -> list[NamedTensor]:
        """One group's tensors through a fresh copy of its converter (as ``save_pretrained()`` makes one per key)."""
        converter = deepcopy(self._by_pattern[group[0][1]])
        names = [name for name, _, _ in group]
        for name, pattern, tensor in group:
            converter.add_tensor(key, name, pattern, tensor)
        group.clear()
        try:
            converted = converter.convert(key, model=self.model, config=self.model.config)
        except (ValueError, RuntimeError, KeyError, IndexError) as exc:
            raise RefitError(
                f"{type(self.model).__name__}: transformers' conversion of {names} to the checkpoint's layout failed "
                f"({type(exc).__name__}: {exc}); pass checkpoint_names=False to stream the in-memory names"
            ) from exc
        return [(name, value[0] if isinstance(value, list) else value) for name, value in converted.items()]


def checkpoint_layout(module: nn.Module) -> CheckpointLayout | None:
    """The checkpoint layout of ``module`` when it is a transformers model whose ``save_pretrained()`` converts
    weights (renames or re-lays them out); None for any other module, whose state dict is its checkpoint."""
    model = getattr(module, "_orig_mod", module)  # torch.compile's wrapper holds the model
    if not isinstance(model, PreTrainedModel):
        return None
    # what revert_weight_conversion reverts: the mapping the model was loaded with, else its family's default one
    # without the legacy renames and without a prefix change it cannot know was made
    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:
        conversions = get_model_conversion_mapping(model, add_legacy=False)
        conversions = [entry for entry in conversions if not isinstance(entry, PrefixChange)]
    if not conversions:
        return None
    return CheckpointLayout(model, list(conversions))
