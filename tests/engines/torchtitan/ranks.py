"""Rank functions for the TorchTitan adapter tests: torchtitan's llama3 debug model over gloo on CPU."""

from __future__ import annotations

import torch
from torch import nn

from refitkit.offload.device import local_tensor as _local
from tests.helpers.bits import bits_equal

SEQ_LEN = 32
BATCH = 2


def build(world_size: int, *, n_layers: int = 2, seed: int = 0) -> tuple[nn.Module, object, object]:
    """torchtitan's debug model, parallelized the way its trainer does it, plus its optimizers and loss.

    CPU adjustments: torchtitan's device_type is "cpu"; the partial_dtensor SPMD backend; causal
    SDPA instead of flex attention (flex needs compiled kernels); FSDP comms forced to a plain
    sum reduction (gloo has no PREMUL_SUM); the for-loop AdamW (fused is CUDA-only).
    """
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.models.llama3.config_registry import llama3_debugmodel_ce_loss

    _use_cpu()
    config = llama3_debugmodel_ce_loss()
    config.parallelism.spmd_backend = "partial_dtensor"
    config.parallelism.data_parallel_shard_degree = world_size
    config.training.seq_len = SEQ_LEN
    config.training.local_batch_size = BATCH
    config.activation_checkpoint = None
    config.optimizer = default_adamw(lr=1e-3, foreach=False)
    config.optimizer.implementation = "for-loop"
    model, _, parallel_dims = meta_model(config, world_size, n_layers=n_layers)
    model = parallelize_on_cpu(config, model, parallel_dims, seed=seed)
    model.train()
    model_parts = [model]
    optimizers = config.optimizer.build(model_parts=model_parts)
    loss_fn = config.loss.build(compile_config=config.compile)
    return model_parts, optimizers, loss_fn


def meta_model(config: object, world_size: int, *, n_layers: int) -> tuple[nn.Module, object, object]:
    """The model of a torchtitan trainer ``config`` on the meta device (its first ``n_layers``, causal SDPA
    instead of flex attention), its model config, and the ParallelDims its parallelism gives."""
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.common.attention import ScaledDotProductAttention

    model_config = config.model_spec.model  # type: ignore[attr-defined]
    model_config.layers = model_config.layers[:n_layers]
    for layer in model_config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    dist_utils.set_spmd_backend("partial_dtensor")
    parallel_dims = ParallelDims.from_config(config.parallelism, world_size)  # type: ignore[attr-defined]
    model_config.update_from_config(config=config)
    with torch.device("meta"):
        model = model_config.build()
    return model, model_config, parallel_dims


def parallelize_on_cpu(config: object, model: nn.Module, parallel_dims: object, *, seed: int) -> nn.Module:
    """``config``'s parallelize_fn as its trainer runs it, FSDP comms summed (gloo), weights made on the CPU."""
    spec = config.model_spec  # type: ignore[attr-defined]
    model = spec.parallelize_fn(
        model,
        parallel_dims=parallel_dims,
        training=config.training,  # type: ignore[attr-defined]
        parallelism=config.parallelism,  # type: ignore[attr-defined]
        compile_config=config.compile,  # type: ignore[attr-defined]
        ac_config=None,
        dump_folder="/tmp",
    )
    _force_sum_reduction(model)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


def _use_cpu() -> None:
    """Point torchtitan's device globals at the CPU (they are copied by name into a few modules)."""
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.tools.utils as tool_utils

    for module in (tool_utils, parallel_dims, dist_utils):
        module.device_type = "cpu"
        if hasattr(module, "device_module"):
            module.device_module = torch.cpu


def _force_sum_reduction(model: nn.Module) -> None:
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


def train_step(model_parts, optimizers, loss_fn, rank: int, step: int, *, zero: bool = True) -> float:
    generator = torch.Generator().manual_seed(1000 * rank + step)
    tokens = torch.randint(0, 2048, (BATCH, SEQ_LEN + 1), generator=generator)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    pred = model_parts[0](inputs)
    loss, _ = loss_fn(pred, labels, global_valid_tokens=torch.tensor(float(labels.numel())))
    loss.backward()
    optimizers.step()
    if zero:
        optimizers.zero_grad()
    return loss.item()


