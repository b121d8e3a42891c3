"""refitkit inside other frameworks' own loops, through their plug-in points (each module imports its framework
lazily: ``import refitkit`` never needs one).

- ``verl``: a checkpoint-engine backend for verl 0.9.1 (``checkpoint_engine.backend=refitkit``), see docs/verl.md.
"""
