"""Endpoint socket files: born private, never another user's replaced, never a successor's removed."""

from __future__ import annotations

import os
import re
import socket
import stat
import subprocess
import sys
import tempfile

import pytest

from refitkit.errors import InvalidInput, TransferError
from refitkit.transfer import BucketedWeightReceiver, BucketedWeightSender
from refitkit.transfer._ipc.endpoint import socket_path
from tests.helpers.world import child_env
from tests.transfer.harness import roundtrip

pytestmark = pytest.mark.timeout(120)

NOBODY = 65534
needs_root = pytest.mark.skipif(os.getuid() != 0, reason="needs root to chown files to / act as another uid")


def stale_socket(path: str) -> None:
    """A socket file nobody accepts on: a dead sender's leftover."""
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(path)
    dead.close()


def test_socket_file_is_never_more_open_than_0600(endpoint, monkeypatch):
    # What another user could connect through is the file between bind and its chmod: observed at the
    # chmod, under a permissive umask (the common 022), the file must already be 0600 or sit in a
    # directory nobody else may enter (and not yet under the endpoint's name).
    seen: list[tuple[int, int, str]] = []
    chmod = os.chmod

    def observing_chmod(path, mode, *args, **kwargs):
        parent = os.path.dirname(os.path.abspath(path))
        seen.append((stat.S_IMODE(os.lstat(path).st_mode), stat.S_IMODE(os.stat(parent).st_mode), path))
        return chmod(path, mode, *args, **kwargs)

    monkeypatch.setattr(os, "chmod", observing_chmod)
    previous = os.umask(0o022)
    try:
        with BucketedWeightSender(endpoint, timeout_s=1) as sender:
            final = sender.path
            assert stat.S_IMODE(os.lstat(final).st_mode) == 0o600
    finally:
        os.umask(previous)
    assert seen, "the socket file was never made 0600 explicitly"
    for mode, parent_mode, path in seen:
        assert mode == 0o600 or (parent_mode & 0o077 == 0 and path != final), (oct(mode), oct(parent_mode), path)


def test_binding_never_changes_the_process_umask(endpoint, monkeypatch):
    # A umask set around bind() is process-wide: another thread's files made meanwhile came out 0600
    # (directories without x), so binding must not touch it.
    calls: list[int] = []
    umask = os.umask

    def recording_umask(mask):
        calls.append(mask)
        return umask(mask)

    monkeypatch.setattr(os, "umask", recording_umask)
    with BucketedWeightSender(endpoint, timeout_s=1):
        pass
    assert calls == []


def test_close_leaves_a_successors_socket_file(receiver_server, endpoint):
    first = BucketedWeightSender(endpoint, timeout_s=5)
    os.unlink(first.path)  # its file is gone (removed as stale by someone): a successor binds the same name
    with BucketedWeightSender(endpoint, timeout_s=5) as successor:
        first.close()
        assert stat.S_ISSOCK(os.lstat(successor.path).st_mode)  # still there, still the successor's
    # ...and a receiver can still reach a sender on that endpoint
    roundtrip(receiver_server, endpoint, [("w", __import__("torch").arange(10.0))])


@needs_root
def test_another_uids_stale_socket_file_is_refused_and_kept(endpoint):
    path = socket_path(endpoint)
    stale_socket(path)
    os.chown(path, 12345, 12345)
    try:
        with pytest.raises(
            TransferError, match=rf"endpoint file {path} belongs to uid 12345, not to this uid 0; .*another endpoint"
        ):
            BucketedWeightSender(endpoint, timeout_s=1)
        assert os.lstat(path).st_uid == 12345  # not replaced
    finally:
        os.unlink(path)


_AS_NOBODY = """
import os, sys
from refitkit.errors import TransferError
from refitkit.transfer import BucketedWeightSender  # imported as root: the interpreter's files may be root's only
os.setgid({uid}); os.setuid({uid})
try:
    BucketedWeightSender("ipc://" + sys.argv[1], timeout_s=1).close()
except TransferError as exc:
    print("TransferError:", exc)
"""


@needs_root
def test_a_users_sender_meets_another_users_stale_socket_in_a_shared_dir():
    # A shared sticky directory (like /tmp) holds root's stale socket; a sender of another user
    # used to die in the liveness probe with a bare PermissionError.
    shared = tempfile.mkdtemp(prefix="rk-shared-")
    os.chmod(shared, 0o1777)
    path = os.path.join(shared, "ep.sock")
    stale_socket(path)
    os.chmod(path, 0o600)
    try:
        run = subprocess.run(
            [sys.executable, "-c", _AS_NOBODY.format(uid=NOBODY), path],
            capture_output=True,
            text=True,
            timeout=60,
            env=child_env(REFITKIT_SOCKET_DIR=shared),
        )
        assert run.returncode == 0, run.stderr
        assert f"TransferError: endpoint file {path} belongs to uid 0, not to this uid {NOBODY}" in run.stdout
        assert stat.S_ISSOCK(os.lstat(path).st_mode)
    finally:
        os.unlink(path)
        os.rmdir(shared)