def train_with_cycle(rank: int, world_size: int, keep_grads: bool) -> dict:
    """Baseline: 4 steps. Cycled: 2 steps, to("cpu") (checked), to(device), 2 steps. Same process."""
    from refitkit.engines.torchtitan import TorchTitanAdapter

    def run(cycle: bool) -> dict:
        model_parts, optimizers, loss_fn = build(world_size)
        # step-2 grads are present at the cycle: kept ones carry into step 3, dropped ones are zeroed
        losses = [
            train_step(model_parts, optimizers, loss_fn, rank, s, zero=s != 1 or not keep_grads) for s in range(2)
        ]
        out: dict = {}
        if cycle:
            adapter = TorchTitanAdapter(model_parts, optimizers, keep_grads=keep_grads)
            before = local_state(model_parts, optimizers)
            move = adapter.to("cpu")
            out["live"] = [
                n
                for n, t in adapter._model_tensors() + adapter._optimizer_tensors()
                if _local(t).untyped_storage().nbytes()
            ]
            out["live_grads"] = [
                n for n, p in adapter._grad_params() if p.grad is not None and _local(p.grad).untyped_storage().nbytes()
            ]
            out["bytes"] = (move.model.bytes, move.optimizer.bytes, move.grad.bytes)
            out["device_bytes"] = adapter.state_bytes().device_bytes
            out["state"] = adapter.state.name
            out["again"] = adapter.to("cpu").total.bytes
            adapter.reload()
            out["intact"] = _all_equal(before, local_state(model_parts, optimizers))
            out["state_after"] = adapter.state.name
        losses += [train_step(model_parts, optimizers, loss_fn, rank, s) for s in range(2, 4)]
        out["losses"] = losses
        out["final"] = local_state(model_parts, optimizers)
        return out

    return {"base": run(False), "cycled": run(True)}


def named_weights_and_cycles(rank: int, world_size: int, cycles: int) -> dict:
    """named_weights() against torchtitan's full state dict; arena size over repeated cycles."""
    from refitkit.engines.torchtitan import TorchTitanAdapter

    model_parts, optimizers, loss_fn = build(world_size)
    adapter = TorchTitanAdapter(model_parts, optimizers)
    sizes = []
    for cycle in range(cycles):
        train_step(model_parts, optimizers, loss_fn, rank, cycle)
        adapter.offload()
        sizes.append((adapter.arena.nbytes, adapter.arena.chunks, adapter.arena.held_bytes))
        adapter.reload()
    full = _native_full_state_dict(model_parts[0])
    weights = [(name, tensor.clone()) for name, tensor in adapter.named_weights()]
    return {
        "sizes": sizes,
        "names": sorted(n for n, _ in weights),
        "full_names": sorted(full),
        "equal": all(bits_equal(t, full[n]) for n, t in weights),
        "types": sorted({type(t).__name__ for _, t in weights}),
        "shapes_full": all(tuple(t.shape) == tuple(full[n].shape) for n, t in weights),
    }


def _native_full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """torchtitan's own state dict, gathered, with its split q/k/v merged back by its own load hook.

    ``state_dict()`` splits fused ``wqkv`` into ``wq``/``wk``/``wv`` (checkpoint layout);
    named_weights() streams the module's own params, so the reference is brought back to that
    layout with torchtitan's ``FusedQKVLinear._merge_qkv_on_load``.
    """
    from torchtitan.models.common.attention import FusedQKVLinear

    full = {}
    for name, tensor in model.state_dict().items():
        full[name] = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
    for prefix, module in model.named_modules():
        if isinstance(module, FusedQKVLinear):
            FusedQKVLinear._merge_qkv_on_load(module, full, f"{prefix}.")
    return full


def local_state(model_parts, optimizers) -> dict[str, torch.Tensor]:
    """Clones of every local shard, buffer and optimizer state tensor."""
    out: dict[str, torch.Tensor] = {}
    for index, part in enumerate(model_parts):
        out.update({f"{index}.p.{n}": _local(t).detach().clone() for n, t in part.named_parameters()})
        out.update({f"{index}.b.{n}": _local(t).detach().clone() for n, t in part.named_buffers()})
    for o_index, optimizer in enumerate(optimizers.optimizers):
        for p_index, state in enumerate(optimizer.state.values()):
            for key, value in state.items():
                out[f"o{o_index}.{p_index}.{key}"] = _local(value).detach().clone()
    return out


def _all_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return sorted(a) == sorted(b) and all(bits_equal(a[k], b[k]) for k in a)
