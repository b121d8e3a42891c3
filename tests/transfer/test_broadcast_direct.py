"""Landing streamed weights straight in an engine's parameters (one copy), from a load plan of its own loader.

The plan is recorded on a toy engine (fused q/k/v and gate/up rows, a transposed weight) and checked
entry by entry; then a real broadcast over gloo (this process sends, two spawned receivers) lands the
same stream in one receiver through the plan and in the other through the bucket path: the engines'
parameters must be bit-exact alike and equal to the loader's own result, the bytes split as planned,
and a weight whose dtype does not match its plan falls back to the bucket path with a note.
"""

from __future__ import annotations

import pytest
import torch

from refitkit.errors import InvalidInput
from refitkit.rollout.load_plan import Destination, record_load_plan
from refitkit.transfer._broadcast.sender import BroadcastWeightSender
from tests.helpers.ports import free_port
from tests.transfer.direct_peers import (
    FFN,
    HEADS_KV,
    HEADS_Q,
    HIDDEN,
    SHAPES,
    DirectReceiverProcess,
    ToyEngine,
    engine_digests,
    toy_load_weights,
    toy_weights,
)

pytestmark = pytest.mark.timeout(240)

SECRET = "job-secret-0123456789abcdef"
TIMEOUT_S = 5.0
BUCKET = 1 << 13  # halves of 4 KiB: gate, up and w (8 KiB each) are split across buckets


def toy_plan(engine: ToyEngine):
    return record_load_plan(engine, lambda weights: toy_load_weights(engine, weights), list(SHAPES.items()))


def expected_digests(weights) -> dict:
    engine = ToyEngine()
    toy_load_weights(engine, weights)
    return engine_digests(engine)


# -- the plan ----------------------------------------------------------------------------------------


def test_plan_maps_fused_rows_and_skips_the_transposed_weight():
    engine = ToyEngine()
    with torch.no_grad():
        engine.norm.fill_(3.0)
    before = {name: (param, param.data_ptr()) for name, param in engine.named_parameters()}
    plan = toy_plan(engine)
    f32 = torch.float32
    assert dict(plan.destinations) == {
        "q": Destination("qkv", 0, HEADS_Q * HIDDEN, (HEADS_Q, HIDDEN), f32),
        "k": Destination("qkv", HEADS_Q * HIDDEN, HEADS_KV * HIDDEN, (HEADS_KV, HIDDEN), f32),
        "v": Destination("qkv", (HEADS_Q + HEADS_KV) * HIDDEN, HEADS_KV * HIDDEN, (HEADS_KV, HIDDEN), f32),
        "gate": Destination("gate_up", 0, FFN * HIDDEN, (FFN, HIDDEN), f32),
        "up": Destination("gate_up", FFN * HIDDEN, FFN * HIDDEN, (FFN, HIDDEN), f32),
        "out": Destination("out", 0, HIDDEN * HEADS_Q, (HIDDEN, HEADS_Q), f32),
        "norm": Destination("norm", 0, HIDDEN, (HIDDEN,), f32),
    }
    assert plan.skipped == {"w": "its elements landed in 'w_t' out of order (transposed or repacked)"}
    for name, param in engine.named_parameters():  # the engine is given back as it was: same objects, values, grads
        assert param is before[name][0] and param.data_ptr() == before[name][1] and param.requires_grad
    assert torch.equal(engine.norm, torch.full((HIDDEN,), 3.0))
    bound = plan.bind(engine)
    assert bound("k", f32, (HEADS_KV, HIDDEN)).data_ptr() == engine.qkv.data[HEADS_Q].data_ptr()
    assert bound("w", f32, (FFN, HIDDEN)) is None


