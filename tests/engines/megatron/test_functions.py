"""The six offload / load functions on a real Megatron GPT (DDP + Adam) in real gloo worlds.

Each world trains a reference run and an offloaded run from the same seed and data; the
offloaded run must free every device storage and then train on bit-identically.
"""

from __future__ import annotations

import pytest
import torch

from tests.engines.megatron import tiny_gpt
from tests.helpers.world import run_world

STEPS = 5  # offload rounds after step 1 and after step 3


def _copy_params(optimizer) -> list[torch.Tensor]:
    """The fp32 master copies, read straight from Megatron (independently of refitkit)."""
    found = []
    for leaf in optimizer.chained_optimizers:
        groups = getattr(leaf, "shard_fp32_from_float16_groups", None) or leaf.fp32_from_float16_groups
        found += [p for group in groups for p in group if p is not None]
    return found


def _state(optimizer) -> list[torch.Tensor]:
    return [
        value
        for leaf in optimizer.chained_optimizers
        for per_param in leaf.optimizer.state.values()
        for key, value in per_param.items()
        if isinstance(value, torch.Tensor) and key != "step"
    ]


def _grads(trainer) -> list[torch.Tensor]:
    return [p.main_grad for p in trainer.chunks[0].parameters() if p.requires_grad]


def _params(trainer) -> list[torch.Tensor]:
    return list(trainer.chunks[0].parameters())


def _snapshot(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().to("cpu", copy=True) for t in tensors]


def _same(tensors: list[torch.Tensor], snapshot: list[torch.Tensor]) -> bool:
    return all(torch.equal(t.detach().cpu(), s) for t, s in zip(tensors, snapshot, strict=True))


def six_functions_world(rank: int, world_size: int, use_distributed_optimizer: bool) -> dict:
    """Reference run, then the same run with every function exercised between steps."""
    from refitkit.engines import megatron as rm

    reference = tiny_gpt.build(use_distributed_optimizer=use_distributed_optimizer)
    reference_losses = [tiny_gpt.train_step(reference, step) for step in range(STEPS)]
    reference_weights = tiny_gpt.weights(reference)

    trainer = tiny_gpt.build(use_distributed_optimizer=use_distributed_optimizer)
    chunks, optimizer = trainer.chunks, trainer.optimizer
    losses = [tiny_gpt.train_step(trainer, step) for step in range(2)]
    parts = {
        "params": _params(trainer),
        "grads": _grads(trainer),
        "copies": _copy_params(optimizer),
        "state": _state(optimizer),
    }
    before = {name: tiny_gpt.device_bytes(t) for name, t in parts.items()}
    values = {name: _snapshot(t) for name, t in parts.items() if name != "grads"}
    seen: dict = {"before": before, "optimizer": [type(leaf).__name__ for leaf in optimizer.chained_optimizers]}

    def now() -> dict:
        return {name: tiny_gpt.device_bytes(t) for name, t in parts.items()}

    moved = rm.offload_megatron_model_to_cpu(chunks)
    seen["after_model_offload"] = now()
    seen["model_moved"] = moved.bytes
    seen["model_arena_held"] = rm.arena_of(chunks[0]).held_bytes
    seen["copy_moved"] = rm.offload_megatron_copy_params(optimizer).bytes
    seen["after_copy_offload"] = now()
    seen["optimizer_moved"] = rm.offload_megatron_optimizer(optimizer).bytes
    seen["after_optimizer_offload"] = now()
    rm.load_megatron_copy_params(optimizer)
    seen["after_copy_load"] = now()
    seen["copies_restored"] = _same(parts["copies"], values["copies"])
    rm.load_megatron_optimizer(optimizer)
    seen["after_optimizer_load"] = now()
    seen["state_restored"] = _same(parts["state"], values["state"])
    rm.load_megatron_model_to_gpu(chunks, load_grad=False)
    seen["after_model_load_no_grad"] = now()
    seen["params_restored"] = _same(parts["params"], values["params"])
    rm.load_megatron_model_to_gpu(chunks, load_grad=True)
    seen["after_model_load"] = now()
    seen["grads_zero"] = all(bool((g == 0).all()) for g in parts["grads"])
    seen["main_grad_views_kept"] = all(
        p.main_grad is g for p, g in zip([p for p in chunks[0].parameters() if p.requires_grad], parts["grads"])
    )

    losses += [tiny_gpt.train_step(trainer, step) for step in range(2, 4)]
    arenas = [rm.arena_of(chunks[0]), rm.arena_of(optimizer.chained_optimizers[0])]
    first_round = [(a.nbytes, a.chunks) for a in arenas]
    rm.offload_megatron_model_to_cpu(chunks)
    rm.offload_megatron_optimizer(optimizer)
    seen["after_second_offload"] = now()
    rm.load_megatron_model_to_gpu(chunks)
    rm.load_megatron_optimizer(optimizer)
    seen["arenas_reused"] = first_round == [(a.nbytes, a.chunks) for a in arenas]
    losses += [tiny_gpt.train_step(trainer, step) for step in range(4, STEPS)]
    return {
        "reference_losses": reference_losses,
        "losses": losses,
        "weights_identical": {n: torch.equal(w, reference_weights[n]) for n, w in tiny_gpt.weights(trainer).items()},
        "seen": seen,
    }


CASES = [
    pytest.param(1, True, id="ws1-distributed-optimizer"),
    pytest.param(2, True, id="ws2-distributed-optimizer"),
    pytest.param(1, False, id="ws1-float16-optimizer"),
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size,use_distributed_optimizer", CASES)
def test_six_functions_free_everything_and_training_continues_bit_identically(world_size, use_distributed_optimizer):
    results = run_world(six_functions_world, world_size, use_distributed_optimizer, timeout_s=200)
    for rank, result in enumerate(results):
        seen = result["seen"]
        before = seen["before"]
        expected_kind = "DistributedOptimizer" if use_distributed_optimizer else "Float16OptimizerWithFloat16Params"
        assert seen["optimizer"] == [expected_kind], rank
        assert all(before[part] > 0 for part in ("params", "grads", "copies", "state")), before

        # model offload frees params and grads, touches nothing else
        assert seen["after_model_offload"] == {**before, "params": 0, "grads": 0}
        assert seen["model_moved"] == before["params"] == seen["model_arena_held"]
        # copy params alone, then the optimizer (its copy params are already on host)
        assert seen["after_copy_offload"] == {**before, "params": 0, "grads": 0, "copies": 0}
        assert seen["copy_moved"] == before["copies"]
        assert seen["after_optimizer_offload"] == {"params": 0, "grads": 0, "copies": 0, "state": 0}
        assert seen["optimizer_moved"] >= before["state"]  # + Adam's step scalars on a CPU-only run
        # loads restore exactly what they own
        assert seen["after_copy_load"] == {"params": 0, "grads": 0, "copies": before["copies"], "state": 0}
        assert seen["copies_restored"] and seen["state_restored"] and seen["params_restored"]
        assert seen["after_optimizer_load"] == {**before, "params": 0, "grads": 0}
        assert seen["after_model_load_no_grad"] == {**before, "grads": 0}
        assert seen["after_model_load"] == before
        assert seen["grads_zero"] and seen["main_grad_views_kept"]
        # a second round frees everything again and allocates no new host memory
        assert seen["after_second_offload"] == {"params": 0, "grads": 0, "copies": 0, "state": 0}
        assert seen["arenas_reused"]
        # same losses and weights as the run that never offloaded, bit for bit
        assert result["losses"] == result["reference_losses"], rank
        assert all(result["weights_identical"].values()), [n for n, ok in result["weights_identical"].items() if not ok]
