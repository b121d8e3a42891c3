"""FSDP2 (``torch.distributed.fsdp.fully_shard``) adapter; also works for a plain ``nn.Module``."""

from refitkit.engines.fsdp.adapter import FSDPAdapter, clean_fqn

__all__ = ["FSDPAdapter", "clean_fqn"]
