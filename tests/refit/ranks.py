"""Rank functions for multi-rank refit tests (spawned by tests.helpers.world.run_world)."""

from __future__ import annotations

import threading
import uuid

import torch

from refitkit.engines import DeviceState
from refitkit.engines.fsdp import FSDPAdapter
from refitkit.refit import RefitCycle
from refitkit.transfer import BucketedWeightReceiver, BucketedWeightSender
from tests.engines.fsdp.ranks import build, train_step
from tests.helpers.bits import bits_equal


def refit_two_ranks(rank: int, world_size: int) -> dict:
    """FSDP2 over gloo: rank 0 streams the gathered weights to a receiver, rank 1 only joins the gathers."""
    model, optimizer = build(world_size, fsdp=True, mixed_precision=False)
    train_step(model, optimizer, rank, 0)
    adapter = FSDPAdapter(model, optimizer)
    full = {name: tensor.clone() for name, tensor in adapter.named_weights()}  # what inference must get
    received: dict[str, torch.Tensor] = {}
    sender = peer = None
    if rank == 0:
        endpoint = f"refit2-{uuid.uuid4().hex[:8]}"
        sender = BucketedWeightSender(endpoint, bucket_bytes=64 * 1024, transport="shm", timeout_s=30.0)

        def receive() -> None:
            def load(batch, is_last):
                for name, tensor in batch:
                    received[name] = tensor.clone()

            BucketedWeightReceiver(endpoint, "cpu", timeout_s=30.0).receive(load)

        peer = threading.Thread(target=receive, daemon=True)
        peer.start()
    cycle = RefitCycle(adapter, sender, barrier_timeout_s=60.0)
    report = cycle.refit(step=1)
    offloaded = adapter.state is DeviceState.OFFLOADED and adapter.state_bytes().device_bytes == 0
    cycle.resume(step=1)
    if peer is not None:
        peer.join(30.0)
        sender.close()
    loss = train_step(model, optimizer, rank, 1)
    return {
        "phases": [p.name for p in report.phases],
        "sync_bytes": report.phase("sync_weights").bytes,
        "offloaded": offloaded,
        "received_equal": sorted(received) == sorted(full) and all(bits_equal(received[n], full[n]) for n in full)
        if rank == 0 else None,
        "loss_finite": bool(torch.isfinite(torch.tensor(loss))),
    }
