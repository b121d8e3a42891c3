"""A push of a transformers 5 Mixture-of-Experts model is checked against the checkpoint its ``save_pretrained()``
wrote, the way an engine rank checks it: every expert weight by name and shape; a push that misses one expert weight
lands incomplete and names it. Needs transformers (`make test-automodel` runs this file in the automodel venv)."""

from __future__ import annotations

import concurrent.futures
import os

import pytest
import torch
from torch import nn

pytest.importorskip("transformers", reason="needs transformers 5: make test-automodel runs this file")

from refitkit.engines.fsdp import FSDPAdapter  # noqa: E402
from refitkit.rollout._push import partial_push  # noqa: E402
from refitkit.rollout.checkpoint_names import checkpoint_weight_shapes  # noqa: E402
from refitkit.rollout.load_plan import DirectLoads  # noqa: E402
from refitkit.rollout.sessions import SyncProgress, WeightCheck, land_in_place, record_landing  # noqa: E402
from refitkit.rollout.versions import EngineWeights, SyncCoverage  # noqa: E402
from refitkit.transfer import BucketedWeightReceiver, BucketedWeightSender  # noqa: E402
from tests.engines.fsdp.transformers_ranks import saved_checkpoint, tiny_model  # noqa: E402
from tests.helpers.bits import bits_equal  # noqa: E402

pytestmark = pytest.mark.timeout(120)

LEFT_OUT = "model.layers.1.mlp.experts.5.up_proj.weight"


class CheckpointEngine(nn.Module):
    """An engine rank's weights as the checkpoint it loaded names them, with a loader that copies each by name."""

    def __init__(self, checkpoint: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.slots = {name: f"w{index}" for index, name in enumerate(checkpoint)}
        for name, tensor in checkpoint.items():
            self.register_parameter(self.slots[name], nn.Parameter(tensor.clone(), requires_grad=False))

    def weight(self, name: str) -> torch.Tensor:
        return getattr(self, self.slots[name])

    def load_weights(self, weights) -> None:
        for name, tensor in weights:
            self.weight(name).data.copy_(tensor)


def _push(weights, engine: CheckpointEngine, check: WeightCheck, state: EngineWeights, version: int) -> SyncCoverage:
    """One real session (shm) landed in ``engine`` through ``check``, then recorded as a landed sync of ``version``."""
    progress = SyncProgress()
    endpoint = f"moe-coverage-{os.getpid()}"
    with BucketedWeightSender(endpoint, bucket_bytes=1 << 18, transport="shm", timeout_s=10.0) as sender:
        receiver = BucketedWeightReceiver(endpoint, "cpu", timeout_s=10.0)
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            landing = pool.submit(
                land_in_place, receiver.receive, DirectLoads(engine, engine.load_weights), progress, check
            )
            sender.send(weights)
            landing.result(timeout=10.0)
    assert progress.refusal is None
    return record_landing(state, version, progress.names, frozenset(check.shapes))


def _step(model: nn.Module) -> None:
    """A stand-in for a training step: every weight changes."""
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.5)


def test_a_push_of_a_fused_moe_covers_the_checkpoint_and_one_missing_expert_is_named(tmp_path):
    model = tiny_model("qwen3_moe")
    checkpoint = saved_checkpoint(model, str(tmp_path))
    shapes = checkpoint_weight_shapes(str(tmp_path), revision=None, tied_embeddings=False)
    assert shapes is not None and LEFT_OUT in shapes and "model.layers.1.mlp.experts.gate_up_proj" not in shapes
    check, state, engine = WeightCheck(shapes, "engine rank 0"), EngineWeights(), CheckpointEngine(checkpoint)
    adapter = FSDPAdapter(model)

    _step(model)
    whole = _push(adapter.named_weights(), engine, check, state, version=1)
    assert whole.complete and (whole.received, whole.expected) == (len(shapes), len(shapes))
    assert state.version.version == 1 and state.version.clean
    streamed = {name: tensor.clone() for name, tensor in adapter.named_weights()}  # (views of the model's own)
    assert all(bits_equal(engine.weight(name), tensor) for name, tensor in streamed.items())

    _step(model)
    short = _push(((n, t) for n, t in adapter.named_weights() if n != LEFT_OUT), engine, check, state, version=2)
    assert not short.complete and short.missing == (LEFT_OUT,)
    assert short.describe() == f"{len(shapes) - 1} of the {len(shapes)} weights the engine loads (missing {LEFT_OUT!r})"
    assert (state.version.version, state.version.incomplete) == (1, 2)
    assert state.as_dict()["missing"] == [LEFT_OUT]
    refused = partial_push("engine rank 0", version=2, expected=short.expected, missing=short.missing)
    assert str(refused).startswith(
        f"the push of version 2 delivered {len(shapes) - 1} of the {len(shapes)} weights engine rank 0 loads; "
        f"missing [{LEFT_OUT!r}]"
    )
    # what landed is the new step's; the expert left out still holds the last push's weight
    assert bits_equal(engine.weight(LEFT_OUT), streamed[LEFT_OUT])
    fresh = dict(adapter.named_weights())
    assert all(bits_equal(engine.weight(name), fresh[name]) for name in fresh if name != LEFT_OUT)
