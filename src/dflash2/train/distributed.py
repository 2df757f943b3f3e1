"""Data-parallel training under ``torchrun``: which process this is, and the few collectives used.

``torchrun --nproc_per_node N -m dflash2.cli train-drafter ...`` starts N processes with
``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` set; each answers and trains on its share of the prompts,
gradients are averaged by ``DistributedDataParallel`` (NCCL on CUDA, gloo on the CPU) and the first
process writes checkpoints and the export. Without ``torchrun`` everything is one process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Group:
    """This process's place among the training processes (``world == 1``: no ``torchrun``)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    started: bool = False  # whether ``join`` started the process group (and ``leave`` ends it)

    @property
    def main(self) -> bool:
        """The process that writes checkpoints, exports and shows progress."""
        return self.rank == 0

    def device(self, requested: str) -> str:
        """``requested``, pinned to this process's own GPU under ``torchrun`` on CUDA."""
        if self.world > 1 and requested in ("auto", "cuda") and torch.cuda.is_available():
            return f"cuda:{self.local_rank}"
        return requested

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (on the training device) summed over the processes, in place."""
        if self.world > 1:
            dist.all_reduce(tensor)
        return tensor


def join(device: str) -> Group:
    """This process's ``Group``; under ``torchrun`` the process group is started (once)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Group()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if dist.is_initialized():  # the caller's own process group
        return Group(rank, world, local_rank)
    cuda = device in ("auto", "cuda") and torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl" if cuda else "gloo")
    return Group(rank, world, local_rank, started=True)


def leave(group: Group) -> None:
    """End the process group if ``join`` started it."""
    if group.started and dist.is_initialized():
        dist.destroy_process_group()
