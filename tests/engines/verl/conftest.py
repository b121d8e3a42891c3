"""The verl suite runs in .venv-verl (make test-verl): verl 0.9.1 as released, on CPU torch."""

from __future__ import annotations

import importlib.util
import os
import tempfile

# Set before any peer starts, so the spawned trainer and rollout processes find each other's sockets.
os.environ.setdefault("REFITKIT_SOCKET_DIR", tempfile.mkdtemp(prefix="rk-sock-"))

if importlib.util.find_spec("verl") is None:  # the core venv: these tests run in .venv-verl
    collect_ignore_glob = ["test_*.py"]
