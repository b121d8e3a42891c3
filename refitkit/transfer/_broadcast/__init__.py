"""The broadcast wing: the same streams to engines on other GPUs or nodes over a torch.distributed
broadcast (gloo or NCCL), a group formed per session (``group``: rendezvous, admission by the job's
secret). Private: the API is ``refitkit.transfer``."""