def test_plan_skips_sharded_spread_and_dropped_weights_and_restores_on_failure():
    engine = ToyEngine()

    def loader(weights):
        with torch.no_grad():
            for name, tensor in weights:
                if name == "half":  # a tensor-parallel shard: only its first half of rows is kept
                    engine.gate_up.data[: FFN // 2].copy_(tensor[: FFN // 2])
                elif name == "both":  # written to two parameters
                    engine.out.data.copy_(tensor)
                    engine.w_t.data[:, :HEADS_Q].copy_(tensor)

    plan = record_load_plan(engine, loader, [("half", (FFN, HIDDEN)), ("both", (HIDDEN, HEADS_Q)), ("gone", (4,))])
    assert plan.destinations == {}
    assert plan.skipped == {
        "half": f"{FFN // 2 * HIDDEN} of its {FFN * HIDDEN} elements landed in 'gate_up' (sharded or padded)",
        "both": "its elements went to several parameters (out, w_t)",
        "gone": "the loader put none of its elements in a parameter (dropped, or held outside parameters)",
    }

    def failing(weights):
        next(iter(weights))
        raise RuntimeError("loader broke (test)")

    originals = {name: param.data_ptr() for name, param in engine.named_parameters()}
    with pytest.raises(RuntimeError, match="loader broke"):
        record_load_plan(engine, failing, [("q", (HEADS_Q, HIDDEN))])
    assert all(
        param.data_ptr() == originals[name] and param.dtype == torch.float32
        for name, param in engine.named_parameters()
    )


def test_bind_refuses_a_model_that_changed_since_the_plan():
    engine = ToyEngine()
    plan = toy_plan(engine)
    engine.qkv.data = engine.qkv.data.to(torch.bfloat16)
    with pytest.raises(InvalidInput, match=r"'q' lands in 'qkv' .* now torch.bfloat16 \(64, 32\).*take the plan again"):
        plan.bind(engine)
    with pytest.raises(InvalidInput, match=r"streamed item 0 is 'q'; expected \(name, shape\)"):
        record_load_plan(engine, lambda weights: None, ["q"])


# -- over the broadcast ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def receivers():
    made = {1: DirectReceiverProcess(), 2: DirectReceiverProcess()}
    yield made
    codes = [process.close() for process in made.values()]
    assert codes == [0, 0], f"receiver processes did not exit cleanly: {codes}"


def sync(receivers, weights, *, per_tensor: bool, version: int) -> dict[int, tuple]:
    """One session: rank 1 receives with its plan, rank 2 through the bucket path; their answers by rank."""
    url = f"tcp://127.0.0.1:{free_port()}"
    sender = BroadcastWeightSender(
        url, secret=SECRET, receivers=2, bucket_bytes=BUCKET, timeout_s=TIMEOUT_S, per_tensor=per_tensor
    )
    try:
        for rank, process in receivers.items():
            process.start(url, SECRET, rank, use_plan=rank == 1, timeout_s=TIMEOUT_S)
        sender.send(weights, version=version)
    finally:
        sender.close()
    return {rank: process.result() for rank, process in receivers.items()}


def test_direct_receive_is_bit_exact_with_the_bucket_path(receivers):
    weights = toy_weights(seed=1)
    want = expected_digests(weights)
    for as_given in (weights, iter(weights)):  # batched list, and a generator item by item
        answers = sync(receivers, as_given, per_tensor=True, version=7)
        for rank, (error, message, _, got, version, _direct) in answers.items():
            assert error is None, message
            assert got == want, f"rank {rank}"
            assert version == (7, None)
        w_bytes = FFN * HIDDEN * 4
        total = sum(tensor.nbytes for _, tensor in weights)
        assert answers[1][5] == (total - w_bytes, 7, w_bytes, {})  # all but the transposed weight landed in place
        assert answers[2][5] == (0, 0, total, {})


def test_mismatched_dtype_falls_back_to_the_bucket_path_with_a_note(receivers):
    weights = toy_weights(seed=2, dtypes={"k": torch.bfloat16, "gate": torch.float16})
    want = expected_digests(weights)
    answers = sync(receivers, weights, per_tensor=True, version=8)
    for rank, (error, message, _, got, _version, _) in answers.items():
        assert error is None, message
        assert got == want, f"rank {rank}"
    direct_bytes, direct_tensors, bucket_bytes, fallbacks = answers[1][5]
    assert fallbacks == {
        "k": f"the plan says torch.float32 ({HEADS_KV}, {HIDDEN}), the sender sent torch.bfloat16 ({HEADS_KV}, {HIDDEN})",
        "gate": f"the plan says torch.float32 ({FFN}, {HIDDEN}), the sender sent torch.float16 ({FFN}, {HIDDEN})",
    }
    assert direct_tensors == 5
    assert bucket_bytes == sum(tensor.nbytes for name, tensor in weights if name in ("k", "gate", "w"))


def test_a_sender_of_whole_buckets_means_the_bucket_path(receivers):
    weights = toy_weights(seed=3)
    answers = sync(receivers, weights, per_tensor=False, version=9)
    for rank, (error, message, _, got, _version, direct) in answers.items():
        assert error is None, message
        assert got == expected_digests(weights), f"rank {rank}"
        assert direct[:2] == (0, 0) and direct[2] == sum(tensor.nbytes for _, tensor in weights)


def test_a_stream_that_breaks_after_direct_landings_leaves_the_weights_incomplete(receivers):
    """Weights landed in place count as touched: the receiver's version says incomplete, and the next sync heals it."""
    weights = toy_weights(seed=5)

    def breaking():
        yield from weights[:4]  # q, k, v (in place on rank 1) and gate, split across buckets
        raise RuntimeError("trainer lost a rank (test)")

    url = f"tcp://127.0.0.1:{free_port()}"
    with BroadcastWeightSender(
        url, secret=SECRET, receivers=2, bucket_bytes=BUCKET, timeout_s=TIMEOUT_S, per_tensor=True
    ) as sender:
        for rank, process in receivers.items():
            process.start(url, SECRET, rank, use_plan=rank == 1, timeout_s=TIMEOUT_S)
        with pytest.raises(RuntimeError, match="trainer lost a rank"):
            sender.send(breaking(), version=10)
    for rank, process in receivers.items():
        error, message, seconds, _, version, direct = process.result()
        assert error == "TransferError" and "trainer lost a rank (test)" in message, (rank, message)
        assert seconds < TIMEOUT_S + 2.0
        assert version[1] == 10  # incomplete: version 10 was partly applied
        assert (direct[0] >= HEADS_Q * HIDDEN * 4) if rank == 1 else direct[0] == 0  # q at least landed in place
    answers = sync(receivers, weights, per_tensor=True, version=11)
    for _rank, (error, message, _, got, version, _) in answers.items():
        assert error is None, message
        assert got == expected_digests(weights) and version == (11, None)


def test_per_tensor_is_a_bool():
    with pytest.raises(InvalidInput, match="per_tensor=1; need a bool"):
        BroadcastWeightSender(f"tcp://127.0.0.1:{free_port()}", secret=SECRET, receivers=1, per_tensor=1)  # type: ignore[arg-type]


@pytest.mark.cuda
def test_direct_receive_into_cuda_parameters_over_gloo():
    """One GPU: the plan recorded on a CUDA engine, the gloo path with CUDA tensors on both sides, landing in place."""
    url = f"tcp://127.0.0.1:{free_port()}"
    process = DirectReceiverProcess(device="cuda")
    try:
        weights = [(name, tensor.cuda()) for name, tensor in toy_weights(seed=4)]
        want = expected_digests(weights)
        with BroadcastWeightSender(
            url, secret=SECRET, receivers=1, bucket_bytes=BUCKET, device="cuda", per_tensor=True, timeout_s=30.0
        ) as sender:
            process.start(url, SECRET, 1, use_plan=True, timeout_s=30.0)
            sender.send(weights, version=1)
        error, message, _, got, version, direct = process.result()
        assert error is None, message
        assert got == want and version == (1, None)
        w_bytes = FFN * HIDDEN * 4
        assert direct == (sum(t.nbytes for _, t in weights) - w_bytes, 7, w_bytes, {})
    finally:
        assert process.close() == 0
