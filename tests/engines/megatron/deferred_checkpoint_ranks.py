"""Rank functions: Megatron's optimizer checkpointed (saved or loaded) while a deferred reload is ARRIVING.

Megatron's dist-checkpoint path is ``optimizer.sharded_state_dict(model_sharded_state_dict, ...)``
(ShardedTensors wrapping the live state tensors), then for a load ``dist_checkpointing.load``
writes into those tensors in place and ``optimizer.load_state_dict`` takes the result.
``dist_checkpointing.save`` needs child processes (not allowed in these daemonic ranks), so the
in-memory round trip below stands in for the storage layer: the same objects, the same in-place writes.
"""

from __future__ import annotations

import copy
import threading
from typing import Any

import torch

from tests.engines.megatron import tiny_gpt
from tests.engines.megatron.deferred_ranks import _inner_optimizers, _state
from tests.helpers.bits import bits_equal

GATE_S = 60.0  # bound on a held-back copy's wait (never reached when the test passes)
METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}  # the bucket-space format: no gathers


def _sharded(trainer, *, is_loading: bool = False) -> dict:
    return trainer.optimizer.sharded_state_dict(
        trainer.chunks[0].sharded_state_dict(), is_loading=is_loading, metadata=METADATA
    )


def _flat(obj: Any, path: str, out: dict[str, Any]) -> None:
    """Every leaf of a sharded state dict by path; tensors cloned (what a save would write now)."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedObject, ShardedTensor

    if isinstance(obj, ShardedTensor):
        out[path] = obj.data.clone()
    elif isinstance(obj, ShardedObject):
        _flat(obj.data, f"{path}<object>", out)
    elif isinstance(obj, LocalNonpersistentObject):
        _flat(obj.obj, f"{path}<local>", out)
    elif isinstance(obj, dict):
        for key, value in obj.items():
            _flat(value, f"{path}.{key}", out)
    elif isinstance(obj, (list, tuple)):
        for index, value in enumerate(obj):
            _flat(value, f"{path}[{index}]", out)
    elif isinstance(obj, torch.Tensor):
        out[path] = obj.clone()
    else:
        out[path] = copy.deepcopy(obj)


def saved(trainer) -> dict[str, Any]:
    out: dict[str, Any] = {}
    _flat(_sharded(trainer), "", out)
    return out


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if sorted(a) != sorted(b):
        return False
    for key in a:
        if isinstance(a[key], torch.Tensor):
            if not (isinstance(b[key], torch.Tensor) and bits_equal(a[key], b[key])):
                return False
        elif a[key] != b[key]:
            return False
    return True


def _loaded(obj: Any, path: str, checkpoint: dict[str, Any]) -> Any:
    """What ``dist_checkpointing.load`` returns for a loading sharded state dict: tensors written in place."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedObject, ShardedTensor

    if isinstance(obj, ShardedTensor):
        obj.data.copy_(checkpoint[path])  # into the live state tensor, as the storage layer does
        return obj.data
    if isinstance(obj, ShardedObject):
        return _rebuild(obj.data, f"{path}<object>", checkpoint)
    if isinstance(obj, LocalNonpersistentObject):
        return obj.obj
    if isinstance(obj, dict):
        return {key: _loaded(value, f"{path}.{key}", checkpoint) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_loaded(value, f"{path}[{index}]", checkpoint) for index, value in enumerate(obj))
    return _rebuild(obj, path, checkpoint)  # common (unsharded) state, e.g. the step: the checkpoint's value


def _rebuild(obj: Any, path: str, checkpoint: dict[str, Any]) -> Any:
    """A saved object's value from the flat checkpoint (its structure from the loading side's)."""
    if isinstance(obj, dict):
        return {key: _rebuild(value, f"{path}.{key}", checkpoint) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_rebuild(value, f"{path}[{index}]", checkpoint) for index, value in enumerate(obj))
    value = checkpoint[path]
    return value.clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)


def load(trainer, checkpoint: dict[str, Any]) -> None:
    trainer.optimizer.load_state_dict(_loaded(_sharded(trainer, is_loading=True), "", checkpoint))


