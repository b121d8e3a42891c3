"""megatron-core support: the six offload / load functions Megatron RL trainers call, and MegatronAdapter.

Needs ``pip install 'refitkit[megatron]'`` (megatron-core 0.16 on Python 3.11, 0.19 on 3.12);
megatron is imported only when one of these is called. The functions keep one pinned
``HostArena`` per model chunk / leaf optimizer between calls (``arena_of`` shows it).
"""

from refitkit.engines.megatron._arenas import arena_of
from refitkit.engines.megatron.adapter import MegatronAdapter
from refitkit.engines.megatron.model import load_megatron_model_to_gpu, offload_megatron_model_to_cpu
from refitkit.engines.megatron.optimizer import (
    load_megatron_copy_params,
    load_megatron_optimizer,
    offload_megatron_copy_params,
    offload_megatron_optimizer,
)
from refitkit.engines.megatron.weights import is_stream_source

__all__ = [
    "MegatronAdapter",
    "arena_of",
    "is_stream_source",
    "load_megatron_copy_params",
    "load_megatron_model_to_gpu",
    "load_megatron_optimizer",
    "offload_megatron_copy_params",
    "offload_megatron_model_to_cpu",
    "offload_megatron_optimizer",
]
