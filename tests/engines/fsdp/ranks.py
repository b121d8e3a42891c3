"""Rank functions for the FSDP adapter tests: a tiny model trained with real FSDP2 over gloo."""

from __future__ import annotations

import torch
from torch import nn

from refitkit.engines import DeviceState
from refitkit.engines.fsdp import FSDPAdapter
from refitkit.offload.device import local_tensor as _local
from tests.helpers.bits import bits_equal

DIM = 12  # odd-ish sizes so world size 2 shards carry padding


class TinyLM(nn.Module):
    """Embedding, two MLP blocks with a norm, a head, and a persistent + a non-persistent buffer."""

    def __init__(self, vocab: int = 37, dim: int = DIM) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 3 * dim), nn.GELU(), nn.Linear(3 * dim, dim))
            for _ in range(2)
        )
        self.head = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("scale", torch.full((dim,), 0.5))
        self.register_buffer("cache", torch.arange(dim, dtype=torch.float32), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        embedded = self.embed(tokens)
        # buffers stay fp32 under a bf16 param policy
        hidden = (embedded * self.scale + self.cache * 0.01).to(embedded.dtype)
        for block in self.blocks:
            hidden = hidden + block(hidden)
        return self.head(hidden)


def build(
    world_size: int, *, fsdp: bool, mixed_precision: bool, seed: int = 0, reshard_after_forward: bool = True
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The same initial weights on every rank; FSDP2 per block and at the root when ``fsdp``."""
    torch.manual_seed(seed)
    model = TinyLM()
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh("cpu", (world_size,))
        policy = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if mixed_precision
            else MixedPrecisionPolicy()
        )
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
        fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, optimizer


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, step: int, *, zero: bool = True) -> float:
    tokens = torch.randint(0, 37, (3, 7), generator=torch.Generator().manual_seed(1000 * rank + step))
    logits = model(tokens).float()
    loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()
    if zero:
        optimizer.zero_grad()
    return loss.item()


def local_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Clones of every local shard, buffer and optimizer state tensor, for bit-exact comparison."""
    from refitkit.offload.device import local_tensor

    out = {f"p.{n}": local_tensor(t).detach().clone() for n, t in model.named_parameters()}
    out.update({f"b.{n}": t.detach().clone() for n, t in model.named_buffers()})
    for index, (_param, state) in enumerate(optimizer.state.items()):
        for key, value in state.items():
            out[f"o.{index}.{key}"] = local_tensor(value).detach().clone()
    return out


def train_with_cycle(
    rank: int, world_size: int, fsdp: bool, mixed_precision: bool, use_to: bool, keep_grads: bool
) -> dict:
    """Baseline: 4 steps. Cycled: 2 steps, offload (checked), reload (checked), 2 steps. Same process."""
    base_model, base_opt = build(world_size, fsdp=fsdp, mixed_precision=mixed_precision)
    # the cycled run offloads with step-2 grads present: dropped grads match zero_grad(), kept grads
    # match a baseline that never zeroed them (the step-3 backward adds to them)
    base_losses = [train_step(base_model, base_opt, rank, s, zero=not (keep_grads and s == 1)) for s in range(4)]

    model, optimizer = build(world_size, fsdp=fsdp, mixed_precision=mixed_precision)
    losses = [train_step(model, optimizer, rank, s, zero=s != 1) for s in range(2)]
    adapter = FSDPAdapter(model, optimizer, keep_grads=keep_grads)
    before = local_state(model, optimizer)
    grads_before = {n: _local(p.grad).clone() for n, p in model.named_parameters() if p.grad is not None}

    move = adapter.to("cpu") if use_to else adapter.offload()
    freed = {
        "state": adapter.state.name,
        "parts": [s.name for s in vars(adapter.part_states).values()],
        "device_bytes": adapter.state_bytes().device_bytes,
        "host_bytes": adapter.state_bytes().host_bytes,
        "live_storages": [
            n
            for n, t in adapter._model_tensors() + adapter._optimizer_tensors()
            if _local(t).untyped_storage().nbytes()
        ],
        "grads_left": [
            n for n, p in model.named_parameters() if p.grad is not None and _local(p.grad).untyped_storage().nbytes()
        ],
        "grads_none": all(p.grad is None for p in model.parameters()),
        "moved_bytes": move.total.bytes,
        "model_bytes": move.model.bytes,
        "optimizer_bytes": move.optimizer.bytes,
        "grad_bytes": move.grad.bytes,
    }
    again = adapter.offload()  # idempotent: nothing left to move
    adapter.reload()
    after = local_state(model, optimizer)
    grads_after = {n: _local(p.grad).clone() for n, p in model.named_parameters() if p.grad is not None}
    losses += [train_step(model, optimizer, rank, s) for s in range(2, 4)]
    return {
        "base_losses": base_losses,
        "losses": losses,
        "base_final": local_state(base_model, base_opt),
        "final": local_state(model, optimizer),
        "intact": sorted(before) == sorted(after) and all(bits_equal(before[k], after[k]) for k in before),
        "grads_intact": sorted(grads_before) == sorted(grads_after)
        and all(bits_equal(grads_before[k], grads_after[k]) for k in grads_before),
        "n_grads_before": len(grads_before),
        "freed": freed,
        "again_bytes": again.total.bytes,
        "state_after_reload": adapter.state.name,
    }


def named_weights_match(rank: int, world_size: int) -> dict:
    """named_weights() equals the unsharded state dict bit for bit, before and after training and a cycle."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    torch.manual_seed(0)
    reference = {k: v.clone() for k, v in TinyLM().state_dict().items()}
    model, optimizer = build(world_size, fsdp=True, mixed_precision=True)
    adapter = FSDPAdapter(model, optimizer)
    initial = [(name, tensor.clone()) for name, tensor in adapter.named_weights()]
    for step in range(2):
        train_step(model, optimizer, rank, step)
    adapter.offload()
    adapter.reload()
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    trained = [(name, tensor.clone()) for name, tensor in adapter.named_weights()]
    return {
        "initial_names": [n for n, _ in initial],
        "reference_names": list(reference),
        "initial_equal": all(bits_equal(t, reference[n]) for n, t in initial),
        "trained_names": [n for n, _ in trained],
        "full_names": list(full),
        "trained_equal": all(bits_equal(t, full[n]) for n, t in trained),
        "types": sorted({type(t).__name__ for _, t in trained}),
        "says_held": getattr(adapter.named_weights(), "refitkit_holds_tensors", False),  # gathered: not the model's own
        "says_fresh": getattr(
            adapter.named_weights(), "refitkit_fresh_tensors", False
        ),  # but new ones nothing else holds
        "trained_changed": not all(bits_equal(t, reference[n]) for n, t in trained if n in reference),
    }


def offload_after_inference_forward(rank: int, world_size: int) -> dict:
    """A no-grad forward with reshard_after_forward=False leaves params unsharded; offload must reshard."""
    model, optimizer = build(world_size, fsdp=True, mixed_precision=True, reshard_after_forward=False)
    train_step(model, optimizer, rank, 0)
    tokens = torch.randint(0, 37, (2, 5), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = model(tokens).float()
    unsharded_before = sorted(n for n, p in model.named_parameters() if type(p).__name__ != "DTensor")
    adapter = FSDPAdapter(model, optimizer)
    adapter.offload()
    unsharded_after = sorted(n for n, p in model.named_parameters() if type(p).__name__ != "DTensor")
    live = [n for n, t in adapter._model_tensors() if _local(t).untyped_storage().nbytes()]
    adapter.reload()
    with torch.no_grad():
        again = model(tokens).float()
    return {
        "unsharded_before": unsharded_before,
        "unsharded_after": unsharded_after,
        "live": live,
        "same_output": bits_equal(expected, again),
    }


def repeated_cycles(rank: int, world_size: int, cycles: int) -> dict:
    """Arena size and chunk count after each of several train/offload/reload cycles."""
    model, optimizer = build(world_size, fsdp=True, mixed_precision=True)
    adapter = FSDPAdapter(model, optimizer)
    sizes = []
    for cycle in range(cycles):
        train_step(model, optimizer, rank, cycle)
        adapter.offload()
        if adapter.state is not DeviceState.OFFLOADED:  # (no assert: ranks run under `python -O` in make test)
            raise AssertionError(f"cycle {cycle}: adapter is {adapter.state} after offload()")
        sizes.append((adapter.arena.nbytes, adapter.arena.chunks, adapter.arena.held_bytes))
        adapter.reload()
    return {"sizes": sizes, "held_after": adapter.arena.held_bytes}


def cycle_garbage(rank: int, world_size: int) -> dict:
    """Cyclic garbage made by each of offload, reload and a named_weights pass on real FSDP2 (after a warm cycle)."""
    from refitkit.engines.fsdp import FSDPAdapter
    from refitkit.watchdog import CycleAudit

    model, optimizer = build(world_size, fsdp=True, mixed_precision=True)
    train_step(model, optimizer, rank, 0)
    adapter = FSDPAdapter(model, optimizer)
    adapter.offload()
    adapter.reload()
    for _ in adapter.named_weights():
        pass
    result = {}
    for phase, run in (
        ("offload", adapter.offload),
        ("reload", adapter.reload),
        ("named_weights", lambda: list(adapter.named_weights())),
    ):
        with CycleAudit() as audit:
            run()
        result[phase] = (audit.report.cyclic_objects, dict(audit.report.by_type))
    return result
