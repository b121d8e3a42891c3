"""The inference-engine side of a refit: what runs in (or drives) the engine that serves rollouts.

- ``refitkit.rollout.vllm``: ``RefitWorkerExtension`` (mixed into vLLM's workers with
  ``worker_extension_cls="refitkit.rollout.vllm.RefitWorkerExtension"``), ``push_weights`` (same
  host: ZMQ + CUDA IPC / shm) and ``push_weights_broadcast`` (other GPUs or nodes), and the weight
  version each worker serves (``weight_versions``, ``clean_weight_version``).
- ``refitkit.rollout.sglang``: the same for an ``sglang.Engine`` (refitkit's ``sglang.srt.plugins`` entry
  point hooks its schedulers): ``push_weights``, ``push_weights_broadcast``, ``engine_state`` (GPU-tested with SGLang 0.5.17).
- ``refitkit.rollout.links``: the engine side of a ``RefitCycle`` as one object with ``send(weights)``:
  ``VllmLink`` (a vLLM ``LLM`` fed over IPC or broadcast), ``SglangLink`` (an ``sglang.Engine``, likewise)
  and ``BroadcastLink`` (bare broadcast receivers). Both engines' pushes and links take the same knobs
  (``reset_prefix_cache``, ``sleep_level``, ...) and return one ``PushStats``; their shared core is ``_push``.
- ``refitkit.rollout.versions``: weight versions and sync coverage.

Nothing here imports vLLM or SGLang until one of their internals is needed (inside the engine's processes).
"""

from refitkit.rollout._push import PushStats
from refitkit.rollout.links import BroadcastLink, EngineMemory, SglangLink, VllmLink
from refitkit.rollout.sglang import SglangPushStats
from refitkit.rollout.versions import EngineWeights, SyncCoverage
from refitkit.rollout.vllm import (
    EXTENSION_QUALNAME,
    RefitWorkerExtension,
    VllmPushStats,
    clean_weight_version,
    push_weights,
    push_weights_broadcast,
    tensor_fingerprint,
    tensor_sha256,
    weight_versions,
)
from refitkit.transfer import WeightVersion

__all__ = [
    "EXTENSION_QUALNAME",
    "BroadcastLink",
    "EngineMemory",
    "EngineWeights",
    "PushStats",
    "RefitWorkerExtension",
    "SglangLink",
    "SglangPushStats",
    "SyncCoverage",
    "VllmLink",
    "VllmPushStats",
    "WeightVersion",
    "clean_weight_version",
    "push_weights",
    "push_weights_broadcast",
    "tensor_fingerprint",
    "tensor_sha256",
    "weight_versions",
]
