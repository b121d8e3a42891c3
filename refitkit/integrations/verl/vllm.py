"""The vLLM worker extension for refitkit inside verl's colocated vLLM rollout: verl's own extension and refitkit's.

verl 0.9.1's vLLM server starts its engine with ``worker_extension_cls`` set to verl's
``vLLMColocateWorkerExtension`` and then spreads ``rollout.engine_kwargs.vllm`` over its arguments
(``verl/workers/rollout/vllm_rollout/vllm_async_server.py``, ``launch_server``), so one key replaces the class::

    +actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls=refitkit.integrations.verl.vllm.VerlRefitWorkerExtension

vLLM mixes the named class into every worker (``vllm/v1/worker/worker_base.py``, ``init_worker``). verl still needs
its own methods there (the server calls ``monkey_patch_model`` on every worker when it starts, and its ``__new__`` sets
up LoRA, FP8 and the death signal), and refitkit's manager calls ``refit_receive`` through the server's
``collective_rpc``: this class has both. Imported only inside vLLM's worker processes (it needs vLLM and verl); its
name is ``refitkit.integrations.verl.colocated.VLLM_EXTENSION``, which the manager checks the config for.
"""

from __future__ import annotations

from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension

from refitkit.rollout.vllm import RefitWorkerExtension


class VerlRefitWorkerExtension(vLLMColocateWorkerExtension, RefitWorkerExtension):
    """verl's ``vLLMColocateWorkerExtension`` (its ``__new__`` and rpcs) with refitkit's ``refit_*`` rpcs."""


__all__ = ["VerlRefitWorkerExtension"]
