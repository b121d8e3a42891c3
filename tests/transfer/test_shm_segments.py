"""Shared-memory segments: reserved up front, swept only when their owner is gone, safe from truncation."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

import pytest

from refitkit.errors import ProtocolError
from refitkit.transfer._ipc import shm
from tests.helpers.world import child_env

pytestmark = pytest.mark.timeout(180)

NOBODY = 65534
DEAD_PID = 2**22 + 4242  # above any pid_max of the host: never a live process here
needs_root = pytest.mark.skipif(os.getuid() != 0, reason="needs root (namespaces, chown, another uid)")


def run_script(
    script: str, *args: str, prefix: tuple[str, ...] = (), env: dict[str, str] | None = None, timeout_s: float = 120
) -> subprocess.CompletedProcess:
    """Run ``script`` in a fresh interpreter (behind ``prefix``, e.g. ``unshare``) from the worktree root."""
    return subprocess.run(
        [*prefix, sys.executable, "-c", textwrap.dedent(script), *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=child_env(**(env or {})),
    )


def own_names() -> list[str]:
    return sorted(name for name in os.listdir(shm.SHM_DIR) if name.startswith(shm.segment_prefix()))


# -- item 6: a small /dev/shm ---------------------------------------------------------------------

_SEND_IN_A_SMALL_DEV_SHM = """
    import json, multiprocessing as mp, os, subprocess, torch
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", "/dev/shm"], check=True)
    from refitkit.transfer import BucketedWeightSender
    from tests.transfer.peers import one_shot_receiver_main
    if __name__ == "__main__":
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        receiver = ctx.Process(target=one_shot_receiver_main, args=("small", "cpu", 20, "collect", None, child))
        receiver.start()
        weights = [(f"w{i}", torch.full((1 << 16,), float(i))) for i in range(6)]  # 6 x 256 KiB, 2 MiB buffer
        outcome = {}
        with BucketedWeightSender("small", bucket_bytes=2 << 20, transport="shm", timeout_s=20) as sender:
            try:
                outcome["tensors"] = sender.send(item for item in weights).tensors
            except Exception as exc:
                outcome["error"] = [type(exc).__name__, str(exc)]
            outcome["left"] = sorted(os.listdir("/dev/shm"))
        receiver.join(30)
        if parent.poll(1):
            parent.recv()  # "starting"
        outcome["received"] = parent.recv() if parent.poll(1) else None
        print(json.dumps(outcome, default=str))
"""


@needs_root
@pytest.mark.parametrize("segments", ["named", "memfd"])
def test_a_2_mib_bucket_in_a_1_mib_dev_shm(segments, tmp_path):
    # Docker's 64 MiB /dev/shm against a 2 GiB bucket, scaled down: a private mount namespace with a
    # 1 MiB tmpfs on /dev/shm. Named segments must fail before the first byte with the knobs; a sealed
    # memfd does not live in /dev/shm at all and must deliver.
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) to mount a private /dev/shm")
    env = {"REFITKIT_SOCKET_DIR": str(tmp_path), "REFITKIT_NAMED_SEGMENTS": "1" if segments == "named" else ""}
    run = run_script(_SEND_IN_A_SMALL_DEV_SHM, prefix=("unshare", "-m"), env=env)
    if run.returncode != 0 and "mount" in run.stderr and "permission denied" in run.stderr.lower():
        pytest.skip(f"cannot mount a private /dev/shm here: {run.stderr.strip()[-200:]}")
    assert run.returncode == 0, f"the sender died (rc {run.returncode}, -7 is SIGBUS): {run.stderr[-2000:]}"
    outcome = json.loads(run.stdout.strip().splitlines()[-1])
    assert outcome["left"] == []  # nothing left in /dev/shm either way
    if segments == "memfd":
        assert outcome["tensors"] == 6 and len(outcome["received"]["digests"]) == 6
        return
    kind, message = outcome["error"]
    assert kind == "TransferError"
    assert "shared-memory bucket of 2097152 bytes (2.0 MiB) does not fit /dev/shm (free: " in message
    for knob in ("bucket_bytes", "docker --shm-size", "transport='cuda_ipc'"):
        assert knob in message


_SEND_WITH_LITTLE_ADDRESS_SPACE = """
    import json, multiprocessing as mp, os, resource, torch
    from refitkit.transfer import BucketedWeightSender
    from tests.transfer.peers import one_shot_receiver_main
    if __name__ == "__main__":
        torch.set_num_threads(1)
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        receiver = ctx.Process(target=one_shot_receiver_main, args=("narrow", "cpu", 20, "collect", None, child))
        receiver.start()  # (before the limit: its interpreter is not ours)
        with BucketedWeightSender("narrow", bucket_bytes=64 << 30, transport="shm", timeout_s=20, direct=False) as sender:
            with open("/proc/self/status") as status:
                mapped = next(int(line.split()[1]) << 10 for line in status if line.startswith("VmSize:"))
            # 1 GiB of address space left: a 64 GiB bucket can be sized (a memfd) or reserved, but never mapped
            resource.setrlimit(resource.RLIMIT_AS, (mapped + (1 << 30), resource.RLIM_INFINITY))
            outcome = {}
            try:
                outcome["tensors"] = sender.send(item for item in [("w", torch.ones(10))]).tensors
            except Exception as exc:
                chain, cause = [], exc.__cause__
                while cause is not None:
                    chain.append([type(cause).__name__, getattr(cause, "errno", None)])
                    cause = cause.__cause__
                outcome["error"] = [type(exc).__name__, str(exc), chain]
            resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        receiver.join(30)
        if parent.poll(1):
            parent.recv()  # "starting"
        outcome["received"] = parent.recv() if parent.poll(1) else None
        print(json.dumps(outcome, default=str))
