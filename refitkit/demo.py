"""The refit cycle end to end on a small model: trainer + a spawned inference peer (for `refitkit demo`).

The trainer trains a step, streams its weights to the peer through a ``BucketedWeightSender``,
offloads params, grads and AdamW state into the host arena, flushes and lines up, lets the peer
"roll out", then reloads and trains on. The peer checks every round that the weights it loaded
are bit-identical to the trainer's. No printing here: ``refitkit.cli`` owns the terminal.
"""

from __future__ import annotations

import contextlib
import hashlib
import multiprocessing as mp
import os
import sys
import uuid
from dataclasses import dataclass

import torch

from refitkit.engines.fsdp import FSDPAdapter
from refitkit.errors import RefitError, TransferError, TransferTimeout
from refitkit.refit import RefitCycle
from refitkit.report import RefitReport
from refitkit.transfer import BucketedWeightReceiver, BucketedWeightSender
from refitkit.watchdog import GcMonitor, RSSWatchdog

WIDTH = 512
PEER_TIMEOUT_S = 120.0
PEER_FAILED = b"failed: "  # how the peer's failure reaches the trainer (raw bytes, no pickle)


def build_model(device: torch.device, seed: int = 0) -> torch.nn.Module:
    """A small MLP stack standing in for a policy model (16 storages, ~16 MiB fp32)."""
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for _ in range(4):
        layers += [torch.nn.Linear(WIDTH, 2 * WIDTH), torch.nn.GELU(), torch.nn.Linear(2 * WIDTH, WIDTH)]
    return torch.nn.Sequential(*layers).to(device)


def digest(named: list[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 over names and raw bytes: equal digests mean bit-identical weights."""
    h = hashlib.sha256()
    for name, tensor in sorted(named, key=lambda item: item[0]):
        h.update(name.encode())
        # clone first: numpy() marks the storage it views non-resizable, which offload must refuse
        h.update(tensor.detach().cpu().clone().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def peer_main(endpoint: str, device: str, rounds: int, conn) -> None:
    """The inference side: its own model copy, loaded from the stream each round.

    A failure goes to the trainer as one line (``PEER_FAILED`` + type and message), which reports it; the peer
    then exits 1 without a traceback of its own on the terminal.
    """
    try:
        _serve_rounds(endpoint, device, rounds, conn)
    except Exception as exc:
        with contextlib.suppress(OSError):  # the trainer may be gone already
            conn.send_bytes(PEER_FAILED + f"{type(exc).__name__}: {exc}".encode(errors="replace"))
        sys.exit(1)


def _serve_rounds(endpoint: str, device: str, rounds: int, conn) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    model = build_model(torch.device(device), seed=1)  # different init: only the stream can make it match
    params = dict(model.named_parameters())
    receiver = BucketedWeightReceiver(endpoint, device, timeout_s=PEER_TIMEOUT_S)

    def load(weights: list[tuple[str, torch.Tensor]], is_last: bool) -> None:
        with torch.no_grad():
            for name, tensor in weights:
                params[name].copy_(tensor)  # views are valid only during this call

    conn.send_bytes(b"ready")
    for _ in range(rounds):
        receiver.receive(load)
        conn.send_bytes(digest(list(params.items())).encode())  # raw bytes, no pickle


@dataclass(frozen=True)
class DemoRound:
    """One round: the trainer's loss, the refit and resume reports, and the peer's verdict."""

    loss: float
    refit: RefitReport
    resume: RefitReport
    peer_matches: bool
    freed_while_offloaded: bool


@dataclass(frozen=True)
class DemoResult:
    device: str
    transport: str
    rounds: list[DemoRound]
    arena_bytes: int
    arena_pinned: bool
    watchdog_status: str
    explicit_gc: int


def _from_peer(conn, what: str) -> bytes:
    """One message from the peer, bounded by PEER_TIMEOUT_S; a dead peer is an error, not a hang."""
    if not conn.poll(PEER_TIMEOUT_S):
        raise TransferTimeout(f"demo peer: no {what} within PEER_TIMEOUT_S={PEER_TIMEOUT_S} s")
    try:
        message = conn.recv_bytes()
    except EOFError:
        raise TransferError(f"demo peer exited before sending its {what}") from None
    if message.startswith(PEER_FAILED):
        failure = message[len(PEER_FAILED) :].decode(errors="replace")
        raise TransferError(f"demo peer failed before sending its {what}: {failure}", remote_message=failure)
    return message


def run_demo(*, rounds: int = 3, device: str | None = None, bucket_bytes: int = 4 << 20) -> DemoResult:
    """Run ``rounds`` train / refit / resume cycles against a spawned peer; returns what happened."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = build_model(dev)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    adapter = FSDPAdapter(model, optimizer, keep_grads=False)
    endpoint = f"refitkit-demo-{uuid.uuid4().hex[:8]}"
    transport = "cuda_ipc" if dev.type == "cuda" else "shm"
    context = mp.get_context("spawn")
    parent, child = context.Pipe()
    peer = context.Process(target=peer_main, args=(endpoint, dev.type, rounds, child), daemon=True)
    watchdog = RSSWatchdog(window=max(rounds, 3), warmup=1)
    monitor = GcMonitor()
    results: list[DemoRound] = []
    stage = "start"
    with BucketedWeightSender(
        endpoint, bucket_bytes=bucket_bytes, transport=transport, timeout_s=PEER_TIMEOUT_S
    ) as sender:
        peer.start()
        child.close()  # only the peer holds its end now, so its death reads as EOF here
        finished = False
        try:
            if _from_peer(parent, "start") != b"ready":
                raise TransferError("demo peer sent an unexpected greeting")
            cycle = RefitCycle(adapter, sender, barrier_timeout_s=60.0, on_phase=watchdog.mark)
            with monitor:
                for step in range(rounds):
                    stage = f"round {step}"
                    batch = torch.randn(16, WIDTH, generator=torch.Generator().manual_seed(step)).to(dev)
                    loss = model(batch).pow(2).mean()
                    loss.backward()
                    optimizer.step()
                    expected = digest(list(model.named_parameters()))
                    refit = cycle.refit(step)
                    freed = adapter.state_bytes().device_bytes == 0
                    matches = _from_peer(parent, f"digest of round {step}").decode() == expected
                    resume = cycle.resume(step)
                    optimizer.zero_grad(set_to_none=True)
                    watchdog.end_cycle()
                    results.append(DemoRound(loss.item(), refit, resume, matches, freed))
            finished = True
        except RefitError:
            raise
        except Exception as exc:  # the CLI reports a refitkit error in one line; the trainer's own failure is one too
            raise RefitError(f"demo trainer failed at {stage}: {type(exc).__name__}: {exc}") from exc
        finally:
            # a peer left waiting on a failed trainer would hold the demo for PEER_TIMEOUT_S: stop it at once
            if finished:
                peer.join(PEER_TIMEOUT_S)
            if peer.is_alive():
                peer.kill()
                peer.join(PEER_TIMEOUT_S)
    verdict = watchdog.end_cycle()
    return DemoResult(
        device=str(dev),
        transport=transport,
        rounds=results,
        arena_bytes=adapter.arena.nbytes,
        arena_pinned=adapter.arena.pinned,
        watchdog_status=verdict.status,
        explicit_gc=monitor.totals().explicit,
    )
