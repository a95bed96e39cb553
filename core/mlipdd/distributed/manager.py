"""Process-group lifecycle: from torchrun / SLURM environment or explicit arguments."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from mlipdd.comm import default_backend, free_port, group_rank, group_size, rank_device


def _env_int(*names: str, default: int | None = None) -> int | None:
    for name in names:
        if os.environ.get(name):
            return int(os.environ[name])
    return default


def _slurm_master() -> str:
    nodes = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST") or "localhost"
    # first host of a list such as "gpu[012-015],gpu020" -> gpu012
    head = nodes.split(",")[0]
    if "[" in head:
        prefix, rest = head.split("[", 1)
        head = prefix + rest.split("-")[0].split(",")[0].rstrip("]")
    return head


# How long a rank waits in a collective (and at start-up, for the others to join) before
# the run fails. A few MD steps take far less, so a suspended, wedged or dead rank is
# reported within minutes instead of torch's 10-30 min; rank 0 alone reads the structure
# and writes checkpoints while the others wait, which is what the margin is for. Raise it
# for systems whose file reading or checkpoint writing takes minutes.
DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0


class DistributedManager:
    """Owns (or adopts) the default process group and picks this rank's device.

    NCCL when CUDA is used, gloo on CPU. A group created here is destroyed by
    `cleanup`; one that already existed (made by the caller) is left alone. ``timeout_s``:
    the collective timeout (`DEFAULT_COLLECTIVE_TIMEOUT_S`).
    """

    def __init__(self, backend: str | None = None, device: str | torch.device | None = None,
                 rank: int | None = None, world_size: int | None = None,
                 timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S):
        self._owns_group = False
        if not dist.is_initialized():
            rank = rank if rank is not None else _env_int("RANK", "SLURM_PROCID", default=0)
            world_size = world_size if world_size is not None else _env_int("WORLD_SIZE", "SLURM_NTASKS", default=1)
            os.environ.setdefault("MASTER_ADDR", _slurm_master() if "SLURM_PROCID" in os.environ else "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29531" if "SLURM_JOB_ID" in os.environ else str(free_port()) if world_size == 1 else "29500")
            use_cuda = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
            backend = backend or default_backend(use_cuda)
            dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
            self._owns_group = True
        self.rank = group_rank()
        self.world_size = group_size()
        self.backend = dist.get_backend()
        self.local_rank = _env_int("LOCAL_RANK", "SLURM_LOCALID", default=self.rank % max(1, torch.cuda.device_count() or 1))
        if device is None:
            device = rank_device(self.backend, self.local_rank)
        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    @property
    def group(self):
        return dist.group.WORLD

    def cleanup(self) -> None:
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_group = False

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.cleanup()