"""


def test_a_bucket_larger_than_the_address_space_is_a_transfer_error_naming_size_and_knob(tmp_path):
    """A bucket the process cannot map (here: RLIMIT_AS leaves 1 GiB; a sealed memfd is sized, never reserved, so
    only the mapping fails) ends the session in a TransferError naming the bucket's size and bucket_bytes, with the
    OSError chained, not in a raw OSError."""
    if shm.pid_namespace() is None:
        pytest.skip("needs memfd segments (a named one would reserve the 64 GiB in /dev/shm)")
    run = run_script(_SEND_WITH_LITTLE_ADDRESS_SPACE, env={"REFITKIT_SOCKET_DIR": str(tmp_path)})
    assert run.returncode == 0, f"the sender died (rc {run.returncode}): {run.stderr[-2000:]}"
    outcome = json.loads(run.stdout.strip().splitlines()[-1])
    kind, message, chain = outcome["error"]
    assert kind == "TransferError", message
    assert message.startswith("handshake: cannot allocate the session's bucket of 68719476736 bytes (shared memory")
    assert "cannot map a shared-memory segment of 68719476736 bytes ([Errno 12]" in message
    assert "bucket_bytes" in message
    assert chain == [["TransferError", None], ["OSError", 12]]  # shm's own error, then the mmap's ENOMEM


# -- item 8: liveness across PID namespaces -------------------------------------------------------

_HOLD_A_SEGMENT = """
    import sys
    from refitkit.transfer._ipc import shm
    segment = shm.Segment(4096, name="cafe")
    print(segment.path, flush=True)
    sys.stdin.readline()  # alive (and holding the segment) until the test closes our stdin
