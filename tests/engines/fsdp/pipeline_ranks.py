"""Rank functions for pipeline-stage failure tests: a four-layer model split into two stages, each
stage optionally FSDP2-sharded over its data-parallel ranks (real gloo groups, spawned ranks)."""

from __future__ import annotations

import datetime
import threading
import time
import uuid

import torch
from torch import nn

from refitkit.engines import DeviceState
from refitkit.engines.fsdp import FSDPAdapter
from refitkit.refit import RefitCycle
from refitkit.transfer import BucketedWeightReceiver, BucketedWeightSender
from tests.helpers.bits import bits_equal

LAYERS, DIM, VOCAB = 4, 10, 23


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(index): nn.Linear(DIM, DIM) for index in range(LAYERS)})
        self.head = nn.Linear(DIM, VOCAB, bias=False)


def full_model() -> Stack:
    torch.manual_seed(0)
    return Stack()


def stage(stage_index: int) -> Stack:
    """Pipeline stage ``stage_index`` of 2: the full model's layers kept under their own names."""
    model = full_model()
    keep = range(0, LAYERS // 2) if stage_index == 0 else range(LAYERS // 2, LAYERS)
    for index in range(LAYERS):
        if index not in keep:
            del model.layers[str(index)]
    if stage_index == 0:
        model.head = None
    else:
        model.embed = None
    return model


def _groups(world_size: int, pg_timeout_s: float) -> tuple[int, nn.Module, object]:
    """(pipeline stage, the stage's model, the pipeline group). World 2: PP2; world 4: PP2 x FSDP2 (rank = 2 * pp + dp)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    if world_size == 2:
        # the trainer's pipeline group with a short timeout of its own: without refitkit's bound a rank waits this long
        pp_group = dist.new_group([0, 1], backend="gloo", timeout=datetime.timedelta(seconds=pg_timeout_s))
        return rank, stage(rank), pp_group
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage_index = rank // 2
    model = stage(stage_index)
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return stage_index, model, mesh.get_group("pp")


class _Receiver:
    """A receiver thread on the sending rank, keeping what it got."""

    def __init__(self, endpoint: str) -> None:
        self.received: dict[str, torch.Tensor] = {}
        self.error: str | None = None
        self._thread = threading.Thread(target=self._run, args=(endpoint,), daemon=True)
        self._thread.start()

    def _run(self, endpoint: str) -> None:
        def load(batch, is_last):
            for name, tensor in batch:
                self.received[name] = tensor.clone()

        try:
            BucketedWeightReceiver(endpoint, "cpu", timeout_s=30.0).receive(load)
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"

    def join(self) -> None:
        self._thread.join(30.0)


def _all_reduce(value: float) -> float:
    import torch.distributed as dist

    tensor = torch.tensor([value])
    dist.all_reduce(tensor)
    return float(tensor.item())


def stage_fails_part_way(
    rank: int, world_size: int, failing_rank: int, pp_timeout_s: float, pg_timeout_s: float
) -> dict:
    """``failing_rank`` holds a buffer left on the meta device in its stage's first layer, so its stream
    fails after that layer's weights; rank 0 streams to a receiver. Every rank must raise within the bound,
    with nothing offloaded; then the default group works and, with the buffer removed, the next refit
    delivers the whole model bit-exact."""
    stage_index, model, pp_group = _groups(world_size, pg_timeout_s)
    first_layer = model.layers[str(0 if stage_index == 0 else LAYERS // 2)]
    if rank == failing_rank:
        first_layer.register_buffer("scale", torch.empty(DIM, device="meta"))
    adapter = FSDPAdapter(
        model, torch.optim.SGD(model.parameters(), lr=0.1), pp_group=pp_group, pp_timeout_s=pp_timeout_s
    )
    endpoint = f"ppfail-{uuid.uuid4().hex[:8]}"
    sender = BucketedWeightSender(endpoint, bucket_bytes=4096, transport="shm", timeout_s=30.0) if rank == 0 else None
    cycle = RefitCycle(adapter, sender, barrier_timeout_s=60.0)
    receiver = _Receiver(endpoint) if rank == 0 else None

    start = time.monotonic()
    try:
        cycle.refit(step=1)
        outcome: dict = {"error_type": None}
    except Exception as exc:
        outcome = {"error_type": type(exc).__name__, "error": str(exc), "failures": getattr(exc, "failures", None)}
    outcome["seconds"] = time.monotonic() - start
    outcome["on_device"] = adapter.state is DeviceState.ON_DEVICE
    if receiver is not None:
        receiver.join()
    outcome["all_reduce"] = _all_reduce(rank + 1.0)

    if rank == failing_rank:
        del first_layer.scale
    receiver = _Receiver(endpoint) if rank == 0 else None
    cycle.refit(step=2)
    outcome["offloaded"] = adapter.state is DeviceState.OFFLOADED
    cycle.resume(step=2)
    if receiver is not None:
        receiver.join()
        expected = full_model().state_dict()
        outcome["receiver_error"] = receiver.error
        outcome["received_names"] = sorted(receiver.received) == sorted(expected)
        outcome["received_equal"] = all(
            bits_equal(receiver.received[n], expected[n]) for n in expected if n in receiver.received
        )
        sender.close()
    cycle.close()
    return outcome


def stage_rank_stalls(rank: int, world_size: int, pp_timeout_s: float, stall_s: float) -> dict:
    """PP2: one full stream, then pipeline rank 1 stops after its first own weight for ``stall_s`` (longer than
    ``pp_timeout_s``) and closes its stream; rank 0 must give up within ``pp_timeout_s`` with a TransferTimeout
    naming the knob, keep a usable default group, and refuse the spent header group at once afterwards."""
    _, model, pp_group = _groups(world_size, pg_timeout_s=3 * stall_s)
    adapter = FSDPAdapter(model, pp_group=pp_group, pp_timeout_s=pp_timeout_s)
    first = sorted(name for name, _ in adapter.named_weights())
    outcome: dict = {"first_names": first}
    if rank == 1:
        stream = adapter.named_weights()
        stage_zero = sum(1 for name in first if not name.startswith(("layers.2.", "layers.3.", "head.")))
        for _ in range(stage_zero + 1):  # every stage-0 weight, then its own first
            next(stream)
        time.sleep(stall_s)
        stream.close()
    else:
        start = time.monotonic()
        try:
            list(adapter.named_weights())
        except Exception as exc:
            outcome.update(error_type=type(exc).__name__, error=str(exc))
        outcome["seconds"] = time.monotonic() - start
        try:
            list(adapter.named_weights())
        except Exception as exc:
            outcome["second_error"] = f"{type(exc).__name__}: {exc}"
    outcome["all_reduce"] = _all_reduce(rank + 1.0)
    return outcome


def long_names_cross(rank: int, world_size: int, pp_timeout_s: float) -> dict:
    """PP2 where stage 1 holds a weight whose header does not fit one header record (a 1500-character name),
    followed by an ordinary one: both arrive whole, under their names, bit-exact."""
    stage_index, model, pp_group = _groups(world_size, pg_timeout_s=60.0)
    long_name = "w" * 1500
    if stage_index == 1:
        model.layers[str(LAYERS - 1)].register_parameter(long_name, nn.Parameter(torch.arange(6.0).reshape(2, 3)))
    adapter = FSDPAdapter(model, pp_group=pp_group, pp_timeout_s=pp_timeout_s)
    streamed = {name: tensor.clone() for name, tensor in adapter.named_weights()}
    expected = full_model().state_dict()
    expected[f"layers.{LAYERS - 1}.{long_name}"] = torch.arange(6.0).reshape(2, 3)
    return {
        "names": sorted(streamed) == sorted(expected),
        "equal": all(bits_equal(streamed[name], expected[name]) for name in expected if name in streamed),
    }


def stage_fails_part_way_on_nccl(rank: int, world_size: int, pp_timeout_s: float) -> dict:
    """PP2 on two GPUs, the tensors over an NCCL pipeline group: stage 1 fails part-way. Both ranks must raise
    refitkit's errors at once (no NCCL op left waiting for the watchdog to end the process), the NCCL group
    must still work, and the next refit and stream must be bit-exact."""
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    pp_group = dist.new_group([0, 1], backend="nccl")
    model = stage(rank).to(device)
    first_layer = model.layers[str(0 if rank == 0 else LAYERS // 2)]
    if rank == 1:
        first_layer.register_buffer("scale", torch.empty(DIM, device="meta"))
    adapter = FSDPAdapter(
        model, torch.optim.SGD(model.parameters(), lr=0.1), pp_group=pp_group, pp_timeout_s=pp_timeout_s
    )
    cycle = RefitCycle(adapter, None, barrier_timeout_s=60.0)
    start = time.monotonic()
    try:
        cycle.refit(step=1)
        outcome: dict = {"error_type": None}
    except Exception as exc:
        outcome = {"error_type": type(exc).__name__, "error": str(exc)}
    outcome["seconds"] = time.monotonic() - start
    outcome["on_device"] = adapter.state is DeviceState.ON_DEVICE
    check = torch.tensor([rank + 1.0], device=device)
    dist.all_reduce(check, group=pp_group)
    outcome["nccl_all_reduce"] = float(check.item())
    if rank == 1:
        del first_layer.scale
    cycle.refit(step=2)
    outcome["offloaded"] = adapter.state is DeviceState.OFFLOADED
    cycle.resume(step=2)
    streamed = {name: tensor.clone() for name, tensor in adapter.named_weights()}
    expected = {name: tensor.to(device) for name, tensor in full_model().state_dict().items()}
    outcome["names"] = sorted(streamed) == sorted(expected)
    outcome["equal"] = all(bits_equal(streamed[n], expected[n]) for n in expected if n in streamed)
    cycle.close()
    return outcome


FORGED_HEADERS = [  # (what, header fields) in the wire format of PipelineStages.send_weight: name, shape, dtype, bytes
    ("a string shape", ["w", "abc", "float32", 12]),
    ("a negative dim", ["w", [-1, 3], "float32", 12]),
    ("a bool dim", ["w", [True, 3], "float32", 12]),
    ("a float dim", ["w", [2.0, 3], "float32", 24]),
    ("a name that is no string", [5, [2, 3], "float32", 24]),
    ("an unknown dtype", ["w", [2, 3], "Tensor", 24]),
    ("a dtype that is no string", ["w", [2, 3], 7, 24]),
    ("a huge shape announced small", ["w", [2**31, 2**31], "float32", 24]),
    ("a shape that disagrees with its bytes", ["w", [2, 3], "float32", 23]),
    ("too many dims", ["w", [1] * 65, "float32", 4]),
    ("a huge shape announced whole", ["w", [2**31, 2**30], "float32", 2**63]),  # no room: TransferError
]


def forged_headers(rank: int, world_size: int, pp_timeout_s: float) -> dict:
    """PP2 over gloo: pipeline rank 1 sends forged weight headers (and no tensors); pipeline rank 0 must raise
    ProtocolError naming rank 1 for each, before allocating or joining a tensor broadcast."""
    import msgpack
    import torch.distributed as dist

    from refitkit.engines.fsdp import _pipeline_stages as ps

    stages = ps.PipelineStages(dist.new_group([0, 1], backend="gloo"), timeout_s=pp_timeout_s)
    outcomes: dict = {}
    for what, fields in FORGED_HEADERS:
        if rank == 1:
            stages._broadcast(ps._WEIGHT, msgpack.packb(fields), stages.pipeline_rank)
            continue
        try:
            next(stages.receive_from(1, torch.device("cpu")))
            outcomes[what] = {"error_type": None}
        except Exception as exc:
            outcomes[what] = {"error_type": type(exc).__name__, "error": str(exc)}
    if rank == 1:  # the header group is still in step: a real weight and done go through
        stages.send_weight("w", torch.arange(6.0).reshape(2, 3), torch.device("cpu"))
        stages.send_done()
    else:
        outcomes["after"] = [(name, tensor.tolist()) for name, tensor in stages.receive_from(1, torch.device("cpu"))]
    stages.close()
    return outcomes
