"""A session's progress is one state on each side, changed only by ``to()``, which refuses impossible moves; each state
belongs to the protocol phase that messages name."""

from __future__ import annotations

import pytest

from refitkit.errors import TransferError
from refitkit.transfer._ipc.receiver import ReceiveState
from refitkit.transfer._ipc.sender import BucketState


def test_a_receiving_session_names_the_phase_the_sender_knows_it_in():
    phases = {state.name: state.phase.value for state in ReceiveState}
    assert phases == {
        "HANDSHAKE": "handshake",
        "STREAMING": "streaming",
        "DRAINING": "draining",
        "RELEASED": "draining",  # released, the sender not answered yet: for it the session still drains
        "ACKED": "released",
        "FAILED": "released",
        "ABORTED": "released",
    }
    assert [state.name for state in ReceiveState if state.released] == ["RELEASED", "ACKED", "FAILED", "ABORTED"]
    assert [state.name for state in ReceiveState if state.ended] == ["ACKED", "FAILED", "ABORTED"]


@pytest.mark.parametrize(
    "path",
    [
        ["HANDSHAKE", "STREAMING", "DRAINING", "RELEASED", "ACKED"],  # the final ACK after the release
        ["HANDSHAKE", "STREAMING", "RELEASED", "FAILED"],  # on_bucket raised
        ["HANDSHAKE", "STREAMING", "DRAINING", "RELEASED", "FAILED"],  # a view kept past the release
        ["HANDSHAKE", "STREAMING", "RELEASED", "ABORTED"],  # the sender aborted
        ["HANDSHAKE", "RELEASED", "FAILED"],  # the setup could not be mapped
        ["HANDSHAKE", "ABORTED"],  # the sender refused the session (nothing mapped)
    ],
)
def test_a_receiving_session_goes_one_way(path):
    state = ReceiveState[path[0]]
    for name in path[1:]:
        state = state.to(ReceiveState[name])
    assert state.name == path[-1] and state.ended


@pytest.mark.parametrize(
    "start, new",
    [("ACKED", "RELEASED"), ("RELEASED", "STREAMING"), ("DRAINING", "ACKED"), ("STREAMING", "ACKED")],
)
def test_a_receiving_session_refuses_an_impossible_move(start, new):
    with pytest.raises(TransferError, match=rf"receive session cannot go from '{start.lower()}' to '{new.lower()}'"):
        ReceiveState[start].to(ReceiveState[new])


def test_a_sending_sessions_bucket_comes_with_the_setup_or_once_a_tensor_needs_it():
    later = BucketState.LATER
    assert later.later and later.to(BucketState.LATE_PENDING).to(BucketState.ANNOUNCED) is BucketState.ANNOUNCED
    assert not BucketState.LATER.to(BucketState.WITH_SETUP).later  # the set-up chose shm: bucket with the setup
    for done in (BucketState.WITH_SETUP, BucketState.LATE_PENDING, BucketState.ANNOUNCED):
        assert not done.later


@pytest.mark.parametrize(
    "start, new",
    [
        ("WITH_SETUP", "LATE_PENDING"),  # a bucket allocated by the set-up is never allocated again
        ("ANNOUNCED", "LATE_PENDING"),
        ("LATE_PENDING", "LATER"),
        ("WITH_SETUP", "LATER"),
    ],
)
def test_a_sending_sessions_bucket_refuses_an_impossible_move(start, new):
    with pytest.raises(TransferError, match=rf"bucket cannot go from '{BucketState[start].value}'"):
        BucketState[start].to(BucketState[new])
