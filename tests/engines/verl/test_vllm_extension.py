"""The worker extension verl's vLLM server gets with refitkit on: verl's and refitkit's in one class, mixed into vLLM's
GPU worker without a clash (vLLM asserts none, ``vllm/v1/worker/worker_base.py`` ``init_worker``). Needs GPU vLLM and
verl in one Python (the GPU machine with both kits); skipped elsewhere."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.cuda


def test_the_combined_extension_mixes_into_vllms_worker() -> None:
    pytest.importorskip("vllm")
    from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension
    from vllm.v1.worker.gpu_worker import Worker

    from refitkit.integrations.verl.colocated import VLLM_EXTENSION
    from refitkit.integrations.verl.vllm import VerlRefitWorkerExtension
    from refitkit.rollout.vllm import RefitWorkerExtension

    cls = VerlRefitWorkerExtension
    assert f"{cls.__module__}.{cls.__qualname__}" == VLLM_EXTENSION
    assert cls.__mro__[1:3] == (vLLMColocateWorkerExtension, RefitWorkerExtension)
    # what vLLM checks before it appends the class to the worker's bases: no attribute of the worker's overridden
    clashes = [name for name in dir(cls) if not name.startswith("__") and hasattr(Worker, name)]
    assert clashes == []
    # verl's server calls monkey_patch_model at start; refitkit's manager calls refit_receive every step
    for method in ("monkey_patch_model", "update_weights_from_ipc", "refit_receive", "refit_fingerprints"):
        assert callable(getattr(cls, method)), method
