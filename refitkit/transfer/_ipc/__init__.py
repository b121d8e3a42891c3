"""The bucketed wing: one host, ZMQ control frames and a double-buffered bucket in CUDA IPC or shared
memory (``sender``, ``receiver``; ``cuda_ipc`` and ``shm`` hold the bucket, ``handoff`` the hand-offs,
``endpoint`` the sockets). Private: the API is ``refitkit.transfer``."""
