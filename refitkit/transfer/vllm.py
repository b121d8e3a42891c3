"""Deprecated: the vLLM integration moved to ``refitkit.rollout.vllm``; this module re-exports it.

``worker_extension_cls="refitkit.transfer.vllm.RefitWorkerExtension"`` keeps working (it is the
same class); use ``"refitkit.rollout.vllm.RefitWorkerExtension"`` in new code.
"""

import warnings

from refitkit.rollout.vllm import (
    EXTENSION_QUALNAME, RPC_SLACK_S, RefitWorkerExtension, VllmPushStats, clean_weight_version, push_weights,
    push_weights_broadcast, tensor_sha256, weight_versions,
)  # fmt: skip

# Once per process: a module body runs once, however often it is imported.
warnings.warn(
    "refitkit.transfer.vllm moved to refitkit.rollout.vllm; import from there "
    "(worker_extension_cls='refitkit.rollout.vllm.RefitWorkerExtension')",
    DeprecationWarning, stacklevel=2,
)  # fmt: skip

__all__ = [
    "EXTENSION_QUALNAME", "RPC_SLACK_S", "RefitWorkerExtension", "VllmPushStats", "clean_weight_version",
    "push_weights", "push_weights_broadcast", "tensor_sha256", "weight_versions",
]
