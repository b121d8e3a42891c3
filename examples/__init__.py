"""Runnable examples; ``tiny_llama`` is shared with the engine tests."""
