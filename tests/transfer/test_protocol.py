"""Wire format and endpoints: frames are plain msgpack data; anything else is a ProtocolError."""

from __future__ import annotations

import math
import os
import pickle
import socket
import stat

import msgpack
import pytest
import torch

from refitkit.errors import InvalidInput, ProtocolError, TransferError
from refitkit.transfer import BucketedWeightSender
from refitkit.transfer._ipc import shm
from refitkit.transfer._ipc.endpoint import socket_dir, socket_path
from refitkit.transfer.protocol import (
    SUPPORTED_DTYPES,
    WIRE_VERSION,
    Entry,
    contiguous_strides,
    decode,
    dtype_name,
    encode,
    entries_from_wire,
    entry_to_wire,
)

pytestmark = pytest.mark.timeout(30)


def test_frames_round_trip_as_plain_data():
    whole = entry_to_wire("layers.0.k_norm.weight", "float32", torch.Size([128]), 0)
    piece = entry_to_wire("layers.0.q_proj.weight", "bfloat16", (4096, 4096), 512, (2048, 1024))
    frame = decode(encode("bucket", session="ab", seq=3, half=1, wide=False, last=False, entries=[whole, piece]))
    assert frame["kind"] == "bucket" and frame["v"] == WIRE_VERSION
    assert entries_from_wire(frame["entries"], capacity=4096) == [
        Entry("layers.0.k_norm.weight", torch.float32, (128,), 0, 512, 0, 512),
        Entry("layers.0.q_proj.weight", torch.bfloat16, (4096, 4096), 512, 1024, 2048, 4096 * 4096 * 2),
    ]


@pytest.mark.parametrize(
    "raw, match",
    [
        (b"\xc1\xc1garbage", "undecodable"),
        (pickle.dumps({"v": 1, "kind": "hello"}), "undecodable|not a map"),
        (msgpack.packb([1, "hello"]), "not a map"),
        (msgpack.packb({"v": 99, "kind": "hello"}), "wire version 99"),
        (msgpack.packb({"v": WIRE_VERSION, "kind": "exec"}), "unknown frame kind 'exec'"),
        (msgpack.packb({1: 2}), "undecodable"),  # non-str keys are refused by the codec
    ],
)
def test_anything_else_is_a_protocol_error(raw, match):
    with pytest.raises(ProtocolError, match=match):
        decode(raw)


@pytest.mark.parametrize(
    "raw, match",
    [
        (["w", "float32", [2]], "malformed"),  # too few fields
        (["w", "object", [2], 0], "malformed"),  # not a dtype we ship
        (["w", "float32", "ab", 0], "malformed"),  # shape not a list of ints
        (["w", "float32", [2, True], 0], "bad name, shape"),  # bool is no dimension
        (["w", "float32", [-2, -3], 0], "bad name, shape"),  # negative dims with a positive product
        (["w", "float32", [2], 100], "bad name, shape"),  # offset off the alignment boundary
        (["w", "float32", [2000], 0], "bad name, shape"),  # 8000 bytes in a 4096-byte bucket
        (["w", "float32", [4], 0, 8, 12], "bad name, shape"),  # piece beyond the tensor's end
        (["", "float32", [2], 0], "bad name, shape"),
        ([7, "float32", [2], 0], "bad name, shape"),
    ],
)
def test_malformed_entries_are_protocol_errors(raw, match):
    with pytest.raises(ProtocolError, match=match):
        entries_from_wire([raw], capacity=4096)
    with pytest.raises(ProtocolError, match="not a list"):
        entries_from_wire({"w": 1}, capacity=4096)


def test_dtype_names_cover_every_supported_dtype():
    for name, dtype in SUPPORTED_DTYPES.items():
        assert dtype_name(dtype) == name
    assert dtype_name(torch.qint8) is None and dtype_name(torch.uint4) is None


def test_named_endpoint_lives_in_a_private_dir_and_socket_is_0600(endpoint):
    with BucketedWeightSender(endpoint, timeout_s=1) as sender:
        assert stat.S_IMODE(os.stat(socket_dir()).st_mode) == 0o700
        assert sender.path == os.path.join(socket_dir(), f"{endpoint}.sock")
        assert stat.S_IMODE(os.stat(sender.path).st_mode) == 0o600
    assert not os.path.exists(sender.path)  # close() removes the socket file


def test_explicit_ipc_path(tmp_path):
    path = tmp_path / "explicit.sock"
    with BucketedWeightSender(f"ipc://{path}", timeout_s=1):
        assert stat.S_ISSOCK(os.stat(path).st_mode)


@pytest.mark.parametrize("bad", ["", "../etc/passwd", "a b", "ipc://relative.sock", "x" * 65, 42])
def test_bad_endpoints_are_rejected(bad):
    with pytest.raises(InvalidInput, match="endpoint"):
        socket_path(bad)


