"""Property: any stream of (name, tensor) with any bucket size round-trips bit-exactly."""

from __future__ import annotations

import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refitkit.transfer.protocol import SUPPORTED_DTYPES
from tests.transfer.harness import roundtrip
from tests.transfer.test_roundtrip import random_tensor

pytestmark = pytest.mark.timeout(180)

DTYPES = sorted(SUPPORTED_DTYPES.values(), key=str)

tensor_specs = st.lists(
    st.tuples(
        st.sampled_from(DTYPES),
        st.lists(st.integers(min_value=0, max_value=40), min_size=0, max_size=3),
        st.booleans(),  # transposed view (non-contiguous) when 2-D
    ),
    min_size=0,
    max_size=12,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    specs=tensor_specs, bucket_kib=st.sampled_from([1, 2, 4, 16]), seed=st.integers(0, 2**16), use_iter=st.booleans()
)
def test_any_stream_round_trips(receiver_server, specs, bucket_kib, seed, use_iter):
    weights = []
    for index, (dtype, shape, transpose) in enumerate(specs):
        tensor = random_tensor(tuple(shape), dtype, seed=seed + index)
        if transpose and tensor.dim() == 2:
            tensor = tensor.t()
        weights.append((f"p{index}.w", tensor))
    stats, result = roundtrip(
        receiver_server,
        f"h{uuid.uuid4().hex[:10]}",
        weights,
        bucket_bytes=bucket_kib << 10,
        mode="iter" if use_iter else "collect",
    )
    assert stats.bytes == sum(t.numel() * t.element_size() for _, t in weights)
