"""Rank functions for rebuild_params_from_main: bf16 params dropped on offload, rebuilt from the fp32 main params."""

from __future__ import annotations

import torch

from tests.engines.megatron import tiny_gpt


def _streamed(adapter) -> dict[str, torch.Tensor]:
    return {name: w.detach().to("cpu", copy=True) for name, w in adapter.named_weights()}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return sorted(a) == sorted(b) and all(
        torch.equal(a[k].view(torch.uint8) if a[k].dim() else a[k], b[k].view(torch.uint8) if b[k].dim() else b[k])
        for k in a
    )


def rebuild_world(rank: int, world_size: int, use_distributed_optimizer: bool) -> dict:
    from refitkit.engines import DeviceState
    from refitkit.engines import megatron as rm
    from refitkit.engines.megatron.main_params import main_pairs, rebuildable_tensors
    from refitkit.errors import InvalidInput

    reference = tiny_gpt.build(use_distributed_optimizer=use_distributed_optimizer)
    reference_losses = [tiny_gpt.train_step(reference, s) for s in range(4)]
    reference_weights = tiny_gpt.weights(reference)

    trainer = tiny_gpt.build(use_distributed_optimizer=use_distributed_optimizer)
    losses = [tiny_gpt.train_step(trainer, s) for s in range(2)]
    adapter = rm.MegatronAdapter(trainer.chunks, trainer.optimizer, rebuild_params_from_main=True)
    seen: dict = {}
    dropped = rebuildable_tensors(adapter.chunks, adapter._leaves, main_pairs(adapter._leaves))
    seen["dropped_names"] = [n for n, _ in dropped]
    seen["bf16_bytes"] = sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for _, t in dropped}.values())
    seen["bf16_dtypes"] = sorted({str(t.dtype) for _, t in dropped})
    seen["model_bytes"] = adapter.state_bytes().model.device_bytes
    before = _streamed(adapter)
    move = adapter.offload()
    seen["moved_model_bytes"] = move.model.bytes
    seen["moved_total"] = move.total.bytes
    seen["device_bytes_after_offload"] = adapter.state_bytes().device_bytes
    seen["arena_held"] = adapter.arena.held_bytes
    for kwargs in ({"optimizer": False}, {"defer_optimizer": True}):
        try:
            adapter.reload(**kwargs)
            seen[f"refused_{sorted(kwargs)[0]}"] = None
        except InvalidInput as error:
            seen[f"refused_{sorted(kwargs)[0]}"] = str(error)
    seen["still_offloaded"] = adapter.state is DeviceState.OFFLOADED and adapter.state_bytes().device_bytes == 0
    adapter.reload()
    seen["streamed_equal"] = _equal(_streamed(adapter), before)
    losses += [tiny_gpt.train_step(trainer, s) for s in range(2, 4)]
    seen["losses_equal"] = losses == reference_losses
    seen["weights_equal"] = _equal(tiny_gpt.weights(trainer), reference_weights)

    # a param written outside the optimizer breaks bf16(main) == param: it travels by copy instead
    param = next(p for n, p in trainer.chunks[0].named_parameters() if p.requires_grad and p.dtype == torch.bfloat16)
    with torch.no_grad():
        param.view(-1)[0] = param.view(-1)[0] + 1.0
    changed = _streamed(adapter)
    seen["moved_model_bytes_when_changed"] = adapter.offload().model.bytes
    adapter.reload()
    seen["changed_kept"] = _equal(_streamed(adapter), changed)
    return seen


def hook_failure_world(rank: int, world_size: int, drop_first: bool) -> dict:
    """The offload's hook (the bf16 drop) raises after the copies freed every storage: the parts must stay OFFLOADED."""
    from refitkit.engines import megatron as rm

    class FailingDrop(rm.MegatronAdapter):
        def _after_offload(self, parts: list[str]) -> None:
            if drop_first:
                super()._after_offload(parts)  # the bf16 params are gone too
            raise RuntimeError("injected failure in _after_offload")

    trainer = tiny_gpt.build(use_distributed_optimizer=True)
    tiny_gpt.train_step(trainer, 0)
    adapter = FailingDrop(trainer.chunks, trainer.optimizer, rebuild_params_from_main=True)
    before = _streamed(adapter)
    optimizer_before = {k: v.detach().clone() for k, v in adapter._optimizer_tensors()}
    seen: dict = {}
    try:
        adapter.offload()
        seen["error"] = None
    except RuntimeError as error:
        seen["error"] = str(error)
    seen["parts"] = [getattr(adapter.part_states, p).name for p in ("model", "optimizer", "grad")]
    seen["device_bytes"] = adapter.state_bytes().device_bytes
    if seen["parts"] != ["OFFLOADED"] * 3:
        return seen  # a reload would skip the freed storages and the rest would touch them (a crash)
    adapter.reload()
    seen["parts_after_reload"] = [getattr(adapter.part_states, p).name for p in ("model", "optimizer", "grad")]
    seen["streamed_equal"] = _equal(_streamed(adapter), before)
    optimizer_after = dict((k, v.detach()) for k, v in adapter._optimizer_tensors())
    seen["optimizer_equal"] = _equal(optimizer_after, optimizer_before)
    seen["device_bytes_after_reload"] = adapter.state_bytes().device_bytes
    seen["model_bytes_after_reload"] = adapter.state_bytes().model.device_bytes
    tiny_gpt.train_step(trainer, 1)  # the state is whole again: a step runs
    return seen


def prepare_world(rank: int, world_size: int, arriving: bool) -> dict:
    """prepare() with rebuild_params_from_main: host bytes for what an offload copies, not for the dropped params."""
    from refitkit.engines import megatron as rm
    from refitkit.engines.megatron.main_params import main_pairs, rebuildable_tensors

    trainer = tiny_gpt.build(use_distributed_optimizer=True)
    tiny_gpt.train_step(trainer, 0)
    adapter = rm.MegatronAdapter(trainer.chunks, trainer.optimizer, rebuild_params_from_main=True)
    dropped = rebuildable_tensors(adapter.chunks, adapter._leaves, main_pairs(adapter._leaves))
    seen: dict = {
        "bf16_bytes": sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for _, t in dropped}.values())
    }
    before = _streamed(adapter)
    if arriving:  # the first prepare() while a deferred reload of the optimizer state is still copying
        adapter.offload(model=False)
        arena_before = adapter.arena.nbytes
        adapter.reload(defer_optimizer=True)
        seen["state_at_prepare"] = adapter.part_states.optimizer.name
        seen["reserved"] = arena_before + adapter.prepare().wait(60)
    else:
        seen["state_at_prepare"] = adapter.part_states.optimizer.name
        seen["reserved"] = adapter.prepare().wait(60)
    move = adapter.offload()
    seen["moved"], seen["storages"] = move.total.bytes, move.total.storages
    seen["arena_after_offload"] = adapter.arena.nbytes
    adapter.reload()
    seen["streamed_equal"] = _equal(_streamed(adapter), before)
    return seen
