"""``RefitkitMegatronEngine``: verl 0.9.1's Megatron training engine (its class, its config) whose ``to()`` moves a real
Megatron GPT, its DDP buffers and distributed optimizer through refitkit's ``MegatronAdapter``.

verl's own ``__init__`` / ``initialize()`` builds the model through Megatron-Bridge on a GPU, so here the engine gets
the pieces verl's ``initialize()`` would give it (``module``: the model chunks, ``optimizer``, ``engine_config``: verl's
``McoreEngineConfig``) around the tests' tiny Megatron GPT (``tests/engines/megatron/tiny_gpt.py``, its test-only CPU
shim on this machine). Training then goes on bit for bit as if nothing had moved."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core", reason="megatron-core (envs/verl.txt has it)")
pytest.importorskip("verl.workers.engine.megatron.transformer_impl", reason="verl's Megatron engine")

from tests.helpers.world import run_world  # noqa: E402

pytestmark = pytest.mark.timeout(240)


def _bytes(trainer) -> dict[str, int]:
    from tests.engines.megatron import tiny_gpt

    leaf = trainer.optimizer.chained_optimizers[0]
    return {
        "params": tiny_gpt.device_bytes(list(trainer.chunks[0].parameters())),
        "grads": tiny_gpt.device_bytes([p.main_grad for p in trainer.chunks[0].parameters()]),
        "copies": tiny_gpt.device_bytes([p for group in leaf.shard_fp32_from_float16_groups for p in group]),
        "state": tiny_gpt.device_bytes([v for s in leaf.optimizer.state.values() for k, v in s.items() if k != "step"]),
    }


def engine_world(rank: int, world_size: int) -> dict:
    import torch
    from verl.workers.config import McoreEngineConfig
    from verl.workers.engine.base import EngineRegistry

    from refitkit.engines.megatron import MegatronAdapter
    from refitkit.errors import InvalidInput
    from refitkit.integrations.verl.colocated import ENGINE_VENDOR, RefitkitMegatronEngine
    from tests.engines.megatron import tiny_gpt

    reference = tiny_gpt.build()
    reference_losses = [tiny_gpt.train_step(reference, step) for step in range(3)]
    trainer = tiny_gpt.build()
    losses = [tiny_gpt.train_step(trainer, 0)]

    engine = object.__new__(RefitkitMegatronEngine)  # what verl's initialize() leaves on it (see the docstring)
    engine.module, engine.optimizer = trainer.chunks, trainer.optimizer
    engine.engine_config = McoreEngineConfig(param_offload=True, optimizer_offload=True)
    engine._is_offload_param = engine._is_offload_optimizer = True
    seen = {"before": _bytes(trainer)}
    engine.to("cpu")  # verl's offload after a training step: model, grads, optimizer
    seen["offloaded"] = _bytes(trainer)
    seen["adapter"] = type(engine._adapter) is MegatronAdapter and engine._adapter.chunks == list(trainer.chunks)
    try:
        engine.to("cpu", model=False, optimizer=False, grad=True)
        seen["grad_without_model"] = "no error"
    except InvalidInput as error:
        seen["grad_without_model"] = str(error)
    engine.to("cuda")  # verl's device name (on this CPU the shim keeps Megatron here; the adapter reloads in place)
    seen["reloaded"] = _bytes(trainer)
    engine.to("cpu", model=True, optimizer=False, grad=False)  # verl's naive path: the model only, before the KV wake
    seen["model_only"] = _bytes(trainer)
    engine.to("cuda", model=True, optimizer=False, grad=False)
    losses += [tiny_gpt.train_step(trainer, step) for step in (1, 2)]
    megatron = EngineRegistry._engines["language_model"]["megatron"]
    registered = {"cuda": megatron.get(("cuda", ENGINE_VENDOR)), "npu": megatron.get(("npu", ENGINE_VENDOR))}
    return {
        "reference_losses": reference_losses,
        "losses": losses,
        "same_weights": all(
            torch.equal(w, tiny_gpt.weights(reference)[n]) for n, w in tiny_gpt.weights(trainer).items()
        ),
        "seen": seen,
        "registered": registered == {"cuda": RefitkitMegatronEngine, "npu": None},  # npu's is Mindspeed's
    }


def test_verls_megatron_engine_moves_through_refitkits_adapter_and_trains_on_bit_for_bit() -> None:
    (result,) = run_world(engine_world, 1)
    seen = result["seen"]
    assert all(seen["before"].values()), seen["before"]
    assert seen["offloaded"] == {part: 0 for part in seen["before"]}, "every device storage freed"
    assert seen["adapter"], "the move was refitkit's MegatronAdapter over the engine's chunks"
    assert "grad=True needs model=True" in seen["grad_without_model"]
    assert seen["reloaded"] == seen["before"]
    assert seen["model_only"]["params"] == 0 and seen["model_only"]["state"] == seen["before"]["state"]
    assert result["losses"] == result["reference_losses"] and result["same_weights"]
    assert result["registered"]
