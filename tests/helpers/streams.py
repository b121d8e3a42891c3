"""Taking an adapter's weight stream for a test: each name once, then a pass under the cycle audit."""

from __future__ import annotations

from typing import Any

import torch


def stream_twice(adapter: Any) -> tuple[dict[str, torch.Tensor], Any]:
    """Clones of one ``named_weights()`` pass (AssertionError on a name streamed twice), and the
    ``CycleAudit`` report of a second pass (its reference cycles: a GC-free gather makes none)."""
    from refitkit.watchdog import CycleAudit

    streamed: dict[str, torch.Tensor] = {}
    for name, tensor in adapter.named_weights():
        if name in streamed:
            raise AssertionError(f"{name} streamed twice")
        streamed[name] = tensor.clone()
    with CycleAudit() as audit:
        for _ in adapter.named_weights():
            pass
    return streamed, audit.report