def test_stale_socket_file_is_replaced(endpoint):
    path = socket_path(endpoint)
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(path)
    dead.close()  # the file stays, nobody accepts on it: a dead sender's leftover
    assert os.path.exists(path)
    with BucketedWeightSender(endpoint, timeout_s=1):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_live_endpoint_is_refused(endpoint):
    with BucketedWeightSender(endpoint, timeout_s=1):
        with pytest.raises(TransferError, match="in use by a live sender"):
            BucketedWeightSender(endpoint, timeout_s=1)


def test_non_socket_file_is_not_replaced(endpoint):
    path = socket_path(endpoint)
    with open(path, "w") as handle:
        handle.write("precious")
    with pytest.raises(TransferError, match="not a socket"):
        BucketedWeightSender(endpoint, timeout_s=1)
    os.unlink(path)


def test_stale_shm_segments_of_dead_senders_are_removed():
    dead_pid = 2**22 + 12345  # above the default pid_max: never a live process
    stale = f"{shm.SHM_DIR}/refitkit-{os.getuid()}-{dead_pid}-deadbeef"
    with open(stale, "wb") as handle:
        handle.write(b"\0" * 64)  # nobody holds its lock: its owner is gone
    mine = shm.Segment(64, name="cafe")  # a live sender's named segment (locked while named)
    try:
        assert shm.remove_stale_segments() >= 1
        assert not os.path.exists(stale) and os.path.exists(mine.path)
    finally:
        mine.unlink()
        mine.mapping.close()
        shm.unlink_quietly(stale)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"transport": "tcp"}, "transport"),
        ({"bucket_bytes": 100}, "bucket_bytes"),
        ({"bucket_bytes": 1.5e9}, "bucket_bytes"),
        ({"timeout_s": 0}, "timeout_s"),
    ],
)
def test_sender_knobs_are_checked(endpoint, kwargs, match):
    with pytest.raises(InvalidInput, match=match):
        BucketedWeightSender(endpoint, **kwargs)


# -- fuzzing the frame decoder (bounded: a few seconds on CI) ---------------------------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from refitkit.transfer.protocol import MAX_TENSOR_BYTES, bucket_fields, setup_fields  # noqa: E402

_FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
_atoms = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(),
    st.text(max_size=12),
    st.binary(max_size=12),
    st.sampled_from(sorted(SUPPORTED_DTYPES)),
)
_values = st.recursive(
    _atoms,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=30,
)
_dims = st.lists(st.integers(min_value=-4, max_value=2**40), max_size=5)
_entry = st.builds(
    lambda name, dtype, shape, offset, piece: [name, dtype, shape, offset, *piece],
    st.text(max_size=6),
    st.sampled_from(sorted(SUPPORTED_DTYPES)),
    _dims,
    st.integers(min_value=-512, max_value=1 << 16),
    st.one_of(st.just(()), st.tuples(st.integers(-8, 1 << 16), st.integers(-8, 1 << 16))),
)


@_FUZZ
@given(
    st.binary(max_size=256)
    | _values.map(lambda value: msgpack.packb(value, use_bin_type=True))
    | st.dictionaries(
        st.sampled_from(
            ["v", "kind", "session", "seq", "half", "wide", "last", "half_bytes", "handle", "transport", "entries"]
        ),
        _values,
        max_size=11,
    ).map(lambda fields: msgpack.packb({"v": WIRE_VERSION, "kind": "bucket", **fields}, use_bin_type=True))
)
def test_decode_returns_a_frame_or_raises_protocol_error(raw):
    try:
        frame = decode(raw)
    except ProtocolError:
        return
    assert frame["v"] == WIRE_VERSION and isinstance(frame["kind"], str)
    for check in (setup_fields, lambda f: bucket_fields(f, 0)):
        try:
            check(frame)
        except ProtocolError:
            pass


@_FUZZ
@given(st.lists(_entry | _values, max_size=6), st.integers(min_value=0, max_value=1 << 16))
def test_entries_from_wire_only_returns_ranges_inside_the_bucket_and_the_tensor(raw, capacity):
    try:
        entries = entries_from_wire(msgpack.unpackb(msgpack.packb(raw, use_bin_type=True)), capacity=capacity)
    except ProtocolError:
        return
    for entry in entries:
        assert entry.total == math.prod(entry.shape) * entry.dtype.itemsize <= MAX_TENSOR_BYTES
        assert 0 <= entry.offset and entry.offset % 256 == 0 and entry.offset + entry.nbytes <= capacity
        assert 0 <= entry.start and 0 <= entry.nbytes and entry.start + entry.nbytes <= entry.total
        assert all(type(size) is int and size >= 0 for size in entry.shape)


@pytest.mark.parametrize("shape", [(), (7,), (0,), (3, 5), (3, 0), (0, 5), (2, 3, 4), (2, 0, 4), (1, 1, 1, 9)])
def test_contiguous_strides_are_torchs_for_every_rank_and_empty_dims(shape):
    # torch's own row-major strides, for the short ways (one and two dims) and the general loop alike; an empty
    # dim counts as 1 in the dims before it, as torch.empty gives it
    assert contiguous_strides(shape) == torch.empty(shape).stride()