"""


@needs_root
def test_sweep_keeps_a_live_segment_of_another_pid_namespace():
    # Its owner runs in a PID namespace whose pid numbers mean nothing here (3000001 is no process
    # of ours): a pid check would call it dead and unlink it under the living owner.
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) for a PID namespace")
    script = textwrap.dedent(_HOLD_A_SEGMENT)
    owner = subprocess.Popen(
        [
            "unshare",
            "--pid",
            "--fork",
            "--mount-proc",
            "sh",
            "-c",
            'echo 3000000 > /proc/sys/kernel/ns_last_pid && "$0" -c "$1"; true',
            sys.executable,
            script,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    try:
        path = owner.stdout.readline().strip()
        if not path:
            pytest.skip("could not start a process in a new PID namespace here")
        assert f"-{3000001}-cafe" in path
        with pytest.raises(ProcessLookupError):
            os.kill(3000001, 0)  # to this process, its pid is dead
        shm.remove_stale_segments()
        assert os.path.exists(path)  # its owner holds the lock: alive
    finally:
        owner.stdin.close()
        owner.wait(30)
    shm.remove_stale_segments()
    assert not os.path.exists(path)  # the owner is gone: its lock too, and the sweep removes the name


def test_named_segment_is_never_visible_half_made(monkeypatch):
    # A reservation that fails leaves no file behind (made unnamed, linked only once complete).
    before = own_names()
    with pytest.raises(Exception, match="does not fit /dev/shm"):
        shm.Segment(1 << 50, name="0123abcd")  # a petabyte: no /dev/shm has it
    assert own_names() == before


def test_receiver_opens_named_segments_without_following_links(tmp_path):
    target = tmp_path / "target"
    target.write_bytes(b"\0" * 4096)
    link = os.path.join(shm.SHM_DIR, f"{shm.segment_prefix()}{DEAD_PID}-{os.urandom(4).hex()}")
    os.symlink(target, link)
    try:
        with pytest.raises(Exception, match="cannot open the shm bucket .*Too many levels of symbolic links"):
            shm.open_segment({"path": link, "nbytes": 4096}, what="shm bucket")
    finally:
        os.unlink(link)
    other_uid = f"{shm.SHM_DIR}/refitkit-{os.getuid() + 1}-{DEAD_PID}-abcd"
    with pytest.raises(ProtocolError, match=f"not a refitkit segment of uid {os.getuid()}"):
        shm.open_segment({"path": other_uid, "nbytes": 4096}, what="shm bucket")


# -- item 12: another uid's files -----------------------------------------------------------------


@needs_root
def test_sweep_skips_and_logs_a_file_of_another_uid(caplog):
    path = f"{shm.SHM_DIR}/{shm.segment_prefix()}{DEAD_PID}-0dd"
    with open(path, "wb") as handle:
        handle.write(b"\0" * 64)
    os.chown(path, 12345, 12345)
    try:
        with caplog.at_level("WARNING", logger="refitkit.transfer._ipc.shm"):
            shm.remove_stale_segments()
        assert os.path.exists(path)  # not ours: left alone
        assert f"stale sweep skips {path}: not a regular file of uid {os.getuid()} (uid 12345" in caplog.text
    finally:
        os.unlink(path)


_NEW_SENDER = """
    import logging, os, sys
    logging.basicConfig(level=logging.WARNING)
    from refitkit.transfer import BucketedWeightSender  # imported as root: the interpreter may be root's only
    os.setgid({uid}); os.setuid({uid})  # a sender that drops privileges after import sweeps as that uid
    BucketedWeightSender("ep", timeout_s=1).close()
    print("sender made")
"""


@needs_root
def test_a_new_sender_starts_despite_another_uids_file_with_its_prefix():
    # Another local user (root here) made /dev/shm/refitkit-<uid>-...: the sweep of a sender running
    # as <uid> used to die with a bare PermissionError (sticky /dev/shm: not its file to unlink).
    planted = f"{shm.SHM_DIR}/refitkit-{NOBODY}-{DEAD_PID}-bad"
    with open(planted, "wb") as handle:
        handle.write(b"\0" * 64)
    sockets = tempfile.mkdtemp(prefix="rk-nobody-")  # in /tmp: reachable for that user
    os.chown(sockets, NOBODY, NOBODY)
    try:
        run = run_script(_NEW_SENDER.format(uid=NOBODY), env={"REFITKIT_SOCKET_DIR": sockets}, timeout_s=60)
        assert run.returncode == 0 and "sender made" in run.stdout, run.stderr[-2000:]
        assert f"stale sweep skips {planted}: not a regular file of uid {NOBODY} (uid 0" in run.stderr
        assert os.path.exists(planted)
    finally:
        os.unlink(planted)
        shutil.rmtree(sockets)


# -- item 11: a same-uid peer that truncates ------------------------------------------------------

_SCRIBBLE = """
    import json, os, sys
    handle = json.loads(sys.argv[1])
    where = handle.get("path") or "/proc/{pid}/fd/{fd}".format(**handle["memfd"])
    fd = os.open(where, os.O_RDWR)
    results = []
    for size in (2 * handle["nbytes"], 0):  # grow, then shrink: SIGBUS for whoever touches the lost pages
        try:
            os.ftruncate(fd, size)
            results.append("truncated")
        except OSError as exc:
            results.append(exc.strerror)
    print(json.dumps(results))
