"""The trainer-side helpers of refitkit.rollout.vllm that need no engine."""

from __future__ import annotations

import hashlib

import pytest
import torch

from refitkit.engines.fsdp import FSDPAdapter
from refitkit.rollout.vllm import tensor_sha256

pytestmark = pytest.mark.timeout(60)


def test_tensor_sha256_hashes_the_raw_bytes_and_leaves_the_tensor_offloadable():
    model = torch.nn.Linear(8, 4)
    expected = hashlib.sha256(bytes(model.weight.detach().clone().reshape(-1).view(torch.uint8).tolist())).hexdigest()

    assert tensor_sha256(model.weight) == expected
    assert model.weight.untyped_storage().resizable()  # numpy() on the storage itself would have pinned it
    FSDPAdapter(model).offload()  # a trainer may checksum its weights, then offload them
    assert model.weight.untyped_storage().nbytes() == 0
