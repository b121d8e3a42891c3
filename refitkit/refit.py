"""The refit cycle for one trainer rank: sync weights, offload, flush, barrier; later reload."""

from __future__ import annotations

import datetime
import logging
import time
from typing import TYPE_CHECKING, Any, Callable


from refitkit.errors import BarrierTimeout
from refitkit.offload import flush_device
from refitkit.report import PhaseRecord, RefitReport

if TYPE_CHECKING:
    from refitkit.engines.base import EngineAdapter
    from refitkit.transfer import BucketedWeightSender

logger = logging.getLogger(__name__)


def bounded_barrier(group: Any = None, *, timeout_s: float, phase: str = "refit") -> float:
    """Barrier over ``group`` that gives up after ``timeout_s`` with ``BarrierTimeout``; returns seconds waited.

    A no-op without an initialised process group (single-process runs).
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 0.0
    start = time.perf_counter()
    work = dist.barrier(group=group, async_op=True)
    try:
        completed = work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as exc:  # gloo and NCCL report a timed-out wait as RuntimeError
        raise BarrierTimeout(
            f"barrier after {phase} timed out after {timeout_s:.1f} s on rank {dist.get_rank()}: "
            f"some rank did not arrive (raise barrier_timeout_s if it is only slow): {exc}"
        ) from exc
    if completed is False:
        raise BarrierTimeout(
            f"barrier after {phase} did not complete within {timeout_s:.1f} s on rank {dist.get_rank()}; "
            "raise barrier_timeout_s if a rank is only slow"
        )
    return time.perf_counter() - start


class RefitCycle:
    """Runs the refit cycle for one adapter and (on the sending rank) one sender.

    ``refit(step)``: stream ``adapter.named_weights()`` through ``sender`` (ranks without a sender
    still iterate, since gathering full weights is a collective), offload the adapter, flush the
    device, and line up all ranks. ``resume(step)``: reload the adapter. Each returns a
    ``RefitReport``. It calls ``adapter.offload()`` / ``reload()``, never the ambiguous ``to()``.
    """

    def __init__(
        self,
        adapter: "EngineAdapter",
        sender: "BucketedWeightSender | None" = None,
        *,
        group: Any = None,
        barrier_timeout_s: float = 300.0,
        on_phase: Callable[[str], None] | None = None,
    ) -> None:
        self.adapter = adapter
        self.sender = sender
        self.group = group
        self.barrier_timeout_s = barrier_timeout_s
        self.on_phase = on_phase  # e.g. RSSWatchdog.mark, to sample at every phase boundary

    def _rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def refit(self, step: int) -> RefitReport:
        """Sync weights, offload everything, flush the device, barrier."""
        records: list[PhaseRecord] = []
        origin = time.perf_counter()
        records.append(self._timed("sync_weights", origin, self._sync_weights))
        records.append(self._timed("offload", origin, lambda: self.adapter.offload().total.bytes))
        records.append(self._timed("flush_device", origin, flush_device))
        records.append(self._timed("barrier", origin, lambda: self._barrier("offload")))
        return RefitReport(step=step, rank=self._rank(), phases=tuple(records))

    def resume(self, step: int) -> RefitReport:
        """Bring the training state back to the device."""
        origin = time.perf_counter()
        record = self._timed("reload", origin, lambda: self.adapter.reload().total.bytes)
        return RefitReport(step=step, rank=self._rank(), phases=(record,))

    def _sync_weights(self) -> int:
        weights = self.adapter.named_weights()
        if self.sender is None:
            for _ in weights:  # take part in the gathers; another rank sends
                pass
            return 0
        return self.sender.send(weights).bytes

    def _barrier(self, phase: str) -> None:
        bounded_barrier(self.group, timeout_s=self.barrier_timeout_s, phase=phase)

    def _timed(self, name: str, origin: float, fn: Callable[[], int | None]) -> PhaseRecord:
        start = time.perf_counter()
        moved = fn() or 0
        end = time.perf_counter()
        if self.on_phase is not None:
            self.on_phase(name)
        logger.debug("refit phase %s: %.3f ms, %d bytes", name, (end - start) * 1e3, moved)
        return PhaseRecord(name=name, start_s=start - origin, seconds=end - start, bytes=moved)


__all__ = ["RefitCycle", "bounded_barrier"]
