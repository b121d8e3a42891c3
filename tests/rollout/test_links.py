"""RefitCycle drives bare broadcast receivers through a BroadcastLink: each refit is one versioned session."""

from __future__ import annotations

import pytest
import torch

from refitkit.engines.fsdp import FSDPAdapter
from refitkit.errors import InvalidInput
from refitkit.refit import RefitCycle
from refitkit.rollout import BroadcastLink
from refitkit.transfer import BroadcastWeightSender, BucketedWeightSender
from tests.helpers.ports import free_port
from tests.transfer.broadcast_peers import ReceiverProcess
from tests.transfer.peers import digest

pytestmark = pytest.mark.timeout(240)

SECRET = "links-secret-0123456789abcdef"
TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def receiver():
    peer = ReceiverProcess()
    yield peer
    assert peer.close() == 0


def test_each_refit_is_one_broadcast_session_with_the_next_version(receiver):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rendezvous = f"tcp://127.0.0.1:{free_port()}"
    with BroadcastWeightSender(
        rendezvous, secret=SECRET, receivers=1, bucket_bytes=1 << 14, timeout_s=TIMEOUT_S
    ) as sender:
        link = BroadcastLink(sender, first_version=10)
        with RefitCycle(FSDPAdapter(model, optimizer), link) as cycle:
            for step in range(2):
                model(torch.randn(4, 64)).square().mean().backward()
                optimizer.step()
                optimizer.zero_grad()
                # digest a copy: numpy() on a live parameter makes its storage non-resizable (then it cannot be offloaded)
                expected = {name: digest(param.detach().clone()) for name, param in model.named_parameters()}
                receiver.start(rendezvous, SECRET, 1, timeout_s=TIMEOUT_S)
                report = cycle.refit(step)
                error, _, _, got, version = receiver.result()
                assert error is None
                assert got == expected  # bit-exact, every tensor
                assert version == (10 + step, None)  # the link's version for this refit, landed whole
                assert report.phase("sync_weights").bytes == sum(param.nbytes for param in model.parameters())
                cycle.resume(step)
    assert link.next_version == 12


def test_links_refuse_the_wrong_sender():
    with BucketedWeightSender("links-wrong", transport="shm", timeout_s=TIMEOUT_S) as sender:
        with pytest.raises(
            InvalidInput, match="BroadcastLink: sender must be a BroadcastWeightSender, got a BucketedWeightSender"
        ):
            BroadcastLink(sender)
    with BroadcastWeightSender(
        f"tcp://127.0.0.1:{free_port()}", secret=SECRET, receivers=1, timeout_s=TIMEOUT_S
    ) as sender:
        with pytest.raises(InvalidInput, match=r"version=-1; need an int >= 0"):
            BroadcastLink(sender, first_version=-1)
