"""Property test: any mix of dtypes, shapes and views round-trips bit-exact through one arena."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from refitkit.offload import HostArena, offload_tensors, reload_tensors
from tests.offload.test_moves import ALL_DTYPES, random_tensor, storage_bytes

tensor_specs = st.lists(
    st.tuples(
        st.sampled_from(ALL_DTYPES),
        st.lists(st.integers(0, 7), min_size=0, max_size=3),
        st.booleans(),  # also offload a view of it
    ),
    min_size=1,
    max_size=8,
)


@settings(max_examples=60, deadline=None)
@given(tensor_specs, st.integers(1, 3))
def test_any_tensor_set_round_trips_bit_exact(specs, rounds):
    named = []
    for index, (dtype, shape, with_view) in enumerate(specs):
        t = random_tensor(tuple(shape), dtype, seed=index)
        named.append((f"t{index}", t))
        if with_view and t.dim() > 0 and t.shape[0] > 1:
            named.append((f"t{index}.view", t[1:]))
    before = {name: storage_bytes(t) for name, t in named}
    arena = HostArena()
    for _ in range(rounds):
        offload_tensors(named, arena)
        assert all(t.untyped_storage().nbytes() == 0 for _, t in named)
        reload_tensors(named, arena)
        assert {name: storage_bytes(t) for name, t in named} == before
    assert arena.chunks == 1 or all(t.numel() == 0 for _, t in named)
