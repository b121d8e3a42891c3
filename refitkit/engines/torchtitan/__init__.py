"""TorchTitan adapter (``pip install 'refitkit[torchtitan]'``); torchtitan is imported on first use."""

from refitkit.engines.torchtitan.adapter import TorchTitanAdapter

__all__ = ["TorchTitanAdapter"]
