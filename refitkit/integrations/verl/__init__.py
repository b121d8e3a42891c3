"""refitkit inside verl 0.9.1, selected by configuration: this package is the one module a verl config names.

- ``checkpoint_engine``: ``RefitkitCheckpointEngine``, the ``checkpoint_engine.backend=refitkit`` backend (needs no
  verl to import).
- ``colocated``: ``RefitkitCheckpointManager`` (``checkpoint_manager_class``), ``RefitkitFSDPEngine`` and, where
  megatron-core is installed, ``RefitkitMegatronEngine`` (engine vendor ``refitkit``); they subclass verl's classes, so
  they load only with verl installed.
- ``vllm``: ``VerlRefitWorkerExtension``, the worker extension verl's vLLM rollout is started with.

Importing this package with verl installed registers the backend and the engine (``custom_backend_module`` and
``model.external_lib`` name it); without verl it still imports, and the colocated classes raise verl's
``ModuleNotFoundError`` when asked for. See docs/verl.md.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from refitkit.integrations.verl.checkpoint_engine import BACKEND, KNOBS, RefitkitCheckpointEngine, Role


def register() -> None:
    """Register ``RefitkitCheckpointEngine`` in verl's ``CheckpointEngineRegistry`` as ``"refitkit"``, and
    ``RefitkitFSDPEngine`` (and ``RefitkitMegatronEngine``) in its ``EngineRegistry`` under the vendor ``refitkit``
    (idempotent; done when this package is imported with verl installed, which is what ``custom_backend_module`` and
    ``model.external_lib`` do)."""
    from verl.checkpoint_engine import CheckpointEngineRegistry  # verl is optional: only here

    CheckpointEngineRegistry.register(BACKEND)(RefitkitCheckpointEngine)
    # registers the engine when loaded (a plain import: it may be the module whose import loads this package)
    import refitkit.integrations.verl.colocated  # noqa: F401


def __getattr__(name: str) -> Any:
    # the colocated loop's classes subclass verl's: loaded on first use (checkpoint_manager_class names one)
    if name in ("RefitkitCheckpointManager", "RefitkitFSDPEngine", "RefitkitMegatronEngine"):
        from refitkit.integrations.verl import colocated

        found = getattr(colocated, name)
        if found is None:
            raise ImportError(
                f"{name} subclasses verl's Megatron engine, which needs megatron-core: pip install megatron-core"
            )
        return found
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if importlib.util.find_spec("verl") is not None:
    register()

__all__ = ["BACKEND", "KNOBS", "RefitkitCheckpointEngine", "Role", "register"]
