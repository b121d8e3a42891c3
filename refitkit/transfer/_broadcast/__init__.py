"""The broadcast wing: the same streams to engines on other GPUs or nodes over a torch.distributed
broadcast (gloo or NCCL), on a group kept across syncs (``group``: rendezvous, admission by the job's
secret). Private: the API is ``refitkit.transfer``."""
