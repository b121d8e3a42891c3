"""Early copies for an adapter: per set of parts moved through the arena, the plan of their last move
(``refitkit.offload.early``), so a steady offload or reload starts copying before it lists its tensors."""

from __future__ import annotations

from collections.abc import Iterable

from refitkit.offload.arena import HostArena
from refitkit.offload.early import RoundPlan


class EarlyCopies:
    """``EngineAdapter``'s round plans (a mixin: the arena and the packing knob are the adapter's)."""

    arena: HostArena
    pack_below_bytes: int

    def _round_plan(self, parts: Iterable[str]) -> RoundPlan | None:
        """The plan of the last move of exactly these parts (made empty the first time); None with packing,
        whose runs are planned per round."""
        key = tuple(sorted(parts))
        if not key or self.pack_below_bytes:
            return None
        plans: dict[tuple[str, ...], RoundPlan] = self.__dict__.setdefault("_round_plans", {})
        plan = plans.get(key)
        if plan is None:
            plan = plans[key] = RoundPlan()
        return plan
