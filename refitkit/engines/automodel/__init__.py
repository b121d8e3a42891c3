"""NeMo Automodel adapter (extra ``automodel``): offload, reload and weight streaming for its trainers."""

from refitkit.engines.automodel.adapter import AutomodelAdapter

__all__ = ["AutomodelAdapter"]