def test_a_socket_dir_that_cannot_be_made_is_a_transfer_error_naming_the_knob(monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("REFITKIT_SOCKET_DIR", str(blocker / "sockets"))
    with pytest.raises(
        TransferError, match=r"socket dir .*a-file/sockets cannot be made or read .*REFITKIT_SOCKET_DIR"
    ):
        socket_path("anything")


@pytest.mark.parametrize("side", ["sender", "receiver"])
def test_a_relative_socket_dir_is_refused_naming_the_variable(side, monkeypatch, tmp_path):
    # it used to be made in each process's own working directory: a sender and a receiver started in different
    # folders waited on two different sockets until their timeouts
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("REFITKIT_SOCKET_DIR", "sockets")
    message = re.escape(
        "REFITKIT_SOCKET_DIR='sockets' is a relative path, which every process (sender, receivers) resolves"
    )
    with pytest.raises(InvalidInput, match=message + r".*set it to an absolute path"):
        if side == "sender":
            BucketedWeightSender("relative-dir", timeout_s=1)
        else:
            BucketedWeightReceiver("relative-dir", "cpu", timeout_s=1)
    assert list(tmp_path.iterdir()) == []  # nothing made in the working directory


def test_a_relative_xdg_runtime_dir_is_ignored_as_the_xdg_spec_says(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("REFITKIT_SOCKET_DIR", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", "run")
    assert socket_path("anything") == os.path.join(tempfile.gettempdir(), f"refitkit-{os.getuid()}", "anything.sock")
    assert list(tmp_path.iterdir()) == []


def test_a_directory_that_takes_no_socket_is_a_transfer_error_naming_the_path_and_the_knob():
    """/proc exists but takes no new file (as a read-only mount would not): the bind's OSError is chained under a
    TransferError naming the path and what to change, not raised raw."""
    with pytest.raises(TransferError) as raised:
        BucketedWeightSender("ipc:///proc/refitkit-test-socket")
    message, cause = str(raised.value), raised.value.__cause__
    assert isinstance(cause, OSError)  # ENOENT as root, EACCES otherwise
    assert message.startswith(
        f"cannot bind the sender's socket at /proc/refitkit-test-socket ({type(cause).__name__}: "
    )
    assert message.endswith("(a name under REFITKIT_SOCKET_DIR, or ipc:///path)")


def test_a_receiver_channel_keeps_one_connection_across_syncs_failed_ones_included_and_close_lets_it_go(endpoint):
    import threading

    import torch

    from refitkit.errors import ChannelClosed
    from refitkit.transfer import ChannelState, ReceiverChannel
    from tests.transfer.peers import digest

    weights = [(f"w{i}", torch.randn(64 + i)) for i in range(5)]
    expected = {name: digest(tensor) for name, tensor in weights}

    def sync(sender: BucketedWeightSender, channel: ReceiverChannel, on_bucket=None) -> dict:
        """One sync as an engine's worker makes it: its kept channel, in this thread; the sender in another."""
        sent: list[BaseException] = []
        thread = threading.Thread(target=lambda: _send_catching(sender, weights, sent))
        thread.start()
        got: dict = {}
        try:
            channel.receive(
                on_bucket or (lambda batch, last: got.update((name, digest(tensor)) for name, tensor in batch))
            )
        finally:
            thread.join(15)
        return got

    with BucketedWeightSender(endpoint, transport="shm", timeout_s=10.0) as sender:
        with ReceiverChannel(endpoint, "cpu", timeout_s=10.0) as channel:
            sock = channel._sock
            assert sync(sender, channel) == expected
            assert channel.state is ChannelState.OPEN
            with pytest.raises(TransferError, match="on_bucket raised"):
                sync(sender, channel, on_bucket=lambda batch, last: 1 / 0)
            assert channel.state is ChannelState.OPEN  # a failed sync ends that sync only
            assert sync(sender, channel) == expected
            assert sync(sender, channel) == expected
            assert channel._sock is sock and not sock.closed  # every sync on the one connection
            assert sender._watch._serial == 1  # the sender accepted one connection in all
        assert channel.state is ChannelState.CLOSED and sock.closed and channel._context.closed
        with pytest.raises(ChannelClosed, match="is closed; open a new one"):
            channel.receive(lambda batch, last: None)
        with ReceiverChannel(endpoint, "cpu", timeout_s=10.0) as fresh:  # a new channel: a new connection
            assert sync(sender, fresh) == expected
            assert sender._watch._serial == 2


def test_a_receiver_channel_dropped_without_close_lets_its_socket_and_context_go(endpoint):
    from refitkit.transfer import ReceiverChannel

    channel = ReceiverChannel(endpoint, "cpu", timeout_s=10.0)
    sock, context = channel._sock, channel._context
    del channel  # (reference counting: the finalizer runs now, no collection needed)
    assert sock.closed and context.closed


def _send_catching(sender: BucketedWeightSender, weights: list, failures: list) -> None:
    try:
        sender.send(weights)
    except BaseException as exc:  # the sender's side of a failing session: the test looks at the receiver's
        failures.append(exc)