"""

_OWNER = """
    import json, subprocess, sys
    from refitkit.transfer._ipc import shm
    bucket = shm.ShmBucket(1 << 20, session="5e55", peer_pidns=shm.pid_namespace())
    peer = subprocess.run([sys.executable, "-c", sys.argv[1], json.dumps(bucket.handle())], capture_output=True, text=True)
    seen = {"bucket": json.loads(peer.stdout)}
    bucket.tensor.fill_(7)  # every page of the bucket: a truncated segment raises SIGBUS here
    seen["sum"] = int(bucket.tensor.sum())
    bucket.free()
    print(json.dumps(seen))
"""


def test_a_same_uid_peer_cannot_truncate_the_bucket():
    # The bucket is a sealed memfd (sender and peer share a PID namespace): the peer's ftruncate fails, and the
    # owner writes every page afterwards without SIGBUS.
    if shm.pid_namespace() is None:
        pytest.skip("no memfd / PID namespace identity here: named segments (see the shm docstring)")
    run = run_script(_OWNER, textwrap.dedent(_SCRIBBLE))
    assert run.returncode == 0, f"the owner died (rc {run.returncode}, -7 is SIGBUS): {run.stderr[-2000:]}"
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen["bucket"] == ["Operation not permitted", "Operation not permitted"]
    assert seen["sum"] == 7 << 20


def test_receiver_refuses_an_unsealed_memfd():
    # A hostile sender that hands out a memfd it could still shrink under the receiver.
    name = f"{shm.segment_prefix()}{os.getpid()}-feed"
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, 4096)
        handle = {"memfd": {"pid": os.getpid(), "fd": fd, "pidns": shm.pid_namespace()}, "name": name, "nbytes": 4096}
        if shm.pid_namespace() is None:
            pytest.skip("no memfd / PID namespace identity here")
        with pytest.raises(ProtocolError, match=f"not the sealed memfd '{name}'"):
            shm.open_segment(handle, what="shm bucket")
    finally:
        os.close(fd)


def test_a_truncated_named_segment_is_refused_before_it_is_mapped():
    # The named fallback's window: a peer truncates between creation and the receiver's open; the
    # receiver checks the size and refuses instead of mapping pages that are gone.
    segment = shm.Segment(8192, name="7e11")
    try:
        os.truncate(segment.path, 0)
        with pytest.raises(ProtocolError, match="with 8192 bytes .*0 bytes"):
            shm.open_segment(segment.handle(), what="shm bucket")
    finally:
        segment.unlink()
        segment.mapping.close()


# -- both kinds of segment carry a session ------------------------------------------------------


def test_named_segments_round_trip_when_the_receiver_asks_for_them(endpoint, monkeypatch):
    # REFITKIT_NAMED_SEGMENTS=1 in the receiver's environment: its hello offers no PID namespace,
    # so the bucket is a named file in /dev/shm, unlinked once mapped.
    import multiprocessing as mp

    import torch

    from refitkit.transfer import BucketedWeightSender
    from tests.transfer.peers import digest, one_shot_receiver_main

    monkeypatch.setenv(shm.NAMED_SEGMENTS_ENV, "1")
    assert shm.pid_namespace() is None
    named = shm.Segment(4096, name="abc")
    assert named.path is not None and named.handle() == {"path": named.path, "nbytes": 4096}
    named.unlink()
    named.mapping.close()
    weights = [(f"w{i}", torch.randn(3000 + i, generator=torch.Generator().manual_seed(i))) for i in range(20)]
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    receiver = ctx.Process(target=one_shot_receiver_main, args=(endpoint, "cpu", 20, "collect", None, child))
    receiver.start()  # inherits the environment variable
    with BucketedWeightSender(endpoint, bucket_bytes=64 << 10, transport="shm", timeout_s=20) as sender:
        stats = sender.send(item for item in weights)
    assert parent.poll(60) and parent.recv() == "starting"
    assert parent.poll(60)
    result = parent.recv()
    receiver.join(30)
    assert result["digests"] == {name: digest(tensor) for name, tensor in weights} and stats.buckets > 3
    assert result["segments_after"] == [] and own_names() == []
