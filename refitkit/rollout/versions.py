"""Which weights an inference engine serves: the version of its last whole sync, and what each sync covered.

Every sync carries a version (an int the trainer picks, e.g. its step). A worker's weights are
*clean* when the last sync that touched them delivered every weight the engine loads; they are
*incomplete* after a sync that failed part-way (some tensors were loaded, then the stream broke)
or that delivered only some of the engine's weights (a partial push: vLLM rebuilds every layer it
got anything for, so a layer with only some of its tensors holds garbage in the others). An
incomplete state names the version of the offending sync and stays until a later sync is whole.

Coverage is by name, per sync: the Hugging Face names the engine's checkpoint holds (the names
its loader takes; ``expected``) against the distinct names the sync delivered. Syncs do not add
up: two half pushes leave the engine incomplete, because each one rebuilt the layers it touched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from refitkit.transfer.common import WeightVersion

MISSING_SHOWN = 8  # names listed in messages; the count is always exact


@dataclass(frozen=True)
class SyncCoverage:
    """What one sync delivered: ``received`` distinct names, of ``expected`` the engine loads (None: unknown),
    and the ``missing`` expected names it did not deliver (all of them, sorted)."""

    received: int
    expected: int | None
    missing: tuple[str, ...]

    @property
    def complete(self) -> bool:
        """Every weight the engine loads arrived (always True when the engine's names are unknown)."""
        return not self.missing

    def describe(self) -> str:
        if self.expected is None:
            return f"{self.received} weights (the engine's own names are unknown)"
        shown = ", ".join(repr(name) for name in self.missing[:MISSING_SHOWN])
        more = f" and {len(self.missing) - MISSING_SHOWN} more" if len(self.missing) > MISSING_SHOWN else ""
        return f"{self.expected - len(self.missing)} of the {self.expected} weights the engine loads (missing {shown}{more})"


def coverage_of(received: set[str], expected: frozenset[str] | None) -> SyncCoverage:
    """The coverage of a sync that delivered the names ``received`` into an engine that loads ``expected``."""
    if expected is None:
        return SyncCoverage(received=len(received), expected=None, missing=())
    return SyncCoverage(received=len(received), expected=len(expected), missing=tuple(sorted(expected - received)))


class EngineWeights:
    """One worker's weight state: a ``WeightVersion`` and the last sync's coverage; changed only by its two events."""

    def __init__(self) -> None:
        self.version = WeightVersion()
        self.coverage: SyncCoverage | None = None
        self.failure: tuple[int, SyncCoverage | None] | None = (
            None  # the last sync, when it failed after touching weights
        )

    def next_version(self) -> int:
        """The version a sync gets when the caller names none: one above every version seen so far."""
        seen = [number for number in (self.version.version, self.version.incomplete) if number is not None]
        return max(seen) + 1 if seen else 0

    def landed(self, version: int, coverage: SyncCoverage) -> None:
        """A sync's stream arrived whole: clean at ``version`` if it covered every weight, else incomplete."""
        self.coverage, self.failure = coverage, None
        if coverage.complete:
            self.version = WeightVersion(version, None)
        else:
            self.version = WeightVersion(self.version.version, version)

    def failed(self, version: int, *, touched: bool, handed: SyncCoverage | None = None) -> None:
        """A sync failed; ``touched``: it had handed at least one tensor to the loader (the weights are now a mix);
        ``handed``: what it had handed over by then (None: unknown), reported as ``failed`` until a sync lands."""
        self.failure = None
        if touched:
            self.version = WeightVersion(self.version.version, version)
            self.failure = (version, handed)

    def as_dict(self) -> dict[str, Any]:
        """Plain values for ``collective_rpc`` (see ``weight_version_of``)."""
        coverage = self.coverage
        return {
            "version": self.version.version,
            "incomplete": self.version.incomplete,
            "clean": self.version.clean,
            "received": None if coverage is None else coverage.received,
            "expected": None if coverage is None else coverage.expected,
            "missing": [] if coverage is None else list(coverage.missing),
            "failed": None if self.failure is None else _failed_sync(*self.failure),
        }


def _failed_sync(version: int, handed: SyncCoverage | None) -> dict[str, Any]:
    """A sync that failed after it touched the weights, as plain values: its version and what it had handed over."""
    if handed is None:
        return {"version": version, "received": None, "expected": None, "missing": []}
    return {
        "version": version,
        "received": handed.received,
        "expected": handed.expected,
        "missing": list(handed.missing),
    }


def weight_version_of(state: dict[str, Any]) -> WeightVersion:
    """The ``WeightVersion`` in a worker's ``refit_weight_version()`` answer."""
    return WeightVersion(state["version"], state["incomplete"])