def _moments_and_main_params(trainer) -> dict[str, torch.Tensor]:
    """The optimizer tensors a checkpoint load must bring: not the step, which Megatron 0.16.1's
    dp_reshardable load takes from the running optimizer without TE/Apex (the reference does the same)."""
    return {k: v for k, v in _state(trainer).items() if k.startswith("o.") and not k.endswith(".step")}


def _hook_count(inner: list[torch.optim.Optimizer]) -> int:
    return sum(
        len(o._optimizer_step_pre_hooks)
        + len(o._optimizer_state_dict_pre_hooks)
        + len(o._optimizer_load_state_dict_pre_hooks)
        for o in inner
    )


def checkpoint_while_arriving(rank: int, world_size: int, use_distributed_optimizer: bool, mode: str) -> dict:
    """``mode``: "save" (sharded_state_dict right after the deferred reload), "load" (a checkpoint loaded
    then) or "fail" (the deferred reload fails: the save raises). The copies are held back until
    Megatron's call reaches its inner optimizers' state_dict (a pre-hook registered before the adapter's)."""
    from refitkit.engines import DeviceState
    from refitkit.engines import megatron as rm
    from refitkit.errors import RefitError

    def build(seed: int = 1234):
        return tiny_gpt.build(use_distributed_optimizer=use_distributed_optimizer, seed=seed)

    seen: dict = {}
    if mode == "load":
        source = build(seed=7)  # another run: every value differs from this one's
        for step in range(3):
            tiny_gpt.train_step(source, step)
        checkpoint = saved(source)
        source_state = _moments_and_main_params(source)
    reference = build()
    reference_losses = [tiny_gpt.train_step(reference, s) for s in range(2)]
    expected = saved(reference)
    if mode == "load":
        load(reference, checkpoint)
        reference_losses += [tiny_gpt.train_step(reference, s) for s in range(2, 4)]

    trainer = build()
    losses = [tiny_gpt.train_step(trainer, s) for s in range(2)]
    adapter = rm.MegatronAdapter(trainer.chunks, trainer.optimizer)
    adapter.offload()
    gate = threading.Event()
    victim = adapter._optimizer_tensors()[-1][0]

    def before_copy(name: str) -> None:
        gate.wait(GATE_S)
        if mode == "fail" and name == victim:
            raise RuntimeError("injected regrow failure")

    adapter._deferred_before_copy = before_copy
    inner = _inner_optimizers(trainer)

    def at_state_dict(opt: torch.optim.Optimizer) -> None:  # registered before the adapter's hooks: runs first
        if "optimizer_bytes" not in seen:
            seen["optimizer_bytes"] = adapter.state_bytes().optimizer.device_bytes
            gate.set()

    mine = [opt.register_state_dict_pre_hook(at_state_dict) for opt in inner]
    adapter.reload(defer_optimizer=True)
    seen["arriving"] = adapter.part_states.optimizer is DeviceState.ARRIVING
    seen["hooked"] = _hook_count(inner) == 4 * len(inner)  # the adapter's three and the test's one, per optimizer
    if mode == "save":
        seen["saved_equal"] = same(saved(trainer), expected)
    elif mode == "load":
        load(trainer, checkpoint)
    else:
        try:
            saved(trainer)
            seen["error"] = None
        except RefitError as error:
            seen["error"] = str(error)
        seen["after_failure"] = adapter.part_states.optimizer.name
        seen["optimizer_bytes_after_failure"] = adapter.state_bytes().optimizer.device_bytes
        adapter._deferred_before_copy = None
        adapter.reload()  # the plain reload's retry rule
        seen["saved_equal"] = same(saved(trainer), expected)
    seen["on_device"] = adapter.part_states.optimizer is DeviceState.ON_DEVICE  # the call itself waited
    for handle in mine:
        handle.remove()
    seen["hooks_left"] = _hook_count(inner)
    if mode == "load":
        after_load = _moments_and_main_params(trainer)
        seen["loaded_equal"] = sorted(after_load) == sorted(source_state) and all(
            torch.equal(after_load[k], source_state[k]) for k in after_load
        )
        losses += [tiny_gpt.train_step(trainer, s) for s in range(2, 4)]
        seen["losses_equal"] = losses == reference_losses
        final, wanted = _state(trainer), _state(reference)
        seen["state_equal"] = sorted(final) == sorted(wanted) and all(torch.equal(final[k], wanted[k]) for k in final)
    seen["victim"] = victim
    return seen
